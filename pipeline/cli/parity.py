"""``parity``: a compiled release against the eager Hugging Face model, per bucket."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, print_json


def register(app: typer.Typer, panel: str) -> None:
    app.command("parity", rich_help_panel=panel)(parity)


def parity(
    path: Annotated[Path, typer.Argument(help="A release directory, or DEST/MODEL (current).")],
    reference: Annotated[
        str, typer.Option("--reference", help="Where the reference runs: auto, cpu or cuda.")
    ] = "auto",
    steps: Annotated[int, typer.Option("--steps", help="Decode steps per prompt.")] = 8,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts.")] = 0,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="The Hugging Face checkpoint the release was compiled from (its weights "
            "digest must match); default: rebuild the reference from the release's weights.",
        ),
    ] = None,
    bucket: Annotated[
        list[str] | None, typer.Option("--bucket", help="Only this bucket (repeatable).")
    ] = None,
    cuda_graphs: Annotated[
        bool, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Replay decode as CUDA graphs.")
    ] = True,
    report: Annotated[
        Path | None, typer.Option("--report", help="Write the report as Markdown to this file.")
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Check every bucket of a release against the eager Hugging Face model; exit 1 on a
    bucket outside the tolerances of the release's dtype."""
    from pipeline.parity import BucketParity, check_release

    def progress(b: BucketParity) -> None:
        if not json:
            verdict = "pass" if b.passed else "FAIL: " + "; ".join(b.failures)
            typer.echo(
                f"{b.bucket}: max abs {b.max_abs:.3g}, max rel {b.max_rel:.3g}, "
                f"top-1 {b.top1:.1%}, greedy exact {b.greedy_exact:.1%}: {verdict}"
            )

    result = check_release(
        path,
        reference=reference,
        steps=steps,
        seed=seed,
        checkpoint=checkpoint,
        buckets=bucket or (),
        cuda_graphs=cuda_graphs,
        on_bucket=progress,
    )
    if report is not None:
        result.write_markdown(report)
    if json:
        print_json(result.to_dict())
    else:
        passed = sum(b.passed for b in result.buckets)
        tol = result.tolerance
        typer.echo(
            f"{'PASS' if result.passed else 'FAIL'}: {passed}/{len(result.buckets)} buckets "
            f"within the {result.tolerance_dtype} tolerances (max rel {tol.max_rel:g}, "
            f"top-1 ≥ {tol.min_top1:.0%}); reference on {result.reference['device']}"
            + (f"; report: {report}" if report else "")
        )
    if not result.passed:
        raise typer.Exit(1)
