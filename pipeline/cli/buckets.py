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
    from pipeline.plan.config import load_grid

    buckets = load_grid(grid).buckets()
    if json:
        print_json([{"name": b.name, "batch": b.batch, "seq": b.seq} for b in buckets])
    else:
        typer.echo("\n".join(b.name for b in buckets))


@app.command("fit")
def fit(
    trace: Annotated[Path, typer.Argument(metavar="TRACE.csv", help="Request log (CSV).")],
    column: Annotated[str, typer.Option("--column", help="Column of token counts.")],
    plus_column: Annotated[
        str | None,
        typer.Option("--plus-column", help="Add this column to each length (e.g. generated)."),
    ] = None,
    max_buckets: Annotated[
        int | None, typer.Option("--max-buckets", min=1, help="Fit at most K buckets.")
    ] = None,
    target_efficiency: Annotated[
        float | None,
        typer.Option("--target-efficiency", help="Or: the fewest buckets reaching E (0–1]."),
    ] = None,
    multiple_of: Annotated[
        int, typer.Option("--multiple-of", min=1, help="Bucket lengths are multiples of M.")
    ] = 1,
    max_len: Annotated[
        int | None,
        typer.Option("--max-len", min=1, help="Reject (and count) longer requests."),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write a grid file here.")] = None,
    batch_sizes: Annotated[
        str, typer.Option("--batch-sizes", help="Batch sizes of the --out grid, e.g. 1,4,8.")
    ] = "1",
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a CDF plot (PNG).")] = None,
    prefill_buckets: Annotated[
        int | None,
        typer.Option(
            "--prefill-buckets",
            min=0,
            help="Also fit K prefill lengths to --column alone (the prompts); default 3 with "
            "--plus-column, else 0.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Fit sequence-length buckets to a request trace (exactly optimal), against baselines."""
    from pipeline.errors import InputError
    from pipeline.plan.buckets import write_grid
    from pipeline.plan.fit import fit as fit_buckets
    from pipeline.plan.fit import fit_prefill_lengths, grid_comment, to_grid
    from pipeline.plan.traces import read_lengths

    if (max_buckets is None) == (target_efficiency is None):
        raise InputError(
            "buckets fit",
            "give exactly one of --max-buckets and --target-efficiency",
            "e.g. --max-buckets 8",
        )
    sizes = _int_list("--batch-sizes", batch_sizes)
    lengths = read_lengths(trace, column, plus_column)
    result = fit_buckets(
        lengths,
        max_buckets=max_buckets,
        target_efficiency=target_efficiency,
        multiple_of=multiple_of,
        max_len=max_len,
    )
    source = f"{trace.name} ({column}{' + ' + plus_column if plus_column else ''})"
    k = prefill_buckets if prefill_buckets is not None else (3 if plus_column else 0)
    prefill: tuple[list[int], float] | None = None
    if k:
        prompts = read_lengths(trace, column)
        prefill = fit_prefill_lengths(prompts, lengths, result.buckets, k, multiple_of)
    if out is not None:
        comment = grid_comment(result, source)
        if prefill:
            comment += f"\nPrefill lengths fitted to {column}: prompts {prefill[1]:.1%} efficient."
        write_grid(to_grid(result, sizes, prefill[0] if prefill else ()), out, comment=comment)
    if plot is not None:
        from pipeline.plan.fit_plot import plot_fit

        plot_fit(result, lengths, plot, title=source)
    if json:
        data = result.to_dict()
        if prefill:
            data["prefill"] = {"lengths": prefill[0], "efficiency": prefill[1]}
        print_json(data)
        return
    _print_fit(result, source, out, plot)
    if prefill:
        alone = fit_prefill_lengths(read_lengths(trace, column), lengths, result.buckets, 0)
        typer.echo(
            f"prefill lengths (fitted to {column}): {prefill[0]}; prompt efficiency "
            f"{prefill[1]:.1%} (each bucket's own length only: {alone[1]:.1%})"
        )


def _int_list(option: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        from pipeline.errors import InputError

        raise InputError(
            option, f"'{text}' is not a comma-separated list of integers", "e.g. 1,4,8"
        ) from None


def _print_fit(result, source: str, out: Path | None, plot: Path | None) -> None:
    typer.echo(
        f"{source}: {result.accepted} requests, {len(result.buckets)} buckets "
        f"(multiples of {result.multiple_of})"
    )
    if result.max_len is not None:
        typer.echo(f"rejected: {result.rejected} longer than --max-len {result.max_len}")
    typer.echo(f"{'bucket':>8} {'requests':>9} {'padding':>8}")
    for u in result.uses:
        typer.echo(f"{u.seq:>8} {u.requests / result.accepted:>9.1%} {u.padding_share:>8.1%}")
    typer.echo(f"efficiency: {result.efficiency:.1%}")
    for name, s in result.baselines.items():
        ratio = f"fitted ×{result.efficiency / s.efficiency:.2f}" if s.efficiency else "—"
        typer.echo(f"  vs {name} {list(s.buckets)}: {s.efficiency:.1%} ({ratio})")
    for what, path in (("grid", out), ("plot", plot)):
        if path is not None:
            typer.echo(f"wrote {what}: {path}")
