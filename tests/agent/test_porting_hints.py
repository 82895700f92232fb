"""A port of top-level code into an `@elastic` function that shadows a module global gets a note naming it
(agent/hints.py), in the worker's error report as a user sees it; other errors are left as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from elasticd.agent.hints import add_hint

SHADOWING = '''
import torch
import elasticd

device = "cpu"

@elasticd.elastic(workers=2)
def train(ctx):
    x = torch.zeros(2, device=device)   # the module's `device`, as it was at top level
    device = ctx.device                 # ... but this makes `device` local to all of train()
    for _ in ctx.steps(2):
        pass

if __name__ == "__main__":
    train()
'''


def test_a_shadowed_global_is_named_in_the_failure_a_user_sees(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SHADOWING)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "UnboundLocalError" in proc.stderr
    assert "`device` is a module global, but train() also assigns `device`" in proc.stderr
    assert 'device = globals()["device"]' in proc.stderr


def _raise_unbound() -> None:
    if False:
        z = 1
    print(z)   # noqa: F821 - a local never assigned, and no global of that name


def test_other_errors_get_no_note() -> None:
    for make in (_raise_unbound, lambda: 1 / 0, lambda: undefined_name):   # noqa: F821
        try:
            make()
        except Exception as e:  # noqa: BLE001
            add_hint(e)
            assert not getattr(e, "__notes__", None), e
        else:
            raise AssertionError("did not raise")


def test_calling_the_function_with_the_old_signature_says_where_rank_and_world_size_come_from() -> None:
    import pytest

    import elasticd

    @elasticd.elastic(workers=2)
    def main(ctx):   # ported from main(rank, world_size, num_epochs)
        pass

    with pytest.raises(TypeError, match=r"ctx alone.*ctx\.rank, ctx\.world_size"):
        main(0, 2, 5)
