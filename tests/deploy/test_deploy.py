"""The recipes in deploy/ name only commands and options the CLI has, and the Slurm script parses.

A renamed option would otherwise break a recipe silently: nothing here can run systemd, Slurm or
Kubernetes (docs/observability.md says what was checked with which tool).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import click
import pytest
from util import REPO

from elasticd.cli import main

DEPLOY = REPO / "deploy"
RECIPES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".service", ".sbatch", ".yaml"))


def _invocations(text: str) -> list[tuple[str, list[str]]]:
    """(command, its --options) of every `elasticd CMD ...` in a recipe, continuation lines joined; in
    Kubernetes' list form too (`["elasticd", "start", "--state-dir", ...]`)."""
    text = re.sub(r"\\\n\s*(#\s*)?", " ", text)
    text = re.sub(r'"\s*,\s*"', " ", text)   # ["elasticd", "start", "--x", "y"] -> "elasticd start --x y"
    found = []
    commands = set(main.list_commands(click.Context(main)))
    for m in re.finditer(r"elasticd\s+([a-z]+)\b([^\n;|&]*)", text):
        cmd, rest = m.group(1), m.group(2)
        if cmd in commands or rest.lstrip().startswith("--"):   # not prose ("one elasticd node daemon")
            found.append((cmd, re.findall(r"(--[a-z][a-z-]*)", rest)))
    return found


def test_there_are_recipes_for_systemd_slurm_and_kubernetes():
    names = {p.relative_to(DEPLOY).as_posix() for p in RECIPES}
    assert {"systemd/elasticd-scheduler.service", "systemd/elasticd-node.service", "slurm/elasticd.sbatch",
            "kubernetes/scheduler.yaml", "kubernetes/node-daemonset.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_elasticd_command_line_in_a_recipe_is_one_the_cli_accepts(recipe):
    calls = _invocations(recipe.read_text())
    assert calls, f"{recipe} starts no elasticd command"
    ctx = click.Context(main)
    for cmd, opts in calls:
        command = main.get_command(ctx, cmd)
        assert command is not None, f"{recipe.name}: `elasticd {cmd}` is not a command"
        known = {o for p in command.params for o in p.opts}
        unknown = [o for o in opts if o not in known]
        assert not unknown, f"{recipe.name}: `elasticd {cmd}` has no option {unknown}"
    if recipe.suffix in (".service", ".yaml"):
        assert any(c == "scheduler" and "--metrics" in o for c, o in calls) or "node" in recipe.name, \
            f"{recipe.name}: the scheduler recipe must serve metrics"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_slurm_script_parses():
    r = subprocess.run(["bash", "-n", str(DEPLOY / "slurm" / "elasticd.sbatch")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# The Kubernetes versions the manifests say they are for (their header comments).
K8S_VERSIONS = ("1.28.0", "1.37.0")


def test_the_kubernetes_manifests_are_valid_for_the_versions_they_name():
    """Strictly (no unknown field) against the official OpenAPI schemas of each version, bundled by
    kubernetes-validate: a misspelt field or a removed API version fails here, not at `kubectl apply`."""
    import kubernetes_validate
    import yaml

    manifests = sorted(DEPLOY.glob("kubernetes/*.yaml"))
    for path in manifests:
        text = path.read_text()
        assert all(v.rsplit(".", 1)[0] in text for v in K8S_VERSIONS), f"{path.name} does not name {K8S_VERSIONS}"
        for doc in yaml.safe_load_all(text):
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)   # raises ValidationError


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_systemd_units_verify(tmp_path):
    """`systemd-analyze verify` on each unit, its /opt/elasticd path pointed at this install's elasticd."""
    import sys

    elasticd_bin = Path(sys.executable).parent / "elasticd"
    units = []
    for path in sorted(DEPLOY.glob("systemd/*.service")):
        unit = tmp_path / path.name
        unit.write_text(path.read_text().replace("/opt/elasticd/bin/elasticd", str(elasticd_bin)))
        units.append(str(unit))
    out = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
