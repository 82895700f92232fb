"""Hooks that hold their object weakly, for callbacks torch keeps where Python's collector cannot look.

An autograd node keeps its pre-hooks in C++, and a parameter's post-accumulate-grad hooks are reached
from C++ too: a hook bound strongly to the object that owns the parameters (a replicated group, a
logical DDP model) closes a cycle the collector cannot free, and every resize then kept the finished
segment alive with its model, optimizer and private state (found on a GPU). A worker's
`backward_hooks` list is plain Python, but the same holder lets a dropped model go there as well.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any


def weakly(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """`functools.partial(method, *args)` holding the method's object weakly: a no-op once it is gone."""
    return functools.partial(_call, weakref.WeakMethod(method), args)


def _call(ref: weakref.WeakMethod, args: tuple[Any, ...], *rest: Any) -> Any:
    method = ref()
    return None if method is None else method(*args, *rest)
