"""Loading a compiled cpu/cuda bucket: its weights once, each graph bound to them, checked
against the contract it was built for (``pipeline.contracts.graph_abi``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pipeline._environ import environ_set
from pipeline.contracts.graph_abi import (
    DECODE_FILE,
    MIXED_FILE,
    WEIGHTS_FILE,
    GraphSpec,
    cuda_arch,
    prefill_file,
)


def new_cache(spec: GraphSpec, device: Any = None) -> tuple[Any, Any]:
    """Zeroed (k_cache, v_cache) for one bucket."""
    import torch

    dtype = getattr(torch, spec.dtype)
    device = device or spec.device
    return (
        torch.zeros(spec.cache_shape, dtype=dtype, device=device),
        torch.zeros(spec.cache_shape, dtype=dtype, device=device),
    )


def load_weights(path: Path, device: Any = "cpu") -> dict[str, Any]:
    """weights.safetensors → {name: tensor} on ``device``. Load once, share across buckets."""
    from safetensors.torch import load_file

    return load_file(str(path), device=str(device))


def load_graph(
    path: Path,
    weights: dict[str, Any],
    spec: GraphSpec,
    device: Any = None,
    *,
    single_threaded: bool = False,
):
    """Load one .pt2 and bind the shared weights to it (no copy: user-managed constants).

    ``single_threaded``: run without the package's locks and CUDA events, which CUDA graph
    capture forbids (``pipeline.runtime.cuda_graphs``); the caller must not call it concurrently."""
    import torch
    from torch._inductor import aoti_load_package

    device = torch.device(device or spec.device)
    _quiet_isa_notice()
    # torch's loader extracts under TMPDIR: this process's folder, for the load (under
    # _no_isa_probe's _LOADING: the environment is the process's)
    with _no_isa_probe(), environ_set("TMPDIR", str(_extraction_dir())):
        model = aoti_load_package(
            str(path),
            run_single_threaded=single_threaded,
            device_index=-1 if device.index is None else device.index,
        )
    names = {n: spec.aliases.get(n, n) for n in model.get_constant_fqns()}
    missing = sorted(w for w in names.values() if w not in weights)
    if missing:
        from pipeline.errors import IntegrityError

        raise IntegrityError(
            str(path),
            f"needs {len(missing)} weights that {WEIGHTS_FILE} lacks (first: {missing[0]})",
            "the release mixes graphs and weights of different builds; compile and publish it "
            "again",
        )
    check_weights(path, spec, {n: weights[w] for n, w in names.items()})
    constants = {n: weights[w] for n, w in names.items()}
    model.load_constants(constants, check_full_update=True, user_managed=True)
    return model


def check_weights(path: Path, spec: GraphSpec, constants: dict[str, Any]) -> None:
    """Refuse, in one line, weights whose shape or dtype is not what the graphs were built
    for: graphs of one architecture must never run on weights of another."""
    for name, want in sorted(spec.constants.items()):
        t = constants.get(name)
        if t is None:
            continue  # names are checked by the caller
        got_dtype = str(t.dtype).removeprefix("torch.")
        if list(t.shape) != list(want["shape"]) or got_dtype != want["dtype"]:
            from pipeline.errors import IntegrityError

            raise IntegrityError(
                str(path),
                f"weight {name} is {got_dtype}{list(t.shape)}, the graphs were built for "
                f"{want['dtype']}{list(want['shape'])}",
                "the release pairs graphs and weights of different architectures; compile "
                "and publish it again",
            )


def _quiet_isa_notice() -> None:
    """cpu packages target a portable ISA (x86-64-v3) on purpose, and torch warns at a load
    where the build machine had more. The loads skip the check that warns
    (``_no_isa_probe``), so this is a guard for a torch whose load no longer goes through
    it: drop just that notice."""
    import logging

    log = logging.getLogger("torch.export.pt2_archive._package")
    if not any(isinstance(f, _IsaNotice) for f in log.filters):
        log.addFilter(_IsaNotice())


_LOADING = threading.Lock()  # the swaps below are process-wide: one load at a time

# A package's load extracts its files into a new folder under TMPDIR, which torch's loader
# removes when it is destroyed; a process that ends without destroying it (the engine's
# process ends by os._exit or SIGKILL with its server) left ~2 MB a graph in /tmp, every
# server start: 30 GB on a developer VM in two days. So each process extracts into a folder
# of its own, named by host and pid, and any load sweeps the folders of processes gone.
EXTRACT_PREFIX = "inf2-pipeline-graphs-"
_EXTRACTED: dict[int, Path] = {}  # pid -> its folder (a forked child makes its own)


def _extraction_dir() -> Path:
    """This process's folder for extracted packages, made at its first load, after
    sweeping the folders of this host's processes that are gone."""
    pid = os.getpid()
    if pid not in _EXTRACTED:
        base, host = Path(tempfile.gettempdir()), socket.gethostname()
        for old in base.glob(f"{EXTRACT_PREFIX}{host}-*"):
            gone = old.name.rsplit("-", 1)[1]
            if gone.isdigit() and not _alive(int(gone)):
                shutil.rmtree(old, ignore_errors=True)
        folder = base / f"{EXTRACT_PREFIX}{host}-{pid}"
        folder.mkdir(mode=0o700, exist_ok=True)
        _EXTRACTED[pid] = folder
    return _EXTRACTED[pid]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


@contextlib.contextmanager
def _no_isa_probe() -> Iterator[None]:
    """Load without torch's check of the host against the build.

    A package load asks for the host's device information only to warn where it differs
    from the build's (torch/export/pt2_archive/_package.py, ``_load_aoti``, which imports
    ``codecache.get_device_information`` when called). The CPU ISA in it is found by
    compiling a probe per vector ISA and loading each in a child interpreter
    (torch/_inductor/cpu_vec_isa.py, ``VecISA.check_build``; before torch 2.13 the child
    imports torch; AVX-512 and AMX hosts probe several). On the H100 host a process's first
    package load took 36-45 s and every later one 0.0-0.1 s (bench/RESULTS.md, twenty-fifth
    round). What a package runs was fixed when it was compiled, and a cuda package's GPU
    architecture is checked by ``check_runs_here``; so for the load, the host's information
    is empty (nothing to compare, no warning), and torch's own is back after it, untouched
    (no cache of it is filled or cleared). A compile in another thread meanwhile would
    record no host information in its package; ours run in worker processes."""
    from torch._inductor import codecache

    with _LOADING:
        real = getattr(codecache, "get_device_information", None)
        if real is not None:
            codecache.get_device_information = _nothing_to_compare
        try:
            yield
        finally:
            if real is not None:
                codecache.get_device_information = real


def _nothing_to_compare(device_type: str) -> dict[str, str]:
    return {}


class _IsaNotice:
    def filter(self, record: Any) -> bool:
        return "AOTI_CPU_ISA" not in record.getMessage()


def check_runs_here(spec: GraphSpec, bucket_dir: Path, device: Any = None) -> None:
    """Refuse cuda kernels built for another GPU architecture before loading them."""
    from pipeline.errors import RuntimeMismatchError

    if not spec.cuda_arch or spec.device != "cuda":
        return
    here = cuda_arch(device)
    if here != spec.cuda_arch:
        raise RuntimeMismatchError(
            str(bucket_dir),
            f"compiled for {spec.cuda_arch} GPUs, this GPU is {here}",
            "compile the release on (or for) this GPU architecture",
        )


class BucketGraphs:
    """Every graph of one bucket directory, ready to call."""

    def __init__(
        self,
        bucket_dir: Path,
        device: Any = None,
        weights: dict | None = None,
        *,
        single_threaded: bool = False,
    ):
        self.dir = Path(bucket_dir)
        self.single_threaded = single_threaded
        self.spec = GraphSpec.read(self.dir)
        self.device = device or self.spec.device
        check_runs_here(self.spec, self.dir, self.device)
        self.weights = weights or load_weights(self.dir / WEIGHTS_FILE, self.device)
        # seconds each package took to load, by file name: a GPU server's start is mostly
        # these (bench/RESULTS.md, twenty-fourth round), and the runner logs the slowest
        self.load_seconds: dict[str, float] = {}
        # prompt length T -> the prefill graph at T
        self.prefills = {
            n: self._load(prefill_file(n, self.spec.seq)) for n in self.spec.prefill_lengths
        }
        self.decode = _checked_key_positions(self._load(DECODE_FILE), self.spec)
        # the mixed graph: a step and prompts packed into one stream (None: the bucket has none)
        self.mixed = (
            _checked_key_positions(self._load(MIXED_FILE), self.spec)
            if self.spec.mixed_lengths
            else None
        )

    def _load(self, name: str) -> Any:
        start = time.perf_counter()
        graph = load_graph(
            self.dir / name,
            self.weights,
            self.spec,
            self.device,
            single_threaded=self.single_threaded,
        )
        self.load_seconds[name] = time.perf_counter() - start
        return graph

    def new_cache(self) -> tuple[Any, Any]:
        return new_cache(self.spec, self.device)

    def prefill(
        self, slots: Sequence[int], prompts: Sequence[Any], k_cache: Any, v_cache: Any
    ) -> tuple[Any, Any]:
        """Fill cache rows ``slots`` with ``prompts`` (lists of ids, or int64 tensors), at
        most ``spec.prefill_batch`` per call and all at the shortest prefill length that
        holds the longest of them: (logits [P, V], next_tokens [P])."""
        return self.run_prefill(self.prefill_inputs(slots, prompts), k_cache, v_cache)

    def run_prefill(self, inputs: tuple[Any, ...], k_cache: Any, v_cache: Any) -> tuple[Any, Any]:
        """Call the prefill graph of ``prefill_inputs``' length on them."""
        from pipeline.runtime.pending import to_device  # no sync with queued device work

        tokens = inputs[0]
        on = tuple(to_device(t, self.device) for t in inputs)
        return self.prefills[tokens.shape[1]](*on, k_cache, v_cache)

    def prefill_inputs(self, slots: Sequence[int], prompts: Sequence[Any]) -> tuple[Any, ...]:
        """The host tensors of one prefill call, checked: tokens [P, T] right-padded to the
        prefill length T, lengths [P], slots [P] (int64)."""
        import torch

        spec = self.spec
        lengths = self._checked(slots, prompts, spec.prefill_batch, "prefill")
        t = spec.prefill_length(max(lengths))
        tokens = torch.zeros((len(prompts), t), dtype=torch.int64)
        for r, p in enumerate(prompts):
            tokens[r, : lengths[r]] = torch.as_tensor(p, dtype=torch.int64).cpu()
        return (
            tokens,
            torch.tensor(lengths, dtype=torch.int64),
            torch.tensor(list(slots), dtype=torch.int64),
        )

    def mixed_inputs(
        self, slots: Sequence[int], prompts: Sequence[Any], count: int = 0
    ) -> tuple[Any, ...]:
        """The host tensors of a mixed call's prompts, checked: the stream [T] (the prompts
        end to end, padded to the shortest mixed length that holds them), lengths [P] and
        slots [P] (int64), with placeholders after the prompts up to ``count`` entries (a
        recorded call's fixed size: length 0, the last prompt's slot)."""
        import torch

        spec = self.spec
        lengths = self._checked(slots, prompts, spec.mixed_batch, "mixed")
        total = sum(lengths)
        t = spec.mixed_length(total)
        if t is None or (t > total and min(lengths) >= spec.seq):
            raise ValueError(
                f"prompts of {total} tokens in all: this bucket's mixed calls take up to "
                f"{max(spec.mixed_lengths, default=0)} (padding needs a prompt under {spec.seq})"
            )
        stream = torch.zeros((t,), dtype=torch.int64)
        stream[:total] = torch.cat([torch.as_tensor(p, dtype=torch.int64).cpu() for p in prompts])
        extra = max(count - len(prompts), 0)
        return (
            stream,
            torch.tensor(lengths + [0] * extra, dtype=torch.int64),
            torch.tensor(list(slots) + [slots[-1]] * extra, dtype=torch.int64),
        )

    def _checked(
        self, slots: Sequence[int], prompts: Sequence[Any], most: int, call: str
    ) -> list[int]:
        """The prompts' lengths, once each prompt fits the bucket and goes into a distinct
        slot of it, at most ``most`` of them (else one ValueError saying what it takes)."""
        spec = self.spec
        lengths = [len(p) for p in prompts]
        bad = not 1 <= len(prompts) <= most or len(set(slots)) != len(slots)
        if bad or len(slots) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts into slots {list(slots)}: this bucket's {call} calls "
                f"take 1..{most} prompts into distinct slots"
            )
        if (
            min(lengths) < 1
            or max(lengths) > spec.seq
            or not all(0 <= s < spec.batch for s in slots)
        ):
            raise ValueError(
                f"prompts of {lengths} tokens into slots {list(slots)}: this bucket takes "
                f"1..{spec.seq} tokens into slots 0..{spec.batch - 1}"
            )
        return lengths

    def prefill_rows(
        self, tokens: Any, lengths: Any, k_cache: Any, v_cache: Any
    ) -> tuple[Any, Any]:
        """Right-padded prompts [B', S'] with ``lengths`` [B'], row r into slot r:
        (logits [B', V], next_tokens [B']). Rows of one prefill length share calls (of at
        most ``prefill_batch`` prompts), so each prompt runs at its own length."""
        import torch

        n = [int(x) for x in lengths.tolist()]
        groups: dict[int, list[int]] = {}
        for r, length in enumerate(n):
            groups.setdefault(self.spec.prefill_length(length), []).append(r)
        logits: list[Any] = [None] * len(n)
        nxt: list[Any] = [None] * len(n)
        step = self.spec.prefill_batch
        for rows in groups.values():
            for a in range(0, len(rows), step):
                part = rows[a : a + step]
                out = self.prefill(part, [tokens[r, : n[r]] for r in part], k_cache, v_cache)
                for i, r in enumerate(part):
                    logits[r], nxt[r] = out[0][i], out[1][i]
        return torch.stack(logits), torch.stack(nxt)


def _checked_key_positions(decode: Any, spec: GraphSpec) -> Any:
    """``decode`` refusing a key_positions length it was not built for: AOTInductor does not
    check input shapes, so a static graph (``attend_prefix`` false) given fewer positions
    would read past the end of them."""
    low = 2 if spec.attend_prefix and spec.seq > 2 else spec.seq  # as in key_tiers

    def checked(*args: Any) -> Any:
        n = args[-1].shape[0]
        if not low <= n <= spec.seq:
            raise ValueError(
                f"key_positions of length {n}: this decode graph takes {low}..{spec.seq} "
                "(GraphSpec.key_tiers lists the lengths to use)"
            )
        return decode(*args)

    return checked
