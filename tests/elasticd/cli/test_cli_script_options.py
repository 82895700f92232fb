"""Arguments after SCRIPT named like an elasticd option: the script's when the script declares that option.

pytorch/examples' distributed DCGAN declares `--workers` (its DataLoader's processes). Run as torchrun runs
it, `elasticd run --workers 4 --devices 2 main.py --dataset fake --workers 2` ran 2 logical workers
instead of 4, the DCGAN's loader at its default, exit 0. End to end: a torchrun-mode script that declares
`--workers` and `-n` records what it got and the world it ran in.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from util import cli

from elasticd.cli.run import run
from elasticd.cli.script_args import declared_options, route
from elasticd.cli.submit import submit

SCRIPT = textwrap.dedent("""\
    import argparse, json, os, sys
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)   # a DataLoader's, as the DCGAN's
    parser.add_argument("-n", "--num-epochs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    with open(args.out.format(rank=dist.get_rank()), "w") as f:
        json.dump({"world": dist.get_world_size(), "workers": args.workers, "epochs": args.num_epochs,
                   "argv": sys.argv[1:]}, f)
    dist.destroy_process_group()
""")


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "loader_workers.py"
    path.write_text(SCRIPT)
    return path


def test_declared_options_are_read_from_argparse_and_click_calls(tmp_path):
    path = tmp_path / "s.py"
    path.write_text(textwrap.dedent("""\
        import argparse, click
        p = argparse.ArgumentParser()
        p.add_argument("--workers", "-j", type=int)
        p.add_argument("positional")
        @click.option("--devices", default=1)
        def f(devices): pass
    """))
    assert declared_options(str(path)) == {"--workers", "-j", "--devices"}
    (tmp_path / "bad.py").write_text("def (:\n")
    assert declared_options(str(tmp_path / "bad.py")) == set()
    assert declared_options(str(tmp_path / "missing.py")) == set()


@pytest.mark.parametrize("command, devices", [(run, "--devices"), (submit, "--min-devices")], ids=["run", "submit"])
def test_a_declared_option_after_the_script_goes_to_the_script(command, devices, script):
    notes: list[str] = []
    routed = route(command, ["--workers", "4", str(script), "--workers", "2", "--lr=0.1", devices, "2",
                             "-n", "3", "pos"], notes)
    # the devices option is elasticd's (the script does not declare it); --workers and -n are the script's
    assert routed == ["--workers", "4", str(script), devices, "2",
                      "--", "--workers", "2", "--lr=0.1", "-n", "3", "pos"]
    assert len(notes) == 2 and "--workers after" in notes[0] and "-n after" in notes[1]


def test_routing_keeps_what_was_right_before(script):
    notes: list[str] = []
    plain = ["job.py", "--devices", "2", "--scale-at", "5:1", "--lr", "0.5"]
    assert route(run, plain, notes) == ["job.py", "--devices", "2", "--scale-at", "5:1", "--", "--lr", "0.5"]
    assert route(run, ["--ddp", "job.py"], notes) == ["--ddp", "job.py"]
    after_dashes = [str(script), "--devices", "1", "--", "--devices", "x"]
    assert route(run, after_dashes, notes) == [str(script), "--devices", "1", "--", "--devices", "x"]
    assert route(run, ["--workers", "4"], notes) == ["--workers", "4"]   # no SCRIPT: click says so
    assert notes == []


def test_torchrun_mode_gets_its_own_workers_option(script, tmp_path):
    out = str(tmp_path / "rank{rank}.json")
    r = cli("run", "--workers", "4", "--devices", "2", str(script), "--workers", "0", "-n", "3", "--out", out,
            timeout=240)
    assert r.code == 0, r.output
    assert f"--workers after {script} is given to the script" in r.output
    got = [json.loads(Path(out.format(rank=k)).read_text()) for k in range(4)]
    assert {g["world"] for g in got} == {4}
    assert {(g["workers"], g["epochs"]) for g in got} == {(0, 3)}
    assert got[0]["argv"] == ["--workers", "0", "-n", "3", "--out", out]
