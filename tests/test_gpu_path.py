"""The CUDA path's decisions that can be made and checked without a GPU (issue #10).

The CUDA code itself only runs in tests/test_cuda.py (`pytest -m cuda`, scripts/gpu_check.sh); what is
checked here is the logic around it: which process group the agents form on a device, which GPU an
agent gets, what deterministic mode switches on, and that collectives elasticd cannot run over logical
ranks fail loudly inside a worker.
"""

from __future__ import annotations

import pytest
import torch

from elasticd.agent.comm.physical import DEVICE_BACKEND_ENV, GroupSpec, group_spec, shares_devices

# -- the agents' process group ----------------------------------------------------------------------

def test_cpu_agents_form_a_gloo_group() -> None:
    spec = group_spec(torch.device("cpu"), environ={})
    assert spec == GroupSpec("gloo")
    assert spec.init_kwargs() == {} and spec.barrier_kwargs() == {}


def test_cuda_agents_form_one_group_for_cpu_and_cuda_tensors_bound_to_their_gpu() -> None:
    """CPU control tensors (the step vote, snapshot tables, resize bytes) must never reach NCCL: one group
    with gloo for CPU tensors and NCCL for CUDA tensors, bound to the agent's GPU (init_process_group's
    device_id; barrier's device_ids), so no agent ever lands on GPU 0 by default."""
    spec = group_spec(torch.device("cuda", 3), environ={})
    assert spec.backend == "cpu:gloo,cuda:nccl"
    assert spec.init_kwargs() == {"device_id": torch.device("cuda", 3)}
    assert spec.barrier_kwargs() == {"device_ids": [3]}
    # What torch does with the string: gloo for cpu tensors, NCCL for cuda tensors.
    from torch.distributed import Backend, BackendConfig

    assert BackendConfig(Backend(spec.backend)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


def test_the_test_switch_makes_cuda_agents_a_gloo_group_that_may_share_a_gpu() -> None:
    env = {DEVICE_BACKEND_ENV: "gloo"}
    assert group_spec(torch.device("cuda", 0), environ=env) == GroupSpec("gloo")
    assert shares_devices(env) and not shares_devices({})


def test_bad_device_group_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=DEVICE_BACKEND_ENV):
        group_spec(torch.device("cuda", 0), environ={DEVICE_BACKEND_ENV: "mpi"})
    with pytest.raises(ValueError, match="index"):
        group_spec(torch.device("cuda"), environ={})
