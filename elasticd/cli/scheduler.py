"""`elasticd scheduler`: a standalone island scheduler."""

from __future__ import annotations

import signal
import sys

import click

from elasticd.cli import EXIT_DAEMON_ERROR, limit_options, limits_from, metrics_option


@click.command("scheduler")
@click.option("--bind", default="tcp://127.0.0.1:7450", show_default=True, metavar="tcp://HOST:PORT",
              help="TCP endpoint nodes and remote CLIs connect to (CURVE); port 0 picks a free one.")
@click.option("--state-dir", default=None, envvar="ELASTICD_STATE_DIR", metavar="DIR",
              help="Keys, allow-list and the job table [default: ~/.elasticd].")
@click.option("--heartbeat", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Heartbeat period the nodes are told to use.")
@click.option("--node-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds without heartbeats after which a node is declared lost.")
@click.option("--start-timeout", type=click.FloatRange(min=1.0), default=300.0, show_default=True,
              help="Seconds a job may take to get all its agents up before it fails.")
@click.option("--relayout/--no-relayout", default=True, show_default=True,
              help="Re-lay running jobs out live (same devices, more logical workers on the faster ones) when "
                   "their devices' measured speeds drift; --no-relayout keeps the layout chosen at launch.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--federation", default=None, metavar="tcp://HOST:PORT",
              help="Join the federation front there as island --island-id: it is told this island's nodes, "
                   "devices and jobs every heartbeat (`elasticd islands` on the front shows them).")
@click.option("--federation-key", default=None, metavar="KEY",
              help="The front's public key (Z85 text or certificate file).")
@click.option("--island-id", default=None, metavar="ID",
              help="This island's id at the front; the front's operator binds this scheduler's key to it "
                   "(`elasticd keygen --allow KEY --role island --island-id ID`).")
@metrics_option
@limit_options
def scheduler(bind: str, state_dir: str | None, heartbeat: float, node_timeout: float, start_timeout: float,
              relayout: bool, log_level: str, federation: str | None, federation_key: str | None,
              island_id: str | None, metrics: tuple[str, int] | None, **limits: object) -> None:
    """Run an island scheduler without a node daemon: nodes join it with `elasticd start --scheduler`.

    Nodes and clients must present a CURVE key on the allow-list of this state dir (`elasticd keygen
    --allow KEY --state-dir DIR`); they need this scheduler's public key (printed at start, and in
    DIR/keys/id.key). The job table lives in DIR/scheduler.db and survives restarts.
    """
    from elasticd.cli.start import serving_state_dir
    from elasticd.daemon.server import DaemonError, lock_state_dir
    from elasticd.keys import BadKeyError, parse_public_key
    from elasticd.observe.serving import watch_at
    from elasticd.protocol.limits import bad_island_id
    from elasticd.scheduler.server import Federation, SchedulerServer
    from elasticd.scheduler.state import Config
    from elasticd.transport import TransportError, ipc_endpoint

    link = None
    if (federation, federation_key, island_id) != (None, None, None):
        if None in (federation, federation_key, island_id):
            raise click.UsageError("--federation, --federation-key and --island-id go together")
        if (why := bad_island_id(island_id)):   # type: ignore[arg-type]
            raise click.BadParameter(why, param_hint="--island-id")
        try:
            link = Federation(federation, parse_public_key(federation_key), island_id)   # type: ignore[arg-type]
        except BadKeyError as e:
            raise click.BadParameter(str(e), param_hint="--federation-key") from None
    sd = serving_state_dir(state_dir, log_level, "scheduler.log")
    try:
        lock = lock_state_dir(sd, "scheduler")
        server = SchedulerServer(sd, bind=bind, local=ipc_endpoint(sd.scheduler_sock),
                                 config=Config(heartbeat_s=heartbeat, node_timeout_s=node_timeout,
                                               start_timeout_s=start_timeout, relayout_enabled=relayout), limits=limits_from(limits),
                                 watch=watch_at(metrics), federation=link)
    except (DaemonError, TransportError, RuntimeError, BadKeyError, OSError) as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_DAEMON_ERROR)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.write_info()
    click.echo(f"elasticd scheduler on {server.tcp_endpoint}; public key {server.public_key}"
               + (f"; metrics and status page {server.metrics_url}/" if server.metrics_url else ""), err=True)
    try:
        server.run()
    finally:
        for path in (sd.scheduler_info, sd.scheduler_sock):
            path.unlink(missing_ok=True)
        import os

        os.close(lock)
