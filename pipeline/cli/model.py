"""``tiny-model``: write the small random-weight checkpoint used by the demo and tests."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer, panel: str) -> None:
    app.command("tiny-model", rich_help_panel=panel)(tiny_model)


def tiny_model(
    out: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    arch: Annotated[str, typer.Option(help="llama, mistral or qwen2.")] = "llama",
    layers: Annotated[int, typer.Option(min=1)] = 2,
    hidden: Annotated[int, typer.Option(min=1)] = 64,
    heads: Annotated[int, typer.Option(min=1)] = 8,
    kv_heads: Annotated[int, typer.Option("--kv-heads", min=1)] = 2,
    vocab: Annotated[int, typer.Option(min=1)] = 512,
    seed: int = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty DIR.")] = False,
) -> None:
    """Write a deterministic random-weight Hugging Face checkpoint (GQA Llama by default).

    For tests and demos: at most 100M parameters (400 MB of fp32 weights).
    """
    from pipeline.tiny_model import write_tiny_model

    path = write_tiny_model(
        out,
        arch=arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        seed=seed,
        overwrite=overwrite,
    )
    typer.echo(f"wrote {arch} checkpoint to {path}")
