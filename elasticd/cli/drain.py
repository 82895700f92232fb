"""`elasticd drain`: move every job off a node before it goes."""

from __future__ import annotations

import json

import click

from elasticd.cli import client


@click.command("drain")
@click.argument("node_id", metavar="NODE")
@click.option("--deadline", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Jobs that could not move off NODE within SECONDS fail, naming the drain [default: no "
                   "deadline: they keep running there until devices free up elsewhere or they end].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@client.client_options
def drain(node_id: str, deadline: float | None, as_json: bool, **opts: object) -> None:
    """Drain NODE (a preemption notice, maintenance): it takes no new work, and every job running on it
    moves off it live at its next step boundary, nothing redone.

    A job that has enough of its devices on other nodes (`--min-devices`) shrinks onto them, whichever
    of its ranks NODE hosts; one that has not first grows onto free devices elsewhere, then shrinks off.
    When the deadline passes, a job still on NODE (not enough devices elsewhere) fails with an error
    naming the drain; resubmit it or lower its --min-devices. `elasticd status` shows the node draining,
    then drained once no agent runs there: the node can go. `elasticd undrain NODE` puts it back.

    A portion of a job spanning islands is moved by its federation front: the whole job shrinks off the
    ranks NODE hosts, live, onto its agents elsewhere (on this island or others). One with no agent
    elsewhere fails at the deadline, and the front restarts it from its newest snapshot.

    A node daemon started with `--drain-grace SECONDS` drains itself this way on SIGTERM and exits once
    its agents are gone (or at the deadline).
    """
    from elasticd.protocol import Drain

    reply = client.call(opts, Drain(node_id=node_id, deadline_s=deadline), as_json)
    click.echo(json.dumps({"node_id": node_id, "message": reply.message}) if as_json  # type: ignore[attr-defined]
               else reply.message)  # type: ignore[attr-defined]
