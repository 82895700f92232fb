"""The time-slicer: the runtime, its baton, the worker context, and what each worker keeps apart (RNG, loader position)."""
