"""torchrun mode with a Hugging Face `Trainer` script (tests/jobs/torchrun_hf_trainer.py: a tiny GPT-2 from its
config, warmup and cosine schedule, gradient clipping, an evaluation set), run unchanged: against real
torchrun with 4 processes over gloo, the same training and evaluation losses and the same weights within
DDP's tolerance, on 1 device and on 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_compare import RUN_TIMEOUT
from util import JOBS, cli, element_diff, global_diff, load_state, torchrun

# Long end-to-end runs of a third-party trainer beside torchrun: run by CI's second pass, not the README's.
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")   # a test extra (pyproject.toml): installed by scripts/setup.sh

SCRIPT = JOBS / "torchrun_hf_trainer.py"
RANKS = 4


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("torchrun_hf_trainer")
    torchrun(tmp, SCRIPT, str(tmp / "final.pt"), str(tmp / "losses.json"), ranks=RANKS)
    return tmp


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_hf_trainer_script_unchanged_matches_torchrun(torchrun_run: Path, tmp_path: Path, devices: int) -> None:
    run = cli("run", "--workers", str(RANKS), "--devices", str(devices), str(SCRIPT), str(tmp_path / "final.pt"),
              str(tmp_path / "losses.json"), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    want = json.loads((torchrun_run / "losses.json").read_text())
    got = json.loads((tmp_path / "losses.json").read_text())
    assert len(want["train"]) == 8 and len(set(want["train"])) > 1 and len(want["eval"]) == 2, want
    assert got["train"] == pytest.approx(want["train"], rel=1e-5), (got, want)
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-5), (got, want)
    # GPT-2's attention has key biases, whose gradient is round-off only: AdamW turns it into O(lr) noise under
    # any summation order, so the weights compare as the conformance matrix compares them (a global relative
    # and an elementwise bound over the model), not tensor by tensor.
    ref, ours = load_state(torchrun_run / "final.pt"), load_state(tmp_path / "final.pt")
    assert ref.keys() == ours.keys()
    keys = list(ref)
    assert global_diff(ref, ours, keys) <= 1e-6 and element_diff(ref, ours, keys) <= 5e-5, \
        (global_diff(ref, ours, keys), element_diff(ref, ours, keys))
