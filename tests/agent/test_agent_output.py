"""The agents of a job share one stdout and stderr (a pipe to `elasticd run`, a node's job log): what
workers print arrives in whole lines, never one agent's text and another's newline spliced together, even
with PYTHONUNBUFFERED set (as the daemon sets it for agents, so that output shows at once)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from util import cli

LINES = 300
SCRIPT = f"""
import sys
import elasticd

@elasticd.elastic(workers=4)
def train(ctx):
    for i in range({LINES}):
        print(f"rank {{ctx.rank}} line {{i}} " + "x" * 100)
        print(f"rank {{ctx.rank}} err {{i}} " + "y" * 100, file=sys.stderr)

if __name__ == "__main__":
    train()
"""


def test_lines_printed_by_workers_on_two_agents_arrive_whole(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(SCRIPT)
    run = cli("run", str(script), "--devices", "2", env={"PYTHONUNBUFFERED": "1"}, cwd=tmp_path, timeout=240)
    assert run.code == 0, run.output
    for stream, text, word, fill in (("stdout", run.out, "line", "x"), ("stderr", run.err, "err", "y")):
        whole = re.compile(rf"rank (\d) {word} (\d+) {fill}{{100}}")
        got = [line for line in text.splitlines() if line.startswith("rank ") or f" {word} " in line]
        spliced = [line for line in got if not whole.fullmatch(line)]
        assert not spliced, f"{stream}: {len(spliced)} lines spliced, e.g. {spliced[:2]}"
        assert sorted(tuple(map(int, whole.fullmatch(line).groups())) for line in got) == [  # type: ignore[union-attr]
            (r, i) for r in range(4) for i in range(LINES)], f"{stream}: lines lost or repeated"


AT_EXIT = """
import atexit
import concurrent.futures
import os
import threading
import time
import elasticd

OUT = os.environ["EXIT_OUT"]
trace = open(os.path.join(OUT, f"trace-{os.getpid()}.txt"), "w")   # never closed, as scripts do
POOL = concurrent.futures.ThreadPoolExecutor(2)


def later():
    time.sleep(0.5)
    with open(os.path.join(OUT, f"thread-{os.getpid()}.txt"), "w") as f:
        f.write("joined")


atexit.register(lambda: open(os.path.join(OUT, f"atexit-{os.getpid()}.txt"), "w").write("ran"))


@elasticd.elastic(workers=4)
def train(ctx):
    for step in ctx.steps(3):
        trace.write(f"rank {ctx.rank} step {step}\\n")
    if ctx.rank == 0:
        # an executor kept and never shut down, as torch's compiler keeps one: its idle threads leave at exit
        POOL.submit(lambda: None).result()
    if ctx.rank == ctx.world_size - 1:
        threading.Thread(target=later).start()
        print("last words without a newline", end="")

if __name__ == "__main__":
    train()
"""


@pytest.mark.parametrize("start", ["forked", pytest.param("cold", marks=pytest.mark.slow)])
def test_an_agents_exit_keeps_what_interpreter_shutdown_would_write(tmp_path: Path, start: str) -> None:
    """Agents skip Python's module teardown at exit (elasticd/agent/process_exit.py), not what a job can see
    of it: a never-closed file's buffer, atexit handlers, a non-daemon thread, a print without a newline;
    and, as the interpreter, it does not wait on the idle threads of an executor never shut down."""
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT)
    out = tmp_path / "out"
    out.mkdir()
    env = {"EXIT_OUT": str(out), "ELASTICD_FORKSERVER": "1" if start == "forked" else "0"}
    run = cli("run", str(script), "--devices", "2", env=env, cwd=tmp_path, timeout=240)
    assert run.code == 0, run.output
    traces = sorted(out.glob("trace-*.txt"))
    assert len(traces) == 2, sorted(out.iterdir())
    lines = sorted(line for t in traces for line in t.read_text().splitlines())
    assert lines == sorted(f"rank {r} step {s}" for r in range(4) for s in range(3)), lines
    assert len(list(out.glob("atexit-*.txt"))) == 2, sorted(out.iterdir())
    assert [t.read_text() for t in out.glob("thread-*.txt")] == ["joined"], sorted(out.iterdir())
    assert "last words without a newline" in run.out, run.output


LOUD = """
import elasticd

@elasticd.elastic(workers=2)
def train(ctx):
    for step in ctx.steps(3):
        ctx.log(report="x" * 1000, **{f"m{i}": i for i in range(80)})

if __name__ == "__main__":
    train()
"""


def test_ctx_log_beyond_the_bounds_warns_in_the_jobs_output_once(tmp_path: Path) -> None:
    """A string longer than MAX_METRIC_CHARS is cut and more than MAX_METRICS names are dropped
    (protocol/limits.py), each said once in the job's own output, naming the bound."""
    script = tmp_path / "loud.py"
    script.write_text(LOUD)
    run = cli("run", str(script), "--devices", "1", cwd=tmp_path, timeout=240)
    assert run.code == 0, run.output
    assert run.err.count("a string of 1000 characters; status and metrics carry the first 256") == 1, run.err
    assert run.err.count("already 64 values are logged, the most a job reports") == 1, run.err
