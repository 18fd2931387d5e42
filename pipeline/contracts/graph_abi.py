"""The contract between compiled cpu/cuda buckets and whoever runs them (runtime, parity):
what compile writes and the runtime reads.

A bucket directory holds::

    graph.json           GraphSpec below: shapes, dtype, device, the constants' names
    prefill.pt2          AOTInductor package: prefill at the bucket's sequence length S
    prefill_<T>.pt2      the same at each shorter prefill length T (``prefill_lengths``)
    decode.pt2           AOTInductor package
    mixed.pt2            a decode step and prompts packed into one stream, in one call
                         (where ``mixed_lengths`` names any; none by default on cpu)
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

``mixed(tokens, positions, prompt_tokens, prompt_lengths, prompt_slots, k_cache, v_cache,
key_positions) -> (logits, next_tokens)``
    decode's step of every row and P prompts packed end to end into one stream, in one pass
    over the weights: the matrix products take the B step rows and the T stream positions
    together; the step attends its rows' cache prefix, each prompt only itself.
    tokens, positions, key_positions: decode's
    prompt_tokens  int64 [T]  the prompts in order, then padding (any id) up to T; T is a
                              dynamic size, 2..max(``mixed_lengths``); callers pad to one
                              of ``mixed_lengths`` (the lengths CUDA graphs are recorded at)
    prompt_lengths int64 [P]  each prompt's tokens, 1..S; 0: a placeholder (after the
                              prompts), which owns no position and repeats the output of
                              the prompt before it. Σ ≤ T; where Σ < T the shortest prompt
                              is < S (its row takes the padding, past its prompt)
    prompt_slots   int64 [P]  the rows they fill: distinct, rows the step does not use
                              (a placeholder: the row of the prompt before it)
    P is 1..``mixed_batch``. The step's cache writes come first, then the stream's: a free
    row's step writes at its held position, and a prompt filling that row overwrites it.
    logits      fp32  [B + P, V]  the B step rows, then each prompt's last token
    next_tokens int64 [B + P]     argmax of logits

Weights: Hugging Face names, with q/k/v and gate/up stacked into ``qkv_proj`` and
``gate_up_proj`` (``pipeline.contracts.checkpoint_layout``).

Bounds are the caller's job: positions must be < S and token ids < V. The kernels check
indices, and a failed check aborts the process rather than raising.

caches: ``dtype`` [L, S, B, KV, D] each (KV after GQA padding; position-major, so the
positions a decode step reads are one dense block).

Weights are not inside the packages (AOTInductor ``package_constants_in_so=False``): the
runtime loads them once and binds them to every graph (``pipeline.runtime.graph_loading``).
Nothing here imports torch until it is called.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contracts.bucket import mixed_length

# 2: fused qkv_proj / gate_up_proj weights; next_tokens output. 3: decode's key_positions.
# 4: slots: prefill fills the cache rows it is given, at one of several prompt lengths.
# 5: mixed graphs (a step and prompts in one call); graph.json's mixed_lengths, mixed_batch
# 6: a mixed graph's prompts packed into one stream of any length (mixed.pt2), not padded
# to a common prefill length (mixed_<T>.pt2)
ABI_VERSION = 6
GRAPH_FILE = "graph.json"
PREFILL_FILE = "prefill.pt2"  # at the bucket's own length; shorter ones: prefill_file(T)
DECODE_FILE = "decode.pt2"
MIXED_FILE = "mixed.pt2"
WEIGHTS_FILE = "weights.safetensors"
PREFILL_INPUTS = ("tokens", "lengths", "slots", "k_cache", "v_cache")
DECODE_INPUTS = ("tokens", "positions", "k_cache", "v_cache", "key_positions")
MIXED_INPUTS = (
    "tokens",
    "positions",
    "prompt_tokens",
    "prompt_lengths",
    "prompt_slots",
    "k_cache",
    "v_cache",
    "key_positions",
)
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
    # the packed stream lengths a mixed call is padded to (empty: no mixed graph), and the
    # prompts one mixed call takes (1..this many; at most batch - 1: a prompt needs a free row)
    mixed_lengths: tuple[int, ...] = ()
    mixed_batch: int = 0
    mixed_inputs: tuple[str, ...] = MIXED_INPUTS

    def __post_init__(self) -> None:
        if not self.prefill_lengths:
            object.__setattr__(self, "prefill_lengths", (self.seq,))

    def mixed_length(self, tokens: int) -> int | None:
        """The shortest mixed length that holds a stream of ``tokens`` (None: none does)."""
        return mixed_length(self.mixed_lengths, tokens)

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
        for k in (
            "prefill_inputs",
            "decode_inputs",
            "mixed_inputs",
            "outputs",
            "prefill_lengths",
            "mixed_lengths",
        ):
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


def cuda_arch(device: Any = None) -> str:
    """The GPU's architecture as nvcc names it: sm_90 on an H100/H200."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"
