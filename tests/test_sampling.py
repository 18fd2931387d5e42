"""Per-request sampling (``pipeline.runtime.sampling``): the sampler against the softmax it
draws from, and the cpu slots that use it (the demo release, fp32)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.sampling import GREEDY, SamplingParams, sample, uniform

# chi-square critical value for 10 degrees of freedom at p = 0.001 (tables): a correct
# sampler exceeds it once in a thousand seeds; the seeds here are fixed
CHI2_10DF_P001 = 29.59


def chi2_top10(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square of the draws against ``probs`` over the 10 likeliest tokens and the rest."""
    n = len(tokens)
    top = probs.topk(10).indices
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    observed = torch.cat([counts[top], (n - counts[top].sum())[None]])
    expected = torch.cat([probs[top], (1 - probs[top].sum())[None]]).double() * n
    return float(((observed - expected) ** 2 / expected).sum())


def test_draws_follow_the_softmax_and_only_what_top_k_and_top_p_keep():
    torch.manual_seed(0)
    logits = torch.randn(50) * 2
    n = 20_000
    rows = logits.expand(n, 50)

    def draws(**kw):
        return sample(rows, [SamplingParams(seed=s, **kw) for s in range(n)], [0] * n)

    for t in (1.0, 0.5):
        got = draws(temperature=t)
        assert chi2_top10(got, (logits / t).softmax(0)) < CHI2_10DF_P001, t
    assert set(draws(temperature=1.0, top_k=3).tolist()) == set(logits.topk(3).indices.tolist())
    # top_p: the smallest set of likeliest tokens whose mass reaches p, and nothing else
    probs, order = logits.softmax(0).sort(descending=True)
    keep = int((probs.cumsum(0) < 0.6).sum()) + 1
    assert set(draws(temperature=1.0, top_p=0.6).tolist()) == set(order[:keep].tolist())


def test_the_noise_is_a_function_of_seed_step_and_token_only():
    u = uniform(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 1000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    again = uniform(torch.tensor([4, 3]), torch.tensor([0, 0]), 1000)
    assert torch.equal(again[0], u[2]) and torch.equal(again[1], u[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    # one row's draw does not depend on the rows beside it
    logits = torch.randn(3, 1000)
    p = [SamplingParams(temperature=1.0, seed=s) for s in (3, 3, 4)]
    both = sample(logits, p, [0, 1, 0])
    assert int(sample(logits[2:], p[2:], [0])[0]) == int(both[2])


def test_params_are_checked_and_greedy_is_temperature_zero_or_top_k_one():
    assert GREEDY.greedy and SamplingParams(temperature=0.9, top_k=1).greedy
    assert not SamplingParams(temperature=0.9).greedy
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# --- the cpu slots of the demo release ---------------------------------------------------


@pytest.fixture(scope="module")
def slots(installed):
    from pipeline.contracts.bucket import Bucket
    from pipeline.runtime import BucketedModel

    model = BucketedModel.load(installed[1])
    return model, model.slots(Bucket(2, 64))


def run(slots, slot: int, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    out = [slots.prefill(slot, prompt, params)]
    while len(out) < n:
        out += slots.step([slot])
    slots.free(slot)
    return out


def test_first_tokens_at_temperature_one_follow_the_models_softmax(slots, tiny_checkpoint):
    """The slot path end to end (prefill, its logits, the sampler) against the checkpoint's
    own softmax in transformers, for one prompt and 3,000 seeds."""
    from transformers import AutoModelForCausalLM

    _, s = slots
    prompt = [1, 17, 42, 99, 5]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    with torch.no_grad():
        probs = hf(torch.tensor([prompt])).logits[0, -1].softmax(0)
    firsts = []
    for seed in range(3000):
        firsts.append(s.prefill(0, prompt, SamplingParams(temperature=1.0, seed=seed)))
        s.free(0)
    assert chi2_top10(torch.tensor(firsts), probs) < CHI2_10DF_P001


def test_a_seed_gives_the_same_answer_whatever_runs_beside_it(slots):
    _, s = slots
    a = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    alone = run(s, 0, [1, 5, 9], a, 12)
    assert run(s, 1, [1, 5, 9], a, 12) == alone  # another slot: the same tokens
    # beside a greedy row and then a sampled one, joining at different steps
    out = [s.prefill(0, [1, 5, 9], a)]
    s.prefill(1, [7, 7, 7, 7])
    out += s.step([0, 1])[:1]
    s.free(1)
    s.prefill(1, [2, 3], SamplingParams(temperature=1.5, seed=99))
    while len(out) < 12:
        out += s.step([0, 1])[:1]
    s.free(0)
    s.free(1)
    assert out == alone
    other = run(s, 0, [1, 5, 9], SamplingParams(temperature=0.8, top_p=0.95, seed=12), 12)
    assert other != alone


def test_greedy_rows_beside_sampled_ones_stay_the_prompt_alone(slots):
    model, s = slots
    greedy = model.generate([[4, 8, 15, 16]], 10)[0]
    s.prefill(1, [2, 3], SamplingParams(temperature=1.0, seed=5))
    out = [s.prefill(0, [4, 8, 15, 16])]
    while len(out) < 10:
        out += s.step([0, 1])[:1]
    s.free(0)
    s.free(1)
    assert out == greedy
