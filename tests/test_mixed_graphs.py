"""Mixed graphs (graph ABI 6): a decode step and prompts, packed end to end into one stream,
prefilled into free rows in one call.

Eagerly the mixed decoder is its step and each prompt's prefill apart; compiled on cpu
(fp32) and driven through ``SessionSlots.launch_mixed``, eager and recorded as a CUDA graph
would be (``ReplayRecorder``), every row's tokens are its prompt's generated alone. Which
stream lengths a bucket's mixed calls take is the grid's choice or the backend's default,
part of the graph key, shown by ``plan`` and refused in one line when too short.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeline.compile import decoder as dec
from pipeline.contracts.bucket import Bucket
from pipeline.contracts.graph_abi import GraphSpec
from pipeline.errors import ConfigError
from pipeline.plan.config import load_config
from pipeline.runtime.decode_session import DecodeSession
from pipeline.runtime.graph_loading import BucketGraphs, new_cache
from pipeline.runtime.sampling import SamplingParams
from pipeline.runtime.session_slots import SessionSlots
from tests.shared_builds import built_once
from tests.test_cuda_graphs import ReplayRecorder

GRID = """
model: {name: tiny-llama, checkpoint: "{ckpt}", dtype: float32}
target: {backend: cpu, instance_type: inf2.24xlarge, tp_degree: 4}
buckets: {batch_sizes: [1, 3], sequence_lengths: [64], prefill_lengths: [32], MIXED}
compiler: {auto_cast_type: fp32}
store: store
"""


@pytest.fixture(scope="module")
def buckets(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """b1_s64 and b3_s64 compiled on cpu, b3 with a mixed graph used at 32 and 64."""
    from pipeline.compile.scheduler import compile_release

    def build(root: Path) -> None:
        config = root / "release.yaml"
        text = GRID.replace("{ckpt}", str(tiny_checkpoint))
        config.write_text(text.replace("MIXED", "mixed_lengths: [32, 64]"))
        report = compile_release(load_config(config), jobs=2, workdir=root / "work")
        assert not report.failed, [(r.bucket.name, r.error) for r in report.failed]

    return built_once(tmp_path_factory, "mixed", build) / "work" / "buckets"


def test_a_mixed_call_is_its_step_and_its_prefills_apart(tiny_checkpoint):
    """Eagerly: the step's rows, each packed prompt's logits and every cache entry a later
    step reads equal the step and each prompt's own prefill; a free row whose held position
    lies inside its new prompt is overwritten by the prompt (the step's writes come first);
    a placeholder prompt (length 0) repeats the one before it; padding stays in the
    shortest prompt's row, past its prompt, and finite."""
    prefill = dec.from_checkpoint(tiny_checkpoint, dec.Prefill)
    decode = dec.from_checkpoint(tiny_checkpoint, dec.Decode)
    mixed = dec.from_checkpoint(tiny_checkpoint, dec.Mixed)
    spec = GraphSpec(5, 64, 2, 4, 8, 512, "float32", "cpu")
    apart = new_cache(spec)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        running = torch.randint(3, 500, (2, 16), generator=g)
        _, first = prefill(running, torch.tensor([10, 16]), torch.tensor([0, 1]), *apart)
        together = tuple(c.clone() for c in apart)
        tokens = torch.zeros((5, 1), dtype=torch.long)
        tokens[:2, 0] = first
        positions = torch.tensor([10, 16, 30, 5, 0])  # rows 2..4 free, at held positions
        lengths, slots = [12, 7, 9], [3, 2, 4]
        prompts = [torch.randint(3, 500, (n,), generator=g) for n in lengths]
        keys = torch.arange(32)
        step_logits, step_next = decode(tokens, positions, *apart, keys)
        alone = [prefill(p[None], torch.tensor([len(p)]), torch.tensor([r]), *apart)
                 for p, r in zip(prompts, slots, strict=True)]  # fmt: skip
        stream = torch.cat((*prompts, torch.full((4,), 7)))  # 28 real positions, 4 padding
        logits, nxt = mixed(
            tokens, positions, stream, torch.tensor([*lengths, 0]), torch.tensor([*slots, 4]),
            *together, keys,
        )  # fmt: skip
    assert torch.equal(nxt[:2], step_next[:2])
    torch.testing.assert_close(logits[:2], step_logits[:2])
    for i, (lg, nx) in enumerate(alone):
        torch.testing.assert_close(logits[5 + i], lg[0])
        assert int(nxt[5 + i]) == int(nx[0])
    torch.testing.assert_close(logits[8], logits[7])  # a placeholder repeats the one before
    for a, b in zip(apart, together, strict=True):
        assert torch.equal(a[:, :, :2], b[:, :, :2])  # the step's rows
        for n, r in zip(lengths, slots, strict=True):
            torch.testing.assert_close(a[:, :n, r], b[:, :n, r])
        assert torch.isfinite(b[:, 7:11, 2]).all()  # padding: row 2 (the shortest), past 7


def test_the_mixed_graph_exports_without_reading_a_number_back(tiny_checkpoint):
    """Its sizes stay the inputs': no value read back from a tensor (an unbacked size). The
    first packed graph indexed by a 0-d tensor, which export turns into ``item()``; cpu's
    compile took that, cuda's could not specialise it and left the bucket without a mixed
    graph (H100, 2026-12-06)."""
    from pipeline.compile.backends.aoti import CpuBackend

    spec = GraphSpec(4, 64, 2, 4, 8, 512, "float32", "cpu", mixed_lengths=(32, 128))
    cache = new_cache(spec)
    graphs = CpuBackend()._graphs(dataclasses.replace(spec, prefill_batch=4), *cache)
    _, _, inputs, dims = next(g for g in graphs if g[1] is dec.Mixed)
    module = dec.from_checkpoint(tiny_checkpoint, dec.Mixed)
    program = torch.export.export(module, inputs, dynamic_shapes=dims, strict=False)
    reads = {"aten.item.default", "aten._local_scalar_dense.default"}
    read_back = [n for n in program.graph.nodes if str(n.target) in reads]
    assert not read_back and not [u for u in map(str, program.range_constraints) if "u" in u]


def test_the_packed_layout_places_every_position():
    """Positions, rows, segments and last tokens of a stream with a placeholder and padding
    that the cache's end clamps."""
    pos, rows, segment, last = dec.packed_layout(
        torch.tensor([3, 0, 2]), torch.tensor([5, 5, 1]), 8, seq=4
    )
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 3]
    assert rows.tolist() == [5, 5, 5, 1, 1, 1, 1, 1]
    assert segment.tolist() == [0, 0, 0, 2, 2, 3, 3, 3]
    assert last.tolist() == [2, 2, 4]


def test_the_compiled_bucket_describes_its_mixed_graphs(buckets):
    spec = GraphSpec.read(buckets / "b3_s64")
    assert spec.abi == 6 and spec.mixed_lengths == (32, 64) and spec.mixed_batch == 2
    assert [p.name for p in (buckets / "b3_s64").glob("mixed*")] == ["mixed.pt2"]
    one = GraphSpec.read(buckets / "b1_s64")  # one row: nothing to prefill beside its step
    assert one.mixed_lengths == () and one.mixed_batch == 0
    assert not list((buckets / "b1_s64").glob("mixed*"))


@pytest.mark.parametrize("recorded", [False, True])
def test_mixed_calls_answer_as_each_prompt_alone(buckets, recorded):
    """Rows joining through mixed calls of one and two prompts, at both stream lengths, beside
    a row stepping and a row held; recorded, every mixed call replays the graph of its
    (tier, length), a single prompt beside a placeholder."""
    graphs = BucketGraphs(buckets / "b3_s64", single_threaded=True)
    alone = DecodeSession(BucketGraphs(buckets / "b1_s64", weights=graphs.weights))
    session = DecodeSession(graphs, recorder=ReplayRecorder() if recorded else None)
    slots = SessionSlots(session)
    if recorded:
        assert session.mixed_graphs == [(64, 32), (64, 64)]  # one tier: the bucket is 64 long
        assert session.mixed_prompts == 2
    assert slots.mixed_lengths == (32, 64) and slots.mixed_batch == 2
    a, b, c, d = [5, 17, 42], list(range(3, 43)), [300, 2, 9, 9], [7] * 30
    got: dict[int, list[int]] = {0: [slots.prefill(0, a)], 1: [], 2: []}
    for _ in range(3):
        got[0] += slots.step([0])
    # two prompts (40 + 4 tokens: a stream of 64, its padding in c's row) beside row 0's step
    t = slots.launch_mixed([0], [2, 1], [b, c]).tokens()
    got[0].append(t[0])
    got[2].append(t[1])
    got[1].append(t[2])
    for _ in range(3):
        for s, tok in zip((0, 1, 2), slots.step([0, 1, 2]), strict=True):
            got[s].append(tok)
    want = {s: alone.generate([p], len(got[s]), None)[0] for s, p in ((0, a), (1, c), (2, b))}
    assert got == want
    slots.free(2)
    # one prompt (a stream of 32) beside row 1 stepping while row 0 is held
    t = slots.launch_mixed([1], [2], [d]).tokens()
    got[1].append(t[0])
    new = [t[1]]
    for _ in range(2):
        row = slots.step([0, 1, 2])
        got[0].append(row[0])
        got[1].append(row[1])
        new.append(row[2])
    assert got[0] == alone.generate([a], len(got[0]), None)[0]
    assert got[1] == alone.generate([c], len(got[1]), None)[0]
    assert new == alone.generate([d], 3, None)[0]


def test_sampled_rows_draw_in_a_mixed_call_what_they_draw_apart(buckets):
    """A request's tokens depend on its seed, not on how its calls were shared: a sampled
    prompt folded into a step with a sampled row draws what it draws prefilled apart."""
    graphs = BucketGraphs(buckets / "b3_s64", single_threaded=True)
    hot = SamplingParams(temperature=1.2, top_k=30, seed=4)
    warm = SamplingParams(temperature=0.7, seed=8)

    def run(fold: bool) -> list[list[int]]:
        slots = SessionSlots(DecodeSession(graphs))
        got = [[slots.prefill(0, [4, 8, 15], hot)], []]
        for _ in range(2):
            got[0] += slots.step([0])
        if fold:
            t = slots.launch_mixed([0], [1], [[16, 23, 42]], [warm]).tokens()
            got[0].append(t[0])
            got[1].append(t[1])
        else:
            got[1].append(slots.prefill(1, [16, 23, 42], warm))
            got[0] += slots.step([0])
        for _ in range(4):
            for row, tok in enumerate(slots.step([0, 1])):
                got[row].append(tok)
        return got

    assert run(fold=True) == run(fold=False)


def test_launch_mixed_refuses_what_its_graphs_cannot_take(buckets):
    slots = SessionSlots(DecodeSession(BucketGraphs(buckets / "b3_s64", single_threaded=True)))
    slots.prefill(0, [1, 2, 3])
    with pytest.raises(ValueError, match="in use"):
        slots.launch_mixed([0], [0], [[4, 5]])
    with pytest.raises(ValueError, match=r"70 tokens in all: .* up to 64"):
        slots.launch_mixed([0], [1, 2], [[4] * 40, [5] * 30])
    slots.prefill(1, [1, 2])
    with pytest.raises(ValueError, match=r"1\.\.2 prompts"):
        slots.launch_mixed([0], [2, 1, 0], [[4]] * 3)
    with pytest.raises(ValueError, match="not in use"):
        slots.launch_mixed([2], [2], [[4]])
    # the calls refused changed nothing: both rows still answer as alone
    assert len(slots.step([0, 1])) == 2


def test_the_demo_grid_s_mixed_calls_take_streams_up_to_its_length(compiled_store):
    config, _ = compiled_store
    bucket = config.parent / "work" / "buckets" / "b2_s64"
    slots = SessionSlots(DecodeSession(BucketGraphs(bucket, single_threaded=True)))
    assert slots.mixed_lengths == (32,) and slots.mixed_batch == 1
    slots.prefill(0, [1, 2, 3])
    with pytest.raises(ValueError, match=r"40 tokens in all: .* up to 32"):
        slots.launch_mixed([0], [1], [list(range(3, 43))])


def test_mixed_lengths_come_from_the_grid_or_the_backend_and_go_into_the_key(write_config):
    from pipeline.compile import keys
    from pipeline.compile.backends.aoti import CpuBackend, CudaBackend

    b8, b1 = Bucket(8, 2048), Bucket(1, 2048)
    ladder = (64, 128, 192, 256, 384, 512)
    assert CudaBackend().mixed_lengths(b8, None) == ladder  # up to 512 by default
    assert CudaBackend().mixed_lengths(Bucket(2, 100), None) == (64, 128)  # one free row
    assert CpuBackend().mixed_lengths(b8, None) == ()
    assert CudaBackend().mixed_lengths(b8, (1000,)) == (1000,)
    assert CudaBackend().mixed_lengths(b8, ()) == ()
    assert CudaBackend().mixed_lengths(b1, None) == ()  # one row: none
    plain = load_config(write_config(GRID.replace(", MIXED", "")))
    mixed = load_config(write_config(GRID.replace("MIXED", "mixed_lengths: [32]"), "m.yaml"))
    b3 = Bucket(3, 64)
    assert "mixed_lengths" not in keys.key_material(plain, b3, "cpu")
    assert keys.key_material(mixed, b3, "cpu")["mixed_lengths"] == [32]
    assert keys.bucket_cache_key(plain, b3, "cpu") != keys.bucket_cache_key(mixed, b3, "cpu")
    # one row: no mixed graph, so the key is the plain one
    b1 = Bucket(1, 64)
    assert keys.bucket_cache_key(plain, b1, "cpu") == keys.bucket_cache_key(mixed, b1, "cpu")


def test_a_mixed_length_too_short_for_a_prompt_is_one_line(write_config):
    config = write_config(GRID.replace("MIXED", "mixed_lengths: [1, 48]"))
    with pytest.raises(ConfigError, match=r"buckets.mixed_lengths.*\[1\] are too short"):
        load_config(config)
    assert load_config(write_config(GRID.replace("MIXED", "mixed_lengths: [48]"), "m.yaml"))


def test_plan_shows_each_bucket_s_mixed_lengths(write_config):
    from pipeline.plan.report import plan_release

    cuda = GRID.replace("backend: cpu", "backend: cuda").replace(", MIXED", "")
    plan = plan_release(load_config(write_config(cuda)))
    got = {b["name"]: b["mixed_lengths"] for b in plan.to_dict()["buckets"]}
    # cuda's default: up to 512, here no further than two prompts of the bucket's 64
    assert got == {"b1_s64": [], "b3_s64": [64, 128]}


def test_a_mixed_call_that_does_not_run_leaves_the_slots_as_they_were(buckets, monkeypatch):
    """It raises before the device runs it: no draw was taken, no row moved, so the same
    requests run apart and draw what they would have drawn."""
    graphs = BucketGraphs(buckets / "b3_s64", single_threaded=True)
    hot = SamplingParams(temperature=1.2, seed=4)

    def run(fail_first: bool) -> list[int]:
        slots = SessionSlots(DecodeSession(graphs))
        got = [slots.prefill(0, [4, 8, 15], hot)]
        if fail_first:
            real = slots.session.run_mixed
            monkeypatch.setattr(slots.session, "run_mixed", _raise)
            with pytest.raises(MemoryError):
                slots.launch_mixed([0], [1], [[16, 23]])
            monkeypatch.setattr(slots.session, "run_mixed", real)
            assert slots.slots_in_use == [0]
        slots.prefill(1, [16, 23])  # apart, as the engine runs them after such a failure
        for _ in range(4):
            got += slots.step([0, 1])[:1]
        return got

    assert run(fail_first=True) == run(fail_first=False)


def test_a_mixed_call_that_ran_and_then_failed_says_so_and_its_rows_moved_on(buckets):
    from pipeline.runtime.pending import RanThenFailed

    slots = SessionSlots(DecodeSession(BucketGraphs(buckets / "b3_s64", single_threaded=True)))
    slots.prefill(0, [4, 8, 15], SamplingParams(temperature=0.9, seed=1))
    slots._draw = _raise  # drawing the step's sampled row fails after the device ran it
    with pytest.raises(RanThenFailed, match="MemoryError"):
        slots.launch_mixed([0], [1], [[16, 23]])
    assert slots.session.next[:2] == [4, 2]  # row 0 stepped once, row 1 holds its prompt


def _raise(*_: object, **__: object) -> None:
    raise MemoryError("out of device memory")


def test_a_mixed_graph_that_cannot_be_built_leaves_its_prompts_to_prefill_apart(
    tiny_checkpoint, tmp_path, monkeypatch, capsys, export_only
):
    """A mixed graph is only a faster way to what prefill and decode do: where it cannot be
    exported, the bucket compiles without it (one line says so) rather than fail. (Exported
    for real, not compiled: what is decided here is export's.)"""
    from pipeline.compile.backends.aoti import CpuBackend
    from pipeline.compile.backends.base import BucketJob

    def broken(self, tokens, positions, prompt_tokens, prompt_lengths, prompt_slots, k, v, keys):
        raise NotImplementedError("an op export cannot trace")

    monkeypatch.setattr(dec.Mixed, "forward", broken)
    out = tmp_path / "out"
    out.mkdir()
    job = BucketJob(
        tiny_checkpoint, Bucket(3, 16), 1, {}, "float32", (), "fp32", out, mixed_lengths=(16,)
    )
    files = CpuBackend().compile(job).files
    spec = GraphSpec.read(out)
    assert spec.mixed_lengths == () and spec.mixed_batch == 0
    assert sorted(files) == ["decode.pt2", "graph.json", "prefill.pt2"]
    assert export_only == ["prefill.pt2", "decode.pt2"]
    assert not list(out.glob("mixed*"))
    said = capsys.readouterr().out
    assert "mixed.pt2: not built (NotImplementedError: an op export cannot trace)" in said
