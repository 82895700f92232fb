"""The fixed order in which deterministic mode adds up the N logical ranks' tensors: a binary tree.

Node [lo, hi) of the tree over [0, N) has children [lo, mid) and [mid, hi), mid = lo + ceil((hi - lo) / 2),
and a node's sum is its left child's plus its right child's. The bits of every element depend on N alone,
not on which agent added what, so a sum can be cut anywhere along the tree. An agent adds up, on its own,
each maximal subtree inside its block of ranks (a "piece"), and only pieces cross the network. Halving
with the larger half first makes the uniform layout's blocks whole subtrees on 2 agents always (and on 4,
8, ... where they divide N evenly): one piece per agent, where a sum in plain rank order would have to ship
every rank's tensor (the last rank's addition needs all the others first).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

Node = tuple[int, int]   # [lo, hi): the ranks under a node of the tree


def split(node: Node) -> int:
    lo, hi = node
    return lo + (hi - lo + 1) // 2


def pieces(workers: int, lo: int, hi: int) -> list[Node]:
    """The maximal subtrees of the tree over [0, workers) that lie inside the block [lo, hi), in rank order."""
    if not 0 <= lo < hi <= workers:
        raise ValueError(f"block [{lo}, {hi}) is not inside [0, {workers})")
    out: list[Node] = []
    todo = [(0, workers)]
    while todo:
        a, b = node = todo.pop()
        if lo <= a and b <= hi:
            out.append(node)
        elif a < hi and lo < b:
            mid = split(node)
            todo += [(mid, b), (a, mid)]   # left popped first: rank order
    return out


def tree_sum(values: Mapping[Node, torch.Tensor], root: Node) -> torch.Tensor:
    """The sum under `root`, from `values`: tensors of nodes that cut the subtree (each leaf rank under
    `root` lies under exactly one of them). Never changes a tensor of `values`; returns a new tensor.

    Raises:
        KeyError: a rank under `root` is under none of the nodes given.
    """
    total, owned = _sum(values, root)
    return total if owned else total.clone()


def _sum(values: Mapping[Node, torch.Tensor], node: Node) -> tuple[torch.Tensor, bool]:
    if node in values:
        return values[node], False
    lo, hi = node
    if hi - lo == 1:
        raise KeyError(f"no value covers rank {lo}")
    mid = split(node)
    left, owned = _sum(values, (lo, mid))
    right, _ = _sum(values, (mid, hi))
    if not owned:
        left = left.clone()
    return left.add_(right), True
