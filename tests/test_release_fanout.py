"""Issue 9's fan-out: 4 compile shards as 4 separate processes against one S3 endpoint, then
publish from the cache alone. The fake backend keeps it to seconds; the processes, the S3
server (moto, over HTTP) and the store protocol are real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.compile.shards import split
from pipeline.contracts.store_layout import release_key
from pipeline.plan.config import load_config
from pipeline.store import open_store
from tests.config_factory import release_yaml

REPO = Path(__file__).resolve().parent.parent
DRIVER = (
    "import sys; from tests import compile_fakes; compile_fakes.install(); "
    "from pipeline.cli import main; sys.argv[0] = 'inf2-pipeline'; main()"
)


def config_yaml(ckpt: Path, store: str) -> str:
    return release_yaml(
        name="fanout",
        checkpoint=ckpt,
        instance_type=None,
        tp_degree=None,
        sequence_lengths=[32, 64, 128, 256],
        timeout_s=60,
        store=store,
    )


pytestmark = pytest.mark.s3


def cli(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err


def compile_shards(cfg: Path, tmp_path: Path, indices: list[int], count: int = 4) -> None:
    """Each shard in its own process, all at once, as an Indexed Job's pods would run."""
    procs = [
        cli(
            "compile",
            str(cfg),
            "--backend",
            "fake",
            "--shard",
            f"{i}/{count}",
            "--workdir",
            str(tmp_path / f"w{i}"),
            cwd=tmp_path,
        )
        for i in indices
    ]
    for proc in procs:
        code, _, err = finish(proc)
        assert code == 0, err


def bucket_digests(store_url: str, model: str, version: str) -> dict[str, list[tuple]]:
    manifest = json.loads(open_store(store_url).get_bytes(release_key(model, version)))
    return {
        name: sorted((f["path"], f["sha256"], f["size"]) for f in b["files"])
        for name, b in manifest["buckets"].items()
    }


def test_four_shard_processes_publish_the_same_release_as_one(tmp_path, tiny_checkpoint, s3_bucket):
    fanned, single = f"s3://{s3_bucket}/fanned", f"s3://{s3_bucket}/single"
    cfg_fan = tmp_path / "fan.yaml"
    cfg_fan.write_text(config_yaml(tiny_checkpoint, fanned))
    cfg_one = tmp_path / "one.yaml"
    cfg_one.write_text(config_yaml(tiny_checkpoint, single))

    compile_shards(cfg_fan, tmp_path, [0, 1, 2, 3])
    code, out, err = finish(
        cli(
            "publish",
            str(cfg_fan),
            "--backend",
            "fake",
            "--version",
            "v1",
            "--shard-count",
            "4",
            "--json",
            cwd=tmp_path,
        )
    )
    assert code == 0, err
    assert json.loads(out)["version"] == "v1"

    code, _, err = finish(
        cli(
            "compile",
            str(cfg_one),
            "--backend",
            "fake",
            "--workdir",
            str(tmp_path / "one"),
            cwd=tmp_path,
        )
    )
    assert code == 0, err
    code, _, err = finish(
        cli("publish", str(cfg_one), "--backend", "fake", "--version", "v1", cwd=tmp_path)
    )
    assert code == 0, err

    fan, one = bucket_digests(fanned, "fanout", "v1"), bucket_digests(single, "fanout", "v1")
    assert len(fan) == 8 and fan == one


def test_publish_names_the_missing_buckets_and_their_shard(tmp_path, tiny_checkpoint, s3_bucket):
    url = f"s3://{s3_bucket}/skipped"
    cfg = tmp_path / "fan.yaml"
    cfg.write_text(config_yaml(tiny_checkpoint, url))
    compile_shards(cfg, tmp_path, [0, 1, 3])  # shard 2 never ran
    code, _, err = finish(
        cli("publish", str(cfg), "--backend", "fake", "--shard-count", "4", cwd=tmp_path)
    )
    assert code == 2
    line = err.strip().splitlines()[-1]
    missing = [b.name for b in split(load_config(cfg).buckets, 4)[2]]
    assert missing and all(f"{name} (shard 2/4)" in line for name in missing), line
    assert "--shard I/4' for I in 2" in line
    assert not list(open_store(url).list("models/"))  # nothing published
