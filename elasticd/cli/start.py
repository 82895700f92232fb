"""`elasticd start`: the node daemon."""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

import click

from elasticd.cli import EXIT_DAEMON_ERROR, limit_options, limits_from, metrics_option

if TYPE_CHECKING:
    from elasticd.statedir import StateDir

DEFAULT_BIND = "tcp://127.0.0.1:7450"


def setup_logging(level: str, logfile: object | None = None) -> None:
    """Log to stderr and to `logfile` (rotating, opened without following a symlink).

    Exits with EXIT_DAEMON_ERROR and a one-line message when the log file cannot be opened safely.
    """
    from elasticd.logfiles import OneLineFormatter, open_log

    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if logfile is not None:
        try:
            handlers.append(open_log(str(logfile)))
        except OSError as e:
            click.echo(f"Error: cannot open the log file {logfile} safely ({e.strerror}; a symlink there is "
                       "refused): remove it, or use another --state-dir", err=True)
            sys.exit(EXIT_DAEMON_ERROR)
    formatter = OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=handlers, force=True)


def serving_state_dir(state_dir: str | None, log_level: str, log_name: str) -> StateDir:
    """The state dir a serving process (daemon, scheduler, federation front) runs in, created, with logging
    set up to stderr and to `log_name` in it. Exits with EXIT_DAEMON_ERROR when the dir is unsafe."""
    from elasticd.statedir import StateDir, UnsafeStateDir

    try:
        sd = StateDir.resolve(state_dir).create()
    except UnsafeStateDir as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_DAEMON_ERROR)
    setup_logging(log_level, sd.root / log_name)
    return sd


@click.command("start")
@click.option("--scheduler", default=None, metavar="tcp://HOST:PORT",
              help="Join this island scheduler instead of running an embedded one.")
@click.option("--scheduler-key", default=None, metavar="KEY",
              help="The scheduler's public key (Z85 text or its keys/id.key file); needed with --scheduler.")
@click.option("--bind", default=DEFAULT_BIND, show_default=True, metavar="tcp://HOST:PORT|none",
              help="TCP endpoint of the embedded scheduler, for other nodes and remote CLIs (CURVE); port 0 "
                   "picks a free one, 'none' serves local IPC only. Ignored with --scheduler.")
@click.option("--cpu-devices", type=click.IntRange(min=1), default=None, metavar="K",
              help="Offer K CPU devices (default: every CUDA device, else one CPU device).")
@click.option("--device-speed", default=None, metavar="SPEC",
              help="Declared relative speed of this node's devices, the scheduler's guess until it has measured "
                   "them: one value for all (0.5) or INDEX=SPEED per device (0=1.0,1=0.5; others 1.0). Faster "
                   "devices get more of a job's logical workers.")
@click.option("--pin-cpus/--no-pin-cpus", default=False, show_default=True,
              help="Bind each CPU device's agent to its own block of this machine's cores (cores / --cpu-devices "
                   "each): faster hand-overs between logical workers. Off by default because several daemons "
                   "sharing one machine would each cut the same blocks.")
@click.option("--relayout/--no-relayout", default=True, show_default=True,
              help="Re-lay running jobs out live (same devices, more logical workers on the faster ones) when "
                   "their devices' measured speeds drift; --no-relayout keeps the layout chosen at launch.")
@click.option("--state-dir", default=None, envvar="ELASTICD_STATE_DIR", metavar="DIR",
              help="Keys, sockets, logs and the job table [default: ~/.elasticd].")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address this node's agents are reachable on from other nodes (torch rendezvous).")
@click.option("--node-id", default=None, help="Name of this node in the island [default: hostname-hash].")
@click.option("--heartbeat", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Seconds between heartbeats to the scheduler.")
@click.option("--node-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds without heartbeats after which the (embedded) scheduler declares a node lost.")
@click.option("--spares", type=click.IntRange(min=0), default=None, metavar="K",
              help="Keep an agent process started ahead (torch imported, waiting for a job) for every idle "
                   "device and at least one, at most K [default: no limit], so that starting an agent, above "
                   "all for a live grow, skips the interpreter start and torch import (seconds). Each spare "
                   "holds a Python interpreter with torch imported (about 0.3 GB RSS). Jobs whose --env sets interpreter start-up variables (PYTHON*, LD_*, OMP_*, "
                   "CUDA_VISIBLE_DEVICES, ...) start cold. 0 disables.")
@click.option("--drain-grace", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM, drain this node first (as `elasticd drain NODE --deadline SECONDS`: its jobs "
                   "move to other nodes live) and exit once its agents are gone or SECONDS passed; a second "
                   "SIGTERM exits at once. 0: SIGTERM stops the agents at once. Set it to the notice a spot "
                   "instance gets.")
@click.option("--jobs-as", default=None, envvar="ELASTICD_JOBS_AS", metavar="USER",
              help="The Unix user jobs run as when their owner's key maps to none (`keygen --allow KEY --run-as "
                   "USER`). Only a daemon running as root can switch users [default: elasticd-job as root, else "
                   "this user: a daemon that is not root runs its jobs as itself, and they are as trusted as it].")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--agent-command", default=None, hidden=True,
              help="Command (space-separated) run instead of `python -m agent`; a test seam.")
@metrics_option
@limit_options
def start(scheduler: str | None, scheduler_key: str | None, bind: str, cpu_devices: int | None,
          state_dir: str | None, host: str, node_id: str | None, heartbeat: float, node_timeout: float,
          jobs_as: str | None, log_level: str, agent_command: str | None, spares: int | None, drain_grace: float,
          metrics: tuple[str, int] | None, device_speed: str | None, relayout: bool, pin_cpus: bool,
          **limits: object) -> None:
    """Run the node daemon in the foreground: own this node's devices and run jobs' agents on them.

    Without --scheduler it also runs the island's scheduler, reachable over CURVE-encrypted TCP at
    --bind by other nodes whose keys are on the allow-list (`elasticd keygen --allow`). The CLI on
    this machine reaches the daemon through an IPC socket in the state dir. Stop it with
    `elasticd shutdown`, SIGTERM or Ctrl-C: its agents are stopped with it (with --drain-grace, SIGTERM
    first moves its jobs to other nodes; see `elasticd drain --help`).
    """
    from elasticd import keys
    from elasticd.daemon.devices import parse_speeds
    from elasticd.daemon.server import DaemonConfig, DaemonError, NodeDaemon

    if device_speed is not None:
        try:
            parse_speeds(device_speed)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    sd = serving_state_dir(state_dir, log_level, "daemon.log")
    key = None
    if scheduler is not None and metrics is not None:
        raise click.UsageError("--metrics serves the island scheduler's metrics: give it to `elasticd scheduler` "
                               "(this node joins one with --scheduler); its agents and devices are there per node")
    if scheduler is not None:
        if scheduler_key is None:
            raise click.UsageError("--scheduler needs --scheduler-key (the scheduler's public key)")
        try:
            key = keys.parse_public_key(scheduler_key)
        except keys.BadKeyError as e:
            raise click.UsageError(str(e)) from None
    cfg = DaemonConfig(state_dir=sd, cpu_devices=cpu_devices, scheduler=scheduler, scheduler_key=key,
                       bind=None if bind.lower() == "none" else bind, host=host, node_id=node_id,
                       heartbeat_s=heartbeat, node_timeout_s=node_timeout,
                       agent_command=agent_command.split() if agent_command else None, spares=spares,
                       limits=limits_from(limits), drain_grace_s=drain_grace, metrics=metrics,
                       device_speed=device_speed, relayout=relayout, pin_cpus=pin_cpus, jobs_as=jobs_as)
    try:
        daemon = NodeDaemon(cfg)
    except DaemonError as e:
        hint = " (another daemon or scheduler there? pick another with --bind, or --bind none)" \
            if "cannot bind tcp" in str(e) else ""
        click.echo(f"Error: {e}{hint}", err=True)
        sys.exit(EXIT_DAEMON_ERROR)
    signal.signal(signal.SIGTERM, lambda *_: daemon.terminate())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop())
    info = daemon.info()
    click.echo(f"elasticd node {info['node_id']}: devices {','.join(info['devices'])}; "  # type: ignore[arg-type]
               f"scheduler {info['scheduler_tcp'] or info['scheduler']}; public key {info['public_key']}"
               + (f"; metrics and status page {info['metrics']}/" if info.get("metrics") else "")
               + f"; jobs run as {info['jobs_as']}" + ("" if daemon.jobs_as.switched else
                                                       " (this daemon's own user: jobs are as trusted as it)"),
               err=True)
    daemon.run()
