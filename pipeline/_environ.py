"""An environment variable of this process set for a while, then put back as it was."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environ_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block; after it, the old value, or none."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
