"""Flattening tensors into one buffer per dtype for a physical collective, and scattering it back."""

from __future__ import annotations

import torch

from elasticd.agent.comm import host_values


def by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


def scatter_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.detach().copy_(flat[offset:offset + n].view_as(t))
        offset += n


def flatten_grads(params: list[torch.Tensor], room: int = 0) -> torch.Tensor:
    """Gradients as one flat fp32-or-native buffer, zeros for missing grads, then one used-flag per param,
    then `room` zeros (where a flush may carry the step-boundary vote)."""
    parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
    parts.append(host_values.flags([p.grad is not None for p in params], params[0]))
    if room:
        parts.append(params[0].new_zeros(room))
    return torch.cat(parts)


def unflatten_grads(flat: torch.Tensor, params: list[torch.Tensor], used: list[float] | None = None) -> None:
    """Assign averaged gradients; a parameter no rank produced a gradient for keeps `grad=None`, as in DDP.

    Written into the existing `.grad` tensors (a fresh one only where there was none), never left as views
    of `flat`: views share one version counter, and the ledger (replicated/ledger.py) tells a worker's
    in-place change of a gradient from the runtime's by each gradient's own counter. `used`: the summed
    flags (the tail of `flat`) where the caller read them already, with other values of the same flush.
    """
    if used is None:
        used = flat[-len(params):].tolist()
    offset = 0
    for i, p in enumerate(params):
        n = p.numel()
        if used[i] <= 0:
            p.grad = None
        elif p.grad is not None:
            p.grad.copy_(flat[offset:offset + n].view_as(p))
        else:
            p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def sparse_gradient_modules(model: torch.nn.Module) -> list[str]:
    """The submodules that make sparse gradients (`Embedding`/`EmbeddingBag` with `sparse=True`): those do not
    flatten into a buffer, so replicated state and the logical DDP refuse them up front. Under DDP they train;
    here the first reduction failed inside elasticd, on two devices or more only for replicated state."""
    return [f"{name or 'the model'} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse]

