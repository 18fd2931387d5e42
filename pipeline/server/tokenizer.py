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


class TextStream:
    """Token ids in, text deltas out; stops at the first stop string (which is not sent).

    Text is decoded incrementally: each push decodes a window of ``CONTEXT_TOKENS`` tokens
    before the new ones plus the new ones, and adds what that window decodes to beyond its
    start (the offsets technique of vLLM's and TGI's detokenizers), so a long answer costs
    the same per token as a short one instead of decoding every id again. A delta ending in
    an incomplete character (U+FFFD: byte-level tokens can split one) is held back until the
    next token completes it. With stop strings, the last ``len(longest) - 1`` characters
    wait too, until it is clear they do not begin a stop string.
    """

    def __init__(self, tokenizer: Any | None, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` already given out
        self.stopped = False
        self._prefix = 0  # the context window starts here ...
        self._read = 0  # ... and the ids not yet in ``text`` start here

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> None:
        """Add the text of the ids past ``_read`` to ``text``, unless it ends mid-character
        (``final``: whatever it is, no more tokens come)."""
        if self._read == len(self.ids):
            return
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix = max(0, len(self.ids) - CONTEXT_TOKENS)
            self._read = len(self.ids)

    def push(self, ids: list[int]) -> str:
        """The new text to send; sets ``stopped`` when a stop string appeared."""
        if self.tokenizer is None or self.stopped:
            self.ids += ids
            return ""
        self.ids += ids
        self._advance()
        text = self.text
        # a stop string cannot begin in what was sent: that much was held back for it
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(min(hits))
        return self._take(len(text) - self.hold)

    def flush(self) -> str:
        """The text held back, once no more tokens come."""
        if self.stopped or self.tokenizer is None:
            return ""
        self._advance(final=True)  # what was held back, as it decodes in the end
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
