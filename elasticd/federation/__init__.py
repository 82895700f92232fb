"""The federation front: island schedulers join it, and it keeps their table (elasticd/federation/state.py)."""
