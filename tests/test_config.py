"""Each bad-input class names file:line and field, and exits 2 through the CLI."""

from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.plan.config import load_config, load_grid

GOOD = """
model:
  name: tiny
  checkpoint: {ckpt}
  dtype: bf16
target:
  tp_degree: 2
buckets:
  batch_sizes: [1, 2]
  sequence_lengths: [32, 64]
"""


def test_good_config_loads_with_defaults(write_config, tiny_checkpoint):
    r = load_config(write_config(GOOD))
    assert r.name == "tiny" and r.config.model.dtype == "bfloat16"
    assert r.config.target.backend == "auto" and r.config.target.instance_type == "inf2.xlarge"
    assert [b.name for b in r.buckets] == ["b1_s32", "b1_s64", "b2_s32", "b2_s64"]
    assert r.checkpoint == tiny_checkpoint
    assert r.store_url == str(r.path.parent / "artifacts")


def test_grid_file_is_relative_to_the_config(write_config, tmp_path):
    (tmp_path / "grids").mkdir()
    (tmp_path / "grids/g.yaml").write_text("batch_sizes: [4]\nsequence_lengths: [128, 64]\n")
    r = load_config(
        write_config("""
        model: {name: t, checkpoint: {ckpt}}
        buckets: {grid: grids/g.yaml}
    """)
    )
    assert [b.name for b in r.buckets] == ["b4_s64", "b4_s128"]


def test_shipped_demo_config_and_grids_are_valid():
    repo = Path(__file__).resolve().parent.parent
    for grid in (repo / "buckets").glob("*.yaml"):
        assert load_grid(grid).buckets()


@pytest.mark.parametrize(
    ("text", "line", "field", "why"),
    [
        ("model: {name: t, checkpoint: {ckpt}\nbuckets: [", 2, None, "malformed YAML"),
        (GOOD.replace("  tp_degree: 2", "  tp_degre: 2"), 6, "target", "unknown key 'tp_degre'"),
        (GOOD.replace("  name: tiny\n", ""), 1, "model.name", "Field required"),
        (GOOD.replace("[1, 2]", "[1, 0]"), 8, "buckets.batch_sizes.1", "greater than 0"),
        (GOOD.replace("[32, 64]", "[32, 64.5]"), 9, "buckets.sequence_lengths.1", "valid integer"),
        (GOOD.replace("[32, 64]", "[32, '64']"), 9, "buckets.sequence_lengths.1", "valid integer"),
        (GOOD.replace("[32, 64]", "[64, 32, 64]"), 9, "buckets.sequence_lengths", "duplicate"),
        (GOOD.replace("tp_degree: 2", "tp_degree: 0"), 6, "target.tp_degree", "greater than 0"),
        (
            GOOD.replace("tp_degree: 2", "tp_degree: 2\n  tp_degree: 4"),
            7,
            "tp_degree",
            "duplicate key",
        ),
        (GOOD.replace("dtype: bf16", "dtype: int3"), 4, "model.dtype", "Input should be"),
        (
            GOOD.replace("tp_degree: 2", "instance_type: inf9.huge"),
            6,
            "target.instance_type",
            "unknown instance type",
        ),
        (GOOD.replace("{ckpt}", "/nonexistent/ckpt"), 3, "model.checkpoint", "no config.json"),
        ("- just\n- a list\n", 1, None, "expected a mapping"),
    ],
)
def test_bad_config_names_file_line_and_field(write_config, text, line, field, why):
    path = write_config(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    err = e.value
    assert err.path == str(path)
    assert err.line == line, err.one_line()
    assert err.field == field
    assert why in err.one_line()
    assert err.exit_code == 2


def test_bad_grid_file_names_the_grid(write_config, tmp_path):
    (tmp_path / "g.yaml").write_text("batch_sizes: [1]\nsequence_lengths: [32, 32]\n")
    cfg = write_config("""
        model: {name: t, checkpoint: {ckpt}}
        buckets: {grid: g.yaml}
    """)
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert e.value.path.endswith("g.yaml") and e.value.line == 2


def test_grid_and_inline_together_is_an_error(write_config):
    with pytest.raises(ConfigError, match="either 'grid' or inline"):
        load_config(
            write_config("""
            model: {name: t, checkpoint: {ckpt}}
            buckets: {grid: g.yaml, batch_sizes: [1]}
        """)
        )


def test_missing_file():
    with pytest.raises(ConfigError, match="file not found"):
        load_config("/nonexistent/x.yaml")
