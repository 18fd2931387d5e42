"""Shared fixtures: the tiny checkpoint (made once per session) and config writers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

# A neuron release made with the stand-in exporter, and the stand-in optimum.neuron.
from tests.neuron_fakes import neuron_release, standin  # noqa: F401
from tests.shared_builds import built_once
from tests.tls_cert import self_signed_cert

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama (8 query / 2 KV heads), written once per test run."""
    from pipeline.tiny_model import write_tiny_model

    root = built_once(tmp_path_factory, "ckpt", lambda d: write_tiny_model(d / "tiny-llama"))
    return root / "tiny-llama"


@pytest.fixture
def write_config(tmp_path: Path, tiny_checkpoint: Path):
    """Write a release config (YAML text, ``{ckpt}`` replaced) and return its path."""

    def write(text: str, name: str = "release.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip().replace("{ckpt}", str(tiny_checkpoint)))
        return path

    return write


# --- A real S3 endpoint: moto's standalone server (tests/s3_server.py) ----------------------

# Fake, credential-shaped values: tests grep every output for them.
FAKE_AWS_ACCESS_KEY_ID = "AKIAFAKEFAKEFAKE7777"
FAKE_AWS_SECRET_ACCESS_KEY = "fakeSecretKey/DoNotLeak+0123456789abcdefXYZ"
FAKE_AWS_SESSION_TOKEN = "FakeSessionTokenDoNotLeak0123456789"


@pytest.fixture(scope="session")
def s3_endpoint():
    """The endpoint URL of moto's server, started once per session on a free loopback port."""
    from tests.s3_server import S3Server

    with S3Server() as server:
        yield server.url


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point boto3 (in this process and in child processes) at the endpoint, with fake
    credentials and no host AWS config. Returns the endpoint URL."""
    for name in (
        "AWS_PROFILE",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ENDPOINT_URL_S3",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_AWS_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_AWS_SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", FAKE_AWS_SESSION_TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Fixed paths (that do not exist): the same environment in every test lets the store
    # reuse its boto3 session.
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/inf2-pipeline-tests/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/inf2-pipeline-tests/creds")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return s3_endpoint


@pytest.fixture
def s3_bucket(s3_env: str) -> str:
    """A fresh, empty bucket on the endpoint."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_store_url(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/artifacts"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same test against a local store and against S3 (moto over HTTP)."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_store_url")


# --- The demo release compiled on cpu, once per session (compile stage) --------------------


def _demo_config(root: Path, checkpoint: Path, backend: str) -> Path:
    """configs/tiny-llama.yaml for ``backend``, its checkpoint and store under ``root``."""
    import yaml

    source = REPO / "configs" / "tiny-llama.yaml"
    data = yaml.safe_load(source.read_text())
    data["model"]["checkpoint"] = str(checkpoint)
    data["target"]["backend"] = backend
    data["buckets"]["grid"] = str((source.parent / data["buckets"]["grid"]).resolve())
    data["store"] = str(root / "store")
    config = root / "tiny-llama.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return config


@pytest.fixture(scope="session")
def compiled_store(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """configs/tiny-llama.yaml (grid buckets/demo.yaml, tp 4: GQA-padded) compiled on cpu
    into a fresh store, once per test run. Returns (release config path, store dir); treat
    both as read-only. Compiled bucket directories are under ``config.parent / "work"``."""

    def build(root: Path) -> None:
        from pipeline.compile.scheduler import compile_release
        from pipeline.plan.config import load_config

        config = _demo_config(root, tiny_checkpoint, "cpu")
        report = compile_release(load_config(config), jobs=2, workdir=root / "work")
        assert not report.failed, [(r.bucket.name, r.error) for r in report.failed]

    root = built_once(tmp_path_factory, "compiled", build)
    return root / "tiny-llama.yaml", root / "store"


@pytest.fixture(scope="session")
def installed(compiled_store, tmp_path_factory):
    """The compiled demo release, published and pulled: (release, DEST/MODEL). Read-only:
    tests that damage a release work on a copy."""
    from pipeline.plan.config import load_config

    config, store_dir = compiled_store
    release = load_config(config)

    def build(dest: Path) -> None:
        from pipeline.compile.release import publish_release
        from pipeline.install.pull import pull_release
        from pipeline.store import open_store

        version = publish_release(release, version="v-installed").version
        pull_release(open_store(str(store_dir)), release.name, dest, version=version)

    return release, built_once(tmp_path_factory, "models", build) / release.name


@pytest.fixture(scope="session")
def compiled_cuda_release(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """The demo release compiled for cuda, published and pulled, once per session: the
    installed release directory. GPU machines only (skips where torch sees no GPU)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")

    def build(root: Path) -> None:
        from pipeline.compile.release import publish_release
        from pipeline.compile.scheduler import compile_release
        from pipeline.install.pull import pull_release
        from pipeline.plan.config import load_config
        from pipeline.store import open_store

        release = load_config(_demo_config(root, tiny_checkpoint, "cuda"))
        report = compile_release(release, jobs=2, workdir=root / "work")
        assert not report.failed, [(r.bucket.name, r.error) for r in report.failed]
        version = publish_release(release, version="v-cuda").version
        store = open_store(str(root / "store"))
        pull_release(store, release.name, root / "models", version=version)

    return built_once(tmp_path_factory, "compiled-cuda", build) / "models" / "tiny-llama"


@pytest.fixture
def export_only(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The cpu backend exports every graph for real but compiles none: a test of what export
    decides (fallbacks, a graph left out) needs no C++ build, ~10 s a graph on 2 cores. Each
    package is an empty file; returns their names, in build order."""
    import torch._inductor

    from pipeline.compile.backends import aoti

    built: list[str] = []

    def package(program, package_path: str, inductor_configs=None) -> str:
        assert program.graph.nodes  # an exported program reached the compiler
        Path(package_path).write_bytes(b"")
        built.append(Path(package_path).name)
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", package)
    monkeypatch.setattr(aoti, "check_loads", lambda path: None)
    return built


# --- Load: timing-dependent tests must pass on a 2-core machine kept busy -------------------


@pytest.fixture
def busy_cores():
    """Two spinning processes keeping both cores of a 2-core machine busy for the test."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="session")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by itself, and its key (PEM files)."""
    return self_signed_cert(tmp_path_factory.mktemp("tls"))
