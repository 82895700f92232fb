"""The CUDA path end to end, on one GPU (`pytest -m cuda`; scripts/gpu_check.sh runs it on a GPU machine).

Every run is a real `elasticd run --device-type cuda` of tests/jobs/cuda_job.py (or resize_job.py): N=4
logical workers on cuda:0. Several agents on the one GPU use the test switch ELASTICD_DEVICE_BACKEND=gloo
(NCCL refuses two ranks on one GPU), which makes the agents' group gloo carrying CUDA tensors. Peak
device memory (`torch.cuda.max_memory_allocated` of each agent) is printed for every run (`pytest -s`).

Skipped, with the reason, where torch sees no GPU: the logic these runs rely on that can run without
one is tested in tests/agent/comm/test_gpu_path.py, tests/agent/resize/test_resize_fallback.py and tests/agent/compat/test_torch_dist.py.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from run_faults import grow_with_a_joiner_killed
from util import JOBS, assert_same_run, cli, max_rel_diff, wait_until

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: torch sees none here (run scripts/gpu_check.sh on a GPU machine)"),
]

JOB = JOBS / "cuda_job.py"
WORKERS = 4
STEPS = 12
PRIVATE_MB = 32           # per rank (cuda_job.py), 128 MiB for the 4 ranks of one agent
BUDGET = 80 * 2**20       # --device-memory: room for two ranks' private state, so the other two swap
SHARED_GPU = {"ELASTICD_DEVICE_BACKEND": "gloo"}  # several agents on the one GPU (tests only)
RUN_TIMEOUT = 600


def run_job(tmp: Path, name: str, devices: int = 1, device_type: str = "cuda", env: dict[str, str] | None = None,
            args: tuple[str, ...] = (), job: Path = JOB) -> Path:
    out = tmp / name
    out.mkdir()
    full_env = {"ELASTICD_TEST_WORKERS": str(WORKERS), "ELASTICD_TEST_STEPS": str(STEPS),
                "ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt"),
                "ELASTICD_TEST_PRIVATE_MB": str(PRIVATE_MB), **(env or {})}
    argv = ["run", str(job), "--workers", str(WORKERS), "--devices", str(devices), "--device-type", device_type,
            "--summary", str(out / "summary.json"), *args]
    run = cli(*argv, env=full_env, timeout=RUN_TIMEOUT)
    assert run.code == 0, f"`elasticd {' '.join(argv)}` exited {run.code}:\n{run.output[-5000:]}"
    if job == JOB:
        peaks = {r: peak(out, r) for r in range(WORKERS)}
        print(f"{name}: {run.seconds:.1f}s, peak device memory by rank's agent (MiB): "
              f"{ {r: round(p['max_memory_allocated'] / 2**20, 1) for r, p in peaks.items()} }, "
              f"swapped out: {peaks[0]['swap'].get('bytes_out')} B")
    return out


def trace(out: Path, rank: int) -> list[tuple[int, float, float, float]]:
    rows = [line.split() for line in (out / f"rank{rank}.log").read_text().splitlines()]
    return [(int(s), float(loss), float(noise), float(mem)) for s, loss, noise, mem in rows]


def peak(out: Path, rank: int) -> dict:
    return json.loads((out / f"peak{rank}.json").read_text())


def assert_bitwise(out: Path, ref: Path) -> None:
    want, got = torch.load(ref / "final.pt"), torch.load(out / "final.pt")
    assert set(want) == set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs bitwise from {ref.name}"
    for r in range(WORKERS):
        assert trace(out, r) == trace(ref, r), f"rank {r}'s trace differs bitwise from {ref.name}"


@pytest.fixture(scope="module")
def det_m1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N=4 on one agent on cuda:0, deterministic, with dropout: the reference of most tests here."""
    return run_job(tmp_path_factory.mktemp("det_m1"), "det_m1", env={"ELASTICD_TEST_DETERMINISTIC": "1"})


def test_n4_on_one_gpu_matches_the_cpu_run(tmp_path: Path) -> None:
    """Without dropout (CPU and CUDA generators differ) the GPU computes what the CPU computes, to fp32
    round-off: same losses step by step, same final parameters."""
    env = {"ELASTICD_TEST_DROPOUT": "0"}
    gpu = run_job(tmp_path, "gpu", env=env)
    cpu = run_job(tmp_path, "cpu", device_type="cpu", env=env)
    for r in range(WORKERS):
        g, c = trace(gpu, r), trace(cpu, r)
        assert [s for s, *_ in g] == list(range(STEPS))
        for (s, lg, _, mg), (_, lc, _, mc) in zip(g, c, strict=True):
            assert abs(lg - lc) <= 1e-4 * max(1.0, abs(lc)), f"rank {r} step {s}: loss {lg} on GPU, {lc} on CPU"
            assert abs(mg - mc) <= 1e-5 * max(1.0, abs(mc)), f"rank {r} step {s}: private state differs"
    assert max_rel_diff(torch.load(cpu / "final.pt"), torch.load(gpu / "final.pt")) <= 1e-4


def test_deterministic_mode_is_bitwise_to_itself_and_over_two_agents(det_m1: Path, tmp_path: Path) -> None:
    env = {"ELASTICD_TEST_DETERMINISTIC": "1"}
    assert_bitwise(run_job(tmp_path, "again", env=env), det_m1)
    assert_bitwise(run_job(tmp_path, "m2", devices=2, env={**env, **SHARED_GPU}), det_m1)


def test_every_worker_draws_from_its_own_cuda_stream(det_m1: Path) -> None:
    """Each rank seeded its CUDA generator differently; with the generator swapped at every hand-over its
    draws are exactly those of a process of its own (replayed here: the noise, then the dropout mask)."""
    for r in range(WORKERS):
        torch.cuda.manual_seed(1000 + r)
        for step, _, noise, _ in trace(det_m1, r):
            want = torch.rand(16, 8, device="cuda").sum().item()
            F.dropout(torch.ones(16, 256, device="cuda"), 0.3, training=True)  # the forward's draw
            assert noise == want, f"rank {r} step {step}: drew {noise}, its own stream gives {want}"
    assert len({trace(det_m1, r)[0][2] for r in range(WORKERS)}) == WORKERS


@pytest.mark.parametrize("stream", [False, True], ids=["default-stream", "side-stream"])
def test_device_memory_swapping_is_bitwise_the_unbudgeted_run(det_m1: Path, tmp_path: Path, stream: bool) -> None:
    """Private state beyond --device-memory goes to pinned host buffers between turns and comes back on a
    side stream; under `torch.cuda.stream(s)` the incoming worker must still wait for it (hand-over
    events), else it reads half-copied tensors and the bits differ."""
    env = {"ELASTICD_TEST_DETERMINISTIC": "1", "ELASTICD_TEST_STREAM": "1" if stream else "0"}
    out = run_job(tmp_path, "budget", env=env, args=("--device-memory", str(BUDGET)))
    assert peak(out, 0)["swap"]["bytes_out"] > 0, "the budget did not make the run swap"
    assert_bitwise(out, det_m1)
    assert peak(out, 0)["max_memory_allocated"] < peak(det_m1, 0)["max_memory_allocated"]


def test_resize_2_1_2_with_two_agents_on_one_gpu(det_m1: Path, tmp_path: Path) -> None:
    """A shrink and a grow on CUDA: snapshots cross agents on the CPU, RNG states load on the CPU, and
    the run ends bitwise as the unscaled one. The shrink must not hold the old segment's state on the
    device while the new one is built: agent 0's peak stays near that of a run on one agent all along."""
    env = {"ELASTICD_TEST_DETERMINISTIC": "1", **SHARED_GPU}
    out = run_job(tmp_path, "scaled", devices=2, env=env, args=("--scale-at", "4:1,8:2"))
    resizes = json.loads((out / "summary.json").read_text())["resizes"]
    assert [(r["from"], r["to"], r["outcome"]) for r in resizes] == [(2, 1, "done"), (1, 2, "done")]
    assert_bitwise(out, det_m1)
    slack = PRIVATE_MB * 2**20  # one rank's private tensor; a device copy of the snapshot would be 4
    assert peak(out, 0)["max_memory_allocated"] <= peak(det_m1, 0)["max_memory_allocated"] + slack


def test_device_memory_is_the_private_state_plus_blas_workspaces_not_one_per_worker(det_m1: Path) -> None:
    """N hosted workers hold one cuBLAS workspace between them, not one each (a worker thread's handle gets
    its own; agent/slicer/device.py frees the outgoing worker's), and swapping a slot out takes no
    temporary near its size (the dedup checksum's column sums once took twice the slot). The autograd
    engine's device thread, which runs every worker's backward, has a handle and a workspace of its own."""
    private = WORKERS * PRIVATE_MB * 2**20
    room = (2 * (32 + 1) + 16) * 2**20  # forward's and backward's cuBLAS(Lt) workspaces, activations, rounding
    got = peak(det_m1, 0)["max_memory_allocated"]
    assert got <= private + room, f"peak {got / 2**20:.1f} MiB: private state {private / 2**20:.0f} MiB + more"


def test_the_swap_checksum_of_a_slot_takes_little_device_memory_and_matches_the_cpu_one() -> None:
    from elasticd.agent.private.swap_cuda import cuda_checksum

    g = torch.Generator(device="cuda").manual_seed(0)
    data = torch.randint(0, 256, (PRIVATE_MB * 2**20 + 77,), dtype=torch.uint8, device="cuda", generator=g)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = cuda_checksum(data)
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= 4 * 2**20, f"the checksum of a {PRIVATE_MB} MiB slot took {extra / 2**20:.1f} MiB more"
    assert got == cuda_checksum(data.cpu())  # the same int64 sums, exact on both devices
    data[12345] ^= 1
    assert cuda_checksum(data) != got


def test_a_daemon_job_on_a_forked_spare_is_bitwise_the_elasticd_run_one(det_m1: Path, cluster, tmp_path: Path) -> None:
    """A node daemon on the GPU machine (its devices: every CUDA device) forks its spares from a server that
    imported torch without initialising CUDA; the job's agent, one such spare, creates its context on
    cuda:0 after the fork and ends bitwise as the agent `elasticd run` forked for det_m1."""
    from cluster import wait_state
    from daemon_jobs import submit

    d = cluster.daemon(cpu=None, fake=False)
    sd = d.state_dir
    spares_log = sd / "spares.log"
    wait_until(lambda: spares_log.exists() and "forked ready in" in spares_log.read_text(), 180,
               what="a spare forked from the daemon's fork server")
    out = tmp_path / "daemon"
    out.mkdir()
    env = {"ELASTICD_TEST_WORKERS": str(WORKERS), "ELASTICD_TEST_STEPS": str(STEPS), "ELASTICD_TEST_LOG": str(out),
           "ELASTICD_TEST_OUT": str(out / "final.pt"), "ELASTICD_TEST_PRIVATE_MB": str(PRIVATE_MB),
           "ELASTICD_TEST_DETERMINISTIC": "1"}
    job = submit(sd, str(JOB), env, "--workers", str(WORKERS), "--max-devices", "1")
    info = wait_state(sd, job, ("finished", "failed"), timeout=RUN_TIMEOUT)
    assert info["state"] == "finished", (info["error"], d.output()[-3000:])
    (agent,) = info["agents"]
    assert f"started on spare agent pid {agent['pid']}" in d.output(), d.output()[-3000:]
    assert_bitwise(out, det_m1)


def test_a_failed_grow_rolls_back_with_restore_epoch_on_cuda(tmp_path: Path) -> None:
    """tests/elasticd/test_run_resize.py's roll-back, on the GPU: a joiner freezes during the hand-over of a 2 -> 4 grow,
    every agent is stopped and the job restarts on 2 agents with --restore-epoch from the snapshot on
    tmpfs, loaded on the CPU and moved to the GPU; it ends bitwise as a run that never scaled."""
    job = JOBS / "resize_job.py"
    steps = 20
    env = {**SHARED_GPU, "ELASTICD_TEST_DETERMINISTIC": "1", "ELASTICD_TEST_STEPS": str(steps)}
    ref = run_job(tmp_path, "unscaled", devices=2, env=env, job=job)
    out, snaps = tmp_path / "fell-back", tmp_path / "snapshots"
    out.mkdir()
    hold = out / "hold"
    hold.touch()
    full_env = {**os.environ, **env, "ELASTICD_TEST_WORKERS": str(WORKERS), "ELASTICD_TEST_LOG": str(out),
                "ELASTICD_TEST_OUT": str(out / "final.pt"), "ELASTICD_TEST_HOLD": str(hold),
                "ELASTICD_TEST_HOLD_AT": "8"}
    cmd = [sys.executable, "-m", "elasticd", "run", str(job), "--devices", "2", "--device-type", "cuda",
           "--scale-at", "5:4", "--snapshot-dir", str(snaps), "--summary", str(out / "summary.json")]
    grow_with_a_joiner_killed(cmd, full_env, out, hold, snaps)
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["from"], r["to"], r["outcome"]) for r in summary["resizes"]] == [(2, 4, "rolled back")]
    assert_same_run(out, ref, steps, ranks=WORKERS)


def test_sync_batch_norm_fails_loudly_instead_of_reducing_over_the_agents(tmp_path: Path) -> None:
    """SyncBatchNorm's backward all-reduces on autograd's device thread (agent/compat/torch_dist.py)."""
    argv = ["run", str(JOBS / "sync_bn.py"), "--workers", str(WORKERS), "--devices", "2", "--device-type", "cuda"]
    run = cli(*argv, env={"ELASTICD_TEST_WORKERS": str(WORKERS), **SHARED_GPU}, timeout=RUN_TIMEOUT)
    assert run.code == 1, run.output[-5000:]
    assert "was called from a thread of its own during logical rank" in run.output, run.output[-5000:]


def test_a_flushs_small_values_reach_the_gpu_without_a_wait_and_come_back_in_one() -> None:
    """The used-flags and the ballot go to the device from pinned memory (a copy from pageable memory makes
    the host wait for the whole queued backward); what a flush reads back is one device-to-host copy."""
    from elasticd.agent.comm import host_values

    like = torch.zeros(8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            flags = host_values.flags([True, False, True], like)
            ones = host_values.flags([True, True], like)
            ballot = host_values.to_device([1, 0, 1, 1], torch.float32, like.device)
            sent = len(seen)
            got = host_values.read([flags, ones, ballot])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waits = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
    assert sent == 0, f"sending made the host wait: {waits}"
    assert len(waits) == 1, waits
    assert got == [[1.0, 0.0, 1.0], [1.0, 1.0], [1.0, 0.0, 1.0, 1.0]]
