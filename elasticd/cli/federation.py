"""`elasticd federation`: a federation front that island schedulers join."""

from __future__ import annotations

import os
import signal
import sys

import click

from elasticd.cli import EXIT_DAEMON_ERROR, metrics_option


@click.command("federation")
@click.option("--bind", default="tcp://127.0.0.1:7460", show_default=True, metavar="tcp://HOST:PORT",
              help="TCP endpoint island schedulers and remote CLIs connect to (CURVE); port 0 picks a free one.")
@click.option("--state-dir", default=None, envvar="ELASTICD_STATE_DIR", metavar="DIR",
              help="The front's keys, allow-list and table of jobs spanning islands [default: ~/.elasticd].")
@click.option("--island-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds without a status after which an island is declared lost.")
@click.option("--reserve-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a job spanning islands waits for every island to hold its portion; then every "
                   "portion is released and the job waits for free devices again.")
@metrics_option
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def federation(bind: str, state_dir: str | None, island_timeout: float, reserve_timeout: float,
               metrics: tuple[str, int] | None, log_level: str) -> None:
    """Run a federation front: island schedulers join it (`elasticd scheduler --federation`), and it keeps
    the table of islands with what each has (live nodes, devices, free devices, jobs), shown by
    `elasticd islands`; and it splits jobs submitted to it with `elasticd submit --islands` into one
    portion per island, which each island's scheduler places on its own nodes.

    Each island scheduler presents a key allowed on this state dir with its island id (`elasticd keygen
    --allow KEY --role island --island-id ID --state-dir DIR`) and may speak for that island only;
    client keys may read the table, submit jobs spanning islands and stop their own. The front places
    nothing on a node itself: each island's scheduler keeps its own queue and nodes (docs/islands.md says
    what spans islands today and what does not).

    With --metrics, Prometheus metrics of its jobs (devices and workers per island, steps, restarts, live
    moves) and islands are at /metrics, and a status page at /.
    """
    from elasticd.cli.start import serving_state_dir
    from elasticd.daemon.server import DaemonError, lock_state_dir
    from elasticd.federation.server import FederationServer, info_path, sock_path
    from elasticd.keys import BadKeyError
    from elasticd.scheduler.store import StoreError
    from elasticd.transport import TransportError

    sd = serving_state_dir(state_dir, log_level, "federation.log")
    try:
        lock = lock_state_dir(sd, "federation")
        server = FederationServer(sd, bind=bind, timeout_s=island_timeout, reserve_timeout_s=reserve_timeout,
                                  metrics=metrics)
    except (DaemonError, TransportError, BadKeyError, StoreError, OSError) as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_DAEMON_ERROR)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.write_info()
    click.echo(f"elasticd federation front on {server.tcp_endpoint}; public key {server.public_key}"
               + (f"; metrics and status page {server.metrics_url}/" if server.metrics_url else ""), err=True)
    try:
        server.run()
    finally:
        for path in (info_path(sd), sock_path(sd)):
            path.unlink(missing_ok=True)
        os.close(lock)
