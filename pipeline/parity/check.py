"""Parity: a compiled release against the eager Hugging Face model, bucket by bucket.

For each bucket, seeded prompts of three lengths (1 token, half the bucket, and the longest
that leaves room for N decode steps) fill the bucket's rows. The release runs them padded
into the bucket, through the same runtime that serves it (``DecodeSession``: CUDA graphs on
cuda); the reference runs each prompt alone, unpadded, in fp32, on the reference device.

* Logits after the prompt and after each of N decode steps, **teacher-forced** on the
  reference's greedy tokens so that one early difference does not compound: max absolute
  error, max relative error (|Δ| over the row's largest |reference logit|), top-1 agreement
  (exact; the report also counts the flips where the reference itself was near a tie).
* N+1 **free-running** greedy tokens from the release's own ``generate``: equal to the
  reference's, or diverging only where the reference itself was within the tolerance of a tie.
* The bucket's **mixed graphs** (a decode step with prompts in it, as ``serve
  --fold-prompts`` runs them), where it has any: ``pipeline.parity.mixed``.

The reference's weights come from one of two places:

* ``checkpoint``: the Hugging Face checkpoint the release was compiled from, loaded by
  transformers as it stands. Its weights digest must equal the manifest's. Independent of
  everything the pipeline did to the weights (GQA padding, dtype cast), so it checks those too.
* otherwise the release itself: its config.json and a bucket's weights.safetensors (verified
  against the manifest's sha256) with the GQA head padding undone, upcast to fp32. This checks
  the compiled graphs and the runtime on exactly the weights they run with.

A release runs through its backend's parity target (the backend table,
``pipeline.contracts.backend_table``); a neuron release needs the Neuron runtime and says so
plainly where it is absent. Neuron exports sample on the device and return no logits, so for
them only the free-running greedy tokens are compared (``_check_bucket_tokens``), and the
report says so.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline._files import atomic_write_text
from pipeline.contracts import backend_table
from pipeline.errors import InputError
from pipeline.install.installed import open_installed, verify_files
from pipeline.parity.mixed import MixedParity, check_mixed
from pipeline.parity.reference import Reference, reference_device
from pipeline.parity.targets import BucketSession
from pipeline.store.manifest import Manifest

DEFAULT_STEPS = 8


@dataclass(frozen=True)
class Tolerance:
    max_rel: float  # max |Δ logit| ÷ max |reference logit| of that row
    min_top1: float  # share of compared logit rows whose top-1 token agrees
    # Compare at least this many logit rows (more prompts where the batch is small): a top-1
    # share below 100% is a rate, and over the 27 rows of a b1 bucket it is noise.
    min_rows: int = 0


# fp32 differs only in summation order (measured ~1e-6 relative). Half precision differs in
# every rounding: on random-weight models we measured ~1.2% relative for bf16, ~0.15% for fp16.
# Half precision's top-1 share is a rate. A release that agrees on 94.2% of rows (bf16,
# Llama-3.2-1B shape, random weights, pooled over 11 buckets on an H200) misses the 90% bar by
# chance in 20% of 27-row checks (a b1 bucket: 3 prompts x 9 rows), 5.7% of 72-row ones, and
# 0.4% of 256-row ones (binomial).
TOLERANCES = {
    "float32": Tolerance(max_rel=1e-4, min_top1=1.0),
    "float16": Tolerance(max_rel=1e-2, min_top1=0.98, min_rows=256),
    "bfloat16": Tolerance(max_rel=5e-2, min_top1=0.9, min_rows=256),
}
# Neuron's --auto_cast_type lowers matmul precision below the weights' dtype. (optimum-neuron
# decoder exports ignore it and compile with --auto-cast=none: modeling_decoder.py:418-432;
# keeping the looser tolerance only widens what counts as a near-tie.)
AUTO_CAST_DTYPES = {"fp32": "float32", "tf32": "float16", "fp16": "float16", "bf16": "bfloat16"}


@dataclass
class BucketParity:
    bucket: str
    prompt_lengths: list[int]
    prompts: int = 0
    logits: bool = True  # False: the backend returns tokens only (neuron), so none compared
    rows: int = 0  # compared logit rows: prompts × (steps + 1)
    max_abs: float = 0.0
    max_rel: float = 0.0
    top1: float = 0.0  # share of rows whose top-1 token is the reference's
    top1_near_ties: int = 0  # rows whose top-1 differs where the reference was near a tie
    greedy_exact: float = 0.0  # share of prompts whose steps + 1 greedy tokens all match
    greedy_near_ties: int = 0  # prompts that diverged where the reference was near a tie
    greedy_decisive: int = 0  # prompts that diverged where the reference was not
    mixed: MixedParity | None = None  # its mixed graphs' check (none: it has none)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


@dataclass
class ParityReport:
    release: str
    model: str
    version: str
    backend: str
    dtype: str
    tolerance_dtype: str
    tolerance: Tolerance
    reference: dict[str, str]
    steps: int
    seed: int
    cuda_graphs: bool
    buckets: list[BucketParity]
    logits: bool = True  # whether the release's logits were compared (not for neuron)

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "release": self.release,
            "model": self.model,
            "version": self.version,
            "backend": self.backend,
            "dtype": self.dtype,
            "tolerance": {"dtype": self.tolerance_dtype, **asdict(self.tolerance)},
            "reference": self.reference,
            "steps": self.steps,
            "seed": self.seed,
            "cuda_graphs": self.cuda_graphs,
            "logits_compared": self.logits,
            "passed": self.passed,
            "buckets": [b.to_dict() for b in self.buckets],
        }

    def to_markdown(self) -> str:
        t, ref = self.tolerance, self.reference
        passed = sum(b.passed for b in self.buckets)
        lines = [
            f"# Parity: {self.model} {self.version}",
            "",
            f"- Release: `{self.release}` (backend {self.backend}, dtype {self.dtype}"
            + (", decode replayed as CUDA graphs" if self.cuda_graphs else "")
            + ")",
            f"- Reference: Hugging Face `{ref['model_class']}`, eager, {ref['dtype']} on "
            f"{ref['device']}; weights: {ref['weights']}",
            f"- Prompts: seeded (seed {self.seed}), per bucket of lengths 1, S/2 and S−N, "
            f"filling its batch (more batches where needed for the rows below); N = "
            f"{self.steps} decode steps, teacher-forced on the "
            "reference's greedy tokens; plus N+1 free-running greedy tokens",
            f"- Tolerances ({self.tolerance_dtype}): max relative logit error ≤ {t.max_rel:g} "
            f"(|Δ| ÷ the row's max |reference logit|), top-1 agreement ≥ {t.min_top1:.0%}"
            + (f" over at least {t.min_rows} rows" if t.min_rows and self.logits else "")
            + ", "
            "greedy tokens equal except after a near-tie (the reference's margin between the "
            f"two tokens ≤ 2 × {t.max_rel:g} × max |logit|)",
            *(
                []
                if self.logits
                else [
                    "- **Logits are not available** from this release: neuron exports sample "
                    "on the device and optimum-neuron's generate() returns no logits, so "
                    "only the N+1 free-running greedy tokens are compared (the reference's "
                    "logits still say where it was near a tie)"
                ]
            ),
            "",
            "| bucket | prompts | lengths | max abs | max rel | top-1 | greedy exact | result |",
            "|---|---:|---|---:|---:|---:|---:|---|",
        ]
        for b in self.buckets:
            lengths = ", ".join(map(str, b.prompt_lengths))
            result = "pass" if b.passed else "**FAIL**"
            err = (
                f"{b.max_abs:.3g} | {b.max_rel:.3g} | {b.top1:.1%}"
                if b.logits
                else "n/a | n/a | n/a"
            )
            lines.append(
                f"| {b.bucket} | {b.prompts} | {lengths} | {err} "
                f"| {b.greedy_exact:.1%} | {result} |"
            )
        lines += [
            "",
            f"**{'PASS' if self.passed else 'FAIL'}**: {passed}/{len(self.buckets)} "
            "buckets within tolerance.",
        ]
        mixed = [b for b in self.buckets if b.mixed is not None]
        if mixed:
            lines += [
                "",
                "Mixed graphs (a decode step with prompts in it, as `serve --fold-prompts` "
                "runs them; teacher-forced):",
                "",
                *(
                    f"- {b.bucket} at {', '.join(map(str, b.mixed.lengths))}: "
                    f"{b.mixed.rows} rows, max abs {b.mixed.max_abs:.3g}, max rel "
                    f"{b.mixed.max_rel:.3g}, top-1 flips {b.mixed.flips}"
                    for b in mixed
                    if b.mixed is not None
                ),
            ]
        failed = [b for b in self.buckets if not b.passed]
        if failed:
            lines += [""] + [f"- {b.bucket}: {'; '.join(b.failures)}" for b in failed]
        return "\n".join(lines) + "\n"

    def write_markdown(self, path: Path) -> None:
        atomic_write_text(Path(path), self.to_markdown())


def check_release(
    path: Path | str,
    *,
    reference: str = "auto",
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    checkpoint: Path | None = None,
    buckets: Sequence[str] = (),
    cuda_graphs: bool = True,
    on_bucket: Callable[[BucketParity], None] | None = None,
) -> ParityReport:
    """Run every bucket (or ``buckets``) of the release at ``path`` against the reference."""
    import torch

    if steps < 1:
        raise InputError("--steps", f"must be ≥ 1, got {steps}", None)
    installed = open_installed(path, verify="none")
    release_dir, manifest = installed.dir, installed.manifest
    names = _bucket_names(manifest, buckets)
    device = reference_device(reference)
    runner_cls = backend_table.role(manifest.backend, "parity", installed.what)
    verify_files(installed, "sha256", names)
    runner = runner_cls(installed, cuda_graphs=cuda_graphs)
    if getattr(runner, "needs_checkpoint", False) and checkpoint is None:
        raise InputError(
            installed.what,
            f"a {manifest.backend} release's weights are not in a form the reference reads",
            "pass --checkpoint with the Hugging Face checkpoint it was compiled from",
        )
    logits = getattr(runner, "logits", True)
    ref = Reference(release_dir, manifest, device, checkpoint)
    tol_dtype = tolerance_dtype(manifest)
    tol = TOLERANCES[tol_dtype]
    results = []
    with torch.no_grad():
        for name in names:
            check = _check_bucket if logits else _check_bucket_tokens
            session = runner.session(name)
            result = check(session, ref, name, tol, steps, seed)
            if logits:
                verdict = functools.partial(_near_tie, tol=tol)
                result.mixed = check_mixed(session, ref, seed, verdict)
                if result.mixed is not None:
                    exact = tol.min_top1 >= 1.0
                    result.failures += result.mixed.failures(tol.max_rel, exact)
            results.append(result)
            if on_bucket:
                on_bucket(result)
    graphed = cuda_graphs and getattr(runner, "device", None) == "cuda"
    return ParityReport(
        release=str(release_dir),
        model=manifest.model,
        version=manifest.version,
        backend=manifest.backend,
        dtype=manifest.dtype,
        tolerance_dtype=tol_dtype,
        tolerance=tol,
        reference=ref.describe(),
        steps=steps,
        seed=seed,
        cuda_graphs=graphed,
        buckets=results,
        logits=logits,
    )


# --- one bucket ---------------------------------------------------------------------------


def prompt_lengths(seq: int, steps: int) -> list[int]:
    """1, about half the bucket, and the longest prompt that leaves room for ``steps``."""
    longest = max(1, seq - steps)
    return sorted({1, min(max(1, seq // 2), longest), longest})


def make_prompts(
    bucket: str, batch: int, seq: int, steps: int, vocab: int, seed: int, min_rows: int = 0
) -> Iterator[list[list[int]]]:
    """Batches of ``batch`` seeded prompts whose lengths cycle through ``prompt_lengths``;
    enough batches that every length appears and that the prompts give at least
    ``min_rows`` logit rows (``steps + 1`` each)."""
    import torch

    lengths = prompt_lengths(seq, steps)
    g = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(bucket))
    low = 3 if vocab > 3 else 0  # keep clear of the usual pad/bos/eos ids
    prompts = max(len(lengths), -(-min_rows // (steps + 1)))
    for first in range(0, prompts, batch):
        rows = [lengths[(first + i) % len(lengths)] for i in range(batch)]
        yield [torch.randint(low, vocab, (n,), generator=g).tolist() for n in rows]


def _check_bucket(
    run: BucketSession, ref: Reference, name: str, tol: Tolerance, steps: int, seed: int
) -> BucketParity:
    import torch

    steps = min(steps, run.seq - 1)
    out = BucketParity(name, prompt_lengths(run.seq, steps))
    agree = near = exact = 0
    for prompts in make_prompts(name, run.batch, run.seq, steps, ref.vocab, seed, tol.min_rows):
        expected = [ref.greedy(p, steps) for p in prompts]  # (tokens [N+1], logits [N+1, V])
        ref_tokens = torch.tensor([t for t, _ in expected])  # [B, N+1]
        ref_logits = torch.stack([lg for _, lg in expected])  # [B, N+1, V]
        tokens = torch.zeros((run.batch, run.seq), dtype=torch.int64)
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in prompts])
        got = run.prefill(tokens, lengths)
        for k in range(steps + 1):
            if k:  # teacher-forced: the reference's token k-1, at position length + k - 1
                got = run.decode(ref_tokens[:, k - 1 : k], lengths + k - 1)
            actual = got.float().cpu()
            want = ref_logits[:, k]
            err = (actual - want).abs().amax(-1)
            out.max_abs = _worst(out.max_abs, err.max().item())
            out.max_rel = _worst(out.max_rel, (err / _scale(want)).max().item())
            for row_got, row_want in zip(actual.argmax(-1).tolist(), want, strict=True):
                tie = _near_tie(row_want, int(row_want.argmax()), row_got, tol)
                agree += tie == "exact"
                near += tie == "near-tie"
            out.rows += len(prompts)
        exact += _tally_greedy(out, run, prompts, expected, steps, tol)
    out.top1 = agree / out.rows
    out.top1_near_ties = near
    out.greedy_exact = exact / out.prompts
    out.failures = _failures(out, tol)
    return out


def _tally_greedy(
    out: BucketParity,
    run: BucketSession,
    prompts: list[list[int]],
    expected: list[tuple[list[int], Any]],
    steps: int,
    tol: Tolerance,
) -> int:
    """Free-running greedy tokens of ``prompts`` against the reference's, counted into
    ``out``; returns how many were exact."""
    exact = 0
    for row, tokens in enumerate(run.generate(prompts, steps + 1, None)):
        verdict = _greedy_verdict(tokens, expected[row], tol)
        exact += verdict == "exact"
        out.greedy_near_ties += verdict == "near-tie"
        out.greedy_decisive += verdict == "decisive"
    out.prompts += len(prompts)
    return exact


def _check_bucket_tokens(
    run: BucketSession, ref: Reference, name: str, tol: Tolerance, steps: int, seed: int
) -> BucketParity:
    """Free-running greedy tokens only, for runners that return no logits. The whole
    sequence must fit the bucket (neuron: prompt + new tokens ≤ sequence length)."""
    steps = min(steps, run.seq - 2)
    out = BucketParity(name, prompt_lengths(run.seq, steps + 1), logits=False)
    exact = 0
    for prompts in make_prompts(name, run.batch, run.seq, steps + 1, ref.vocab, seed):
        expected = [ref.greedy(p, steps) for p in prompts]
        exact += _tally_greedy(out, run, prompts, expected, steps, tol)
    out.greedy_exact = exact / out.prompts
    out.failures = _failures(out, tol)
    return out


def _greedy_verdict(got: list[int], expected: tuple[list[int], Any], tol: Tolerance) -> str:
    """exact | near-tie (first divergence where the reference's own margin was within the
    tolerance) | decisive."""
    want, logits = expected
    for k, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return _near_tie(logits[k], b, a, tol)
    return "exact" if len(got) == len(want) else "decisive"


def _near_tie(row: Any, want: int, got: int, tol: Tolerance) -> str:
    """exact | near-tie (the reference scores ``got`` within twice the logit tolerance of its
    own choice ``want``: logit errors the tolerance allows can swap them) | decisive."""
    if got == want:
        return "exact"
    margin = float(row[want] - row[got])
    return "near-tie" if margin <= 2 * tol.max_rel * float(_scale(row)) else "decisive"


def _failures(b: BucketParity, tol: Tolerance) -> list[str]:
    failures = []
    if b.logits and not b.max_rel <= tol.max_rel:  # also catches NaN
        failures.append(f"max relative logit error {b.max_rel:.3g} > {tol.max_rel:g}")
    if b.logits and b.top1 < tol.min_top1:
        flips = b.rows - round(b.top1 * b.rows)
        failures.append(
            f"top-1 agreement {b.top1:.1%} < {tol.min_top1:.0%} ({b.top1_near_ties} of "
            f"{flips} differing rows at a reference near-tie)"
        )
    if b.greedy_decisive:
        failures.append(
            f"{b.greedy_decisive} of {b.prompts} prompts' greedy tokens diverge from the "
            "reference where it was not near a tie"
        )
    return failures


def _scale(logits: Any) -> Any:
    return logits.abs().amax(-1).clamp_min(1e-12)


def _stable_hash(text: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(text)) % 1_000_003


def tolerance_dtype(manifest: Manifest) -> str:
    """The release's dtype, or Neuron's lower auto-cast precision where that is looser."""
    dtype = manifest.dtype if manifest.dtype in TOLERANCES else "float32"
    if manifest.backend == "neuron":
        cast = AUTO_CAST_DTYPES.get(manifest.auto_cast_type, dtype)
        if TOLERANCES[cast].max_rel > TOLERANCES[dtype].max_rel:
            return cast
    return dtype


def _bucket_names(manifest: Manifest, wanted: Sequence[str]) -> list[str]:
    names = sorted(
        manifest.buckets, key=lambda n: (manifest.buckets[n].batch, manifest.buckets[n].seq)
    )
    unknown = [w for w in wanted if w not in manifest.buckets]
    if unknown:
        raise InputError(
            f"--bucket {unknown[0]}", "not a bucket of this release", f"buckets: {', '.join(names)}"
        )
    return [n for n in names if not wanted or n in wanted]


def _worst(a: float, b: float) -> float:
    """max() that keeps a NaN (a NaN error must fail, never vanish)."""
    return b if math.isnan(b) or b > a else a
