"""The agent's channel to whoever launched it: nothing, the local launcher's pipes, or the node daemon."""
