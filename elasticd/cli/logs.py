"""`elasticd logs`: a job's agent output."""

from __future__ import annotations

import json
import time

import click

from elasticd.cli import client
from elasticd.core.lifecycle import JOB_ENDED
from elasticd.core.text import printable


@click.command("logs")
@click.argument("job_id", metavar="JOB")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (not with -f).")
@click.option("--raw", is_flag=True, help="Print the output as the job wrote it, control characters included "
                                          "(escape sequences, carriage returns of progress bars).")
@client.client_options
@client.guarded()
def logs(job_id: str, follow: bool, as_json: bool, raw: bool, **opts: object) -> None:
    """Print the stdout/stderr of JOB's agents, each line prefixed with its agent and the logical ranks that
    agent hosts now (when the job ended, for an ended job): `[agent 1, ranks 4-7]`. An agent's file keeps
    its output across resizes, when it may have hosted other ranks.

    Control characters a job printed (terminal escape sequences, carriage returns, bells) are shown as
    \\xNN escapes unless --raw: a job's output cannot rewrite the terminal or hide the prefix of its line.

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
                    prefix = f"[{_who(name, info)}] "
                    shown = text if raw else printable(text, keep_newlines=True, keep_tabs=True)
                    # Lines end at newlines only: a carriage return (a progress bar's) stays inside its line.
                    *lines, last = shown.split("\n")
                    click.echo("".join(f"{prefix}{line}\n" for line in lines) + (prefix + last if last else ""),
                               nl=False)
            return got

        while True:
            nodes = ([here] if here is not None else []) + [n for n in info.nodes if n != here]
            if any([fetch(n) for n in nodes]):
                continue  # drain everything available before looking at the job's state
            if not follow or info.state in JOB_ENDED:
                break
            time.sleep(0.2)  # polling interval of `tail -f`-style output
            info = c.request(Status(job_id=job_id)).jobs[0]  # type: ignore[attr-defined]
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "logs": collected, "unreachable": unreachable}))
    for node, why in unreachable.items():
        click.echo(f"(logs of node {node} unavailable: {why})", err=True)


def _who(name: str, info: object) -> str:
    """`rank3.log` (the agent's file, by physical rank) as `agent 3, ranks 6-7` under the job's layout."""
    from elasticd.core.layout import Layout

    stem = name.removesuffix(".log")
    if not stem.startswith("rank") or not stem[4:].isdigit():
        return stem
    agent = int(stem[4:])
    try:
        layout = Layout.of(info.workers, info.devices, info.blocks)  # type: ignore[attr-defined]
    except ValueError:   # queued (0 devices), or a layout it does not describe: the agent alone
        return f"agent {agent}"
    if agent >= layout.world:
        return f"agent {agent}"   # an agent of an earlier, larger size
    ranks = layout.hosted(agent)
    shown = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return f"agent {agent}, {shown}"
