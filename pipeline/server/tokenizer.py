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


class TextStream:
    """Token ids in, text deltas out; stops at the first stop string (which is not sent).

    Text is decoded from all ids so far (byte-level tokens can split a character, and
    detokenizers join tokens with context), and a delta ending in an incomplete character
    (U+FFFD) is held back. With stop strings, the last ``len(longest) - 1`` characters wait
    too, until it is clear they do not begin a stop string.
    """

    def __init__(self, tokenizer: Any | None, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` already given out
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """The new text to send; sets ``stopped`` when a stop string appeared."""
        if self.tokenizer is None or self.stopped:
            self.ids += ids
            return ""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        self.text = text
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(min(hits))
        return self._take(len(text) - self.hold)

    def flush(self) -> str:
        """The text held back, once no more tokens come."""
        if self.stopped or self.tokenizer is None:
            return ""
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
