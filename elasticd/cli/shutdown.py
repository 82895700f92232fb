"""`elasticd shutdown`: stop the local daemon (or the scheduler at --endpoint)."""

from __future__ import annotations

import json
import time

import click

from elasticd.cli import client


@click.command("shutdown")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--no-wait", is_flag=True, help="Return once the daemon acknowledged, before it has exited.")
@client.client_options
def shutdown(as_json: bool, no_wait: bool, **opts: object) -> None:
    """Stop the daemon: its agents are stopped (their jobs fail) and, if it runs the island's
    scheduler, the scheduler stops too (its job table stays in the state dir for the next start)."""
    from elasticd.protocol import Shutdown
    from elasticd.statedir import StateDir, pid_alive, read_info

    sd = StateDir.resolve(opts.get("state_dir"))  # type: ignore[arg-type]
    info = read_info(sd.daemon_info) or read_info(sd.scheduler_info) or {}
    reply = client.call(opts, Shutdown(), as_json)
    pid = info.get("pid")
    if not no_wait and not opts.get("endpoint") and isinstance(pid, int):
        deadline = time.monotonic() + 30
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for another process to exit; there is nothing to block on
    click.echo(json.dumps({"message": reply.message}) if as_json else reply.message)  # type: ignore[attr-defined]
