"""Failure causes (elasticd/core/failures.py): which failures are recovered from, and an exit status in words."""

from __future__ import annotations

import json

import pytest

from elasticd import protocol as p
from elasticd.core.failures import INFRASTRUCTURE, Cause, how_it_ended, is_infrastructure, no_restart


@pytest.mark.parametrize("cause", ["died", "peer_lost", "stuck", "node_lost", "drained"])
def test_every_cause_but_the_users_is_the_infrastructures(cause: str) -> None:
    assert is_infrastructure(cause) and is_infrastructure(Cause(cause))


@pytest.mark.parametrize("cause", ["user", None, "", "died ", "DIED", "resize"])
def test_the_users_error_an_unknown_cause_and_none_are_the_jobs(cause: str | None) -> None:
    """Retrying a job whose failure nobody explained as the infrastructure's would fail it again the same way."""
    assert not is_infrastructure(cause)


def test_a_cause_travels_as_its_plain_value() -> None:
    assert INFRASTRUCTURE == tuple(c for c in Cause if c.value != "user")
    assert json.loads(json.dumps({"cause": Cause.STUCK})) == {"cause": "stuck"}
    err = p.AgentError(message="m", cause=Cause.PEER_LOST.value)
    assert type(err.cause) is str and err.cause == Cause.PEER_LOST


@pytest.mark.parametrize("code, words", [(-9, "was killed by SIGKILL"), (-15, "was killed by SIGTERM"),
                                         (3, "exited with code 3"), (0, "exited with code 0"),
                                         (-40, "was killed by signal 40")])
def test_an_exit_status_in_words(code: int, words: str) -> None:
    assert how_it_ended(code) == words


def test_a_refused_restart_says_what_failed_and_how_many_restarts_were_used() -> None:
    assert no_restart("agent 1 was killed by SIGKILL", 2, 2) == \
        "agent 1 was killed by SIGKILL; not restarting: 2 restart(s) of --max-restarts 2 used"
