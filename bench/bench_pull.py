"""Pull throughput for a ≥ 2 GB release, beside two baselines measured in the same run:

* boto3 ``download_file`` with its default transfer settings, file by file;
* raw loopback: ``curl`` fetching the same bytes to /dev/null, one stream per file.

The endpoint is Debian's nginx serving the store directory as a path-style S3 bucket (plain
GETs with byte ranges at disk/page-cache speed): moto's server moves ~40 MB/s and would be
the bottleneck. Also measured: nearest-bucket selection per call, and the CLI's start time
for ``pull --help`` (the init container's cold path).

    python bench/bench_pull.py [--gib 2] [--files 4] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.install.pull import pull_release
from pipeline.plan.buckets import Bucket, select_bucket
from pipeline.store.blobs import put_blob
from pipeline.store.layout import blob_key, release_key
from pipeline.store.local import LocalStore
from pipeline.store.manifest import BucketEntry, Manifest

BUCKET = "bench-bucket"
NGINX_CONF = """
daemon off; worker_processes 2; pid {root}/nginx.pid; error_log {root}/nginx.err;
events {{ worker_connections 256; }}
http {{
  access_log off; sendfile on; tcp_nopush on; keepalive_requests 100000;
  client_body_temp_path {root}/tmp; proxy_temp_path {root}/tmp; fastcgi_temp_path {root}/tmp;
  uwsgi_temp_path {root}/tmp; scgi_temp_path {root}/tmp;
  types {{ }} default_type application/octet-stream;
  server {{ listen 127.0.0.1:{port}; root {root}/www; }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_release(store: LocalStore, work: Path, gib: float, files: int) -> Manifest:
    size = int(gib * (1 << 30)) // files
    refs = []
    block = os.urandom(64 << 20)
    for i in range(files):
        path = work / f"part{i}.bin"
        with open(path, "wb") as f:
            f.write(i.to_bytes(8, "little"))  # distinct blobs
            left = size - 8
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
        refs.append(put_blob(store, path, f"part{i}.bin")[0])
        path.unlink()
    m = Manifest(
        model="bench",
        version="v1",
        created=datetime.now(timezone.utc).isoformat(),
        weights_digest="0" * 64,
        backend="cpu",
        target={},
        dtype="bfloat16",
        grid={"batch_sizes": [1], "sequence_lengths": [128]},
        gqa={},
        versions={},
        flags=[],
        auto_cast_type="bf16",
        config={},
        files=[],
        buckets={"b1_s128": BucketEntry(batch=1, seq=128, cache_key="0" * 64, files=refs)},
    )
    store.put_bytes(release_key("bench", "v1"), m.model_dump_json().encode())
    return m


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        sys.exit("error: nginx: not installed (apt-get install nginx-light)")
    root = Path(tempfile.mkdtemp(prefix="bench-pull-"))
    root.chmod(0o755)  # nginx's workers run as an unprivileged user
    server = None
    results: dict = {
        "bench": "pull",
        "date": datetime.now(timezone.utc).isoformat(),
        "cpus": os.cpu_count(),
        "gib": args.gib,
        "files": args.files,
    }
    try:
        (root / "tmp").mkdir()
        store = LocalStore(root / "www" / BUCKET / "store")
        m = make_release(store, root, args.gib, args.files)
        total = sum(r.size for r in m.buckets["b1_s128"].files)
        port = free_port()
        (root / "nginx.conf").write_text(NGINX_CONF.format(root=root, port=port))
        server = subprocess.Popen([nginx, "-c", str(root / "nginx.conf"), "-p", str(root)])
        time.sleep(0.5)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        import boto3

        from pipeline.store.s3 import S3Store

        s3 = S3Store.from_url(f"s3://{BUCKET}/store?addressing_style=path")
        urls = [
            f"{endpoint}/{BUCKET}/store/{blob_key(r.sha256)}" for r in m.buckets["b1_s128"].files
        ]
        gb = total / 1e9

        def curl() -> None:
            for u in urls:
                subprocess.run(["curl", "-sf", "-o", "/dev/null", u], check=True)

        def curl_file() -> None:
            dest.mkdir(exist_ok=True)
            for u, r in zip(urls, m.buckets["b1_s128"].files, strict=True):
                subprocess.run(["curl", "-sf", "-o", str(dest / r.path), u], check=True)

        client = boto3.client("s3", config=boto3.session.Config(s3={"addressing_style": "path"}))
        dest = root / "dest"

        def boto() -> None:
            dest.mkdir(exist_ok=True)
            for r in m.buckets["b1_s128"].files:
                client.download_file(BUCKET, f"store/{blob_key(r.sha256)}", str(dest / r.path))

        def ours() -> None:
            pull_release(s3, "bench", root / "pulled", version="v1", concurrency=args.concurrency)

        rows = {}
        for name, fn, cleanup in (
            ("curl → /dev/null (raw loopback)", curl, None),
            ("curl → files (loopback + disk)", curl_file, dest),
            ("boto3 download_file (defaults)", boto, dest),
            ("inf2-pipeline pull", ours, root / "pulled"),
        ):
            fn() if name.startswith("curl") else None  # warm nginx and the page cache
            best = min(_run(fn, cleanup) for _ in range(2))
            rows[name] = best
            print(f"{name:34s} {best:7.2f} s  {gb / best:6.2f} GB/s", flush=True)
        pull_s = rows["inf2-pipeline pull"]
        results["seconds"] = rows
        results["pull_vs_boto3"] = rows["boto3 download_file (defaults)"] / pull_s
        results["pull_vs_curl"] = rows["curl → /dev/null (raw loopback)"] / pull_s
        results["pull_vs_curl_files"] = rows["curl → files (loopback + disk)"] / pull_s
        print(
            f"pull is {results['pull_vs_boto3']:.2f}× boto3 download_file, "
            f"{results['pull_vs_curl_files']:.2f}× curl to files, "
            f"{results['pull_vs_curl']:.2f}× raw curl (higher is faster)"
        )
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(root, ignore_errors=True)

    grid = [Bucket(b, s) for b in (1, 2, 4, 8, 16, 32) for s in range(128, 8193, 128)]
    n = 20_000
    t = timed(lambda: [select_bucket(grid, 1 + i % 32, 1 + (i * 37) % 8192) for i in range(n)])
    results["select_us_per_call_384_buckets"] = t / n * 1e6
    print(f"select_bucket over {len(grid)} buckets: {t / n * 1e6:.1f} µs per call")
    cli = Path(sys.executable).parent / "inf2-pipeline"
    starts = [
        timed(lambda: subprocess.run([str(cli), "pull", "--help"], check=True, capture_output=True))
        for _ in range(5)
    ]
    py = [
        timed(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True)) for _ in range(5)
    ]
    results["cli_pull_help_s"] = min(starts)
    results["python_start_s"] = min(py)
    print(
        f"`inf2-pipeline pull --help`: {min(starts) * 1e3:.0f} ms "
        f"(bare python start: {min(py) * 1e3:.0f} ms)"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def _run(fn, cleanup: Path | None) -> float:
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    t = timed(fn)
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    return t


if __name__ == "__main__":
    main()
