"""N computed by the script (neither a literal in its decorator nor a name bound once to one, which the
source gives): `elasticd run` reads it from a fork of its warm
agent fork server (agent/__main__.py's `--workers-of`), so the launcher does not import the script, nor
torch, itself; where forks are off it imports the script as before. The script's arguments, its errors and
its output reach the user as when the launcher imported it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from util import cli

# The top level parses its own arguments and appends its pid to OUT.tops on every execution.
COMPUTED = """\
import argparse, json, os
import elasticd

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
ARGS = parser.parse_args()
with open(f"{ARGS.out}.tops", "a") as f:
    f.write(f"{os.getpid()}\\n")
print("top level ran", flush=True)
N = int(os.environ.get("PROBE_WORKERS", "4"))


@elasticd.elastic(workers=N)
def train(ctx):
    with open(f"{ARGS.out}{ctx.rank}.json", "w") as f:
        json.dump({"world": ctx.world_size}, f)
"""


@pytest.mark.parametrize("forks", ["1", pytest.param("0", marks=pytest.mark.slow)], ids=["forked", "cold"])
def test_n_computed_at_import_is_read_without_importing_the_script_in_the_launcher(tmp_path: Path, forks: str
                                                                                   ) -> None:
    script = tmp_path / "computed.py"
    script.write_text(COMPUTED)
    out = tmp_path / "r"
    r = cli("run", str(script), "--devices", "2", "--out", str(out), env={"PROBE_WORKERS": "6",
                                                                          "ELASTICD_FORKSERVER": forks})
    assert r.code == 0, r.output
    assert [json.loads(Path(f"{out}{rank}.json").read_text())["world"] for rank in range(6)] == [6] * 6
    tops = [int(pid) for pid in Path(f"{out}.tops").read_text().split()]
    # once to read N, once per agent; in the launcher's own process only where forks are off
    assert len(tops) == 3 and (r.session in tops) == (forks == "0"), (r.session, tops)
    assert r.out.count("top level ran") == 3, r.out


def test_a_script_with_two_functions_is_a_usage_error_naming_them(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text("import os\nimport elasticd\nN = int(os.environ.get('N', '2'))\n"
                      "@elasticd.elastic(workers=N)\ndef f(ctx): pass\n"
                      "@elasticd.elastic(workers=N)\ndef g(ctx): pass\n")
    r = cli("run", str(script), "--devices", "1")
    assert r.code == 2 and "several elastic functions (f, g)" in r.err and "SCRIPT:FUNC" in r.err, r.output
    r = cli("run", f"{script}:g", "--devices", "2")
    assert r.code == 0, r.output


@pytest.mark.parametrize("top, code, said", [
    ("N = int(os.environ['NO_SUCH_VARIABLE'])", 1, "KeyError: 'NO_SUCH_VARIABLE'"),   # its traceback
    ("sys.exit(3)", 3, ""),                                                           # as `python SCRIPT` exits
    ("os.kill(os.getpid(), 9)", 1, "to read N was killed by SIGKILL"),
], ids=["raises", "exits", "killed"])
def test_a_script_whose_top_level_ends_the_process_ends_the_run_as_python_would_and_starts_no_agent(
        tmp_path: Path, top: str, code: int, said: str) -> None:
    script = tmp_path / "ends.py"
    script.write_text(f"import os, sys\nimport elasticd\n{top}\nN = int('2')\n@elasticd.elastic(workers=N)\ndef f(ctx): pass\n")
    r = cli("run", str(script), "--devices", "1")
    assert r.code == code and said in r.err, r.output
    if said.startswith("KeyError"):
        assert f'File "{script}", line 3' in r.err, r.err
    assert "[elasticd]" not in r.err, r.err   # no launcher line: nothing started


def test_n_bound_once_to_a_literal_is_read_from_the_source_without_running_the_top_level(tmp_path: Path) -> None:
    script = tmp_path / "constant.py"
    script.write_text(COMPUTED.replace('int(os.environ.get("PROBE_WORKERS", "4"))', "6"))
    out = tmp_path / "r"
    r = cli("run", str(script), "--devices", "2", "--out", str(out))
    assert r.code == 0, r.output
    assert [json.loads(Path(f"{out}{rank}.json").read_text())["world"] for rank in range(6)] == [6] * 6
    assert len(Path(f"{out}.tops").read_text().split()) == 2   # once per agent, and nowhere else
