"""The foundation commands through Typer's CliRunner: output, JSON keys, exit codes."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_gqa_plan_json_keys():
    r = invoke(
        "gqa",
        "plan",
        "--heads",
        32,
        "--kv-heads",
        8,
        "--tp",
        24,
        "--head-dim",
        128,
        "--layers",
        32,
        "--dtype",
        "bf16",
        "--json",
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data) == {
        "strategy",
        "q_heads",
        "kv_heads",
        "tp",
        "padded_q_heads",
        "padded_kv_heads",
        "kv_replication",
        "q_heads_per_rank",
        "kv_heads_per_rank",
        "q_padding",
        "wasted_attention_fraction",
        "kv_cache_bytes_per_token",
    }
    assert data["strategy"] == "replicate_to_tp_degree" and data["padded_q_heads"] == 48
    assert data["kv_cache_bytes_per_token"] == 32 * 2 * 24 * 128 * 2


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--heads", 30, "--kv-heads", 8, "--tp", 2], "do not divide"),
        (["--heads", 32, "--kv-heads", 8, "--tp", 0], "--tp"),
        (
            ["--heads", 32, "--kv-heads", 8, "--tp", 12, "--strategy", "replicate_to_tp_degree"],
            "cannot be replicated",
        ),
        (["--heads", 32, "--kv-heads", 8, "--tp", 2, "--strategy", "bogus"], "unknown strategy"),
        (["--heads", 32, "--kv-heads", 8, "--tpx", 2], "No such option"),
    ],
)
def test_gqa_plan_bad_input_is_one_line_exit_2(args, msg):
    r = invoke("gqa", "plan", *args)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0]
    assert "Traceback" not in r.output


def test_validate_and_plan_the_demo_shape(write_config):
    cfg = write_config("""
        model: {name: tiny, checkpoint: {ckpt}, dtype: fp32}
        target: {backend: cpu, instance_type: inf2.24xlarge, tp_degree: 4}
        buckets: {batch_sizes: [1, 2], sequence_lengths: [32, 64]}
    """)
    r = invoke("validate", cfg)
    assert r.exit_code == 0 and "ok" in r.stdout
    r = invoke("plan", cfg, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["gqa"]["strategy"] == "replicate_to_tp_degree"
    assert [b["name"] for b in data["buckets"]] == ["b1_s32", "b1_s64", "b2_s32", "b2_s64"]
    assert all(b["fits"] for b in data["buckets"])
    r = invoke("plan", cfg)
    assert r.exit_code == 0 and "b2_s64" in r.stdout


def test_validate_bad_config_is_one_line_with_file_line(write_config):
    cfg = write_config("""
        model: {name: tiny, checkpoint: {ckpt}}
        buckets: {batch_sizes: [1], sequence_lenghts: [32]}
    """)
    r = invoke("validate", cfg)
    assert r.exit_code == 2
    line = r.stderr.strip()
    assert line.startswith(f"error: {cfg}:2: buckets: unknown key 'sequence_lenghts'"), line


def test_plan_that_does_not_fit_exits_2(write_config):
    cfg = write_config(f"""
        model: {{name: big, checkpoint: {REPO / "models/llama-3-8b"}}}
        target: {{instance_type: inf2.xlarge, tp_degree: 1}}
        buckets: {{batch_sizes: [8], sequence_lengths: [4096]}}
    """)
    r = invoke("plan", cfg)
    assert r.exit_code == 2 and "do not fit" in r.stderr


def test_debug_shows_the_traceback(write_config):
    r = invoke("--debug", "validate", "/nonexistent.yaml")
    assert r.exit_code != 0 and r.exception is not None


def test_tiny_model_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "m"
    r = invoke("tiny-model", out, "--arch", "qwen2", "--heads", 4, "--kv-heads", 2, "--hidden", 32)
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
    }
    r = invoke("tiny-model", out)
    assert r.exit_code == 2 and "not empty" in r.stderr
    r = invoke("tiny-model", tmp_path / "x", "--arch", "gpt2")
    assert r.exit_code == 2 and "unknown architecture" in r.stderr
