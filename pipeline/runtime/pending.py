"""Tokens of a call already launched on the device, read when the caller needs them.

A slot engine's ``launch`` (``pipeline.runtime.runners.Slots``) queues its work and returns
one of these at once; ``tokens()`` is the host sync. So the server can queue the next step
before it reads this one's tokens, and the device works while the host delivers them.

On cuda the tokens are copied into pinned host memory behind the call on the same stream
(before any later call can overwrite the graph's output buffer), and ``tokens()`` waits on
an event recorded after that copy. Host-to-device copies that feed a queued call go the same
way (``to_device``): a plain ``.to("cuda")`` of host memory synchronises the stream, which
would wait for every call queued before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Pending(Protocol):
    def tokens(self) -> list[int]:
        """The call's tokens, one per row it was given, in order (waits for the device)."""
        ...

    def done(self) -> bool:
        """Whether the device has finished the call (never waits)."""
        ...


class RanThenFailed(RuntimeError):
    """A call that ran on the device, then failed on the host (drawing its sampled tokens,
    say): its rows have moved on, so the caller fails them rather than run them again. Any
    other exception from a launch means nothing ran."""


class Ready:
    """Tokens already on the host (a backend whose calls return when they are done)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens = [int(t) for t in tokens]

    def tokens(self) -> list[int]:
        return self._tokens

    def done(self) -> bool:
        return True


class DeviceTokens:
    """Rows ``rows`` (None: every row) of an int64 device tensor [B], copied to the host
    behind the work queued so far."""

    def __init__(self, values: Any, rows: Sequence[int] | None = None) -> None:
        import torch

        self._rows = None if rows is None else list(rows)
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event: Any = torch.cuda.Event()
            self._event.record()
        else:  # cpu: the call is done already
            self._host, self._event = values.clone(), None

    def tokens(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        out = self._host.tolist()
        return out if self._rows is None else [out[r] for r in self._rows]

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())


def to_device(values: Any, device: Any) -> Any:
    """A host tensor on ``device`` without waiting for the device's queued work (cuda: from
    pinned memory, non-blocking; the caching host allocator keeps the pinned block until
    the copy is done)."""
    import torch

    if torch.device(device).type != "cuda" or values.device.type != "cpu":
        return values.to(device)  # on the device already: as it is (only host memory pins)
    return values.pin_memory().to(device, non_blocking=True)
