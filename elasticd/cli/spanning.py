"""Jobs spanning islands from the CLI: `elasticd submit --islands` to a federation front, their table in
`elasticd islands --jobs`, and `submit --wait`'s follow of one."""

from __future__ import annotations

import json
import sys
import time

import click

from elasticd.cli import EXIT_DAEMON_ERROR, EXIT_OK, client
from elasticd.protocol import limits as L

ENDED = ("finished", "failed", "stopped")


def parse_islands(text: str) -> list[str]:
    """--islands A,B: island ids in rank order (the first hosts rank 0)."""
    ids = [i.strip() for i in text.split(",") if i.strip()]
    for i in ids:
        if (why := L.bad_island_id(i)):
            raise click.BadParameter(why, param_hint="--islands")
    if len(set(ids)) != len(ids):
        raise click.BadParameter(f"{text!r} names an island twice", param_hint="--islands")
    return ids


def refuse_options(**given: object) -> None:
    """Options of an island's own jobs that a job spanning islands does not take, named in a usage error."""
    asked = [name for name, value in given.items() if value]
    if asked:
        raise click.UsageError(f"{', '.join(asked)}: not for a job spanning islands (--islands / --max-islands): "
                               "it runs at the size its front splits it to, is not resized, and its agents run "
                               "as each island's job user")


def submit(opts: dict, *, script: str, func: str | None, workers: int, devices: int, islands: list[str],
           max_islands: int, priority: int, name: str, cwd: str, env: dict[str, str], snapshot_every: str,
           threads: int, max_restarts: int, as_json: bool) -> str:
    """Submit it to the front; returns its id there."""
    from elasticd.protocol import SubmitSpanning

    msg = SubmitSpanning(script=script, func=func, workers=workers, devices=devices, islands=islands,
                         max_islands=max_islands, priority=priority, name=name, cwd=cwd, env=env,
                         snapshot_every=snapshot_every, threads=threads, max_restarts=max_restarts)
    return client.call(opts, msg, as_json).job_id  # type: ignore[attr-defined]


@client.guarded()
def follow(opts: dict, job_id: str, as_json: bool) -> int:
    """`submit --wait` of a job spanning islands: its state until it ends; the exit code."""
    from elasticd.protocol import ListSpans, plain

    tty = sys.stderr.isatty()
    last = ""
    with client.session(opts, as_json) as c:
        while True:
            span = c.request(ListSpans(span_id=job_id)).spans[0]  # type: ignore[attr-defined]
            # On a terminal one line, its step moving; in a log, a line per state or reason only.
            line = f"{span.span_id} {span.state:<10} " + (f"step {span.step}  " if tty else "") + span.reason
            if not as_json and line != last:
                click.echo(("\r\033[K" if tty else "") + line, err=True, nl=not tty)
                last = line
            if span.state in ENDED:
                break
            time.sleep(0.25)  # polling interval of a human-facing progress display
    if not as_json and tty:
        click.echo("", err=True)
    if as_json:
        click.echo(json.dumps(plain(span)))
    return EXIT_OK if span.state == "finished" else EXIT_DAEMON_ERROR


def show(spans: list, as_json: bool) -> None:
    from elasticd.core.text import printable
    from elasticd.protocol import plain

    if as_json:
        click.echo(json.dumps({"jobs": [plain(s) for s in spans]}))
        return
    if not spans:
        click.echo("no job spans these islands")
        return
    click.echo(f"{'JOB':<8} {'STATE':<10} {'WORKERS':>7} {'DEVICES':>7} {'STEP':>6}  ISLANDS")
    for s in spans:
        where = " ".join(f"{pt.island}:{pt.devices}" for pt in s.portions) or "-"
        click.echo(f"{s.span_id:<8} {s.state:<10} {s.workers:>7} {s.devices:>7} {s.step:>6}  {where}")
        click.echo(f"  {printable(s.reason)}")
        for pt in s.portions:
            err = f"  {printable(pt.error)}" if pt.error else ""
            click.echo(f"  portion {pt.index} on {pt.island}: ranks {pt.ranks}, {pt.workers} workers, "
                       f"{pt.job_id or '-'} {pt.state or '(not reported yet)'}{err}")
