"""A pull's files shared out to worker processes (pipeline.install.processes): the same
install, checks and counts as one process's threads, against a local store and moto's S3
server (through the fault proxy where bytes go bad); a failing or killed worker fails the
pull in one line and leaves what a resume needs; no worker outlives the pull."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.contracts.store_layout import blob_key
from pipeline.errors import IntegrityError, PipelineError
from pipeline.install import fetcher as fetcher_module
from pipeline.install import processes as processes_module
from pipeline.install import pull as pull_module
from pipeline.install.fetcher import Fetcher
from pipeline.install.installed import BUCKETS, release_files
from pipeline.install.landing import PART_RETRIES
from pipeline.install.processes import Tickets, _picklable, plan
from pipeline.install.pull import default_processes, pull_release
from pipeline.store import open_store
from pipeline.store.local import LocalStore
from pipeline.store.refs import FileRef
from pipeline.store.s3 import MAX_PULL_PROCESSES, S3Store
from pipeline.store.verified import read_verified
from tests.fault_proxy import FaultProxy, ranged_get_of
from tests.release_factory import make_release

runner = CliRunner()
PART = 1 << 16


@pytest.fixture
def store(store_url):
    return open_store(store_url)


def _files(n: int = 7, size: int = 5 * PART) -> dict[str, bytes]:
    return {f"part{i}.bin": os.urandom(size + i) for i in range(n)}


def _forked_children() -> list[int]:
    """Our children that are forks of this process (same command line) or zombies (a
    zombie has none): workers left running or not reaped."""
    me, mine = str(os.getpid()), Path("/proc/self/cmdline").read_bytes()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            zombie = "\nState:\tZ" in status
            if f"\nPPid:\t{me}\n" in status and (zombie or (proc / "cmdline").read_bytes() == mine):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def _ref(size: int, parts: bool = True) -> FileRef:
    n = -(-size // PART)
    return FileRef(
        path=f"f{size}",
        size=size,
        sha256="0" * 64,
        part_size=PART if parts else None,
        parts=["0" * 64] * n if parts else None,
    )


def test_ranges_are_shared_and_files_checked_whole_go_whole(tmp_path):
    """A huge file's ranges are claimed by any process, one of each file in turn; a file
    checked whole, or of one range, goes whole to one process, by bytes."""
    huge, small, whole = _ref(12 * PART), _ref(PART), _ref(3 * PART, parts=False)
    other = _ref(2 * PART)
    jobs = [(tmp_path / "huge", huge), (tmp_path / "small", small), (tmp_path / "whole", whole),
            (tmp_path / "other", other)]  # fmt: skip
    fetcher = Fetcher(LocalStore(tmp_path / "s"), 1, PART, "parts")
    work = plan(jobs, 3, fetcher)
    assert work.shared == {tmp_path / "huge": (huge, False), tmp_path / "other": (other, False)}

    def at(name: str, i: int) -> tuple[Path, int, int]:
        return (tmp_path / name, i * PART, PART)

    in_turn = [at("huge", 0), at("other", 0), at("huge", 1), at("other", 1)]
    assert work.ranges[:4] == in_turn
    expected = [at("huge", i) for i in range(12)] + [at("other", i) for i in range(2)]
    assert sorted(work.ranges) == sorted(expected)  # each range once
    assert len(work.plans) == 3  # every process claims ranges, whole files or not
    for name in ("small", "whole"):  # whole, in one process, not shared
        holders = [p for p in work.plans if (tmp_path / name, _find(jobs, name)) in p.jobs]
        assert len(holders) == 1 and tmp_path / name not in work.shared
    assert sorted(p.bytes for p in work.plans) == [0, PART, 3 * PART]
    full = Fetcher(LocalStore(tmp_path / "s"), 1, PART, "full")
    everything_whole = plan(jobs, 8, full)  # --verify full: every file checked whole
    assert everything_whole.shared == {} and everything_whole.ranges == []
    assert len(everything_whole.plans) == 4  # no more processes than files then
    assert len(plan(jobs, 99, fetcher).plans) == 16  # 14 ranges and 2 files


def _find(jobs, name):
    return next(r for t, r in jobs if t.name == name)


def test_a_shared_file_resumes_only_at_full_size_and_is_made_before_the_fork(tmp_path):
    huge = _ref(4 * PART)
    fetcher = Fetcher(LocalStore(tmp_path / "s"), 1, PART, "parts")
    tmp = tmp_path / ".huge.incomplete"
    tmp.write_bytes(b"x" * (4 * PART))  # a killed pull's full-size temporary file
    assert plan([(tmp_path / "huge", huge)], 2, fetcher).shared[tmp_path / "huge"][1]
    assert tmp.exists()
    tmp.write_bytes(b"stale")  # not full size: no process may keep its bytes
    assert not plan([(tmp_path / "huge", huge)], 2, fetcher).shared[tmp_path / "huge"][1]
    assert tmp.read_bytes() == bytes(4 * PART)  # made anew at full size, before any fork


def _take(tickets: Tickets, got: list[int], go: Path) -> None:
    deadline = time.monotonic() + 30
    while not go.exists() and time.monotonic() < deadline:  # every process starts at once
        time.sleep(0.001)
    while batch := tickets.claim():
        got.extend(start for _, start, _ in batch)  # list.extend holds the GIL: whole
        time.sleep(0.0005)  # so no one process takes them all before the others run


def test_tickets_are_claimed_once_each_across_processes_and_batched_to_fit_the_pipe(
    tmp_path, monkeypatch
):
    ranges = [(tmp_path / "f", i, 1) for i in range(3000)]
    tickets, go = Tickets(ranges), tmp_path / "go"
    pids = []
    for _ in range(3):  # three processes, each two threads, claim until none are left
        pid = os.fork()
        if pid == 0:
            try:
                got: list[int] = []
                threads = [
                    threading.Thread(target=_take, args=(tickets, got, go)) for _ in range(2)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                (tmp_path / f"claimed-{os.getpid()}").write_text(json.dumps(got))
            finally:
                os._exit(0)
        pids.append(pid)
    tickets.close()
    go.touch()
    for pid in pids:
        os.waitpid(pid, 0)
    each = [json.loads(f.read_text()) for f in tmp_path.glob("claimed-*")]
    assert sorted(s for got in each for s in got) == list(range(3000))  # every range once
    assert len(each) == 3 and all(each)  # by every process
    # A pipe that cannot grow past one page (pipe-max-size 4096): 1,024 tickets of 3 ranges,
    # written whole before any reader (a ticket too many would block the write for good)
    (tmp_path / "pipe-max-size").write_text("4096\n")
    monkeypatch.setattr(processes_module, "PIPE_MAX_SIZE", tmp_path / "pipe-max-size")
    small = Tickets(ranges)
    batches = list(iter(small.claim, []))
    assert small.batch == 3 and len(batches) == 1000
    assert [r for b in batches for r in b] == ranges
    small.close()


def test_a_worker_holds_a_shared_file_open_only_while_landing_it(tmp_path):
    """A worker may claim ranges of every file of a release: it must not keep each open
    (a release of more files than the open files limit would fail)."""
    store = LocalStore(tmp_path / "store")
    files = {f"w{i}.bin": os.urandom(2 * PART) for i in range(200)}
    make_release(store, tmp_path, buckets={"b1_s32": files}, part_size=PART)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # room for what the pull holds (pipes, the progress, a range per thread), not 200 files
    room = len(os.listdir("/proc/self/fd")) + 48
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(room, soft), hard))
    try:
        r = pull_release(
            store, "m", tmp_path / "d", version="v1", processes=2, concurrency=4, part_size=PART
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for name, data in files.items():
        assert (r.path / "buckets/b1_s32" / name).read_bytes() == data


def _until_all_read(log: Path, workers: int) -> None:
    """Hold a worker's read until ``workers`` processes have each read once (so a claim is
    not all taken by the first worker to start), or 30 s have passed."""
    with open(log, "a") as f:  # one short append a call: whole lines from any process
        f.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + 30
    while len(set(log.read_text().split())) < workers and time.monotonic() < deadline:
        time.sleep(0.01)


def test_one_huge_file_is_landed_by_every_worker(store, tmp_path):
    big = os.urandom(24 * PART + 5)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"weights.bin": big}}, part_size=PART)
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    log, real = tmp_path / "readers", store.read_range_into

    def read_range_into(k, start, buf):
        if k == key:
            _until_all_read(log, 3)
        return real(k, start, buf)

    store.read_range_into = read_range_into
    r = pull_release(  # a thread each: two workers' threads cannot hold every range
        store, "m", tmp_path / "d", version="v1", processes=3, concurrency=3, part_size=PART
    )
    assert (r.path / "buckets/b1_s32/weights.bin").read_bytes() == big
    assert r.processes == 3 and len(set(log.read_text().split())) == 3
    assert not list((tmp_path / "d").rglob("*.incomplete"))


def test_a_slow_worker_lands_fewer_ranges(store, tmp_path):
    """Ranges go to whichever worker is free: one whose reads take 10x as long lands
    fewer, and the pull does not wait for a fixed share of its own."""
    big = os.urandom(40 * PART)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"weights.bin": big}}, part_size=PART)
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    log, real, landed = tmp_path / "readers", store.read_range_into, tmp_path / "landed"

    def read_range_into(k, start, buf):
        if k == key:
            _until_all_read(log, 2)
            slow = log.read_text().split()[0]  # the first worker to read
            time.sleep(0.2 if str(os.getpid()) == slow else 0.02)
            with open(landed, "a") as f:
                f.write(f"{os.getpid()} {start}\n")
        return real(k, start, buf)

    store.read_range_into = read_range_into
    r = pull_release(
        store, "m", tmp_path / "d", version="v1", processes=2, concurrency=2, part_size=PART
    )
    assert (r.path / "buckets/b1_s32/weights.bin").read_bytes() == big
    ranges = {tuple(line.split()) for line in landed.read_text().splitlines()}
    by_worker = collections.Counter(pid for pid, _ in ranges)
    assert len(ranges) == 40 and by_worker[log.read_text().split()[0]] < 15


def test_workers_install_every_byte_and_report_one_progress(store, tmp_path, monkeypatch):
    files = _files()
    make_release(store, tmp_path, buckets={"b1_s32": files}, part_size=PART)
    advanced = []

    @contextlib.contextmanager
    def recording(description, total):
        yield type("P", (), {"advance": lambda self, n: advanced.append(n)})()

    monkeypatch.setattr(pull_module, "byte_progress", recording)
    r = pull_release(store, "m", tmp_path / "d", version="v1", processes=3, concurrency=6,
                     part_size=PART)  # fmt: skip
    assert r.processes == 3
    for name, data in files.items():
        assert (r.path / "buckets/b1_s32" / name).read_bytes() == data
    assert sum(advanced) == r.downloaded_bytes + r.reused_bytes  # every child's bytes
    assert list(r.phases) == list(pull_module.PHASES)  # the marks by the children's reports
    assert r.parts == sum(-(-len(d) // PART) for d in files.values()) + 1  # + config.json
    assert not list(r.path.rglob("*.incomplete")) and not _forked_children()


def test_no_more_workers_than_ranges(store, tmp_path):
    make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": os.urandom(3 * PART)}},
                 part_size=PART)  # fmt: skip
    r = pull_release(store, "m", tmp_path / "d", version="v1", processes=8, part_size=PART)
    assert r.processes == 4  # w.bin's 3 ranges and config.json
    r = pull_release(store, "m", tmp_path / "e", version="v1", processes=8, concurrency=2,
                     part_size=PART)  # fmt: skip
    assert r.processes == 2  # no more than ranges in flight


@pytest.mark.s3
def test_a_part_corrupted_in_a_worker_is_refetched_alone_and_counted(
    s3_store_url, s3_env, tmp_path, monkeypatch
):
    files = _files(4, 20 * PART)
    m = make_release(open_store(s3_store_url), tmp_path, buckets={"b1_s32": files},
                     part_size=PART)  # fmt: skip
    ref = next(f for f in m.buckets["b1_s32"].files if f.path == "part2.bin")
    with FaultProxy(s3_env, ranged_get_of(blob_key(ref.sha256), 4 * PART)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(tmp_path / "d"),
                                "--store", s3_store_url, "--part-size", "256KiB",
                                "--processes", "2", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["processes"] == 2 and out["refetched_parts"] == 1 and len(proxy.hits) == 1
    for name, data in files.items():
        assert (tmp_path / "d/m/current/buckets/b1_s32" / name).read_bytes() == data


@pytest.mark.s3
def test_persistent_corruption_in_a_worker_is_one_line_exit_1_and_keeps_the_install(
    s3_store_url, s3_env, tmp_path, monkeypatch
):
    store = open_store(s3_store_url)
    make_release(store, tmp_path, version="v1", part_size=PART)
    m2 = make_release(store, tmp_path, version="v2", buckets={"b1_s32": _files(4)},
                      part_size=PART)  # fmt: skip
    dest = tmp_path / "d"
    pull_release(store, "m", dest, version="v1")
    ref = m2.buckets["b1_s32"].files[0]
    bad = ranged_get_of(blob_key(ref.sha256), 3 * PART)
    with FaultProxy(s3_env, bad, None) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        r = runner.invoke(app, ["pull", "m", "--version", "v2", "--dest", str(dest), "--store",
                                s3_store_url, "--part-size", "64KiB",
                                "--processes", "3"])  # fmt: skip
    assert r.exit_code == 1, r.output
    assert r.stderr.count("\n") == 1 and "blake3 mismatch in part 3" in r.stderr
    assert f"after {PART_RETRIES} re-fetches" in r.stderr
    assert os.readlink(dest / "m/current") == "v1" and not (dest / "m/v2").exists()
    assert not _forked_children()


def test_a_killed_worker_fails_the_pull_then_a_pull_resumes(store, tmp_path):
    files = _files(6, 8 * PART)
    make_release(store, tmp_path, buckets={"b1_s32": files}, part_size=PART)
    parent, real = os.getpid(), store.read_range_into
    landed = []

    def read_range_into(key, start, buf):
        if os.getpid() != parent and start >= 4 * PART:  # in a worker, halfway through a file
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
        landed.append(key)
        return real(key, start, buf)

    store.read_range_into = read_range_into  # the workers inherit it
    dest = tmp_path / "d"
    with pytest.raises(PipelineError, match="worker process ended without reporting") as e:
        # one thread a worker: its ranges before the one it dies at have landed
        pull_release(store, "m", dest, version="v1", processes=3, concurrency=3, part_size=PART)
    assert e.value.exit_code == 1 and "--processes 1" in str(e.value)
    assert not _forked_children() and not (dest / "m/current").exists()
    store.read_range_into = real
    r = pull_release(store, "m", dest, version="v1", processes=3, part_size=PART)
    assert r.reused_bytes >= PART  # the killed workers' verified parts, not just a small file
    assert r.downloaded_bytes < sum(len(d) for d in files.values())
    for name, data in files.items():
        assert (r.path / "buckets/b1_s32" / name).read_bytes() == data


def test_an_error_in_a_worker_reaches_the_caller_as_itself(store, tmp_path):
    make_release(store, tmp_path, buckets={"b1_s32": _files(4)}, part_size=PART)
    parent, real = os.getpid(), store.read_range_into

    def read_range_into(key, start, buf):
        n = real(key, start, buf)
        if os.getpid() != parent:
            buf[0] ^= 0xFF  # every read in a worker goes bad
        return n

    store.read_range_into = read_range_into
    with pytest.raises(IntegrityError, match="mismatch"):
        pull_release(store, "m", tmp_path / "d", version="v1", processes=2, part_size=PART)
    assert not _forked_children()


def test_workers_die_with_a_killed_pull(store, tmp_path):
    """A SIGKILLed pull (no finally of ours runs) takes its workers with it."""
    make_release(store, tmp_path, buckets={"b1_s32": _files(4)}, part_size=PART)
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipeline.store import open_store
        from pipeline.install.pull import pull_release
        store = open_store({store.url!r})
        slow = store.read_range_into
        def read_range_into(*a):
            time.sleep(60)  # still reading when the pull is killed
            return slow(*a)
        store.read_range_into = read_range_into
        pull_release(store, "m", Path({str(tmp_path / "d")!r}), version="v1", processes=2,
                     part_size={PART})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parent.parent)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = [
                int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and f"\nPPid:\t{proc.pid}\n" in _status(p)
            ]  # fmt: skip
        assert len(workers) == 2, "the pull should have forked two workers"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in workers)
    finally:  # a failing run leaves nothing behind either
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _status(proc: Path) -> str:
    try:
        return (proc / "status").read_text()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie that a container's init may never reap)."""
    lines = _status(Path(f"/proc/{pid}")).splitlines()
    state = next((ln.split()[1] for ln in lines if ln.startswith("State:")), "")
    return bool(state) and state != "Z"


@pytest.mark.s3
def test_workers_on_botocores_path_install_every_byte(s3_store_url, tmp_path, monkeypatch):
    monkeypatch.setenv("INF2_PIPELINE_S3_GETS", "botocore")
    store = open_store(s3_store_url)
    assert store.ranges is None
    files = _files(6, 3 * PART)
    make_release(store, tmp_path, buckets={"b1_s32": files}, part_size=PART)
    r = pull_release(store, "m", tmp_path / "d", version="v1", processes=3, part_size=PART)
    for name, data in files.items():
        assert (r.path / "buckets/b1_s32" / name).read_bytes() == data


@pytest.mark.s3
def test_a_worker_forgets_the_parents_connections(s3_store_url, s3_env, monkeypatch):
    """Against S3 (keep-alive) the manifest's GET leaves a connection in botocore's pool and
    the reader's: two workers reading one inherited socket would get each other's bytes.
    (moto's server closes every connection, so a pull there cannot show it.)"""
    store = open_store(s3_store_url)
    assert store.ranges is not None
    conn, _ = store.ranges._connection(("http", s3_env.removeprefix("http://")), "test")
    store.ranges._local.conns = {("http", "kept"): conn}  # as a kept-alive reply leaves it
    closed = []
    session = store.client._endpoint.http_session
    monkeypatch.setattr(session, "close", lambda: closed.append(True))
    store.after_fork()
    assert closed == [True] and not store.ranges._local.__dict__.get("conns")
    conn.close()


def test_processes_by_default_only_over_tls(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    tls = S3Store("b", endpoint_url="https://127.0.0.1:9")
    by_cpus = [default_processes(tls, c) for c in (1, 2, 5, 16, 64)]
    assert by_cpus == [1, 2, 5, 16, MAX_PULL_PROCESSES]
    assert default_processes(S3Store("b", endpoint_url="http://127.0.0.1:9"), 16) == 1
    botocore = S3Store("b", endpoint_url="https://127.0.0.1:9", lean_gets=False)
    assert default_processes(botocore, 16) == 1
    assert default_processes(LocalStore(tmp_path), 16) == 1
    monkeypatch.delattr(os, "fork")
    assert default_processes(tls, 16) == 1


def test_an_exception_that_does_not_pickle_still_reaches_the_parent():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(a)  # unpickling calls Odd(a): a TypeError

    e = _picklable(Odd("x", "y"))
    assert isinstance(e, PipelineError) and "Odd: x" in str(e)
    kept = IntegrityError("f", "bad")
    assert _picklable(kept) is kept


def test_a_worker_that_cannot_start_is_one_line_and_nothing_is_left_running(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    make_release(store, tmp_path, buckets={"b1_s32": _files(4)}, part_size=PART)
    real, forks = os.fork, []

    def fork():  # the first worker starts, the second hits the pids limit
        if forks:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        forks.append(real())
        return forks[-1]

    monkeypatch.setattr(os, "fork", fork)
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(tmp_path / "d"),
                            "--store", str(tmp_path / "store"), "--processes", "3"])  # fmt: skip
    monkeypatch.setattr(os, "fork", real)
    assert r.exit_code == 1, r.output
    assert "cannot start a worker process: Resource temporarily unavailable" in r.stderr
    assert "--processes 1" in r.stderr and r.stderr.count("\n") == 1
    assert not _forked_children()


def test_a_failing_worker_ends_its_blocked_siblings_at_once(tmp_path):
    store = LocalStore(tmp_path / "store")
    make_release(store, tmp_path, buckets={"b1_s32": _files(4, 8 * PART)}, part_size=PART)
    parent, real = os.getpid(), store.read_range_into
    forks = tmp_path / "forks"

    def read_range_into(key, start, buf):
        if os.getpid() != parent:
            with open(forks, "a") as f:
                f.write(f"{os.getpid()}\n")
            first = forks.read_text().split()[0]
            if str(os.getpid()) == first:
                raise IntegrityError(key, "bad bytes")  # the first worker to read fails
            time.sleep(60)  # the others would block for a minute
        return real(key, start, buf)

    store.read_range_into = read_range_into
    t = time.monotonic()
    with pytest.raises(IntegrityError, match="bad bytes"):
        pull_release(store, "m", tmp_path / "d", version="v1", processes=3, part_size=PART)
    assert time.monotonic() - t < 30 and not _forked_children()


def _started_workers(store, dest: Path, n: int):
    """``n`` worker processes started on release m v1 of ``store``, and their jobs."""
    manifest = read_verified(store, "m", version="v1").manifest
    jobs = [(dest / rel, ref) for rel, ref in release_files(manifest)]
    workers = processes_module.WorkerProcesses(store, n, n, PART, "parts")
    workers.start(jobs)
    return workers, jobs


def test_a_second_ctrl_c_waits_until_every_worker_is_reaped(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    make_release(store, tmp_path, buckets={"b1_s32": _files(4, 8 * PART)}, part_size=PART)
    parent, real = os.getpid(), store.read_range_into

    def read_range_into(key, start, buf):
        if os.getpid() != parent:
            time.sleep(60)  # every worker is busy when the pull is stopped
        return real(key, start, buf)

    store.read_range_into = read_range_into
    workers, _ = _started_workers(store, tmp_path / "d", 3)
    assert workers.started == 3
    real_kill = os.kill

    def kill(pid, sig):  # the user presses Ctrl-C again as the first worker is killed
        real_kill(pid, sig)
        if not pressed:  # once
            pressed.append(pid)
            real_kill(parent, signal.SIGINT)

    pressed: list[int] = []

    monkeypatch.setattr(os, "kill", kill)
    # Python's own Ctrl-C handler, whatever started the session (a background job of a
    # non-interactive shell starts with SIGINT ignored); and a thread that does not block
    # signals, as the progress bar's: the kernel may hand the Ctrl-C to it
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = threading.Event()
    bar = threading.Thread(target=done.wait, args=(30,))
    bar.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            workers.close()
    finally:
        done.set()
        bar.join()
        signal.signal(signal.SIGINT, before)
        monkeypatch.setattr(os, "kill", real_kill)
    assert not _forked_children()


def test_workers_leave_ctrl_c_to_the_pull(tmp_path):
    """A terminal's Ctrl-C reaches every process of its group; the workers ignore it and
    the pull decides (here: nothing stops it, so every byte lands)."""
    store = LocalStore(tmp_path / "store")
    files = _files(4, 4 * PART)
    make_release(store, tmp_path, buckets={"b1_s32": files}, part_size=PART)
    parent, real = os.getpid(), store.read_range_into
    reading, go = tmp_path / "reading", tmp_path / "go"

    def read_range_into(key, start, buf):
        if os.getpid() != parent:
            with open(reading, "a") as f:
                f.write(f"{os.getpid()}\n")
            deadline = time.monotonic() + 30
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(key, start, buf)

    store.read_range_into = read_range_into
    workers, jobs = _started_workers(store, tmp_path / "d", 2)
    try:
        deadline = time.monotonic() + 30
        while len(set(reading.read_text().split()) if reading.exists() else ()) < 2:
            assert time.monotonic() < deadline, "the workers did not start reading"
            time.sleep(0.01)
        for child in workers._children:
            os.kill(child.pid, signal.SIGINT)
        go.touch()
        try:
            workers.fetch_all(jobs, processes_module.ByteProgress(None, None))
        except KeyboardInterrupt:  # a worker's, sent on as its failure
            pytest.fail("a worker took the Ctrl-C for itself")
    finally:
        workers.close()
    for rel, data in files.items():
        assert (tmp_path / "d" / BUCKETS / "b1_s32" / rel).read_bytes() == data


class _Recording(LocalStore):
    def after_fork(self) -> None:  # in each worker: one line
        with open(self.root.parent / "after_fork", "a") as f:
            f.write(f"{os.getpid()}\n")


def test_every_worker_drops_what_it_inherited_before_its_first_read(tmp_path):
    store = _Recording(tmp_path / "store")
    make_release(store, tmp_path, buckets={"b1_s32": _files(4)}, part_size=PART)
    r = pull_release(store, "m", tmp_path / "d", version="v1", processes=3, part_size=PART)
    pids = (tmp_path / "after_fork").read_text().split()
    assert r.processes == 3 and len(set(pids)) == 3 and str(os.getpid()) not in pids


def test_each_worker_reserves_only_the_ranges_it_lands_of_a_shared_file(tmp_path, monkeypatch):
    """Blocks are reserved by the worker that writes them (where a filesystem has no
    fallocate, glibc's stand-in writes into every block it reserves), and in parallel."""
    store = LocalStore(tmp_path / "store")
    big = os.urandom(12 * PART)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"w.bin": big}}, part_size=PART)
    key = blob_key(m.buckets["b1_s32"].files[0].sha256)
    log, real = tmp_path / "reserved", fetcher_module.reserve
    readers, real_read = tmp_path / "readers", store.read_range_into

    def read_range_into(k, start, buf):
        if k == key:
            _until_all_read(readers, 3)
            with open(tmp_path / "landed", "a") as f:
                f.write(f"{os.getpid()} {start}\n")
        return real_read(k, start, buf)

    def reserve(fd, start, length):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {start} {length}\n")
        return real(fd, start, length)

    store.read_range_into = read_range_into
    monkeypatch.setattr(fetcher_module, "reserve", reserve)
    r = pull_release(  # a thread each: two workers' threads cannot hold every range
        store, "m", tmp_path / "d", version="v1", processes=3, concurrency=3, part_size=PART
    )
    assert (r.path / "buckets/b1_s32/w.bin").read_bytes() == big
    rows = [line.split() for line in log.read_text().splitlines()]
    assert sorted(int(start) for _, start, _ in rows) == [i * PART for i in range(12)]
    landed = {tuple(line.split()) for line in (tmp_path / "landed").read_text().splitlines()}
    assert {(pid, start) for pid, start, _ in rows} == landed  # by the worker that landed it
    assert len({pid for pid, _, _ in rows}) == 3 and str(os.getpid()) not in log.read_text()
