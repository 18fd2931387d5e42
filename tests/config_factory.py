"""The release config (YAML) that most tests write, with only what differs as arguments."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def release_yaml(
    *,
    name: str = "tiny",
    checkpoint: str | Path = "{ckpt}",
    dtype: str = "float32",
    backend: str = "cpu",
    instance_type: str | None = "inf2.xlarge",
    tp_degree: int | None = 2,
    batch_sizes: Sequence[int] = (1, 2),
    sequence_lengths: Sequence[int] = (32,),
    flags: Sequence[str] | str | None = None,
    auto_cast_type: str | None = None,
    timeout_s: int | None = None,
    store: str | Path = "store",
) -> str:
    """A release config, one key a line (block style), so that a test can still
    ``.replace()`` a line of it. ``None`` leaves a key out (``compiler:`` too, when all its
    keys are). ``{ckpt}`` is what conftest's ``write_config`` fills in."""
    sections = {
        "model": {"name": name, "checkpoint": checkpoint, "dtype": dtype},
        "target": {"backend": backend, "instance_type": instance_type, "tp_degree": tp_degree},
        "buckets": {"batch_sizes": _flow(batch_sizes), "sequence_lengths": _flow(sequence_lengths)},
        "compiler": {
            "flags": _flow(flags),
            "auto_cast_type": auto_cast_type,
            "timeout_s": timeout_s,
        },
    }
    lines = []
    for section, fields in sections.items():
        given = {key: value for key, value in fields.items() if value is not None}
        if given:
            lines.append(f"{section}:")
            lines += [f"  {key}: {value}" for key, value in given.items()]
    lines.append(f"store: {store}")
    return "\n".join(lines) + "\n"


def _flow(value: Sequence[int | str] | str | None) -> str | None:
    """JSON is YAML: a list in flow style (``[1, 2]``), a string in quotes (``""`` too)."""
    if value is None:
        return None
    return json.dumps(value if isinstance(value, str) else list(value))
