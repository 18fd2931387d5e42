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

from pipeline.contracts.bucket import Bucket
from pipeline.errors import InputError, RuntimeMismatchError
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
    from pipeline.contracts.store_layout import blob_key
    from pipeline.store import open_store

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


# --- Slots: the serving engine's interface (pipeline.runtime.neuron_slots.NeuronSlots) ---------


def forwards(module) -> list[tuple]:
    return [c for c in module.CALLS if c[0] == "forward"]


@pytest.fixture
def fake():
    """The stand-in as a plain module (no sys.path change, nothing to undo): for exports made
    in memory."""
    import tests.neuron_standin.optimum.neuron as module

    module.CALLS.clear()
    return module


def in_memory(module, batch: int = 4, seq: int = 32, on_device_sampling: bool = True):
    """A stand-in export, no release: (model, its slots)."""
    from pipeline.runtime.neuron_slots import NeuronSlots

    fields = {"batch_size": batch, "sequence_length": seq, "tp_degree": 2}
    fields |= {"continuous_batching": batch > 1, "on_device_sampling": on_device_sampling}
    model = module.NeuronModelForCausalLM("in-memory", fields, {"vocab_size": 512})
    return model, NeuronSlots(model, Bucket(batch, seq))


def test_slots_answer_as_generate_does_on_the_same_loaded_export(neuron_release, standin):
    from pipeline.runtime import BucketedModel

    runner = BucketedModel.load(neuron_release[1]).runner
    bucket = Bucket(2, 32)
    slots = runner.slots(bucket)
    assert runner.slots(bucket) is slots and (slots.batch, slots.seq) == (2, 32)
    prompt, n = [5, 6, 7], 10
    got = [slots.prefill(1, prompt)] + [slots.step([1])[0] for _ in range(n - 1)]
    slots.free(1)
    assert got == runner.session(bucket).generate([prompt], n, None)[0]
    assert got == expected(prompt, n, None)
    assert loads(standin) == ["b2_s32"]  # one export serves both
    # The prefill: one unpadded row from position 0; then one token a row, every row sorted.
    first, *rest = forwards(standin)
    assert first[2] == "context_encoding" and first[3]["input_ids"] == [prompt]
    assert first[3]["position_ids"] == [[0, 1, 2]] and first[3]["seq_ids"] == [1]
    assert [c[3]["position_ids"] for c in rest] == [[[p]] for p in range(3, 3 + n - 1)]
    # A batch-1 export (no continuous batching) is one slot.
    one = runner.slots(Bucket(1, 16))
    assert [one.prefill(0, [9, 9]), *one.step([0])] == expected([9, 9], 2, None)


@pytest.mark.parametrize("on_device_sampling", [True, False], ids=["tokens", "logits"])
def test_interleaved_slots_each_give_their_alone_answer(fake, on_device_sampling):
    """Requests join and leave a running batch: prefills between steps, steps of some slots in
    any order, one-token prompts, freed slots reused. Each request's tokens are its own,
    whether the export samples on the device or returns logits (Qwen2/3 at tp 2)."""
    import random

    _, slots = in_memory(fake, on_device_sampling=on_device_sampling)
    rng = random.Random(7)
    running: dict[int, tuple[list[int], list[int]]] = {}  # slot: (prompt, tokens)
    finished = 0

    def finish(slot: int) -> None:
        nonlocal finished
        prompt, tokens = running.pop(slot)
        assert tokens == expected(prompt, len(tokens), None), (slot, prompt)
        slots.free(slot)
        finished += 1

    for _ in range(400):
        free = [s for s in range(slots.batch) if s not in running]
        roll = rng.random()
        if free and (roll < 0.25 or not running):
            prompt = [rng.randrange(512) for _ in range(rng.choice([1, 1, 2, 5, 9]))]
            slot = rng.choice(free)
            running[slot] = (prompt, [slots.prefill(slot, prompt)])
        elif roll < 0.35:
            finish(rng.choice(sorted(running)))
        else:
            some = rng.sample(sorted(running), rng.randint(1, len(running)))
            for slot, token in zip(some, slots.step(some), strict=True):
                running[slot][1].append(token)
                if len(running[slot][0]) + len(running[slot][1]) == slots.seq:
                    finish(slot)  # full
    for slot in sorted(running):
        finish(slot)
    assert finished > 50
    routes = {c[2] for c in forwards(fake)}
    assert routes == {"context_encoding", "token_generation"}
    assert slots.on_device_sampling is on_device_sampling  # else the host took the argmax


def test_every_decode_carries_every_active_slot(fake):
    _, slots = in_memory(fake)
    a = [slots.prefill(0, [1, 2, 3])]
    b = [slots.prefill(2, [4, 5])]
    b += slots.step([2])  # slot 0 fed again beside it, its answer dropped
    last = forwards(fake)[-1][3]
    assert last["seq_ids"] == [0, 2] and last["position_ids"] == [[3], [2]]
    a += slots.step([0])
    c = [slots.prefill(1, [6])]  # one token: a decode row at position 0, beside 0 and 2
    last = forwards(fake)[-1]
    assert last[2] == "token_generation" and last[3]["seq_ids"] == [0, 1, 2]
    b += slots.step([2, 0])[:1]
    assert a == expected([1, 2, 3], 2, None) and b == expected([4, 5], 3, None)
    assert c == expected([6], 1, None)


def test_a_wrong_position_or_a_left_out_slot_is_refused_by_the_standin(fake, monkeypatch):
    """The stand-in catches engine mistakes: these tests fail if it answered them."""
    from pipeline.runtime.neuron_slots import NeuronSlots

    _, slots = in_memory(fake)
    slots.prefill(0, [1, 2, 3, 4, 5, 6])
    right = NeuronSlots._forward

    def one_ahead(self, ids, positions, seq_ids, wanted):
        if len(ids[0]) == 1:
            positions = [[p + 1] for (p,) in positions]
        return right(self, ids, positions, seq_ids, wanted)

    monkeypatch.setattr(NeuronSlots, "_forward", one_ahead)
    with pytest.raises(ValueError, match=r"seq_id 0, position 7: does not continue"):
        slots.step([0])
    monkeypatch.setattr(NeuronSlots, "_forward", right)
    assert slots.step([0]) == expected([1, 2, 3, 4, 5, 6], 2, None)[1:]  # state unchanged

    def alone(self, rows):  # the decode without the other active slots
        order = sorted(rows)
        ids, positions = [[rows[s][0]] for s in order], [[rows[s][1]] for s in order]
        out = right(self, ids, positions, order, set(order))
        return dict(zip(order, out, strict=True))

    monkeypatch.setattr(NeuronSlots, "_decode", alone)
    slots.prefill(1, [7, 8, 9])
    slots.step([1])  # at position 3: the padding copies it into slot 0's line
    with pytest.raises(ValueError, match="position 3 holds a copy of another row"):
        slots.step([0])


def test_the_standin_refuses_what_upstream_cannot_run(fake):
    import torch

    model, _ = in_memory(fake, batch=2, seq=8)
    greedy = torch.ones((1, 3))

    def forward(ids, pos, seq, params=greedy):
        return model.forward(torch.tensor(ids), torch.tensor(pos), torch.tensor(seq), params)

    with pytest.raises(ValueError, match=r"distinct cache lines 0\.\.1"):
        forward([[1, 2]], [[0, 1]], [2])
    with pytest.raises(ValueError, match="> the context length 8"):
        forward([list(range(9))], [list(range(9))], [0])
    with pytest.raises(ValueError, match="3 rows for an export of 2 lines"):
        forward([[1]] * 3, [[0]] * 3, [0, 1, 1], torch.ones((3, 3)))
    with pytest.raises(ValueError, match="position 1: does not continue"):
        forward([[5]], [[1]], [0])  # nothing at position 0
    with pytest.raises(ValueError, match="top_k"):
        forward([[1, 2]], [[0, 1]], [0], torch.tensor([[0.0, 1.0, 1.0]]))
    assert forward([[1, 2], [3, 4]], [[0, 1], [0, 1]], [1, 0], torch.ones((2, 3))).tolist() == [
        expected([1, 2], 1, None)[0],
        expected([3, 4], 1, None)[0],
    ]  # two prompts at once: one graph call each upstream, as here


def test_bad_slot_calls_raise_value_errors_and_change_nothing(fake):
    _, slots = in_memory(fake, batch=2, seq=8)
    first = slots.prefill(0, [1, 2, 3])
    calls = len(forwards(fake))
    bad = [
        lambda: slots.prefill(2, [1]),  # no such slot
        lambda: slots.prefill(1, []),
        lambda: slots.prefill(1, [1] * 8),  # leaves no room for a new token
        lambda: slots.step([1]),  # not active
        lambda: slots.step([0, 0]),
        lambda: slots.step([]),
        lambda: slots.free(-1),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
    assert len(forwards(fake)) == calls  # none reached the model
    tokens = [first] + [slots.step([0])[0] for _ in range(4)]  # 3 + 5 = 8 tokens: full
    with pytest.raises(InputError, match="holds 8 tokens"):
        slots.step([0])
    assert tokens == expected([1, 2, 3], 5, None)
    slots.free(0)
    slots.free(0)  # freeing a free slot does nothing
    assert slots.prefill(0, [1, 2, 3]) == first


def test_a_bucket_with_active_slots_is_never_evicted(neuron_release, standin):
    from pipeline.errors import PipelineError
    from pipeline.runtime import BucketedModel
    from pipeline.runtime.neuron import bucket_costs

    _, model_dir = neuron_release
    costs = bucket_costs(BucketedModel.load(model_dir).installed)
    b16, b32, b64, wide = Bucket(1, 16), Bucket(1, 32), Bucket(1, 64), Bucket(2, 16)
    budget = costs[b16] + max(costs[b32], costs[wide])  # two at once, one of them b1_s16
    assert costs[b16] + costs[b64] > budget
    runner = BucketedModel.load(model_dir, hbm_budget=budget).runner
    busy = runner.slots(b16)
    busy.prefill(0, [1, 2])
    runner.session(b32)
    # The least recently used bucket is busy: the next one goes instead.
    runner.session(wide)
    assert runner.loaded == [b16, wide]
    # No room without evicting the busy one: refused, and nothing evicted for nothing.
    with pytest.raises(PipelineError, match=r"active slots \(b1_s16\).*retry once"):
        runner.session(b64)
    assert runner.loaded == [b16, wide]
    with pytest.raises(PipelineError, match="active slots"):
        runner.session(b16).generate([[1]], 1, None)  # would overwrite slot 0's cache
    with pytest.raises(PipelineError, match="active slots"):
        runner.unload(b16)
    assert busy.step([0]) == expected([1, 2], 2, None)[1:]  # its request carried on
    busy.free(0)
    runner.session(b64)  # now b1_s16 may go
    assert b16 not in runner.loaded
    assert sorted(Path(p).name for p in standin.LIVE.values()) == sorted(
        b.name for b in runner.loaded
    )  # released, though the test still holds its slots
    with pytest.raises(PipelineError, match="was unloaded"):
        busy.prefill(0, [1])
    again = runner.slots(b16)
    assert again is not busy and again.prefill(0, [1, 2]) == expected([1, 2], 1, None)[0]


def test_sampled_slots_pass_upstreams_rows_and_sample_logits_on_the_host(fake, caplog):
    """On-device sampling: each row's [top_k, top_p, temperature] goes to forward. Logits:
    the host sampler draws, seeded, and only for the slots asked (a slot fed again beside
    another's step does not advance its draws)."""
    from pipeline.runtime.sampling import SamplingParams

    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    _, slots = in_memory(fake)
    slots.prefill(0, [1, 2, 3], hot)
    slots.prefill(1, [4, 5])
    slots.step([0, 1])
    rows = forwards(fake)[-1][3]["sampling_params"]  # float32, as upstream takes them
    assert rows[1] == [1.0, 1.0, 1.0]  # the greedy row
    assert rows[0] == pytest.approx(slots.sampling_row(hot))
    assert rows[0] == pytest.approx([float(slots.max_topk), 0.9, 1.0])  # top_k all: max_topk

    def answer(slots, beside: bool) -> list[int]:
        out = [slots.prefill(2, [7, 8], hot)]
        if beside:
            slots.prefill(3, [9, 9, 9])
        while len(out) < 8:
            if beside:
                slots.step([3])  # slot 2 is fed again here: no draw of its own
            out += slots.step([2])
        slots.free(2)
        slots.free(3)
        return out

    with caplog.at_level("INFO", logger="inf2_pipeline.runtime"):
        _, host = in_memory(fake, on_device_sampling=False)
    assert "picked on the host" in caplog.text  # the runner says what it does instead
    alone = answer(host, beside=False)
    assert answer(host, beside=True) == alone
    assert alone != expected([7, 8], 8, None)  # drawn, not the argmax
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=4)
    assert [host.prefill(2, [7, 8], other), *host.step([2])] != alone[:2]
