"""What a streamed token costs the front's text decoding as an answer grows, where the
tokenizer's decode cleans up spaces (transformers 4 does for Llama 3's tokenizer): µs per
``TextStream.push`` near the start and near the end of answers of 2,000 / 8,000 / 32,000
characters, beside the named baseline measured in the same run, "cleaned whole" (the same
stream made to clean all its text at every push, as it did before 2026-12-06).

    python bench/bench_text_stream.py [--chars 2000,8000,32000] [--repeats 3]

The tokenizer is a byte-level BPE trained here on generated English (no hub), with the
cleanup on (forced where transformers 5 would skip it for BPE). One token a push, on both of
the stream's paths: tokenizers' ``DecodeStream`` and windows of ids.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.server import tokenizer as tokenizer_module
from pipeline.server.tokenizer import TextStream

_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "model answer token stream water long little very after words called just where most know"
)
WORDS = _WORDS.split()
CONTRACTIONS = ["don't", "it's", "I'm", "we've", "they're", "isn't", "that's"]


def english(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [
            rng.choice(CONTRACTIONS) if rng.random() < 0.08 else rng.choice(WORDS)
            for _ in range(rng.randrange(5, 16))
        ]
        words = [w + "," if rng.random() < 0.08 else w for w in words[:-1]] + words[-1:]
        s = " ".join(words)
        out.append(s[0].upper() + s[1:] + rng.choice(".!?."))
    return " ".join(out)


def cleaned_tokenizer(text: str) -> Any:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator([text], trainer)
    kw: dict[str, Any] = {"clean_up_tokenization_spaces": True}
    if not transformers.__version__.startswith("4."):  # 5 skips it for BPE unless forced
        kw[tokenizer_module._FORCE_BPE_CLEANUP] = True
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **kw)


def pushes(tok: Any, ids: list[int], whole: bool) -> tuple[list[float], str]:
    """µs of each push, and the text streamed."""
    t = TextStream(tok, [])
    if whole:
        t._pieces = False  # the baseline: every push cleans all the text
    clock, times, out = time.perf_counter, [], []
    for i in ids:
        t0 = clock()
        out.append(t.push([i]))
        times.append((clock() - t0) * 1e6)
    return times, "".join(out) + t.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", default="2000,8000,32000", help="answer lengths, characters")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest kept")
    args = ap.parse_args()
    import transformers

    text = english(random.Random(0), 1000)
    tok = cleaned_tokenizer(text)
    every = tok(text, add_special_tokens=False).input_ids
    print(f"transformers {transformers.__version__}; µs per push, median of the first and last "
          f"5 % of an answer's pushes, best of {args.repeats}")  # fmt: skip
    print(f"{'chars':>6} {'path':>12} {'way':>14} {'start':>7} {'end':>7}  end ÷ baseline's")
    real_backend = tokenizer_module.stream_backend
    for chars in (int(c) for c in args.chars.split(",")):
        n = next((k for k in range(1, len(every)) if len(tok.decode(every[:k])) >= chars), None)
        if n is None:
            sys.exit(f"error: --chars {chars}: the generated text is shorter; ask for less")
        ids, want = every[:n], tok.decode(every[:n])
        for path in ("DecodeStream", "windows"):
            tokenizer_module.stream_backend = (
                real_backend if path == "DecodeStream" else (lambda t: None)
            )
            ends = {}
            for way, whole in (("cleaned whole", True), ("in pieces", False)):
                start = end = float("inf")
                for _ in range(args.repeats):
                    times, got = pushes(tok, ids, whole)
                    if got != want:
                        sys.exit(f"error: {way} streamed other text than decode gives")
                    w = max(50, n // 20)
                    start = min(start, statistics.median(times[:w]))
                    end = min(end, statistics.median(times[-w:]))
                ends[way] = end
                ratio = end / ends["cleaned whole"]
                print(f"{chars:>6} {path:>12} {way:>14} {start:7.1f} {end:7.1f}  {ratio:.2f}×")
    tokenizer_module.stream_backend = real_backend


if __name__ == "__main__":
    main()
