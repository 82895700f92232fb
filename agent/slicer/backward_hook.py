"""The context-switch point at the end of backward.

DDP averages gradients from autograd hooks inside the engine; a time-slicer must not block there
(on CUDA the engine's device threads are shared by every worker). So the switch happens right after
`torch.autograd.backward` returns in the worker's own thread, which is also where DDP guarantees the
gradients are averaged. `Tensor.backward` calls `torch.autograd.backward`, so one patch covers both.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from elasticd.agent import patches
from elasticd.agent.worker import current_worker

_LEDGER = patches.ledger("slicer.backward_hook")


def install_backward_hook() -> None:
    if _LEDGER.active:
        return
    original = torch.autograd.backward

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> None:
        w = current_worker()
        if w is None or w.ctx is None:
            return original(*args, **kwargs)
        rt = w.runtime
        try:
            rt.before_backward(w)   # may refuse what the worker did to replicated gradients
            original(*args, **kwargs)
        except BaseException as e:
            rt.backward_raised(w, e)
            raise
        rt.after_backward(w)
        return None

    _LEDGER.set(torch.autograd, "backward", backward)
