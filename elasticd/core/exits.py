"""Agent exit codes that mean something to whoever supervises agents (the daemon, `elasticd run`); no torch."""

# The agent's group failed under it (agent/comm/physical.py PeerLost): another agent died first, so the job
# can be recovered; the first cause is that other agent, not this one. EX_TEMPFAIL.
EXIT_PEER_LOST = 75
