"""The compile stage's scheduling, cache and shards, with the fake backend in real workers."""

from __future__ import annotations

import contextlib
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
from pipeline.compile.scheduler import compile_release
from pipeline.compile.shards import split
from pipeline.plan.config import load_config
from pipeline.store import open_store
from pipeline.store.cache import read_cache_entry
from tests import compile_fakes
from tests.config_factory import release_yaml
from tests.proc_helpers import alive as _alive
from tests.proc_helpers import live_with as _live_with

REPO = Path(__file__).resolve().parent.parent
CONFIG = release_yaml(instance_type=None, tp_degree=None, sequence_lengths=[32, 64], timeout_s=60)
# Runs the CLI with the fake backend registered, as a separate process. SIGINT is set to
# raise KeyboardInterrupt again: a test run started in the background by a shell (`make
# test &`, some CI runners) inherits SIGINT ignored, and then Ctrl-C tests could only time out.
DRIVER = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from tests import compile_fakes; compile_fakes.install(); "
    "from pipeline.cli import main; sys.argv[0] = 'inf2-pipeline'; main()"
)


@pytest.fixture(autouse=True)
def fake_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default workdir (work/compile/<model>) lands here
    compile_fakes.install()
    yield
    compile_fakes.uninstall()


@pytest.fixture
def config(write_config):
    return write_config(CONFIG)


def run(config: Path, **kw):
    release = load_config(config)
    kw.setdefault("workdir", config.parent / "work")
    return compile_release(release, backend="fake", **kw)


def statuses(report) -> dict[str, str]:
    return {r.bucket.name: r.status for r in report.results}


def entries(store_dir: Path, kind: str = "graphs") -> dict[str, dict[str, str]]:
    """bucket -> {file: sha256} of every graph entry, or with kind "weights", weights key
    -> {file: sha256} of every prepared-weights entry (logs are not entry files)."""
    store = open_store(str(store_dir))
    out = {}
    for key in store.list("cache/"):
        entry = read_cache_entry(store, Path(key).stem)
        if entry.kind == kind:
            name = entry.bucket if kind == "graphs" else entry.key
            out[name] = {f.path: f.sha256 for f in entry.files}
    return out


def test_rerun_of_an_unchanged_config_compiles_nothing(config):
    first = run(config)
    assert set(statuses(first).values()) == {"compiled"}
    assert [r.bucket.name for r in first.results] == ["b2_s64", "b1_s64", "b2_s32", "b1_s32"]
    second = run(config)
    assert set(statuses(second).values()) == {"cached"}
    assert [r.files for r in second.results] == [r.files for r in first.results]
    assert len(entries(config.parent / "store")) == 4


def test_changing_one_bucket_recompiles_exactly_that_bucket(write_config):
    cfg = write_config(CONFIG.replace("batch_sizes: [1, 2]", "batch_sizes: [1]"))
    run(cfg)
    cfg.write_text(cfg.read_text().replace("[32, 64]", "[32, 96]"))
    assert statuses(run(cfg)) == {"b1_s96": "compiled", "b1_s32": "cached"}


def test_one_failure_does_not_stop_the_others(config, monkeypatch):
    monkeypatch.setenv("FAKE_COMPILE", json.dumps({"b2_s32": "fail"}))
    report = run(config, jobs=2)
    assert statuses(report) == {
        "b2_s64": "compiled",
        "b1_s64": "compiled",
        "b2_s32": "failed",
        "b1_s32": "compiled",
    }
    (failed,) = report.failed
    assert failed.error == "RuntimeError: fake compiler error in b2_s32"
    assert "fake compiler error" in failed.log.read_text()
    assert "b2_s32" not in entries(config.parent / "store")
    monkeypatch.delenv("FAKE_COMPILE")
    assert statuses(run(config))["b2_s32"] == "compiled"
    assert list(statuses(run(config)).values()) == ["cached"] * 4


def test_a_failed_prepare_fails_every_miss_and_is_retried_next_run(config, monkeypatch):
    monkeypatch.setenv("FAKE_PREPARE", "fail")
    report = run(config)
    assert set(statuses(report).values()) == {"failed"}
    assert report.failed[0].error.startswith("prepare failed: RuntimeError: fake prepare error")
    monkeypatch.delenv("FAKE_PREPARE")
    assert set(statuses(run(config)).values()) == {"compiled"}


def test_shared_files_are_prepared_again_when_the_format_changes(config, monkeypatch):
    """A new format (what a backend writes, e.g. renamed weights) must not reuse the shared
    files an older format prepared in the same workdir."""
    import pipeline.compile.keys as keys

    run(config)
    shared = config.parent / "work" / "shared"
    before = {p.name for p in shared.iterdir()}
    monkeypatch.setattr(keys, "FORMAT_VERSION", keys.FORMAT_VERSION + 1)
    assert set(statuses(run(config)).values()) == {"compiled"}  # new keys: nothing cached
    assert {p.name for p in shared.iterdir()} - before  # and a fresh prepare


def test_a_crashed_compiler_leaves_no_cache_entry(config, monkeypatch):
    monkeypatch.setenv("FAKE_COMPILE", json.dumps({"b1_s64": "crash"}))
    report = run(config)
    (failed,) = report.failed
    assert failed.bucket.name == "b1_s64" and failed.error.startswith("killed by signal SIGKILL")
    assert set(entries(config.parent / "store")) == {"b2_s64", "b2_s32", "b1_s32"}


def test_timeout_kills_the_compiler(config, monkeypatch, tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv("FAKE_COMPILE", json.dumps({"b2_s64": "hang"}))
    monkeypatch.setenv("FAKE_COMPILE_TRACE", str(trace))
    start = time.monotonic()
    report = run(config, jobs=2, timeout_s=1.5)
    assert time.monotonic() - start < 20
    assert statuses(report)["b2_s64"] == "timeout"
    assert report.failed[0].error == "timed out after 1.5s"
    assert not _alive(json.loads((trace / "b2_s64.json").read_text())["pid"])
    assert "b2_s64" not in entries(config.parent / "store")


def test_jobs_compile_in_parallel_most_expensive_first(config, monkeypatch, tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv("FAKE_COMPILE", json.dumps(dict.fromkeys(_names(config), "sleep:1")))
    monkeypatch.setenv("FAKE_COMPILE_TRACE", str(trace))
    run(config, jobs=2)
    spans = {p.stem: json.loads(p.read_text()) for p in trace.glob("*.json")}
    order = sorted(spans, key=lambda n: spans[n]["start"])
    assert set(order[:2]) == {"b2_s64", "b1_s64"}
    most = max(sum(s["start"] <= t < s["end"] for s in spans.values()) for t in _starts(spans))
    assert most == 2


def test_shards_in_two_processes_make_the_same_entries_as_one(config, tmp_path):
    run(config, store=str(tmp_path / "one"))
    shared = tmp_path / "shared"
    cmd = [sys.executable, "-c", DRIVER, "compile", str(config), "--backend", "fake"]
    procs = [
        subprocess.Popen(
            [
                *cmd,
                "--shard",
                f"{i}/2",
                "--store",
                str(shared),
                "--workdir",
                str(tmp_path / f"w{i}"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    assert entries(shared) == entries(tmp_path / "one")
    assert len(entries(shared)) == 4


def test_ctrl_c_stops_the_compilers_and_writes_no_entry(config, tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {
        **os.environ,
        "FAKE_COMPILE": json.dumps(dict.fromkeys(_names(config), "hang")),
        "FAKE_COMPILE_TRACE": str(trace),
        "PYTHONPATH": str(REPO),
    }
    cmd = [sys.executable, "-c", DRIVER, "compile", str(config), "--backend", "fake", "-j", "2"]
    cmd += ["--workdir", str(tmp_path / "work")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # two workers start: slow only on a loaded box
        while len(_traces(trace)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [t["pid"] for t in _traces(trace).values()]
        assert len(pids) == 2
        proc.send_signal(signal.SIGINT)
        # One shared grace period (KILL_GRACE_S) at most, then exit: 120 s only bounds a
        # machine that is very busy; a hang fails here instead of hanging the suite.
        _, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == 130
    assert "b2_s64 graph interrupted" in err and "b1_s64 graph interrupted" in err
    assert err.strip().splitlines()[-1] == "error: interrupted"
    assert not any(_alive(pid) for pid in pids)
    assert entries(config.parent / "store") == {}


# -- workers and their compilers never outlive the compile command --------------------------


def _start_compilers(config: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, str]:
    """The compile CLI with two workers, each waiting on a stubborn child compiler (see
    compile_fakes "compiler-hang"); returns once both compilers handle SIGTERM. Also the
    trace dir and the marker (the workdir) in every worker's and compiler's argv."""
    trace = tmp_path / "trace"
    trace.mkdir()
    workdir = tmp_path / "work"
    env = {
        **os.environ,
        "FAKE_COMPILE": json.dumps(dict.fromkeys(_names(config), "compiler-hang")),
        "FAKE_COMPILE_TRACE": str(trace),
        "PYTHONPATH": str(REPO),
    }
    cmd = [sys.executable, "-c", DRIVER, "compile", str(config), "--backend", "fake", "-j", "2"]
    cmd += ["--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(_ready_compilers(trace)) == 2:
            return proc, trace, str(workdir)
        time.sleep(0.1)
    _stop(proc)
    raise AssertionError(f"two compilers did not start: {proc.stderr.read()}")


def test_sigkilled_compile_leaves_no_worker_or_compiler(config, tmp_path):
    proc, trace, marker = _start_compilers(config, tmp_path)
    try:
        pids = [p for t in _traces(trace).values() for p in (t["pid"], t["compiler"])]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        assert set(pids) <= set(_live_with(marker))  # the marker finds them
        proc.kill()  # no handler runs: the workers are on their own
        proc.wait()
        # The workers see it at once (parent-death signal) or within WATCH_S (their watch
        # thread); 20 s is slack for a loaded machine, not the expected time. A killed
        # process's argv reads empty while it tears down, before it is a zombie: wait for
        # the pids too, not only for the marker to disappear.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (_live_with(marker) or any(_alive(p) for p in pids)):
            time.sleep(0.1)
        assert _live_with(marker) == []
        assert not any(_alive(p) for p in pids)
    finally:
        _stop(proc, marker)
    assert entries(config.parent / "store") == {}


def test_ctrl_c_under_load_stops_all_workers_within_one_grace_period(config, tmp_path, busy_cores):
    from pipeline.compile.workers import KILL_GRACE_S

    proc, trace, marker = _start_compilers(config, tmp_path)
    try:
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        _stop(proc, marker)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted"
    # The compilers ignore SIGTERM, so each group lasts its whole grace period and then is
    # SIGKILLed. Both got SIGTERM at once: one kill per group in turn would space them a
    # whole grace period apart. (A woken sleeper runs within milliseconds even with both
    # cores busy; KILL_GRACE_S of slack is over a hundred times that.)
    sigterms = [
        float(line.split()[1])
        for f in trace.glob("*.compiler")
        for line in f.read_text().splitlines()
        if line.startswith("sigterm")
    ]
    assert len(sigterms) == 2, sigterms
    assert max(sigterms) - min(sigterms) < KILL_GRACE_S
    # The bound: one grace period plus the CLI's own exit. The work after SIGINT is a few
    # signals and the interpreter's exit, well under a second of CPU; with two busy loops
    # this process gets at least a third of a core, so 20 s more is ample. (Stopping the
    # groups one after another would take a grace period per worker.)
    assert took < KILL_GRACE_S + 20
    deadline = time.monotonic() + 20  # SIGKILLed processes exit asynchronously
    while _live_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_with(marker) == []


def test_interrupt_between_blobs_and_entry_leaves_no_entry(config, monkeypatch):
    from pipeline.compile import scheduler

    real, calls = scheduler._write_entry, []

    def interrupted_on_second(store, entry):
        if entry.kind == "weights":  # written first, before any bucket compiles
            return real(store, entry)
        calls.append(entry.bucket)
        if len(calls) == 2:
            raise KeyboardInterrupt  # after this bucket's blobs went up, before its entry
        real(store, entry)

    monkeypatch.setattr(scheduler, "_write_entry", interrupted_on_second)
    with pytest.raises(KeyboardInterrupt):
        run(config)
    store_dir = config.parent / "store"
    assert set(entries(store_dir)) == {calls[0]}
    assert all(
        (store_dir / "blobs" / "sha256" / sha).is_file()
        for sha in entries(store_dir)[calls[0]].values()
    )
    monkeypatch.setattr(scheduler, "_write_entry", real)
    assert sorted(statuses(run(config)).values()) == ["cached"] + ["compiled"] * 3


def test_plain_lines_in_ci_and_a_bar_on_a_terminal(monkeypatch):
    from pipeline.compile import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.delenv("CI", raising=False)
    assert isinstance(progress.make_progress(4), progress.BarProgress)
    monkeypatch.setenv("CI", "true")
    assert isinstance(progress.make_progress(4), progress.PlainProgress)


def test_download_fetches_cache_hits_into_the_workdir(config, tmp_path):
    run(config)
    work = tmp_path / "elsewhere"
    report = run(config, workdir=work, download=True)
    assert set(statuses(report).values()) == {"cached"}
    graph = work / "buckets" / "b1_s32" / "graph.bin"
    assert graph.read_text().startswith("b1_s32 float32")


# --- the CLI -----------------------------------------------------------------------------

cli = CliRunner()


def test_cli_reports_failed_buckets_by_name_and_exits_1(config, monkeypatch):
    monkeypatch.setenv("FAKE_COMPILE", json.dumps({"b1_s32": "fail"}))
    r = cli.invoke(app, ["compile", str(config), "--backend", "fake", "--json"])
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert data["failed"] == ["b1_s32"] and data["counts"] == {"compiled": 3, "failed": 1}
    assert {b["bucket"]: b["cache_hit"] for b in data["buckets"]}["b1_s32"] is False
    assert "error: compile tiny: 1 of 4 buckets failed: b1_s32 (failed)" in r.stderr
    assert "[4/4]" in r.stderr  # plain progress lines, not a bar, outside a terminal


def test_cli_summary_table_shows_cache_hits(config):
    cli.invoke(app, ["compile", str(config), "--backend", "fake"])
    r = cli.invoke(app, ["compile", str(config), "--backend", "fake"])
    assert r.exit_code == 0, r.output
    assert "0 of 4 compiled" in r.stdout and "weights: hit" in r.stdout
    row = next(line for line in r.stdout.splitlines() if "b2_s64" in line)
    assert [c.strip() for c in row.split("│")[1:4]] == ["b2_s64", "hit", "hit"]


def test_cli_shard_count_takes_the_index_from_job_completion_index(config, monkeypatch):
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    r = cli.invoke(app, ["compile", str(config), "--backend", "fake", "--shard-count", "2"])
    assert r.exit_code == 0, r.output
    r = cli.invoke(
        app, ["compile", str(config), "--backend", "fake", "--shard-count", "2", "--json"]
    )
    data = json.loads(r.stdout)
    expected = [b.name for b in split(load_config(config).buckets, 2)[1]]
    assert data["shard"] == "1/2" and [b["bucket"] for b in data["buckets"]] == expected


def test_cli_release_compiles_then_publishes_once(config, tmp_path):
    store = tmp_path / "released"
    args = ["release", str(config), "--backend", "fake", "--store", str(store), "--json"]
    r = cli.invoke(app, args)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["compile"]["counts"] == {"compiled": 4}
    assert data["publish"]["created"] is True
    version = data["publish"]["version"]
    assert (store / "models" / "tiny" / "releases" / f"{version}.json").is_file()
    again = json.loads(cli.invoke(app, args).stdout)
    assert again["compile"]["counts"] == {"cached": 4}
    assert again["publish"]["version"] == version and again["publish"]["created"] is False


@pytest.mark.parametrize(
    ("args", "env", "msg"),
    [
        (["--shard-count", "2"], {}, "JOB_COMPLETION_INDEX is unset"),
        (["--shard", "2/2"], {}, "index must be in 0..count-1"),
        (["--shard", "one/2"], {}, "not of the form I/N"),
        (["--backend", "tpu"], {}, "backend 'tpu': unknown"),
        (["--jobs", "0"], {}, "--jobs"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(config, monkeypatch, args, env, msg):
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    r = cli.invoke(app, ["compile", str(config), *args])
    assert r.exit_code == 2
    assert msg in r.stderr and "Traceback" not in r.output


# --- helpers -----------------------------------------------------------------------------


def _names(config: Path) -> list[str]:
    return [b.name for b in load_config(config).buckets]


def _starts(spans: dict) -> list[float]:
    return [s["start"] for s in spans.values()]


def _traces(trace: Path) -> dict[str, dict]:
    """Each started compile's trace record (a file being written is skipped)."""
    out = {}
    for p in trace.glob("*.json"):
        with contextlib.suppress(ValueError):
            out[p.stem] = json.loads(p.read_text())
    return out


def _ready_compilers(trace: Path) -> list[str]:
    return [
        p.stem
        for p in trace.glob("*.compiler")
        if "ready" in p.read_text() and "compiler" in _traces(trace).get(p.stem, {})
    ]


def _stop(proc: subprocess.Popen, marker: str | None = None) -> None:
    """A failed test must not leave its processes behind."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
    for pid in _live_with(marker) if marker else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_the_workers_like_ctrl_c(config, tmp_path):
    """A pod's or CI job's stop (SIGTERM) unwinds like Ctrl-C: workers and compilers are
    stopped, no entry written, exit 143 with one line."""
    proc, _, marker = _start_compilers(config, tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        _stop(proc, marker)
    assert proc.returncode == 143, err
    assert "b2_s64 graph interrupted" in err and "b1_s64 graph interrupted" in err
    assert err.strip().splitlines()[-1] == "error: terminated"
    deadline = time.monotonic() + 20  # SIGKILLed processes exit asynchronously
    while _live_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_with(marker) == []
    assert entries(config.parent / "store") == {}
