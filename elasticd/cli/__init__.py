"""The `elasticd` command line.

One command per module (circus style): each module under this package defines a click command
named like the module, and its docstring is the command's help text. Exit codes are a contract
(docs/architecture.md, elasticd/core/exits.py): 0 ok, 1 the daemon answered with an error, 2 usage error,
3 cannot reach the daemon; an elasticd error no command handled exits with its class's code.
"""

from __future__ import annotations

import importlib

import click

from elasticd.core.errors import ElasticdError
from elasticd.core.exits import EXIT_ERROR as EXIT_DAEMON_ERROR  # noqa: F401 - the commands import them here
from elasticd.core.exits import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE  # noqa: F401

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
    "events": "events",
    "stop": "stop",
    "shutdown": "shutdown",
    "keygen": "keygen",
    "federation": "federation",
    "islands": "islands",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module = importlib.import_module(f"elasticd.cli.{name}")
        return getattr(module, _COMMANDS[name])

    def invoke(self, ctx: click.Context) -> object:
        # An elasticd error no command handled ends it with the exit code its class means, not a traceback.
        try:
            return super().invoke(ctx)
        except ElasticdError as e:
            from elasticd.core.text import printable

            click.echo(f"Error: {printable(e)}", err=True)
            ctx.exit(e.exit_code)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="elasticd")
def main() -> None:
    """elasticd: run an N-worker data-parallel PyTorch job on any M <= N devices, and resize it live."""


def register(name: str, attr: str | None = None) -> None:
    """Add a command module to the group (used by packages that extend the CLI)."""
    _COMMANDS[name] = attr or name


def limit_options(fn):
    """The scheduler's retention and quota options, shared by `start` (embedded) and `scheduler`."""
    import click

    from elasticd.scheduler.admission import Limits

    d = Limits()
    fn = click.option("--max-jobs-per-owner", type=click.IntRange(1, 10**6), default=d.max_jobs_per_owner,
                      show_default=True, help="Queued + running jobs one key (or the local user) may have.")(fn)
    fn = click.option("--max-jobs", type=click.IntRange(1, 10**6), default=d.max_jobs, show_default=True,
                      help="Queued + running jobs on the island.")(fn)
    fn = click.option("--max-ended-jobs", type=click.IntRange(0, 10**6), default=d.max_ended, show_default=True,
                      help="Ended jobs kept in the table (oldest purged first), whatever --job-retention says.")(fn)
    fn = click.option("--job-retention", type=click.FloatRange(0, 10**9), default=d.job_retention_s,
                      show_default=True, metavar="SECONDS",
                      help="Ended jobs are purged from the job table this long after they ended.")(fn)
    return fn


def metrics_option(fn):
    """`--metrics ADDR:PORT`, shared by `start` (embedded scheduler) and `scheduler`: parsed to (host, port)."""
    import click

    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
        from elasticd.observe.http import BadAddress, parse_addr

        if value is None:
            return None
        try:
            return parse_addr(value)
        except BadAddress as e:
            raise click.BadParameter(str(e)) from None

    return click.option(
        "--metrics", default=None, metavar="ADDR:PORT", callback=parse,
        help="Serve Prometheus metrics (/metrics), the live status page (/) and its JSON (/api/status.json) "
             "over plain HTTP at ADDR:PORT, e.g. 127.0.0.1:9450 (':PORT' means loopback; port 0 picks a free "
             "one, shown in the state dir's info file). Off by default. The endpoints are read-only but show "
             "every job and node to whoever reaches them: give an address beyond loopback only behind a "
             "firewall or an authenticating proxy.")(fn)


def limits_from(opts: dict):
    """Pop the limit options out of a command's keyword arguments."""
    from elasticd.scheduler.admission import Limits

    return Limits(job_retention_s=opts.pop("job_retention"), max_ended=opts.pop("max_ended_jobs"),
                  max_jobs=opts.pop("max_jobs"), max_jobs_per_owner=opts.pop("max_jobs_per_owner"))
