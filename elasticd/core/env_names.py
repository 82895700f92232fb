"""Environment variables that the launcher, the scheduler and the agents pass between them."""

# The script's own arguments, as a JSON list, in the agents' environment: one carrier for `elasticd run`
# (the launcher sets it) and `elasticd submit` (a job's --env reaches agents and warm spares alike).
ARGS_VAR = "ELASTICD_SCRIPT_ARGS"
# Where the step count of restarted agents starts (the launcher's count when it restarted them), so that
# `--scale-at` steps stay absolute across restarts.
STEP_OFFSET_VAR = "ELASTICD_STEP_OFFSET"

# Set on the agents of a restarted job: by `elasticd run` (a resize or recovery of a torchrun-mode job), and
# by the scheduler after a recovery.
RESTARTS_VAR = "ELASTICD_RESTART_COUNT"

# Islands (agent/comm/islands.py): the job's sums go in two levels across them. "S1,S2,..." gives the agents
# per island in rank order (an island scheduler sets it for a job spanning islands); "K" splits a job's
# agents into K emulated islands of consecutive agents, as even as they come (tests, the benchmarks).
ISLANDS_VAR = "ELASTICD_ISLANDS"
# An emulated link between those islands, "MBPS[:MS]": what crosses between island leaders is delayed as
# that bandwidth and one-way latency would (scripts/bench_islands_link.py).
ISLAND_LINK_VAR = "ELASTICD_ISLAND_LINK"

# Test-only switch: "gloo" makes the group of CUDA agents plain gloo (which carries CUDA tensors too),
# so that two agents can share one GPU, which NCCL refuses. Slower; never for real runs.
DEVICE_BACKEND_ENV = "ELASTICD_DEVICE_BACKEND"

# The secret a node daemon gives each agent process it starts, proof on the agent socket that a message
# comes from that agent (elasticd/daemon/supervision.py). The agent takes it out of its environment at
# start, so the job's own children do not inherit it.
AGENT_TOKEN_VAR = "ELASTICD_AGENT_TOKEN"

# A spare that writes to a terminal or a run's own output (no log of its own) does not say it is ready.
QUIET_SPARE_VAR = "ELASTICD_QUIET_SPARE"


def torchrun_variables(rank: int, world: int, master_addr: str, master_port: int, restarts: int = 0,
                       run_id: str = "elasticd") -> dict[str, str]:
    """What `torchrun --nproc_per_node N` sets for rank `rank`: one node holding all N ranks."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
