"""One root for elasticd's errors, and the exit code each kind means."""

from __future__ import annotations

import importlib
import inspect

import click
import pytest
from click.testing import CliRunner
from source_tree import modules

from elasticd.cli import _LazyGroup
from elasticd.core import errors
from elasticd.core.exits import EXIT_ERROR, EXIT_PEER_LOST, EXIT_UNREACHABLE, EXIT_USAGE


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for module in sorted(modules()):
        if module.endswith("__main__"):
            continue
        mod = importlib.import_module(module)
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module:
                found.append(obj)
    return found


def test_every_exception_of_ours_has_one_of_the_two_roots():
    classes = _exception_classes()
    assert len(classes) >= 25
    strays = [f"{c.__module__}.{c.__qualname__}" for c in classes
              if not issubclass(c, errors.ElasticdError | errors.ElasticdInterrupt)]
    assert strays == []


def test_the_kinds_mean_their_exit_codes():
    from elasticd.agent.comm.physical import PeerLost
    from elasticd.agent.runtime import WorkerFailed
    from elasticd.agent.script import ScriptError
    from elasticd.cli.client import Unreachable
    from elasticd.observe.http import BadAddress
    from elasticd.scheduler.store import StoreError

    assert (ScriptError.exit_code, BadAddress.exit_code) == (EXIT_USAGE, EXIT_USAGE)
    assert Unreachable.exit_code == EXIT_UNREACHABLE
    assert (StoreError.exit_code, WorkerFailed.exit_code) == (EXIT_ERROR, EXIT_ERROR)
    assert PeerLost.exit_code == EXIT_PEER_LOST
    # The built-in bases stay, so handlers written against them still catch these.
    assert issubclass(StoreError, RuntimeError) and issubclass(BadAddress, ValueError)
    # What unwinds worker threads is no Exception: a user's `except Exception:` cannot swallow it.
    assert not issubclass(PeerLost, Exception)


@pytest.mark.parametrize(("error", "code"), [(errors.UsageError("no such thing"), EXIT_USAGE),
                                             (errors.UnreachableError("nobody home"), EXIT_UNREACHABLE),
                                             (errors.ControlPlaneError("refused"), EXIT_ERROR)])
def test_an_error_no_command_handled_ends_it_with_its_code(error, code):
    @click.command()
    def boom() -> None:
        raise error

    class Group(_LazyGroup):
        def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
            return boom if name == "boom" else super().get_command(ctx, name)

    result = CliRunner().invoke(Group(), ["boom"])
    assert result.exit_code == code
    assert f"Error: {error}" in result.output
