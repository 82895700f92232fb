"""`elasticd status`: jobs and nodes of the island."""

from __future__ import annotations

import collections
import json
import time
from typing import TYPE_CHECKING, Any

import click

from elasticd.cli import client
from elasticd.core.lifecycle import JOB_ENDED, TOOK_EFFECT
from elasticd.core.records import ResizeEntry
from elasticd.core.text import printable as safe

if TYPE_CHECKING:
    from elasticd.protocol import JobInfo, NodeInfo, StatusReply


def job_doc(info: JobInfo) -> dict[str, Any]:
    """A job's row as `--json` prints it: the fields under their wire names (a resize's "from" and "to")."""
    from elasticd.protocol import plain

    return plain(info)


def _fmt_loss(metrics: dict[str, Any]) -> str:
    loss = metrics.get("loss")
    return f"{loss:.4g}" if isinstance(loss, int | float) else "-"


def _fmt_resizes(resizes: list[ResizeEntry]) -> str:
    """The resize history in a table cell: "4->2->1", the sizes a job went through, then how many of the
    resizes asked for ended otherwise, by outcome: "4->2 (1 refused)"."""
    if not resizes:
        return "-"
    took = [r for r in resizes if r.outcome in TOOK_EFFECT]
    path = "->".join([str(took[0].src)] + [str(r.dst) for r in took]) if took else "none"
    others = collections.Counter(r.outcome for r in resizes if r.outcome not in TOOK_EFFECT)
    return path + (f" ({', '.join(f'{n} {o}' for o, n in sorted(others.items()))})" if others else "")


def _fmt_resize(r: ResizeEntry) -> str:
    took = f" in {r.seconds:.2f}s" if r.seconds is not None else ""
    pause = (f" (hand-over {r.handover_s:.2f}s" + (f", training paused {r.stall:.2f}s" if r.stall is not None else "")
             + ")") if r.handover_s is not None else ""
    when = time.strftime("%H:%M:%S", time.localtime(r.at))
    note = f": {safe(r.note)}" if r.note else ""
    if r.blocks_to is not None:   # a re-layout: same devices, other blocks
        gain = r.predicted_gain
        what = (f"blocks {_blocks(r.blocks_from)} -> {_blocks(r.blocks_to)}"
                + (f" (predicted {100 * gain:.0f}% shorter step)" if gain is not None else ""))
        return (f"  {when}  re-layout {what} at step {r.step}  {r.outcome}{took}{pause}  "
                f"[{safe(r.reason)}]{note}")
    return (f"  {when}  {r.src} -> {r.dst} devices at step {r.step}  {r.outcome}"
            f"{took}{pause}  [{safe(r.why)}]{note}")


def _blocks(b: list[int] | None) -> str:
    return "/".join(str(x) for x in b) if b else "uniform"


def _fmt_layout(j: JobInfo) -> list[str]:
    """Speed-aware placement: the blocks, each agent's device and fitted speed, predicted vs measured step."""
    lay = j.layout
    if lay is None:
        return []
    meas = lay.measured_step_s
    lines = [f"layout     blocks {_blocks(j.blocks)}; step predicted {lay.predicted_step_s:.4f}s measured "
             + (f"{meas:.4f}s" if meas is not None else "-")
             + (f" (comm {lay.comm_s:.4f}s)" if lay.comm_s else "")]
    for a in lay.agents:
        c = a.worker_step_s
        lines.append(f"  rank {a.rank}  {safe(a.device)}  {a.workers} workers  speed {a.speed:.2f}  "
                     + (f"{c:.4f}s per worker-step" if c is not None else "not measured yet"))
    return lines


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _node_state(n: NodeInfo) -> str:
    if not n.alive:
        return "lost"
    d = n.draining
    if d is None:
        return "up"
    if d.drained:
        return f"drained ({d.seconds:.1f}s)"
    state = "draining" + (f" ({d.deadline_s:.0f}s left)" if d.deadline_s is not None else "")
    return state + (f": {safe(d.waiting)}" if d.waiting else "")


def _pending_request(j: JobInfo) -> bool:
    """A `scale` request the job has yet to carry out: none once it ended, or once it is at that size."""
    return bool(j.requested_devices) and j.requested_devices != j.devices and j.state not in JOB_ENDED


def render(reply: StatusReply) -> str:
    rows = [["JOB", "NAME", "STATE", "N", "DEVICES", "NODES", "STEP", "STEPS/S", "LOSS", "PRIO", "RESIZES"]]
    for j in reply.jobs:
        dev = str(j.devices) if j.devices else f"{j.min_devices}-{j.max_devices}"
        if j.resizing:
            dev += f" (->{j.resizing.dst})"
        elif _pending_request(j):
            dev += f" (->{j.requested_devices})"
        rows.append([safe(j.job_id), safe(j.name) or "-", j.state, str(j.workers), dev, safe(",".join(j.nodes)) or "-",
                     str(j.step),
                     f"{j.steps_per_s:.2f}" if j.steps_per_s else "-", _fmt_loss(j.metrics), str(j.priority),
                     _fmt_resizes(j.resizes)])
    out = [_table(rows) if reply.jobs else "no jobs"]
    if reply.nodes:
        nrows = [["NODE", "HOST", "STATE", "DEVICES", "FREE", "SPEEDS", "LAST SEEN"]]
        for n in reply.nodes:
            speeds = n.speeds
            nrows.append([safe(n.node_id), safe(n.host), _node_state(n), ",".join(n.devices) or "-",
                          str(len(n.free)), ",".join(f"{speeds[d]:.2f}" if d in speeds else "-" for d in n.devices)
                          or "-", f"{n.last_seen_s:.1f}s ago"])
        out += ["", _table(nrows)]
    return "\n".join(out)


def render_job(j: JobInfo) -> str:
    def ts(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

    lines = [f"job        {safe(j.job_id)}" + (f" ({safe(j.name)})" if j.name else ""),
             f"state      {j.state}",
             f"script     {safe(j.script)}" + (f"   (runs as {safe(j.run_as)})" if j.run_as else ""),
             f"workers    {j.workers} on {j.devices or '-'} devices (min {j.min_devices}, max {j.max_devices})"
             + (f", scale to {j.requested_devices} requested" if _pending_request(j) else ""),
             f"priority   {j.priority}",
             f"nodes      {safe(','.join(j.nodes)) or '-'}",
             f"step       {j.step}  ({j.steps_per_s:.2f} steps/s)  loss {_fmt_loss(j.metrics)}",
             f"submitted  {ts(j.submitted_at)}   started {ts(j.started_at)}   ended {ts(j.ended_at)}",
             f"resizes    {len(j.resizes)}" + (f" (resizing {j.resizing.src} -> {j.resizing.dst}: "
                                                  f"{j.resizing.phase}, snapshot parts saved "
                                                  f"{j.resizing.saved}/{j.resizing.parts})"
                                                  if j.resizing else "")]
    lines += [_fmt_resize(r) for r in j.resizes]
    if j.scale_at:
        lines.append("scale at   " + ", ".join(f"after step {e.step} -> {e.devices} device(s)"
                                                 + (f" (blocks {'/'.join(map(str, e.blocks))})" if e.blocks else "")
                                                 for e in j.scale_at))
    lines += _fmt_layout(j)
    snap = j.snapshot or {}
    if snap:
        step = snap.get("step", -1)
        lines.append(f"snapshot   {'none complete yet' if step is None or step < 0 else f'step {step}'}, "
                     f"{int(snap.get('bytes') or 0) / 2**20:.1f} MiB per agent in host memory (two at most: the "
                     f"complete one and the one being written)"
                     + (f"; OFF: {safe(snap['error'])}" if snap.get("error") else ""))
    lines.append(f"recoveries {len(j.recoveries)}")
    for r in j.recoveries:
        lines.append(f"  {ts(r.at)}  {safe(r.cause)}: resumed at step {r.resumed_from} "
                     f"({r.steps_redone} redone) on {r.devices} devices, first step "
                     f"{r.seconds}s after the failure was detected"
                     + (f"; the stuck agent had held the job {r.detected_after}s before it was fenced"
                        if r.detected_after else ""))
    for a in j.agents:
        lines.append(f"agent {a.rank}    {safe(a.node)}/{safe(a.device)} pid {a.pid} "
                     f"{'alive' if a.alive else 'exit ' + str(a.exitcode)} "
                     f"rss {a.rss / 2**20:.0f} MiB cpu {a.cpu}%")
    lines.append("history")
    for t, state, reason in j.history:
        lines.append(f"  {ts(t)}  {safe(state):<9} {safe(reason)}")
    if j.error:
        lines.append(f"error      {safe(j.error.get('message', ''))}"
                     + (f" (node {safe(j.error['node'])})" if j.error.get("node") else ""))
        if j.error.get("traceback"):
            lines.append(safe(str(j.error["traceback"]).rstrip(), keep_newlines=True))
    return "\n".join(lines)


@click.command("status")
@click.argument("job_id", required=False, metavar="[JOB]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@client.client_options
def status(job_id: str | None, as_json: bool, **opts: object) -> None:
    """Show jobs (state, N, devices, nodes, step, steps/s, last loss, resizes) and nodes; or one JOB in detail."""
    from elasticd.protocol import Status

    if job_id is not None:
        reply = client.call(opts, Status(job_id=job_id), as_json)
    else:
        reply = _all_pages(opts, as_json=as_json)
    if as_json:
        from elasticd.protocol import plain

        doc: dict[str, Any] = {"jobs": [job_doc(j) for j in reply.jobs],  # type: ignore[attr-defined]
                               "nodes": [plain(n) for n in reply.nodes]}  # type: ignore[attr-defined]
        click.echo(json.dumps(doc))
    elif job_id is not None:
        click.echo(render_job(reply.jobs[0]))  # type: ignore[attr-defined]
    else:
        click.echo(render(reply))


@client.guarded()
def _all_pages(opts: dict[str, Any], as_json: bool = False) -> Any:
    """The whole job list: the scheduler pages it so that every reply fits in a frame."""
    from elasticd.protocol import Status

    with client.session(opts, as_json) as c:
        reply = c.request(Status())
        jobs = list(reply.jobs)  # type: ignore[attr-defined]
        while reply.next_after:  # type: ignore[attr-defined]
            reply = c.request(Status(after=reply.next_after))  # type: ignore[attr-defined]
            jobs += reply.jobs  # type: ignore[attr-defined]
    reply.jobs = jobs  # type: ignore[attr-defined]
    return reply
