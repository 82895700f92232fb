"""`elasticd submit`: queue a job on the island."""

from __future__ import annotations

import json
import os
import sys
import time

import click

from elasticd.cli import EXIT_DAEMON_ERROR, EXIT_OK, client
from elasticd.cli.run import agent_options, recovery_options
from elasticd.cli.script_args import ScriptCommand
from elasticd.core.lifecycle import JOB_ENDED
from elasticd.protocol import limits as L

TERMINAL = JOB_ENDED


def _env(items: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key or not (key.replace("_", "a").isalnum() and not key[0].isdigit()):
            raise click.BadParameter(f"not an environment variable name: {key!r}", param_hint="--env")
        if not sep:
            if key not in os.environ:
                raise click.BadParameter(f"{key} is not set in this environment", param_hint="--env")
            value = os.environ[key]
        if "\x00" in value:
            raise click.BadParameter(f"the value of {key} contains a NUL character", param_hint="--env")
        env[key] = value
    size = sum(len(k.encode()) + len(v.encode("utf-8", "surrogatepass")) for k, v in env.items())
    if len(env) > L.MAX_ENV_ITEMS or size > L.MAX_ENV_BYTES:
        raise click.BadParameter(f"{len(env)} variables of {size} bytes; at most {L.MAX_ENV_ITEMS} variables "
                                 f"and {L.MAX_ENV_BYTES} bytes are allowed", param_hint="--env")
    return env


@click.command("submit", cls=ScriptCommand, context_settings={"ignore_unknown_options": True})
@click.argument("target", metavar="SCRIPT[:FUNC]")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.option("--workers", "-n", type=click.IntRange(1, L.MAX_WORKERS), default=None,
              help="N logical workers (default: the script's @elastic(workers=N)).")
@click.option("--min-devices", type=click.IntRange(1, L.MAX_WORKERS), default=None,
              help="Start only when at least this many devices are free (gang) [default: 1, or --layout's "
                   "device count].")
@click.option("--max-devices", type=click.IntRange(1, L.MAX_WORKERS), default=None,
              help="Never use more [default: N].")
@click.option("--priority", type=click.IntRange(-L.MAX_PRIORITY, L.MAX_PRIORITY), default=0, show_default=True,
              help="Higher starts first.")
@click.option("--name", default="", help="A label shown by `status`.")
@click.option("--env", "env_items", multiple=True, metavar="KEY[=VALUE]",
              help="Set KEY in the agents' environment (repeatable); KEY alone copies it from here.")
@recovery_options
@agent_options
@click.option("--layout", "layout", metavar="B1,B2,...", default="",
              help="Logical workers per device, in device order (e.g. 6,2): the job runs on that many devices "
                   "(its --min-devices and --max-devices) with these block sizes, which the scheduler's "
                   "speed-aware re-layout then leaves alone. Default: the scheduler's choice.")
@click.option("--scale-at", "scale_at", metavar="STEP:M[:B1/B2/...][,...]", default="",
              help="Resize live to M devices right after step STEP of ctx.steps (e.g. 10:2,20:1): every agent "
                   "stops after STEP and waits for the resize, so it happens exactly there. Block sizes give the "
                   "new layout (10:2:6/2; at the same M a live re-layout), else the scheduler picks it. A grow "
                   "that finds too few free devices then is refused and recorded in the job's resizes; the job "
                   "goes on. A torchrun-mode script counts its optimizer steps and is restarted there, as "
                   "`elasticd run --scale-at` does.")
@click.option("--run-as", default="", metavar="USER",
              help="Admins only: the Unix user the job's agents run as on nodes whose daemon runs as root "
                   "[default: the one your key maps to, else each node's --jobs-as user].")
@click.option("--islands", "islands", metavar="A,B,...", default="",
              help="A job spanning islands: submit it to a federation front (--state-dir or --endpoint of the "
                   "front), which splits its devices over these islands (in rank order) by their free devices; "
                   "each island's scheduler holds its portion, and the job starts when every island holds one. "
                   "--max-devices is the total (default: N, or fewer if fewer are free). See docs/islands.md.")
@click.option("--max-islands", type=click.IntRange(1, 64), default=None,
              help="A job spanning islands, on at most this many islands the front picks (most free devices "
                   "first).")
@click.option("--wait", is_flag=True, help="Follow the job until it ends, with a progress line; exit 1 "
                                           "unless it finished.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@client.client_options
def submit(target: str, script_args: tuple[str, ...], workers: int | None, min_devices: int | None,
           max_devices: int | None,
           priority: int, name: str, env_items: tuple[str, ...], snapshot_every: str, max_restarts: int,
           stuck_after: str, device_memory: int | None, threads: int, layout: str, scale_at: str, run_as: str,
           islands: str, max_islands: int | None, wait: bool, as_json: bool, **opts: object) -> None:
    """Submit SCRIPT's @elastic function as a job and print its id.

    The scheduler starts it when at least --min-devices devices are free, on up to --max-devices
    devices (preferring a count that divides N), all agents at once. SCRIPT must be readable at the
    same path on every node; the job runs in the current directory when that exists there too.

    A script with no @elastic function runs as under torchrun (torchrun mode: see `elasticd run --help`).
    It has no step boundary to hand over at, so `scale`, a drain and the policy's shrinks and grows resize
    it as torchelastic does: every agent stops and the script starts again at the new size, from its own
    checkpoint if it loads one. Since each resize costs it the steps since that checkpoint, --max-devices
    defaults to --min-devices (one size) for such a script; give a range to let the policy resize it.
    ARGS are the script's; one spelled like an option
    here is elasticd's unless the script declares it itself or it follows `--` (see `elasticd run --help`).
    """
    from elasticd.cli.run import resolve_target, torchrun_mode
    from elasticd.core.env_names import ARGS_VAR
    from elasticd.protocol import ScaleAt, Submit

    why = L.bad_text("--name", name, L.MAX_NAME)
    if why:
        raise click.BadParameter(why, param_hint="--name")
    if run_as and (why := L.bad_user_name(run_as)):
        raise click.BadParameter(why, param_hint="--run-as")
    script, func, workers = resolve_target(target, workers, script_args)
    if not 1 <= workers <= L.MAX_WORKERS:
        raise click.UsageError(f"{target} asks for {workers} workers; at most {L.MAX_WORKERS} are allowed")
    torchrun = func is None and torchrun_mode(script)
    blocks = _layout(layout, workers, min_devices, max_devices)
    min_devices = min_devices or len(blocks) or 1
    hi = max_devices or len(blocks) or (min_devices if torchrun else workers)
    env = _env(env_items)
    if script_args:
        env[ARGS_VAR] = json.dumps(list(script_args))
    if not min_devices <= hi <= workers:
        raise click.UsageError(f"need --min-devices <= --max-devices <= --workers, got {min_devices} <= {hi} "
                               f"<= {workers}")
    if islands or max_islands:
        from elasticd.cli import spanning

        spanning.refuse_options(**{"--min-devices": min_devices > 1 and not blocks, "--layout": layout,
                                   "--scale-at": scale_at, "--run-as": run_as, "--device-memory": device_memory,
                                   "torchrun mode (a script without @elastic)": torchrun})
        job_id = spanning.submit(opts, script=os.path.abspath(script), func=func, workers=workers,
                                 devices=max_devices or 0, islands=spanning.parse_islands(islands),
                                 max_islands=max_islands or 0, priority=priority, name=name, cwd=os.getcwd(), env=env,
                                 snapshot_every=snapshot_every, threads=threads, max_restarts=max_restarts,
                                 as_json=as_json)
        _done(opts, job_id, wait, as_json, spanning.follow)
        return
    schedule = _schedule(scale_at, workers)
    msg = Submit(script=os.path.abspath(script), func=func, workers=workers, min_devices=min_devices,
                 max_devices=hi, priority=priority, name=name, cwd=os.getcwd(), env=env,
                 snapshot_every=snapshot_every, max_restarts=max_restarts, torchrun=torchrun, stuck_after=stuck_after,
                 run_as=run_as, scale_at=[ScaleAt(step=step, devices=m, blocks=b) for step, m, b in schedule], threads=threads,
                 device_memory=device_memory or 0, blocks=blocks)
    reply = client.call(opts, msg, as_json)
    _done(opts, reply.job_id, wait, as_json, _follow)  # type: ignore[attr-defined]


def _done(opts: dict, job_id: str, wait: bool, as_json: bool, follow) -> None:
    """Print the new job's id, or follow it until it ends (`--wait`) and exit as it did."""
    if not wait:
        click.echo(json.dumps({"job_id": job_id}) if as_json else job_id)
        return
    if not as_json:
        click.echo(job_id)
    sys.exit(follow(opts, job_id, as_json))


def _schedule(text: str, workers: int) -> list[tuple[int, int, list[int]]]:
    """--scale-at's (step, devices, blocks) entries by step, with a usage error for what the scheduler would
    refuse."""
    from elasticd.cli.run import parse_scale_at

    entries = sorted(parse_scale_at(text, workers), key=lambda e: e[0])
    if not entries:
        return []
    if (why := L.bad_scale_at([(step, m) for step, m, _ in entries], workers)):
        raise click.BadParameter(why, param_hint="--scale-at")
    return entries


def _layout(text: str, workers: int, lo: int | None, hi: int | None) -> list[int]:
    """--layout's block sizes ([] when not given), with a usage error for a layout the device bounds exclude."""
    from elasticd.cli.run import parse_layout
    from elasticd.core.layout import parse_blocks

    if not text:
        return []
    try:
        devices = len(parse_blocks(text))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--layout") from None
    blocks = parse_layout(text, workers, devices)
    if (lo or devices) != devices or (hi or devices) != devices:
        raise click.BadParameter(f"a layout of {devices} devices runs on {devices} devices: leave out "
                                 f"--min-devices/--max-devices or give {devices}", param_hint="--layout")
    return blocks


@client.guarded()
def _follow(opts: dict, job_id: str, as_json: bool) -> int:
    from elasticd.protocol import Status

    show = not as_json
    tty = sys.stderr.isatty()
    last_line = ""
    with client.session(opts, as_json) as c:
        while True:
            info = c.request(Status(job_id=job_id)).jobs[0]  # type: ignore[attr-defined]
            line = _progress(info)
            if show and line != last_line:
                click.echo(("\r\033[K" if tty else "") + line, err=True, nl=not tty)
                last_line = line
            if info.state in TERMINAL:
                break
            time.sleep(0.25)  # polling interval of a human-facing progress display
    if show and tty:
        click.echo("", err=True)
    if as_json:
        from elasticd.cli.status import job_doc

        click.echo(json.dumps(job_doc(info)))
    elif info.error:
        from elasticd.core.text import printable

        click.echo(f"job {job_id} {info.state}: {printable(info.error.get('message', ''))}", err=True)
        if info.error.get("traceback"):
            click.echo(printable(info.error["traceback"], keep_newlines=True), err=True)
    return EXIT_OK if info.state == "finished" else EXIT_DAEMON_ERROR


def _progress(info) -> str:
    width = 24
    total = info.metrics.get("total_steps") if isinstance(info.metrics.get("total_steps"), int) else None
    if total:
        # `step` is the index of the latest step reported, so a finished job's reads total - 1: show it whole
        step = total if info.state == "finished" else info.step
        done = min(width, int(width * step / max(1, total)))
        bar = f"[{'#' * done}{'.' * (width - done)}] {step}/{total}"
    else:
        bar = f"step {info.step}"
    loss = info.metrics.get("loss")
    extra = f" loss {loss:.4g}" if isinstance(loss, float) else ""
    rate = f" {info.steps_per_s:.2f} steps/s" if info.steps_per_s else ""
    return f"{info.job_id} {info.state:<9} {info.devices}/{info.workers} devices  {bar}{rate}{extra}"
