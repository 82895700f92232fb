"""The node daemon: owns a node's devices, spawns and watches one agent per (job, device), and talks
to the island scheduler (embedded in the same process unless `--scheduler` names another one)."""
