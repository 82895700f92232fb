"""`elasticd logs`: a job's agent output."""

from __future__ import annotations

import json
import time

import click

from elasticd.cli import client


@click.command("logs")
@click.argument("job_id", metavar="JOB")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (not with -f).")
@client.client_options
@client.guarded()
def logs(job_id: str, follow: bool, as_json: bool, **opts: object) -> None:
    """Print the stdout/stderr of JOB's agents, each line prefixed with its agent's rank.

    Each node keeps its own agents' logs (STATE_DIR/logs/JOB); those of other nodes are fetched
    through the scheduler.
    """
    from elasticd.protocol import Logs, Status

    if follow and as_json:
        raise click.UsageError("--json and --follow do not mix")
    offsets: dict[str, dict[str, int]] = {}
    collected: dict[str, dict[str, str]] = {}
    unreachable: dict[str, str] = {}
    with client.session(opts, as_json) as c:
        info = c.request(Status(job_id=job_id)).jobs[0]  # type: ignore[attr-defined]  # unknown job: exit 1
        try:
            here = c.request(Logs(job_id=job_id, max_bytes=0)).node_id  # type: ignore[attr-defined]
        except client.ErrorReply:
            here = None   # talking to a scheduler, not a daemon: every node's logs are remote

        def fetch(node: str) -> bool:
            try:
                reply = c.request(Logs(job_id=job_id, node_id="" if node == here else node,
                                       offsets=offsets.get(node, {})))
            except client.ErrorReply as e:
                if node == here:
                    raise
                unreachable[node] = e.error.message
                return False
            unreachable.pop(node, None)
            got = False
            for name, text in sorted(reply.chunks.items()):  # type: ignore[attr-defined]
                offsets.setdefault(node, {})[name] = reply.offsets[name]  # type: ignore[attr-defined]
                if not text:
                    continue
                got = True
                if as_json:
                    files = collected.setdefault(node, {})
                    files[name] = files.get(name, "") + text
                else:
                    prefix = f"[{name.removesuffix('.log')}] "
                    click.echo("".join(prefix + line for line in text.splitlines(keepends=True)), nl=False)
            return got

        while True:
            nodes = ([here] if here is not None else []) + [n for n in info.nodes if n != here]
            if any([fetch(n) for n in nodes]):
                continue  # drain everything available before looking at the job's state
            if not follow or info.state in ("finished", "failed", "stopped"):
                break
            time.sleep(0.2)  # polling interval of `tail -f`-style output
            info = c.request(Status(job_id=job_id)).jobs[0]  # type: ignore[attr-defined]
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "logs": collected, "unreachable": unreachable}))
    for node, why in unreachable.items():
        click.echo(f"(logs of node {node} unavailable: {why})", err=True)
