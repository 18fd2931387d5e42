"""Issue 16: a fine-tune of an already-compiled model releases without compiling anything.

Two keys (pipeline.compile.keys): a graph key per bucket without the weights, and a weights
key per release. The real test reuses the demo release compiled once per session
(``compiled_store``): a second checkpoint of the same architecture (seed 2) is released from
a copy of that store, compiles nothing, and generates its own Hugging Face greedy tokens.
The key rules are also checked with the fake backend in real workers (milliseconds).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.compile import keys
from pipeline.compile.release import publish_release
from pipeline.compile.scheduler import compile_release
from pipeline.contracts import digests
from pipeline.contracts.bucket import Bucket
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.releases import read_release
from pipeline.tiny_model import write_tiny_model
from tests import compile_fakes
from tests.config_factory import release_yaml

VERSIONS = {"torch": "2.13.0", "transformers": "5.0"}


def _yaml(ckpt: Path, store: str = "store") -> str:
    return release_yaml(
        checkpoint=ckpt,
        instance_type="inf2.24xlarge",
        tp_degree=4,
        auto_cast_type="fp32",
        timeout_s=60,
        store=store,
    )


def _config(tmp_path: Path, ckpt: Path, name: str = "release.yaml", store: str = "store") -> Path:
    path = tmp_path / name
    path.write_text(_yaml(ckpt, store))
    return path


def _edit_config(ckpt: Path, **fields) -> None:
    cfg = ckpt / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **fields}, indent=2))
    digests._memo.clear()


@pytest.fixture
def ckpt_a(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "a"))


@pytest.fixture
def ckpt_b(tmp_path: Path) -> Path:
    """Model B: the tiny model's config, other weights."""
    return write_tiny_model(tmp_path / "b", seed=2)


# --- the keys --------------------------------------------------------------------------------


def _keys(tmp_path: Path, ckpt: Path, backend: str = "cpu") -> tuple[str, str]:
    release = load_config(_config(tmp_path, ckpt))
    graph = keys.graph_key(release, Bucket(1, 32), backend, versions=VERSIONS)
    return graph, keys.weights_key(release, backend, versions=VERSIONS)


def test_other_weights_change_the_weights_key_only(tmp_path, ckpt_a, ckpt_b):
    graph_a, weights_a = _keys(tmp_path, ckpt_a)
    graph_b, weights_b = _keys(tmp_path, ckpt_b)
    assert graph_a == graph_b and weights_a != weights_b


@pytest.mark.parametrize(
    "fields",
    [{"rope_theta": 50000.0}, {"vocab_size": 256}, {"rms_norm_eps": 1e-5}, {"new_field": 1}],
    ids=["rope_theta", "vocab_size", "rms_norm_eps", "unknown-field"],
)
def test_graph_relevant_config_fields_change_both_keys(tmp_path, ckpt_a, fields):
    """An unknown field counts as graph-relevant: at worst a needless recompile. The weights
    key follows the architecture too: prepared weights never meet other graphs."""
    before = _keys(tmp_path, ckpt_a)
    _edit_config(ckpt_a, **fields)
    after = _keys(tmp_path, ckpt_a)
    assert before[0] != after[0] and before[1] != after[1]


@pytest.mark.parametrize(
    "fields",
    [
        {"_name_or_path": "org/fine-tuned"},
        {"architectures": ["SomethingForCausalLM"]},
        {"transformers_version": "9.9.9"},
        {"torch_dtype": "bfloat16", "dtype": "bfloat16"},
        {"eos_token_id": 7, "bos_token_id": 6, "pad_token_id": 5},
    ],
    ids=["_name_or_path", "architectures", "transformers_version", "dtype", "token_ids"],
)
def test_fields_that_never_reach_the_graphs_change_neither_key(tmp_path, ckpt_a, fields):
    before = _keys(tmp_path, ckpt_a)
    _edit_config(ckpt_a, **fields)
    assert _keys(tmp_path, ckpt_a) == before


def test_weights_key_follows_how_they_are_prepared(tmp_path, ckpt_a):
    base = load_config(_config(tmp_path, ckpt_a))
    key = keys.weights_key(base, "cpu", versions=VERSIONS)
    text = _yaml(ckpt_a)
    for old, new in [("dtype: float32", "dtype: bfloat16"), ("tp_degree: 4", "tp_degree: 1")]:
        (tmp_path / "other.yaml").write_text(text.replace(old, new))
        other = load_config(tmp_path / "other.yaml")
        assert keys.weights_key(other, "cpu", versions=VERSIONS) != key, new
    assert keys.weights_key(base, "cuda", versions=VERSIONS) != key
    # the bucket is not an input: one set of prepared weights serves every bucket
    (tmp_path / "other.yaml").write_text(text.replace("[1, 2]", "[4]"))
    assert keys.weights_key(load_config(tmp_path / "other.yaml"), "cpu", versions=VERSIONS) == key


def test_neuron_graph_key_keeps_the_weights_and_the_whole_config(tmp_path, ckpt_a, ckpt_b):
    """The exporter's bucket output holds the sharded weights and a copy of config.json."""
    from pipeline.compile.backends import get_backend

    assert get_backend("neuron").graphs_depend_on_weights
    assert not get_backend("cpu").graphs_depend_on_weights
    graph_a, _ = _keys(tmp_path, ckpt_a, "neuron")
    graph_b, _ = _keys(tmp_path, ckpt_b, "neuron")
    assert graph_a != graph_b
    _edit_config(ckpt_a, _name_or_path="org/fine-tuned")
    assert _keys(tmp_path, ckpt_a, "neuron")[0] != graph_a


# --- the runner and release, with the fake backend in real workers ----------------------------


@pytest.fixture
def fake_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    compile_fakes.install()
    yield
    compile_fakes.uninstall()


def _run(config: Path):
    return compile_release(load_config(config), backend="fake", workdir=config.parent / "work")


def _outcome(report) -> set[tuple[str, str]]:
    return {(r.graph, r.weights_status) for r in report.results}


def test_a_finetune_compiles_nothing_and_releases_its_own_weights(
    fake_backend, tmp_path, ckpt_a, ckpt_b
):
    from pipeline.store.gc import gc

    a = _config(tmp_path, ckpt_a, "a.yaml")
    first = _run(a)
    assert _outcome(first) == {("compiled", "prepared")}
    rel_a = publish_release(load_config(a), version="a", backend="fake")
    b = _config(tmp_path, ckpt_b, "b.yaml")
    cli = CliRunner()
    r = cli.invoke(app, ["release", str(b), "--backend", "fake", "--version", "b", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)["compile"]
    assert data["compiled"] == 0 and data["weights"]["status"] == "prepared"
    assert {(x["graph"], x["weights"]) for x in data["buckets"]} == {("hit", "prepared")}
    store = open_store(str(tmp_path / "store"))
    ma, mb = read_release(store, "tiny", rel_a.version), read_release(store, "tiny", "b")
    for name, bucket in mb.buckets.items():
        assert bucket.cache_key == ma.buckets[name].cache_key  # the same graphs
        assert bucket.weights_key != ma.buckets[name].weights_key  # B's own weights
        weights = {f.path: f.sha256 for f in bucket.files}["weights.bin"]
        assert weights != {f.path: f.sha256 for f in ma.buckets[name].files}["weights.bin"]
    assert mb.weights_digest == digests.weights_digest(ckpt_b) != ma.weights_digest
    # Human output: per bucket, graph hit or compiled and weights hit or prepared.
    r = cli.invoke(app, ["compile", str(b), "--backend", "fake"])
    assert r.exit_code == 0 and "0 of 2 compiled" in r.stdout and "weights: hit" in r.stdout
    # gc keeps what B's release uses, and drops A's weights once A's release is gone.
    result = gc(store, "tiny", keep=1, grace_s=0)
    assert result.deleted_releases == ["a"]
    assert result.deleted_cache_entries == [ma.buckets["b1_s32"].weights_key]
    assert publish_release(load_config(b), version="b", backend="fake").created is False


def test_graph_fields_recompile_every_bucket_and_name_fields_none(fake_backend, tmp_path, ckpt_a):
    config = _config(tmp_path, ckpt_a)
    assert _outcome(_run(config)) == {("compiled", "prepared")}
    _edit_config(ckpt_a, _name_or_path="org/renamed")
    assert _outcome(_run(config)) == {("hit", "hit")}
    _edit_config(ckpt_a, rope_theta=50000.0)
    assert _outcome(_run(config)) == {("compiled", "prepared")}
    # a vocabulary change comes with a checkpoint of that vocabulary
    shutil.rmtree(ckpt_a)
    write_tiny_model(ckpt_a, vocab=256)
    digests._memo.clear()
    assert _outcome(_run(config)) == {("compiled", "prepared")}


def test_a_failed_prepare_fails_the_release_even_when_every_graph_is_a_hit(
    fake_backend, tmp_path, ckpt_a, ckpt_b, monkeypatch
):
    _run(_config(tmp_path, ckpt_a, "a.yaml"))
    monkeypatch.setenv("FAKE_PREPARE", "fail")
    b = _config(tmp_path, ckpt_b, "b.yaml")
    report = _run(b)
    assert {r.status for r in report.results} == {"cached"} and len(report.failed) == 2
    assert report.weights.status == "failed"
    r = CliRunner().invoke(app, ["publish", str(b), "--backend", "fake"])
    assert r.exit_code == 2
    assert "the prepared weights of this checkpoint are not in the cache" in r.stderr
    monkeypatch.delenv("FAKE_PREPARE")
    assert _outcome(_run(b)) == {("hit", "prepared")}


# --- the real thing: cpu graphs compiled once per session, then model B --------------------------


def _hf_greedy(checkpoint: Path, prompt: list[int], new: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


def test_model_b_releases_from_model_a_graphs_and_generates_b_tokens(
    compiled_store, tiny_checkpoint, ckpt_b, tmp_path
):
    from pipeline.install.pull import pull_release
    from pipeline.runtime import BucketedModel

    config_a, store_a = compiled_store
    store_dir = Path(shutil.copytree(store_a, tmp_path / "store"))  # the fixture is read-only
    data = yaml.safe_load(config_a.read_text())
    data["model"]["checkpoint"], data["store"] = str(ckpt_b), str(store_dir)
    config_b = tmp_path / "b.yaml"
    config_b.write_text(yaml.safe_dump(data, sort_keys=False))
    release = load_config(config_b)

    report = compile_release(release, workdir=tmp_path / "work")
    assert not report.failed, [(r.bucket.name, r.error) for r in report.failed]
    assert report.compiled == 0 and len(report.results) == 4
    assert _outcome(report) == {("hit", "prepared")}
    version = publish_release(release, version="b").version
    pull_release(open_store(str(store_dir)), release.name, tmp_path / "models", version=version)
    model = BucketedModel.load(tmp_path / "models" / release.name)
    prompts = [[1, 17, 42, 99, 5, 7, 300, 12], [3, 4]]
    got = model.generate(prompts, max_new_tokens=10, eos_token_id=None)
    want_b = [_hf_greedy(ckpt_b, p, 10) for p in prompts]
    want_a = [_hf_greedy(tiny_checkpoint, p, 10) for p in prompts]
    assert got == want_b
    assert want_a != want_b  # the test can tell A's weights from B's


def test_weights_of_another_shape_are_refused_in_one_line(installed, tmp_path):
    """Graphs of one architecture beside weights of another (here, a smaller vocabulary)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.errors import IntegrityError
    from pipeline.runtime.graph_loading import BucketGraphs

    _, model_dir = installed
    bucket = next((model_dir / "current" / "buckets").iterdir())
    copy = Path(shutil.copytree(bucket, tmp_path / bucket.name))
    state = load_file(copy / "weights.safetensors")
    state["model.embed_tokens.weight"] = torch.zeros(256, 64)
    (copy / "weights.safetensors").unlink()
    save_file(state, copy / "weights.safetensors")
    with pytest.raises(IntegrityError) as e:
        BucketGraphs(copy)
    line = e.value.one_line()
    assert "weight model.embed_tokens.weight is float32[256, 64]" in line
    assert "built for float32[512, 64]" in line and "\n" not in line
