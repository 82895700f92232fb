"""`python -m agent ...`: one agent process. Exit 0 when every hosted worker returned, 1 when one raised."""

from __future__ import annotations

from elasticd.agent.process_exit import run
from elasticd.core.agent_config import parse_args


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    from elasticd.agent.process import run_agent

    return run_agent(cfg)


if __name__ == "__main__":
    run(main)
