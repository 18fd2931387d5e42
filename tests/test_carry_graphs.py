"""bench/carry_graphs.py: a compile's graphs packed into pieces and unpacked into a fresh
store are cache hits there, so the next compile prepares only the weights."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.errors import InputError
from pipeline.store.local import LocalStore
from tests.conftest import _demo_config
from tests.serve_helpers import REPO

sys.path.insert(0, str(REPO / "bench"))

from carry_graphs import PIECES, graph_entries, pack, unpack


def test_packed_graphs_are_hits_in_a_fresh_store(compiled_store, tiny_checkpoint, tmp_path):
    from pipeline.compile.scheduler import compile_release
    from pipeline.plan.config import load_config

    _, store = compiled_store
    kept = list(graph_entries(LocalStore(store)))
    assert kept and len({e.bucket for e in kept}) == len(kept)
    max_bytes = 256 * 1024  # small pieces, so the tiny release is cut into several
    counts = pack([store], tmp_path / "out", max_bytes)
    pieces = sorted((tmp_path / "out").glob(PIECES + "*"))
    assert len(pieces) > 1 and all(p.stat().st_size <= max_bytes for p in pieces)
    assert counts["entries"] == len(kept)

    fresh = tmp_path / "fresh"
    assert unpack(tmp_path / "out", fresh) == {
        "entries": len(kept),
        "blobs": counts["blobs"],
        "already_there": 0,
    }
    again = unpack(tmp_path / "out", fresh)  # nothing new, nothing rewritten
    assert again["entries"] == again["blobs"] == 0 and again["already_there"] > 0

    report = compile_release(
        load_config(_demo_config(fresh, tiny_checkpoint, "cpu")), jobs=1, workdir=fresh / "work"
    )
    assert {r.bucket.name: r.status for r in report.results} == {e.bucket: "cached" for e in kept}
    assert report.weights.status == "prepared"  # the weights entry was left behind


def test_a_damaged_piece_is_refused_and_writes_no_entry(compiled_store, tmp_path):
    _, store = compiled_store
    pack([store], tmp_path / "out", 2**30)
    (piece,) = (tmp_path / "out").glob(PIECES + "*")
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"damaged|digest"):  # xz's own check, or the blob's
        unpack(tmp_path / "out", tmp_path / "fresh")
    assert not list((tmp_path / "fresh").glob("*/cache/*.json"))


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path):
    script = str(REPO / "bench" / "carry_graphs.py")
    for argv in (
        ["pack", str(tmp_path), "--out", str(tmp_path / "o")],
        ["unpack", str(tmp_path), str(tmp_path)],
    ):
        out = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True)
        assert out.returncode == 2, out
        assert out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1, out.stderr
    with pytest.raises(InputError, match="share a folder name"):
        for side in "ab":
            (tmp_path / side / "s" / "cache").mkdir(parents=True)
        pack([tmp_path / "a" / "s", tmp_path / "b" / "s"], tmp_path / "o", 2**20)
