"""What a backend provides to serve its releases: a ``Runner`` that loads buckets and runs them.

``BucketedModel`` (and through it parity and ``serve``) knows only this interface; which
runner serves a backend is the backend table's ``runtime`` entry
(``pipeline.contracts.backend_table``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pipeline.contracts import backend_table
from pipeline.contracts.bucket import Bucket
from pipeline.errors import RuntimeMismatchError
from pipeline.install.installed import InstalledRelease


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


class Slots(Protocol):
    """One loaded bucket as ``batch`` independent KV-cache slots of ``seq`` positions each: the
    interface the serving engine drives (``pipeline.server.engine``), the same on every
    backend. A request owns one slot from its prefill until it is freed; rows of other
    slots are unaffected by it, so a request joins and leaves a running bucket between steps.

    Greedy unless a prefill gives the slot ``SamplingParams`` (``pipeline.runtime.sampling``):
    then the slot's tokens are drawn under them until it is freed. Calls are not re-entrant
    (one model thread drives them)."""

    batch: int
    seq: int

    def prefill(self, slot: int, prompt: Sequence[int], sampling: Any = None) -> int:
        """Fill ``slot``'s cache with ``prompt`` (from position 0, replacing what was there)
        and return the first new token. The slot is then active: ``step`` may advance it.
        ``sampling``: the request's ``SamplingParams`` (None: greedy)."""
        ...

    def step(self, slots: Sequence[int]) -> list[int]:
        """One decode step for each of ``slots`` (active, distinct): feed each slot the token
        it produced last, at its next position; return the next token of each, in order."""
        ...

    def free(self, slot: int) -> None:
        """The slot's request is done; the slot may be prefilled again."""
        ...

    # Optional, looked up by the engine where a backend has them (cpu/cuda's SessionSlots):
    #   prefill_many(slots, prompts, sampling=None) -> first tokens: several prompts in one
    #       call (``sampling``: one ``SamplingParams`` per prompt), at most
    #       ``prefill_batch`` of them (the engine groups them by prefill length);
    #   prefill_positions(n) -> positions a prefill of n tokens computes (default: seq);
    #   prefill_lengths: the prompt lengths it has prefill graphs for (warm-up runs each);
    #   launch, launch_prefill: ``step`` and ``prefill_many`` queued, their tokens a
    #       ``Pending`` read later (``pipeline.runtime.pending``);
    #   launch_mixed(slots, prompt_slots, prompts, sampling=None) -> Pending: a step of
    #       ``slots`` and prompts prefilled into free ``prompt_slots`` in one call, at most
    #       ``mixed_batch`` of them at one of ``mixed_lengths`` (``serve --fold-prompts``).


class Runner(Protocol):
    device: str

    def slots(self, bucket: Bucket) -> Slots:
        """The bucket's slot engine (loaded on first use; the same object every call)."""
        ...

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
    return backend_table.role(manifest.backend, "runtime", installed.what)(installed, **options)


def until_eos(row: list[int], eos: int | None) -> list[int]:
    """An answer up to and including its first ``eos`` (all of it without one)."""
    return row[: row.index(eos) + 1] if eos is not None and eos in row else row
