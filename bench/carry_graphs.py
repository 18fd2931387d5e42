"""Carry a device round's compiled graphs to the next session, so that a fresh machine
compiles nothing and only prepares the weights.

A lent GPU machine starts bare, and the s256 release's compile took 283-509 s of a
session's 1,800 device seconds (bench/RESULTS.md, thirtieth to thirty-fifth rounds): in the
thirty-fifth it left no time for the replay it was for. Its graphs are 14 packages, 56.8
MiB, which pack into 2.5 MB (thirty-sixth round). The compile cache already keys them by
everything that reaches them (torch, transformers, the compiler, the GPU's compute
capability: ``pipeline/compile/keys.py``), so graphs carried to the same image are hits,
and graphs carried elsewhere are simply misses.

    python bench/carry_graphs.py pack STORE [STORE ...] --out DIR [--max-mib 15]
    python bench/carry_graphs.py unpack DIR ROOT

``pack`` takes every *graphs* entry of each local store (``cache/<key>.json`` and the
blobs it names; not the weights entry, which is the whole checkpoint again and is prepared
in seconds) into one xz-compressed tar, cut into ``graphs.tar.xz.00``, ``.01``, ... of at
most ``--max-mib`` each: the device's ``$OUT`` brings back 8 files of 16 MiB at most.
``unpack`` puts them into ``ROOT/<store's folder name>``: every blob checked against its
digest and written first, the entries last, as the compile writes them, so an entry found
is always complete. Blobs and entries already there are left as they are.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.contracts.store_layout import CACHE_PREFIX, blob_key, cache_key  # noqa: E402
from pipeline.errors import InputError  # noqa: E402
from pipeline.store.cache import CacheEntry, read_cache_entry  # noqa: E402
from pipeline.store.local import LocalStore  # noqa: E402

PIECES = "graphs.tar.xz."
_MEMBER = re.compile(r"^([A-Za-z0-9._-]+)/(blobs/sha256/[0-9a-f]{64}|cache/[0-9a-f]{64}\.json)$")


def graph_entries(store: LocalStore) -> Iterator[CacheEntry]:
    for key in sorted(store.list(CACHE_PREFIX)):
        entry = read_cache_entry(store, Path(key).stem)
        if entry is not None and entry.kind == "graphs":
            yield entry


def pack(stores: list[Path], out: Path, max_bytes: int) -> dict[str, int]:
    """Write ``out/graphs.tar.xz.NN``; returns what went in."""
    names = [s.name for s in stores]
    if len(set(names)) != len(names):
        raise InputError("stores", f"two share a folder name ({names})", "pack them apart")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(PIECES + "*"):
        old.unlink()
    counts = {"entries": 0, "blobs": 0, "bytes": 0}
    whole = io.BytesIO()  # the s256 release: 56.8 MiB before compression, so memory is fine
    with tarfile.open(fileobj=whole, mode="w:xz") as tar:
        for root in stores:
            store = LocalStore(root)
            for entry in graph_entries(store):
                for ref in entry.files:  # blobs first, so an unpack cut short leaves no entry
                    path = store.local_path(blob_key(ref.sha256))
                    if path is None or not path.is_file():
                        raise InputError(
                            f"{root}/{cache_key(entry.key)}",
                            f"names a blob the store lacks ({ref.path})",
                            "recompile that bucket",
                        )
                    tar.add(path, f"{root.name}/{blob_key(ref.sha256)}")
                    counts["blobs"] += 1
                    counts["bytes"] += ref.size
                tar.add(
                    store.local_path(cache_key(entry.key)), f"{root.name}/{cache_key(entry.key)}"
                )
                counts["entries"] += 1
    data = whole.getvalue()
    for n, start in enumerate(range(0, len(data), max_bytes)):
        piece = out / f"{PIECES}{n:02d}"
        tmp = piece.with_name(piece.name + ".tmp")
        tmp.write_bytes(data[start : start + max_bytes])
        tmp.replace(piece)
    counts["compressed_bytes"] = len(data)
    return counts


def _unpack_member(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    root: Path,
    entries: list[tuple[str, str, bytes]],
    counts: dict[str, int],
) -> None:
    """A blob is checked and written at once; an entry is kept for the end."""
    found = _MEMBER.match(member.name)
    if not member.isfile() or not found:
        raise InputError(member.name, "is not a graph blob or cache entry", "pack again")
    store_name, key = found.groups()
    data = tar.extractfile(member).read()
    if key.startswith(CACHE_PREFIX):
        CacheEntry.model_validate_json(data)  # refuse a damaged entry here, not at compile
        entries.append((store_name, key, data))
        return
    if hashlib.sha256(data).hexdigest() != key.rsplit("/", 1)[1]:
        raise InputError(member.name, "does not match its digest", "pack again")
    _put_new(LocalStore(root / store_name), key, data, "blobs", counts)


def _put_new(store: LocalStore, key: str, data: bytes, kind: str, counts: dict[str, int]) -> None:
    """Write ``key`` unless it is there (a blob is its digest, an entry its key's)."""
    if store.exists(key):
        counts["already_there"] += 1
    else:
        store.put_bytes(key, data)
        counts[kind] += 1


def unpack(folder: Path, root: Path) -> dict[str, int]:
    """Put the pieces in ``folder`` into the stores under ``root``; returns what was new."""
    paths = sorted(folder.glob(PIECES + "[0-9][0-9]"))
    if not paths:
        raise InputError(str(folder), f"holds no {PIECES}NN pieces", "pack them first")
    counts = {"entries": 0, "blobs": 0, "already_there": 0}
    entries: list[tuple[str, str, bytes]] = []
    try:
        whole = io.BytesIO(b"".join(p.read_bytes() for p in paths))  # as pack holds it
        with tarfile.open(fileobj=whole, mode="r|xz") as tar:
            for member in tar:
                _unpack_member(tar, member, root, entries, counts)
    except (lzma.LZMAError, tarfile.TarError, EOFError) as e:
        raise InputError(str(folder), f"damaged or incomplete pieces ({e})", "pack again") from None
    for store_name, key, data in entries:  # last: an entry names blobs already in place
        _put_new(LocalStore(root / store_name), key, data, "entries", counts)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="a store's graph entries into pieces")
    pk.add_argument("stores", type=Path, nargs="+")
    pk.add_argument("--out", type=Path, required=True)
    pk.add_argument("--max-mib", type=float, default=15.0)
    up = sub.add_parser("unpack", help="pieces into the stores under ROOT")
    up.add_argument("folder", type=Path)
    up.add_argument("root", type=Path)
    args = p.parse_args()
    try:
        if args.command == "pack":
            missing = [str(s) for s in args.stores if not (s / "cache").is_dir()]
            if missing:
                raise InputError(", ".join(missing), "not a store with a compile cache", None)
            counts = pack(args.stores, args.out, int(args.max_mib * 2**20))
        else:
            counts = unpack(args.folder, args.root)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps({args.command: counts}))


if __name__ == "__main__":
    main()
