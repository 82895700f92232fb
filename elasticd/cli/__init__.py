"""The `elasticd` command line.

One command per module (circus style): each module under this package defines a click command
named like the module, and its docstring is the command's help text. Exit codes are a contract
(README, Design): 0 ok, 1 the daemon answered with an error, 2 usage error, 3 cannot reach the daemon.
"""

from __future__ import annotations

import importlib

import click

EXIT_OK = 0
EXIT_DAEMON_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

# module name -> attribute holding the click command. Imported lazily so `elasticd --help`
# and the control-plane commands do not pay for importing torch.
_COMMANDS = {
    "run": "run",
    "start": "start",
    "scheduler": "scheduler",
    "submit": "submit",
    "status": "status",
    "scale": "scale",
    "drain": "drain",
    "undrain": "undrain",
    "logs": "logs",
    "stop": "stop",
    "shutdown": "shutdown",
    "keygen": "keygen",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module = importlib.import_module(f"elasticd.cli.{name}")
        return getattr(module, _COMMANDS[name])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="elasticd")
def main() -> None:
    """elasticd: run an N-worker data-parallel PyTorch job on any M <= N devices, and resize it live."""


def register(name: str, attr: str | None = None) -> None:
    """Add a command module to the group (used by packages that extend the CLI)."""
    _COMMANDS[name] = attr or name
