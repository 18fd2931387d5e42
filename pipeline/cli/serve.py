"""``serve``: the pod's server container (``pipeline.server``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    path: Annotated[Path, typer.Argument(help="DEST/MODEL (follows current) or a release dir.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    max_wait_ms: Annotated[
        float,
        typer.Option("--max-wait-ms", min=0, help="How long a request waits for others to batch."),
    ] = 5.0,
    max_queue: Annotated[
        int,
        typer.Option("--max-queue", min=1, help="Requests waiting to be batched; more get 503."),
    ] = 256,
) -> None:
    """Serve the release over HTTP (OpenAI /v1/completions), batching requests into buckets."""
    from pipeline.errors import InputError
    from pipeline.install.installed import open_installed

    try:
        from pipeline.server.app import ServeOptions
        from pipeline.server.app import serve as run
    except ImportError as e:
        raise InputError(
            "serve",
            f"the server's packages are not installed ({e.name})",
            "pip install 'inf2-pipeline[serve]'",
        ) from None
    open_installed(path, verify="size")  # a wrong path fails now, in one line, before binding
    run(ServeOptions(path, host, port, max_wait_ms, max_queue))
