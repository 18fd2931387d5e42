"""GQA head padding on real (tiny) checkpoints: same logits, whole heads per rank, atomic writes.

Equivalence runs in memory over every shape × tp × strategy (the same ``pad_tensor`` and
``padded_config`` that ``pad_checkpoint`` uses); a subset round-trips through files and
``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile import gqa_pad
from pipeline.compile.gqa_pad import CONFIG_KEY, pad_checkpoint, pad_tensor, padded_config
from pipeline.errors import CheckpointError, InputError, UnsupportedArchitectureError
from pipeline.plan.checkpoint import ModelShape, read_shape
from pipeline.plan.gqa import GqaPlan, plan_gqa

transformers.logging.set_verbosity_error()

ARCHS = ("llama", "mistral", "qwen2")
SHAPES = ((8, 2), (32, 8), (40, 8), (28, 4), (16, 8))  # query/KV heads of real models
TPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
HEAD_DIM, VOCAB, TOL = 8, 64, 1e-4
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
runner = CliRunner()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny: thread hand-off costs ~100x the math on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def strategies(kv: int, tp: int) -> list[str]:
    """Every strategy that applies: replication needs tp to be a multiple of the KV heads."""
    return ["auto", "convert_to_mha"] + (["replicate_to_tp_degree"] if tp % kv == 0 else [])


def all_plans(q: int, kv: int) -> list[GqaPlan]:
    return [plan_gqa(q, kv, tp, s) for tp in TPS for s in strategies(kv, tp)]


@functools.cache
def original(arch: str, q: int, kv: int, rope: str = "default"):
    """A 1-layer model with every parameter random (Qwen2's q/k/v biases too) and its shape."""
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[arch]
    extra = {"rope_parameters": LLAMA31_ROPE} if rope == "llama3" else {}
    config = cls(
        vocab_size=VOCAB,
        hidden_size=2 * q,  # LlamaConfig wants hidden % heads == 0 for the original
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=q,
        num_key_value_heads=kv,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(q * 100 + kv)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model, _shape(model.config.to_dict())


def _shape(config: dict) -> ModelShape:
    # read_shape is what pad_checkpoint uses; feed it the same config.json text.
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        return read_shape(Path(d))


def padded_model(model, shape: ModelShape, plan: GqaPlan, o_proj_pad_fill: float | None = None):
    """The padded model built in memory exactly as pad_checkpoint builds its files."""
    cfg = padded_config(model.config.to_dict(), shape, plan)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    padded = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    state = {k: pad_tensor(k, v, shape, plan) for k, v in model.state_dict().items()}
    if o_proj_pad_fill is not None:  # simulate "padding Q alone": pad columns not zeroed
        pads = [i for i, s in enumerate(plan.q_slot_sources()) if s is None]
        for k in state:
            if k.endswith("o_proj.weight"):
                for slot in pads:
                    state[k][:, slot * HEAD_DIM : (slot + 1) * HEAD_DIM] = o_proj_pad_fill
    padded.load_state_dict(state, strict=True)
    return padded


def tokens(n: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(0))


def max_logit_diff(a, b) -> float:
    with torch.no_grad():
        x = tokens()
        return (a(x).logits - b(x).logits).abs().max().item()


# ---------------------------------------------------------------- equivalence, in memory


@pytest.mark.parametrize("q_kv", SHAPES, ids=lambda s: f"{s[0]}q-{s[1]}kv")
@pytest.mark.parametrize("arch", ARCHS)
def test_padded_logits_equal_original_for_every_tp_and_strategy(arch, q_kv):
    model, shape = original(arch, *q_kv)
    worst = {}
    for plan in all_plans(*q_kv):
        padded = padded_model(model, shape, plan)
        assert padded.config.num_attention_heads == plan.padded_q_heads
        assert padded.config.num_key_value_heads == plan.padded_kv_heads
        worst[(plan.tp, plan.strategy)] = max_logit_diff(model, padded)
    bad = {k: v for k, v in worst.items() if v > TOL}
    assert not bad, f"{arch} {q_kv}: logits differ (tp, strategy) → max abs diff: {bad}"


# ------------------------------------------------------- simulated tensor parallelism


def attention_split_across_ranks(attn, state: dict, plan: GqaPlan, h, cos, sin):
    """Each rank computes attention from only its own slices; the sum is the all-reduce."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    prefix = "model.layers.0.self_attn."
    qpr, kvpr, d = plan.q_heads_per_rank, plan.kv_heads_per_rank, HEAD_DIM
    assert qpr % kvpr == 0, "a rank's query heads must group evenly over its KV heads"
    b, s, _ = h.shape
    total = torch.zeros_like(h)
    for r in range(plan.tp):
        qs, kvs = slice(r * qpr * d, (r + 1) * qpr * d), slice(r * kvpr * d, (r + 1) * kvpr * d)

        def proj(name, rows, heads):
            w, bias = state[prefix + name + ".weight"][rows], state.get(prefix + name + ".bias")
            out = F.linear(h, w, None if bias is None else bias[rows])
            return out.view(b, s, heads, d).transpose(1, 2)

        q, k, v = proj("q_proj", qs, qpr), proj("k_proj", kvs, kvpr), proj("v_proj", kvs, kvpr)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(qpr // kvpr, 1), v.repeat_interleave(qpr // kvpr, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
        total += F.linear(
            a.transpose(1, 2).reshape(b, s, qpr * d), state[prefix + "o_proj.weight"][:, qs]
        )
    if attn.o_proj.bias is not None:  # a row-parallel bias is added once, after the all-reduce
        total += attn.o_proj.bias
    return total


@pytest.mark.parametrize("q_kv", SHAPES, ids=lambda s: f"{s[0]}q-{s[1]}kv")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases split with heads
def test_ranks_holding_only_their_heads_reproduce_the_original_attention(arch, q_kv):
    model, shape = original(arch, *q_kv)
    attn = model.model.layers[0].self_attn
    h = torch.randn(2, 6, shape.hidden, generator=torch.Generator().manual_seed(1))
    cos, sin = model.model.rotary_emb(h, torch.arange(6)[None])
    with torch.no_grad():
        expected, _ = attn(h, position_embeddings=(cos, sin), attention_mask=None)
        for plan in all_plans(*q_kv):
            state = {k: pad_tensor(k, v, shape, plan) for k, v in model.state_dict().items()}
            got = attention_split_across_ranks(attn, state, plan, h, cos, sin)
            diff = (got - expected).abs().max().item()
            assert diff <= TOL, f"tp {plan.tp} {plan.strategy}: max abs diff {diff}"


# --------------------------------------------------------------- why o_proj must be zero


@pytest.mark.parametrize(
    ("q_kv", "tp", "padding"), [((32, 8), 24, "interleaved"), ((32, 8), 12, "tail")]
)
def test_padded_slots_are_zero_in_q_and_o_proj_and_real_slots_keep_their_head(q_kv, tp, padding):
    model, shape = original("qwen2", *q_kv)
    plan = plan_gqa(*q_kv, tp)
    assert plan.q_padding == padding
    sd, d = model.state_dict(), HEAD_DIM
    pre = "model.layers.0.self_attn."
    q_w = pad_tensor(pre + "q_proj.weight", sd[pre + "q_proj.weight"], shape, plan)
    q_b = pad_tensor(pre + "q_proj.bias", sd[pre + "q_proj.bias"], shape, plan)
    o_w = pad_tensor(pre + "o_proj.weight", sd[pre + "o_proj.weight"], shape, plan)
    k_w = pad_tensor(pre + "k_proj.weight", sd[pre + "k_proj.weight"], shape, plan)
    for slot, src in enumerate(plan.q_slot_sources()):
        rows = slice(slot * d, (slot + 1) * d)
        if src is None:
            assert not q_w[rows].any() and not q_b[rows].any() and not o_w[:, rows].any()
        else:
            orig = slice(src * d, (src + 1) * d)
            assert torch.equal(q_w[rows], sd[pre + "q_proj.weight"][orig])
            assert torch.equal(o_w[:, rows], sd[pre + "o_proj.weight"][:, orig])
    for slot, src in enumerate(plan.kv_slot_sources()):
        rows = slice(slot * d, (slot + 1) * d)
        expect = sd[pre + "k_proj.weight"][src * d : (src + 1) * d] if src is not None else 0
        assert torch.equal(k_w[rows], torch.zeros_like(k_w[rows]) + expect)


def test_padding_q_alone_adds_the_mean_of_v_and_changes_the_logits():
    model, shape = original("llama", 32, 8)
    plan = plan_gqa(32, 8, 24)  # 48 query slots, 16 of them padding
    assert max_logit_diff(model, padded_model(model, shape, plan)) <= TOL
    buggy = padded_model(model, shape, plan, o_proj_pad_fill=0.3)
    assert max_logit_diff(model, buggy) > 1e-2

    # Why: a zero query scores every key 0, so it averages V uniformly over the causal prefix.
    pad = plan.q_slot_sources().index(None)
    kv_slot = pad // (plan.padded_q_heads // plan.padded_kv_heads)
    state = {k: pad_tensor(k, v, shape, plan) for k, v in model.state_dict().items()}
    h = torch.randn(1, 5, shape.hidden)
    v = F.linear(h, state["model.layers.0.self_attn.v_proj.weight"]).view(1, 5, -1, HEAD_DIM)
    v = v[:, :, kv_slot]
    q = torch.zeros(1, 1, 5, HEAD_DIM)
    a = F.scaled_dot_product_attention(q, v[:, None], v[:, None], is_causal=True)
    running_mean = v.cumsum(1) / torch.arange(1, 6)[None, :, None]
    assert torch.allclose(a[:, 0], running_mean, atol=1e-6) and running_mean.abs().sum() > 0


# ------------------------------------------------------------ files: pad_checkpoint


def save(model, path: Path, shard: str | None = None) -> Path:
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.mark.parametrize(
    ("arch", "q_kv", "tp", "strategy", "rope", "sharded"),
    [
        ("llama", (32, 8), 24, "auto", "llama3", False),  # interleaved; loads as Mistral
        ("llama", (8, 2), 1, "auto", "default", False),  # tp 1: a faithful copy
        ("qwen2", (28, 4), 6, "convert_to_mha", "default", True),  # tail padding, biases
        ("mistral", (40, 8), 32, "replicate_to_tp_degree", "default", True),
    ],
)
def test_padded_checkpoint_loads_with_auto_model_and_matches(
    tmp_path, arch, q_kv, tp, strategy, rope, sharded
):
    model, _ = original(arch, *q_kv, rope=rope)
    src = save(model, tmp_path / "src", "40KB" if sharded else None)
    assert (src / gqa_pad.INDEX_NAME).exists() == sharded
    out = tmp_path / "padded"
    plan = pad_checkpoint(src, out, tp, strategy, max_shard_bytes=48_000 if sharded else 1 << 30)

    padded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert max_logit_diff(model, padded) <= TOL
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        plan.padded_q_heads,
        plan.padded_kv_heads,
        HEAD_DIM,
    )
    assert cfg[CONFIG_KEY]["strategy"] == plan.strategy
    assert cfg[CONFIG_KEY]["source_model_type"] == arch
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    assert (out / gqa_pad.INDEX_NAME).exists() == sharded
    if sharded:
        index = json.loads((out / gqa_pad.INDEX_NAME).read_text())
        assert set(index["weight_map"]) == set(model.state_dict())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("name", ["llama-3-8b", "mistral-7b-v0.3", "qwen2.5-7b"])
def test_padded_config_of_published_models_is_accepted_by_transformers(name):
    src = Path(__file__).resolve().parent.parent / "models" / name
    for tp in TPS:
        shape, plan = gqa_pad.plan_for_checkpoint(src, tp)
        cfg = padded_config(json.loads((src / "config.json").read_text()), shape, plan)
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        assert config.num_attention_heads == plan.padded_q_heads
        assert config.head_dim == shape.head_dim == 128


def test_llama_padded_past_what_llama_config_accepts_is_relabelled_mistral(tmp_path):
    model, _ = original("llama", 32, 8)
    src = save(model, tmp_path / "src")
    pad_checkpoint(src, tmp_path / "tp8", 8)  # 32 heads divide hidden 64: stays Llama
    pad_checkpoint(src, tmp_path / "tp24", 24)  # 48 heads do not
    assert json.loads((tmp_path / "tp8/config.json").read_text())["model_type"] == "llama"
    cfg = json.loads((tmp_path / "tp24/config.json").read_text())
    assert cfg["model_type"] == "mistral" and cfg["sliding_window"] is None


def test_an_already_padded_checkpoint_is_refused(tmp_path):
    model, _ = original("llama", 8, 2)
    pad_checkpoint(save(model, tmp_path / "src"), tmp_path / "tp3", 3)
    with pytest.raises(InputError, match="already padded"):
        pad_checkpoint(tmp_path / "tp3", tmp_path / "again", 3)
    assert not (tmp_path / "again").exists()


def test_unsupported_architecture_is_named_and_nothing_is_written(tmp_path):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_head": 12})
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        pad_checkpoint(src, tmp_path / "out", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_weights_that_disagree_with_config_fail_before_writing(tmp_path):
    model, _ = original("mistral", 8, 2)
    src = save(model, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    with pytest.raises(CheckpointError, match="k_proj"):
        pad_checkpoint(src, tmp_path / "out", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_failure_mid_write_leaves_nothing_and_keeps_an_existing_out(tmp_path, monkeypatch):
    model, _ = original("llama", 8, 2)
    src = save(model, tmp_path / "src")
    out = tmp_path / "out"
    calls = []

    def flaky(name, *args):
        calls.append(name)
        if len(calls) == 6:
            raise OSError("disk full")
        return pad_tensor(name, *args)

    monkeypatch.setattr(gqa_pad, "pad_tensor", flaky)
    with pytest.raises(OSError, match="disk full"):
        pad_checkpoint(src, out, 4, max_shard_bytes=1000)  # several shards written by then
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]

    out.mkdir()
    (out / "keep.txt").write_text("old")
    calls.clear()
    with pytest.raises(OSError):
        pad_checkpoint(src, out, 4, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert (out / "keep.txt").read_text() == "old"


def test_existing_out_needs_overwrite(tmp_path):
    model, _ = original("llama", 8, 2)
    src = save(model, tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(InputError, match="already exists"):
        pad_checkpoint(src, out, 4)
    pad_checkpoint(src, out, 4, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").exists()


_MEMORY_SCRIPT = """
import json, sys
from pathlib import Path

def hwm():  # peak resident set size so far, bytes
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

from pipeline.compile.gqa_pad import pad_checkpoint
import safetensors.torch, torch  # imported before the baseline
torch.set_num_threads(1)  # small copies; threads only add contention on a busy CI machine
base = hwm()
pad_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]), 6, max_shard_bytes=32 << 20)
print(json.dumps({"base": base, "peak": hwm()}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_memory_stays_within_one_and_a_half_model_sizes(tmp_path):
    from safetensors.torch import save_file

    hidden, inter, layers, vocab, q, kv, d = 1024, 2048, 4, 4096, 16, 4, 64
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": q,
        "num_key_value_heads": kv,
        "head_dim": d,
        "vocab_size": vocab,
    }
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for part, layer_ids in enumerate(((0, 1), (2, 3))):
        tensors = {}
        for i in layer_ids:
            p = f"model.layers.{i}."
            for name, shape in {
                "self_attn.q_proj.weight": (q * d, hidden),
                "self_attn.k_proj.weight": (kv * d, hidden),
                "self_attn.v_proj.weight": (kv * d, hidden),
                "self_attn.o_proj.weight": (hidden, q * d),
                "mlp.gate_proj.weight": (inter, hidden),
                "mlp.up_proj.weight": (inter, hidden),
                "mlp.down_proj.weight": (hidden, inter),
            }.items():
                tensors[p + name] = torch.randn(shape, generator=g)
        if part == 0:
            tensors["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
        else:
            tensors["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
        fname = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file(tensors, src / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    (src / gqa_pad.INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    model_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))

    r = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(r.stdout)
    grown = m["peak"] - m["base"]
    print(f"model {model_bytes / 2**20:.0f} MiB, peak RSS grew {grown / 2**20:.0f} MiB")
    assert grown <= 1.5 * model_bytes
    assert json.loads((tmp_path / "out/config.json").read_text())["num_attention_heads"] == 18


# ------------------------------------------------------------------------------- CLI


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_gqa_pad_json(tmp_path):
    model, _ = original("qwen2", 8, 2)
    src = save(model, tmp_path / "src")
    r = invoke("gqa", "pad", src, "--tp", 3, "--out", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["out"] == str(tmp_path / "out")
    assert data["plan"]["strategy"] == "convert_to_mha" and data["plan"]["padded_q_heads"] == 9
    r = invoke("gqa", "pad", src, "--tp", 4, "--out", tmp_path / "out", "--overwrite")
    assert r.exit_code == 0 and "8/2 → 8/4" in r.stdout


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["{missing}", "--tp", 2], "not a directory"),
        (["{src}", "--tp", 2, "--strategy", "bogus"], "unknown strategy"),
        (["{src}", "--tp", 0], "--tp"),
        (["{src}", "--tp", 3, "--strategy", "replicate_to_tp_degree"], "cannot be replicated"),
        (["{src}", "--tp", 2, "--out", "{src}"], "is the source checkpoint"),
        (["{exists}", "--tp", 2], "already exists"),
        (["{gpt2}", "--tp", 2], "GPT2LMHeadModel"),
    ],
)
def test_cli_gqa_pad_bad_input_is_one_line_exit_2(tmp_path, args, msg):
    model, _ = original("llama", 8, 2)
    paths = {
        "src": save(model, tmp_path / "src"),
        "missing": tmp_path / "nope",
        "gpt2": tmp_path / "gpt2",
        "exists": tmp_path / "src",
    }
    paths["gpt2"].mkdir()
    (paths["gpt2"] / "config.json").write_text(
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}'
    )
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    argv = [str(a).format(**paths) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / ("taken" if args[0] == "{exists}" else "out"))]
    r = invoke("gqa", "pad", *argv)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], r.stderr
    assert not (tmp_path / "out").exists()
