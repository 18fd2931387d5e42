"""CUDA-graph decode: the copy-in / replay / read-out logic of ``StaticGraph`` and its wiring
into ``DecodeSession``, tested on CPU with a recorder that replays the way a CUDA graph does
(same output tensor, recomputed from the graph-owned inputs); and on a GPU for real."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.cuda_graphs import StaticGraph


class ReplayRecorder:
    """Stands in for CUDA graph capture: warm up, record once, and on replay recompute
    ``fn`` (which reads the graph-owned inputs) into the recorded output tensor."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fn, warmup):
        def counted():
            self.calls += 1
            return fn()

        for _ in range(warmup):
            counted()
        out = counted()  # a tuple of tensors: every output of the recorded step

        def replay():
            for dst, src in zip(out, counted(), strict=True):
                dst.copy_(src)

        return replay, out


def test_static_graph_copies_inputs_in_and_reads_the_recorded_output():
    acc = torch.tensor([100.0, 200.0])  # fixed: captured by address, like a KV cache
    recorder = ReplayRecorder()
    graph = StaticGraph(
        lambda x, y, a: x * 2 + y + a,
        (torch.empty(2), torch.empty(2)),
        (acc,),
        recorder=recorder,
        warmup=2,
    )
    assert recorder.calls == 3  # two warmups and the capture, before any input is given
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    first = graph(x, y)
    assert first.tolist() == [112.0, 224.0]
    x.add_(1000)  # the caller's tensor is not the graph's: changing it changes nothing
    assert graph.inputs[0].tolist() == [1.0, 2.0]
    acc.add_(1)  # a fixed tensor is read at replay time
    second = graph(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0]))
    assert second is first  # always the one recorded output, overwritten in place
    assert second.tolist() == [107.0, 209.0]
    assert recorder.calls == 5  # one replay per call, no extra eager call


def test_static_graph_refuses_inputs_of_another_shape_or_dtype():
    graph = StaticGraph(
        lambda t: t + 1, (torch.zeros(2, 1, dtype=torch.int64),), recorder=ReplayRecorder()
    )
    with pytest.raises(ValueError, match="does not match"):
        graph(torch.zeros(2, dtype=torch.int64))  # [B] where [B, 1] was recorded
    with pytest.raises(ValueError, match="does not match"):
        graph(torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected 1 inputs"):
        graph(torch.zeros(2, 1, dtype=torch.int64), torch.zeros(1))


@pytest.fixture(scope="module")
def demo_buckets(compiled_store):
    config, _ = compiled_store
    return config.parent / "work" / "buckets"


def test_recorded_decode_session_equals_direct_calls_on_the_compiled_demo(demo_buckets):
    """The session records decode before any prefill, on its own caches; a replayed decode
    gives the same logits and tokens as direct calls (wired wrong — another cache, a capture
    after prefill whose warmup overwrites position 0, inputs not copied — it would not)."""
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.graph_loading import BucketGraphs

    graphs = BucketGraphs(demo_buckets / "b2_s64", single_threaded=True)
    plain = DecodeSession(graphs)
    recorded = DecodeSession(graphs, recorder=ReplayRecorder())
    assert recorded.graphed and not plain.graphed
    assert recorded.k_cache.data_ptr() != plain.k_cache.data_ptr()
    prompts = [[5, 17, 42, 99, 7, 300], list(range(3, 40))]
    assert recorded.generate(prompts, 12, None) == plain.generate(prompts, 12, None)

    tokens = torch.zeros((2, 64), dtype=torch.int64)
    tokens[0, :3], tokens[1, :5] = torch.tensor([1, 2, 3]), torch.tensor([9, 8, 7, 6, 5])
    lengths = torch.tensor([3, 5])
    for session in (plain, recorded):
        session.prefill(tokens, lengths)
    step = torch.tensor([[11], [12]])
    for k in range(3):
        a = plain.decode(step, lengths + k).clone()
        b = recorded.decode(step, lengths + k)
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_generate_stops_at_eos_like_a_step_by_step_loop(demo_buckets):
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.graph_loading import BucketGraphs

    session = DecodeSession(BucketGraphs(demo_buckets / "b2_s64"))
    prompts = [[5, 17, 42], [9, 9, 9, 9]]
    free = session.generate(prompts, 10, None)
    eos = free[0][3]  # a token the first row emits at step 4
    stopped = session.generate(prompts, 10, eos)
    for full, cut in zip(free, stopped, strict=True):
        assert cut == (full[: full.index(eos) + 1] if eos in full else full)
    with pytest.raises(ValueError, match="must fit 64 cache positions"):
        session.generate([list(range(60))], 6, None)


def test_generate_fills_the_bucket_to_its_last_position(demo_buckets):
    """60 prompt tokens + 5 new in a 64-position bucket: the 5th token needs no cache slot.
    The greedy step (in-graph argmax fed back in place) equals a loop over decode logits."""
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.graph_loading import BucketGraphs

    graphs = BucketGraphs(demo_buckets / "b2_s64", single_threaded=True)
    prompts = [list(range(3, 63)), [7, 8]]
    recorder = ReplayRecorder()
    recorded = DecodeSession(graphs, recorder=recorder)
    before = recorder.calls
    got = recorded.generate(prompts, 5, None)
    assert recorder.calls - before == 4  # one replay per token after the prefill's
    assert got == DecodeSession(graphs).generate(prompts, 5, None)

    manual = DecodeSession(graphs)
    tokens = torch.zeros((2, 64), dtype=torch.int64)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    nxt = manual.prefill(tokens, lengths).argmax(-1)
    want = [nxt]
    for k in range(4):
        nxt = manual.decode(nxt[:, None], lengths + k).argmax(-1)
        want.append(nxt)
    assert got == torch.stack(want, 1).tolist()


def test_key_tiers_double_from_the_smallest_up_to_the_bucket():
    from pipeline.contracts.graph_abi import key_tiers

    assert key_tiers(2048) == (64, 128, 256, 512, 1024, 2048)
    assert key_tiers(100) == (64, 100)
    assert key_tiers(64) == (64,)
    assert key_tiers(16) == (16,)
    assert key_tiers(64, smallest=16) == (16, 32, 64)


def test_decode_reads_only_the_key_positions_it_is_given(demo_buckets):
    """The compiled decode graph attends the first len(key_positions) cache positions: a
    prefix that holds every position gives the full bucket's logits; one that cuts the
    prompt off gives others (so the bound is real, not ignored)."""
    from pipeline.runtime.graph_loading import BucketGraphs

    graphs = BucketGraphs(demo_buckets / "b2_s64")
    tokens = torch.randint(3, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([20, 9])

    def decode(n: int) -> torch.Tensor:
        k, v = graphs.new_cache()
        graphs.prefill_rows(tokens, lengths, k, v)
        step = torch.tensor([[11], [12]])
        return graphs.decode(step, lengths, k, v, torch.arange(n))[0]

    full = decode(64)
    torch.testing.assert_close(decode(21), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode(32), full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(decode(8), full, rtol=1e-3, atol=1e-3)


def test_generate_moves_up_the_tiers_as_the_cache_fills(demo_buckets):
    """Each step attends the shortest tier holding every position so far; crossing tiers
    (16 → 32 → 64) changes no token, recorded (one graph per tier on shared inputs) or not."""
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.graph_loading import BucketGraphs

    graphs = BucketGraphs(demo_buckets / "b2_s64", single_threaded=True)
    attended: list[int] = []
    decode = graphs.decode

    def spy(tokens, positions, k, v, keys):
        attended.append(keys.shape[0])
        return decode(tokens, positions, k, v, keys)

    graphs.decode = spy
    prompts = [list(range(3, 13)), [7, 8, 9]]  # longest: 10 tokens
    want = DecodeSession(graphs, tiers=(64,)).generate(prompts, 40, None)
    for recorder in (None, ReplayRecorder()):
        session = DecodeSession(graphs, tiers=(16, 32, 64), recorder=recorder)
        attended.clear()
        assert session.generate(prompts, 40, None) == want
        # step k (1..39) attends 10 + k positions
        assert attended == [16] * 6 + [32] * 16 + [64] * 17
    with pytest.raises(ValueError, match="must rise to the bucket length 64"):
        DecodeSession(graphs, tiers=(16, 32))


# --- on an NVIDIA GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graph_decode_equals_non_graph_decode(compiled_cuda_release):
    from pipeline.runtime import BucketedModel

    graphed = BucketedModel.load(compiled_cuda_release)
    plain = BucketedModel.load(compiled_cuda_release, cuda_graphs=False)
    prompts = [[1, 17, 42, 99, 5, 7, 300, 12], list(range(10, 40))]
    assert graphed.generate(prompts, 20, None) == plain.generate(prompts, 20, None)
    bucket = graphed.select(2, 40)
    a, b = plain.session(bucket), graphed.session(bucket)
    assert b.graphed and not a.graphed
    tokens = torch.zeros((bucket.batch, bucket.seq), dtype=torch.int64)
    tokens[:, :4] = torch.tensor([3, 1, 4, 1])
    lengths = torch.full((bucket.batch,), 4)
    a.prefill(tokens, lengths)
    b.prefill(tokens, lengths)
    for k in range(5):
        step = torch.full((bucket.batch, 1), 7 + k)
        want = a.decode(step, lengths + k).clone()
        torch.testing.assert_close(b.decode(step, lengths + k), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("recorded", [False, True])
def test_slots_join_leave_and_skip_steps_each_equal_alone(demo_buckets, recorded):
    """The slot calls serve uses, recorded as a CUDA graph would be or eager: requests
    prefilled together and alone (the 32- and 64-token prefill graphs), stepped together and
    one at a time while the other waits, freed and replaced; every row's tokens equal its
    prompt generated alone in a bucket of its own (fp32 on cpu)."""
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.graph_loading import BucketGraphs
    from pipeline.runtime.session_slots import SessionSlots

    graphs = BucketGraphs(demo_buckets / "b2_s64", single_threaded=True)
    alone = DecodeSession(BucketGraphs(demo_buckets / "b1_s64", weights=graphs.weights))
    slots = SessionSlots(DecodeSession(graphs, recorder=ReplayRecorder() if recorded else None))
    assert slots.prefill_batch == 2 and slots.prefill_positions(20) == 32
    # recorded, every prefill call below replays one of these graphs
    want_graphs = [(1, 32), (1, 64), (2, 32), (2, 64)] if recorded else []
    assert slots.session.prefill_graphs == want_graphs
    a, b, c = [5, 17, 42], list(range(3, 43)), [300, 2, 9, 9]  # b needs the 64 graph
    got = {0: [], 1: []}
    for slot, t in zip((0, 1), slots.prefill_many([0, 1], [a, b]), strict=True):
        got[slot].append(t)
    for i in range(6):
        got[i % 2] += slots.step([i % 2])  # the other row waits a step
        for slot, t in zip((0, 1), slots.step([0, 1]), strict=True):
            got[slot].append(t)
    assert got[0] == alone.generate([a], len(got[0]), None)[0]
    assert got[1] == alone.generate([b], len(got[1]), None)[0]
    slots.free(0)
    new = [slots.prefill(0, c)]
    for _ in range(4):
        new.append(slots.step([0, 1])[0])
    assert new == alone.generate([c], 5, None)[0]
    with pytest.raises(RuntimeError, match="slots are in use"):
        slots.session.generate([a], 2, None)  # whole-batch calls would clobber them


def test_sampled_slots_replayed_as_graphs_equal_eager_ones(demo_buckets):
    """The sampled path through recorded step and prefill graphs (their static inputs get
    the drawn token written back) gives the eager session's tokens for the same seeds,
    greedy rows beside it included, with rows held while others step."""
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.graph_loading import BucketGraphs
    from pipeline.runtime.sampling import SamplingParams
    from pipeline.runtime.session_slots import SessionSlots

    graphs = BucketGraphs(demo_buckets / "b2_s64", single_threaded=True)
    hot = SamplingParams(temperature=1.1, top_k=40, seed=21)

    def run(recorder) -> list[list[int]]:
        slots = SessionSlots(DecodeSession(graphs, recorder=recorder))
        got = [[], []]
        first = slots.prefill_many([0, 1], [[5, 17, 42], [9, 9, 9, 9]], [hot, SamplingParams()])
        for row, t in enumerate(first):
            got[row].append(t)
        for i in range(8):
            got[i % 2] += slots.step([i % 2])  # the other row is held a step
            for row, t in enumerate(slots.step([0, 1])):
                got[row].append(t)
        return got

    eager, replayed = run(None), run(ReplayRecorder())
    assert replayed == eager
    greedy = DecodeSession(BucketGraphs(demo_buckets / "b1_s64", weights=graphs.weights))
    assert eager[1] == greedy.generate([[9, 9, 9, 9]], len(eager[1]), None)[0]
    assert eager[0] != greedy.generate([[5, 17, 42]], len(eager[0]), None)[0]


def test_the_recorded_sampler_draws_the_eager_tokens_of_both_kinds(demo_buckets):
    """Graphed, a step's sampled rows are drawn by one recorded sampler per kind (with a
    top-k/top-p filter or without), both recorded with the session: the tokens equal the
    eager draw's, a temperature-only row first and a filtered one joining it."""
    from pipeline.runtime.decode_session import DecodeSession
    from pipeline.runtime.graph_loading import BucketGraphs
    from pipeline.runtime.sampling import SamplingParams
    from pipeline.runtime.session_slots import SessionSlots

    graphs = BucketGraphs(demo_buckets / "b2_s64", single_threaded=True)
    warm = SamplingParams(temperature=0.8, seed=5)
    picky = SamplingParams(temperature=1.3, top_p=0.8, top_k=20, seed=9)

    def run(recorder) -> tuple[list[list[int]], DecodeSession]:
        session = DecodeSession(graphs, recorder=recorder)
        slots = SessionSlots(session)
        got = [[slots.prefill(0, [4, 8, 15], warm)], []]
        for _ in range(3):
            got[0] += slots.step([0])
        got[1].append(slots.prefill(1, [16, 23, 42], picky))
        for _ in range(4):
            for row, t in enumerate(slots.step([0, 1])):
                got[row].append(t)
        return got, session

    eager, _ = run(None)
    replayed, session = run(ReplayRecorder())
    assert replayed == eager
    graphs_made = session.sampler._graphs
    assert sorted(graphs_made) == [False, True] and all(graphs_made.values())
