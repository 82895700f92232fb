"""What runs inside a training process: the time-slicer and the worker contexts.

One agent process per (job, device) hosts a contiguous block of logical ranks, runs each in its own
thread, and passes a baton so exactly one runs at a time (see DESIGN.md, "Pieces").
"""
