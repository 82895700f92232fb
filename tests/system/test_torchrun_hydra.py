"""torchrun mode with a Hydra-configured script (tests/jobs/torchrun_hydra.py, shaped like pytorch/examples'
minGPT-ddp): `@hydra.main` runs once per rank, so with the ranks of an agent in one process its run-state
singletons must be per worker (agent/compat/per_rank_singletons.py; without them every rank after the
first fails with "GlobalHydra is already initialized"). Against real torchrun, 4 processes over gloo: the
same parameters within DDP's tolerance, each rank given the config and overrides Hydra gives it there,
and a script that draws before it seeds gets numbers of each rank's own, as a fresh process would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_compare import MOVED, RUN_TIMEOUT, assert_ddp_close
from util import JOBS, cli, load_state, rel_diff

# Long end-to-end runs of a third-party trainer beside torchrun: run by CI's second pass, not the README's.
pytestmark = pytest.mark.slow

SCRIPT = JOBS / "torchrun_hydra.py"
RANKS = 4


def overrides(tmp: Path) -> list[str]:
    return [f"out={tmp / 'final.pt'}", f"info={tmp / 'info'}", "model.hidden=40", "epochs=2"]


def infos(tmp: Path) -> list[dict]:
    return [json.loads((tmp / f"info{r}.json").read_text()) for r in range(RANKS)]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("torchrun_hydra")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
           str(SCRIPT), *overrides(tmp)]
    run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, f"torchrun failed:\n{run.stdout}{run.stderr}"
    return tmp


@pytest.mark.timeout(600)
def test_hydra_script_unchanged_matches_torchrun_with_every_rank_in_one_agent(torchrun_run: Path,
                                                                               tmp_path: Path) -> None:
    run = cli("run", "--workers", str(RANKS), "--devices", "1", str(SCRIPT), *overrides(tmp_path),
              cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    ref, got = load_state(torchrun_run / "final.pt"), load_state(tmp_path / "final.pt")
    torch.manual_seed(1234)   # the script's model at its seed: training moved every tensor of it
    initial = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                  torch.nn.Linear(40, 4)).state_dict()
    assert all(rel_diff(initial[k], ref[k]) > MOVED for k in initial)
    assert_ddp_close(ref, got)

    theirs, ours = infos(torchrun_run), infos(tmp_path)
    for r, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        assert o["rank"] == r and o["env_rank"] == str(r) and o["steps"] == t["steps"] == 16
        assert o["job"] == t["job"] == "torchrun_hydra"
        assert o["cfg"]["model"] == t["cfg"]["model"] == {"width": 20, "hidden": 40, "dropout": 0.1}
        assert [x.split("=")[0] for x in o["overrides"]] == ["out", "info", "model.hidden", "epochs"]
        assert o["overrides"] == [x.replace(str(torchrun_run), str(tmp_path)) for x in t["overrides"]]


def test_ranks_that_draw_before_seeding_get_streams_of_their_own_as_under_torchrun(torchrun_run: Path,
                                                                                   tmp_path: Path) -> None:
    run = cli("run", "--workers", str(RANKS), "--devices", "2", str(SCRIPT), *overrides(tmp_path),
              cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output

    def distinct(runs: list[dict], stream: str) -> int:
        return len({json.dumps(i["draws"][stream]) for i in runs})

    theirs, ours = infos(torchrun_run), infos(tmp_path)
    counts = {s: (distinct(theirs, s), distinct(ours, s)) for s in ("python", "numpy", "torch")}
    # Python and numpy seed from the OS in every fresh process; so does torch in this version. A torch that
    # starts from a constant seed gives every rank the same numbers under torchrun, and here.
    assert counts["python"] == counts["numpy"] == (RANKS, RANKS), counts
    assert counts["torch"] in ((RANKS, RANKS), (1, 1)), counts
