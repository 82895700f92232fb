"""`elasticd scale`: change the number of devices a job runs on."""

from __future__ import annotations

import json

import click

from elasticd.cli import client
from elasticd.protocol import limits as L

# Only what cannot be sent (beyond msgpack's integers) is a usage error here; 0 or more than the job's N
# workers is the scheduler's to refuse (exit 1), with the job's own range in the message.


@click.command("scale")
@click.argument("job_id", metavar="JOB")
@click.option("--devices", "-m", type=click.IntRange(-L.MAX_WORKERS, L.MAX_WORKERS), required=True, help="M: the device count to run on (1..N).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@client.client_options
def scale(job_id: str, devices: int, as_json: bool, **opts: object) -> None:
    """Run JOB on M devices (1..N): a queued job starts on exactly M; a running one resizes live at its
    next step boundary, without losing or repeating a step (`status JOB` shows the resize history).

    The job then keeps M: the scheduler's policy no longer shrinks or grows it. Scaling to the size
    it has is a no-op; a grow needs the extra devices free. A torchrun-mode job (no @elastic function)
    resizes by restarting at the new size, as torchelastic does (see `elasticd submit --help`).
    """
    from elasticd.protocol import Scale

    reply = client.call(opts, Scale(job_id=job_id, devices=devices), as_json)
    click.echo(json.dumps({"job_id": job_id, "message": reply.message}) if as_json  # type: ignore[attr-defined]
               else reply.message)  # type: ignore[attr-defined]

