"""`elasticd keygen`: CURVE keys and the allow-list."""

from __future__ import annotations

import json
import sys

import click

from elasticd.cli import EXIT_USAGE


@click.command("keygen")
@click.option("--state-dir", default=None, envvar="ELASTICD_STATE_DIR", metavar="DIR",
              help="Whose keys [default: ~/.elasticd].")
@click.option("--force", is_flag=True, help="Replace the identity with a new keypair.")
@click.option("--allow", "allow", default=None, metavar="KEY",
              help="Instead: put KEY (Z85 text or a .key file) on this state dir's allow-list.")
@click.option("--role", type=click.Choice(["client", "node", "island", "admin"]), default="client",
              show_default=True,
              help="With --allow: what the key may do. client: submit, status, logs, stop/scale its own jobs; "
                   "node: join as the node --node-id (and relay its CLI's requests as a client); island (on a "
                   "federation front): join as the island scheduler --island-id; admin: anything, including "
                   "stopping others' jobs and shutdown.")
@click.option("--node-id", default=None, metavar="ID",
              help="With --role node: the one node id this key may speak for (`elasticd start --node-id`).")
@click.option("--island-id", default=None, metavar="ID",
              help="With --role island: the one island this key may speak for (`elasticd scheduler "
                   "--island-id`).")
@click.option("--run-as", default=None, metavar="USER",
              help="With --allow: the Unix user this key's jobs run as on nodes whose daemon runs as root "
                   "[default: each node's --jobs-as user]. Owners who must not reach each other's jobs need "
                   "users of their own.")
@click.option("--name", default=None, help="File name for the allowed key [default: derived from the key].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def keygen(state_dir: str | None, force: bool, allow: str | None, role: str, node_id: str | None,
           island_id: str | None, run_as: str | None, name: str | None, as_json: bool) -> None:
    """Create this state dir's CURVE identity (if missing) and print its public key.

    Give the printed key to the scheduler's operator, who allows it with `elasticd keygen --allow KEY`
    on the scheduler's state dir; daemons and CLIs pass the scheduler's key as --scheduler-key /
    --server-key. The secret half stays in DIR/keys/id.key_secret (mode 0600). A running daemon or
    scheduler picks up allow-list changes without a restart.

    Every allowed key has a role (--role); a node's key is bound to its node id (--node-id). Keys
    allowed before roles existed are read as clients until allowed again with a role.
    """
    from elasticd import keys
    from elasticd.statedir import StateDir

    if allow is None and (node_id is not None or island_id is not None or role != "client" or run_as is not None):
        raise click.UsageError("--role, --node-id, --island-id and --run-as go with --allow KEY")
    if node_id is not None and island_id is not None:
        raise click.UsageError("a key speaks for a node (--node-id) or an island (--island-id), not both")
    if island_id is not None and role != "island" or node_id is not None and role != "node":
        raise click.UsageError("--node-id goes with --role node, --island-id with --role island")
    bound = node_id if node_id is not None else island_id
    from elasticd.cli import EXIT_DAEMON_ERROR
    from elasticd.statedir import UnsafeStateDir

    try:
        sd = StateDir.resolve(state_dir).create()
    except UnsafeStateDir as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_DAEMON_ERROR)
    try:
        if allow is not None:
            public = keys.parse_public_key(allow)
            path = keys.allow_key(sd.root, public, name or f"{role}-" + "".join(
                c for c in public.decode() if c.isalnum())[:12], role=role, node_id=bound, run_as=run_as)
            doc = {"allowed": public.decode(), "path": str(path), "role": role, "node_id": node_id,
                   "island_id": island_id, "run_as": run_as}
            click.echo(json.dumps(doc) if as_json else f"allowed {public.decode()} as {role}"
                       + (f" {bound}" if bound else "") + (f", its jobs run as {run_as}" if run_as else "")
                       + f" ({path})")
            return
        public, _ = keys.ensure_identity(sd.root, force=force)
    except keys.BadKeyError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    from elasticd.statedir import default_node_id

    # node_id: what to bind this key to on the scheduler when a daemon started without --node-id uses it
    doc = {"public_key": public.decode(), "path": str(keys.keys_dir(sd.root) / "id.key"),
           "node_id": default_node_id(sd)}
    click.echo(json.dumps(doc) if as_json else public.decode())
