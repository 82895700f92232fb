"""A live grow through a real node daemon: warm spare agents (`--spares 1`) vs cold agent starts (`--spares 0`).

`elasticd scale JOB --devices 2` on a job running on 1 of the node's 2 CPU devices: the daemon starts
the joining agent, the scheduler waits until it is warm, then the job hands its workers over at its
next step boundary. With `--spares 1` the joiner is a spare that imported torch before it was needed;
with `--spares 0` it is a fresh `python -m agent`. Spares come two ways: forked from the daemon's fork
server, which imported torch once (the default), or each started cold and importing torch itself
(`ELASTICD_FORKSERVER=0`, agent/spare.py).

Each round runs every variant, each on a fresh daemon (throwaway state dir, embedded scheduler, no TCP):
scripts/_benchjob.py (N=4, trains until stopped) is submitted with --max-devices 1 and trains; with
spares the benchmark also waits until the spare that replaced the one the launch used says it is
ready (the steady state the pool keeps), and records how long after the submit that was: the time a
node is one spare short after each agent start, a cold spare's warm-up competing with the training for
the node's cores. Then it scales the job to 2 devices and reads the resize from `elasticd status
--json`: `seconds` (request -> first step at 2 devices, the scheduler's clock), `prepare_s` (request ->
every joiner warm: what spares cut) and `handover_s`.

The variants' order rotates from round to round; figures are medians. The last lines are
`daemon_grow_seconds=X.XX` (forked spares), `daemon_grow_seconds_cold=X.XX` (no spares) and
`daemon_grow_ratio=X.XX` (forked spares / no spares).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from _benchdaemon import BenchDaemon, wait_for
from _benchjob_common import JOB, BenchError, load_average, median, table, tempdir

WORKERS = 4
FIGURES = ("seconds", "prepare_s", "handover_s")


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both variants (default 3)")
    ap.add_argument("--width", type=int, default=128, help="MLP hidden width (default 128)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round")
    a = ap.parse_args()
    if a.quick:
        a.repeats = 1
    return a


# name -> (--spares, the daemon's extra environment)
VARIANTS = {"forked spares": (1, {}), "cold spares": (1, {"ELASTICD_FORKSERVER": "0"}), "no spares": (0, {})}


class Daemon(BenchDaemon):
    """`elasticd start` on 2 CPU devices with SPARES warm spare agents."""

    def __init__(self, root: Path, spares: int, env: dict[str, str]) -> None:
        super().__init__(root, 2, "--spares", str(spares), env=env)

    def spares_ready(self) -> int:
        try:
            return (self.sd / "spares.log").read_text().count(" ready in ")
        except OSError:
            return 0


def grow(root: Path, spares: int, env: dict[str, str], width: int) -> dict[str, float]:
    """One daemon, one job on 1 device grown to 2: the resize's figures from the job table."""
    d = Daemon(root, spares, env)
    try:
        knobs = {"WORKERS": WORKERS, "STEPS": 10**8, "WIDTH": width}
        envs = [x for k, v in knobs.items() for x in ("--env", f"ELASTICD_BENCH_{k}={v}")]
        if spares:
            wait_for(lambda: d.spares_ready() >= 1, 300, "the first spare to be ready")
        submitted = time.monotonic()
        job = d.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--max-devices", "1", *envs).strip()
        replaced = math.nan
        if spares:   # the launch used the first spare; its replacement must be warm, as the pool keeps it
            wait_for(lambda: d.spares_ready() >= 2, 300, "the replacement spare to be ready", interval=0.02)
            replaced = time.monotonic() - submitted
        wait_for(lambda: (j := d.job(job))["state"] == "running" and j["step"] >= 5, 300, "the job to train")
        d.cli("scale", job, "--devices", "2")
        info = wait_for(lambda: (j := d.job(job))["resizes"] and j["resizing"] is None and j, 300, "the grow")
        entry = info["resizes"][-1]
        if entry["outcome"] != "done" or entry["seconds"] is None:
            raise BenchError(f"the grow did not complete: {entry}")
        joiner = next(x for x in info["agents"] if x["rank"] == 1)
        if spares and f"started on spare agent pid {joiner['pid']}" not in d.out.read_text():
            raise BenchError(f"the joiner did not start on a spare:\n{d.out.read_text()[-3000:]}")
        d.cli("stop", job)
        return {**{k: float(entry[k]) for k in FIGURES}, "replaced_s": replaced}
    finally:
        d.close()


def main() -> None:
    a = _parse()
    figures: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in VARIANTS}
    names = list(VARIANTS)
    with tempdir() as tmp:
        for rnd in range(a.repeats):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                spares, env = VARIANTS[name]
                got = grow(Path(tmp) / f"{name.replace(' ', '_')}{rnd}", spares, env, a.width)
                for k, v in got.items():
                    figures[name][k].append(v)
            print(f"round {rnd + 1}/{a.repeats}: " + "  ".join(
                f"{name}: {k}={figures[name][k][-1]:.2f}" for name in names for k in FIGURES),
                file=sys.stderr, flush=True)
    rows = [[name, *(f"{m:.2f}" if not math.isnan(m := median(figures[name][k])) else "-"
                     for k in (*FIGURES, "replaced_s"))] for name in names]
    print(f"grow 1 -> 2 CPU devices through `elasticd scale`, N={WORKERS}, MLP width {a.width}, {a.repeats} "
          f"round(s), medians in seconds; {load_average()}")
    print(table(["daemon", "request->first step", "of which joiner warm-up", "hand-over",
                 "submit->spare replaced"], rows))
    warm, cold = median(figures["forked spares"]["seconds"]), median(figures["no spares"]["seconds"])
    print(f"daemon_grow_seconds={warm:.2f}")
    print(f"daemon_grow_seconds_cold={cold:.2f}")
    print(f"daemon_grow_ratio={warm / cold:.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
