"""``gqa``: plan (and apply) head padding for a tensor-parallel degree."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, human_bytes, new_app, print_json

app = new_app("Plan and apply GQA head padding for tensor parallelism.")


@app.command("plan")
def plan(
    heads: Annotated[int, typer.Option("--heads", help="Query heads.")],
    kv_heads: Annotated[int, typer.Option("--kv-heads", help="Key/value heads.")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")],
    strategy: Annotated[
        str, typer.Option(help="auto, replicate_to_tp_degree or convert_to_mha.")
    ] = "auto",
    head_dim: Annotated[int | None, typer.Option("--head-dim", min=1)] = None,
    layers: Annotated[int | None, typer.Option("--layers", min=1)] = None,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32 (KV-cache bytes).")] = "bf16",
    json: JsonOpt = False,
) -> None:
    """Plan query/KV head padding so each rank holds whole heads (NxD Inference rules)."""
    from pipeline.errors import InputError
    from pipeline.plan.config import DTYPE_ALIASES, DTYPE_BYTES
    from pipeline.plan.gqa import plan_gqa

    if strategy not in ("auto", "replicate_to_tp_degree", "convert_to_mha"):
        raise InputError(
            "--strategy",
            f"unknown strategy '{strategy}'",
            "use auto, replicate_to_tp_degree or convert_to_mha",
        )
    dt = DTYPE_ALIASES.get(dtype, dtype)
    if dt not in DTYPE_BYTES:
        raise InputError("--dtype", f"unknown dtype '{dtype}'", "use bf16, fp16 or fp32")
    p = plan_gqa(
        heads, kv_heads, tp, strategy, head_dim=head_dim, layers=layers, dtype_bytes=DTYPE_BYTES[dt]
    )
    if json:
        print_json(p.to_dict())
        return
    typer.echo(f"strategy: {p.strategy}")
    typer.echo(
        f"heads: {p.q_heads}/{p.kv_heads} → {p.padded_q_heads}/{p.padded_kv_heads} "
        f"(KV replication ×{p.kv_replication}, q padding {p.q_padding})"
    )
    typer.echo(f"per rank: {p.q_heads_per_rank} query, {p.kv_heads_per_rank} KV heads")
    typer.echo(f"wasted attention compute: {p.wasted_attention_fraction:.1%}")
    if p.kv_cache_bytes_per_token is not None:
        typer.echo(f"KV cache per token (all ranks): {human_bytes(p.kv_cache_bytes_per_token)}")


@app.command("pad")
def pad(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory.")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the padded checkpoint.")],
    strategy: Annotated[
        str, typer.Option(help="auto, replicate_to_tp_degree or convert_to_mha.")
    ] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT_DIR.")] = False,
    json: JsonOpt = False,
) -> None:
    """Write a copy of a checkpoint with heads padded so each rank holds whole heads."""
    from pipeline.compile.gqa_pad import pad_checkpoint

    p = pad_checkpoint(model_dir, out, tp, strategy, overwrite=overwrite)
    if json:
        print_json({"out": str(out), "plan": p.to_dict()})
        return
    typer.echo(
        f"wrote {out}: heads {p.q_heads}/{p.kv_heads} → {p.padded_q_heads}/{p.padded_kv_heads} "
        f"for tp {p.tp} ({p.strategy}, wasted attention compute {p.wasted_attention_fraction:.1%})"
    )
