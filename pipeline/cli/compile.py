"""``compile`` (and ``release``: compile, then publish): thin commands over compile.scheduler."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import JsonOpt, SignOpt, StoreOpt, print_json, sigterm_unwinds

BackendOpt = Annotated[
    str | None,
    typer.Option(
        "--backend", help="auto, neuron, cuda or cpu (default: the config's target.backend)."
    ),
]
JobsOpt = Annotated[int, typer.Option("--jobs", "-j", min=1, help="Buckets compiled at once.")]
WorkdirOpt = Annotated[
    Path | None,
    typer.Option("--workdir", help="Logs and outputs (default: work/compile/<model>)."),
]


def register(app: typer.Typer, panel: str) -> None:
    app.command("compile", rich_help_panel=panel)(compile_)
    app.command("release", rich_help_panel=panel)(release)


def compile_(
    config: Annotated[Path, typer.Argument(help="Release config (configs/*.yaml).")],
    backend: BackendOpt = None,
    jobs: JobsOpt = 1,
    shard: Annotated[
        str | None, typer.Option("--shard", help="Compile shard I of N (0-based): I/N.")
    ] = None,
    shard_count: Annotated[
        int | None,
        typer.Option(
            "--shard-count",
            min=1,
            help="N shards; this one's index comes from JOB_COMPLETION_INDEX (Indexed Jobs).",
        ),
    ] = None,
    workdir: WorkdirOpt = None,
    store: StoreOpt = None,
    download: Annotated[
        bool, typer.Option("--download", help="Also fetch cache hits into the workdir.")
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Compile every bucket that is not in the cache; a summary table, or --json."""
    from pipeline.compile.shards import parse_shard
    from pipeline.plan.config import load_config

    release = load_config(config)
    index, count = _shard(shard, shard_count, parse_shard)
    report = _compile(release, backend, jobs, (index, count), workdir, store, download, json)
    if json:
        print_json(report.to_dict())
    _raise_if_failed(report)


def release(
    config: Annotated[Path, typer.Argument(help="Release config (configs/*.yaml).")],
    backend: BackendOpt = None,
    jobs: JobsOpt = 1,
    workdir: WorkdirOpt = None,
    store: StoreOpt = None,
    version: Annotated[
        str | None, typer.Option("--version", help="Default: UTC date + content digest.")
    ] = None,
    sign: SignOpt = None,
    json: JsonOpt = False,
) -> None:
    """Compile every bucket (cache hits are free), then publish the release."""
    from pipeline.compile.release import publish_release
    from pipeline.contracts.store_layout import check_version
    from pipeline.plan.config import load_config
    from pipeline.store.signing import open_signer

    if version is not None:  # publish would refuse it, but only after the whole compile
        check_version(version)
    signer = open_signer(sign) if sign else None  # a bad key fails before the compile
    rel = load_config(config)
    if store:  # one store for both: the cache compile fills is the one publish reads
        rel = replace(rel, config=rel.config.model_copy(update={"store": store}))
    report = _compile(rel, backend, jobs, (0, 1), workdir, None, False, json)
    if report.failed:
        if json:
            print_json({"compile": report.to_dict(), "publish": None})
        _raise_if_failed(report)
    result = publish_release(rel, version=version, backend=report.backend, signer=signer)
    if json:
        print_json({"compile": report.to_dict(), "publish": result.to_dict()})
    else:
        state = "published" if result.created else "already published"
        signed = f", signed by key {result.signed_by[:16]}" if result.signed_by else ""
        typer.echo(
            f"{state} {result.model} {result.version} to {result.store} "
            f"({report.compiled} of {len(report.results)} buckets compiled, weights "
            f"{_weights_word(report)}; {result.uploaded_files} files, "
            f"{result.uploaded_bytes} bytes uploaded{signed})"
        )


def _weights_word(report) -> str:
    w = report.weights
    return "in the graphs" if w is None else {"cached": "hit"}.get(w.status, w.status)


def _compile(release, backend, jobs, shard, workdir, store, download, json):
    from rich.console import Console

    from pipeline.compile.progress import make_progress, summary_table
    from pipeline.compile.scheduler import compile_release

    # SIGTERM (a pod or CI job stopped) stops the workers as Ctrl-C does: exit 143.
    with sigterm_unwinds(), make_progress(_shard_size(release, shard)) as progress:
        report = compile_release(
            release,
            backend=backend,
            jobs=jobs,
            shard=shard,
            workdir=workdir,
            store=store,
            download=download,
            on_event=progress,
        )
    if not json:
        Console().print(summary_table(report))
    return report


def _shard_size(release, shard: tuple[int, int]) -> int:
    from pipeline.compile.shards import shard as pick

    return len(pick(release.buckets, *shard))


def _shard(shard: str | None, count: int | None, parse) -> tuple[int, int]:
    from pipeline.errors import InputError

    if shard is not None and count is not None:
        raise InputError("--shard and --shard-count", "give one, not both", None)
    if shard is not None:
        return parse(shard)
    if count is None:
        return 0, 1
    index = os.environ.get("JOB_COMPLETION_INDEX")
    if index is None or not index.strip().isdigit():
        raise InputError(
            f"--shard-count {count}",
            f"JOB_COMPLETION_INDEX is {'unset' if index is None else repr(index)}",
            "run as a Kubernetes Indexed Job, or pass --shard I/N",
        )
    return parse(f"{index.strip()}/{count}")


def _raise_if_failed(report) -> None:
    from pipeline.errors import CompileError

    failed = report.failed
    if not failed:
        return
    names = ", ".join(
        f"{r.bucket.name} ({r.status if r.status != 'cached' else 'weights ' + r.weights_status})"
        for r in failed
    )
    raise CompileError(
        f"compile {report.model}",
        f"{len(failed)} of {len(report.results)} buckets failed: {names}",
        f"logs in {report.workdir / 'logs'}",
        failed=[r.bucket.name for r in failed],
    )
