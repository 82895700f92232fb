"""`elasticd islands`: the island table of a federation front."""

from __future__ import annotations

import json
import time

import click

from elasticd.cli import client


@click.command("islands")
@click.option("--jobs", "jobs", is_flag=True, help="Show the jobs spanning islands instead: state, why, and "
                                                   "each portion's island, ranks and state there.")
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@client.client_options
def islands(jobs: bool, job: str | None, as_json: bool, **opts: object) -> None:
    """Show the islands a federation front knows: state (up, lost, left), live nodes, free/total devices,
    jobs running and queued, and when each was last heard from. With --jobs [JOB]: the jobs spanning
    islands (`elasticd submit --islands`), or one of them.

    Ask the front at --endpoint tcp://HOST:PORT --server-key KEY (a client key allowed on its state dir), or
    the front whose state dir is --state-dir on this machine.
    """
    from elasticd.federation.server import sock_path
    from elasticd.protocol import ListIslands, plain
    from elasticd.statedir import StateDir
    from elasticd.transport import ipc_endpoint

    if not opts.get("endpoint"):
        path = sock_path(StateDir.resolve(opts.get("state_dir")))   # type: ignore[arg-type]
        if not path.exists():
            client.fail(client.EXIT_UNREACHABLE, f"no federation front serves {path.parent} (no {path.name}); "
                        "start one with `elasticd federation`, or pass --endpoint and --server-key", as_json)
        opts["endpoint"] = ipc_endpoint(path)
    if job and not jobs:
        raise click.UsageError("JOB is for --jobs: `elasticd islands --jobs JOB`")
    if jobs:
        from elasticd.cli import spanning
        from elasticd.protocol import ListSpans

        spanning.show(client.call(opts, ListSpans(span_id=job or ""), as_json).spans, as_json)  # type: ignore[attr-defined]
        return
    reply = client.call(opts, ListIslands(), as_json)
    rows = reply.islands  # type: ignore[attr-defined]
    if as_json:
        click.echo(json.dumps({"islands": [plain(i) for i in rows]}))
        return
    if not rows:
        click.echo("no island has joined this front")
        return
    click.echo(f"{'ISLAND':<16} {'STATE':<6} {'NODES':>5} {'FREE':>9} {'RUNNING':>7} {'QUEUED':>6}  LAST SEEN")
    now = time.time()
    for i in rows:
        c = i.capacity
        seen = f"{now - i.last_seen:.1f}s ago" + (f" ({i.reason})" if i.reason else "")
        if i.state == "up":
            click.echo(f"{i.island_id:<16} {i.state:<6} {c.nodes:>5} {f'{c.free}/{c.devices}':>9} {c.running:>7} "
                       f"{c.queued:>6}  {seen}")
        else:   # what it last reported is no capacity the federation has now (--json keeps it)
            click.echo(f"{i.island_id:<16} {i.state:<6} {'-':>5} {'-':>9} {'-':>7} {'-':>6}  {seen}")
