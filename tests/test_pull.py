"""pull: atomic install, resume, verification, path safety, retries.

The ``store`` fixture runs each scenario against a local store and against a real S3
endpoint (moto's server, through boto3 over HTTP).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.contracts.store_layout import blob_key, release_key
from pipeline.errors import InputError, IntegrityError, NotFoundError, StoreError
from pipeline.install import pull as pull_module
from pipeline.install.installed import find_release
from pipeline.install.landing import with_retries
from pipeline.install.pull import PHASES, pull_release
from pipeline.store import open_store
from tests.release_factory import make_release, point_channel

runner = CliRunner()


@pytest.fixture
def store(store_url):
    return open_store(store_url)


def _installed_bytes(release_dir: Path, manifest) -> dict[str, bytes]:
    out = {p.name: p.read_bytes() for p in release_dir.glob("buckets/*/*")}
    assert len(out) >= 1
    return out


def test_pull_installs_atomically_and_points_current(store, tmp_path):
    m = make_release(store, tmp_path)
    dest = tmp_path / "dest"
    r = pull_release(store, "m", dest, version="v1")
    assert r.path == dest / "m" / "v1" and not r.already_installed
    assert os.readlink(dest / "m" / "current") == "v1"
    assert find_release(dest / "m") == (dest / "m" / "v1").resolve()
    for name, bucket in m.buckets.items():
        for ref in bucket.files:
            assert (r.path / "buckets" / name / ref.path).stat().st_size == ref.size
    assert (r.path / "config.json").read_bytes() == b'{"model_type": "llama"}'
    assert json.loads((r.path / "manifest.json").read_text())["version"] == "v1"
    assert not list((dest / "m").glob(".staging-*"))
    again = pull_release(store, "m", dest, version="v1")
    assert again.already_installed and again.downloaded_bytes == 0


def test_a_failed_write_names_the_model_directory_not_our_temporary_file(tmp_path, monkeypatch):
    import errno

    from pipeline.errors import PipelineError

    store = open_store(str(tmp_path / "store"))
    make_release(store, tmp_path)

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(PipelineError) as e:
        pull_release(store, "m", tmp_path / "dest", version="v1")
    assert e.value.what == str(tmp_path / "dest" / "m")
    assert e.value.why == "cannot write: No space left on device"


def test_pull_by_channel_and_upgrade_swaps_current(store, tmp_path):
    make_release(store, tmp_path, version="v1")
    make_release(store, tmp_path, version="v2")
    point_channel(store, "m", "prod", "v1")
    dest = tmp_path / "dest"
    assert pull_release(store, "m", dest, channel="prod").version == "v1"
    point_channel(store, "m", "prod", "v2")
    assert pull_release(store, "m", dest, channel="prod").version == "v2"
    assert os.readlink(dest / "m" / "current") == "v2"
    assert (dest / "m" / "v1" / "manifest.json").is_file()  # the old one stays for rollback


def test_missing_channel_version_and_model_are_clear(store, tmp_path):
    make_release(store, tmp_path)
    with pytest.raises(NotFoundError, match="channel 'prod'"):
        pull_release(store, "m", tmp_path / "d", channel="prod")
    with pytest.raises(NotFoundError, match="release m v9"):
        pull_release(store, "m", tmp_path / "d", version="v9")
    r = runner.invoke(
        app, ["pull", "m", "--channel", "prod", "--dest", str(tmp_path / "d"), "--store", store.url]
    )
    assert r.exit_code == 2 and r.stderr.startswith("error: channel 'prod' of model 'm'")
    r = runner.invoke(app, ["pull", "m", "--dest", str(tmp_path / "d"), "--store", store.url])
    assert r.exit_code == 2 and "exactly one of --version or --channel" in r.stderr


def test_corrupted_blob_fails_and_leaves_previous_install(store, tmp_path):
    make_release(store, tmp_path, version="v1")
    m2 = make_release(store, tmp_path, version="v2")
    dest = tmp_path / "dest"
    pull_release(store, "m", dest, version="v1")
    before = _installed_bytes(dest / "m" / "v1", None)
    victim = m2.buckets["b1_s32"].files[0]
    key = blob_key(victim.sha256)
    data = store.get_bytes(key)
    # same size, different bytes: the first byte flipped (a fixed b"X" would leave a random
    # blob that already starts with X unchanged, one run in 256)
    store.put_bytes(key, bytes([data[0] ^ 0xFF]) + data[1:])
    with pytest.raises(IntegrityError, match="blake3 mismatch"):
        pull_release(store, "m", dest, version="v2")
    assert os.readlink(dest / "m" / "current") == "v1"
    assert not (dest / "m" / "v2").exists()
    assert _installed_bytes(dest / "m" / "v1", None) == before
    r = runner.invoke(
        app, ["pull", "m", "--version", "v2", "--dest", str(dest), "--store", store.url]
    )
    assert r.exit_code == 1 and "blake3 mismatch" in r.stderr


@pytest.mark.parametrize("evil", ["../escape.bin", "/etc/evil", "a/../../x", "", "./x", "a//b"])
def test_manifest_paths_outside_dest_are_refused(store, tmp_path, evil):
    m = make_release(store, tmp_path, version="v1")
    data = json.loads(store.get_bytes(release_key("m", "v1")))
    data["buckets"]["b1_s32"]["files"][0]["path"] = evil
    data["version"] = "evil"
    store.put_bytes(release_key("m", "evil"), json.dumps(data).encode())
    dest = tmp_path / "dest"
    with pytest.raises(InputError, match="outside the release directory"):
        pull_release(store, "m", dest, version="evil")
    assert not (tmp_path / "escape.bin").exists() and not (dest / "m" / "evil").exists()
    assert m.version == "v1"


def test_resume_keeps_verified_files(store, tmp_path):
    m = make_release(store, tmp_path)
    dest = tmp_path / "dest"
    staging = dest / "m" / ".staging-v1"
    # what a killed pull leaves: one complete verified file, one partial temp file
    ref = m.buckets["b2_s64"].files[0]
    (staging / "buckets/b2_s64").mkdir(parents=True)
    store.get_file(blob_key(ref.sha256), staging / "buckets/b2_s64" / ref.path)
    (staging / "buckets/b1_s32/.prefill.pt2.incomplete").parent.mkdir(parents=True)
    (staging / "buckets/b1_s32/.prefill.pt2.incomplete").write_bytes(b"partial")
    r = pull_release(store, "m", dest, version="v1")
    assert r.reused_bytes == ref.size
    assert (
        r.downloaded_bytes
        == sum(f.size for b in m.buckets.values() for f in b.files)
        + sum(f.size for f in m.files)
        - ref.size
    )
    assert not list(r.path.rglob("*.incomplete"))


def test_resume_after_sigkill_mid_download(store, tmp_path):
    """A real kill: a subprocess pulls through a slowed store, is SIGKILLed, then resumes."""
    files = {f"part{i}.bin": os.urandom(40_000) for i in range(12)}
    m = make_release(store, tmp_path, buckets={"b1_s32": files})
    dest = tmp_path / "dest"
    script = textwrap.dedent(f"""
        import time, sys
        from pipeline.store import open_store
        from pipeline.install.pull import pull_release
        store = open_store({store.url!r})
        slow = store.read_range_into
        def read_range_into(*a):
            time.sleep(0.15)
            return slow(*a)
        store.read_range_into = read_range_into
        pull_release(store, "m", __import__("pathlib").Path({str(dest)!r}), version="v1",
                     concurrency=1)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parent.parent)
    staging = dest / "m" / ".staging-v1" / "buckets" / "b1_s32"
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len([p for p in staging.glob("part*.bin")]) < 3:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    done = len(list(staging.glob("part*.bin")))
    assert 3 <= done < len(files), "the kill should land mid-download"
    r = pull_release(store, "m", dest, version="v1")
    assert r.reused_bytes >= done * 40_000
    for name, data in files.items():
        assert (r.path / "buckets/b1_s32" / name).read_bytes() == data
    assert m.version == "v1"


def test_identical_files_in_several_buckets_download_once(store, tmp_path):
    weights = os.urandom(50_000)
    buckets = {
        name: {"weights.safetensors": weights, "graph.pt2": os.urandom(100)}
        for name in ("b1_s32", "b2_s32", "b1_s64")
    }
    make_release(store, tmp_path, buckets=buckets)
    r = pull_release(store, "m", tmp_path / "d", version="v1")
    assert r.downloaded_bytes == len(weights) + 3 * 100 + len(b'{"model_type": "llama"}')
    for name in buckets:
        assert (r.path / "buckets" / name / "weights.safetensors").read_bytes() == weights


def test_large_files_are_fetched_in_parallel_ranges(store, tmp_path):
    big = os.urandom(1_000_003)
    m = make_release(store, tmp_path, buckets={"b1_s32": {"weights.bin": big}}, part_size=1 << 16)
    ref = m.buckets["b1_s32"].files[0]
    calls = []
    real = store.read_range_into

    def spy(key, start, buf):
        if key == blob_key(ref.sha256):
            calls.append((start, len(buf)))
        return real(key, start, buf)

    store.read_range_into = spy
    r = pull_release(store, "m", tmp_path / "d", version="v1", part_size=1 << 16, concurrency=4)
    assert (r.path / "buckets/b1_s32/weights.bin").read_bytes() == big
    assert len(calls) == -(-len(big) // (1 << 16))


def test_retries_transient_errors_then_gives_up():
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) < 3:
            raise StoreError("s3://b/k", "503 Slow Down", None)
        return b"ok"

    assert with_retries(flaky, base=0.001) == b"ok" and len(attempts) == 3
    with pytest.raises(StoreError):
        with_retries(
            lambda: (_ for _ in ()).throw(StoreError("k", "500", None)), attempts=2, base=0.001
        )
    calls = []

    def missing():
        calls.append(1)
        raise NotFoundError("k", "not found", None)

    with pytest.raises(NotFoundError):
        with_retries(missing, base=0.001)
    assert len(calls) == 1


def test_pull_cli_json(store, tmp_path):
    make_release(store, tmp_path)
    r = runner.invoke(
        app,
        [
            "pull",
            "m",
            "--version",
            "v1",
            "--dest",
            str(tmp_path / "d"),
            "--store",
            store.url,
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["version"] == "v1" and data["downloaded_bytes"] > 0 and data["files"] == 5
    assert list(data["phases"]) == list(PHASES)


def test_a_pull_stamps_its_phases_in_order(store, tmp_path):
    make_release(store, tmp_path)
    r = pull_release(store, "m", tmp_path / "d", version="v1")
    assert list(r.phases) == list(PHASES)
    times = list(r.phases.values())
    assert times == sorted(times) and times[0] >= 0 and times[-1] <= r.seconds + 1e-3  # rounded
    again = pull_release(store, "m", tmp_path / "d", version="v1")
    assert list(again.phases) == ["manifest", "installed"]


def test_the_landing_marks_are_stamped_when_the_bytes_pass_them(monkeypatch):
    clock = iter(range(100, 200))  # the module's clock only, not every caller's
    monkeypatch.setattr(pull_module, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    stamp = pull_module._Stamps(100)
    seen = []
    inner = type("P", (), {"advance": lambda self, n: seen.append(n)})()
    marked = pull_module._Marked(inner, 100, stamp)
    for n in (10, 40, 10, 30, 10):  # landed: 10, 50, 60, 90, 100
        marked.advance(n)
    assert seen == [10, 40, 10, 30, 10]  # passed on as they came
    # each mark at the first advance past it: 0 at the 1st (clock 100), half at the 3rd
    # (the 2nd reaches 50, not past it), 90 % at the 5th
    assert stamp.phases == {"first_range": 0, "half_landed": 1, "ninety_landed": 2}


def test_pull_path_imports_no_torch():
    code = (
        "import sys\n"
        "from pipeline.cli import app\n"
        "try:\n    app(['pull', '--help'])\nexcept SystemExit:\n    pass\n"
        "import pipeline.install.pull, pipeline.store.s3\n"
        "bad = [m for m in ('torch', 'transformers', 'numpy', 'safetensors') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert out.returncode == 0, out.stderr


def test_a_pull_from_s3_starts_without_boto3(s3_store_url, tmp_path):
    """The init container's cold path: clients are botocore's and pull's GETs its own, so
    boto3 and s3transfer (~0.1 s of imports) load only for managed uploads and downloads;
    rich (~26-35 ms) only for a terminal's progress bar or another command's tables."""
    make_release(open_store(s3_store_url), tmp_path)
    code = (
        "import sys\n"
        "from pipeline.cli import main\n"
        f"sys.argv = ['inf2-pipeline', 'pull', 'm', '--version', 'v1', '--store', "
        f"{s3_store_url!r}, '--dest', {str(tmp_path / 'dest')!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "loaded = [m for m in ('boto3', 's3transfer', 'torch', 'rich') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "dest" / "m" / "v1" / "manifest.json").is_file()


def test_the_cli_pull_freezes_its_start_and_collects_during_the_pull(tmp_path):
    """Run as the init container runs it (``main``), the pull's start is left out of later
    collections (frozen) and the collector runs again for the download; under a CliRunner
    (a test, a program calling the commands) the collector is left as it was."""
    from pipeline.store.local import LocalStore

    make_release(LocalStore(tmp_path / "store"), tmp_path)
    code = (
        "import gc, sys\n"
        "import pipeline.install.pull as p\n"
        "real, seen = p.pull_release, []\n"
        "def spy(*a, **k):\n"
        "    seen.append((gc.isenabled(), gc.get_freeze_count() > 0))\n"
        "    return real(*a, **k)\n"
        "p.pull_release = spy\n"
        "from pipeline.cli import app, main\n"
        "from typer.testing import CliRunner\n"
        "args = ['pull', 'm', '--version', 'v1', '--store', sys.argv[1], '--dest']\n"
        "r = CliRunner().invoke(app, [*args, sys.argv[2] + '/a'])\n"
        "assert r.exit_code == 0 and seen == [(True, False)], (r.output, seen)\n"
        "sys.argv = ['inf2-pipeline', *args, sys.argv[2] + '/b']\n"
        "main()\n"
        "assert seen[1:] == [(True, True)], seen\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "b" / "m" / "v1" / "manifest.json").is_file()


def test_the_cli_pull_parses_as_the_whole_app_does(tmp_path):
    """``main`` builds the pull's parser alone: its help and its usage errors are the whole
    app's."""
    code = "import sys\nfrom pipeline.cli import main\nsys.argv[0] = 'inf2-pipeline'\nmain()\n"
    for args in (["pull", "--help"], ["pull", "m", "--dest", "d", "--concurrency", "0"]):
        out = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "100"},
            cwd=Path(__file__).parent.parent,
        )
        r = CliRunner().invoke(app, args, prog_name="inf2-pipeline", env={"COLUMNS": "100"})
        assert (out.returncode, out.stdout, out.stderr) == (r.exit_code, r.stdout, r.stderr)


@pytest.mark.parametrize(
    ("paths", "why"),
    [
        (["x", ".x.incomplete"], "ends in '.incomplete'"),
        (["a", "a/b"], "also the folder of another file"),
        (["ctl\x01.bin"], "control character"),
    ],
)
def test_manifest_paths_that_collide_on_disk_are_refused(tmp_path, paths, why):
    """A path that is another file's temporary name, or another file's folder, would
    install the wrong bytes or fail as an I/O error (exit 1, retried forever by Kubernetes)."""
    from pipeline.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    make_release(store, tmp_path, extra_files={p: os.urandom(100 + i) for i, p in
                                               enumerate(paths)})  # fmt: skip
    dest = tmp_path / "dest"
    with pytest.raises(InputError, match=re.escape(why)):
        pull_release(store, "m", dest, version="v1")
    assert not (dest / "m" / "v1").exists()
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(dest),
                            "--store", store.url])  # fmt: skip
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output


def test_a_nul_in_a_manifest_path_is_bad_input_not_a_traceback(store, tmp_path):
    make_release(store, tmp_path)
    data = json.loads(store.get_bytes(release_key("m", "v1")))
    data["buckets"]["b1_s32"]["files"][0]["path"] = "nul\x00.bin"
    store.put_bytes(release_key("m", "v1"), json.dumps(data).encode())
    r = runner.invoke(app, ["pull", "m", "--version", "v1", "--dest", str(tmp_path / "d"),
                            "--store", store.url])  # fmt: skip
    assert r.exit_code == 2 and "control character" in r.stderr, r.output


def test_a_top_level_file_named_like_the_buckets_folder_is_refused(tmp_path):
    from pipeline.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    make_release(store, tmp_path, extra_files={"buckets": b"x"})
    with pytest.raises(InputError, match="also the folder of another file"):
        pull_release(store, "m", tmp_path / "dest", version="v1")


def test_reinstalling_a_version_swaps_it_whole(tmp_path, monkeypatch):
    """The same version name from another store: the earlier install is set aside, not
    deleted before the new one is in place; a pull killed between the two renames leaves it
    recoverable, and the next pull finishes the swap."""
    import pipeline.install.pull as pull_mod
    from pipeline.store.local import LocalStore

    first, second = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    make_release(first, tmp_path)
    make_release(second, tmp_path)
    dest = tmp_path / "dest"
    pull_release(first, "m", dest, version="v1")
    rename = os.rename

    def killed_after_setting_aside(src, dst):
        rename(src, dst)
        if Path(dst).name.startswith(".replaced-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(pull_mod.os, "rename", killed_after_setting_aside)
    with pytest.raises(KeyboardInterrupt):
        pull_release(second, "m", dest, version="v1")
    assert (dest / "m" / ".replaced-v1" / "manifest.json").is_file()  # nothing lost
    monkeypatch.setattr(pull_mod.os, "rename", rename)
    r = pull_release(second, "m", dest, version="v1")
    assert not r.already_installed and not (dest / "m" / ".replaced-v1").exists()
    assert (dest / "m" / "v1" / "manifest.json").read_bytes() == second.get_bytes(
        release_key("m", "v1")
    )
    assert os.readlink(dest / "m" / "current") == "v1"
