"""The front's per-token path: ``TextStream`` on tokenizers' ``DecodeStream`` where that
decodes exactly as the tokenizer does, and on windows of ids elsewhere; the chunk events
from a per-stream template, byte for byte the JSON of the wire's dict.

Every tokenizer is built here (no hub): the tiny checkpoint's Metaspace BPE, a byte-level
BPE whose characters split over tokens, a Llama 2 style byte-fallback BPE and WordPiece, with
and without transformers' ``clean_up_tokenization_spaces``.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any

import pytest

from pipeline.server import chat, protocol
from pipeline.server.tokenizer import TextStream, cleans_in_pieces, cleanup, stream_backend

CORPUS = [
    "Grüße aus Köln, 東京 und São Paulo! 🚀 naïve café — ok 漢字 😀👍🏽 élan",
    "plain ascii words here. Don't , it's ok ? I 'm fine ! a . b",
] * 3
SPECIAL = "<|end|>"


def _byte_level(**kwargs: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=alphabet, special_tokens=[SPECIAL], show_progress=False
    )
    bpe.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=SPECIAL, **kwargs)


def _byte_fallback() -> Any:
    """Llama 2's shape: ``<0xNN>`` tokens for what the vocabulary lacks."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    special = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _word_piece(**kwargs: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer()
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.decoder = decoders.WordPiece()
    special = ["[UNK]", "[CLS]", "[SEP]"]
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=special, show_progress=False)
    wp.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", **kwargs)


class Windows:
    """A tokenizer with a decode and nothing else (as a slow one): only windows decode it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


FORCE = {"clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
# name: (tokenizer, whether DecodeStream decodes it, before any cleanup)
BUILDERS = {
    "byte-level": (_byte_level, True),
    # transformers 5 skips the cleanup for BPE, so what DecodeStream gives stays exact
    "byte-level, cleanup set": (lambda: _byte_level(clean_up_tokenization_spaces=True), True),
    "byte-level, cleanup forced": (
        lambda: _byte_level(clean_up_tokenization_spaces=True, **FORCE),
        True,
    ),
    "byte-fallback": (_byte_fallback, True),
    "wordpiece": (_word_piece, True),
    "wordpiece, cleanup set": (lambda: _word_piece(clean_up_tokenization_spaces=True), True),
    "decode only": (lambda: Windows(_byte_level()), False),
}
# the tokenizers whose decode cleans up spaces
CLEANED = ("byte-level, cleanup forced", "wordpiece, cleanup set")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, bool]]:
    from transformers import AutoTokenizer

    from pipeline.tiny_model import write_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(out, 256)
    built = {"metaspace": (AutoTokenizer.from_pretrained(str(out)), True)}
    return built | {name: (make(), streams) for name, (make, streams) in BUILDERS.items()}


def _decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def _stream(tok: Any, ids: list[int], sizes: Any, stop: list[str] | None = None) -> list[str]:
    t = TextStream(tok, stop or [])
    out, at = [], 0
    while at < len(ids):
        n = sizes()
        out.append(t.push(ids[at : at + n]))
        at += n
    return [*out, t.flush()]


def _random_ids(rng: random.Random, vocab: int, specials: list[int]) -> list[int]:
    """Any ids, a few of them special (skipped in the text)."""
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 90))]
    for _ in range(rng.randrange(3)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    return ids


@pytest.mark.parametrize(
    "name",
    ["metaspace", "byte-level", "byte-level, cleanup set", "byte-fallback", "wordpiece", *CLEANED],
)
def test_decode_stream_deltas_add_up_to_the_whole_decode(tokenizers, name, monkeypatch):
    """Random ids, one at a time or several, special ones among them: the deltas add up to
    decoding every id at once (its space cleanup included), what was sent is always the
    start of that (no half character), and pushes decode no window (DecodeStream does all
    of it)."""
    tok, streams = tokenizers[name]
    assert streams and stream_backend(tok) is tok._tokenizer
    windows = 0
    decode = TextStream._decode

    def counted(self: TextStream, ids: list[int]) -> str:
        nonlocal windows
        windows += 1
        return decode(self, ids)

    monkeypatch.setattr(TextStream, "_decode", counted)
    rng = random.Random(name)
    specials = list(tok.all_special_ids)
    for trial in range(150):
        ids = _random_ids(rng, len(tok), specials)
        whole = _decode(tok, ids)
        t = TextStream(tok, [])
        out, windows = [], 0
        for at in range(len(ids)):
            out.append(t.push([ids[at]]))
            assert whole.startswith("".join(out)), trial  # no half character, nothing undone
        assert windows == 0, trial  # (a flush may decode what DecodeStream still holds)
        assert "".join(out) + t.flush() == _decode(tok, ids), trial
        sizes = lambda: rng.choice((1, 2, 3, 7))  # noqa: E731
        assert "".join(_stream(tok, ids, sizes)) == _decode(tok, ids), trial


def test_text_that_splits_characters_streams_whole_characters(tokenizers):
    """é, 漢字 and emoji over several byte-level tokens each: each delta holds whole ones."""
    tok, _ = tokenizers["byte-level"]
    text = "élan 漢字😀👍🏽 Grüße, naïve café; 東京🚀🚀 ok"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text) // 2  # several tokens for some characters
    pieces = _stream(tok, ids, lambda: 1)
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize(
    "name, text",
    [
        ("byte-level, cleanup set", "ok . ok , it 's"),
        ("byte-level, cleanup forced", "ok . ok , it 's"),
        ("wordpiece, cleanup set", "don ' t"),
        ("wordpiece", "don ' t"),
    ],
)
def test_the_cleanup_is_applied_where_decode_applies_it(tokenizers, name, text):
    """What ``cleanup`` rests on: transformers' decode is the Rust tokenizer's, then its
    space cleanup where it applies. This transformers leaves the cleanup out for BPE
    although the config asks for it (as Llama 3's does), so " ." stays; forced, or for
    WordPiece, the cleanup happens (" ' " becomes "'"), and the stream cleans too."""
    tok, _ = tokenizers[name]
    ids = tok(text, add_special_tokens=False).input_ids
    rust = tok._tokenizer.decode(ids, skip_special_tokens=True)
    assert " ." in rust or " ' " in rust  # text the cleanup would change
    assert (_decode(tok, ids) == rust) is (name not in CLEANED)
    assert (cleanup(tok) is None) is (name not in CLEANED)
    assert stream_backend(tok) is tok._tokenizer
    assert "".join(_stream(tok, ids, lambda: 1)) == _decode(tok, ids)


def test_the_cleanup_cleans_in_pieces_where_the_first_ends_in_three_non_spaces(tokenizers):
    """What cleaning a stream in pieces rests on, checked on this transformers' own cleanup
    (as a tokenizer that applies it has it): for every string of up to 6 characters over
    the space, the quote, "." and the letters of " n't", " 's" and " 've" (every shape of
    pattern, 2 to 4 long), and every cut whose first piece has no space in its last 3
    characters, cleaning the pieces gives the whole cleaned. And every one of those 3
    characters matters: for each, some cut with a space there (and none after it) does not
    (" n'" then "t" stays " n't", " '" then "s" stays " 's", " " then "." stays " .")."""
    tok, _ = tokenizers["wordpiece, cleanup set"]
    clean = cleanup(tok)
    assert clean is not None and cleans_in_pieces(tok)
    cleaned = {"": ""}
    for n in range(1, 7):
        for chars in itertools.product(" '.ntsve", repeat=n):
            s = "".join(chars)
            cleaned[s] = clean(s)
    cuts, broken = 0, set()  # how far from the end of the first piece its last space is
    for s, whole in cleaned.items():
        for k in range(1, len(s)):
            first = s[:k]
            space = first[-3:].rfind(" ")
            if space < 0:
                cuts += 1
                assert cleaned[first] + cleaned[s[k:]] == whole, (s, k)
            elif cleaned[first] + cleaned[s[k:]] != whole:
                broken.add(len(first[-3:]) - space)
    assert cuts > 10**6 and broken == {1, 2, 3}


@pytest.mark.parametrize("name", sorted({"metaspace", *BUILDERS} - set(CLEANED)))
def test_each_push_gives_what_the_windows_give(tokenizers, name):
    """On every tokenizer that does not clean spaces, the stream path or not: each push and
    the flush give what decoding windows gives (the text before DecodeStream), stop strings
    and ``stopped`` included."""
    tok, streams = tokenizers[name]
    assert (stream_backend(tok) is not None) is streams
    plain = tok if isinstance(tok, Windows) else Windows(tok)
    rng = random.Random(name)
    specials = list(plain.tokenizer.all_special_ids)
    for trial in range(60):
        ids = _random_ids(rng, len(plain.tokenizer), specials)
        stop = rng.choice([[], ["e"], ["ok", "é "], ["漢", ". "]])
        got, want = TextStream(tok, stop), TextStream(plain, stop)
        for i in ids:
            assert got.push([i]) == want.push([i]), trial
        assert (got.flush(), got.stopped) == (want.flush(), want.stopped), trial


@pytest.mark.parametrize("path", ["DecodeStream", "windows"])
@pytest.mark.parametrize("name", CLEANED)
def test_a_cleaned_stream_is_the_whole_decode_and_sends_nothing_it_takes_back(
    tokenizers, name, path, monkeypatch
):
    """Where decode cleans up spaces, a pattern can span two pushes (" '" then "s" is
    "'s"): cleaning each window apart lost text. On either path, what was sent is always
    the start of the whole decode (nothing sent is taken back), and the deltas add up to
    it, stop strings included."""
    tok, _ = tokenizers[name]
    if path == "windows":
        monkeypatch.setattr("pipeline.server.tokenizer.stream_backend", lambda t: None)
    ids = tok("it 's ok . don ' t , it ' s", add_special_tokens=False).input_ids
    assert "".join(_stream(tok, ids, lambda: 1)) == _decode(tok, ids) == "it's ok. don't, it's"
    rng = random.Random(name + path)
    vocab = {i for i in range(len(tok))} - set(tok.all_special_ids)
    # the ids of spaces, quotes and the letters cleanup patterns hold, so they come often
    parts = [i for i in sorted(vocab) if set(_decode(tok, [i]).strip()) <= set("'.,?!ntsmvre")]
    for trial in range(200):
        ids = [
            rng.choice(parts) if rng.random() < 0.7 else rng.randrange(len(tok))
            for _ in range(rng.randrange(2, 41))
        ]
        whole = _decode(tok, ids)
        t, sent = TextStream(tok, []), ""
        for i in ids:
            sent += t.push([i])
            assert whole.startswith(sent), trial
        assert sent + t.flush() == whole, trial
        stop = rng.choice(["'s", " ok", "n't"])
        cut = whole.find(stop)
        t = TextStream(tok, [stop])
        got = "".join(t.push([i]) for i in ids) + t.flush()
        assert got == (whole if cut < 0 else whole[:cut]) and t.stopped is (cut >= 0), trial


# words of 3 letters or more and the cleanup's patterns (all in the WordPiece vocabulary)
WORDS = ["plain", "ascii", "words", "here", "don", "fine", "line", "please"]
MARKS = [".", ",", "?", "!", "'s", "'m", "'ve", "'re", "n't", "' t", "' s"]


@pytest.mark.parametrize("path", ["DecodeStream", "windows"])
@pytest.mark.parametrize("name", CLEANED)
def test_a_long_cleaned_answer_cleans_only_its_tail(tokenizers, name, path, monkeypatch):
    """A long answer (thousands of characters, a cleanup pattern every few words), one
    token a push, on either path: after every push ``text`` is what cleaning all of it gives
    (a stream made to clean it whole, side by side), what was sent is the start of the
    whole decode and the deltas add up to it; and the raw text cleaned again on each push
    is only what follows its last 3 characters with no space, a few characters here (the
    rest was cleaned once), which it would not be if the stream never cut it."""
    tok, _ = tokenizers[name]
    if path == "windows":
        monkeypatch.setattr("pipeline.server.tokenizer.stream_backend", lambda t: None)
    rng = random.Random(name + path)
    words = [rng.choice(WORDS if rng.random() < 0.6 else MARKS) for _ in range(1500)]
    ids = tok(" ".join(words), add_special_tokens=False).input_ids
    whole = _decode(tok, ids)
    rust = tok._tokenizer.decode(ids, skip_special_tokens=True)
    assert len(whole) > 4000 and len(rust) - len(whole) > 500  # spaces the cleanup took out
    t, cleaned_whole = TextStream(tok, []), TextStream(tok, [])
    assert t._pieces and (t._stream is None) is (path == "windows")
    cleaned_whole._pieces = False
    sent, longest = "", 0
    for i in ids:
        got = t.push([i])
        assert got == cleaned_whole.push([i]) and t.text == cleaned_whole.text
        sent += got
        assert whole.startswith(sent)
        assert re.search("[^ ]{3}", t._raw_tail) is None  # cut after the last 3 non-spaces
        longest = max(longest, len(t._raw_tail))
    assert sent + t.flush() == whole
    assert (t._stream is None) is (path == "windows")  # the path it was meant to take
    assert longest < 64


def test_a_cut_is_sought_only_in_what_could_make_one():
    """``_last_split(raw, after)`` finds the cut ``_last_split(raw)`` finds wherever
    ``raw[:after]`` has none (a stream's tail: it was cut at its last one), so a tail with
    no cut is not scanned again at every push; and text with no 3 non-spaces in a row
    (" . . .", a model repeating itself) still streams exactly what decode gives."""
    from pipeline.server.tokenizer import _last_split

    rng = random.Random(3)
    checked = 0
    for _ in range(20000):
        raw = "".join(rng.choice(" .ab") for _ in range(rng.randrange(12)))
        for after in range(len(raw) + 1):
            if _last_split(raw[:after]) == 0:
                checked += 1
                assert _last_split(raw, after) == _last_split(raw), (raw, after)
    assert checked > 50000
    assert _last_split(" . . . .abc", 8) == 11 and _last_split(" . . . .", 0) == 0


@pytest.mark.parametrize("name", CLEANED)
def test_text_without_a_cut_streams_what_decode_gives(tokenizers, name):
    tok, _ = tokenizers[name]
    ids = tok(" ." * 300 + " ' ," * 50, add_special_tokens=False).input_ids
    t = TextStream(tok, [])
    assert t._pieces
    sent = "".join(t.push([i]) for i in ids) + t.flush()
    assert sent == _decode(tok, ids) and len(t._raw_tail) > 100  # never cut: cleaned whole


def test_a_cleanup_of_its_own_is_cleaned_whole():
    """A tokenizer class with a cleanup of its own ("ab" to "X", which joins text across
    any cut) is cleaned as a whole: the stream is its decode, token by token. Cleaned in
    pieces, as transformers' own cleanup is, "cca" then "b" would stay "ccab"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class OwnCleanup(PreTrainedTokenizerFast):
        def clean_up_tokenization(self, text: str) -> str:
            return text.replace("ab", "X")

    word = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    word.decoder = decoders.Fuse()
    tok = OwnCleanup(tokenizer_object=word, clean_up_tokenization_spaces=True)
    ids = [2, 2, 0, 1, 2, 0, 0, 1, 2, 2, 2, 2, 0, 1]
    assert _decode(tok, ids) == "ccXcaXccccX"
    assert cleanup(tok) is not None and not cleans_in_pieces(tok)
    assert "".join(_stream(tok, ids, lambda: 1)) == _decode(tok, ids)
    t = TextStream(tok, [])
    t._pieces = True  # as if it were transformers' own
    assert "".join([*(t.push([i]) for i in ids), t.flush()]) != _decode(tok, ids)


def test_a_decoder_decode_stream_refuses_goes_on_in_windows():
    """A decoder that rewrites text it gave for a later token (here "ab" becomes "X"):
    DecodeStream raises mid-stream, and the stream goes on decoding windows, as it would
    have from the start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    word.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tok = PreTrainedTokenizerFast(tokenizer_object=word)
    assert stream_backend(tok) is not None
    ids = [2, 0, 1, 2, 0, 2, 1]
    got, want = TextStream(tok, []), TextStream(Windows(tok), [])
    pushed = [(got.push([i]), want.push([i])) for i in ids]
    assert all(a == b for a, b in pushed) and got.flush() == want.flush()
    assert got._stream is None  # it did refuse


# --- chunk events ----------------------------------------------------------------------

TEXTS = [
    "",
    "plain",
    'say "hi"',
    "back\\slash",
    "new\nline\r\t",
    "é漢字😀",
    "\x00\x1f\u2028",
    "\ufffd",
]
IDS = [[], [0], [5], [1, 22, 333], [2**31 + 7]]
MODELS = ["tiny-llama", 'odd "name" \\ é', "\x00text\x00", "\x00ids\x00"]


@pytest.mark.parametrize("model", MODELS)
def test_chunk_events_are_the_dicts_json_byte_for_byte(model):
    """Each wire's ``chunk_event`` is exactly ``data: json.dumps(chunk)`` (None where the
    chunk is), for awkward text and ids, and model names that hold the template's stand-ins."""
    wires = [
        protocol.CompletionWire(protocol.new_id(), model, 1765000000),
        chat.ChatWire(chat.new_id(), model, 1765000000),
    ]
    for wire in wires:
        for text in TEXTS:
            for ids in IDS:
                chunk = wire.chunk(text, ids)
                want = None if chunk is None else f"data: {json.dumps(chunk)}\n\n"
                assert wire.chunk_event(text, ids) == want, (type(wire), text, ids)
