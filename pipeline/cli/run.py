"""``run``: a quick check from the shell that an installed release generates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, print_json


def register(app: typer.Typer) -> None:
    app.command("run")(run)


def run(
    path: Annotated[Path, typer.Argument(help="DEST/MODEL (follows current) or a release dir.")],
    prompt_ids: Annotated[str, typer.Option("--prompt-ids", help="Token ids, e.g. 1,2,3.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 8,
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
    new = model.generate([prompt], max_new_tokens)[0]
    bucket = model.select(1, len(prompt) + max_new_tokens - 1)
    if json:
        print_json(
            {
                "prompt": prompt,
                "new_tokens": new,
                "bucket": bucket.name,
                "version": model.manifest.version,
            }
        )
    else:
        typer.echo(f"bucket {bucket.name}: {','.join(map(str, new))}")
