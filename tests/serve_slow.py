"""Imported by a test server process (``ServerProcess(..., step_delay_s=...)``): every decode
step of a bucket's slots sleeps ``$INF2_TEST_STEP_DELAY_S`` first, so a test can send, read
or leave while requests are provably still running. Nothing else changes."""

from __future__ import annotations

import os
import time

from pipeline.runtime import session_slots

_DELAY_S = float(os.environ["INF2_TEST_STEP_DELAY_S"])
_Slots = session_slots.SessionSlots
_launch = _Slots.launch  # ``step`` is a launch read at once
_launch_mixed = _Slots.launch_mixed  # a step with prompts in it


def _slow_launch(self, slots):
    time.sleep(_DELAY_S)
    return _launch(self, slots)


def _slow_launch_mixed(self, slots, *args, **kw):
    time.sleep(_DELAY_S)
    return _launch_mixed(self, slots, *args, **kw)


_Slots.launch = _slow_launch
_Slots.launch_mixed = _slow_launch_mixed
