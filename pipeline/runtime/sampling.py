"""Per-request sampling on the logits a step returns: temperature, top-k, top-p and a seed,
row by row inside one batch.

The compiled graphs return fp32 logits beside their greedy argmax (``graph_abi``), so a
greedy row costs nothing here and a sampled row needs no other graph. Rows are sampled
together (one sort, one softmax over the rows that sample) with the Gumbel-max trick:
``argmax(logits / T + g)`` with ``g`` Gumbel noise is an exact draw from ``softmax(logits /
T)`` restricted to the tokens top-k and top-p keep.

The noise is counter-based: a hash of (the request's seed, the index of the token in its
answer, the vocabulary id), not a generator's state; seed and index are mixed on the host,
so the device hashes each element once (the sampler is launch-bound on a GPU). So a
request's tokens depend only on its own seed, prompt and the release, never on which rows
share its step or in what order they joined, and the same seed gives the same answer on
every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.runtime.pending import to_device

if TYPE_CHECKING:  # torch is imported when a row is drawn: the params need none
    from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature`` 0 is greedy (the graph's argmax);
    ``top_k`` 0 keeps every token; ``top_p`` 1 keeps every token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"sampling needs temperature ≥ 0, top_p in (0, 1], top_k ≥ 0; got {self}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


GREEDY = SamplingParams()

# splitmix64's constants, and as signed int64 for torch (no uint64 arithmetic; products wrap)
_U1, _U2, _UG = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15
_M1, _M2, _GOLDEN = _U1 - (1 << 64), _U2 - (1 << 64), _UG - (1 << 64)
_MASK = (1 << 64) - 1
_KEYS: dict[tuple[int, str], Tensor] = {}  # (vocab, device) -> each token id's key


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: it would copy the sign
    bit down, and the xor would always clear it)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on the host: every input bit reaches every output bit."""
    x = ((x ^ (x >> 30)) * _U1) & _MASK
    x = ((x ^ (x >> 27)) * _U2) & _MASK
    return x ^ (x >> 31)


def row_key(seed: int, step: int) -> int:
    """One row's key (signed int64): its request's seed and the index of the token drawn,
    mixed on the host, so the device mixes only once per element."""
    # the Weyl increments keep a zero seed or step from hashing to zero
    x = _mix_int((_mix_int((seed + _UG) & _MASK) + (step + 1) * _UG) & _MASK)
    return x - (1 << 64) if x >> 63 else x


def noise(keys: Tensor, vocab: int) -> Tensor:
    """fp32 [R, vocab] in (0, 1) from the rows' keys (``row_key``): each element splitmix64
    of its row's key xor its token id's key; the same bits on every device."""
    import torch

    ids = _KEYS.get((vocab, str(keys.device)))
    if ids is None:
        ids = torch.arange(vocab, dtype=torch.int64, device=keys.device) * _GOLDEN
        _KEYS[vocab, str(keys.device)] = ids
    x = keys[:, None] ^ ids[None, :]
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    bits = _shr(x, 40)  # the top 24 bits
    return bits.to(torch.float32).mul_(1.0 / (1 << 24)).add_(0.5 / (1 << 24))


def uniform(seeds: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """``noise`` for rows given as seed and step tensors."""
    import torch

    keys = [row_key(s, n) for s, n in zip(seeds.tolist(), steps.tolist(), strict=True)]
    return noise(torch.tensor(keys, dtype=torch.int64).to(seeds.device), vocab)


@dataclass(frozen=True)
class Draws:
    """The rows of one sampling call, as tensors on the device: made before the step runs,
    so their copies queue ahead of it instead of waiting for it."""

    floats: Tensor  # fp32 [R, 2]: temperature, top_p
    ints: Tensor  # int64 [R, 2]: top_k (0: all), the row's key (seed and step, mixed)
    filtered: bool  # some row has a top_k or top_p < 1

    @classmethod
    def of(cls, params: Sequence[SamplingParams], steps: Sequence[int], device: object) -> Draws:
        import torch

        floats = torch.tensor([(p.temperature, p.top_p) for p in params], dtype=torch.float32)
        ints = torch.tensor(
            [(p.top_k, row_key(p.seed, n)) for p, n in zip(params, steps, strict=True)],
            dtype=torch.int64,
        )
        filtered = any(p.top_k or p.top_p < 1 for p in params)
        return cls(to_device(floats, device), to_device(ints, device), filtered)


class SlotSampling:
    """Which slots of a bucket sample, under what params, and how many tokens each has drawn
    (the noise's counter): the state every slot engine keeps beside its caches."""

    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}
        self._drawn: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._params)

    def assign(self, slot: int, params: SamplingParams | None) -> None:
        """A new request in ``slot``: greedy (None) or sampled, its counter from 0."""
        self._drawn.pop(slot, None)
        if params is None or params.greedy:
            self._params.pop(slot, None)
        else:
            self._params[slot] = params

    def free(self, slot: int) -> None:
        self._params.pop(slot, None)
        self._drawn.pop(slot, None)

    def state(self) -> tuple[dict[int, SamplingParams], dict[int, int]]:
        """A copy of every slot's params and counter, for ``restore``."""
        return dict(self._params), dict(self._drawn)

    def restore(self, state: tuple[dict[int, SamplingParams], dict[int, int]]) -> None:
        """Back to ``state``: a call that took draws and then did not run."""
        self._params, self._drawn = dict(state[0]), dict(state[1])

    def params(self, slot: int) -> SamplingParams:
        return self._params.get(slot, GREEDY)

    def sampled(self, slots: Sequence[int]) -> list[int]:
        """Those of ``slots`` that sample, in order."""
        return [s for s in slots if s in self._params] if self._params else []

    def take(self, slots: Sequence[int]) -> list[tuple[SamplingParams, int]]:
        """Each of ``slots``' params and the index of the token it draws next (slots that
        sample), counting the draws."""
        out = []
        for s in slots:
            n = self._drawn.get(s, 0)
            self._drawn[s] = n + 1
            out.append((self._params[s], n))
        return out

    def draws(self, slots: Sequence[int], device: object) -> Draws:
        """The sampler's rows for the next token of each of ``slots`` (slots that sample),
        made before the call that computes their logits; counts the draws."""
        taken = self.take(slots)
        return Draws.of([p for p, _ in taken], [n for _, n in taken], device)

    def filtered(self, slots: Sequence[int]) -> bool:
        """Whether any of ``slots`` keeps only some tokens (top_k or top_p)."""
        return any(self._params[s].top_k or self._params[s].top_p < 1 for s in slots)


def sample(logits: Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> Tensor:
    """One token for each row of ``logits`` [R, V] (rows that are not greedy), drawn under
    its params, the ``steps[r]``-th token of its request. int64 [R], on logits' device."""
    return draw(logits, Draws.of(params, steps, logits.device))


def draw(logits: Tensor, rows: Draws) -> Tensor:
    """``sample`` with the rows' tensors made beforehand."""
    import torch

    x = logits.float() / rows.floats[:, :1]
    vocab = x.shape[1]
    if rows.filtered:
        # The smallest logit each row keeps: top-k's k-th, or top-p's last of the sorted
        # prefix whose mass first reaches p (the token that crosses p is kept, as in vLLM).
        top, _ = x.sort(dim=1, descending=True)
        k = torch.where(rows.ints[:, 0] > 0, rows.ints[:, 0], vocab).clamp(max=vocab)
        probs = top.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass strictly above each sorted token
        positions = torch.arange(vocab, device=x.device)
        keep = (before < rows.floats[:, 1:2]) & (positions < k[:, None])
        kept = keep.sum(dim=1).clamp(min=1)
        floor = top.gather(1, (kept - 1)[:, None])
        x = x.masked_fill(x < floor, float("-inf"))
    gumbel = noise(rows.ints[:, 1], vocab).log_().neg_().log_()  # −g: log(−log u)
    return (x - gumbel).argmax(dim=1)
