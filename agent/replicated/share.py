"""A hosted worker's own model, pointed at the shared one when it calls `ctx.replicate`.

Every worker builds its model, but only the first hosted worker's becomes the shared copy; the others'
are set aside. Under DDP the module a rank wraps stays the one it trains, so code that took a reference
into it before wrapping keeps working: a head a loss module holds, a submodule kept for evaluation,
a list of parameters for a penalty. Here such a reference would reach a copy nobody trains, and a
penalty's gradient would land on it and be lost: exit 0 with a result DDP would not give.

So the worker's own module tree takes the shared parameters and buffers (every submodule it holds is the
shared one's in all but its Python object), and each parameter object it held is pointed at the shared
values (reads are current, and its memory is freed) and refuses a gradient: autograd cannot send what
accumulates into a separate leaf to the shared parameter, so a backward through one fails, naming it.
"""

from __future__ import annotations

import functools

import torch

from elasticd.agent.replicated.ledger import ReplicatedStateError


def share_into(own: torch.nn.Module, shared: torch.nn.Module, rank: int) -> None:
    """Point `own` (a worker's model passed to ctx.replicate) at `shared`, which must be built alike."""
    if isinstance(own, torch.jit.ScriptModule):
        return   # its attributes are fixed by the compiler; it stays set aside, as before
    mine = dict(own.named_modules(remove_duplicate=False))
    theirs = dict(shared.named_modules(remove_duplicate=False))
    if mine.keys() != theirs.keys():
        extra, missing = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
        raise ValueError(f"ctx.replicate: logical rank {rank} built another model than the first worker (modules "
                         f"only it has: {extra[:5]}, modules it lacks: {missing[:5]}); every worker must build "
                         f"the same model, as every DDP rank must")
    for path, module in mine.items():
        other = theirs[path]
        for kind in ("_parameters", "_buffers"):
            _share_slots(module, other, kind, path, rank)


def _share_slots(module: torch.nn.Module, other: torch.nn.Module, kind: str, path: str, rank: int) -> None:
    ours: dict[str, torch.Tensor | None] = getattr(module, kind)
    theirs: dict[str, torch.Tensor | None] = getattr(other, kind)
    if ours.keys() != theirs.keys():
        raise ValueError(f"ctx.replicate: logical rank {rank}'s module '{path}' has {kind[1:]} "
                         f"{sorted(ours)}, the first worker's {sorted(theirs)}: every worker must build the same model")
    for name, mine in list(ours.items()):
        shared = theirs[name]
        if (mine is None) != (shared is None):
            raise ValueError(f"ctx.replicate: '{_join(path, name)}' is None on logical rank {rank} or on the first "
                             f"worker only: every worker must build the same model")
        if mine is None or mine is shared:
            continue
        if mine.shape != shared.shape or mine.dtype != shared.dtype:
            raise ValueError(f"ctx.replicate: logical rank {rank}'s '{_join(path, name)}' is {tuple(mine.shape)} "
                             f"{mine.dtype}, the first worker's {tuple(shared.shape)} {shared.dtype}")
        setattr(module, name, shared)   # through Module.__setattr__: modules that cache their tensors see it
        if isinstance(mine, torch.nn.Parameter) and not hasattr(mine, "_elasticd_set_aside"):
            mine.data = shared.detach()   # the memory itself: `shared.data` is one copy per later worker
            mine._elasticd_set_aside = True   # type: ignore[attr-defined]
            if mine.requires_grad:
                mine.register_post_accumulate_grad_hook(functools.partial(_refuse, _join(path, name), rank))


def _refuse(name: str, rank: int, _param: torch.Tensor) -> None:
    raise ReplicatedStateError(
        f"elasticd: logical rank {rank}'s backward accumulated a gradient into parameter '{name}' as it was "
        f"before ctx.replicate (a reference taken earlier, e.g. a list of parameters for a penalty), which no "
        f"flush sees; take such references from the model ctx.replicate returned")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
