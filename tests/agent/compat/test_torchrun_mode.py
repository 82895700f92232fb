"""torchrun mode: a script written for torchrun, unchanged, on N logical workers over M devices.

End to end against the real thing: tests/jobs/torchrun_tutorial.py (written as the torch DDP tutorials
write it) runs under `python -m torch.distributed.run --nproc_per_node 4` with real gloo processes and
under `elasticd run --workers 4 --devices 1|2`; the parameters must agree within DDP's tolerance. A
resize and a killed agent restart the job, which resumes from the script's own snapshot. In process:
the per-worker environment and the process-group lifecycle inside workers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrun_compare import MOVED, RUN_TIMEOUT, assert_ddp_close
from util import JOBS, cli, kill_session, load_state, rel_diff, wait_until

import elasticd
from elasticd.agent.compat import cuda_ranks, worker_env
from elasticd.agent.proc_name import agents_under
from elasticd.agent.runtime import WorkerFailed
from elasticd.agent.worker import DistState, Worker, set_current_worker

SCRIPT = JOBS / "torchrun_tutorial.py"
EPOCHS = 3        # 512 samples / 4 ranks / batch 16 = 8 steps per epoch


def tutorial_args(tmp: Path, out: str) -> list[str]:
    return [str(EPOCHS), "--snapshot", str(tmp / "snapshot.pt"), "--out", str(tmp / out),
            "--info", str(tmp / "info{rank}.json")]


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The tutorial script under real torchrun: 4 processes, torch's DDP over gloo."""
    tmp = tmp_path_factory.mktemp("torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(SCRIPT),
           *tutorial_args(tmp, "final.pt")]
    run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, f"torchrun failed:\n{run.stdout}{run.stderr}"
    infos = [json.loads((tmp / f"info{r}.json").read_text()) for r in range(4)]
    assert [i["env"]["RANK"] for i in infos] == ["0", "1", "2", "3"]  # the reference itself is 4 real ranks
    return load_state(tmp / "final.pt")


def test_reference_trained(torchrun_reference: dict[str, torch.Tensor]) -> None:
    """Guards the comparisons below against a vacuous reference: training moved every tensor."""
    torch.manual_seed(0)
    sys.path.insert(0, str(JOBS))
    try:
        from tutorial_parts import Net
    finally:
        sys.path.remove(str(JOBS))
    initial = Net().state_dict()
    assert all(rel_diff(initial[k], torchrun_reference[k]) > MOVED for k in initial)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_tutorial_script_unchanged_matches_torchrun(devices: int, torchrun_reference: dict[str, torch.Tensor],
                                                    tmp_path: Path) -> None:
    run = cli("run", "--workers", "4", "--devices", str(devices), str(SCRIPT), *tutorial_args(tmp_path, "final.pt"),
              cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    assert_ddp_close(torchrun_reference, load_state(tmp_path / "final.pt"))
    for rank in range(4):
        info = json.loads((tmp_path / f"info{rank}.json").read_text())
        assert info == {"env": {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                                "GROUP_RANK": "0"},
                        "getenv": str(rank), "in": True, "dict": str(rank), "get_rank": rank, "initialized": True,
                        "backend": "gloo", "initialized_after_destroy": False}, f"rank {rank}: {info}"
    assert "RANK" not in os.environ  # nothing of the workers' view leaked into the launcher's environment
    print(f"torchrun mode N=4 M={devices}: {run.seconds:.1f}s")


@pytest.mark.timeout(600)
def test_resize_restarts_and_resumes_from_the_scripts_checkpoint(torchrun_reference: dict[str, torch.Tensor],
                                                                 tmp_path: Path) -> None:
    """2 -> 1 device after step 12 (mid second epoch): every agent restarts, the script loads the snapshot
    of its first epoch and trains on; the result is the undisturbed torchrun run's."""
    summary = tmp_path / "summary.json"
    run = cli("run", "--workers", "4", "--devices", "2", "--scale-at", "12:1", "--summary", str(summary), str(SCRIPT),
              *tutorial_args(tmp_path, "final.pt"), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    resizes = json.loads(summary.read_text())["resizes"]
    assert [(r["step"], r["from"], r["to"], r["outcome"]) for r in resizes] == [(12, 2, 1, "restarted")], resizes
    assert resizes[0]["seconds"] > 0
    assert run.out.count("Resuming training from snapshot at Epoch 1") == 4, run.output
    assert_ddp_close(torchrun_reference, load_state(tmp_path / "final.pt"))
    print(f"torchrun-mode restart 2 -> 1: {resizes[0]['seconds']:.2f}s to the first step")


@pytest.mark.timeout(600)
def test_accumulation_by_require_backward_grad_sync_matches_torchrun(tmp_path: Path) -> None:
    """nanoGPT's idioms (tests/jobs/torchrun_accum.py): accumulation by assigning DDP's
    `require_backward_grad_sync` per micro-step, GradScaler + `unscale_` + `clip_grad_norm_` on the DDP
    model, lr written into `param_groups`, dropout from per-rank seeds. N=4 on 2 devices and on 3 (an
    uneven split) against real torchrun, and the run moved the model."""
    script = JOBS / "torchrun_accum.py"
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                          str(script), "--out=ref.pt", "--init=init.pt"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    assert ref.returncode == 0, f"torchrun failed:\n{ref.stdout}{ref.stderr}"
    reference = load_state(tmp_path / "ref.pt")
    for devices in (2, 3):
        run = cli("run", "--workers", "4", "--devices", str(devices), str(script), f"--out=m{devices}.pt",
                  cwd=tmp_path, timeout=RUN_TIMEOUT)
        assert run.code == 0, run.output
        assert run.out.count("iter 11: loss") == 1, run.output   # rank 0 alone logs, as under torchrun
        assert_ddp_close(reference, load_state(tmp_path / f"m{devices}.pt"))
    initial = load_state(tmp_path / "init.pt")
    # The embedding's N(0, 1) rows move ~0.5% in 12 small AdamW steps, the linear layers ~10%.
    assert all(rel_diff(initial[k], reference[k]) > 1e-3 for k in initial), "the reference did not train"


@pytest.mark.timeout(600)
def test_scale_at_counts_the_scripts_optimizer_steps_not_its_backward_passes(tmp_path: Path) -> None:
    """With gradient accumulation (2 micro-batches per iteration here) `--scale-at 3:1` restarts after rank
    0's third optimizer step, inside it: the script printed iterations 0 and 1 (it prints after its step),
    then, restarted from scratch (no checkpoint), every iteration. Counting backward passes, the restart came
    in the middle of iteration 1."""
    summary = tmp_path / "summary.json"
    run = cli("run", "--workers", "4", "--devices", "2", "--scale-at", "3:1", "--summary", str(summary),
              str(JOBS / "torchrun_accum.py"), "--iters=6", "--out=m.pt", cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    assert [run.out.count(f"iter {it}: loss") for it in range(6)] == [2, 2, 1, 1, 1, 1], run.output
    resizes = json.loads(summary.read_text())["resizes"]
    assert [(r["step"], r["outcome"]) for r in resizes] == [(3, "restarted")], resizes
    assert "restarting the torchrun-mode job on 1 device(s) after optimizer step 3; the script starts again " \
           "from its beginning" in run.err, run.err
    # Where each agent's time went, as after an @elastic job: the one agent of the restarted job, 4 workers.
    assert re.search(r"agent 0: 4 worker\(s\), compute [0-9.]+s/step .* over \d+ step\(s\)", run.err), run.err


@pytest.mark.timeout(600)
def test_killed_agent_restarts_the_job_from_its_checkpoint(torchrun_reference: dict[str, torch.Tensor],
                                                           tmp_path: Path) -> None:
    """SIGKILL of an agent once the first snapshot exists: an infrastructure failure, not the user's, so
    the job restarts on its devices and resumes from that snapshot, as torchrun with restarts would."""
    hold = tmp_path / "release"   # the first run waits after its first snapshot until this exists
    proc = subprocess.Popen([sys.executable, "-m", "elasticd", "run", "--workers", "4", "--devices", "2", str(SCRIPT),
                             *tutorial_args(tmp_path, "final.pt")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TUTORIAL_HOLD": str(hold)})
    try:
        wait_until(lambda: (tmp_path / "snapshot.pt").exists() or proc.poll() is not None, timeout=RUN_TIMEOUT,
                   what="the first epoch's snapshot")
        assert proc.poll() is None, "the job ended before an agent could be killed"
        victim = wait_until(lambda: next((p for r, p in agents_under(proc.pid) if r == 1), None), 60,
                            what="agent 1")
        victim.send_signal(signal.SIGKILL)
        hold.touch()
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        kill_session(proc.pid)
    assert proc.returncode == 0, out + err
    # One wording for a killed agent in both modes (an @elastic job's recovery says the same), and the
    # survivor's line keeps the backend's internals (gloo's source path) out.
    assert "agent 1 was killed by SIGKILL: restarting the torchrun-mode job on 2 device(s)" in err, err
    assert "restarted on 2 device(s)" in err and "pair.cc" not in err and "GLHF" not in err, err
    assert "Resuming training from snapshot at Epoch" in out, out
    assert_ddp_close(torchrun_reference, load_state(tmp_path / "final.pt"))


@pytest.mark.timeout(300)
def test_failing_worker_prints_its_traceback_and_is_not_retried(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(
        "import os\nimport torch.distributed as dist\n\n"
        "def check(rank):\n    if rank == 2:\n        raise ValueError('bad batch on rank 2')\n\n"
        "if __name__ == '__main__':\n    dist.init_process_group('gloo')\n    dist.barrier()\n"
        "    check(int(os.environ['RANK']))\n    dist.barrier()\n")
    run = cli("run", "--workers", "4", "--devices", "2", str(script), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 1, run.output
    assert "logical rank 2" in run.err and "ValueError: bad batch on rank 2" in run.err, run.err
    assert f'File "{script}", line 6, in check' in run.err, run.err
    assert "restart" not in run.err, run.err


@pytest.mark.timeout(300)
def test_sys_exit_status(tmp_path: Path) -> None:
    """`sys.exit(0)` ends a worker normally; another status fails the job, as that process would fail torchrun."""
    script = tmp_path / "exits.py"
    script.write_text("import os, sys\nimport torch.distributed as dist\n\nif __name__ == '__main__':\n"
                      "    dist.init_process_group()\n    dist.barrier()\n"
                      "    sys.exit(int(os.environ.get('STATUS', '0')) if os.environ['RANK'] == '3' else 0)\n")
    assert cli("run", "--workers", "4", str(script), cwd=tmp_path, timeout=RUN_TIMEOUT).code == 0
    bad = cli("run", "--workers", "4", str(script), cwd=tmp_path, timeout=RUN_TIMEOUT, env={"STATUS": "3"})
    assert bad.code == 1 and "logical rank 3" in bad.err and "sys.exit(3)" in bad.err, bad.output


PICKLES_SCRIPT_CLASSES = """
import io, os, sys
from dataclasses import dataclass
import torch
import torch.distributed as dist

@dataclass
class GPTConfig:
    n_layer: int = 2

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(float(i * i))

class Net(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc = torch.nn.Linear(2, 2)

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    model = Net(GPTConfig(n_layer=rank))
    torch.save({"model": model.state_dict(), "config": model.config}, f"ckpt{rank}.pt")   # build-nanogpt's
    torch.save(model, f"model{rank}.pt")
    dist.barrier()
    config = torch.load(f"ckpt{rank}.pt", weights_only=False)["config"]
    whole = torch.load(f"model{rank}.pt", weights_only=False)
    assert type(config) is GPTConfig and config.n_layer == rank, config
    assert type(whole) is Net and whole.config.n_layer == rank, whole
    # A spawned DataLoader worker gets the dataset pickled, and runs the script as its `__main__`.
    loader = torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    assert [b.tolist() for b in loader] == [[0.0, 1.0], [4.0, 9.0]]
    print("LOADED", rank, sys.modules["__main__"].__file__ == os.path.abspath(__file__), flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
def test_objects_of_the_scripts_classes_pickle_as_under_torchrun(tmp_path: Path) -> None:
    """Under torchrun the script is each rank's `__main__`, so pickle saves and finds its classes by the
    name `__main__.GPTConfig` (build-nanogpt's checkpoints hold its config dataclass), and a DataLoader
    under the `spawn` start method pickles the script's dataset for its worker processes. Each worker here
    runs the script in a module of its own; `sys.modules["__main__"]` answers with it in the worker's thread."""
    script = tmp_path / "pickles.py"
    script.write_text(PICKLES_SCRIPT_CLASSES)
    run = cli("run", "--workers", "4", "--devices", "2", str(script), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    assert sorted(line for line in run.out.splitlines() if line.startswith("LOADED")) == [
        f"LOADED {r} True" for r in range(4)], run.out
    # Each rank's checkpoint holds its own config, saved by reference to the class as torchrun's would be.
    assert b"__main__" in (tmp_path / "ckpt3.pt").read_bytes()


COMPILES_PER_RANK = """
import os
import torch
import torch.distributed as dist

class Config:
    width: int = 2

@torch.compile(backend="eager")
def newton_schulz(g):
    return 1.5 * g - 0.5 * g @ g.T @ g

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    for _ in range(2):  # every rank meets the cache entry the first rank of its agent compiled
        x = newton_schulz(torch.full((2, 2), 0.1 * (rank + 1)))
        dist.barrier()
    print("COMPILED", rank, round(x.sum().item(), 4), Config.__annotations__["width"] is int, flush=True)
"""


@pytest.mark.timeout(300)
def test_a_module_level_torch_compile_runs_in_every_rank_of_an_agent(tmp_path: Path) -> None:
    """modded-nanogpt compiles its Muon's Newton-Schulz function at the script's top level. The ranks an agent
    hosts ran one code object in namespaces of their own: dynamo's cache entry, made by the first rank, named
    a callable it had put in that rank's globals only, so the next rank failed with `NameError:
    __compiled_fn_...`. Each rank now compiles the script itself, as each torchrun process does, and without
    the agent's own `from __future__ import annotations` (annotations stay objects, as under `python`)."""
    script = tmp_path / "compiles.py"
    script.write_text(COMPILES_PER_RANK)
    run = cli("run", "--workers", "4", "--devices", "2", str(script), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    want = []
    for r in range(4):
        g = torch.full((2, 2), 0.1 * (r + 1))
        want.append(f"COMPILED {r} {round((1.5 * g - 0.5 * g @ g.T @ g).sum().item(), 4)} True")
    assert sorted(line for line in run.out.splitlines() if line.startswith("COMPILED")) == want, run.output


@pytest.mark.timeout(300)
def test_script_args_reach_sys_argv_as_torchrun_passes_them(tmp_path: Path) -> None:
    script = tmp_path / "argv.py"
    script.write_text("import os, sys\nif __name__ == '__main__':\n"
                      "    print('ARGV', os.environ['RANK'], sys.argv, flush=True)\n")
    run = cli("run", "--workers", "2", str(script), "5", "--batch_size=32", "-b", "3", "--", "--workers", "3",
              cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    args = [str(script), "5", "--batch_size=32", "-b", "3", "--workers", "3"]
    assert sorted(line for line in run.out.splitlines() if line.startswith("ARGV")) == [
        f"ARGV {r} {args!r}" for r in range(2)], run.out


def test_torchrun_mode_needs_workers(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('hello')\n")
    run = cli("run", str(script), cwd=tmp_path)
    assert run.code == 2 and "--workers N" in run.err and "torchrun mode" in run.err, run.output


# -- standalone: `python script.py` of a decorated script ------------------------------------------

def test_standalone_ddp_imported_by_name_in_a_helper_and_traceback(tmp_path: Path) -> None:
    """The helper module binds DistributedDataParallel before elasticd patches anything; standalone runs
    must still get the logical DDP, and a failing worker's own traceback must reach the terminal."""
    script = str(JOBS / "ddp_helper_standalone.py")
    ok = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert ok.returncode == 0 and "wrapper=LogicalDDP RANK=0 initialized=True" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                         env={**os.environ, "ELASTICD_TEST_FAIL_RANK": "2"})
    assert bad.returncode == 1
    assert "logical rank 2 failed" in bad.stderr and "in fail_here" in bad.stderr, bad.stderr
    launched = cli("run", script, "--devices", "2", cwd=tmp_path, env={"ELASTICD_TEST_FAIL_RANK": "2"},
                   timeout=RUN_TIMEOUT)
    assert launched.code == 1 and "in fail_here" in launched.err, launched.output


# -- in process ------------------------------------------------------------------------------------

def test_environment_is_per_worker_thread() -> None:
    worker_env.install()
    seen: dict[int, dict] = {}

    def body(rank: int, go: threading.Event, done: threading.Event) -> None:
        set_current_worker(Worker(rank, dist=DistState(env=worker_env.variables_for(rank, 4))))
        go.wait(10)
        os.environ["MASTER_PORT"] = str(30000 + rank)  # a worker's own variable: its view only
        del os.environ["GROUP_RANK"]
        seen[rank] = {"rank": os.environ["RANK"], "getenv": os.getenv("LOCAL_RANK"), "in": "GROUP_RANK" in os.environ,
                      "copy": os.environ.copy()["WORLD_SIZE"], "port": os.environ["MASTER_PORT"],
                      "len": len(os.environ) == len(list(os.environ)),
                      "child": subprocess.run([sys.executable, "-c", "import os; print(os.environ['RANK'])"],
                                              capture_output=True, text=True, check=True).stdout.strip()}
        done.set()

    go = threading.Event()
    dones = [threading.Event() for _ in range(2)]
    threads = [threading.Thread(target=body, args=(r, go, dones[r])) for r in range(2)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(30)
    assert seen == {r: {"rank": str(r), "getenv": str(r), "in": False, "copy": "4", "port": str(30000 + r),
                        "len": True, "child": str(r)} for r in range(2)}, seen
    assert "RANK" not in os.environ and os.environ.get("MASTER_PORT") != "30000"  # the process's own view
    os.environ["ELASTICD_TEST_PLAIN"] = "1"  # writes outside workers reach the real environment, as before
    try:
        assert subprocess.run([sys.executable, "-c", "import os; print(os.environ['ELASTICD_TEST_PLAIN'])"],
                              capture_output=True, text=True, check=True).stdout.strip() == "1"
    finally:
        del os.environ["ELASTICD_TEST_PLAIN"]


def test_process_group_lifecycle_inside_an_elastic_function() -> None:
    """The torchrun plumbing in @elastic functions: env ranks, a no-op init, a logical destroy."""
    seen: dict[int, tuple] = {}

    @elasticd.elastic(workers=2)
    def train(ctx):
        before = dist.is_initialized()
        dist.init_process_group("nccl", init_method="env://")  # any backend: nothing is formed
        t = torch.ones(1) * (ctx.rank + 1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        after, refused = dist.is_initialized(), False
        try:
            dist.barrier()  # as in torch: no collective once the group is destroyed
        except ValueError as e:
            refused = "not been initialized" in str(e)
        seen[ctx.rank] = (before, os.environ["RANK"], os.environ["WORLD_SIZE"], t.item(), after, refused)

    train()
    assert seen == {0: (True, "0", "2", 3.0, False, True), 1: (True, "1", "2", 3.0, False, True)}


@pytest.mark.timeout(300)
def test_elastic_function_with_torchrun_plumbing_on_two_agents(tmp_path: Path) -> None:
    """On 2 agents, `init_process_group` and `destroy_process_group` inside the function leave the agents'
    own group alone: neither raises ("initialize twice"), and the job ends 0 after training."""
    script = tmp_path / "plumbing.py"
    script.write_text(
        "import os\nimport torch\nimport torch.distributed as dist\nimport elasticd\n\n"
        "@elasticd.elastic(workers=4)\ndef train(ctx):\n"
        "    dist.init_process_group('gloo', init_method='env://')\n"
        "    t = torch.tensor([float(os.environ['RANK'])])\n    dist.all_reduce(t)\n"
        "    dist.destroy_process_group()\n"
        "    print(f'rank {os.environ[\"RANK\"]} of {os.environ[\"WORLD_SIZE\"]} sum {t.item():.0f} '\n"
        "          f'initialized {dist.is_initialized()}', flush=True)\n\n"
        "if __name__ == '__main__':\n    train()\n")
    run = cli("run", str(script), "--devices", "2", cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    assert sorted(line for line in run.out.splitlines() if line.startswith("rank ")) == [
        f"rank {r} of 4 sum 6 initialized False" for r in range(4)], run.out


def test_init_process_group_for_another_world_fails() -> None:
    @elasticd.elastic(workers=2)
    def train(ctx):
        dist.init_process_group("gloo", world_size=8, rank=ctx.rank)

    with pytest.raises(WorkerFailed, match="world_size=8.*2 logical workers"):
        train()


def test_second_init_fails_as_in_torch() -> None:
    @elasticd.elastic(workers=2)
    def train(ctx):
        dist.init_process_group()
        dist.init_process_group()

    with pytest.raises(WorkerFailed, match="initialize the default process group twice"):
        train()


def test_a_cuda_index_in_a_worker_means_the_agents_device() -> None:
    """What a CUDA agent installs (agent/compat/cuda_ranks.py), pointed at the CPU so it runs here: in a
    worker thread `x.to(local_rank)` and `model.to(local_rank)` land on the agent's device."""
    assert cuda_ranks.mapped(3, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert cuda_ranks.mapped("cuda:2", torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert cuda_ranks.mapped(torch.float16, torch.device("cuda", 0)) is torch.float16
    assert cuda_ranks.mapped(True, torch.device("cuda", 0)) is True
    worker_env.install()   # the per-worker os.environ the body reads LOCAL_RANK from (idempotent)
    cuda_ranks.install(torch.device("cpu"))
    try:
        got: dict[str, object] = {}

        def body() -> None:
            set_current_worker(Worker(3, dist=DistState(env=worker_env.variables_for(3, 4))))
            local_rank = int(os.environ["LOCAL_RANK"])
            got["tensor"] = torch.ones(2).to(local_rank).device
            got["dtype"] = torch.ones(2).to(local_rank, torch.float64).dtype
            got["module"] = torch.nn.Linear(2, 2).to(device=f"cuda:{local_rank}").weight.device

        t = threading.Thread(target=body)
        t.start()
        t.join(30)
        # (`.cuda(k)` is mapped the same way; torch refuses a CPU target for it, so it is not run here.)
        assert got == {"tensor": torch.device("cpu"), "dtype": torch.float64, "module": torch.device("cpu")}, got
        if not torch.cuda.is_available():
            with pytest.raises((RuntimeError, AssertionError)):  # outside workers: torch's own behaviour
                torch.ones(2).to(3)
    finally:
        cuda_ranks.uninstall()
    assert torch.Tensor.to is torch._C.TensorBase.to


def test_torch_accelerator_set_device_index_in_a_worker_means_the_agents_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.accelerator.set_device_index(local_rank)` reaches torch's C++ without `torch.cuda.set_device`:
    in a worker of a CUDA agent it must pick the agent's GPU too. Seen here at torch's C++ entry point."""
    chosen: list[int] = []
    monkeypatch.setattr(torch._C, "_accelerator_setDeviceIndex", chosen.append)
    worker_env.install()
    cuda_ranks.install(torch.device("cuda", 1))
    try:
        def body() -> None:
            set_current_worker(Worker(3, dist=DistState(env=worker_env.variables_for(3, 4))))
            torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))

        t = threading.Thread(target=body)
        t.start()
        t.join(30)
        torch.accelerator.set_device_index(3)   # outside workers: torch's own behaviour
    finally:
        cuda_ranks.uninstall()
    assert chosen == [1, 3]


# -- through the daemon ----------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_submit_runs_the_tutorial_script_with_its_args(cluster, torchrun_reference: dict[str, torch.Tensor],
                                                       tmp_path: Path) -> None:
    d = cluster.daemon(cpu=2, fake=False)
    sd = str(d.state_dir)
    run = cli("submit", str(SCRIPT), "--workers", "4", "--min-devices", "2", "--wait", "--state-dir", sd,
              *tutorial_args(tmp_path, "final.pt"), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    assert_ddp_close(torchrun_reference, load_state(tmp_path / "final.pt"))
    assert json.loads((tmp_path / "info3.json").read_text())["env"]["RANK"] == "3"
    # A device range lets the scheduler resize it (by restarts); without one it keeps one size.
    for extra, bounds in ((("--max-devices", "2"), (1, 2)), ((), (1, 1))):
        sub = cli("submit", str(SCRIPT), "--workers", "4", "--min-devices", "1", *extra, "--state-dir", sd,
                  *tutorial_args(tmp_path, "other.pt"), cwd=tmp_path)
        assert sub.code == 0, sub.output
        job = sub.out.strip()
        info = cli("status", job, "--json", "--state-dir", sd).json()["jobs"][0]
        assert (info["min_devices"], info["max_devices"]) == bounds, info
        assert cli("stop", job, "--state-dir", sd).code == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_submit_scale_at_restarts_a_torchrun_job_after_that_optimizer_step(
        cluster, torchrun_reference: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """`elasticd run --scale-at 12:1` above, under the daemon: the agents stop after optimizer step 12, every one
    restarts on 1 device, the script resumes from its checkpoint; the result is the undisturbed torchrun run's."""
    d = cluster.daemon(cpu=2, fake=False)
    run = cli("submit", str(SCRIPT), "--workers", "4", "--min-devices", "2", "--scale-at", "12:1", "--wait", "--json",
              "--state-dir", str(d.state_dir), *tutorial_args(tmp_path, "final.pt"), cwd=tmp_path, timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    info = json.loads(run.out)
    assert [(r["step"], r["from"], r["to"], r["why"], r["outcome"]) for r in info["resizes"]] == [
        (12, 2, 1, "--scale-at 12:1", "restarted")], info["resizes"]
    assert info["state"] == "finished" and info["devices"] == 1
    assert_ddp_close(torchrun_reference, load_state(tmp_path / "final.pt"))


RESTARTED = """\
import os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

if __name__ == "__main__":
    dist.init_process_group("gloo")
    out = sys.argv[1]
    open(os.path.join(out, f"rank{dist.get_rank()}.restart{os.environ['TORCHELASTIC_RESTART_COUNT']}"), "w").close()
    model = DDP(torch.nn.Linear(2, 1))
    while True:   # a step a pass (the backward) until the test releases every rank at once
        model(torch.ones(1, 2)).sum().backward()
        flag = torch.tensor([float(os.path.exists(os.path.join(out, "release")))])
        dist.all_reduce(flag)
        if flag.item():
            break
        time.sleep(0.02)
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_agent_restarts_a_torchrun_job_under_the_daemon_which_counts_the_restart(cluster, tmp_path: Path):
    """As torchrun restarts its workers: every rank starts again with TORCHELASTIC_RESTART_COUNT one higher,
    and the recovery is in the job's record once the restarted job steps."""
    from cluster import wait_state
    from daemon_jobs import job_info

    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    d = cluster.daemon(cpu=2, fake=False, own_forks=True)   # finds its agents by process tree
    sd = d.state_dir
    sub = cli("submit", str(script), "--workers", "2", "--min-devices", "2", "--state-dir", str(sd), str(tmp_path),
              cwd=tmp_path)
    assert sub.code == 0, sub.output
    job = sub.out.strip()
    wait_until(lambda: job_info(sd, job)["step"] >= 3, 120, what="the job to step")
    assert {f.name for f in tmp_path.glob("rank*.restart*")} == {"rank0.restart0", "rank1.restart0"}
    victim = next(p for r, p in agents_under(d.pid) if r == 1)
    victim.kill()
    info = wait_until(lambda: (i := job_info(sd, job))["recoveries"] and i, 120, what="the recovery to be recorded")
    (rec,) = info["recoveries"]
    assert "killed by SIGKILL" in rec["cause"] and rec["resumed_from"] == 0 and rec["devices"] == 2, rec
    assert {f.name for f in tmp_path.glob("rank*.restart1")} == {"rank0.restart1", "rank1.restart1"}
    (tmp_path / "release").touch()
    assert wait_state(sd, job, ("finished", "failed"), timeout=120)["state"] == "finished"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scale_restarts_a_torchrun_job_under_the_daemon_at_the_new_size(cluster, tmp_path: Path) -> None:
    """As torchelastic resizes: every rank stops and starts again on the new devices with
    TORCHELASTIC_RESTART_COUNT one higher; the step count goes on; the history says `restarted`."""
    from cluster import wait_state
    from daemon_jobs import job_info

    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    d = cluster.daemon(cpu=2, fake=False)
    sd = d.state_dir
    sub = cli("submit", str(script), "--workers", "2", "--min-devices", "1", "--max-devices", "2",
              "--state-dir", str(sd), str(tmp_path), cwd=tmp_path)
    assert sub.code == 0, sub.output
    job = sub.out.strip()
    before = wait_until(lambda: (i := job_info(sd, job))["step"] >= 3 and i, 120, what="the job to step")
    assert before["devices"] == 2
    scaled = cli("scale", job, "--devices", "1", "--state-dir", str(sd))
    assert scaled.code == 0 and "restarting on 1 devices" in scaled.out, scaled.output
    info = wait_until(lambda: (i := job_info(sd, job))["resizes"] and i["resizes"][-1]["outcome"] == "restarted"
                      and i, 120, what="the restart at the new size")
    [r] = info["resizes"]
    assert (r["from"], r["to"], r["why"]) == (2, 1, "scale command") and r["seconds"] > 0, r
    assert info["devices"] == 1 and info["step"] > before["step"] and info["recoveries"] == []
    assert {f.name for f in tmp_path.glob("rank*.restart1")} == {"rank0.restart1", "rank1.restart1"}
    (tmp_path / "release").touch()
    assert wait_state(sd, job, ("finished", "failed"), timeout=120)["state"] == "finished"
