"""agent/comm/host_values.py: a flush's small values to the device and back (the GPU half is in
tests/agent/test_cuda.py, where torch's sync debug mode can count the waits)."""

from __future__ import annotations

import torch

from elasticd.agent.comm import host_values


def test_flags_are_one_per_parameter_with_a_gradient_in_the_buffers_dtype() -> None:
    like = torch.zeros(3, dtype=torch.bfloat16)
    assert host_values.flags([True, True], like).tolist() == [1.0, 1.0]
    mixed = host_values.flags([True, False, True], like)
    assert mixed.dtype == torch.bfloat16 and mixed.tolist() == [1.0, 0.0, 1.0]


def test_one_read_gives_each_tensors_values_exactly_whatever_their_dtypes() -> None:
    parts = [torch.tensor([1.0, 0.0, 3.0]), torch.tensor([7], dtype=torch.float64),
             torch.tensor([2.0, 5.0], dtype=torch.bfloat16), torch.tensor([[4.0], [0.0]], dtype=torch.float16)]
    assert host_values.read(parts) == [[1.0, 0.0, 3.0], [7.0], [2.0, 5.0], [4.0, 0.0]]
    assert host_values.read(parts[:1]) == [[1.0, 0.0, 3.0]]
    assert host_values.read([]) == []


def test_values_reach_a_cpu_device_as_torch_tensor_makes_them() -> None:
    got = host_values.to_device([1, 0, 2], torch.float32, torch.device("cpu"))
    assert torch.equal(got, torch.tensor([1.0, 0.0, 2.0]))
