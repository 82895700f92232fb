"""The torch-free core that the control plane and the training runtime share.

Layouts (which logical ranks each device hosts), snapshot parts and cadence, the agent's launch record,
exit codes, environment variable names and what a script declares. Imports nothing of elasticd outside
itself, and never torch: the daemon and the scheduler read it without paying for torch.
"""
