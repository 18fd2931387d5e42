"""How a compile run looks: a rich progress bar on a terminal, plain lines in CI or a pipe,
and a summary table at the end."""

from __future__ import annotations

import sys
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline._progress import interactive
from pipeline.compile.report import BucketResult, CompileReport


def describe(r: BucketResult) -> str:
    line = f"{r.bucket.name} graph {r.graph}"
    if r.status != "cached":
        line += f" in {r.seconds:.1f}s"
    line += f", weights {r.weights_status}"
    error = r.error or (r.weights.error if r.weights else None)
    if error:
        line += f": {error}"
    return line


def weights_line(report: CompileReport) -> str:
    """What happened to the prepared weights, in one line."""
    w = report.weights
    if w is None:
        return "weights: inside the compiled graphs (this backend compiles them in)"
    words = {"cached": "hit", "prepared": f"prepared in {w.seconds:.1f}s"}
    line = f"weights: {words.get(w.status, w.status)} ({w.key[:12]})"
    return line + (f": {w.error}" if w.error else "")


class PlainProgress:
    """A line per bucket compiled (``[3/8] b2_s64 compiled in 41.2s``); hits only counted."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        self.total, self.done, self.hits = total, 0, 0
        self.stream = stream or sys.stderr

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.hits:
            self._print(f"[compile] {self.hits} of {self.total} buckets were graph cache hits")

    def __call__(self, event: str, r: BucketResult) -> None:
        if event == "start":
            self._print(f"[compile] {r.bucket.name} compiling (log: {r.log})")
            return
        self.done += 1
        if r.cache_hit and r.ok:
            self.hits += 1
        else:
            self._print(f"[{self.done}/{self.total}] {describe(r)}")

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


class BarProgress:
    """A bar over all buckets, naming the ones compiling now."""

    def __init__(self, total: int) -> None:
        self.progress = Progress(
            TextColumn("compile"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.progress.add_task("", total=total)
        self.running: list[str] = []

    def __enter__(self) -> BarProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def __call__(self, event: str, r: BucketResult) -> None:
        name = r.bucket.name
        if event == "start":
            self.running.append(name)
        else:
            self.running = [n for n in self.running if n != name]
            self.progress.advance(self.task)
            if not r.ok:
                self.progress.console.print(f"[red]✗[/red] {describe(r)}")
        self.progress.update(self.task, description=" ".join(self.running))


def make_progress(total: int) -> PlainProgress | BarProgress:
    return BarProgress(total) if interactive() else PlainProgress(total)


def summary_table(report: CompileReport) -> Table:
    table = Table(
        title=f"{report.model}: {report.backend}, shard {report.shard[0]}/{report.shard[1]}; "
        f"{report.compiled} of {len(report.results)} compiled",
        title_justify="left",
        caption=weights_line(report),
        caption_justify="left",
    )
    for col in ("bucket", "graph", "weights", "seconds"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for r in report.results:
        style = None if r.ok else "red"
        table.add_row(r.bucket.name, r.graph, r.weights_status, f"{r.seconds:.1f}", style=style)
    return table
