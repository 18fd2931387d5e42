"""Every manifest defect is one line naming the release and the field, exit 2, on every path
that reads one: ``pull`` (local store and S3), the channel pointer ``pull --channel`` reads,
an installed release (``BucketedModel.load``, ``parity``). Network failures stay exit 1.

Exit 2 matters: the EKS init container's ``pull`` exiting 1 means "retriable", and Kubernetes
would restart it forever on a manifest no retry can fix.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.contracts.store_layout import channel_key, release_key
from pipeline.errors import ManifestError, RuntimeMismatchError
from pipeline.store import open_store
from pipeline.store.manifest import MANIFEST_SCHEMA
from tests.release_factory import make_release, point_channel

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _set(path: str, value) -> Callable[[dict], dict]:
    def edit(d: dict) -> dict:
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[last] = value
        return d

    return edit


def _drop(field: str) -> Callable[[dict], dict]:
    return lambda d: {k: v for k, v in d.items() if k != field}


# name -> (edit of the good manifest as a dict, or bytes replacing it; what stderr must name)
DEFECTS: dict[str, tuple[Callable[[dict], dict] | Callable[[bytes], bytes], str]] = {
    "truncated JSON": (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
    "empty file": (lambda raw: b"", "not valid JSON"),
    "not an object": (lambda raw: b"[1, 2]", "not a JSON object"),
    "missing field": (_drop("backend"), "field 'backend': missing"),
    "unknown field": (_set("surprise", 1), "field 'surprise': unknown field"),
    "wrong type": (_set("buckets", []), "field 'buckets': Input should be a valid dictionary"),
    "wrong nested type": (
        _set("buckets.b1_s32.files.0.size", "big"),
        "field 'buckets.b1_s32.files.0.size'",
    ),
    "null field": (_set("model", None), "field 'model'"),
    "newer schema": (
        _set("schema_version", MANIFEST_SCHEMA + 1),
        f"manifest schema {MANIFEST_SCHEMA + 1} is newer",
    ),
    "schema as a string": (_set("schema_version", "2"), "field 'schema_version'"),
    "newline in a key": (_set("x\ny", 1), "field 'x\\ny': unknown field"),
}


def _defective(good: bytes, defect: str) -> bytes:
    edit, _ = DEFECTS[defect]
    if defect in ("truncated JSON", "empty file", "not an object"):
        return edit(good)
    return json.dumps(edit(json.loads(good))).encode()


def _assert_one_line(stderr: str, *names: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    line = lines[0]
    assert line.startswith("error: ")
    for name in names:
        assert name in line, (name, line)
    assert "pydantic" not in line and "https://" not in line and "Traceback" not in stderr
    return line


@pytest.fixture
def store(store_url):
    return open_store(store_url)


@pytest.fixture
def installed_v1(store, tmp_path):
    """v1 published and pulled (current -> v1); the store also has v2's blobs."""
    make_release(store, tmp_path, version="v1")
    make_release(store, tmp_path, version="v2")
    dest = tmp_path / "dest"
    r = runner.invoke(
        app, ["pull", "m", "--version", "v1", "--dest", str(dest), "--store", store.url]
    )
    assert r.exit_code == 0, r.output
    return dest


def _assert_untouched(dest: Path, version: str = "v2") -> None:
    model_dir = dest / "m"
    assert os.readlink(model_dir / "current") == "v1"
    assert (model_dir / "v1" / "manifest.json").is_file()
    assert not (model_dir / version).exists()
    assert not list(model_dir.glob(".staging-*"))


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_pull_of_a_defective_manifest_is_one_line_exit_2(store, installed_v1, defect):
    key = release_key("m", "v2")
    store.put_bytes(key, _defective(store.get_bytes(key), defect))
    r = runner.invoke(
        app, ["pull", "m", "--version", "v2", "--dest", str(installed_v1), "--store", store.url]
    )
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    line = _assert_one_line(r.stderr, "release m v2", DEFECTS[defect][1])
    if defect == "newer schema":
        assert line.endswith("(upgrade inf2-pipeline)")
    _assert_untouched(installed_v1)


def test_pull_by_channel_of_a_defective_manifest_is_one_line_exit_2(store, installed_v1):
    key = release_key("m", "v2")
    store.put_bytes(key, _defective(store.get_bytes(key), "missing field"))
    point_channel(store, "m", "prod", "v2")
    r = runner.invoke(
        app, ["pull", "m", "--channel", "prod", "--dest", str(installed_v1), "--store", store.url]
    )
    assert r.exit_code == 2, r.output
    _assert_one_line(r.stderr, "release m v2", "field 'backend': missing")
    _assert_untouched(installed_v1)


@pytest.mark.parametrize(
    ("pointer", "names"),
    [
        (b'{"version": ', "not valid JSON"),
        (b'"v2"', "not a JSON object"),
        (b'{"model": "m"}', "field 'version': missing"),
        (b'{"version": ["v2"]}', "field 'version'"),
    ],
)
def test_pull_by_a_defective_channel_pointer_is_one_line_exit_2(
    store, installed_v1, pointer, names
):
    store.put_bytes(channel_key("m", "prod"), pointer)
    r = runner.invoke(
        app, ["pull", "m", "--channel", "prod", "--dest", str(installed_v1), "--store", store.url]
    )
    assert r.exit_code == 2, r.output
    _assert_one_line(r.stderr, "channel 'prod' of model 'm'", names)
    _assert_untouched(installed_v1)


@pytest.mark.parametrize("defect", ["truncated JSON", "missing field", "newer schema"])
def test_pull_process_prints_one_line_and_exits_2(store, installed_v1, defect):
    """The real command in its own process: stderr is exactly what a pod's log would show."""
    key = release_key("m", "v2")
    store.put_bytes(key, _defective(store.get_bytes(key), defect))
    cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "pull", "m"]
    cmd += ["--version", "v2", "--dest", str(installed_v1), "--store", store.url]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    _assert_one_line(p.stderr, "release m v2", DEFECTS[defect][1])
    assert p.stdout == ""
    _assert_untouched(installed_v1)


def test_unreachable_s3_stays_exit_1(tmp_path, s3_env, monkeypatch):
    """A network failure is retriable: exit 1 (one line too)."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "pull", "m"]
    cmd += ["--version", "v1", "--dest", str(tmp_path / "dest"), "--store", "s3://nowhere/x"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    _assert_one_line(p.stderr, "cannot reach S3")
    assert not (tmp_path / "dest").exists()


# -- an installed release: BucketedModel.load and parity ------------------------------------


@pytest.fixture
def installed_dir(tmp_path):
    """A synthetic release pulled from a local store: DEST/m (current -> v1)."""
    store = open_store(str(tmp_path / "store"))
    make_release(store, tmp_path)
    dest = tmp_path / "dest"
    r = runner.invoke(
        app, ["pull", "m", "--version", "v1", "--dest", str(dest), "--store", store.url]
    )
    assert r.exit_code == 0, r.output
    return dest / "m"


def _damage(model_dir: Path, defect: str) -> Path:
    path = model_dir / "v1" / "manifest.json"
    path.write_bytes(_defective(path.read_bytes(), defect))
    return path


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_bucketed_model_load_of_a_defective_manifest_is_one_line(installed_dir, defect):
    from pipeline.runtime import BucketedModel

    path = _damage(installed_dir, defect)
    expected = RuntimeMismatchError if defect == "newer schema" else ManifestError
    with pytest.raises(expected) as e:
        BucketedModel.load(installed_dir)
    assert e.value.exit_code == 2
    message = str(e.value)
    assert "\n" not in message and "pydantic" not in message and "https://" not in message
    assert str(path) in message and DEFECTS[defect][1] in message


@pytest.mark.parametrize("defect", ["truncated JSON", "missing field", "wrong nested type"])
def test_parity_of_a_defective_manifest_is_one_line_exit_2(installed_dir, defect):
    pytest.importorskip("torch")
    path = _damage(installed_dir, defect)
    r = runner.invoke(app, ["parity", str(installed_dir)])
    assert r.exit_code == 2, r.output
    _assert_one_line(r.stderr, str(path), DEFECTS[defect][1])


@pytest.mark.parametrize("defect", ["missing field", "newer schema"])
def test_run_of_a_defective_manifest_is_one_line_exit_2(installed_dir, defect):
    path = _damage(installed_dir, defect)
    r = runner.invoke(app, ["run", str(installed_dir), "--prompt-ids", "1,2,3"])
    assert r.exit_code == 2, r.output
    _assert_one_line(r.stderr, str(path), DEFECTS[defect][1])


def test_the_cli_error_printer_never_prints_more_than_one_line():
    """Whatever a file put into an error (a key, a path with a newline), one line comes out."""
    from pipeline.cli._common import new_app
    from pipeline.errors import InputError

    app_ = new_app("test")

    @app_.command()
    def boom() -> None:
        raise InputError("release m v1 (a\nb.json)", "field 'x\r\ny': missing\n", "fix\nit")

    @app_.command()
    def other() -> None:  # a second command, so Typer keeps the command name
        pass

    r = runner.invoke(app_, ["boom"])
    assert r.exit_code == 2
    assert r.stderr == "error: release m v1 (a\\nb.json): field 'x\\r\\ny': missing\\n (fix\\nit)\n"
