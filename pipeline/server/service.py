"""The server's state: the release, its tokenizer and the engine, made ready off the event
loop: in a process of its own by default (``pipeline.server.engine_process``), or in a thread
of this one (``--no-engine-process``), which then stays the one thread that runs the model.

Phases: loading → warming up → ready (→ draining); or failed, with the error ``/ready`` shows.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.install.installed import find_release
from pipeline.server.jobs import EngineFailed
from pipeline.server.loading import Loaded, ServeOptions, load_release, make_engine
from pipeline.server.metrics import STARTUP_PHASES, Metrics
from pipeline.server.tokenizer import load_tokenizer

log = logging.getLogger("inf2_pipeline.serve")


class Service:
    def __init__(self, options: ServeOptions, loader: Callable[[Path], Any] | None = None):
        self.options = options
        self.loader = loader or functools.partial(_load_model, trust=options.trust)
        self.metrics = Metrics(shared=options.http_workers > 1)
        self.phase = "loading"
        self.error: str | None = None
        self.failure: Exception | None = None
        self.release: Loaded | None = None
        self.tokenizer: Any = None
        self.name = ""
        self.vocab = 0
        # the engine (a thread's) or its handle (the engine's process): submit, cancel, close
        self.engine: Any = None
        self.process: Any = None  # pipeline.server.engine_process.EngineProcess
        # what the resident buckets' samplers honour: a request's seed, the largest top_k
        self.seeded = True
        self.max_topk = 0
        self.thread: threading.Thread | None = None
        self.handles: list[Any] = []  # one per front (HTTP process), until each takes its own
        self.quiet = False  # fronts after the first: the first alone logs the release ready
        self._fronts = 1
        self._fronts_ready: Any = None  # how many fronts are ready (shared by all of them)
        self._tokenizing: asyncio.Future | None = None  # the process's: its tokenizer loading
        self.on_failure: Callable[[], None] = lambda: None
        self._created = time.perf_counter()  # start-up's "total" counts from here
        # _early_tokenizer's, from start() (the engine in its own process)
        self._early: asyncio.Future[tuple[Path, Any, float] | None] | None = None

    @property
    def ready(self) -> bool:
        """This front takes requests."""
        return self.phase == "ready"

    @property
    def all_ready(self) -> bool:
        """Every front takes requests (``/ready``: a probe reaches any one of them)."""
        shared = self._fronts_ready
        return self.ready and (shared is None or shared.value >= self._fronts)

    def spawn(self, close: Sequence[socket.socket] = (), fronts: int = 1) -> None:
        """Start the engine's process now: forked before the event loop and its threads
        exist; it loads the release while the server starts listening. ``close``: what the
        engine must not hold (the listening socket); ``fronts``: the HTTP processes it will
        answer (``pipeline.server.fronts``), each then taking its own with ``front``."""
        from pipeline.server.engine_process import EngineProcess

        self.handles = EngineProcess.fork(
            self.options, self.loader, self, close=close, fronts=fronts
        )
        self.process = self.handles[0]
        if fronts > 1:
            self._fronts = fronts
            self._fronts_ready = multiprocessing.get_context("fork").Value("i", 0)

    def front(self, i: int) -> Service:
        """In front ``i``'s process: its own handle on the engine, the others' closed."""
        if self.handles:
            self.process = self.handles[i].only_this(self.handles)
            self.handles = []
        self.quiet = i > 0
        if i:  # this front's own metrics files from now, "not ready" in them until it is
            self.metrics.ready.set(0)
        return self

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.process is not None:
            self.engine = self.process.attach(loop, self.metrics)
            # The tokenizer loads while the engine's process loads the release (importing
            # transformers alone takes seconds), not after it. Not in the model thread's
            # process (--no-engine-process): two threads importing torch at once can fail.
            self._early = loop.run_in_executor(None, self._early_tokenizer)
            # loaded or not, the engine hears so: it times its calls after every front's
            # tokenizer, so that an import does not share the cores with those timings
            self._early.add_done_callback(lambda _: self.process.tokenizer_loaded())
            return
        self.thread = threading.Thread(
            target=self._main, args=(loop,), name="inf2-serve-model", daemon=True
        )
        self.thread.start()

    def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        """The model thread (``--no-engine-process``): load, then run the engine."""
        try:
            model, resident, loaded = load_release(self.options, self.loader, self.engine_phase)
            tokenizer = self._tokenizer(loaded, None)
            self.engine = make_engine(
                model, resident, self.options, loop, self.metrics, startup=loaded.startup
            )
        except Exception as e:
            self.load_failed(e)
            return
        self._ready(loaded, tokenizer)
        try:
            self.engine.run()
        except EngineFailed as e:  # every request it held was failed; the server stops
            self.engine_failed(str(e))

    # --- what the engine tells the server (its process: on the event loop) ----------------

    def engine_phase(self, phase: str) -> None:
        self.phase = phase

    def engine_ready(self, loaded: Loaded) -> None:
        """The engine is loaded and warm: the tokenizer (loaded beside the release, or now
        where the engine loaded another; off the loop either way), then ready."""

        async def tokenizer() -> None:
            try:
                early = await self._early if self._early is not None else None
                tok = await asyncio.to_thread(self._tokenizer, loaded, early)
            except Exception as e:
                self.load_failed(e)
                return
            if self.phase != "failed":
                self._ready(loaded, tok)

        self._tokenizing = asyncio.ensure_future(tokenizer())

    def _early_tokenizer(self) -> tuple[Path, Any, float] | None:
        """The release ``serve`` was given, found as the engine will find it, and its
        tokenizer loaded (or what loading it raised), with the seconds that took; None
        where no release is found there (the engine's load says why)."""
        try:
            release_dir = find_release(self.options.path)
        except Exception:
            return None
        start = time.perf_counter()
        try:
            tokenizer: Any = load_tokenizer(release_dir)
        except Exception as e:  # raised once the engine has loaded that release
            tokenizer = e
        return release_dir, tokenizer, time.perf_counter() - start

    @staticmethod
    def _tokenizer(loaded: Loaded, early: tuple[Path, Any, float] | None) -> Any:
        """``loaded``'s tokenizer: the one loaded early where it came from the release the
        engine loaded (``current`` may have moved in between), else loaded now."""
        if early is not None and early[0].resolve() == Path(loaded.dir).resolve():
            _, tokenizer, took = early
            loaded.startup["tokenizer"] = took
            if isinstance(tokenizer, Exception):
                raise tokenizer
            return tokenizer
        start = time.perf_counter()
        tokenizer = load_tokenizer(loaded.dir)
        loaded.startup["tokenizer"] = time.perf_counter() - start
        return tokenizer

    def engine_closing(self) -> None:
        """Another front began the drain (the engine takes no more): so does this one."""
        if self.phase == "ready":
            self.phase = "draining"
            self.metrics.ready.set(0)

    def load_failed(self, e: Exception, error: str | None = None) -> None:
        self.failure = e
        self.error = error or (
            e.one_line() if isinstance(e, PipelineError) else f"{type(e).__name__}: {e}"
        )
        self.phase = "failed"
        self.on_failure()

    def engine_failed(self, message: str, what: str = "the engine stopped") -> None:
        """The engine stopped (the device keeps failing, its process died), or another
        front's process did: every request it held was failed; the server stops."""
        self.failure, self.error = EngineFailed(message), f"EngineFailed: {message}"
        self.phase = "failed"
        self.metrics.ready.set(0)
        log.error("%s: %s", what, message)
        self.on_failure()

    def _ready(self, loaded: Loaded, tokenizer: Any) -> None:
        self.release, self.tokenizer = loaded, tokenizer
        self.name, self.vocab = loaded.name, loaded.vocab
        self.seeded, self.max_topk = loaded.seeded, loaded.max_topk
        # What loading made (the tokenizer, the graphs, torch's modules) lives as long as the
        # server: out of the collector's view, so a full collection while serving walks only
        # what requests made (a pause of ~100 ms otherwise, in the middle of streams).
        gc.collect()
        gc.freeze()
        self.phase = "ready"
        self.metrics.ready.set(1)
        if self._fronts_ready is not None:
            with self._fronts_ready.get_lock():
                self._fronts_ready.value += 1
        if self.quiet:
            return
        seconds = {**loaded.startup, "total": time.perf_counter() - self._created}
        for phase, took in seconds.items():
            self.metrics.startup.labels(phase=phase).set(took)
        names = ", ".join(b.name for b in loaded.buckets)
        where = "its own process" if self.process is not None else "a thread"
        if self.options.http_workers > 1:
            where += f", {self.options.http_workers} HTTP processes in front"
        # the tokenizer loads beside the others (on the front's side), so it stands apart
        phases = ", ".join(f"{p} {seconds[p]:.1f}" for p in STARTUP_PHASES[:-1] if p in seconds)
        if "tokenizer" in seconds:
            phases += f"; tokenizer {seconds['tokenizer']:.1f}"
        log.info(
            "ready: %s %s on %s (%s; engine in %s) in %.1f s (%s)",
            loaded.name,
            loaded.version,
            loaded.device,
            names,
            where,
            seconds["total"],
            phases,
        )
        if self.options.trust is None:
            log.warning("not verifying the release's signature (no --trust)")

    def drain(self) -> None:
        """Shutting down: take no new requests; finish the queued and running ones."""
        self.metrics.ready.set(0)
        if self.engine is not None:
            if self.phase != "failed":
                self.phase = "draining"
            self.engine.close()

    async def stop(self) -> None:
        """Finish what is queued and running, then let the model thread (or process) end."""
        self.drain()
        if self.process is not None:
            await self.process.wait()
        elif self.engine is not None and self.thread is not None:
            await asyncio.to_thread(self.thread.join)

    def kill(self) -> None:
        """The server is exiting: the engine's process does not outlive it."""
        if self.process is not None:
            self.process.kill()


def _load_model(path: Path, trust: Any = None) -> Any:
    from pipeline.runtime import BucketedModel

    return BucketedModel.load(path, trust=trust)
