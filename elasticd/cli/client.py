"""How the CLI talks to a daemon (or straight to a scheduler), and how it turns replies into exit codes.

By default the CLI reaches the local daemon through the IPC socket of its state dir (`--state-dir`,
env ELASTICD_STATE_DIR, default ~/.elasticd); with no daemon there, a standalone scheduler's socket
in that state dir is used. `--endpoint tcp://H:P --server-key KEY` talks to a scheduler over CURVE
with the state dir's identity key instead.

Exit codes (docs/architecture.md): 0 ok, 1 the daemon answered with an error, 2 usage error, 3 cannot reach it.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from elasticd import keys, transport
from elasticd import protocol as p
from elasticd.cli import EXIT_DAEMON_ERROR, EXIT_UNREACHABLE, EXIT_USAGE
from elasticd.control_client import DEFAULT_TIMEOUT_S, Client, ErrorReply, Target, Unreachable
from elasticd.statedir import StateDir, pid_alive, read_info

F = TypeVar("F", bound=Callable[..., Any])


def resolve(state_dir: str | None, endpoint: str | None = None, server_key: str | None = None) -> Target:
    """Where to send requests.

    Raises:
        Unreachable: no daemon or scheduler serves this state dir.
        click.UsageError: inconsistent options.
    """
    sd = StateDir.resolve(state_dir)
    if endpoint:
        if not transport.is_tcp(endpoint):
            if not endpoint.startswith("ipc://"):
                raise click.UsageError(f"--endpoint {endpoint!r}: give tcp://HOST:PORT (with --server-key) or "
                                       f"ipc://PATH")
            return Target(endpoint, what=endpoint)
        if not server_key:
            raise click.UsageError("--endpoint tcp://... needs --server-key (the scheduler's public key)")
        try:
            public = keys.parse_public_key(server_key)
        except keys.BadKeyError as e:
            raise click.UsageError(str(e)) from None
        identity = keys.load_identity(sd.root) or keys.ensure_identity(sd.root)
        return Target(endpoint, public, identity, what=f"scheduler at {endpoint}")
    for sock, info_path, what, command in ((sd.daemon_sock, sd.daemon_info, "daemon", "start"),
                                           (sd.scheduler_sock, sd.scheduler_info, "scheduler", "start"),
                                           (sd.federation_sock, sd.federation_info, "federation front", "federation")):
        if not sock.exists():
            continue
        info = read_info(info_path) or {}
        pid = info.get("pid")
        if isinstance(pid, int) and not pid_alive(pid):
            raise Unreachable(f"the {what} of {sd.root} (pid {pid}) is not running (stale socket); "
                              f"start one with `elasticd {command}`")
        return Target(transport.ipc_endpoint(sock), what=f"{what} of {sd.root}")
    raise Unreachable(f"no elasticd daemon is running with state dir {sd.root} (no {sd.daemon_sock.name}); "
                      "start one with `elasticd start`, or pass --state-dir / set ELASTICD_STATE_DIR")


# --- click glue ------------------------------------------------------------------------------------

def client_options(fn: F) -> F:
    """The options every command that talks to a daemon shares."""
    fn = click.option("--timeout", type=click.FloatRange(min=0.1), default=DEFAULT_TIMEOUT_S, show_default=True,
                      help="Seconds to wait for an answer.")(fn)
    fn = click.option("--server-key", default=None, metavar="KEY",
                      help="Public key (Z85 text or certificate file) of the scheduler at --endpoint.")(fn)
    fn = click.option("--endpoint", default=None, envvar="ELASTICD_ENDPOINT", metavar="tcp://HOST:PORT",
                      help="Talk to this scheduler directly (CURVE) instead of the local daemon.")(fn)
    fn = click.option("--state-dir", default=None, envvar="ELASTICD_STATE_DIR", metavar="DIR",
                      help="State dir of the local daemon [default: ~/.elasticd].")(fn)
    return fn


def fail(code: int, message: str, as_json: bool = False, error_code: str = "") -> None:
    """Print an error the way the output mode wants it and exit with `code`."""
    if as_json:
        click.echo(json.dumps({"op": "error", "code": error_code or _CODE_NAMES.get(code, "error"),
                               "message": message}))
    else:
        from elasticd.core.text import printable

        click.echo(f"Error: {printable(message)}", err=True)
    sys.exit(code)


_CODE_NAMES = {EXIT_DAEMON_ERROR: "error", EXIT_USAGE: "usage", EXIT_UNREACHABLE: "unreachable"}


def call(opts: dict[str, Any], msg: p.Message, as_json: bool = False) -> p.Message:
    """One request from a command: resolve the target, ask, map failures to exit codes."""
    try:
        target = resolve(opts.get("state_dir"), opts.get("endpoint"), opts.get("server_key"))
        with Client(target, opts.get("timeout") or DEFAULT_TIMEOUT_S) as c:
            return c.request(msg)
    except Unreachable as e:
        fail(EXIT_UNREACHABLE, str(e), as_json)
    except ErrorReply as e:
        fail(EXIT_DAEMON_ERROR, f"{e.error.message} [{e.error.code}]", as_json, e.error.code)
    raise AssertionError("unreachable")


def session(opts: dict[str, Any], as_json: bool = False) -> Client:
    """A client kept open for several requests (`logs -f`, `submit --wait`)."""
    try:
        target = resolve(opts.get("state_dir"), opts.get("endpoint"), opts.get("server_key"))
        return Client(target, opts.get("timeout") or DEFAULT_TIMEOUT_S)
    except Unreachable as e:
        fail(EXIT_UNREACHABLE, str(e), as_json)
    raise AssertionError("unreachable")


def guarded(as_json: bool = False) -> Callable[[F], F]:
    """Map Unreachable / ErrorReply raised inside a command body to exit codes."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*a: Any, **kw: Any) -> Any:
            try:
                return fn(*a, **kw)
            except Unreachable as e:
                fail(EXIT_UNREACHABLE, str(e), kw.get("as_json", as_json))
            except ErrorReply as e:
                fail(EXIT_DAEMON_ERROR, f"{e.error.message} [{e.error.code}]", kw.get("as_json", as_json),
                     e.error.code)
        return inner  # type: ignore[return-value]
    return wrap


def state_dir_of(opts: dict[str, Any]) -> Path:
    return StateDir.resolve(opts.get("state_dir")).root
