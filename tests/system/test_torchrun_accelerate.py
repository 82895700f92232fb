"""torchrun mode with a script in HF accelerate's documented pattern (tests/jobs/torchrun_accelerate.py).
accelerate's process state is a class-level dict (the Borg pattern); shared by an agent's workers, every
rank after the first never formed its process group and failed at the DataLoader's first collective
(agent/compat/per_rank_singletons.py). Against real torchrun, 4 processes over gloo: the same parameters
within DDP's tolerance, and each rank told the index, count and accuracy accelerate tells it there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_compare import RUN_TIMEOUT, assert_ddp_close
from util import JOBS, cli, load_state

# Long end-to-end runs of a third-party trainer beside torchrun: run by CI's second pass, not the README's.
pytestmark = pytest.mark.slow

pytest.importorskip("accelerate")   # a test extra (pyproject.toml): installed by scripts/setup.sh

SCRIPT = JOBS / "torchrun_accelerate.py"
RANKS = 4


def infos(tmp: Path) -> list[dict]:
    return [json.loads((tmp / f"info{r}.json").read_text()) for r in range(RANKS)]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("torchrun_accelerate")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
           str(SCRIPT), str(tmp / "final.pt"), str(tmp / "info")]
    run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, f"torchrun failed:\n{run.stdout}{run.stderr}"
    return tmp


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_accelerate_script_unchanged_matches_torchrun(torchrun_run: Path, tmp_path: Path, devices: int) -> None:
    run = cli("run", "--workers", str(RANKS), "--devices", str(devices), str(SCRIPT), str(tmp_path / "final.pt"),
              str(tmp_path / "info"), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    assert_ddp_close(load_state(torchrun_run / "final.pt"), load_state(tmp_path / "final.pt"))
    theirs, ours = infos(torchrun_run), infos(tmp_path)
    for r, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        assert o == t, (r, o, t)
        assert o["process_index"] == r and o["num_processes"] == RANKS and o["main"] == (r == 0)
        assert o["synced"] == 8 and o["accuracy"][-1][1] == 128   # 2 epochs of 8 micro-batches, every eval sample
