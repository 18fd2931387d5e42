"""A neuron release end to end without the Neuron SDK: compiled with the stand-in exporter
(tests/neuron_fakes.py), published, pulled, and served through ``BucketedModel`` with the
stand-in ``optimum.neuron`` (tests/neuron_standin; its signatures are checked against the real
classes in tests/test_neuron_upstream.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.errors import InputError, RuntimeMismatchError
from pipeline.plan.buckets import Bucket
from tests.neuron_fakes import VERSIONS


def loads(module) -> list[str]:
    return [Path(c[1]).name for c in module.CALLS if c[0] == "from_pretrained"]


def expected(prompt: list[int], max_new: int, eos: int | None, vocab: int = 512) -> list[int]:
    from tests.neuron_standin.optimum.neuron import next_token

    out: list[int] = []
    while len(out) < max_new and not (out and out[-1] == eos):
        out.append(next_token(prompt + out, vocab))
    return out


def test_manifest_records_loadability_versions_and_shards_are_one_blob(neuron_release):
    from pipeline.store import open_store
    from pipeline.store.layout import blob_key

    store_dir, model_dir = neuron_release
    manifest = json.loads((model_dir / "current" / "manifest.json").read_text())
    assert manifest["backend"] == "neuron"
    assert {k: manifest["versions"][k] for k in VERSIONS} == VERSIONS
    assert "neuronx-cc" in manifest["versions"]
    by_path: dict[str, set[str]] = {}
    for b in manifest["buckets"].values():
        for ref in b["files"]:
            by_path.setdefault(ref["path"], set()).add(ref["sha256"])
    # Six exports, each writing its own shard per rank: byte-identical, so one blob per rank.
    shards = [p for p in by_path if p.startswith("checkpoint/weights/")]
    assert sorted(shards) == [
        f"checkpoint/weights/tp{r}_sharded_checkpoint.safetensors" for r in range(2)
    ]
    assert all(len(by_path[p]) == 1 for p in shards)
    assert len(by_path["model.pt"]) == 6  # the graphs differ per bucket
    blobs = {k.rsplit("/", 1)[-1] for k in open_store(str(store_dir)).list("blobs/sha256/")}
    assert {next(iter(by_path[p])) for p in shards} <= blobs
    refs = sum(len(b["files"]) for b in manifest["buckets"].values())
    distinct = {ref["sha256"] for b in manifest["buckets"].values() for ref in b["files"]}
    assert refs - len(distinct) >= 10  # 12 shard refs stored as 2 blobs (and equal configs)
    assert blob_key(next(iter(by_path[shards[0]]))) in set(
        open_store(str(store_dir)).list("blobs/sha256/")
    )


def test_served_through_bucketed_model_picking_buckets_by_prompt_plus_new_tokens(
    neuron_release, standin
):
    from pipeline.runtime import BucketedModel

    _, model_dir = neuron_release
    model = BucketedModel.load(model_dir)
    assert model.device == "neuron" and loads(standin) == []  # lazily: nothing loaded yet
    # 3 + 4 = 7 tokens: b1_s16; 3 + 13 = 16: still b1_s16; 3 + 14 = 17: b1_s32.
    assert model.generate([[5, 6, 7]], 4, eos_token_id=None) == [expected([5, 6, 7], 4, None)]
    assert model.generate([[5, 6, 7]], 13, eos_token_id=None) == [expected([5, 6, 7], 13, None)]
    assert loads(standin) == ["b1_s16"]
    model.generate([[5, 6, 7]], 14, eos_token_id=None)
    assert loads(standin) == ["b1_s16", "b1_s32"]
    # Two prompts: a batch-2 bucket; the longest prompt + new tokens decides its length.
    prompts = [[9] * 20, [3, 4]]
    got = model.generate(prompts, 8, eos_token_id=None)
    assert got == [expected(p, 8, None) for p in prompts]
    assert loads(standin)[-1] == "b2_s32"
    gen = [c for c in standin.CALLS if c[0] == "generate"][-1]
    assert gen[2] == (2, 20) and gen[3]["max_new_tokens"] == 8  # right-padded to 20
    # Three prompts: split 2 + 1, each padded to its own bucket.
    three = [[11, 12], [13], [14, 15, 16]]
    assert model.generate(three, 5, eos_token_id=None) == [expected(p, 5, None) for p in three]
    # EOS: tokens stop after it (the release's eos by default).
    eos = expected([5, 6, 7], 4, None)[1]
    assert model.generate([[5, 6, 7]], 4, eos_token_id=eos) == [expected([5, 6, 7], 4, eos)]


def test_a_smaller_batch_is_padded_up_to_the_export_and_stripped(neuron_release, standin):
    from pipeline.runtime import BucketedModel

    model = BucketedModel.load(neuron_release[1])
    session = model.session(Bucket(2, 16))
    assert session.generate([[7, 8, 9]], 3, None) == [expected([7, 8, 9], 3, None)]
    gen = [c for c in standin.CALLS if c[0] == "generate"][-1]
    assert gen[2] == (2, 3)  # the export's batch of 2, one row a copy
    with pytest.raises(InputError, match="exceeds this bucket's sequence length 16"):
        session.generate([[1] * 10], 7, None)


def test_buckets_load_lazily_under_an_hbm_budget_least_recently_used_out(neuron_release, standin):
    from pipeline.runtime import BucketedModel
    from pipeline.runtime.neuron import bucket_costs

    _, model_dir = neuron_release
    probe = BucketedModel.load(model_dir)
    costs = bucket_costs(probe.installed)
    b16, b32, b64 = Bucket(1, 16), Bucket(1, 32), Bucket(1, 64)
    budget = costs[b16] + costs[b32]  # room for these two, not for a third
    assert costs[b64] + costs[b16] > budget
    model = BucketedModel.load(model_dir, hbm_budget=budget)
    model.generate([[1, 2]], 4)  # b1_s16
    model.generate([[1, 2]], 20)  # b1_s32
    assert model.runner.loaded == [b16, b32]
    model.generate([[1, 2]], 4)  # b1_s16 again: now the most recently used
    model.generate([[1, 2]], 40)  # b1_s64: b1_s32, the least recently used, goes
    assert model.runner.loaded == [b16, b64] or model.runner.loaded == [b64]
    assert model.runner.used <= budget
    assert b32 not in model.runner.loaded
    import gc

    gc.collect()
    live = sorted(Path(p).name for p in standin.LIVE.values())
    assert live == sorted(b.name for b in model.runner.loaded)  # unloaded means released
    assert loads(standin) == ["b1_s16", "b1_s32", "b1_s64"]


def test_warmup_loads_what_fits(neuron_release, standin):
    from pipeline.runtime import BucketedModel
    from pipeline.runtime.neuron import bucket_costs

    _, model_dir = neuron_release
    costs = bucket_costs(BucketedModel.load(model_dir).installed)
    order = sorted(costs)  # what BucketedModel passes: by batch, then sequence length
    budget = costs[order[0]] + costs[order[1]] + costs[order[2]] - 1
    model = BucketedModel.load(model_dir, hbm_budget=budget)
    model.warmup()
    loaded = model.runner.loaded
    assert loaded[:2] == order[:2] and order[2] not in loaded  # the third does not fit
    assert model.runner.used <= budget  # and nothing was evicted to load another:
    assert len(loads(standin)) == len(loaded)
    room = budget - model.runner.used
    assert all(costs[b] > room for b in order if b not in loaded)  # nothing else fits
    full = BucketedModel.load(model_dir)  # inf2.xlarge's 16 GiB per core: all six fit
    full.warmup()
    assert len(full.runner.loaded) == 6


def test_a_bucket_larger_than_the_budget_is_one_line(neuron_release, standin):
    from pipeline.runtime import BucketedModel

    model = BucketedModel.load(neuron_release[1], hbm_budget=1000)
    with pytest.raises(InputError, match="more than the HBM budget"):
        model.generate([[1, 2]], 2)


def test_without_optimum_neuron_serving_is_one_line_exit_2(neuron_release, monkeypatch):
    from pipeline.cli import app
    from pipeline.runtime import BucketedModel

    for name in [m for m in sys.modules if m == "optimum" or m.startswith("optimum.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "optimum", None)  # not importable, whatever is installed
    with pytest.raises(RuntimeMismatchError, match=r"optimum-neuron\[neuronx\]"):
        BucketedModel.load(neuron_release[1])
    r = CliRunner().invoke(app, ["run", str(neuron_release[1]), "--prompt-ids", "1,2,3"])
    assert r.exit_code == 2
    (line,) = r.stderr.strip().splitlines()
    assert "is a neuron release and optimum.neuron cannot be imported" in line
    assert "inf2" in line and "optimum-neuron[neuronx]" in line


def test_a_release_exported_with_another_optimum_neuron_is_refused(
    neuron_release, standin, tmp_path
):
    import shutil

    from pipeline.runtime import BucketedModel

    copy = tmp_path / "r"
    shutil.copytree(neuron_release[1] / "current", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["versions"]["optimum-neuron"] = "0.4.4"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeMismatchError, match=r"exported with optimum-neuron 0\.4\.4"):
        BucketedModel.load(copy)
