"""Helpers shared by the end-to-end tests: tensor comparison, condition waits, running the CLI."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from elasticd.forked import SHARED_DIR_VAR

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "jobs"
T = TypeVar("T")
REFERENCE_WORKERS = 4  # N of the equivalence jobs
# The directory of this test process's shared fork servers (tests/conftest.py), "" while there are none.
SHARED_FORK_SERVERS = ""
# The same for daemons' spares: an agent server started with the environment a daemon gives its agents.
SHARED_DAEMON_FORK_SERVERS = ""


@dataclass(slots=True)
class Reference:
    """One job's result under plain torch DDP (agent/ddp_reference.py)."""

    initial: dict[str, torch.Tensor]  # logical rank 0's model before training
    final: dict[str, torch.Tensor]    # rank 0's state_dict after training


def rel_diff(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max|Δ| / max|ref| for one tensor (0 when both are all zero; inf when only ref is)."""
    ref, got = ref.detach().double(), got.detach().double()
    if ref.shape != got.shape:
        raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(got.shape)}")
    delta = (ref - got).abs().max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    if scale == 0.0:
        return 0.0 if delta == 0.0 else float("inf")
    return delta / scale


def rel_diffs(ref: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per-tensor rel_diff; the two state dicts must name the same tensors."""
    if set(ref) != set(got):
        raise ValueError(f"different tensors: only in ref {sorted(set(ref) - set(got))}, "
                         f"only in got {sorted(set(got) - set(ref))}")
    return {name: rel_diff(ref[name], got[name]) for name in ref}


def max_rel_diff(ref: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> float:
    """The worst per-tensor max|Δ| / max|p| over every tensor of two state dicts."""
    return max(rel_diffs(ref, got).values(), default=0.0)


def global_diff(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], keys: list[str]) -> float:
    """||got - want|| / ||want|| over the tensors `keys` name, taken together: a model's own figure, which a
    tensor whose gradient is round-off only (an attention key bias under Adam) cannot dominate."""
    num = sum(float((want[k].double() - got[k].double()).square().sum()) for k in keys)
    den = sum(float(want[k].double().square().sum()) for k in keys)
    return (num / den) ** 0.5 if den else float(num > 0)


def element_diff(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], keys: list[str]) -> float:
    """The largest elementwise |got - want| over `keys`, relative to the largest |want| among them."""
    delta = max((float((want[k].double() - got[k].double()).abs().max()) for k in keys if want[k].numel()),
                default=0.0)
    scale = max((float(want[k].double().abs().max()) for k in keys if want[k].numel()), default=0.0)
    return delta / scale if scale else delta


def torchrun(cwd: Path, script: Path, *args: str, ranks: int = REFERENCE_WORKERS, timeout: float = 240.0) -> None:
    """`script ARGS` under real torchrun, `ranks` processes over gloo, from `cwd`: the reference a torchrun-mode
    test compares with. Fails the test with torchrun's output.

    Run once more where a rank aborted in torch's own teardown ("terminate called without an active
    exception": gloo's threads still hold tensors while the interpreter finalizes, an upstream fault a
    script that calls destroy_process_group still meets now and then): the reference is torch's, and a
    fault of torch's exit is no verdict on what elasticd computes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(script), *args]
    for _ in range(2):
        run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if run.returncode == 0 or "terminate called without an active exception" not in run.stderr:
            break
    assert run.returncode == 0, f"torchrun failed:\n{run.stdout}{run.stderr}"


def ranks_saw(out: Path, ranks: int = REFERENCE_WORKERS) -> list[dict[str, Any]]:
    """What each rank of a tests/jobs/torchrun_*.py script recorded (OUT_DIR/rank{r}.pt; objects of the
    scripts' own classes included)."""
    sys.path.insert(0, str(JOBS))
    try:
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    finally:
        sys.path.remove(str(JOBS))


def torchrun_saw(tmp_path_factory: Any, script: Path) -> list[dict[str, Any]]:
    """What each rank of a tests/jobs/torchrun_*.py script records under real torchrun: the reference a
    module's tests compare elasticd's runs with (its module-scoped fixture)."""
    tmp = tmp_path_factory.mktemp(script.stem)
    torchrun(tmp, script, str(tmp))
    return ranks_saw(tmp)


def same(a: Any, b: Any) -> bool:
    """Exactly equal, through lists, tuples and dicts: tensors by dtype and value, everything else by ==."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def assert_ranks_saw_what_torchrun_showed(script: Path, devices: int, want: list[dict[str, Any]], tmp: Path) -> None:
    """`elasticd run` of a tests/jobs/torchrun_*.py script on `devices`: every rank recorded exactly `want`."""
    run = cli("run", "--workers", str(len(want)), "--devices", str(devices), str(script), str(tmp), cwd=tmp,
              timeout=240.0)
    assert run.code == 0, run.output
    for r, (theirs, ours) in enumerate(zip(want, ranks_saw(tmp, len(want)), strict=True)):
        assert theirs.keys() == ours.keys(), (r, set(theirs) ^ set(ours))
        differ = [k for k in theirs if not same(theirs[k], ours[k])]
        assert not differ, f"rank {r} saw other values than under torchrun: " \
                           f"{[(k, theirs[k], ours[k]) for k in differ]}"


def agent_processes() -> multiprocessing.context.BaseContext:
    """A multiprocessing context for test agents: each child forks from one server process that imported
    torch once (per test process), instead of importing it again itself as under "spawn" (seconds each on
    a busy machine). The server never touches a process group, so a forked child starts clean."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def wait_until(pred: Callable[[], T], timeout: float = 20.0, interval: float = 0.02, what: str = "") -> T:
    """Poll `pred` until it returns something truthy (returned); AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or pred}")
        time.sleep(interval)


@dataclass(slots=True)
class CliResult:
    code: int
    out: str
    err: str
    seconds: float
    session: int     # session id of the process tree (the launched process's pid)

    @property
    def output(self) -> str:
        """What a user would have seen on the terminal (stdout, then stderr)."""
        return self.out + self.err

    def json(self) -> Any:
        return json.loads(self.out)


def shared_servers() -> dict[str, str]:
    """What an `elasticd run` a test starts itself needs in its environment to take its fork servers from the
    suite's shared ones (as `cli` does): for runs whose processes the test does not look at."""
    return {SHARED_DIR_VAR: SHARED_FORK_SERVERS} if SHARED_FORK_SERVERS else {}


# Commands that only talk to a daemon or write keys: `cli` runs them in the test's process unless asked for an
# interpreter of its own. Not those that follow a job until it ends (`--wait`, `-f`): a hang there must be
# killable at `timeout`.
CLIENT_COMMANDS = frozenset({"status", "submit", "stop", "scale", "logs", "events", "keygen", "drain", "undrain",
                             "shutdown"})
FOLLOWING = frozenset({"--wait", "-f", "--follow"})


def cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 60.0, cwd: str | Path | None = None,
        process: bool = False) -> CliResult:
    """Run `elasticd ARGS`: a client command (CLIENT_COMMANDS) in this process through `cli_here` unless
    `process`, anything else as `python -m elasticd ARGS` in its own session; on timeout kill the whole
    session and fail.

    A new interpreter for each client command costs 0.16 CPU-s (a `submit` that imports its script, so
    torch, to read N: 3.9), taken from the agents the test waits for on a 2-core machine; the tests of the
    CLI as a program (exit codes, what a terminal shows) pass `process=True`.

    Its own session lets a hang be cleaned up completely and lets tests check that nothing the run started
    outlives it. `elasticd run` takes its fork servers from the suite's shared ones (tests/conftest.py), whose
    agents are outside that session: a test that looks at them passes `ELASTICD_FORKSERVER_DIR=""` in `env`.
    """
    if not process and args[:1] and args[0] in CLIENT_COMMANDS and not FOLLOWING & set(args):
        return cli_here(*args, env=env, cwd=cwd)
    start = time.monotonic()
    shared = shared_servers() if args[:1] == ("run",) else {}
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticd", *args], cwd=cwd or REPO, env={**os.environ, **shared, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(
            f"`elasticd {' '.join(args)}` still running after {timeout:.0f}s; output:\n{out}{err}") from None
    return CliResult(proc.returncode, out, err, time.monotonic() - start, proc.pid)


def cli_process(*args: str, **kw: Any) -> CliResult:
    """`cli` with an interpreter of its own for every command: the CLI as a user's shell runs it (the tests
    of exit codes and of what a terminal shows)."""
    return cli(*args, process=True, **kw)


def cli_here(*args: str, env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> CliResult:
    """Run `elasticd ARGS` in this process (click's test runner): the same command code as a new interpreter
    runs, `env` over this process's environment and `cwd` as the working directory while it runs (the CLI
    reads both: a submitted job's directory, a relative script). An exception the command lets out is exit
    code 1 with its traceback on stderr, as Python's own handler would print it."""
    import traceback

    from click.testing import CliRunner

    from elasticd.cli import main

    start = time.monotonic()
    here = os.getcwd()
    os.chdir(cwd or REPO)
    try:
        r = CliRunner().invoke(main, list(args), env=dict(env or {}), catch_exceptions=True)
    finally:
        os.chdir(here)
    err = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        err += "".join(traceback.format_exception(r.exception))
    return CliResult(r.exit_code, r.stdout, err, time.monotonic() - start, 0)


def session_pids(session: int) -> list[int]:
    """Live (non-zombie) processes in a session."""
    import psutil

    pids = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == session and p.info["status"] != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def kill_session(session: int) -> None:
    """SIGKILL every process of a session this test started (its leader's pid is the session id)."""
    for pid in session_pids(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def load_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def consumed(out: Path, rank: int, kept: bool = False) -> list[tuple[int, list[int]]]:
    """What logical rank `rank` of tests/jobs/resize_job.py consumed, batch by batch: (step, sample indices).

    `kept`: only what the run kept. After a recovery the job goes back to its snapshot's step and redoes the
    steps since: the log shows the step number falling, and the later attempt replaces the earlier one.
    """
    rows = [line.split() for line in (out / f"rank{rank}.log").read_text().splitlines()]
    seen = [(int(r[0]), [int(i) for i in r[1:]]) for r in rows]
    if not kept:
        return seen
    out_rows: list[tuple[int, list[int]]] = []
    for step, idx in seen:
        while out_rows and out_rows[-1][0] >= step:
            out_rows.pop()
        out_rows.append((step, idx))
    return out_rows


def completed_twice(out: Path, rank: int = 0) -> list[int]:
    """The steps logical rank `rank` of tests/jobs/resize_job.py completed (took its optimizer step) more than
    once: what a recovery computed again, by the job's own record."""
    steps = [int(s) for s in (out / f"done{rank}.log").read_text().split()]
    return sorted({s for s in steps if steps.count(s) > 1})


def assert_same_run(out: Path, ref: Path, steps: int, ranks: int, recovered: bool = False) -> None:
    """A run of tests/jobs/resize_job.py (in `out`) ended exactly as `ref` did: bitwise-equal parameters,
    every step run once by every logical rank, on the same samples, with the same private counters.
    `recovered`: the run restarted from a snapshot; what it kept (see `consumed`) must be all that."""
    want, got = torch.load(ref / "final.pt"), torch.load(out / "final.pt")
    assert set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs from the reference run"
    for rank in range(ranks):
        seen = consumed(out, rank, kept=recovered)
        assert [s for s, _ in seen] == list(range(steps)), f"rank {rank} skipped or repeated a step"
        assert seen == consumed(ref, rank), f"rank {rank} saw different samples"
        assert torch.equal(torch.load(out / f"seen{rank}.pt"), torch.load(ref / f"seen{rank}.pt"))
