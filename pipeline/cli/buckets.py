"""``buckets``: inspect bucket grids (and fit them to traffic)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, new_app, print_json

app = new_app("Inspect bucket grids and fit them to real traffic.")


@app.command("show")
def show(
    grid: Annotated[Path, typer.Argument(help="Grid file (buckets/*.yaml).")], json: JsonOpt = False
) -> None:
    """List the buckets of a grid file."""
    from pipeline.config import load_grid

    buckets = load_grid(grid).buckets()
    if json:
        print_json([{"name": b.name, "batch": b.batch, "seq": b.seq} for b in buckets])
    else:
        typer.echo("\n".join(b.name for b in buckets))
