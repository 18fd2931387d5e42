"""Imported by a test server process (``ServerProcess(..., step_delay_s=...)``): every decode
step of a bucket's slots sleeps ``$INF2_TEST_STEP_DELAY_S`` first, so a test can send, read
or leave while requests are provably still running. Nothing else changes."""

from __future__ import annotations

import os
import time

from pipeline.runtime import decode_session

_DELAY_S = float(os.environ["INF2_TEST_STEP_DELAY_S"])
_launch = decode_session.DecodeSession.launch  # ``step`` is a launch read at once


def _slow_launch(self, slots):
    time.sleep(_DELAY_S)
    return _launch(self, slots)


decode_session.DecodeSession.launch = _slow_launch
