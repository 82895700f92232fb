"""What runs inside a training process: the time-slicer and the worker contexts.

One agent process per (job, device) hosts a contiguous block of logical ranks, runs each in its own
thread, and passes a baton so exactly one runs at a time (see docs/architecture.md).

This package imports nothing; the control plane never imports it. What both sides read (layouts, snapshot
parts and cadence, the agent's launch record, exit codes, environment variable names) is `elasticd.core`.
"""
