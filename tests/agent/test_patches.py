"""Every name elasticd replaces in a training process is listed in elasticd.agent.patches, and put back.

The checks run in fresh interpreters: they compare what torch and the standard library hold before and after,
which earlier tests in this process would have changed already.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from util import REPO

from elasticd.agent import patches

# What every namespace of torch and the standard library holds, by the name a ledger gives it. Modules:
# their values; classes defined in them: what the class itself defines (so an attribute added to a class
# counts). Lazily loaded submodules appear as new module attributes and are not replacements.
SNAPSHOT = textwrap.dedent("""
    import builtins, io, os, subprocess, sys, types, warnings
    from elasticd.agent.patches import _qualname

    ROOTS = ("torch", "builtins", "io", "os", "subprocess", "warnings", "__main__", "hydra", "accelerate")

    classes = []   # every class met so far: one a module no longer names (it was replaced) is still read

    def snapshot():
        seen = {}
        for name, module in list(sys.modules.items()):
            if module is None or name.partition(".")[0] not in ROOTS:
                continue
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for key, value in items:
                seen[("m", _qualname(module, key))] = id(value)
                if isinstance(value, type) and getattr(value, "__module__", None) == name and value not in classes:
                    classes.append(value)
        seen[("m", _qualname(sys.modules, "__main__"))] = id(sys.modules.get("__main__"))
        main = sys.modules.get("__main__")
        seen[("m", _qualname(main, "__class__"))] = id(type(main))
        from torch.utils.data import DataLoader
        todo = [DataLoader]
        while todo:
            cls = todo.pop()
            if cls not in classes:
                classes.append(cls)
            todo.extend(cls.__subclasses__())
        for cls in classes:
            for key, value in list(vars(cls).items()):
                seen[("c", _qualname(cls, key))] = id(value)
        return seen

    def changed(before, after):
        out = {k[1] for k, v in before.items() if k in after and after[k] != v}
        out |= {k[1] for k in after if k not in before and k[0] == "c"}
        out |= {k[1] for k in before if k not in after and k[0] == "c"}
        return out
""")


def _run(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(SNAPSHOT + textwrap.dedent(code))
    import os

    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_every_replacement_is_in_a_ledger_and_remove_all_puts_it_back(tmp_path):
    # Every concern installed as the runtime installs them (CUDA's too: wrapping needs no GPU), then removed.
    out = _run("""
        import json
        import torch
        from torch.distributed import all_reduce   # a name the user imported: rebound, and bound back
        from torch.nn.utils import clip_grad_norm_
        from elasticd.agent import patches
        from elasticd.agent.capture import carried, loader_tracking, reentry_writes
        from elasticd.agent.compat import (cuda_ranks, per_rank_main, per_rank_singletons, torch_dist,
                                           warning_origin, worker_env)
        from elasticd.agent.replicated.idioms import install as install_idioms
        from elasticd.agent.slicer.backward_hook import install_backward_hook

        def fn(ctx):
            pass

        snapshot()
        before = snapshot()
        torch_dist.install(fn)
        install_backward_hook()
        warning_origin.install()
        worker_env.install()
        cuda_ranks.install(torch.device("cuda", 0))
        carried.install()
        loader_tracking.install()
        install_idioms(fn)
        reentry_writes.watch()
        per_rank_singletons.install()
        per_rank_main.install()
        during = snapshot()
        listed = [line.partition(": ")[2] for line in patches.installed()]
        assert "sys.meta_path" in listed   # hydra and accelerate are patched when imported
        listed.remove("sys.meta_path")
        concerns = sorted({line.partition(": ")[0] for line in patches.installed()})
        patches.remove_all()
        after = snapshot()
        print(json.dumps({"changed": sorted(changed(before, during)), "listed": sorted(set(listed)),
                          "concerns": concerns, "left": sorted(changed(before, after)),
                          "installed_after": patches.installed(), "meta_path": sys.meta_path.count(
                              per_rank_singletons._finder)}))
    """, tmp_path)
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["changed"] == got["listed"], (sorted(set(got["changed"]) - set(got["listed"])),
                                             sorted(set(got["listed"]) - set(got["changed"])))
    assert got["concerns"] == sorted(p.concern for p in patches.TABLE)
    for name in ("torch.autograd.backward", "os.environ", "builtins.open", "torch.Tensor.data",
                 "torch.nn.modules.module.Module.__setattr__", "torch.distributed.all_reduce", "__main__.all_reduce",
                 "__main__.clip_grad_norm_", "torch.cuda.set_device", "warnings.warn"):
        assert name in got["listed"], name
    assert got["left"] == [] and got["installed_after"] == [] and got["meta_path"] == 0


def test_a_standalone_run_leaves_torch_as_it_was_and_logs_what_it_replaced(tmp_path):
    out = _run("""
        import torch
        import elasticd
        from elasticd.agent import patches

        @elasticd.elastic(workers=2)
        def train(ctx):
            model = torch.nn.Linear(3, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = ctx.replicate(model, opt)
            for _ in ctx.steps(2):
                opt.zero_grad()
                model(torch.ones(2, 3)).sum().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            return float(model.weight.sum())

        import json
        snapshot()
        before = snapshot()
        train()
        after = snapshot()
        assert patches.installed() == []
        train()   # installed again for the next run
        # A run also loads modules and lets torch patch itself (Optimizer's profiling hook on `step`): what
        # is compared is every name the log says was replaced.
        print(json.dumps({"same": {k[1]: before.get(k) == after.get(k) for k in before},
                          "added": [k[1] for k in after if k not in before]}))
    """, tmp_path, env={patches.DEBUG_VAR: "1"})
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    same, added = got["same"], set(got["added"])
    log = out.stderr
    replaced = set(re.findall(r"elasticd patches: (?:replaced|rebound) (\S+)", log))
    assert len(replaced) > 50, log[-3000:]
    assert {name for name in replaced if not same.get(name, True)} == set()
    assert replaced & added == set()   # what a class did not define itself is deleted again
    assert {"torch.Tensor.data", "torch.nn.modules.module.Module.__deepcopy__"} <= replaced
    assert "elasticd patches: replaced torch.autograd.backward (slicer.backward_hook:" in log, log[-3000:]
    assert "elasticd patches: restored torch.autograd.backward" in log
    assert log.count("elasticd patches: replaced torch.autograd.backward") == 2


def test_a_replacement_nobody_listed_is_refused():
    with pytest.raises(KeyError, match="not listed"):
        patches.ledger("replicated.something_new")


def test_the_docs_show_the_table():
    docs = (REPO / "docs" / "architecture.md").read_text()
    assert patches.markdown_table() in docs


def test_the_table_names_real_modules():
    for p in patches.TABLE:
        assert (REPO / "agent" / (p.concern.replace(".", "/") + ".py")).is_file(), p.concern
        assert re.fullmatch(r"[a-z_0-9]+\.[a-z_0-9]+", p.concern)
