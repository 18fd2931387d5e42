"""Real AOTInductor packages: each bucket's prefill and decode graphs reproduce eager
Hugging Face logits for prompts padded into the bucket (fp32).

The demo release is compiled once per session (``compiled_store`` in conftest.py); the
decoder itself is also checked eagerly against Hugging Face for each architecture.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers

from pipeline.compile import argmax
from pipeline.compile import decoder as dec
from pipeline.compile.scheduler import compile_release
from pipeline.contracts import checkpoint_layout
from pipeline.contracts.graph_abi import GRAPH_FILE, GraphSpec
from pipeline.plan.config import load_config
from pipeline.runtime.graph_loading import new_cache
from pipeline.tiny_model import write_tiny_model

ATOL = 1e-4  # fp32; measured differences are ~1e-5
STEPS = 3


def prompts_for(batch: int, seq: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of different lengths, leaving room for STEPS decode steps."""
    g = torch.Generator().manual_seed(seed + batch * 1000 + seq)
    lengths = [max(1, (seq - STEPS) * (i + 1) // batch) for i in range(batch)]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([s])).logits[0, -1] for s in seqs])


def check_against_hf(
    prefill, decode, hf, seqs, seq_len, cache, device="cpu", attend_prefix: bool = True
):
    """Right-pad ``seqs`` into [B, seq_len], prefill, then STEPS greedy decode steps; every
    step's logits must match Hugging Face run on the unpadded sequences. ``attend_prefix``
    false: the decode graph attends the whole bucket (GraphSpec.attend_prefix)."""
    seqs = [list(s) for s in seqs]
    tokens = torch.zeros((len(seqs), seq_len), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    logits, nxt = prefill(tokens.to(device), lengths.to(device), *cache)
    worst = 0.0
    for step in range(STEPS + 1):
        ref = hf_last_logits(hf, seqs)
        worst = max(worst, (logits.cpu() - ref).abs().max().item())
        assert torch.equal(logits.cpu().argmax(-1), ref.argmax(-1))
        assert torch.equal(nxt.cpu(), ref.argmax(-1))  # the graph's own argmax output
        if step == STEPS:
            break
        nxt = nxt.cpu()
        positions = torch.tensor([len(s) for s in seqs])
        for s, t in zip(seqs, nxt.tolist(), strict=True):
            s.append(t)
        # attend the tightest prefix: a new length every step, one compiled graph
        keys = torch.arange(int(positions.max()) + 1 if attend_prefix else seq_len, device=device)
        logits, nxt = decode(nxt[:, None].to(device), positions.to(device), *cache, keys)
    assert worst <= ATOL, worst
    return worst


@pytest.fixture(scope="module")
def hf_tiny(tiny_checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    ).eval()


def test_every_compiled_bucket_reproduces_hugging_face(compiled_store, hf_tiny):
    from pipeline.runtime.graph_loading import BucketGraphs

    config, _ = compiled_store
    release = load_config(config)
    weights = None
    for bucket in release.buckets:
        graphs = BucketGraphs(config.parent / "work" / "buckets" / bucket.name, weights=weights)
        weights = graphs.weights  # one copy of the weights for every bucket
        assert graphs.spec.kv_heads == 4  # 2 KV heads replicated for tp 4
        seqs = prompts_for(bucket.batch, bucket.seq, graphs.spec.vocab)
        check_against_hf(
            graphs.prefill_rows,
            graphs.decode,
            hf_tiny,
            seqs,
            bucket.seq,
            graphs.new_cache(),
            attend_prefix=graphs.spec.attend_prefix,
        )


def test_compiled_release_shares_one_weights_blob_and_describes_its_graphs(compiled_store):
    from pipeline.store import open_store
    from pipeline.store.cache import read_cache_entry

    config, store_dir = compiled_store
    store = open_store(str(store_dir))
    entries = [read_cache_entry(store, Path(k).stem) for k in store.list("cache/")]
    graphs = [e for e in entries if e.kind == "graphs"]
    assert sorted(e.bucket for e in graphs) == ["b1_s32", "b1_s64", "b2_s32", "b2_s64"]
    assert not any(f.path == "weights.safetensors" for e in graphs for f in e.files)
    (weights,) = [e for e in entries if e.kind == "weights"]  # one set, every bucket binds it
    assert [f.path for f in weights.files] == ["weights.safetensors"]
    spec = GraphSpec.read(config.parent / "work" / "buckets" / "b2_s64")
    assert (spec.batch, spec.seq, spec.layers, spec.dtype) == (2, 64, 2, "float32")
    # what the weights must look like, for the check at load time
    assert spec.constants["model.embed_tokens.weight"] == {"dtype": "float32", "shape": [512, 64]}
    assert json.loads((config.parent / "work" / "buckets" / "b2_s64" / GRAPH_FILE).read_text())


def test_unchanged_rerun_of_the_real_release_compiles_nothing(compiled_store):
    config, _ = compiled_store
    start = time.monotonic()
    report = compile_release(load_config(config), jobs=2, workdir=config.parent / "work")
    assert [r.status for r in report.results] == ["cached"] * 4
    assert time.monotonic() - start < 10


# --- the decoder, eagerly, against Hugging Face (no compile) -------------------------------


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {}),
        ("mistral", {"sliding_window": 8}),  # prompts longer than the window
        ("qwen2", {}),  # q/k/v biases
        ("llama", {"tie_word_embeddings": True}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
    ],
)
def test_eager_decoder_matches_hugging_face(tmp_path, arch, extra):
    ckpt = write_tiny_model(tmp_path / arch, arch=arch, heads=8, kv_heads=2)
    if extra:
        cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**cfg, **extra}))
        if extra.get("tie_word_embeddings"):
            from safetensors.torch import load_file, save_file

            state = load_file(ckpt / "model.safetensors")
            state.pop("lm_head.weight")
            save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    module = dec.from_checkpoint(ckpt, dec.Prefill)

    def prefill(tokens, lengths, k, v):  # every prompt at once, row r into slot r
        return module(tokens, lengths, torch.arange(len(lengths)), k, v)

    decode = dec.from_checkpoint(ckpt, dec.Decode)
    seq_len = 24
    spec = GraphSpec(2, seq_len, 2, 2, 8, 512, "float32", "cpu")
    with torch.no_grad():
        check_against_hf(
            prefill, decode, hf, prompts_for(2, seq_len, 512), seq_len, new_cache(spec)
        )


# --- the cuda backend (GPU machines only) ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_bucket_reproduces_hugging_face(tiny_checkpoint, write_config, hf_tiny):
    from pipeline.runtime.graph_loading import BucketGraphs

    config = write_config(
        """
        model: {name: tiny, checkpoint: "{ckpt}", dtype: float32}
        target: {backend: cuda, instance_type: inf2.24xlarge, tp_degree: 4}
        buckets: {batch_sizes: [2], sequence_lengths: [64]}
        compiler: {auto_cast_type: fp32}
        store: store
        """
    )
    report = compile_release(load_config(config), workdir=config.parent / "work")
    assert not report.failed, report.failed[0].error
    graphs = BucketGraphs(config.parent / "work" / "buckets" / "b2_s64")
    assert graphs.spec.device == "cuda"
    seqs = prompts_for(2, 64, graphs.spec.vocab)
    check_against_hf(
        graphs.prefill_rows,
        graphs.decode,
        hf_tiny,
        seqs,
        64,
        graphs.new_cache(),
        device="cuda",
        attend_prefix=graphs.spec.attend_prefix,  # fp32 on an H200: false (the whole bucket)
    )


@pytest.mark.parametrize("vocab", [128256, 32000, 151936, 8191, 100])
def test_greedy_token_is_the_first_maximum(vocab):
    """The two-stage argmax of the graphs picks what argmax picks, ties included (the first
    index of the maximum), whether or not the vocabulary is sliced."""
    g = torch.Generator().manual_seed(vocab)
    tied = torch.randint(0, 4, (4, vocab), generator=g).float()  # every row has many ties
    tied[1, -1] = 9.0  # the maximum alone, in the last slice
    spread = torch.randn(2, 1, vocab, generator=g)
    spread[1, 0, [vocab // 3, vocab - 1]] = float("nan")  # argmax takes the first NaN
    for logits in (tied, spread):
        assert torch.equal(argmax.first_argmax(logits), logits.argmax(-1))
    assert (argmax.argmax_slices(vocab) > 1) == (vocab >= 8192)


def test_greedy_token_compiled_is_the_first_maximum():
    """The same through inductor (the tiny test models' vocabularies are too small to slice)."""
    compiled = torch.compile(argmax.first_argmax, dynamic=False)
    logits = torch.randint(0, 4, (3, 128256), generator=torch.Generator().manual_seed(0)).float()
    logits[2, 128000] = 7.0
    assert torch.equal(compiled(logits), logits.argmax(-1))


def test_fused_projections_round_trip_and_keep_row_order(tmp_path):
    """q/k/v and gate/up stack in that order (the split in Attention.forward relies on it);
    unfusing gives Hugging Face's tensors back, also with GQA-padded head counts; a
    projection whose siblings are missing is left for the caller's name check."""
    from pipeline.plan.checkpoint import read_checkpoint

    ckpt = write_tiny_model(tmp_path / "m", arch="qwen2", heads=8, kv_heads=2)  # qkv biases
    hf = read_checkpoint(ckpt)
    fused = checkpoint_layout.fuse_checkpoint(dict(hf))
    pre = "model.layers.1."
    assert not any("q_proj" in k or "gate_proj" in k for k in fused)
    qkv = fused[pre + "self_attn.qkv_proj.weight"]
    q_rows = hf[pre + "self_attn.q_proj.weight"].shape[0]
    assert torch.equal(qkv[:q_rows], hf[pre + "self_attn.q_proj.weight"])
    assert torch.equal(qkv[-q_rows // 4 :], hf[pre + "self_attn.v_proj.weight"])
    assert torch.equal(
        fused[pre + "self_attn.qkv_proj.bias"][:q_rows], hf[pre + "self_attn.q_proj.bias"]
    )
    assert torch.equal(
        fused[pre + "mlp.gate_up_proj.weight"][-1], hf[pre + "mlp.up_proj.weight"][-1]
    )
    back = checkpoint_layout.unfuse_checkpoint(fused)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)

    # padded: 12 query heads (o_proj columns) and 4 KV heads of head_dim 8 in one qkv_proj
    padded = {
        "l.self_attn.qkv_proj.weight": torch.randn((12 + 2 * 4) * 8, 16),
        "l.self_attn.o_proj.weight": torch.randn(16, 12 * 8),
    }
    parts = checkpoint_layout.unfuse_checkpoint(padded)
    assert [parts[f"l.self_attn.{p}_proj.weight"].shape[0] for p in "qkv"] == [96, 32, 32]

    partial = {k: v for k, v in hf.items() if "k_proj" not in k}
    left = checkpoint_layout.fuse_checkpoint(partial)
    assert pre + "self_attn.q_proj.weight" in left and pre + "mlp.gate_up_proj.weight" in left


def test_decode_attends_the_whole_bucket_when_its_length_cannot_be_dynamic(
    tiny_checkpoint, tmp_path, monkeypatch, export_only
):
    """Where export cannot make the attended length dynamic (on cuda, fp32 attention falls
    back to kernels that fix it), decode is exported for the whole bucket and graph.json
    says so, which is what a session reads to attend all S positions. (Exported for real,
    not compiled: what is decided here is export's.)"""
    from torch._dynamo.exc import UserError, UserErrorType

    from pipeline.compile.backends.aoti import CpuBackend
    from pipeline.compile.backends.base import BucketJob
    from pipeline.contracts.bucket import Bucket

    real = torch.export.export

    def export(module, args, *, dynamic_shapes=None, strict=True):
        if dynamic_shapes is not None:
            raise UserError(UserErrorType.CONSTRAINT_VIOLATION, "Constraints violated (attended)!")
        return real(module, args, strict=strict)

    monkeypatch.setattr(torch.export, "export", export)
    out = tmp_path / "out"
    out.mkdir()
    job = BucketJob(tiny_checkpoint, Bucket(1, 16), 1, {}, "float32", (), "fp32", out)
    CpuBackend().compile(job)
    spec = GraphSpec.read(out)
    assert not spec.attend_prefix and spec.key_tiers == (16,)
    assert export_only == ["prefill.pt2", "decode.pt2"]
    assert GraphSpec(1, 2048, 2, 2, 8, 512, "float32", "cpu").key_tiers[:2] == (64, 128)


def test_decode_refuses_key_positions_its_graph_was_not_built_for():
    """AOTInductor does not check input shapes: a static decode graph given fewer key
    positions than its bucket would read past them, so BucketGraphs refuses that length."""
    from pipeline.runtime.graph_loading import _checked_key_positions

    static = GraphSpec(1, 16, 2, 2, 8, 512, "float32", "cpu", attend_prefix=False)
    dynamic = GraphSpec(1, 16, 2, 2, 8, 512, "float32", "cpu")
    ran = _checked_key_positions(lambda *args: "ran", static)
    assert ran(None, torch.arange(16)) == "ran"
    with pytest.raises(ValueError, match=r"length 15: this decode graph takes 16\.\.16"):
        ran(None, torch.arange(15))
    ran = _checked_key_positions(lambda *args: "ran", dynamic)
    assert [ran(None, torch.arange(n)) for n in (2, 9, 16)] == ["ran"] * 3
    for n in (1, 17):
        with pytest.raises(ValueError, match=rf"length {n}: this decode graph takes 2\.\.16"):
            ran(None, torch.arange(n))
    one = GraphSpec(1, 1, 2, 2, 8, 512, "float32", "cpu")  # too short for a dynamic length
    assert (
        one.key_tiers == (1,)
        and _checked_key_positions(lambda *a: "ran", one)(None, torch.arange(1)) == "ran"
    )
