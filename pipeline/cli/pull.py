"""``pull``: install a release for serving (the EKS init-container's command).

Exit codes, for Kubernetes: 0 installed; 1 retriable failure (network, throttling, store
errors: let the pod restart the init container); 2 bad input (unknown model, version or
channel, malformed manifest: restarting will not help).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pipeline._files import path_error, within
from pipeline.cli._common import JsonOpt, StoreOpt, TrustOpt, human_bytes, print_json, startup_heap
from pipeline.errors import InputError, PipelineError

Verify = Literal["parts", "full"]


def register(app: typer.Typer, panel: str) -> None:
    app.command("pull", rich_help_panel=panel)(pull)


def pull(
    model: Annotated[str, typer.Argument(help="Model name, as in the release config.")],
    dest: Annotated[Path, typer.Option("--dest", help="Install root: DEST/MODEL/VERSION.")],
    version: Annotated[str | None, typer.Option("--version", help="Release version.")] = None,
    channel: Annotated[str | None, typer.Option("--channel", help="Channel, e.g. prod.")] = None,
    store: StoreOpt = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=256,
            help="Ranged GETs in flight (default: 4 per available CPU, 8 to 32; 8 to 144 "
            "where every range is streamed: https on the pull's own GETs, part digests).",
            show_default=False,
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Worker processes the ranges are shared out to, --concurrency ranges in "
            "flight across them (default: over https one per available CPU, 2 to 16: a "
            "TLS read takes the GIL back every 16 KiB; else 1).",
            show_default=False,
        ),
    ] = None,
    part_size: Annotated[
        str,
        typer.Option(
            "--part-size",
            help="Bytes per ranged GET, e.g. 16MiB (rounded to whole manifest parts). "
            "Memory in flight is about concurrency x part size (over https, where a range "
            "with part digests is streamed, about concurrency x 1 MiB).",
        ),
    ] = "16MiB",
    verify: Annotated[
        Verify,
        typer.Option(
            "--verify",
            help="parts: every part against its sha256 as it lands (and whole-file sha256 "
            "where free); full: also re-read and check every file's whole sha256.",
        ),
    ] = "parts",
    trust: TrustOpt = None,
    json: JsonOpt = False,
) -> None:
    """Download a release (files and ranges in parallel, every part sha256-verified as it
    lands) and install it atomically."""
    with startup_heap():  # imports and the store's client: kept to the end
        from pipeline.install.pull import pull_release
        from pipeline.store import open_store
        from pipeline.store.signing import load_trust

        keys = load_trust(trust)
        source = open_store(store)
    size = parse_size(part_size, "--part-size")
    try:
        result = pull_release(
            source,
            model,
            dest,
            version=version,
            channel=channel,
            concurrency=concurrency,
            processes=processes,
            part_size=size,
            verify=verify,
            trust=keys,
        )
    except OSError as e:
        # Name --dest, not the staging directory or temporary file under it where it failed.
        raise path_error(e, dest, "--dest") from e
    except PipelineError as e:
        # A failed write while landing bytes (a full disk) names the model's directory under
        # --dest: exit 1 as it is, about --dest as the user typed it.
        if type(e) is PipelineError and "://" not in e.what and within(Path(e.what), dest):
            raise PipelineError(f"--dest {dest}", e.why, e.hint) from e
        raise
    if keys is None:
        typer.echo("note: not verifying signatures (no --trust given)", err=True)
    if json:
        print_json(result.to_dict())
        return
    if keys is not None:
        typer.echo(f"verified: {model} {result.version} signed by key {result.signed_by[:16]}")
    if result.already_installed:
        typer.echo(f"{model} {result.version} already installed at {result.path}")
    else:
        by = f" by {result.processes} processes" if result.processes > 1 else ""
        typer.echo(
            f"installed {model} {result.version} at {result.path}: {result.files} files, "
            f"{human_bytes(result.downloaded_bytes)} downloaded in {result.parts} parts{by} "
            f"({result.seconds:.1f} s, {human_bytes(result.throughput)}/s), "
            f"{human_bytes(result.reused_bytes)} reused; re-fetched "
            f"{result.refetched_parts} parts, {result.refetched_files} files"
        )


SIZE_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


MIN_SIZE, MAX_SIZE = 1 << 16, 1 << 30  # each thread holds one range in memory


def parse_size(text: str, option: str) -> int:
    """``16MiB``, ``1048576``, ``512KiB`` -> bytes; from 64 KiB to 1 GiB."""
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits) :]
    ok = digits.isascii() and digits.isdigit() and unit in SIZE_UNITS
    if not ok or not MIN_SIZE <= int(digits) * SIZE_UNITS[unit] <= MAX_SIZE:
        raise InputError(
            f"{option} {text}",
            "not a size from 64 KiB to 1 GiB",
            "write e.g. 16MiB or 8388608",
        )
    return int(digits) * SIZE_UNITS[unit]
