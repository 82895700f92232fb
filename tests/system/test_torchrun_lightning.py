"""torchrun mode with a PyTorch Lightning script (tests/jobs/torchrun_lightning.py: a LightningModule with SGD
and a validation set, `Trainer(accelerator="cpu", strategy="ddp")`), run unchanged: Lightning broadcasts its
log directory with broadcast_object_list, synchronises the validation loss and tears its DDP wrapper down.
Against real torchrun with 4 processes over gloo: the same training losses, the same synchronised validation
loss and the same weights within DDP's tolerance, on 1 device and on 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_compare import RUN_TIMEOUT, assert_ddp_close
from util import JOBS, cli, load_state, torchrun

# Long end-to-end runs of a third-party trainer beside torchrun: run by CI's second pass, not the README's.
pytestmark = pytest.mark.slow

pytest.importorskip("lightning")   # a test extra (pyproject.toml): installed by scripts/setup.sh

SCRIPT = JOBS / "torchrun_lightning.py"
RANKS = 4


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("torchrun_lightning")
    torchrun(tmp, SCRIPT, str(tmp / "final.pt"), str(tmp / "losses.json"), ranks=RANKS)
    return tmp


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_script_unchanged_matches_torchrun(torchrun_run: Path, tmp_path: Path, devices: int) -> None:
    run = cli("run", "--workers", str(RANKS), "--devices", str(devices), str(SCRIPT), str(tmp_path / "final.pt"),
              str(tmp_path / "losses.json"), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    want = json.loads((torchrun_run / "losses.json").read_text())
    got = json.loads((tmp_path / "losses.json").read_text())
    assert len(want["train"]) == 8 and len(set(want["train"])) > 1, want
    assert got["train"] == pytest.approx(want["train"], rel=1e-5), (got, want)
    assert got["val"] == pytest.approx(want["val"], rel=1e-5), (got, want)
    assert_ddp_close(load_state(torchrun_run / "final.pt"), load_state(tmp_path / "final.pt"))
