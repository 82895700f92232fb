"""Physical communication: the M agents' process group, the rank layout, and logical collectives flushed over it."""
