"""`elasticd scale`: change the number of devices a job runs on."""

from __future__ import annotations

import json
import os
import sys

import click

from elasticd.cli import EXIT_DAEMON_ERROR, client
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
    it has is a no-op; a grow needs the extra devices free.
    """
    from elasticd.protocol import Scale, Status

    info = client.call(opts, Status(job_id=job_id), as_json).jobs[0]  # type: ignore[attr-defined]
    if info.state == "running" and _torchrun_mode(info.script):
        message = (f"job {job_id} runs in torchrun mode: it has no step boundary to resize at, and restarting "
                   f"it at another size through the daemon is not implemented; stop it and submit it again "
                   f"with --min-devices {devices} (its checkpoint resumes it), or use `elasticd run --scale-at`")
        click.echo(json.dumps({"job_id": job_id, "error": message}) if as_json else f"Error: {message}",
                   err=not as_json)
        sys.exit(EXIT_DAEMON_ERROR)
    reply = client.call(opts, Scale(job_id=job_id, devices=devices), as_json)
    click.echo(json.dumps({"job_id": job_id, "message": reply.message}) if as_json  # type: ignore[attr-defined]
               else reply.message)  # type: ignore[attr-defined]


def _torchrun_mode(script: str) -> bool:
    from elasticd.core.script_source import is_torchrun_script

    try:
        return bool(script) and os.path.isfile(script) and is_torchrun_script(script)
    except SyntaxError:
        return False
