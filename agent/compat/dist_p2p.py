"""`torch.distributed`'s point-to-point functions between logical ranks: send, recv, isend, irecv,
batch_isend_irecv, send_object_list and recv_object_list (agent/comm/p2p.py carries the messages).
Registered into the table of compat/dist_registry.py.

Receiving from any source (`recv(t)` without `src`) is refused by name: which message a receive without a
source gets depends on timing under torchrun, and here on the baton's order, so it could not be the same.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.distributed_c10d as c10d

from elasticd.agent import patches
from elasticd.agent.comm.objects import dumps, loads
from elasticd.agent.comm.p2p import Receive
from elasticd.agent.compat.dist_registry import PATCHES, check_group, logical
from elasticd.agent.slicer.context import runtime_of, worker_of
from elasticd.agent.worker import current_worker

if TYPE_CHECKING:
    from elasticd.agent.slicer.context import WorkerContext

ORIGINAL_CHECK_OP = c10d._check_op
_LEDGER = patches.ledger("compat.dist_p2p")


class _Sent:
    """What isend returns: the tensor is copied, so the send is complete as far as the sender can tell."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _Receiving:
    """What irecv returns: `wait()` blocks the worker until the message is there and delivers it."""

    def __init__(self, ctx: WorkerContext, rec: Receive) -> None:
        self._ctx, self._rec = ctx, rec

    def wait(self, timeout: Any = None) -> bool:
        runtime_of(self._ctx).p2p.wait(worker_of(self._ctx), self._rec)
        return True

    def is_completed(self) -> bool:
        return self._rec.delivered

    def is_success(self) -> bool:
        return self._rec.delivered


def _peer(given: int | None, group_given: int | None, fn: str, what: str) -> int:
    peer = given if given is not None else group_given
    if peer is None:
        raise NotImplementedError(f"elasticd: torch.distributed.{fn} without {what} (from any source) is not "
                                  f"supported: which message it gets depends on timing; name the {what}")
    return peer


@logical("send")
def _send(ctx: WorkerContext, tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> None:
    check_group(group, "send")
    runtime_of(ctx).p2p.send(worker_of(ctx), tensor, _peer(dst, group_dst, "send", "dst"), tag)


@logical("isend")
def _isend(ctx: WorkerContext, tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
           group_dst: int | None = None) -> _Sent:
    _send(ctx, tensor, dst, group, tag, group_dst)
    return _Sent()


@logical("irecv")
def _irecv(ctx: WorkerContext, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
           group_src: int | None = None) -> _Receiving:
    check_group(group, "irecv")
    return _Receiving(ctx, runtime_of(ctx).p2p.post(worker_of(ctx), tensor, _peer(src, group_src, "irecv", "src"), tag))


@logical("recv")
def _recv(ctx: WorkerContext, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> int:
    check_group(group, "recv")
    peer = _peer(src, group_src, "recv", "src")
    runtime_of(ctx).p2p.wait(worker_of(ctx), runtime_of(ctx).p2p.post(worker_of(ctx), tensor, peer, tag))
    return peer


def _is(op: Any, name: str) -> bool:
    return op is getattr(c10d, name) or op is PATCHES.get(name)


@logical("batch_isend_irecv")
def _batch_isend_irecv(ctx: WorkerContext, p2p_op_list: list[Any]) -> list[Any]:
    if not p2p_op_list:
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to to be of type "
                         "``torch.distributed.P2POp``.")
    works = []
    for op in p2p_op_list:
        peer = op.peer if op.peer is not None else getattr(op, "group_peer", None)
        if _is(op.op, "isend"):
            works.append(_isend(ctx, op.tensor, peer, op.group, op.tag))
        elif _is(op.op, "irecv"):
            works.append(_irecv(ctx, op.tensor, peer, op.group, op.tag))
        else:
            raise ValueError(f"Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` or "
                             f"``torch.distributed.irecv``, got {op.op!r}")
    return works


@logical("send_object_list")
def _send_object_list(ctx: WorkerContext, object_list: list[Any], dst: int | None = None, group: Any = None,
                      device: Any = None, group_dst: int | None = None, use_batch: bool = False) -> None:
    check_group(group, "send_object_list")
    peer = _peer(dst, group_dst, "send_object_list", "dst")
    blobs = [dumps(o) for o in object_list]
    p2p = runtime_of(ctx).p2p
    p2p.send(worker_of(ctx), torch.tensor([len(b) for b in blobs], dtype=torch.long), peer, 0)
    payload = b"".join(blobs)
    p2p.send(worker_of(ctx), torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
             else torch.empty(0, dtype=torch.uint8), peer, 0)


@logical("recv_object_list")
def _recv_object_list(ctx: WorkerContext, object_list: list[Any], src: int | None = None, group: Any = None,
                      device: Any = None, group_src: int | None = None, use_batch: bool = False) -> int:
    check_group(group, "recv_object_list")
    peer = _peer(src, group_src, "recv_object_list", "src")
    sizes = torch.empty(len(object_list), dtype=torch.long)
    _recv(ctx, sizes, peer)
    payload = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    _recv(ctx, payload, peer)
    raw, at = ctypes.string_at(payload.data_ptr(), payload.numel()), 0   # numpy is no runtime dependency
    for i, n in enumerate(sizes.tolist()):
        object_list[i] = loads(raw[at:at + n], torch.device(device) if device is not None else None)
        at += n
    return peer


ORIGINAL_P2POP_INIT = c10d.P2POp.__init__


def _p2pop_init(self: Any, op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None,
                tag: int = 0, group_peer: int | None = None) -> None:
    """Inside a worker there is no default process group to resolve `group` against: the peer is a logical rank."""
    if current_worker() is None:
        ORIGINAL_P2POP_INIT(self, op, tensor, peer, group, tag, group_peer)
        return
    self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
    self.peer = self.group_peer = peer if peer is not None else group_peer


def install() -> None:
    """`P2POp(dist.isend, ...)` inside workers: torch checks `op` against its own isend/irecv and resolves
    the default group in the constructor; both are made to accept the logical world (idempotent)."""
    _LEDGER.set(c10d, "_check_op", check_op)
    _LEDGER.set(c10d.P2POp, "__init__", _p2pop_init)


def check_op(op: Any) -> None:
    """torch's P2POp accepts only its own isend/irecv; inside workers those names are the patches above."""
    ORIGINAL_CHECK_OP(c10d.isend if _is(op, "isend") else c10d.irecv if _is(op, "irecv")
                      else op)
