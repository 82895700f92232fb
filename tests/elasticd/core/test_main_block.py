"""`elasticd run`, `--ddp` and `submit` import a decorated script and call its @elastic function themselves,
so its `if __name__ == "__main__":` block never runs: one that does more than call the function (a seed
there changed every result, exit 0) is refused with the lines it would skip."""

from __future__ import annotations

from pathlib import Path

import pytest
from util import cli

from elasticd.core.script_source import skipped_main_code

HEAD = "import sys\nimport torch\nimport elasticd\n\n@elasticd.elastic(workers=2)\ndef train(ctx):\n    pass\n\n"


@pytest.mark.parametrize("block, skipped", [
    ("if __name__ == '__main__':\n    train()\n", []),
    ("if __name__ == '__main__':\n    sys.exit(train())\n", []),
    ("if '__main__' == __name__:\n    torch.manual_seed(123)\n    train()\n", [(10, "torch.manual_seed(123)", True)]),
    ("def main():\n    print('setup')\n    train()\n\nif __name__ == '__main__':\n    main()\n", [(14, "main()", True)]),
    # Another way to run the script (a plain loop) in a branch of its own is not the job's code.
    ("def plain():\n    pass\n\nif __name__ == '__main__':\n    if len(sys.argv) > 5:\n        plain()\n"
     "    else:\n        train()\n", []),
    ("if __name__ == '__main__':\n    if len(sys.argv) > 5:\n        torch.manual_seed(1)\n        train()\n"
     "    else:\n        train()\n", [(11, "torch.manual_seed(1)", True)]),
    # What cannot change the result is listed as such: a print, a value left unused.
    ("if __name__ == '__main__':\n    if len(sys.argv) > 1:\n        n = int(sys.argv[1])\n"
     "    print(torch.__version__)\n    train()\n", [(10, "if len(sys.argv) > 1:", False), (12, "print(torch.__version__)", False)]),
    ("if __name__ == '__main__':\n    torch.backends.cudnn.benchmark = True\n    train()\n",
     [(10, "torch.backends.cudnn.benchmark = True", True)]),
    # A block that does not run the job is not how the job runs.
    ("if __name__ == '__main__':\n    print('see the README')\n", []),
])
def test_what_the_main_block_would_skip(tmp_path: Path, block: str, skipped: list) -> None:
    script = tmp_path / "train.py"
    script.write_text(HEAD + block)
    assert skipped_main_code(str(script)) == skipped


@pytest.mark.parametrize("args", [("run", "--devices", "1"), ("run", "--ddp"), ("submit",)])
def test_a_main_block_that_does_more_is_refused_before_anything_starts(tmp_path: Path, args: tuple) -> None:
    script = tmp_path / "train.py"
    script.write_text(HEAD + "if __name__ == '__main__':\n    torch.manual_seed(123)\n    train()\n")
    r = cli(args[0], str(script), *args[1:], "--state-dir", str(tmp_path / "sd")) if args[0] == "submit" else \
        cli(*args[:1], str(script), *args[1:])
    assert r.code == 2, r.output
    assert "line 10: `torch.manual_seed(123)`" in r.err and "Move it into the function" in r.err, r.err


def test_a_main_block_that_only_prints_runs_with_a_note(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HEAD + "if __name__ == '__main__':\n    print('starting')\n    train()\n")
    r = cli("run", str(script), "--devices", "1")
    assert r.code == 0, r.output
    assert "note:" in r.err and "skipped line 10: `print('starting')`" in r.err, r.err
