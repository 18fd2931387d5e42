"""``serve``: the pod's server container (``pipeline.server``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli._common import TrustOpt


def register(app: typer.Typer, panel: str) -> None:
    app.command("serve", rich_help_panel=panel)(serve)


def serve(
    path: Annotated[Path, typer.Argument(help="DEST/MODEL (follows current) or a release dir.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    max_queue: Annotated[
        int,
        typer.Option("--max-queue", min=1, help="Requests waiting for a slot; more get 503."),
    ] = 256,
    max_prefills: Annotated[
        int,
        typer.Option(
            "--max-prefills",
            min=1,
            help="Requests admitted per iteration (each prefill stalls the running rows).",
        ),
    ] = 4,
    prefill_stall: Annotated[
        str,
        typer.Option(
            "--prefill-stall",
            metavar="MS|auto|off",
            help="The prefill work an iteration may admit, by the start-up timings, within "
            "--max-prefills: admissions stop at the first prompt that would take the "
            "iteration's prefill calls past it (one always goes in), so a burst of short "
            "prompts goes in at once and long ones a few at a time. auto: ten of the slowest "
            "resident step; off: --max-prefills alone (the default).",
        ),
    ] = "off",
    admit_order: Annotated[
        str,
        typer.Option(
            "--admit-order",
            metavar="fcfs|shortest",
            help="The order waiting requests are admitted in: fcfs, as they came (the "
            "default); shortest: shortest prompt first, so an iteration's prefill stall "
            "admits more first tokens, and a request passed over once goes before every "
            "later one (none is overtaken in two iterations).",
        ),
    ] = "fcfs",
    spill: Annotated[
        bool,
        typer.Option(
            "--spill/--no-spill",
            help="When every slot of a request's own length is busy, take a free slot of a "
            "longer bucket rather than wait.",
        ),
    ] = True,
    overflow: Annotated[
        bool,
        typer.Option(
            "--overflow/--no-overflow",
            help="When the running buckets of a length are full, also open an idle bucket of "
            "smaller batch (more rows in flight, but one more step in every iteration).",
        ),
    ] = False,
    widest_from_idle: Annotated[
        bool,
        typer.Option(
            "--widest-from-idle/--no-widest-from-idle",
            help="When nothing of a length runs and several requests wait, open its widest "
            "idle bucket, not the smallest that holds them (a burst that grows then needs no "
            "second bucket stepping beside the first).",
        ),
    ] = False,
    prefill_merge: Annotated[
        str,
        typer.Option(
            "--prefill-merge",
            metavar="POSITIONS|auto",
            help="A prompt may share a prefill call at a longer prefill length of its bucket "
            "when that pads it by at most this many positions (one call's fixed cost saved; "
            "0: only prompts of one length share a call). auto: time each bucket's prefill "
            "calls at start-up and split each iteration's prompts into the calls that cost "
            "least (the default).",
        ),
    ] = "auto",
    fold_prompts: Annotated[
        str,
        typer.Option(
            "--fold-prompts",
            help="Prefill a prompt admitted into a running bucket inside that bucket's decode "
            "step (one pass over the weights for both; cpu/cuda buckets with mixed graphs): "
            "auto: where the start-up timings say it costs less than a prefill call and a "
            "step apart (the default); always; off.",
        ),
    ] = "auto",
    batching: Annotated[
        str,
        typer.Option(
            "--batching",
            help="iteration: requests join and leave running buckets at every step; static: "
            "a bucket admits only when all its rows are done (the old way, to compare).",
        ),
    ] = "iteration",
    chat_max_tokens: Annotated[
        int | None,
        typer.Option(
            "--chat-max-tokens",
            min=1,
            show_default=False,
            help="Tokens a chat answer may have when the request names no max_tokens "
            "(default: all the largest bucket holds after the prompt; a request needing fewer "
            "positions fits a shorter bucket).",
        ),
    ] = None,
    coalesce: Annotated[
        bool,
        typer.Option(
            "--coalesce/--no-coalesce",
            help="Send a stream's tokens that piled up while the event loop was busy in one "
            "event (less work per token under load; no token waits for it); "
            "--no-coalesce: one event per token, always.",
        ),
    ] = True,
    overlap: Annotated[
        bool,
        typer.Option(
            "--overlap/--no-overlap",
            help="Queue each iteration's steps on the device before reading the last one's "
            "tokens, so the device works while the host streams them (cpu/cuda releases).",
        ),
    ] = True,
    launch_lead: Annotated[
        str,
        typer.Option(
            "--launch-lead",
            metavar="MS|auto|off",
            help="With --overlap, hold each iteration's launch until the device's queued work "
            "is about to end (predicted from the start-up timings), this many milliseconds "
            "before it, so requests that arrive meanwhile join it. auto: adapt the lead to "
            "the host, from 0.5 ms (the default); off: launch as soon as the last tokens are "
            "read.",
        ),
    ] = "auto",
    engine_process: Annotated[
        bool,
        typer.Option(
            "--engine-process/--no-engine-process",
            help="Run the engine (the model, its scheduling) in a process of its own, so the "
            "HTTP side never holds the interpreter lock the device's host work needs; "
            "--no-engine-process: a thread of the server's process.",
        ),
    ] = True,
    http_workers: Annotated[
        str,
        typer.Option(
            "--http-workers",
            help="HTTP processes in front of the one engine, sharing the port: each streams "
            "its own clients' tokens, so the SSE writes of many streams use more than one "
            "core. Their metrics are summed at /metrics. auto: one per two usable CPUs, "
            "1 to 4 (1 on the cpu backend and with --no-engine-process).",
        ),
    ] = "auto",
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="INF2_SERVE_API_KEY",
            show_default=False,
            help="Require `Authorization: Bearer KEY` on /v1 routes (probes and /metrics stay "
            "open). Prefer the environment variable: a command line is visible in ps.",
        ),
    ] = None,
    trust: TrustOpt = None,
) -> None:
    """Serve the release over HTTP (OpenAI /v1/completions): requests join the buckets'
    slots at every step."""
    from pipeline.errors import InputError
    from pipeline.install.installed import open_installed

    if batching not in ("iteration", "static"):
        raise InputError(f"--batching {batching}", "unknown", "use iteration or static")
    merge = _prefill_merge(prefill_merge)
    lead = _milliseconds("--launch-lead", launch_lead, 50, "0.5")
    stall = _milliseconds("--prefill-stall", prefill_stall, 1000, "12")
    workers = _http_workers(http_workers)
    from pipeline.server.placement import ADMIT_ORDERS, FOLD

    if fold_prompts not in FOLD:
        raise InputError(f"--fold-prompts {fold_prompts}", "unknown", f"use {', '.join(FOLD)}")
    if admit_order not in ADMIT_ORDERS:
        raise InputError(
            f"--admit-order {admit_order}", "unknown", f"use {' or '.join(ADMIT_ORDERS)}"
        )
    if api_key is not None and not api_key.strip():
        raise InputError(
            "--api-key (or INF2_SERVE_API_KEY)",
            "is empty, so every client would need an empty key",
            "set a key, or leave both unset to serve without one",
        )
    try:
        from pipeline.server.launch import serve as run
        from pipeline.server.loading import ServeOptions
    except ImportError as e:
        raise InputError(
            "serve",
            f"the server's packages are not installed ({e.name})",
            "pip install 'inf2-pipeline[serve]'",
        ) from None
    from pipeline.store.signing import load_trust

    keys = load_trust(trust)
    # a wrong path or an unsigned release fails now, in one line, before binding
    installed = open_installed(path, verify="size", trust=keys)
    if workers is None:
        from pipeline.server.fronts import auto_count

        workers = auto_count(installed.manifest.backend, engine_process)
    run(
        ServeOptions(
            path,
            host=host,
            port=port,
            max_queue=max_queue,
            max_prefills=max_prefills,
            prefill_stall=stall,
            admit_order=admit_order,
            spill=spill,
            overflow=overflow,
            widest_from_idle=widest_from_idle,
            prefill_merge=merge,
            fold_prompts=fold_prompts,
            batching=batching,
            api_key=api_key,
            chat_max_tokens=chat_max_tokens,
            coalesce=coalesce,
            overlap=overlap,
            launch_lead=lead,
            engine_process=engine_process,
            http_workers=workers,
            trust=keys,
        )
    )


def _http_workers(value: str) -> int | None:
    """``--http-workers``: a count from 1, or None for "auto" (``fronts.auto_count``, once
    the release's backend is known)."""
    from pipeline.errors import InputError

    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise InputError(
            f"--http-workers {value}",
            "is not a count of processes",
            "use auto, or a whole number from 1, e.g. --http-workers 4",
        )
    return int(value)


def _milliseconds(flag: str, value: str, most: float, example: str) -> float | str:
    """A flag's value of "auto", "off", or milliseconds from 0 to ``most`` (as seconds)."""
    from pipeline.errors import InputError

    word = value.strip().lower()
    if word in ("auto", "off"):
        return word
    try:
        ms = float(word)
    except ValueError:
        ms = -1.0
    if not 0 <= ms <= most:
        raise InputError(
            f"{flag} {value}",
            f"is not auto, off or milliseconds from 0 to {most:g}",
            f"use e.g. {flag} {example}, or auto",
        )
    return ms / 1e3


def _prefill_merge(value: str) -> int | str:
    from pipeline.errors import InputError

    if value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise InputError(
            f"--prefill-merge {value}",
            "is neither auto nor a count of positions",
            "use auto or 0, 64, ...",
        )
    return n
