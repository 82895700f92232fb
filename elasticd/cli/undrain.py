"""`elasticd undrain`: put a draining node back into service."""

from __future__ import annotations

import json

import click

from elasticd.cli import client


@click.command("undrain")
@click.argument("node_id", metavar="NODE")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@client.client_options
def undrain(node_id: str, as_json: bool, **opts: object) -> None:
    """Put NODE, drained or draining, back into service: it takes new work again. Jobs already moved off
    it stay where they are (the scheduler's policy grows elastic jobs into free devices as usual)."""
    from elasticd.protocol import Undrain

    reply = client.call(opts, Undrain(node_id=node_id), as_json)
    click.echo(json.dumps({"node_id": node_id, "message": reply.message}) if as_json  # type: ignore[attr-defined]
               else reply.message)  # type: ignore[attr-defined]
