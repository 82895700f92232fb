"""`elasticd logs`: a job's agent output."""

from __future__ import annotations

import json
import time

import click

from elasticd import client


@click.command("logs")
@click.argument("job_id", metavar="JOB")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (not with -f).")
@client.client_options
@client.guarded()
def logs(job_id: str, follow: bool, as_json: bool, **opts: object) -> None:
    """Print the stdout/stderr of JOB's agents on this node, each line prefixed with its agent rank.

    Agents on other nodes keep their logs in those nodes' state dirs (`elasticd logs` there).
    """
    from elasticd.protocol import Logs, Status

    if follow and as_json:
        raise click.UsageError("--json and --follow do not mix")
    offsets: dict[str, int] = {}
    with client.session(opts, as_json) as c:
        info = c.request(Status(job_id=job_id)).jobs[0]  # type: ignore[attr-defined]  # unknown job: exit 1
        node_id = ""
        collected: dict[str, str] = {}
        while True:
            reply = c.request(Logs(job_id=job_id, offsets=offsets))
            node_id = reply.node_id  # type: ignore[attr-defined]
            got = False
            for name, text in sorted(reply.chunks.items()):  # type: ignore[attr-defined]
                offsets[name] = reply.offsets[name]  # type: ignore[attr-defined]
                if not text:
                    continue
                got = True
                if as_json:
                    collected[name] = collected.get(name, "") + text
                    continue
                prefix = f"[{name.removesuffix('.log')}] "
                click.echo("".join(prefix + line for line in text.splitlines(keepends=True)), nl=False)
            if got:
                continue  # drain everything available before looking at the job's state
            if not follow or info.state in ("finished", "failed", "stopped"):
                break
            time.sleep(0.2)  # polling interval of `tail -f`-style output
            info = c.request(Status(job_id=job_id)).jobs[0]  # type: ignore[attr-defined]
    remote = [n for n in info.nodes if n != node_id]
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "node_id": node_id, "logs": collected, "other_nodes": remote}))
    elif remote:
        click.echo(f"(agents on {', '.join(remote)} log on those nodes)", err=True)
