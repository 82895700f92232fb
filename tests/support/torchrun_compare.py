"""What a torchrun-mode run is compared with torchrun's by: the time a run may take, how far training must move a
model for the comparison to prove anything, and the tolerance of DDP's own fp32 round-off."""

from __future__ import annotations

import torch

RUN_TIMEOUT = 240.0   # seconds, one run
MOVED = 1e-2          # least relative move of a trained model


def assert_ddp_close(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert set(ref) == set(got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
