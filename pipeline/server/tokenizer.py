"""Text in and out: the release's tokenizer files, and incremental decoding with stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import InputError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(release_dir: Path) -> Any | None:
    """The release's tokenizer (``transformers.AutoTokenizer``, local files only), or None
    when the release has none (then only token-id prompts are served)."""
    if not any((release_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(release_dir), local_files_only=True)
    except Exception as e:  # a broken or unsupported tokenizer: say which, exit 2
        raise InputError(
            f"tokenizer of {release_dir}",
            f"cannot be loaded ({type(e).__name__}: {e})",
            "check the tokenizer files the checkpoint had",
        ) from None


# Tokens decoded before the new ones, for their context: detokenizers join a token with
# its neighbours (a leading space, a character split over byte tokens), so the new text is
# what a window of the last few tokens decodes to beyond what its start alone decodes to.
CONTEXT_TOKENS = 6

# transformers' flag that forces the space cleanup on BPE models, which it skips otherwise
_FORCE_BPE_CLEANUP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
# How far back in the cleaned text one more character can change it: every cleanup pattern
# starts with a space and is at most 4 long, and " ' " then " n't" chain (" n ' t" is
# "n't", though " n '" was itself). The longest reach an exhaustive search over strings of
# up to 7 such characters found is 4; the text this close to its end waits.
CLEANUP_REACH = 6


def cleanup(tokenizer: Any) -> Any | None:
    """``tokenizer.clean_up_tokenization`` when its ``decode`` applies it (" ." to ".", " 's"
    to "'s", ...), else None. transformers 5 skips it for BPE models unless forced
    (transformers/tokenization_utils_tokenizers.py:1172-1197 in 5.25.0), so Llama 3's
    tokenizer, which asks for it, is not cleaned there; transformers 4, which the Neuron
    environment pins, has no forcing flag and cleans whenever the flag is set
    (tokenization_utils_fast.py:689 in 4.57.6)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    force = getattr(tokenizer, _FORCE_BPE_CLEANUP, None)
    backend = getattr(tokenizer, "_tokenizer", None)
    model = type(getattr(backend, "model", None)).__name__
    if force is not None and not force and model == "BPE":
        return None
    return tokenizer.clean_up_tokenization


def cleans_in_pieces(tokenizer: Any) -> bool:
    """Whether the space cleanup ``tokenizer`` applies is transformers' own
    (``PreTrainedTokenizerBase.clean_up_tokenization``), which cleans text in pieces as it
    cleans it whole where each piece but the last ends in 3 characters with no space
    (``_last_split``): then a stream cleans only the text after its last such end. A
    subclass's own cleanup may join text across any split ("ab" to "X", say), so it is
    cleaned whole. Staticmethod (transformers 4) or method (5): the same function either way."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return False
    clean = getattr(tokenizer, "clean_up_tokenization", None)
    return getattr(clean, "__func__", clean) is PreTrainedTokenizerBase.clean_up_tokenization


def _last_split(raw: str, after: int = 0) -> int:
    """The largest ``k`` >= 3 (and > ``after``) with no space in ``raw[k - 3 : k]``, else 0:
    where raw text cleaned by transformers' cleanup can be cut, ``clean(a + b) ==
    clean(a) + clean(b)`` for ``a = raw[:k]``. Why: each of its patterns (" .", " ' ",
    " n't", ...) starts with a space and is at most 4 long, so one that starts in ``a`` ends
    in it, and ``str.replace`` (left to right, not overlapping) replaces in ``a`` what it
    replaces in ``a`` alone, then in ``b`` what it replaces in ``b`` alone; a replacement
    only deletes spaces, so the last 3 characters of ``a`` come out of each of the 10 steps
    as they went in, and the next step splits the same way. Ordinary text has such a cut a
    few characters from its end; this looks back only that far, and never to ``after`` (a
    stream's tail had no cut before its new text: text without 3 non-spaces in a row,
    " . . .", is scanned once, not at every push)."""
    k = len(raw)
    while k >= 3 and k > after:
        space = raw.rfind(" ", k - 3, k)
        if space < 0:
            return k
        k = space
    return 0


def stream_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer (``tokenizers.Tokenizer``) to step a ``DecodeStream`` with, when
    what it streams is ``tokenizer.decode(ids, skip_special_tokens=True)`` before any space
    cleanup (``cleanup``); else None (a slow tokenizer, a class with its own decode)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 (older tokenizers lack it)
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    if cls._decode is not PreTrainedTokenizerFast._decode:  # Whisper's, say, does more
        return None
    return backend


class TextStream:
    """Token ids in, text deltas out; stops at the first stop string (which is not sent).

    Text is decoded incrementally. With a fast tokenizer whose decode is the Rust
    tokenizer's (``stream_backend``), ``tokenizers``' ``DecodeStream`` does it, in Rust
    (a push costs a quarter of what windows cost). Otherwise each push decodes a window of
    ``CONTEXT_TOKENS`` tokens before the new ones plus the new ones, and adds what that
    window decodes to beyond its start (the offsets technique of vLLM's and TGI's
    detokenizers, and DecodeStream's own), so a long answer costs the same per token as a
    short one instead of decoding every id again. A delta ending in an incomplete character
    (U+FFFD: byte-level tokens can split one) is held back until the next token completes
    it. Where the tokenizer's decode cleans up spaces (``cleanup``), the raw text is
    streamed so and cleaned as a whole, and its last ``CLEANUP_REACH`` characters wait
    (cleaning windows apart loses text: " '" then "s" is "'s", not " 's" cut after " '").
    With transformers' own cleanup (``cleans_in_pieces``), "as a whole" costs only the text
    since the last place it can be cut (``_last_split``), whose cleaned start is kept.
    With stop strings, the last ``len(longest) - 1`` characters wait too, until it is clear
    they do not begin a stop string.
    """

    def __init__(self, tokenizer: Any | None, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far, as the tokenizer's decode gives it
        self.sent = 0  # characters of ``text`` already given out
        self.stopped = False
        self._prefix = 0  # the context window starts here ...
        self._read = 0  # ... and the ids not yet in ``text`` start here
        self._backend = self._clean = self._stream = None
        self._pieces = False  # whether the cleanup may clean the raw text in pieces
        if tokenizer is not None:
            self._clean = cleanup(tokenizer)
            self._pieces = self._clean is not None and cleans_in_pieces(tokenizer)
            self._backend = stream_backend(tokenizer)
        # with a cleanup, ``text`` is ``_cleaned_head`` then ``_raw_tail`` cleaned: the raw
        # text up to its last cut (``_last_split``), cleaned once, and the raw text after it
        # (all of it where the cleanup is not transformers' own)
        self._cleaned_head = self._raw_tail = ""
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
        self._given = 0  # ids handed to ``_stream``

    def _decode(self, ids: list[int]) -> str:
        """The raw text of ``ids`` (no space cleanup)."""
        if self._backend is not None:  # the same text, without transformers' overhead
            return self._backend.decode(ids, skip_special_tokens=True)
        if self._clean is not None:
            return self.tokenizer.decode(
                ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> None:
        """Add the text of the ids past ``_read`` to ``text``, unless it ends mid-character
        (``final``: whatever it is, no more tokens come)."""
        if self._read == len(self.ids):
            return
        # at the end, a window decodes what the stream still holds (an incomplete character)
        if self._stream is not None and not final:
            try:
                new = self._stream.step(self._backend, self.ids[self._given :])
            except Exception:
                # it refuses text that changes what it gave (a decoder that looks further
                # back than its window): windows from here on, which look further back
                self._stream = None
            else:
                self._given = len(self.ids)
                if new is not None:
                    self._took(new)
                return
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self._took(after[len(before) :])

    def _took(self, new: str) -> None:
        """``new``: the text of the ids up to the last; the next window starts before it."""
        if self._clean is None:
            self.text += new
        else:
            # cleaned as a whole: a cleanup pattern may span what came before ``new``
            had = len(self._raw_tail)  # no cut in it: only the new text may make one
            self._raw_tail += new
            cut = _last_split(self._raw_tail, had) if self._pieces else 0
            if cut:
                self._cleaned_head += self._clean(self._raw_tail[:cut])
                self._raw_tail = self._raw_tail[cut:]
            self.text = self._cleaned_head + self._clean(self._raw_tail)
        self._prefix = max(0, len(self.ids) - CONTEXT_TOKENS)
        self._read = len(self.ids)

    def push(self, ids: list[int]) -> str:
        """The new text to send; sets ``stopped`` when a stop string appeared."""
        if self.tokenizer is None or self.stopped:
            self.ids += ids
            return ""
        self.ids += ids
        self._advance()
        return self._give(final=False)

    def flush(self) -> str:
        """The text held back, once no more tokens come (up to a stop string in it)."""
        if self.stopped or self.tokenizer is None:
            return ""
        self._advance(final=True)  # what was held back, as it decodes in the end
        return self._give(final=True)

    def _give(self, final: bool) -> str:
        text = self.text
        # what more text cannot change: all of it, unless a cleanup may still reach back
        settled = len(text) if final or self._clean is None else len(text) - CLEANUP_REACH
        # a stop string cannot begin in what was sent: that much was held back for it
        hits = [i for i in (text.find(s, self.sent, settled) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(min(hits))
        return self._take(settled if final else settled - self.hold)

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
