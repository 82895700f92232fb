"""Resizes: the step-boundary snapshot, moving state between agents, and the fall-back copy in tmpfs."""
