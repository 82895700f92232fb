"""A warning torch raises inside a callable elasticd wraps names the user's line, as without elasticd
(agent/compat/warning_origin.py): `torch.cuda.amp.GradScaler(...)`'s deprecation, a scheduler made over a
replicated optimizer, the user's own `warnings.warn(..., stacklevel=2)` in a helper."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from util import REPO

SCRIPT = '''
import warnings
import torch
import elasticd

def helper():
    warnings.warn("from the helper", UserWarning, stacklevel=2)

@elasticd.elastic(workers=2)
def train(ctx):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.replicate(model, opt)
    scaler = torch.cuda.amp.GradScaler(enabled=False)  # LINE_SCALER
    helper()  # LINE_HELPER
    for _ in ctx.steps(1):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()

if __name__ == "__main__":
    train()
'''


def _line(tag: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if tag in line)


@pytest.mark.parametrize("how", ["standalone", "elasticd run"])
def test_warnings_name_the_user_s_line(tmp_path: Path, how: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-W", "always", str(script)] if how == "standalone" else \
        [sys.executable, "-W", "always", "-m", "elasticd", "run", str(script), "--devices", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "PYTHONWARNINGS": "always"})
    assert proc.returncode == 0, proc.stderr
    found = re.findall(r"^(\S+?):(\d+): (\w+Warning): (.*)$", proc.stderr, re.M)
    origins = {(kind, text[:30]): (path, int(line)) for path, line, kind, text in found}
    scaler = [v for (kind, text), v in origins.items() if kind == "FutureWarning" and "GradScaler" in text]
    helper = [v for (kind, text), v in origins.items() if text.startswith("from the helper")]
    assert scaler == [(str(script), _line("LINE_SCALER"))], proc.stderr
    assert helper == [(str(script), _line("LINE_HELPER"))], proc.stderr
    agent_dir = str(REPO / "agent")
    assert not [path for path, *_ in found if path.startswith(agent_dir)], proc.stderr
