"""``run``: a quick check from the shell that an installed release generates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, print_json


def register(app: typer.Typer, panel: str) -> None:
    app.command("run", rich_help_panel=panel)(run)


def run(
    path: Annotated[Path, typer.Argument(help="DEST/MODEL (follows current) or a release dir.")],
    prompt_ids: Annotated[str, typer.Option("--prompt-ids", help="Token ids, e.g. 1,2,3.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 8,
    compare_hf: Annotated[
        Path | None,
        typer.Option(
            "--compare-hf",
            help="The Hugging Face checkpoint the release was compiled "
            "from: print its greedy tokens beside, exit 1 if they differ.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Greedy-generate from one prompt of token ids with the nearest compiled bucket."""
    from pipeline.errors import InputError
    from pipeline.runtime import BucketedModel

    try:
        prompt = [int(t) for t in prompt_ids.replace(" ", "").split(",") if t]
    except ValueError:
        raise InputError(
            "--prompt-ids",
            f"'{prompt_ids}' is not a list of integers",
            "use comma-separated token ids, e.g. 1,2,3",
        ) from None
    model = BucketedModel.load(path)
    # With a reference to compare against, run every step (EOS included) as it does.
    eos = None if compare_hf else -1
    new = model.generate([prompt], max_new_tokens, eos_token_id=eos)[0]
    bucket = model.select(1, len(prompt) + max_new_tokens - 1)
    result = {
        "prompt": prompt,
        "new_tokens": new,
        "bucket": bucket.name,
        "version": model.manifest.version,
    }
    if compare_hf:
        from pipeline.parity import Reference

        ref = Reference(model.dir, model.manifest, "cpu", compare_hf, "--compare-hf")
        result["hf_tokens"] = ref.greedy(prompt, max_new_tokens - 1)[0]
        result["match"] = result["hf_tokens"] == new
    if json:
        print_json(result)
    else:
        typer.echo(f"bucket {bucket.name} ({model.manifest.backend}): {','.join(map(str, new))}")
        if compare_hf:
            typer.echo(
                f"Hugging Face eager:     {','.join(map(str, result['hf_tokens']))}"
                f"  ({'identical' if result['match'] else 'DIFFERENT'})"
            )
    if compare_hf and not result["match"]:
        raise typer.Exit(1)
