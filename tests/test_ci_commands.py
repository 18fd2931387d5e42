"""Every `inf2-pipeline` command line in ci/ (workflows, Kubernetes manifests, Dockerfiles)
must be accepted by the CLI: the subcommand exists and its options parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.main import get_command

from pipeline.cli import app

REPO = Path(__file__).resolve().parent.parent
CI_FILES = sorted(
    p for p in (REPO / "ci").rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml")
)


def _strings(node, key: str = ""):
    """Every string, and every container exec-form list (under `command:` or `args:`)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, str(k))
    elif isinstance(node, list):
        if key in ("command", "args") and node and all(isinstance(x, str) for x in node):
            yield node
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def command_lines(path: Path) -> list[list[str]]:
    """argv lists after `inf2-pipeline`, from shell strings and container command/args."""
    found = []
    for doc in yaml.safe_load_all(path.read_text()):
        for item in _strings(doc):
            if isinstance(
                item, list
            ):  # exec form: ["pull", ...] under an image whose ENTRYPOINT is the CLI
                if item and item[0] == "inf2-pipeline":
                    found.append(item[1:])
                elif item and item[0] in _top_level_commands():
                    found.append(item)
                continue
            text = item.replace("\\\n", " ")
            for m in re.finditer(r"(?<![\w./-])inf2-pipeline[ \t]((?:[^\n;&|`)<>])*)", text):
                argv = shlex.split(_substitute(m.group(1)))
                if argv:
                    found.append(argv)
    return found


def _top_level_commands() -> set[str]:
    return set(get_command(app).commands)


def _substitute(text: str) -> str:
    # Shell and workflow variables ($X, ${X}, ${{ x }}) become placeholders.
    return re.sub(r"\$\{\{[^}]*\}\}|\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*", "1", text)


def assert_accepted(argv: list[str]) -> None:
    cmd = get_command(app)
    ctx = cmd.make_context("inf2-pipeline", [], resilient_parsing=True)
    args = list(argv)
    while hasattr(cmd, "commands"):
        assert args, f"missing subcommand in {argv}"
        name = args.pop(0)
        assert name in cmd.commands, f"unknown command '{name}' in {argv}"
        cmd = cmd.commands[name]
    cmd.make_context(name, args, parent=ctx)  # raises on unknown options


@pytest.mark.parametrize("path", CI_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_in_ci_files_parses(path):
    lines = command_lines(path)
    for argv in lines:
        assert_accepted(argv)


def test_the_checker_rejects_bad_lines():
    with pytest.raises(AssertionError, match="unknown command"):
        assert_accepted(["pul", "m"])
    with pytest.raises(Exception, match="No such option"):
        assert_accepted(["pull", "m", "--dest", "/d", "--chanel", "prod"])


def test_serving_pod_pulls_with_the_cli():
    lines = command_lines(REPO / "ci/k8s/serving-pod.yaml")
    assert [
        "pull",
        "llama-3-8b",
        "--channel",
        "prod",
        "--dest",
        "/models",
        "--store",
        "s3://my-model-artifacts/inf2",
        "--trust",
        "/etc/inf2-pipeline/trust",
    ] in lines


def test_pods_verify_signatures_with_the_pinned_key_and_ci_signs():
    """Both containers trust the ConfigMap's key folder; the release job signs with KMS."""
    docs = list(yaml.safe_load_all((REPO / "ci/k8s/serving-pod.yaml").read_text()))
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert any(name.endswith(".pem") for name in config["data"])
    pod = next(d for d in docs if d["kind"] == "Pod")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]:
        trust = c["args"][c["args"].index("--trust") + 1]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == trust)
        assert volumes[mount["name"]]["configMap"]["name"] == config["metadata"]["name"]
    workflow = (REPO / "ci/github/release.yml").read_text()
    assert '--sign "$SIGNING_KEY"' in workflow and "SIGNING_KEY: kms://" in workflow


def test_serving_pod_serves_with_the_cli_and_probes():
    lines = command_lines(REPO / "ci/k8s/serving-pod.yaml")
    assert any(argv[:2] == ["serve", "/models/llama-3-8b"] for argv in lines)
    docs = list(yaml.safe_load_all((REPO / "ci/k8s/serving-pod.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Pod")
    (server,) = pod["spec"]["containers"]
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    # it keeps answering while the endpoints drop it, within the grace period
    sleep = server["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) < pod["spec"]["terminationGracePeriodSeconds"]
    # the API key comes from a secret, under the variable serve reads
    (key,) = [e for e in server["env"] if e["name"] == "INF2_SERVE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["name"] == "inf2-serve-api-key"
