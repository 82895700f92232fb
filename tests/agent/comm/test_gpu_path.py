"""The CUDA path's decisions that can be made and checked without a GPU.

The CUDA code itself only runs in tests/agent/test_cuda.py (`pytest -m cuda`, scripts/gpu_check.sh); what is
checked here is the logic around it: which process group the agents form on a device, which GPU an
agent gets, what deterministic mode switches on, and that collectives elasticd cannot run over logical
ranks fail loudly inside a worker.
"""

from __future__ import annotations

import pytest
import torch
from util import JOBS, cli

from elasticd.agent.comm.physical import GroupSpec, group_spec
from elasticd.core.agent_config import (
    DEVICE_AT_JOIN,
    cuda_capacity_problem,
    cuda_ordinal,
    shares_devices,
)
from elasticd.core.env_names import DEVICE_BACKEND_ENV

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


# -- which GPU an agent gets ------------------------------------------------------------------------

def test_an_agent_takes_its_own_gpu_or_a_standby_the_one_of_the_rank_it_joins_as() -> None:
    assert cuda_ordinal(1, rank=0, device_count=2) == 1
    assert cuda_ordinal(DEVICE_AT_JOIN, rank=1, device_count=2) == 1
    with pytest.raises(ValueError, match="standby"):
        cuda_ordinal(DEVICE_AT_JOIN, rank=-1, device_count=2)


def test_more_cuda_agents_than_gpus_is_refused_unless_the_test_switch_lets_them_share() -> None:
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        cuda_ordinal(DEVICE_AT_JOIN, rank=1, device_count=1)
    assert cuda_ordinal(DEVICE_AT_JOIN, rank=1, device_count=1, shared=True) == 0
    assert cuda_ordinal(3, rank=3, device_count=2, shared=True) == 1
    assert cuda_capacity_problem(2, 2) is None
    assert "no CUDA device" in (cuda_capacity_problem(1, 0, shared=True) or "")


def test_run_on_cuda_without_enough_gpus_is_a_usage_error_before_any_agent_starts() -> None:
    """This machine has no GPU: `elasticd run --device-type cuda` must say so (exit 2), not start M agents
    that each crash in torch.cuda."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = cli(*["run", str(JOBS / "mlp_sgd.py"), "--workers", "4", "--devices", "2", "--device-type", "cuda"],
                  timeout=120)
    assert run.code == 2, run.output
    assert "torch sees no CUDA device" in run.output


# -- deterministic mode on CUDA ---------------------------------------------------------------------

@pytest.fixture
def global_determinism():
    """set_deterministic changes process-wide torch flags: put them back for the other tests."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[1], saved[2]


def test_deterministic_mode_on_cuda_fixes_kernels_cublas_workspace_and_cudnn(global_determinism) -> None:
    """Pinning CPU threads is not enough on a GPU: cuBLAS' split-K workspace, nondeterministic kernels
    (atomics) and cuDNN's timed algorithm choice each change the bits from run to run."""
    from elasticd.agent.slicer.device import set_deterministic

    torch.backends.cudnn.benchmark = True
    env: dict[str, str] = {}
    set_deterministic(torch.device("cuda", 0), False, environ=env)
    assert env == {} and torch.backends.cudnn.benchmark and not torch.are_deterministic_algorithms_enabled()
    set_deterministic(torch.device("cpu"), True, environ=env)
    assert env == {} and not torch.are_deterministic_algorithms_enabled()  # CPU: one pinned thread instead

    set_deterministic(torch.device("cuda", 0), True, environ=env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    mine = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # the other reproducible setting, exported by the user
    set_deterministic(torch.device("cuda", 0), True, environ=mine)
    assert mine == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 200, 8192, 8193, 40000])
def test_the_cuda_checksum_sums_columns_in_groups_to_exactly_the_plain_sum(rows: int) -> None:
    """agent/private/swap_cuda.py sums a slot's columns in groups of rows (the plain `sum(dim=0)` took a
    CUDA buffer twice the slot's size); int64 sums wrap, so any grouping must give the same bits."""
    from elasticd.agent.private.swap_cuda import _ROW, column_sums

    g = torch.Generator().manual_seed(rows)
    bulk = torch.randint(-2**62, 2**62, (rows, _ROW), dtype=torch.int64, generator=g)
    assert torch.equal(column_sums(bulk), bulk.sum(dim=0))
