"""Hostile or broken input ends in one line and exit 2, never a traceback or a hang:
YAML configs (tags, deep nesting, alias bombs), a checkpoint's config.json, tiny-model sizes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import CheckpointError, ConfigError, InputError
from pipeline.plan.checkpoint import check_neuron_exportable, read_shape
from pipeline.plan.config import load_config, load_grid
from tests.cli_helpers import one_line

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


# --- YAML: pipeline/_yaml.py ----------------------------------------------------------------


def _bomb(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "line", "why"),
    [
        ("model:\n  name: !!python/object:os.system x\n", 2, "tag '!!python/object:os.system'"),
        ("model: !foo bar\n", 1, "tag '!foo'"),
        ("model: {name: !!int abc}\n", 1, "tag '!!int'"),
        ("[" * 100_000, 1, "nested deeper than 32 levels"),
        ("a:\n" + "".join(f"{' ' * (i + 1)}k{i}:\n" for i in range(40)) + "   x\n", 32, "nested"),
        (_bomb(), 2, "alias '*a0' is not supported"),
        ("base: &b {tp_degree: 2}\ntarget:\n  <<: *b\n", 3, "alias '*b'"),
        ("model: {name: t, made: 2024-13-45}\n", 1, "month must be in 1..12"),
        ("? [a, b]\n: c\n", 1, "a key must be a plain name"),
    ],
)
@pytest.mark.timeout(30)
def test_hostile_yaml_is_a_config_error_with_the_line(tmp_path, text, line, why):
    path = tmp_path / "release.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.path == str(path) and e.value.line == line, e.value.one_line()
    assert why in e.value.one_line() and e.value.exit_code == 2


@pytest.mark.timeout(30)
def test_hostile_grid_names_the_grid_file(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(_bomb())
    with pytest.raises(ConfigError, match="alias") as e:
        load_grid(path)
    assert e.value.path == str(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("model:\n  name: !!python/object:os.system x\n", "release.yaml:2: YAML tag"),
        ("model: !foo bar\n", "release.yaml:1: YAML tag '!foo'"),
        ("[" * 100_000, "release.yaml:1: nested deeper"),
        (_bomb(), "release.yaml:2: YAML alias"),
    ],
)
def test_hostile_yaml_through_the_cli(tmp_path, text, why):
    path = tmp_path / "release.yaml"
    path.write_text(text)
    one_line(invoke("validate", path), 2, why)


def test_shipped_configs_and_grids_still_load():
    from pipeline._yaml import load_yaml

    files = [*(REPO / "configs").glob("*.yaml"), *(REPO / "buckets").glob("*.yaml")]
    assert files
    for f in files:
        assert isinstance(load_yaml(f).data, dict), f


def test_plain_yaml_values_still_load(tmp_path):
    from pipeline._yaml import load_yaml

    path = tmp_path / "x.yaml"
    path.write_text("a: 1\nb: 1.5\nc: 'q'\nd: [true, null]\ne: {f: &anchor-unused 2}\n")
    assert load_yaml(path).data == {"a": 1, "b": 1.5, "c": "q", "d": [True, None], "e": {"f": 2}}


# --- a checkpoint's config.json: pipeline/plan/checkpoint.py ------------------------------


@pytest.fixture
def ckpt(tmp_path, tiny_checkpoint):
    """A copy of the tiny checkpoint's config.json; returns (dir, edit(**values))."""
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", d / "config.json")

    def edit(drop: tuple[str, ...] = (), **values):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(values)
        for key in drop:
            cfg.pop(key, None)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    return edit


@pytest.mark.parametrize(
    ("values", "key", "got"),
    [
        ({"hidden_size": "abc"}, "hidden_size", '"abc"'),
        ({"num_hidden_layers": None}, "num_hidden_layers", "null"),
        ({"vocab_size": [512]}, "vocab_size", "[512]"),
        ({"num_attention_heads": True}, "num_attention_heads", "true"),
        ({"intermediate_size": 8.5}, "intermediate_size", "8.5"),  # was silently 8
        ({"num_attention_heads": 0}, "num_attention_heads", "0"),
        ({"num_key_value_heads": 0}, "num_key_value_heads", "0"),  # was silently = heads
        ({"head_dim": -8}, "head_dim", "-8"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings", '"no"'),  # bool("no") is True
    ],
)
def test_bad_config_json_value_names_the_file_and_key(ckpt, values, key, got):
    d = ckpt(**values)
    with pytest.raises(CheckpointError) as e:
        read_shape(d)
    msg = e.value.one_line()
    assert msg.startswith(f"{d / 'config.json'}: {key}: ") and got in msg, msg
    assert e.value.exit_code == 2


def test_heads_zero_without_head_dim_is_not_a_zero_division(ckpt):
    with pytest.raises(CheckpointError, match=r"config.json: num_attention_heads"):
        read_shape(ckpt(num_attention_heads=0, drop=("head_dim",)))


def test_heads_not_a_multiple_of_kv_heads_names_the_file(ckpt):
    with pytest.raises(CheckpointError, match=r"config.json: num_attention_heads: 7 query"):
        read_shape(ckpt(num_attention_heads=7))


def test_whole_floats_and_null_optionals_are_taken(ckpt):
    shape = read_shape(ckpt(intermediate_size=128.0, num_key_value_heads=None, head_dim=None))
    assert shape.intermediate == 128 and shape.kv_heads == shape.q_heads == 8
    assert shape.head_dim == 64 // 8


def test_neuron_check_reads_the_sizes_first(ckpt):
    d = ckpt(model_type="mistral", num_attention_heads="8", sliding_window=None)
    with pytest.raises(CheckpointError, match=r"config.json: num_attention_heads"):
        check_neuron_exportable(d)


def test_heads_zero_in_config_json_is_not_blamed_on_the_heads_flag(ckpt, write_config):
    d = ckpt(num_attention_heads=0)
    cfg = write_config(f"""
        model: {{name: t, checkpoint: {d}}}
        target: {{tp_degree: 2, backend: cpu}}
        buckets: {{batch_sizes: [1], sequence_lengths: [32]}}
    """)
    err = one_line(invoke("plan", cfg), 2, "config.json: num_attention_heads")
    assert "--heads" not in err
    err = one_line(
        invoke("gqa", "pad", d, "--tp", 4, "--out", d.parent / "out"), 2, "num_attention_heads"
    )
    assert "--heads" not in err
    # Given as a flag, the flag is what the message names.
    one_line(invoke("gqa", "plan", "--heads", 0, "--kv-heads", 2, "--tp", 2), 2, "--heads")


@pytest.mark.parametrize("value", ["abc", None, [1], 8.5])
def test_bad_config_json_through_the_cli(ckpt, write_config, value):
    d = ckpt(hidden_size=value)
    cfg = write_config(f"""
        model: {{name: t, checkpoint: {d}}}
        target: {{tp_degree: 2, backend: cpu}}
        buckets: {{batch_sizes: [1], sequence_lengths: [32]}}
    """)
    one_line(invoke("plan", cfg), 2, "config.json: hidden_size: must be a whole number")


def test_config_json_nested_too_deeply(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match=r"config.json"):
        read_shape(tmp_path)


# --- tiny-model: pipeline/tiny_model.py, pipeline/cli/model.py -----------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--hidden", 10_000_000],
        ["--layers", 100_000_000],
        ["--vocab", 100_000_000_000],
        ["--hidden", 4096, "--layers", 64],  # a 7B shape: ~28 GiB of fp32
    ],
)
@pytest.mark.timeout(30)
def test_tiny_model_refuses_absurd_sizes_before_allocating(tmp_path, args):
    err = one_line(
        invoke("tiny-model", tmp_path / "m", *args), 2, "parameters", "at most 100,000,000"
    )
    assert "GiB" in err
    assert not (tmp_path / "m").exists()


def test_tiny_model_refuses_an_out_of_range_seed(tmp_path):
    one_line(invoke("tiny-model", tmp_path / "m", "--seed", 10**24), 2, "--seed")


def test_tiny_param_count_is_exact_and_the_default_is_far_below_the_cap():
    from pipeline.tiny_model import MAX_TINY_PARAMS, tiny_param_count

    n = tiny_param_count(arch="llama", layers=2, hidden=64, heads=8, kv_heads=2, vocab=512)
    # The default model's real count (test_tiny_model checks read_shape's count against torch).
    assert n == 2 * (64 * 64 * 2 + 2 * 64 * 16 + 3 * 64 * 128 + 2 * 64) + 2 * 512 * 64 + 64
    assert n * 100 < MAX_TINY_PARAMS
    with pytest.raises(InputError, match="at most"):
        from pipeline.tiny_model import write_tiny_model

        write_tiny_model(Path("/nonexistent/never-written"), hidden=64, intermediate=10**9)


def test_tiny_model_prints_no_deprecation_warning(tmp_path):
    # A fresh process: transformers warns once per process, so an earlier test could hide it.
    out = tmp_path / "m"
    r = subprocess.run(
        [sys.executable, "-c", "from pipeline.cli import main; main()", "tiny-model", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "deprecated" not in r.stderr.lower(), r.stderr
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
