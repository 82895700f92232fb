"""Exit codes: the CLI's contract (docs/architecture.md) and the agent codes its supervisors read; no torch."""

EXIT_OK = 0
EXIT_ERROR = 1          # the daemon or scheduler answered with an error, or the job failed
EXIT_USAGE = 2          # the command line or the script was wrong; nothing was done
EXIT_UNREACHABLE = 3    # no daemon or scheduler answered

# The agent's group failed under it (agent/comm/physical.py PeerLost): another agent died first, so the job
# can be recovered; the first cause is that other agent, not this one. EX_TEMPFAIL.
EXIT_PEER_LOST = 75
