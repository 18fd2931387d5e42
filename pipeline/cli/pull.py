"""``pull``: install a release for serving (the EKS init-container's command).

Exit codes, for Kubernetes: 0 installed; 1 retriable failure (network, throttling, store
errors: let the pod restart the init container); 2 bad input (unknown model, version or
channel, malformed manifest: restarting will not help).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, StoreOpt, human_bytes, print_json


def register(app: typer.Typer) -> None:
    app.command("pull")(pull)


def pull(
    model: Annotated[str, typer.Argument(help="Model name, as in the release config.")],
    dest: Annotated[Path, typer.Option("--dest", help="Install root: DEST/MODEL/VERSION.")],
    version: Annotated[str | None, typer.Option("--version", help="Release version.")] = None,
    channel: Annotated[str | None, typer.Option("--channel", help="Channel, e.g. prod.")] = None,
    store: StoreOpt = None,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="Parallel range GETs.")] = 16,
    json: JsonOpt = False,
) -> None:
    """Download a release (parallel ranged GETs, sha256-verified) and install it atomically."""
    from pipeline.install.pull import pull_release
    from pipeline.store import open_store

    result = pull_release(
        open_store(store),
        model,
        dest,
        version=version,
        channel=channel,
        concurrency=concurrency,
    )
    if json:
        print_json(result.to_dict())
    elif result.already_installed:
        typer.echo(f"{model} {result.version} already installed at {result.path}")
    else:
        rate = result.downloaded_bytes / max(result.seconds, 1e-9)
        typer.echo(
            f"installed {model} {result.version} at {result.path}: {result.files} files, "
            f"{human_bytes(result.downloaded_bytes)} downloaded ({human_bytes(rate)}/s), "
            f"{human_bytes(result.reused_bytes)} reused"
        )
