"""`elasticd run`: run a job locally, no daemon."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from elasticd.cli import EXIT_USAGE
from elasticd.cli.script_args import ScriptCommand, split_target
from elasticd.core.cadence import DEFAULT_MAX_RESTARTS, DEFAULT_SNAPSHOT_EVERY, Every
from elasticd.core.watchdog import StuckAfter
from elasticd.protocol import limits as L

if TYPE_CHECKING:
    from elasticd.forked import ForkServer


def resolve_target(target: str, workers: int | None, script_args: tuple[str, ...] = (),
                   forks: Callable[[], ForkServer | None] | None = None) -> tuple[str, str | None, int]:
    """SCRIPT[:FUNC] and --workers -> (script, func, N), N from the script's decorator when not given:
    read from its source where it is a literal, else by importing the script with `sys.argv` as
    `python SCRIPT ARGS` gives it (a script that parses its arguments at the top must see its own): in a
    fork of the server `forks` gives (torch is imported there already, and the run's agents fork from it
    next), else here.

    Raises:
        click.UsageError: no such script, or no unambiguous @elastic function in it.
    """
    script, func = split_target(target)
    if not os.path.isfile(script):
        raise click.UsageError(f"no such script: {script}")
    torchrun = torchrun_mode(script)
    if not torchrun:
        refuse_skipped_main(script)
    if workers is None and func is None and torchrun:
        raise click.UsageError(f"{script} has no @elasticd.elastic function: it runs as under torchrun "
                               f"(torchrun mode), with N given by --workers N (torchrun's --nproc_per_node)")
    if workers is None:
        from elasticd.core.script_source import declared_workers

        try:
            workers = declared_workers(script, func)
        except SyntaxError as e:
            raise click.UsageError(f"{script} does not parse: {e}") from None
    if workers is None and forks is not None:
        server = forks()
        workers = forked_workers(server, script, func, script_args) if server is not None else None
    if workers is None:
        from elasticd.agent.script import ScriptError, load_function

        argv = sys.argv
        sys.argv = [os.path.abspath(script), *script_args]
        try:
            workers = load_function(script, func).workers
        except ScriptError as e:
            raise click.UsageError(str(e)) from None
        finally:
            sys.argv = argv
    return script, func, workers


def forked_workers(server: ForkServer, script: str, func: str | None, script_args: tuple[str, ...]) -> int | None:
    """N as a fork of `server` imports SCRIPT to read it (agent/__main__.py's `--workers-of`); None where
    the server cannot fork. The script's own output goes where ours does, as when it is imported here.

    Raises:
        click.UsageError: no unambiguous @elastic function in the script.
        SystemExit: the script's top level raised (exit 1, its traceback on stderr already) or exited (its
            code), or the process importing it was killed (exit 1, saying so).
    """
    import json

    from elasticd.core.agent_config import WORKERS_OF

    answer, end = os.pipe()
    try:
        proc = server.spawn([WORKERS_OF, str(end), os.path.abspath(script), func or "", *script_args],
                            os.environ, (end,))
        os.close(end)
        end = -1
        if proc is None:
            return None
        chunks = []
        while chunk := os.read(answer, 65536):
            chunks.append(chunk)
        code = proc.wait()
    finally:
        os.close(answer)
        if end >= 0:
            os.close(end)
    if not chunks:
        if code <= 0:
            from elasticd.core.failures import how_it_ended

            click.echo(f"Error: the process importing {script} to read N {how_it_ended(code)}", err=True)
        sys.exit(code if code > 0 else 1)
    reply = json.loads(b"".join(chunks))
    if "error" in reply:
        raise click.UsageError(reply["error"])
    return int(reply["workers"])


def refuse_skipped_main(script: str) -> None:
    """elasticd imports the script and calls its @elastic function itself, so its `if __name__ == "__main__":`
    block does not run. Refuse the script where that block does more than call the function in a way that
    can change the result (a seed there, and the job computes something else than `python SCRIPT` does,
    exit 0); say which lines are skipped where it only prints or computes values it leaves unused.

    Raises:
        click.UsageError: naming each statement and what to do.
    """
    from elasticd.core.script_source import skipped_main_code

    skipped = skipped_main_code(script)
    shown = "; ".join(f"line {n}: `{text}`" for n, text, _ in skipped)
    if any(significant for _, _, significant in skipped):
        raise click.UsageError(
            f"{script}: elasticd imports the script and calls its @elastic function itself, so its "
            f"`if __name__ == \"__main__\":` block does not run, and that block does more than call the "
            f"function ({shown}). It would be skipped here and under --ddp and submit, though `python {script}` "
            f"runs it. Move it into the function (a seed at its start), and leave the block calling the "
            f"function alone.")
    if skipped:
        click.echo(f"[elasticd] note: {script}'s `if __name__ == \"__main__\":` block does not run under elasticd, "
                   f"which calls the @elastic function itself: skipped {shown}", err=True)


def torchrun_mode(script: str) -> bool:
    """A script with no `@elastic` function runs its `__main__` once per logical worker (agent/script_main.py).

    Raises:
        click.UsageError: the script does not parse.
    """
    from elasticd.core.script_source import is_torchrun_script

    try:
        return is_torchrun_script(script)
    except SyntaxError as e:
        raise click.UsageError(f"{script} does not parse: {e}") from None


def check_every(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """--snapshot-every, checked before anything starts (exit 2 with the reason)."""
    try:
        return str(Every.parse(value))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def check_stuck_after(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """--stuck-after, checked before anything starts (exit 2 with the reason)."""
    try:
        return str(StuckAfter.parse(value))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def recovery_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--snapshot-every, --max-restarts and --stuck-after, alike on `run` and `submit`."""
    f = click.option("--stuck-after", default="auto", show_default=True, metavar="SECONDS|auto|off",
                     callback=check_stuck_after,
                     help="An agent whose process is stopped, or that the others have waited for inside a "
                          "collective, for this long is stuck: it is killed and the job recovers as from a killed "
                          "agent. auto: 900 s until three steps completed, then 20 times the slowest step lately, "
                          "at least 300 s. A slow agent that no one waits for is never fenced. off: never.")(f)
    f = click.option("--max-restarts", type=click.IntRange(min=0, max=10_000), default=DEFAULT_MAX_RESTARTS,
                     show_default=True,
                     help="Restarts after an infrastructure failure (an agent killed or out of memory, a node "
                          "lost) before the job fails. A worker that raises fails the job at once.")(f)
    return click.option("--snapshot-every", default=DEFAULT_SNAPSHOT_EVERY, show_default=True,
                        metavar="STEPS|SECONDSs", callback=check_every,
                        help="Snapshot the job every this many steps (20) or seconds (30s) into host memory, in the "
                             "background; after an infrastructure failure it restarts from the newest complete "
                             "one. 0: none (a failure restarts it from the beginning).")(f)


def agent_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--threads and --device-memory, alike on `run` and `submit`."""
    f = click.option("--device-memory", type=click.IntRange(min=1, max=L.MAX_DEVICE_MEMORY), default=None,
                     metavar="BYTES",
                     help="Per-device budget for replicated plus worker-private state (ctx.private); private "
                          "state beyond it is swapped to host memory between turns. Activations, cuBLAS "
                          "workspaces (the running worker's and autograd's, 32 MiB each on Hopper) and allocator "
                          "slack come on top.")(f)
    return click.option("--threads", type=click.IntRange(min=0, max=L.MAX_THREADS), default=0,
                        help="torch threads per agent (default: the machine's cores split between agents).")(f)


@click.command("run", cls=ScriptCommand, context_settings={"ignore_unknown_options": True})
@click.argument("target", metavar="SCRIPT[:FUNC]")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.option("--workers", "-n", type=click.IntRange(min=1), default=None,
              help="N logical workers (default: the script's @elastic(workers=N)).")
@click.option("--devices", "-m", type=click.IntRange(min=1), default=1, show_default=True,
              help="M devices (one agent process each); N logical workers are time-sliced over them.")
@click.option("--device-type", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--layout", "layout", metavar="B1,B2,...", default="",
              help="Logical workers per device, in device order (e.g. 6,2: a faster first device hosts more); "
                   "they sum to --workers, one per device, each >= 1. Default: as even as possible.")
@click.option("--scale-at", "scale_at", metavar="STEP:M[:B1/B2/...][,...]", default="",
              help="Resize live to M devices right after step STEP of ctx.steps (e.g. 10:2,20:1,30:4): STEP is the "
                   "last step at the old size. Optional block sizes give the new layout (10:2:6/2); at the same M "
                   "that is a live re-layout. A function that never enters ctx.steps cannot be resized (exit 1).")
@click.option("--summary", type=click.Path(dir_okay=False), default=None,
              help="Write a JSON summary (exit code, last step, resizes with their durations) here.")
@agent_options
@click.option("--snapshot-dir", type=click.Path(file_okay=False), default="",
              help="Where each resize's snapshot is kept until a step completed after it, so a resize that "
                   "fails half-way restarts from it (default: a private directory in /dev/shm, host memory).")
@recovery_options
@click.option("--ddp", is_flag=True,
              help="Run under plain torch DDP with N processes instead, as a reference to compare against.")
def run(target: str, script_args: tuple[str, ...], workers: int | None, devices: int, device_type: str, threads: int,
        device_memory: int | None, layout: str, scale_at: str, summary: str | None, snapshot_dir: str, snapshot_every: str,
        max_restarts: int, stuck_after: str, ddp: bool) -> None:
    """Run SCRIPT's @elastic function with N logical workers on M local devices.

    The result is what N real data-parallel workers would compute: same global batch, data order and
    random streams. A worker that raises stops the whole run, with its logical rank and traceback. An agent
    that dies (killed, out of memory) is not the job's fault: every agent is stopped and the job restarts
    from its newest periodic snapshot (see --snapshot-every, --max-restarts).

    A script with no @elastic function runs as under `torchrun --nproc_per_node N SCRIPT ARGS` (torchrun
    mode): its __main__ once per logical worker, with RANK, LOCAL_RANK, WORLD_SIZE, ... per worker.
    ARGS are the script's. An option of this command may also follow SCRIPT, except one the script
    declares itself (an argparse add_argument or click.option of that name, read from its source):
    that one is the script's, as under torchrun (a note on stderr says so). Everything after `--`
    is the script's.
    In torchrun mode a --scale-at STEP counts logical rank 0's optimizer steps (backward passes in a
    script with no optimizer) since the job started
    (restarts included: steps a restarted script does again count again), and a resize restarts every
    agent at the new size, as torchrun does: the script starts again from its beginning, and continues
    where it was only if it loads its own checkpoint.
    """
    env = None
    if script_args:
        import json

        from elasticd.core.env_names import ARGS_VAR

        env = {ARGS_VAR: json.dumps(list(script_args))}
    servers: list[ForkServer] = []   # the fork server that read N, once started
    try:
        script, func, workers = resolve_target(target, workers, script_args,
                                               None if ddp else lambda: _agent_server(servers, env))
        torchrun = func is None and torchrun_mode(script)
        if devices > workers:
            click.echo(f"Error: --devices {devices} is more than --workers {workers}: a device hosts at least one "
                       f"logical worker", err=True)
            sys.exit(EXIT_USAGE)
        schedule = parse_scale_at(scale_at, workers)
        blocks = parse_layout(layout, workers, devices)
        if device_type == "cuda" and not ddp:
            problem = _cuda_problem(max([devices, *(m for _, m, _ in schedule)]))
            if problem:
                click.echo(f"Error: {problem}", err=True)
                sys.exit(EXIT_USAGE)
        if ddp and torchrun:
            import subprocess

            # The reference for a torchrun script is torchrun itself.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers),
                   script, *script_args]
            sys.exit(subprocess.call(cmd))
        if ddp:
            from elasticd.reference_launch import run_native_ddp

            sys.exit(run_native_ddp(script, func, workers, env=env))   # each rank's sys.argv: [SCRIPT, *ARGS]
        from elasticd.local_node import run_on_node
        from elasticd.protocol import ScaleAt, Submit

        for server in servers:   # the node forks its agents from a server of its own
            server.close()
        top = max([devices, *(m for _, m, _ in schedule)])
        msg = Submit(script=os.path.abspath(script), func=func, workers=workers, min_devices=devices,
                     max_devices=devices, cwd=os.getcwd(), env=env or {}, snapshot_every=snapshot_every,
                     max_restarts=max_restarts, torchrun=torchrun, stuck_after=stuck_after,
                     scale_at=[ScaleAt(step=s, devices=m, blocks=b) for s, m, b in schedule], threads=threads,
                     device_memory=device_memory or 0, blocks=blocks)
        if snapshot_dir:
            os.makedirs(snapshot_dir, mode=0o700, exist_ok=True)
        sys.exit(run_on_node(msg, top, device_type, summary, os.path.abspath(snapshot_dir) if snapshot_dir else ""))
    finally:
        for server in servers:   # closed already where the run got as far as its node; closing is idempotent
            server.close()


def _agent_server(servers: list[ForkServer], env: dict[str, str] | None) -> ForkServer | None:
    """The run's agent fork server, started at its first use (reading N off a script that computes it)
    and kept in `servers` for the run's agents; None where forks are not supported."""
    from elasticd.forked import ForkServer, shared_server, supported

    if not servers and supported():
        full = {**os.environ, **(env or {})}
        servers.append(ForkServer(full, shared=shared_server("agent", full)))
    return servers[0] if servers else None


def _cuda_problem(devices: int) -> str | None:
    """Checked here, before any agent starts, so that too few GPUs is a usage error, not M agent crashes."""
    import torch  # only for --device-type cuda: `elasticd run` on CPU does not pay torch's import here

    from elasticd.core.agent_config import cuda_capacity_problem, shares_devices

    return cuda_capacity_problem(devices, torch.cuda.device_count(), shares_devices())


def parse_layout(text: str, workers: int, devices: int) -> list[int]:
    """--layout "6,2" -> [6, 2], with a usage error naming what is wrong ("" -> [], the uniform layout)."""
    from elasticd.core.layout import blocks_problem, parse_blocks

    try:
        blocks = parse_blocks(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--layout") from None
    problem = blocks_problem(workers, devices, blocks)
    if problem is not None:
        raise click.BadParameter(f"{problem} (--workers {workers}, --devices {devices})", param_hint="--layout")
    return blocks


def parse_scale_at(text: str, workers: int) -> list[tuple[int, int, list[int]]]:
    """"10:2,20:1:1,30:2:6/2" -> [(10, 2, []), (20, 1, []), (30, 2, [6, 2])], with a usage error for anything
    malformed (blocks: the new layout's sizes, "/"-separated; none: uniform)."""
    from elasticd.core.layout import blocks_problem, parse_blocks

    schedule = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        step, sep, rest = item.partition(":")
        devices, _, sizes = rest.partition(":")
        if not sep or not step.isdigit() or not devices.isdigit():
            raise click.BadParameter(f"{item!r} is not STEP:M[:B1/B2/...]", param_hint="--scale-at")
        if not 1 <= int(devices) <= workers:
            raise click.BadParameter(f"{item!r}: M must be between 1 and --workers {workers}",
                                     param_hint="--scale-at")
        try:
            blocks = parse_blocks(sizes.replace("/", ","))
        except ValueError:
            raise click.BadParameter(f"{item!r}: {sizes!r} is not block sizes like 6/2", param_hint="--scale-at") from None
        problem = blocks_problem(workers, int(devices), blocks)
        if problem is not None:
            raise click.BadParameter(f"{item!r}: {problem}", param_hint="--scale-at")
        schedule.append((int(step), int(devices), blocks))
    return schedule
