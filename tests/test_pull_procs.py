"""``pull --processes N``: ranges landed by worker processes (many-core nodes), with the same
per-part checks, re-fetches, resume and install as threads in one process, and workers that
never outlive the pull."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.install import pull_procs
from pipeline.install.pull import default_processes, pull_release
from pipeline.store import open_store
from pipeline.store.layout import blob_key
from tests.fault_proxy import FaultProxy, ranged_get_of
from tests.proc_helpers import alive
from tests.release_factory import make_release

runner = CliRunner()
PART = 1 << 16
REPO = Path(__file__).resolve().parent.parent
WORKER_MODULE = "pipeline.install.pull_procs"
CLI = "from pipeline.cli import app; app()"


def _release(store, tmp_path: Path, version: str = "v1", **kw):
    data = {
        "big.bin": os.urandom(13 * PART + 5),
        "small.bin": os.urandom(1000),
        "empty.bin": b"",
    }
    dup = os.urandom(3 * PART)
    buckets = {"b1_s32": {**data, "w.bin": dup}, "b2_s64": {"w.bin": dup}}
    return make_release(store, tmp_path, version=version, buckets=buckets, part_size=PART, **kw)


def _same_as_published(root: Path, store, manifest) -> None:
    from pipeline.install.installed import release_files

    for rel, ref in release_files(manifest):
        assert (root / rel).read_bytes() == store.get_bytes(blob_key(ref.sha256)), rel


def test_default_processes_keep_small_nodes_in_one_process():
    assert [default_processes(c) for c in (1, 2, 4)] == [1, 1, 1]
    assert default_processes(16) == 8  # 32 ranges in flight: 4 per process
    assert default_processes(192) == 8
    assert default_processes(8, concurrency=8) == 4


@pytest.fixture
def workers_only(monkeypatch):
    """The workers land every range (not the pull's own threads while they start)."""
    monkeypatch.setattr(pull_procs, "LAND_WHILE_STARTING", False)


@pytest.mark.s3
@pytest.mark.parametrize("schema", [2, 1])
def test_processes_land_every_file_verified(s3_store_url, tmp_path, schema, workers_only):
    store = open_store(s3_store_url)
    kw = {"schema": 1, "part_size": None} if schema == 1 else {}
    m = _release(store, tmp_path, **kw) if schema == 2 else make_release(
        store, tmp_path, buckets={"b1_s32": {"a.bin": os.urandom(9 * PART + 1)}}, **kw
    )  # fmt: skip
    dest = tmp_path / "d"
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(dest), "--store",
                            s3_store_url, "--processes", "2", "--part-size", "64KiB",
                            "--concurrency", "4", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["processes"] == 2 and out["worker_peak_rss"] > 0
    assert out["worker_parts"] == out["parts"] > 2
    assert out["refetched_parts"] == 0
    _same_as_published(dest / "m/current", store, m)
    if schema == 2:  # the duplicate blob is one download, hard-linked
        a, b = (dest / "m/current/buckets" / d / "w.bin" for d in ("b1_s32", "b2_s64"))
        assert a.stat().st_ino == b.stat().st_ino
    assert not list(dest.rglob("*.incomplete"))


def test_a_local_store_stays_in_process(tmp_path):
    store = open_store(str(tmp_path / "store"))
    m = _release(store, tmp_path)
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=PART, processes=4)
    assert r.processes == 1 and r.worker_peak_rss == 0
    _same_as_published(r.path, store, m)


@pytest.mark.s3
def test_a_corrupted_part_is_refetched_alone_by_a_worker(
    s3_store_url, s3_env, tmp_path, monkeypatch, workers_only
):
    store = open_store(s3_store_url)
    m = _release(store, tmp_path)
    big = next(f for f in m.buckets["b1_s32"].files if f.path == "big.bin")
    with FaultProxy(s3_env, ranged_get_of(blob_key(big.sha256), 4 * PART)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        r = pull_release(open_store(s3_store_url), "m", tmp_path / "d", version="v1",
                         part_size=2 * PART, concurrency=4, processes=2)  # fmt: skip
    assert proxy.hits and proxy.hits[0][2].startswith(f"bytes={4 * PART}-")
    assert r.processes == 2 and r.refetched_parts == 1 and r.refetched_files == 0
    assert r.worker_parts == r.parts
    _same_as_published(r.path, store, m)


@pytest.mark.s3
def test_persistent_corruption_in_a_worker_is_one_line_and_exit_1(
    s3_store_url, s3_env, tmp_path, monkeypatch, workers_only
):
    store = open_store(s3_store_url)
    m = _release(store, tmp_path)
    big = next(f for f in m.buckets["b1_s32"].files if f.path == "big.bin")
    with FaultProxy(s3_env, ranged_get_of(blob_key(big.sha256), 4 * PART), times=None) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(tmp_path / "d"),
                                "--store", s3_store_url, "--processes", "2",
                                "--part-size", "64KiB"])  # fmt: skip
    assert r.exit_code == 1, r.output
    assert "sha256 mismatch in part 4" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "d/m/v1").exists()


def _workers_of(pid: int) -> list[int]:
    """Live worker processes started by ``pid`` (found by their command line)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if WORKER_MODULE.encode() in argv and str(pid).encode() in argv and alive(int(d.name)):
            found.append(int(d.name))
    return found


def _poll(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the pull ended ({proc.returncode}) first: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    return value


@pytest.mark.s3
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_killing_the_pull_ends_its_workers_and_a_rerun_resumes(s3_store_url, s3_env, tmp_path, sig):
    store = open_store(s3_store_url)
    m = _release(store, tmp_path)
    dest = tmp_path / "d"
    # A slow network: each ranged GET takes 0.3 s, so the pull is still going when killed.
    with FaultProxy(s3_env, lambda *_: False, delay=0.3) as proxy:
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, "PYTHONPATH": str(REPO)}
        pull = subprocess.Popen(
            [sys.executable, "-c", CLI, "pull", "m", "--version", "v1", "--dest", str(dest),
             "--store", s3_store_url, "--processes", "2", "--concurrency", "2",
             "--part-size", "64KiB"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            workers = _poll(lambda: len(_workers_of(pull.pid)) == 2 and _workers_of(pull.pid),
                            60, "two workers", pull)  # fmt: skip
            _poll(lambda: proxy.ranges_served >= 3, 60, "some ranges to land", pull)
            assert pull.poll() is None, "the pull finished before it could be killed"
            pull.send_signal(sig)
            pull.wait(30)
            _poll(lambda: not any(alive(w) for w in workers), 15, "the workers to end")
        finally:
            if pull.poll() is None:
                pull.kill()
                pull.wait()
            for w in _workers_of(pull.pid):  # only if the test already failed
                os.kill(w, signal.SIGKILL)
    assert not (dest / "m/v1").exists()
    r = pull_release(open_store(s3_store_url), "m", dest, version="v1", part_size=PART,
                     processes=2)  # fmt: skip
    assert r.reused_bytes > 0  # parts the killed pull verified were kept
    _same_as_published(dest / "m/current", store, m)


def test_the_pull_process_lands_at_most_a_few_ranges_itself_while_workers_start():
    """While no worker is ready, a range is left to the caller only up to LOCAL_LANDERS at
    a time (its buffers stay small beside the workers'); the next caller waits for a worker
    (here there is none, so it fails), and a landed range frees a slot."""
    from pipeline.errors import PipelineError
    from pipeline.install import pull_procs

    pool = pull_procs.WorkerPool({}, processes=0, threads=4)
    n = pull_procs.LOCAL_LANDERS
    assert [pool.call(None) for _ in range(n)] == [None] * n
    with pytest.raises(PipelineError, match="all exited before starting"):
        pool.call(None)
    pool.landed_here()
    assert pool.call(None) is None
