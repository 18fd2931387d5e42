"""What a backend provides to serve its releases: a ``Runner`` that loads buckets and runs them.

``BucketedModel`` (and through it parity and ``serve``) knows only this interface; which
runner serves a backend is the backend table's ``runtime`` entry (``pipeline.backends``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pipeline import backends
from pipeline.errors import RuntimeMismatchError
from pipeline.install.installed import InstalledRelease
from pipeline.plan.buckets import Bucket


class Session(Protocol):
    """One loaded bucket."""

    batch: int
    seq: int

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ) -> list[list[int]]:
        """Greedy: the new tokens of each prompt (at most ``batch`` prompts).

        ``on_tokens`` (optional; ``serve`` streams with it, and falls back to whole answers
        for sessions without it): called after every step with each prompt's new token;
        True stops generating. No callback: no per-step host work."""
        ...


class Runner(Protocol):
    device: str

    def session(self, bucket: Bucket) -> Session:
        """The bucket, loaded on first use."""
        ...

    def warmup(self, buckets: Sequence[Bucket]) -> None:
        """Load what the runner can keep loaded."""
        ...

    def tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """The bucket sequence length a request of this size needs."""
        ...


def open_runner(installed: InstalledRelease, backend: str = "auto", **options: Any) -> Runner:
    """The runner of the release's backend; one line (exit 2) when it cannot run here."""
    manifest = installed.manifest
    if backend not in ("auto", manifest.backend):
        raise RuntimeMismatchError(
            installed.what,
            f"was compiled for '{manifest.backend}', not '{backend}'",
            "compiled graphs run only on the target they were compiled for",
        )
    return backends.role(manifest.backend, "runtime", installed.what)(installed, **options)
