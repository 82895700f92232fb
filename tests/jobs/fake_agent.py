"""A stand-in for `python -m agent` in control-plane tests: same command line, same control channel,
no torch (so daemon/scheduler tests run in a fraction of the time).

Behaviour comes from the environment (set per job with `elasticd submit --env`):
    FAKE_MODE   ok (default) | fail | hang | deaf | crash
                (deaf: ignores stop commands, needs SIGTERM; crash: exit 3 without an error report)
    FAKE_ONLY_RANK  apply FAKE_MODE to this physical rank only; the others run until killed
    FAKE_STEPS  steps before exiting in ok/fail mode (default 5)
    FAKE_STEP_S seconds per step (default 0.01)
    FAKE_OUT    directory: each agent writes rank<p>.json with its config and what it saw
    FAKE_LOG_CHARS  with each step also log 16 strings of this many characters (as `ctx.log` would pass them)
Live resize, as agent.process does it (a resize command at a step boundary; `--standby` agents wait for
a join command; ranks beyond the new world report `resized(left)` and exit 0):
    FAKE_RESIZE_CRASH   this physical rank exits 3 instead of re-forming (an agent dying mid-resize)
    FAKE_JOINER         ok (default) | fail: a standby agent fails to load the script (exit 1, error file)
    FAKE_JOINER_WAIT    a file: a standby agent says hello only once it exists (slow warm-up)
"""

from __future__ import annotations

import json
import os
import sys
import time

from elasticd import protocol as p
from elasticd.agent.control.zmq_channel import ZmqControl
from elasticd.core.agent_config import parse_args


def _as_job_script(elasticd) -> None:
    """Never called. Tests also submit this file as the job's script, standing for an @elastic one; the CLI
    tells those from torchrun scripts by an `elastic(...)` call in the source (agent/script_main.py)."""

    @elasticd.elastic(workers=1)
    def train(ctx) -> None: ...


def _polled(ctl) -> list[dict]:
    """The commands that arrived, as wire maps without the envelope: what FAKE_OUT records and tests read."""
    return [{k: v for k, v in m.to_wire().items() if k not in ("v", "rid")} for m in ctl.poll()]


def _error(cfg, ctl, message: str) -> None:
    err = p.AgentError(message=message, traceback=f"Traceback (fake)\n{message}\n", logical_rank=cfg.hosted[0],
                       host="fakehost")
    if cfg.error_file:
        with open(cfg.error_file, "w") as f:
            json.dump(err.as_dict(cfg.job_id, cfg.rank), f)
    if ctl:
        ctl.failed(err)


def _info(cfg) -> p.AgentInfo:
    return p.AgentInfo(world=cfg.world, hosted=list(cfg.hosted), pid=os.getpid(), host="fakehost", device="cpu")


def _join(cfg, ctl) -> dict | None:
    """Standby: warm up, say hello, wait for the join command."""
    wait = os.environ.get("FAKE_JOINER_WAIT")
    while wait and not os.path.exists(wait):
        time.sleep(0.01)
    if os.environ.get("FAKE_JOINER") == "fail":
        _error(cfg, ctl, "ImportError: fake joiner cannot load the script")
        return None
    ctl.hello(_info(cfg))
    while True:
        for cmd in _polled(ctl):
            if cmd.get("op") == "join":
                return cmd
        time.sleep(0.005)


def main() -> int:
    cfg = parse_args(sys.argv[1:])
    mode = os.environ.get("FAKE_MODE", "ok")
    if os.environ.get("FAKE_ONLY_RANK", str(cfg.rank)) != str(cfg.rank):
        mode = "deaf"   # FAKE_MODE applies to that rank only; the others run until killed
    steps = int(os.environ.get("FAKE_STEPS", "5"))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.01"))
    ctl = ZmqControl(cfg.control, cfg.job_id, cfg.rank) if cfg.control else None
    commands: list[dict] = []
    rank, world = cfg.rank, cfg.world
    try:
        if cfg.standby and ctl:
            join = _join(cfg, ctl)
            if join is None:
                return 1
            commands.append(join)
            rank, world = int(join["rank"]), int(join["world"])
            ctl.resized(p.ResizedInfo(epoch=None, world=world, rank=rank, left=False, seconds=0.001, blocks=""))
        elif ctl:
            ctl.hello(_info(cfg))
        print(f"fake agent {cfg.rank}/{cfg.world} of {cfg.job_id} hosting {cfg.hosted}", flush=True)
        if mode == "crash":
            print("crashing hard", flush=True)
            os._exit(3)
        step = 0
        while mode in ("hang", "deaf") or step < steps:
            time.sleep(step_s)
            step += 1
            if ctl:
                chars = int(os.environ.get("FAKE_LOG_CHARS", "0"))
                notes = {f"note{i}": f"{i}" * chars for i in range(16)} if chars else {}
                ctl.step(step, {"loss": 1.0 / step, **notes})
                got = _polled(ctl)
                commands += got
                if mode == "hang" and any(c.get("op") == "stop" for c in got):
                    print("stopping at step boundary", flush=True)
                    break
                for cmd in got:
                    if cmd.get("op") != "resize":
                        continue
                    if os.environ.get("FAKE_RESIZE_CRASH") == str(rank):
                        print("dying while re-forming", flush=True)
                        os._exit(3)
                    world = int(cmd["world"])
                    ctl.resized(p.ResizedInfo(epoch=cmd.get("epoch"), world=world, rank=rank, left=rank >= world,
                                              seconds=0.001, blocks=""))
                    if rank >= world:
                        print(f"left in resize {cmd.get('epoch')}", flush=True)
                        return 0
        if mode == "fail":
            _error(cfg, ctl, "ValueError: fake failure")
            print("failing", file=sys.stderr, flush=True)
            return 1
        if ctl:
            ctl.done(stopped=False)
        return 0
    finally:
        out = os.environ.get("FAKE_OUT")
        if out:
            with open(os.path.join(out, f"rank{cfg.rank}.json"), "w") as f:
                json.dump({"rank": cfg.rank, "world": cfg.world, "workers": cfg.workers, "hosted": cfg.hosted,
                           "master": [cfg.master_addr, cfg.master_port], "device": [cfg.device_type,
                           cfg.device_index], "cwd": os.getcwd(), "commands": commands, "pid": os.getpid(),
                           "steps": locals().get("step", 0), "final_world": world}, f)
        if ctl:
            ctl.close()


if __name__ == "__main__":
    sys.exit(main())
