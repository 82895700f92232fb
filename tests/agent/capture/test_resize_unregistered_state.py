"""A decorated job resized live keeps what it never registered, or the resize fails loudly.

Real agent processes over gloo (`elasticd run --scale-at`) against real torch DDP (`elasticd run --ddp`):
plain optimizers, schedulers, GradScalers and DataLoader iterators survive a shrink and a grow; a state a
snapshot cannot hold refuses the resize naming it, and the job trains on as DDP does; a job without `ctx.steps` refuses `--scale-at`;
`ctx.batches` keeps the user's `set_epoch`; a scheduled resize happens at the step asked for.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from torch.utils.data import DistributedSampler
from util import JOBS, REFERENCE_WORKERS, CliResult, cli, load_state, rel_diffs

TOLERANCE = 1e-5  # as tests/system/test_equivalence.py: fp32 reordering of the gradient sum, nothing more
SCALE_AT = "5:1,10:2"  # 2 devices -> 1 after step 5 -> 2 after step 10, on a 20-step job


def _job_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"elasticd_test_{name}", JOBS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(job: str, out: Path, *args: str, env: dict[str, str] | None = None) -> CliResult:
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), "ELASTICD_TEST_OUT": str(out / "final.pt"),
           "ELASTICD_TEST_LOG": str(out), **(env or {})}
    return cli(*["run", str(JOBS / f"{job}.py"), "--workers", str(REFERENCE_WORKERS), *args], env=env, timeout=400)


@pytest.fixture(scope="module")
def forgot_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """tests/jobs/forgot_job.py under real DDP, and resized 2 -> 1 -> 2 devices under elasticd."""
    ref, out = tmp_path_factory.mktemp("ddp"), tmp_path_factory.mktemp("scaled")
    run = _run("forgot_job", ref, "--ddp")
    assert run.code == 0, run.output
    (ref / "output.txt").write_text(run.output)
    run = _run("forgot_job", out, "--devices", "2", "--scale-at", SCALE_AT, "--summary", str(out / "summary.json"))
    assert run.code == 0, run.output
    (out / "output.txt").write_text(run.output)
    return ref, out


@pytest.mark.timeout(900)
def test_unregistered_optimizer_scheduler_scaler_and_loader_survive_resizes_as_under_ddp(
        forgot_runs: tuple[Path, Path]) -> None:
    ref, out = forgot_runs
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["from"], r["to"], r["outcome"]) for r in summary["resizes"]] == [(2, 1, "done"), (1, 2, "done")]
    want, got = load_state(ref / "final.pt"), load_state(out / "final.pt")
    assert got["lr"] == want["lr"], "the StepLR schedule restarted at a resize"
    assert got["scale"] == want["scale"], "the GradScaler's scale restarted at a resize"
    too_far = {k: d for k, d in rel_diffs(want, got).items() if d > TOLERANCE}
    assert not too_far, f"AdamW's state or the data position was lost at a resize: {too_far}"
    for rank in range(REFERENCE_WORKERS):   # the loader went on where it was: same samples, step by step
        seen = [line.split()[:1] + line.split()[2:] for line in (out / f"rank{rank}.log").read_text().splitlines()]
        ddp = [line.split()[:1] + line.split()[2:] for line in (ref / f"rank{rank}.log").read_text().splitlines()]
        assert seen == ddp, f"rank {rank} loaded other samples than under DDP"


@pytest.mark.timeout(900)
def test_scale_at_resizes_after_the_step_asked_for_and_the_summary_says_so(forgot_runs: tuple[Path, Path]) -> None:
    _, out = forgot_runs
    assert [r["step"] for r in json.loads((out / "summary.json").read_text())["resizes"]] == [5, 10]
    # Column 2 is how many logical ranks shared rank 0's device at that step: 2 on 2 devices, 4 on 1.
    hosted = {int(s): int(h) for s, h, *_ in (line.split() for line in (out / "rank0.log").read_text().splitlines())}
    assert [hosted[s] for s in (5, 6, 10, 11)] == [2, 4, 4, 2], hosted



def test_ctx_step_is_the_step_the_function_resumes_at_from_its_first_line(forgot_runs: tuple[Path, Path]) -> None:
    """Code before the loop runs again after each resize; `if ctx.step == 0:` tells it a fresh start, and a file
    that code empties again is named in the job's output (agent/capture/reentry_writes.py)."""
    ref, out = forgot_runs
    for rank in range(REFERENCE_WORKERS):
        assert (ref / f"starts{rank}.log").read_text().split() == ["0"]
        assert (out / f"starts{rank}.log").read_text().split() == ["0", "6", "11"]
    # Every rank rewrites config.txt before its loop: after each resize the job's output says it was emptied,
    # once per agent that found something in it: one after the resize to 1 device; after the one back to 2,
    # one or two, since the agent that opens it second may find it already emptied by the first (the
    # warning is about a file with something in it; the two agents are processes of their own).
    said = [line for line in (out / "output.txt").read_text().splitlines() if "config.txt with mode 'w'" in line]
    assert all("what the file held is gone" in line for line in said), said
    steps = sorted(line.split("resuming at step ")[1].split(":")[0] for line in said)
    assert steps in (["11", "11", "6"], ["11", "6"]), said
    assert "config.txt" not in (ref / "output.txt").read_text()
    said = [line for line in (out / "output.txt").read_text().splitlines() if "notes.txt with mode 'w'" in line]
    assert {line.split("resuming at step ")[1].split(":")[0] for line in said} == {"6", "11"}, said


@pytest.mark.timeout(600)
def test_a_state_no_snapshot_can_hold_refuses_the_resize_naming_the_object(tmp_path: Path) -> None:
    run = _run("forgot_unsavable", tmp_path, "--devices", "2", "--scale-at", "3:1")
    assert run.code == 1, run.output
    assert "resize 2 -> 1 devices after step 3 refused" in run.output, run.output
    assert "RuleLR (object #3 of the optimizers/schedulers/scalers/model copies logical rank" in run.output, run.output
    assert "'rule'" in run.output and "function" in run.output, run.output
    assert "Traceback" not in run.output, run.output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices,scale_at", [("2", SCALE_AT), ("1", "5:2,10:1")], ids=["shrink", "grow"])
def test_a_refused_resize_loses_nothing_the_job_trains_on_as_under_ddp(
        forgot_runs: tuple[Path, Path], tmp_path: Path, devices: str, scale_at: str) -> None:
    ref, _ = forgot_runs
    run = _run("forgot_job", tmp_path, "--devices", devices, "--scale-at", scale_at, "--summary",
               str(tmp_path / "summary.json"), env={"ELASTICD_TEST_UNSAVABLE": "1", "ELASTICD_LOG_LEVEL": "INFO"})
    assert run.code == 1, run.output   # the resizes asked for did not happen: said, not hidden
    first, rest = scale_at.split(",")
    src, dst = int(devices), int(first.split(":")[1])
    assert (f"resize {src} -> {dst} devices after step 5 refused, the job goes on on {src} device(s); --scale-at "
            f"{rest} dropped: logical rank 0: cannot carry `warmup` in train() across the resize: "
            "state_dict()['rule'] is a function") in run.output, run.output
    # once per agent: the command that came after the held step's vote is not taken for another resize
    assert run.output.count("resize refused after step") == src, run.output
    resizes = json.loads((tmp_path / "summary.json").read_text())["resizes"]
    assert [(r["step"], r["from"], r["to"], r["outcome"]) for r in resizes] == [(5, src, dst, "refused")], resizes
    assert "`warmup`" in resizes[0]["note"]
    for rank in range(REFERENCE_WORKERS):
        # the function ran once per rank, every step on the devices it started on
        assert (tmp_path / f"starts{rank}.log").read_text() == "0\n"
        lines = (tmp_path / f"rank{rank}.log").read_text().splitlines()
        assert [int(x.split()[0]) for x in lines] == list(range(20))
        assert {x.split()[1] for x in lines} == {str(REFERENCE_WORKERS // src)}
    want, got = load_state(ref / "final.pt"), load_state(tmp_path / "final.pt")
    too_far = {k: d for k, d in rel_diffs(want, got).items() if d > TOLERANCE}
    assert not too_far, f"the refused resize changed what the job computed: {too_far}"


@pytest.mark.timeout(600)
def test_scale_at_on_a_job_that_never_enters_ctx_steps_is_refused(tmp_path: Path) -> None:
    run = _run("no_steps", tmp_path, "--devices", "2", "--scale-at", "2:1", "--summary", str(tmp_path / "s.json"))
    assert run.code == 1, run.output
    assert "--scale-at 2:1 refused: the function never reached a step boundary of `ctx.steps`" in run.output
    assert json.loads((tmp_path / "s.json").read_text())["resizes"] == []


@pytest.mark.timeout(600)
def test_ctx_batches_keeps_the_epoch_the_user_set(tmp_path: Path) -> None:
    run = _run("user_epoch", tmp_path, "--devices", "2")
    assert run.code == 0, run.output
    user_epoch = _job_module("user_epoch")
    ds = user_epoch.dataset()
    per_epoch = user_epoch.SAMPLES // REFERENCE_WORKERS // user_epoch.BATCH
    for rank in range(REFERENCE_WORKERS):
        sampler = DistributedSampler(ds, num_replicas=REFERENCE_WORKERS, rank=rank, shuffle=True, seed=0)
        want = []
        for epoch in (user_epoch.START_EPOCH, user_epoch.START_EPOCH + 1):   # what DDP's loop would load
            sampler.set_epoch(epoch)
            order = list(sampler)
            want += [order[i * user_epoch.BATCH:(i + 1) * user_epoch.BATCH] for i in range(per_epoch)]
        got = [[int(i) for i in line.split()[1:]] for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()]
        assert got == want[:user_epoch.STEPS], f"rank {rank} walked other epochs than the sampler's own"


@pytest.mark.timeout(900)
def test_a_for_loop_over_the_loader_with_ctx_steps_driving_resumes_where_it_was(
        forgot_runs: tuple[Path, Path], tmp_path: Path) -> None:
    ref, _ = forgot_runs
    run = _run("forgot_job", tmp_path, "--devices", "2", "--scale-at", "5:1", env={"ELASTICD_TEST_LOOP": "for"})
    assert run.code == 0, run.output
    want, got = load_state(ref / "final.pt"), load_state(tmp_path / "final.pt")
    too_far = {k: d for k, d in rel_diffs(want, got).items() if d > TOLERANCE}
    assert not too_far, f"the loader restarted at the resize: {too_far}"


@pytest.mark.timeout(900)
def test_an_epoch_counter_that_restarted_with_the_function_fails_instead_of_repeating_data(tmp_path: Path) -> None:
    # Resized after step 10, in epoch 1 (8 steps an epoch): the re-entered loop's `epoch` starts at 0 again
    # and would set epoch 1 a second time at the end of this one.
    run = _run("forgot_job", tmp_path, "--devices", "2", "--scale-at", "10:1", env={"ELASTICD_TEST_LOOP": "for"})
    assert run.code == 1, run.output
    assert "resumed DataLoader #1 of this rank in epoch 1 after a resize, and now its sampler is set to epoch 1" \
        in run.output, run.output
