"""What a job prints or raises reaches the operator's terminal and the daemon's log escaped: terminal escape
sequences, carriage returns and bells shown as \\xNN in `elasticd logs` (as written with --raw), and every
record of daemon.log one line, so a job can neither rewrite the screen nor forge a log line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster import wait_state
from util import cli, wait_until

SCRIPT = r'''
import elasticd

@elasticd.elastic(workers=2)
def train(ctx):
    for step in ctx.steps(2):
        pass
    if ctx.rank == 0:
        print("title \x1b]0;pwned\x07 bell\a back\rover", flush=True)
        raise ValueError("bad input\n2026-01-01 00:00:00,000 ERROR elasticd.daemon.server: forged line")

if __name__ == "__main__":
    train()
'''


def test_a_jobs_output_and_error_are_escaped_in_logs_and_in_the_daemon_log(cluster, tmp_path: Path) -> None:
    d = cluster.daemon(cpu=1, fake=False)
    sd = d.state_dir
    script = tmp_path / "loud.py"
    script.write_text(SCRIPT)
    r = cli("submit", str(script), "--state-dir", str(sd), cwd=tmp_path)
    assert r.code == 0, r.output
    job = r.out.strip()
    wait_state(sd, job, "failed", timeout=240)
    shown = cli("logs", job, "--state-dir", str(sd))
    assert shown.code == 0, shown.output
    line = next(x for x in shown.out.split("\n") if "title" in x)
    assert line == r"[agent 0, ranks 0-1] title \x1b]0;pwned\x07 bell\x07 back\x0dover", repr(shown.out[-3000:])
    assert "\x1b" not in shown.out and "\r" not in shown.out and "\a" not in shown.out
    # As bytes: a text-mode pipe would turn the carriage return into a newline.
    raw = subprocess.run([sys.executable, "-m", "elasticd", "logs", job, "--raw", "--state-dir", str(sd)],
                         capture_output=True, timeout=60)
    assert b"title \x1b]0;pwned\x07 bell\a back\rover" in raw.stdout, raw.stdout[-1500:]
    log = wait_until(lambda: "forged line" in (sd / "daemon.log").read_text() and (sd / "daemon.log").read_text(),
                     30, what="the job's error in daemon.log")
    assert not any(x.startswith("2026-01-01 00:00:00,000 ERROR") for x in log.splitlines()), log[-3000:]
    assert r"bad input\x0a2026-01-01" in log, log[-3000:]
