"""`elasticd events`: the island's job and node events, as they happen."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import click

from elasticd.cli import client
from elasticd.core.lifecycle import JOB_ENDED
from elasticd.core.text import printable as safe

if TYPE_CHECKING:
    from elasticd.protocol import Event

_ENDS = JOB_ENDED
FOLLOW_POLL_S = 0.5   # how often -f asks; events are derived from the job table, so polling is all it takes


def render(e: Event) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at)) + f".{int(e.at * 1000) % 1000:03d}"
    subject = f"job {e.job}" if e.job else f"island {e.island}" if e.island else f"node {e.node}"
    return f"{when}  {safe(subject):<14} {safe(e.event):<16} {safe(e.detail)}"


def event_doc(e: Event) -> dict[str, Any]:
    """An event as `--json` prints it: its fields under their wire names, those that do not apply left out."""
    from elasticd.protocol import plain

    return {k: v for k, v in plain(e).items() if v is not None}


@click.command("events")
@click.argument("job_id", required=False, metavar="[JOB]")
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing events as they happen (with JOB: until the job ends; else until Ctrl-C).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per event and line (JSON Lines), so that a stream can be read as it comes.")
@click.option("--since", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Only events of the last SECONDS [default: every event the table holds].")
@client.client_options
@client.guarded()
def events(job_id: str | None, follow: bool, as_json: bool, since: float | None, **opts: object) -> None:
    """Print the island's events with their times, oldest first: for jobs submitted, placed, started,
    resizing/resized (or a resize aborted, failed, refused, rolled back), recovering/recovered, requeued,
    finished, failed, stopped; for nodes joined, rejoined, left, lost, draining, drained, undrained.

    Job events come from the job table (they survive a scheduler restart); node events from a log of the
    newest 1000 the scheduler keeps in memory. A client key sees its own jobs' events and the nodes'.
    Asked of a federation front (its --state-dir, or --endpoint): the jobs spanning islands (submitted,
    waiting, reserving, starting, running, recovering, finished, failed, stopped) and the islands
    (island_joined, island_lost, island_back, island_left).
    Each JSON object has `at` (Unix time), `event`, `job` or `node`, `detail`, and where they apply
    `from`, `to`, `step`, `seconds` (resizes), `seconds`, `steps_redone`, `detected_after` (recoveries).
    """
    from elasticd.protocol import Events

    after = max(0.0, time.time() - since) if since is not None else 0.0
    # Times are kept to the millisecond: an event recorded after our last poll can carry the same time as
    # the last one printed. So ask from a millisecond before it and skip those already printed at it.
    at_last: set[str] = set()
    ended = False
    with client.session(opts, as_json) as c:
        while True:
            reply = c.request(Events(job_id=job_id, after=max(0.0, after - 0.001)))
            for e in reply.events:  # type: ignore[attr-defined]
                at, doc = e.at, event_doc(e)
                key = json.dumps(doc, sort_keys=True)
                if at < after or (at == after and key in at_last):
                    continue
                click.echo(json.dumps(doc) if as_json else render(e))
                if at > after:
                    after, at_last = at, set()
                at_last.add(key)
                ended = ended or (job_id is not None and e.event in _ENDS)
            if reply.more:  # type: ignore[attr-defined]
                continue
            if not follow or ended:
                return
            time.sleep(FOLLOW_POLL_S)
