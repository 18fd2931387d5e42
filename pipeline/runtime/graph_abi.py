"""The contract between compiled cpu/cuda buckets and whoever runs them (runtime, parity).

A bucket directory holds::

    graph.json           GraphSpec below: shapes, dtype, device, the constants' names
    prefill.pt2          AOTInductor package: prefill at the bucket's sequence length S
    prefill_<T>.pt2      the same at each shorter prefill length T (``prefill_lengths``)
    decode.pt2           AOTInductor package
    weights.safetensors  every constant of every graph, by name (identical in every bucket
                         of a release, so the store keeps one blob and a loader one copy)

A bucket of batch B is B *slots*: cache rows that hold one sequence each. Prefill fills the
slots it is given and leaves the others alone; decode steps every row at its own position.
So a request joins a running bucket (a prefill into a free slot between two steps) and
leaves it (its row is simply no longer read), which is what an iteration-level server needs
(``pipeline.server.engine``), and what optimum-neuron's continuous-batching exports do with
their ``seq_ids``.

Every graph takes the KV caches as inputs and updates them **in place**; the caller owns
them (allocate with ``new_cache``), so all graphs share one cache without copies and CUDA
graphs can capture decode with fixed addresses. Each returns (logits, next_tokens): fp32
logits for a sampler to read, and their greedy argmax computed inside the graph, so a
greedy step needs no kernel of its own and a sampling step needs no new graph.

``prefill(tokens, lengths, slots, k_cache, v_cache) -> (logits, next_tokens)``
    tokens      int64 [P, T]  P prompts (1 ≤ P ≤ ``prefill_batch``), right-padded (any pad
                              id); T one of the bucket's prefill lengths
    lengths     int64 [P]     their real tokens, 1..T
    slots       int64 [P]     the distinct cache rows to fill, 0..B-1
    logits      fp32  [P, V]  for each prompt's last real token (position length-1)
    next_tokens int64 [P]     argmax of logits
    writes positions 0..T-1 of the rows ``slots`` only (pad positions hold junk that decode
    overwrites before it reads them); each prompt attends only itself

``decode(tokens, positions, k_cache, v_cache, key_positions) -> (logits, next_tokens)``
    tokens      int64 [B, 1]  one new token per row
    positions   int64 [B]     where it goes: the prompt's length for the first step, then
                              +1 each step; a row not in use: any position < S (0), its
                              outputs ignored and its writes confined to its own free row
    key_positions int64 [S']  0..S'-1 with max(positions) < S' ≤ S: attention reads only
                              these cache positions (a dynamic dimension: one package for
                              every S'; callers use a few, ``key_tiers``)
    logits      fp32  [B, V]
    next_tokens int64 [B]     argmax of logits
    attends to cache positions 0..positions (inclusive) of its own row

Weights: Hugging Face names, with q/k/v and gate/up stacked into ``qkv_proj`` and
``gate_up_proj`` (``pipeline.compile.decoder.fuse_checkpoint``).

Bounds are the caller's job: positions must be < S and token ids < V. The kernels check
indices, and a failed check aborts the process rather than raising.

caches: ``dtype`` [L, S, B, KV, D] each (KV after GQA padding; position-major, so the
positions a decode step reads are one dense block).

Weights are not inside the packages (AOTInductor ``package_constants_in_so=False``): load
them once with ``load_weights`` and bind them to each graph with ``load_graph``, which calls
the loader's ``load_constants(..., user_managed=True)`` so every graph shares the same
tensors. Nothing here imports torch until it is called.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# 2: fused qkv_proj / gate_up_proj weights; next_tokens output. 3: decode's key_positions.
# 4: slots: prefill fills the cache rows it is given, at one of several prompt lengths
ABI_VERSION = 4
GRAPH_FILE = "graph.json"
PREFILL_FILE = "prefill.pt2"  # at the bucket's own length; shorter ones: prefill_file(T)
DECODE_FILE = "decode.pt2"
WEIGHTS_FILE = "weights.safetensors"
PREFILL_INPUTS = ("tokens", "lengths", "slots", "k_cache", "v_cache")
DECODE_INPUTS = ("tokens", "positions", "k_cache", "v_cache", "key_positions")
SMALLEST_TIER = 64  # the shortest cache prefix a decode step attends
OUTPUTS = ("logits", "next_tokens")  # fp32 [B, V]; int64 [B], the argmax


@dataclass(frozen=True)
class GraphSpec:
    batch: int
    seq: int
    layers: int
    kv_heads: int  # after GQA padding
    head_dim: int
    vocab: int
    dtype: str  # cache and weights dtype: float32 | bfloat16 | float16
    device: str  # "cpu" or "cuda": where the packages run
    # constant name the graphs ask for -> name in weights.safetensors (tied embeddings)
    aliases: dict[str, str] = field(default_factory=dict)
    abi: int = ABI_VERSION
    prefill_inputs: tuple[str, ...] = PREFILL_INPUTS
    decode_inputs: tuple[str, ...] = DECODE_INPUTS
    outputs: tuple[str, ...] = OUTPUTS
    # cuda: the GPU architecture the kernels were built and tuned for ("sm_90"); "" on cpu
    cuda_arch: str = ""
    # constant name -> {"dtype", "shape"} the graphs were built for. Weights are cached and
    # published apart from the graphs (docs/finetune.md), so a loader checks them against
    # this before binding (user-managed constants are used in place, unchecked). Empty in
    # graph.json files written before it existed.
    constants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # decode takes any key_positions length 2..S (False: the compiler could not make that
    # length dynamic for this model, e.g. fp32 attention kernels that pad it: only S)
    attend_prefix: bool = True
    # the prompt lengths T with a prefill package, rising to ``seq`` (empty: just ``seq``)
    prefill_lengths: tuple[int, ...] = ()
    # prompts one prefill call takes: 1..this many (the batch; 1 where export could not make
    # that size dynamic)
    prefill_batch: int = 1

    def __post_init__(self) -> None:
        if not self.prefill_lengths:
            object.__setattr__(self, "prefill_lengths", (self.seq,))

    def prefill_length(self, prompt: int) -> int:
        """The shortest prefill length that holds a prompt of ``prompt`` tokens."""
        return next((n for n in self.prefill_lengths if n >= prompt), self.seq)

    @property
    def key_tiers(self) -> tuple[int, ...]:
        """The key_positions lengths a runtime uses with these graphs."""
        return key_tiers(self.seq) if self.attend_prefix and self.seq > 2 else (self.seq,)

    @property
    def cache_shape(self) -> tuple[int, int, int, int, int]:
        # position-major: the first S' positions of a layer are one dense block
        return (self.layers, self.seq, self.batch, self.kv_heads, self.head_dim)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def read(cls, bucket_dir: Path) -> GraphSpec:
        data: dict[str, Any] = json.loads((Path(bucket_dir) / GRAPH_FILE).read_text())
        if data.get("abi") != ABI_VERSION:
            from pipeline.errors import RuntimeMismatchError

            raise RuntimeMismatchError(
                str(bucket_dir),
                f"compiled graphs of ABI {data.get('abi')}; this inf2-pipeline runs ABI "
                f"{ABI_VERSION}",
                "compile and publish the release again with this version",
            )
        for k in ("prefill_inputs", "decode_inputs", "outputs", "prefill_lengths"):
            data[k] = tuple(data.get(k, ()))
        return cls(**data)


def prefill_file(length: int, seq: int | None = None) -> str:
    """The package of the prefill graph at ``length`` tokens: ``prefill.pt2`` at the bucket's
    own length ``seq`` (or when ``seq`` is not given and the caller means that one)."""
    return PREFILL_FILE if seq is None or length == seq else f"prefill_{length}.pt2"


def key_tiers(seq: int, smallest: int = SMALLEST_TIER) -> tuple[int, ...]:
    """The lengths S' a runtime passes as ``key_positions``: powers of two from ``smallest``,
    then the bucket's length. A step uses the shortest that holds every position, so its
    attention reads at most twice the filled cache; few lengths, so few CUDA graphs."""
    tiers, n = [], smallest
    while n < seq:
        tiers.append(n)
        n *= 2
    return (*tiers, seq)


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
    """cpu packages target a portable ISA (x86-64-v3) on purpose; torch warns at every load
    that the build machine had more. Drop just that notice."""
    import logging

    log = logging.getLogger("torch.export.pt2_archive._package")
    if not any(isinstance(f, _IsaNotice) for f in log.filters):
        log.addFilter(_IsaNotice())


class _IsaNotice:
    def filter(self, record: Any) -> bool:
        return "AOTI_CPU_ISA" not in record.getMessage()


def cuda_arch(device: Any = None) -> str:
    """The GPU's architecture as nvcc names it: sm_90 on an H100/H200."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


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
        args = (self.weights, self.spec, self.device)
        # prompt length T -> the prefill graph at T
        self.prefills = {
            n: load_graph(
                self.dir / prefill_file(n, self.spec.seq), *args, single_threaded=single_threaded
            )
            for n in self.spec.prefill_lengths
        }
        self.decode = _checked_key_positions(
            load_graph(self.dir / DECODE_FILE, *args, single_threaded=single_threaded), self.spec
        )

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
        lengths = [len(p) for p in prompts]
        bad = not 1 <= len(prompts) <= spec.prefill_batch or len(set(slots)) != len(slots)
        if bad or len(slots) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts into slots {list(slots)}: this bucket prefills "
                f"1..{spec.prefill_batch} prompts per call into distinct slots"
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
        t = spec.prefill_length(max(lengths))
        tokens = torch.zeros((len(prompts), t), dtype=torch.int64)
        for r, p in enumerate(prompts):
            tokens[r, : lengths[r]] = torch.as_tensor(p, dtype=torch.int64).cpu()
        return (
            tokens,
            torch.tensor(lengths, dtype=torch.int64),
            torch.tensor(list(slots), dtype=torch.int64),
        )

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
