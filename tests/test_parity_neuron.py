"""Parity of a neuron release, with the stand-in exporter and the stand-in optimum.neuron
(tests/neuron_fakes.py, tests/neuron_standin): greedy tokens per bucket against the cpu
reference, and a report that says plainly that no logits were compared."""

from __future__ import annotations

import pytest

from pipeline.errors import InputError
from pipeline.parity.check import check_release

BUCKETS = ("b1_s16", "b2_s32")


@pytest.fixture
def hf_greedy(tiny_checkpoint):
    """The tiny checkpoint's greedy next token, in fp32 with transformers: what a correct
    export would produce."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()

    def next_token(tokens: list[int], vocab: int) -> int:
        with torch.no_grad():
            return int(model(torch.tensor([tokens])).logits[0, -1].argmax())

    return next_token


def test_neuron_parity_compares_greedy_tokens_and_says_no_logits(
    neuron_release, standin, tiny_checkpoint, hf_greedy, monkeypatch
):
    monkeypatch.setattr(standin, "NEXT_TOKEN", hf_greedy)
    _, model_dir = neuron_release
    report = check_release(
        model_dir, reference="cpu", checkpoint=tiny_checkpoint, buckets=BUCKETS, steps=4
    )
    assert report.passed and not report.logits
    assert [b.bucket for b in report.buckets] == list(BUCKETS)
    for b in report.buckets:
        assert b.greedy_exact == 1.0 and b.rows == 0 and not b.logits
    # Each bucket ran through its own export, the whole sequence within its length.
    loaded = [c[1].rsplit("/", 1)[-1] for c in standin.CALLS if c[0] == "from_pretrained"]
    assert loaded == list(BUCKETS)
    for call in (c for c in standin.CALLS if c[0] == "generate"):
        assert call[3]["max_new_tokens"] == 5
    text = report.to_markdown()
    assert "**Logits are not available**" in text and "| n/a | n/a | n/a |" in text
    assert report.to_dict()["logits_compared"] is False


def test_neuron_parity_fails_on_wrong_tokens(neuron_release, standin, tiny_checkpoint):
    report = check_release(
        neuron_release[1], reference="cpu", checkpoint=tiny_checkpoint, buckets=BUCKETS[:1]
    )
    assert not report.passed
    (failure,) = report.buckets[0].failures
    assert "greedy tokens diverge from the reference" in failure


def test_neuron_parity_needs_the_checkpoint(neuron_release, standin):
    with pytest.raises(InputError, match="pass --checkpoint"):
        check_release(neuron_release[1], reference="cpu")
