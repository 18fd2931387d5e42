"""Parity of a bucket's mixed graph (graph ABI 6: a decode step and prompts packed into one
stream, prefilled into free rows, in one call), which ``serve --fold-prompts`` runs whenever
a prompt joins a running bucket: a miscompiled one would answer wrongly only under load, so
it is checked against the same reference as the bucket's other graphs.

For each mixed length T, the bucket's rows but the last few are filled with seeded prompts
(prefilled as the server prefills them), then one mixed call steps them, teacher-forced on
the reference's first greedy token, and prefills up to three prompts of different lengths
into the last rows, packed into a stream of T with padding after them, through the serving
runtime's own path (``SessionSlots``; on cuda the recorded graph). Each step row's logits
must match the reference's for that row's second token, and each prompt's logits the
reference's after that prompt, within the bucket's tolerance: the largest relative error,
and top-1 equal but where the reference was near a tie (in fp32, equal everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MixedParity:
    lengths: list[int] = field(default_factory=list)  # the stream lengths checked
    rows: int = 0  # logit rows compared
    max_abs: float = 0.0
    max_rel: float = 0.0
    flips: int = 0  # rows whose top-1 differs from the reference's
    decisive: int = 0  # of those, where the reference was not near a tie

    def failures(self, max_rel: float, exact_top1: bool) -> list[str]:
        out = []
        if not self.max_rel <= max_rel:  # also catches NaN
            out.append(f"mixed calls: max relative logit error {self.max_rel:.3g} > {max_rel:g}")
        flips = self.flips if exact_top1 else self.decisive
        if flips:
            out.append(f"mixed calls: {flips} of {self.rows} rows' top-1 differ")
        return out


def check_mixed(session: Any, ref: Any, seed: int, near_tie: Any) -> MixedParity | None:
    """The bucket's mixed graph against ``ref``; None where it has none (or a row to spare).
    ``near_tie(row, want, got)``: the verdict parity gives a top-1 flip."""
    import torch

    from pipeline.runtime.session_slots import SessionSlots

    lengths = tuple(getattr(getattr(session, "spec", None), "mixed_lengths", ()))
    if not lengths or session.batch < 2 or session.seq < 3:
        return None
    slots = SessionSlots(session)
    out = MixedParity(list(lengths))
    g = torch.Generator().manual_seed(seed * 7_919 + session.batch * 104_729 + session.seq)
    low = 3 if ref.vocab > 3 else 0  # clear of the usual pad/bos/eos ids, as parity's prompts
    k = min(3, session.batch - 1, session.spec.mixed_batch)  # prompts in each stream
    rows = list(range(session.batch - k))
    for t in lengths:
        # step rows of varied lengths that leave room for one step; the prompts fill most of
        # T, each shorter than the last and than the bucket, padding after them
        sizes = [max(1, (session.seq - 1) * (i + 1) // len(rows)) for i in rows]
        steps = [torch.randint(low, ref.vocab, (n,), generator=g).tolist() for n in sizes]
        share = [max(1, min(session.seq - 1, (t - t // 8) * (k - i) // (k * (k + 1) // 2)))
                 for i in range(k)]  # fmt: skip
        prompts = [torch.randint(low, ref.vocab, (n,), generator=g).tolist() for n in share]
        expected = [ref.greedy(p, 1) for p in steps]  # (tokens [2], logits [2, V])
        firsts = [ref.greedy(p, 0)[1][0] for p in prompts]
        want = torch.stack([*(lg[1] for _, lg in expected), *firsts])
        size = slots.prefill_batch
        for a in range(0, len(rows), size):
            slots.prefill_many(rows[a : a + size], steps[a : a + size])
        forced = torch.tensor([tokens[0] for tokens, _ in expected])  # teacher-forced
        session.inputs[0][: len(rows), 0].copy_(forced.to(session.inputs[0].device))
        free = list(range(len(rows), session.batch))
        got = slots.mixed_logits(rows, free, prompts)
        for r in range(session.batch):
            slots.free(r)
        err = (got - want).abs().amax(-1)
        scale = want.abs().amax(-1).clamp_min(1e-12)
        out.max_abs = max(out.max_abs, float(err.max()))
        out.max_rel = max(out.max_rel, float((err / scale).max()))
        if torch.isnan(err).any():
            out.max_rel = float("nan")
        for row_got, row_want in zip(got.argmax(-1).tolist(), want, strict=True):
            verdict = near_tie(row_want, int(row_want.argmax()), row_got)
            out.flips += verdict != "exact"
            out.decisive += verdict == "decisive"
        out.rows += len(want)
    return out
