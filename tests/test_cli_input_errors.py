"""Bad input in the environment, paths and names: one line on stderr and exit 2, found before
any work is done; the outside world's failures (a full disk) stay exit 1. Through the CLI."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import InputError, PipelineError
from tests.cli_helpers import one_line
from tests.release_factory import make_release, point_channel

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials, no host AWS config, and an endpoint where nothing listens: a test
    that reaches the network fails (slowly) instead of passing."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKE7777")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fakeSecretKey")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/inf2-pipeline-tests/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/inf2-pipeline-tests/creds")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# --- 1. the AWS environment and the bucket name ---------------------------------------------


@pytest.mark.parametrize(
    "url", ["not a url", "http://", "ftp://host", "http://host:port", "h:9", "http://my_minio:9000"]
)
@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_malformed_endpoint_url_names_the_variable(aws_env, monkeypatch, var, url):
    monkeypatch.setenv(var, url)
    one_line(
        invoke("list", "--store", "s3://my-bucket/x"),
        2,
        f"{var} '{url}'",
        "not a valid endpoint URL",
        "http(s)://HOST[:PORT]",
    )


def test_endpoint_url_credentials_are_not_echoed(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://user:hunter2@[::1")
    err = one_line(invoke("list", "--store", "s3://my-bucket/x"), 2, "AWS_ENDPOINT_URL")
    assert "hunter2" not in err


def test_invalid_region_names_the_variable(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us east 1")
    one_line(
        invoke("list", "--store", "s3://my-bucket/x"),
        2,
        "AWS_DEFAULT_REGION 'us east 1'",
        "not a valid AWS region name",
        "us-east-1",
    )


def test_unknown_profile_names_the_variable(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    one_line(invoke("list", "--store", "s3://my-bucket/x"), 2, "AWS_PROFILE 'no-such-profile'")


@pytest.mark.parametrize(
    ("bucket", "why"),
    [
        ("a b", "contains ' '"),
        ("x:y", "contains ':'"),
        ("b\u00e4d", "contains 'ä'"),
        ("a" * 256, "is 256 characters long"),
    ],
)
def test_invalid_bucket_name_is_bad_input_before_any_request(aws_env, bucket, why):
    one_line(
        invoke("list", "--store", f"s3://{bucket}/x"),
        2,
        f"bucket name '{bucket}' {why}",
        "1 to 255 letters",
    )


@pytest.mark.parametrize(
    "bucket",
    [
        "bkt",
        "my-model-artifacts",
        "a.b-c.d",
        "ap-123456789012-s3alias",
        "b--x-s3",
        "Legacy_Bucket",  # us-east-1 buckets made before 2018, and S3-compatible stores
        "ab",
        "arn:aws:s3:us-west-2:123456789012:accesspoint:my-ap",
    ],
)
def test_valid_bucket_names_parse(bucket):
    from pipeline.store.s3_client import parse_s3_url

    assert parse_s3_url(f"s3://{bucket}/p")[:2] == (bucket, "p/")


def test_botocore_parameter_validation_is_bad_input():
    from botocore.exceptions import ParamValidationError

    from pipeline.store.s3_errors import translate_error

    e = translate_error(ParamValidationError(report='Invalid bucket name "a b": x\ny'), "s3://k")
    assert isinstance(e, InputError) and e.exit_code == 2
    assert "\n" not in e.one_line() and 'Invalid bucket name "a b"' in e.one_line()


# --- 2. unwritable destinations -----------------------------------------------------------


@pytest.fixture
def local_release(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    from pipeline.store import open_store

    make_release(open_store(str(store)), tmp_path, model="m", version="v1")
    return store


def test_pull_into_a_path_under_a_file_names_dest_and_the_file(local_release, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for dest in (blocker, blocker / "sub"):
        err = one_line(
            invoke("pull", "m", "--version", "v1", "--store", local_release, "--dest", dest),
            2,
            f"--dest {dest}",
            f"not a directory: {blocker} is a file",
            f"remove {blocker}",
        )
        assert ".staging" not in err and ".incomplete" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_pull_into_a_read_only_directory_is_bad_input(local_release, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    one_line(
        invoke("pull", "m", "--version", "v1", "--store", local_release, "--dest", ro / "x"),
        2,
        f"--dest {ro / 'x'}",
        f"permission denied: cannot write in {ro}",
    )


def test_pull_permission_denied_names_dest_not_the_staging_directory(
    local_release, tmp_path, monkeypatch
):
    # As root nothing is read-only: the kernel's answer, where a user would get it.
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        if self.name.startswith(".staging-"):
            real_mkdir(self.parent, parents=True, exist_ok=True)  # as mkdir(parents=True)
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    dest = tmp_path / "models"
    err = one_line(
        invoke("pull", "m", "--version", "v1", "--store", local_release, "--dest", dest),
        2,
        f"--dest {dest}: permission denied: cannot write in {dest / 'm'}",
    )
    assert ".staging" not in err


def test_pull_onto_a_full_disk_is_exit_1_naming_dest(local_release, tmp_path, monkeypatch):
    def fallocate(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    dest = tmp_path / "models"
    err = one_line(
        invoke("pull", "m", "--version", "v1", "--store", local_release, "--dest", dest),
        1,
        f"--dest {dest}: ",
        "No space left on device",
    )
    assert ".staging" not in err and ".incomplete" not in err


def test_output_over_a_directory_names_the_output_not_a_temporary_file(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("ContextTokens\n5\n9\n")
    out = tmp_path / "fit.yaml"
    out.mkdir()
    err = one_line(
        invoke(
            "buckets", "fit", trace, "--column", "ContextTokens", "--max-buckets", 2, "--out", out
        ),
        2,
        f"error: {out}: is a directory",
    )
    assert ".incomplete" not in err


def test_output_in_an_unwritable_directory_names_the_output(tmp_path, monkeypatch):
    import tempfile

    def mkstemp(prefix="", suffix="", dir=None):  # what the kernel says to a non-root user
        raise PermissionError(errno.EACCES, "Permission denied", f"{dir}/{prefix}x{suffix}")

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    trace = tmp_path / "t.csv"
    trace.write_text("ContextTokens\n5\n9\n")
    out = tmp_path / "fit.yaml"
    err = one_line(
        invoke(
            "buckets", "fit", trace, "--column", "ContextTokens", "--max-buckets", 2, "--out", out
        ),
        2,
        f"error: {out}: permission denied: cannot write in {tmp_path}",
        f"make {tmp_path} writable",
    )
    assert ".incomplete" not in err


def test_a_full_disk_is_the_outside_world_and_names_the_output(tmp_path, monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    trace = tmp_path / "t.csv"
    trace.write_text("ContextTokens\n5\n9\n")
    out = tmp_path / "fit.yaml"
    one_line(
        invoke(
            "buckets", "fit", trace, "--column", "ContextTokens", "--max-buckets", 2, "--out", out
        ),
        1,
        f"error: {out}: no space left on device (free some space",
    )
    assert not out.exists() and not list(tmp_path.glob(".*.incomplete"))


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (OSError(errno.ENOSPC, "No space left on device", "/x"), 1),
        (OSError(errno.EIO, "Input/output error", "/x"), 1),
        (OSError(errno.EACCES, "Permission denied"), 1),  # no path: not the user's to fix
        (OSError(errno.EACCES, "Permission denied", "/x"), 2),
        (OSError(errno.EROFS, "Read-only file system", "/x"), 2),
        (OSError(errno.ENOTDIR, "Not a directory", "/x"), 2),
    ],
)
def test_path_error_exit_codes(err, code):
    from pipeline._files import path_error

    e = path_error(err)
    assert isinstance(e, PipelineError) and e.exit_code == code, e


def test_path_error_hides_our_temporary_names(tmp_path):
    from pipeline._files import path_error

    e = path_error(OSError(errno.EROFS, "x", str(tmp_path / "m" / ".staging-v1" / ".f.incomplete")))
    assert e.what == str(tmp_path / "m")


def test_atomic_create_still_refuses_an_existing_file_by_its_name(tmp_path):
    from pipeline._files import atomic_create

    atomic_create(tmp_path / "a", b"1")
    with pytest.raises(FileExistsError) as e:
        atomic_create(tmp_path / "a", b"2")
    assert e.value.filename == str(tmp_path / "a")


# --- 3. list ------------------------------------------------------------------------------


def test_list_an_unknown_model_is_bad_input(local_release):
    one_line(
        invoke("list", "nosuch", "--store", local_release),
        2,
        f"model 'nosuch': no releases of nosuch in {local_release}",
        f"'inf2-pipeline list --store {local_release}' lists the models",
    )
    one_line(invoke("list", "mm", "--store", local_release, "--json"), 2, "did you mean m?")


def test_list_a_model_with_only_a_channel_is_an_empty_list(local_release):
    from pipeline.store import open_store

    point_channel(open_store(str(local_release)), "gone", "prod", "v0")
    r = invoke("list", "gone", "--store", local_release)
    assert r.exit_code == 0 and "no releases of gone" in r.stdout, r.output


def test_list_an_empty_store_is_an_empty_list(tmp_path):
    r = invoke("list", "--store", tmp_path / "empty", "--json")
    assert r.exit_code == 0 and r.stdout.strip() == "[]", r.output


@pytest.mark.parametrize("model", [[], ["m"]])
def test_a_store_that_is_a_file_is_bad_input(tmp_path, model):
    f = tmp_path / "afile"
    f.write_text("")
    for store in (f, f / "sub"):
        one_line(
            invoke("list", *model, "--store", store),
            2,
            f"store {store}: {f} is a file, not a directory",
        )


# --- 4. an unavailable backend: publish and release say what compile says -----------------


@pytest.fixture
def no_neuron_sdk(tmp_path, monkeypatch):
    from pipeline.compile import backends
    from pipeline.compile.backends.neuron import NeuronBackend

    # PATH without the Neuron SDK's tools (the rest of PATH stays: cpu keys need a compiler)
    path = os.environ.get("PATH", "").split(os.pathsep)
    tools = ("neuronx-cc", "optimum-cli")
    kept = [d for d in path if not any(os.path.exists(os.path.join(d, t)) for t in tools)]
    monkeypatch.setenv("PATH", os.pathsep.join(kept))
    monkeypatch.setitem(backends._instances, "neuron", NeuronBackend())  # no cached versions


def test_publish_with_a_missing_toolchain_says_what_compile_says(tmp_path, no_neuron_sdk):
    from tests.store_helpers import write_release_config

    config = write_release_config(tmp_path, str(tmp_path / "store"))
    compiled = one_line(invoke("compile", config, "--backend", "neuron"), 2)
    assert "backend 'neuron'" in compiled and "install the Neuron SDK" in compiled
    assert one_line(invoke("publish", config, "--backend", "neuron"), 2) == compiled
    assert one_line(invoke("release", config, "--backend", "neuron"), 2) == compiled


def test_publish_auto_skips_a_missing_toolchain(tmp_path, write_config, no_neuron_sdk):
    config = write_config(
        f"""
        model: {{name: tiny, checkpoint: "{{ckpt}}", dtype: float32}}
        target: {{backend: auto, instance_type: inf2.xlarge, tp_degree: 2}}
        buckets: {{batch_sizes: [1], sequence_lengths: [32]}}
        store: {tmp_path / "store"}
        """
    )
    one_line(invoke("publish", config), 2, "no compiled artifacts for 1 of 1 buckets")


# --- 5. the release version is checked before compiling -----------------------------------


@pytest.mark.parametrize("version", ["../bad", "a/b", "-v1", "", "x" * 129])
def test_release_rejects_a_bad_version_before_compiling(tmp_path, monkeypatch, version):
    from pipeline.cli import compile as cli_compile
    from tests.store_helpers import write_release_config

    def compile_(*a, **kw):
        raise AssertionError("compiled before checking --version")

    monkeypatch.setattr(cli_compile, "_compile", compile_)
    config = write_release_config(tmp_path, str(tmp_path / "store"))
    one_line(invoke("release", config, "--version", version), 2, "not a valid name")


def test_publish_rejects_a_bad_version_before_reading_the_cache(tmp_path, monkeypatch):
    from pipeline.compile import release as rel
    from pipeline.plan.config import load_config
    from tests.store_helpers import write_release_config

    def find_entries(*a, **kw):
        raise AssertionError("read the cache before checking --version")

    monkeypatch.setattr(rel, "find_entries", find_entries)
    config = write_release_config(tmp_path, str(tmp_path / "store"))
    with pytest.raises(InputError, match=r"version '\.\./bad': not a valid name"):
        rel.publish_release(load_config(config), version="../bad")
    one_line(invoke("publish", config, "--version", "../bad"), 2, "version '../bad'")


# --- A damaged checkpoint: one line naming the weights file ------------------------------


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_gqa_pad_of_a_damaged_checkpoint_names_the_weights_file(tiny_checkpoint, tmp_path, damage):
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, src)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 8 + data[8:] if damage == "header" else data[: len(data) // 2])
    out = tmp_path / "padded"
    r = CliRunner().invoke(app, ["gqa", "pad", str(src), "--out", str(out), "--tp", "4"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: {weights}: not a readable weights file (")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_read_checkpoint_of_a_damaged_bin_names_the_file(tmp_path):
    from pipeline.errors import CheckpointError
    from pipeline.plan.checkpoint import read_checkpoint

    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: not a readable weights file"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (MemoryError(), None),
        (OSError(5, "Input/output error"), None),
        (RuntimeError("Cannot allocate memory (os error 12)"), 1),
        (RuntimeError("Error while deserializing header: HeaderTooLarge"), 2),
    ],
)
def test_reading_weights_tells_a_damaged_file_from_the_machine(tmp_path, error, code):
    """A parser's complaint is the file's fault (exit 2); memory and I/O are the machine's."""
    from pipeline.plan.checkpoint import reading_weights

    f = tmp_path / "model.safetensors"
    with pytest.raises(Exception) as e, reading_weights(f):
        raise error
    if code is None:
        assert e.value is error
    else:
        assert isinstance(e.value, PipelineError) and e.value.exit_code == code
        assert e.value.what == str(f)


@pytest.mark.parametrize(
    "flag, value, why",
    [
        *[("--prefill-merge", v, "neither auto nor a count") for v in ("-1", "many", "6.4")],
        *[
            ("--launch-lead", v, "not auto, off or milliseconds from 0 to 50")
            for v in ("-1", "soon", "51")
        ],
        *[
            ("--prefill-stall", v, "not auto, off or milliseconds from 0 to 1000")
            for v in ("-0.1", "long", "1001")
        ],
        ("--admit-order", "lifo", "unknown"),
        *[("--http-workers", v, "is not a count of processes") for v in ("0", "-1", "many")],
    ],
)
def test_serve_policy_values_are_checked_before_the_release(tmp_path, flag, value, why):
    """--prefill-merge is auto or a count of positions, --launch-lead and --prefill-stall
    auto, off or ms."""
    one_line(invoke("serve", tmp_path, flag, value), 2, f"{flag} {value}", why)


def test_serve_launch_lead_and_prefill_stall_take_milliseconds():
    from pipeline.cli.serve import _milliseconds

    for flag in ("--launch-lead", "--prefill-stall"):
        assert _milliseconds(flag, "AUTO", 50, "1") == "auto"
        assert _milliseconds(flag, "off", 50, "1") == "off"
        assert _milliseconds(flag, "0.5", 50, "1") == pytest.approx(0.5e-3)
