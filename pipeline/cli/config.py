"""``validate`` and ``plan``: fast answers about a release config before any compiling."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, human_bytes, print_json

ConfigArg = Annotated[Path, typer.Argument(help="Release config (configs/<model>.yaml).")]


def register(app: typer.Typer, panel: str) -> None:
    app.command("validate", rich_help_panel=panel)(validate)
    app.command("plan", rich_help_panel=panel)(plan)


def validate(config: ConfigArg, json: JsonOpt = False) -> None:
    """Check a release config and its bucket grid; exit 2 with file:line on the first error."""
    from pipeline.plan.config import load_config

    release = load_config(config)
    if json:
        print_json(
            {"valid": True, "model": release.name, "buckets": [b.name for b in release.buckets]}
        )
    else:
        typer.echo(f"{config}: ok ({release.name}, {len(release.buckets)} buckets)")


def plan(config: ConfigArg, json: JsonOpt = False) -> None:
    """Report the bucket grid, GQA padding and HBM per NeuronCore for a release config."""
    from pipeline.plan.config import load_config
    from pipeline.plan.report import plan_release

    p = plan_release(load_config(config))
    if json:
        print_json(p.to_dict())
        return
    # here, not at the top: every command imports this module, and rich's console and table
    # cost the pull's cold path (the init container's) ~26 ms on the 2-core VM
    from rich.console import Console
    from rich.table import Table

    g, out = p.gqa, Console()
    out.print(
        f"[bold]{p.release.name}[/] on {p.instance.name} "
        f"({p.instance.cores} NeuronCores, {human_bytes(p.instance.hbm_per_core)} HBM each), "
        f"tp={g.tp}, dtype={p.release.config.model.dtype}"
    )
    out.print(
        f"GQA: {g.q_heads}/{g.kv_heads} heads → {g.padded_q_heads}/{g.padded_kv_heads} "
        f"({g.strategy}, q padding {g.q_padding}), per rank {g.q_heads_per_rank}/"
        f"{g.kv_heads_per_rank}, wasted attention {g.wasted_attention_fraction:.1%}, "
        f"KV cache {human_bytes(g.kv_cache_bytes_per_token or 0)}/token"
    )
    out.print(f"weights per NeuronCore: {human_bytes(p.weight_bytes_per_core)}")
    table = Table(
        "bucket", "batch", "seq", "prefills", "mixed", "KV cache/core", "total/core", "fits"
    )
    for m in p.buckets:
        table.add_row(
            m.bucket.name,
            str(m.bucket.batch),
            str(m.bucket.seq),
            ",".join(map(str, p.prefill_lengths(m.bucket))),
            ",".join(map(str, p.mixed_lengths(m.bucket))) or "-",
            human_bytes(m.kv_cache_bytes),
            human_bytes(m.total_bytes),
            "yes" if m.fits else "[red]NO[/]",
        )
    out.print(table)
    r = p.resident
    copies = "a weights copy each" if r.weights_per_bucket else "sharing one weights copy"
    out.print(
        f"all {len(p.buckets)} buckets resident together ({copies}): "
        f"{human_bytes(r.total_bytes)} per NeuronCore of {human_bytes(p.instance.hbm_per_core)}"
        f" ({'fits' if r.fits else 'does not fit'}); the runtime keeps at most "
        f"{r.max_loaded} of {len(p.buckets)} loaded at once, the least recently used unloaded"
    )
    if p.tp_options:
        opts = ", ".join(
            f"tp={o.tp} ({o.wasted_attention_fraction:.1%} wasted)" for o in p.tp_options[:5]
        )
        out.print(f"tp degrees that fit every bucket, least padding first: {opts}")
    else:
        out.print("[red]no tp degree on this instance fits every bucket[/]")
    if not p.all_fit:
        bad = ", ".join(m.bucket.name for m in p.buckets if not m.fits)
        typer.echo(
            f"error: {config}: buckets do not fit in HBM: {bad} "
            "(drop them, raise tp_degree or use a larger instance)",
            err=True,
        )
        raise typer.Exit(2)
