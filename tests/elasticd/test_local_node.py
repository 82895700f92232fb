"""elasticd/local_node.py: the node and scheduler `elasticd run` drives in its own process. What a run does
through it is tested by every file that drives `elasticd run`; these pin what the node is given."""

from __future__ import annotations

from elasticd.local_node import LocalNode


def test_a_cuda_runs_node_serves_the_devices_the_run_asked_for_without_probing_the_machine() -> None:
    """The run checked its GPUs itself (more agents than GPUs only under the gloo test switch, where several
    share one); a probe of the machine would give a node with fewer devices than the job needs, on which
    it would wait for devices for ever."""
    node = LocalNode(3, "cuda")
    try:
        assert [(d.device_id, d.type, d.index) for d in node.daemon.devices] == [
            ("cuda:0", "cuda", 0), ("cuda:1", "cuda", 1), ("cuda:2", "cuda", 2)]
    finally:
        node.close()


def test_a_cpu_runs_node_serves_one_cpu_device_per_agent() -> None:
    node = LocalNode(2, "cpu")
    try:
        assert [(d.device_id, d.type) for d in node.daemon.devices] == [("cpu:0", "cpu"), ("cpu:1", "cpu")]
    finally:
        node.close()
