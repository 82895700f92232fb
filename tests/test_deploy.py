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

from elasticd.cli import main

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
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
