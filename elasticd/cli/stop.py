"""`elasticd stop`: stop a job."""

from __future__ import annotations

import json

import click

from elasticd.cli import client


@click.command("stop")
@click.argument("job_id", metavar="JOB")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@client.client_options
def stop(job_id: str, as_json: bool, **opts: object) -> None:
    """Stop JOB: a queued job never starts; running agents stop at their next step boundary (and are
    terminated if they do not within a few seconds). Its devices are freed once its agents are gone."""
    from elasticd.protocol import Stop

    reply = client.call(opts, Stop(job_id=job_id), as_json)
    click.echo(json.dumps({"job_id": job_id, "message": reply.message}) if as_json  # type: ignore[attr-defined]
               else reply.message)  # type: ignore[attr-defined]
