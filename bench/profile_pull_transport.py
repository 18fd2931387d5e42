"""Where a pull's transport stops scaling on a many-core host: every 16 MiB range of a release
fetched from nginx on loopback and dropped (no sha256, no write), by client and by the
number of ranges in flight.

    python bench/profile_pull_transport.py --nginx PATH [--gib 4] [--files 4] [--work /dev/shm]
                                           [--threads 1,8,32] [--clients curl,s3_ranges]
                                           [--out F.json]

Clients:

* ``curl``: one curl process per range into /dev/null, N at a time: what nginx gives N
  connections when the client costs nothing in Python;
* ``s3_ranges``: the pull's own GETs (``S3Store.read_range_into``, http.client into a
  per-thread buffer) in N threads of this process;
* ``raw socket``: the same requests written and read by hand on a plain socket
  (``recv_into`` straight into the buffer) in N threads: what http.client costs;
* ``obstore``: Rust's object_store (``obstore.get_range``, when installed) in N threads:
  whether a transport outside the interpreter scales where ours does not;
* ``s3_ranges + ...``: the pull's GETs, then what landing does with each range (its sha256;
  a ``pwrite`` at its offset into its file, preallocated as pull does or sparse; both), to
  find which step of landing costs what;
* ``pull_release``: the whole pull, in this process (no start-up), N ranges in flight; and
  the same with its queue in the order before 2026-12-01 (all of a file's ranges, then the
  next file's).

Exploration, not the product's benchmark (bench_pull.py is): figures go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pull import BUCKET, make_release, serve_root

from pipeline.contracts.store_layout import blob_key
from pipeline.store.local import LocalStore

RANGE = 16 << 20
Range = tuple[str, int, int]  # key under the store's prefix, start, length


def in_threads(n: int, ranges: list[Range], fetch: Callable[[Range, memoryview], int]) -> float:
    """Seconds for ``n`` threads to fetch every range, each into its own reused buffer."""
    todo = list(reversed(ranges))
    lock, errors = threading.Lock(), []

    def worker() -> None:
        buf = memoryview(bytearray(RANGE))
        while True:
            with lock:
                if not todo:
                    return
                r = todo.pop()
            try:
                got = fetch(r, buf[: r[2]])
                assert got == r[2], (r, got)
            except BaseException as e:  # reported by the caller
                errors.append(e)
                return

    threads = [threading.Thread(target=worker) for _ in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t


def landing(
    root: Path, ranges: list[Range], get: Callable[..., int], steps: str
) -> Callable[[int], float]:
    """A client that fetches each range with ``get`` and then does ``steps`` with it:
    ``sha256``, ``pwrite`` (files preallocated before the clock starts, as pull does before
    its first write), ``sparse`` (pwrite into files only truncated to size), ``mmap`` (no
    buffer: the range of the preallocated file mapped with MAP_POPULATE, received straight
    into the mapping, hashed there if asked, unmapped: one copy fewer, and no inode lock).

    On 16 cores (2026-12-01) ``sha256 + mmap`` landed 2.1-2.2 GB/s against 4.7-6.3 for
    ``sha256 + pwrite`` at 32 in flight: faulting and unmapping cost more than the copy.
    Reading 1 MiB at a time and hashing and writing each while cache-hot (commit 709b8eb,
    reverted) gained at 8 in flight and lost at 32 (3.97 against 4.67 GB/s, 4 files)."""
    sizes: dict[str, int] = {}
    for key, start, length in ranges:
        sizes[key] = max(sizes.get(key, 0), start + length)

    def run(n: int) -> float:
        fds = {}
        for key, size in sizes.items():
            fd = os.open(root / key.replace("/", "_"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            if "pwrite" in steps or "mmap" in steps:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            fds[key] = fd

        def fetch(r: Range, buf: memoryview) -> int:
            if "mmap" in steps:
                with mmap.mmap(
                    fds[r[0]], r[2], flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=r[1]
                ) as mapped:
                    view = memoryview(mapped)
                    got = get(r, view)
                    if "sha256" in steps:
                        hashlib.sha256(view).digest()
                    view.release()
                return got
            got = get(r, buf)
            if "sha256" in steps:
                hashlib.sha256(buf).digest()
            if "pwrite" in steps or "sparse" in steps:
                os.pwrite(fds[r[0]], buf, r[1])
            return got

        try:
            return in_threads(n, ranges, fetch)
        finally:
            for key, fd in fds.items():
                os.close(fd)
                os.unlink(root / key.replace("/", "_"))

    return run


def raw_fetcher(port: int) -> Callable[[Range, memoryview], int]:
    local = threading.local()

    def fetch(r: Range, buf: memoryview) -> int:
        key, start, length = r
        sock = getattr(local, "sock", None)
        if sock is None:
            sock = local.sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            f"GET /{BUCKET}/store/{key} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Range: bytes={start}-{start + length - 1}\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        header, body = head.split(b"\r\n\r\n", 1)
        size = int(header.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        assert size == length, header
        buf[: len(body)] = body
        got = len(body)
        while got < length:
            n = sock.recv_into(buf[got:])
            if not n:
                raise ConnectionError("closed")
            got += n
        return got

    return fetch


def curl_seconds(n: int, ranges: list[Range], endpoint: str) -> float:
    args = [f"-r {s}-{s + length - 1} {endpoint}/{BUCKET}/store/{key}" for key, s, length in ranges]
    t = time.perf_counter()
    subprocess.run(
        ["xargs", "-P", str(n), "-L", "1", "curl", "-sf", "-o", "/dev/null"],
        input="\n".join(args),
        text=True,
        check=True,
    )
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nginx", required=True)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--work", default=None)
    ap.add_argument("--threads", default="1,8,32")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--clients", default="", help="only the clients whose names start so")
    args = ap.parse_args()
    counts = [int(x) for x in args.threads.split(",")]
    root = Path(tempfile.mkdtemp(prefix="probe-pull-", dir=args.work))
    root.chmod(0o755)
    server = None
    result: dict = {"cpus": os.cpu_count(), "gib": args.gib, "files": args.files, "gb_per_s": {}}
    try:
        (root / "tmp").mkdir()
        store = LocalStore(root / "www" / BUCKET / "store")
        m = make_release(store, root, args.gib, args.files)
        refs = m.buckets["b1_s128"].files
        ranges = [
            (blob_key(r.sha256), s, min(RANGE, r.size - s))
            for r in refs
            for s in range(0, r.size, RANGE)
        ]
        total = sum(r.size for r in refs) / 1e9
        server, port = serve_root(args.nginx, root)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        from pipeline.store.s3 import S3Store

        s3 = S3Store.from_url(f"s3://{BUCKET}/store?addressing_style=path")
        clients: dict[str, Callable[[int], float]] = {
            "curl processes": lambda n: curl_seconds(n, ranges, endpoint),
            "s3_ranges threads": lambda n: in_threads(
                n, ranges, lambda r, b: s3.read_range_into(r[0], r[1], b)
            ),
            "raw socket threads": lambda n: in_threads(n, ranges, raw_fetcher(port)),
        }

        def get(r: Range, b: memoryview) -> int:
            return s3.read_range_into(r[0], r[1], b)

        (root / "land").mkdir()
        for steps in (
            "sha256",
            "pwrite",
            "sparse",
            "sha256 + pwrite",
            "mmap",
            "sha256 + mmap",
        ):
            clients[f"s3_ranges + {steps}"] = landing(root / "land", ranges, get, steps)

        def whole_pull(n: int) -> float:
            from pipeline.install.pull import pull_release

            t = time.perf_counter()
            pull_release(s3, "bench", root / "pulled", version="v1", concurrency=n)
            seconds = time.perf_counter() - t
            subprocess.run(["rm", "-rf", str(root / "pulled")], check=True)
            return seconds

        clients["pull_release"] = whole_pull

        def file_after_file(n: int) -> float:  # the queue's order before 2026-12-01
            import pipeline.install.pull as pull

            interleaved = pull._interleaved
            pull._interleaved = lambda files: ((f, r) for f in files for r in f.ranges)
            try:
                return whole_pull(n)
            finally:
                pull._interleaved = interleaved

        clients["pull_release, file after file"] = file_after_file
        try:
            import obstore
            from obstore.store import S3Store as ObjectStore

            obs = ObjectStore(
                BUCKET,
                endpoint=endpoint,
                region="us-east-1",
                access_key_id="bench",
                secret_access_key="bench",
                virtual_hosted_style_request=False,
                client_options={"allow_http": True},
            )

            def obs_fetch(r: Range, buf: memoryview) -> int:
                data = obstore.get_range(obs, f"store/{r[0]}", start=r[1], length=r[2])
                return len(memoryview(data))  # dropped: no copy

            clients["obstore threads"] = lambda n: in_threads(n, ranges, obs_fetch)
        except ImportError:
            print("obstore not installed: skipped", file=sys.stderr)
        wanted = tuple(c for c in args.clients.split(",") if c)
        for name, run in clients.items():
            if wanted and not name.startswith(wanted):
                continue
            for n in counts:
                run(n)  # warm: connections, buffers, page cache
                best = min(run(n) for _ in range(2))
                result["gb_per_s"][f"{name}, {n}"] = total / best
                print(f"{name:20s} {n:4d} in flight: {total / best:6.2f} GB/s", flush=True)
                if args.out:
                    args.out.write_text(json.dumps(result, indent=1))
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        subprocess.run(["rm", "-rf", str(root)], check=False)


if __name__ == "__main__":
    main()
