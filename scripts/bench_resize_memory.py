"""Memory across live resizes: does an agent hold on to the segments it has finished?

One `elasticd run --workers 4 --devices 2 --scale-at 3:1,6:2,9:1,12:2` of a job with a 12.6M-parameter
MLP under Adam (about 200 MiB of parameters, gradients and optimizer state) and 16 MiB of `ctx.private`
state per worker. Agent 0 stays in every segment; each time its logical rank 0 starts (once per
segment) it reports its process RSS. A resize that frees the segment before it leaves that RSS flat
from the first resize on; one that keeps it alive grows it by a segment's state per resize (the
private-state store and deterministic mode's autograd hooks each kept every segment once).

Prints agent 0's RSS at each segment start, and as the last line `rss_last_vs_first_resize=X.XX`: the
RSS at the last segment's start over that at the first resize's (1.00: nothing kept; about 2 when each
resize kept the segment before it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _benchjob_common import REPO, load_average

JOB = """
import os
import sys

import psutil
import torch

import elasticd


@elasticd.elastic(workers=4, deterministic=os.environ["BENCH_DETERMINISTIC"] == "1")
def train(ctx):
    torch.manual_seed(0)
    width, layers = int(os.environ["BENCH_WIDTH"]), 12
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = ctx.replicate(model, opt)
    mine = ctx.private(torch.zeros(4 << 20))
    if ctx.rank == 0:
        rss = psutil.Process().memory_info().rss
        print(f"[bench] segment start rss={rss}", file=sys.stderr, flush=True)
    for _ in ctx.steps(16):
        opt.zero_grad()
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step()
        mine.add_(1)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deterministic", action="store_true", help="run the job in deterministic mode")
    ap.add_argument("--width", type=int, default=1024, help="MLP width (12 layers; default 1024: 12.6M params)")
    ap.add_argument("--quick", action="store_true", help="smoke run: a 256-wide MLP (numbers not meaningful)")
    a = ap.parse_args()
    width = 256 if a.quick else a.width
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(textwrap.dedent(JOB))
        env = {**os.environ, "BENCH_DETERMINISTIC": "1" if a.deterministic else "0", "BENCH_WIDTH": str(width)}
        cmd = [sys.executable, "-m", "elasticd", "run", str(script), "--devices", "2",
               "--scale-at", "3:1,6:2,9:1,12:2"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark failed: exit {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rss = [int(m) / 2**20 for m in re.findall(r"\[bench\] segment start rss=(\d+)", proc.stderr)]
    if len(rss) != 5:
        raise SystemExit(f"expected 5 segment starts on agent 0 (4 resizes), saw {len(rss)}:\n{proc.stderr[-3000:]}")
    print(f"agent 0, {width}-wide MLP x 12 under Adam, 4 workers, 4 resizes "
          f"({'deterministic' if a.deterministic else 'default'} mode); {load_average()}")
    print("RSS at each segment start (MiB): " + " -> ".join(f"{r:.0f}" for r in rss))
    print(f"rss_last_vs_first_resize={rss[-1] / rss[1]:.2f}")


if __name__ == "__main__":
    main()
