"""The docs' examples, run as a user runs them: the README's quick start (standalone, on 2 devices resized
live, and under plain torch DDP) and the porting guide's worked port (the torchrun script under real
torchrun, its port resized live, the unchanged script in torchrun mode) reach the same result."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from util import REPO, max_rel_diff, torchrun

EXAMPLES = REPO / "examples"


def _sh(cmd: str, cwd: Path, timeout: float = 300) -> str:
    bindir = str(Path(sys.executable).parent)   # `python` and `elasticd` of this install, as in an activated venv
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})
    assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    return proc.stdout + proc.stderr


def _readme_run_lines() -> list[str]:
    """The quick start's run commands: the first group of lines of the README's bash block after its code."""
    readme = (REPO / "README.md").read_text()
    block = re.findall(r"^```bash\n(.*?)^```$", readme, re.S | re.M)[1]
    first_group = block.split("\n\n")[0]
    return [line.split("#")[0].strip() for line in first_group.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_quick_start_runs_as_the_readme_says(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "quickstart.py", tmp_path / "train.py")
    lines = _readme_run_lines()
    assert [line.split()[:2] for line in lines] == [["python", "train.py"], ["elasticd", "run"], ["elasticd", "run"]]
    losses, outs = {}, {}
    for line in lines:
        outs[line] = out = _sh(line, tmp_path)
        found = re.findall(r"^final loss ([0-9.]+)$", out, re.M)
        assert len(found) == 1, f"`{line}` printed no single final loss:\n{out}"
        losses[line] = float(found[0])
    assert "resized 2 -> 1 devices after step 50" in outs[lines[1]]
    assert "resized 1 -> 2 devices after step 100" in outs[lines[1]]
    ref = losses[lines[2]]   # --ddp: plain torch DDP with 8 processes
    for line, loss in losses.items():
        assert abs(loss - ref) <= 1e-4 * abs(ref), f"`{line}`: final loss {loss}, DDP's {ref}"


@pytest.mark.slow
def test_the_worked_port_matches_torchrun(tmp_path: Path) -> None:
    port = EXAMPLES / "port"
    torchrun(tmp_path, port / "train_ddp.py", str(tmp_path / "ref.pt"))
    _sh(f"elasticd run {port / 'train_elastic.py'} --devices 2 --scale-at 10:1,20:2 port.pt", tmp_path)
    _sh(f"elasticd run --workers 4 --devices 2 {port / 'train_ddp.py'} unchanged.pt", tmp_path)
    ref = torch.load(tmp_path / "ref.pt")
    for name in ("port.pt", "unchanged.pt"):
        got = torch.load(tmp_path / name)
        assert max_rel_diff(ref, got) < 1e-5, name
