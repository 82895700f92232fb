"""A live grow through a real node daemon: warm spare agents (`--spares 1`) vs cold agent starts (`--spares 0`).

`elasticd scale JOB --devices 2` on a job running on 1 of the node's 2 CPU devices: the daemon starts
the joining agent, the scheduler waits until it is warm, then the job hands its workers over at its
next step boundary. With `--spares 1` the joiner is a spare that imported torch before it was needed
(agent/spare.py); with `--spares 0` it is a fresh `python -m agent`.

Each round runs both variants, each on a fresh daemon (throwaway state dir, embedded scheduler, no TCP):
scripts/_benchjob.py (N=4, trains until stopped) is submitted with --max-devices 1 and trains; with
spares the benchmark also waits until the spare that replaced the one the launch used says it is
ready (the steady state the pool keeps). Then it scales the job to 2 devices and reads the resize from
`elasticd status --json`: `seconds` (request -> first step at 2 devices, the scheduler's clock),
`prepare_s` (request -> every joiner warm: what spares cut) and `handover_s`.

Which variant goes first alternates from round to round; figures are medians. The last lines are
`daemon_grow_seconds=X.XX` (with spares), `daemon_grow_seconds_cold=X.XX` and `daemon_grow_ratio=X.XX`
(spares / cold).
"""

from __future__ import annotations

import argparse
import sys
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


class Daemon(BenchDaemon):
    """`elasticd start` on 2 CPU devices with SPARES warm spare agents."""

    def __init__(self, root: Path, spares: int) -> None:
        super().__init__(root, 2, "--spares", str(spares))

    def spares_ready(self) -> int:
        try:
            return (self.sd / "spares.log").read_text().count(" ready in ")
        except OSError:
            return 0


def grow(root: Path, spares: int, width: int) -> dict[str, float]:
    """One daemon, one job on 1 device grown to 2: the resize's figures from the job table."""
    d = Daemon(root, spares)
    try:
        knobs = {"WORKERS": WORKERS, "STEPS": 10**8, "WIDTH": width}
        envs = [x for k, v in knobs.items() for x in ("--env", f"ELASTICD_BENCH_{k}={v}")]
        job = d.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--max-devices", "1", *envs).strip()
        wait_for(lambda: (j := d.job(job))["state"] == "running" and j["step"] >= 5, 300, "the job to train")
        if spares:   # the launch used the first spare; its replacement must be warm, as the pool keeps it
            wait_for(lambda: d.spares_ready() >= 2, 300, "the replacement spare to be ready")
        d.cli("scale", job, "--devices", "2")
        info = wait_for(lambda: (j := d.job(job))["resizes"] and j["resizing"] is None and j, 300, "the grow")
        entry = info["resizes"][-1]
        if entry["outcome"] != "done" or entry["seconds"] is None:
            raise BenchError(f"the grow did not complete: {entry}")
        joiner = next(x for x in info["agents"] if x["rank"] == 1)
        if spares and f"started on spare agent pid {joiner['pid']}" not in d.out.read_text():
            raise BenchError(f"the joiner did not start on a spare:\n{d.out.read_text()[-3000:]}")
        d.cli("stop", job)
        return {k: float(entry[k]) for k in FIGURES}
    finally:
        d.close()


def main() -> None:
    a = _parse()
    figures: dict[str, dict[str, list[float]]] = {"spares": defaultdict(list), "cold": defaultdict(list)}
    with tempdir() as tmp:
        for rnd in range(a.repeats):
            order = [("spares", 1), ("cold", 0)]
            if rnd % 2:
                order.reverse()
            for name, spares in order:
                got = grow(Path(tmp) / f"{name}{rnd}", spares, a.width)
                for k, v in got.items():
                    figures[name][k].append(v)
            print(f"round {rnd + 1}/{a.repeats}: " + "  ".join(
                f"{name} {k}={figures[name][k][-1]:.2f}" for name in figures for k in FIGURES),
                file=sys.stderr, flush=True)
    rows = [[name, *(f"{median(figures[name][k]):.2f}" for k in FIGURES)] for name in figures]
    print(f"grow 1 -> 2 CPU devices through `elasticd scale`, N={WORKERS}, MLP width {a.width}, {a.repeats} "
          f"round(s), medians in seconds; {load_average()}")
    print(table(["daemon", "request->first step", "of which joiner warm-up", "hand-over"], rows))
    warm, cold = median(figures["spares"]["seconds"]), median(figures["cold"]["seconds"])
    print(f"daemon_grow_seconds={warm:.2f}")
    print(f"daemon_grow_seconds_cold={cold:.2f}")
    print(f"daemon_grow_ratio={warm / cold:.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
