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
@click.option("--name", default=None, help="File name for the allowed key [default: derived from the key].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def keygen(state_dir: str | None, force: bool, allow: str | None, name: str | None, as_json: bool) -> None:
    """Create this state dir's CURVE identity (if missing) and print its public key.

    Give the printed key to the scheduler's operator, who allows it with `elasticd keygen --allow KEY`
    on the scheduler's state dir; daemons and CLIs pass the scheduler's key as --scheduler-key /
    --server-key. The secret half stays in DIR/keys/id.key_secret (mode 0600). A running daemon or
    scheduler picks up allow-list changes without a restart.
    """
    from elasticd import keys
    from elasticd.daemon.statedir import StateDir

    sd = StateDir.resolve(state_dir).create()
    try:
        if allow is not None:
            public = keys.parse_public_key(allow)
            path = keys.allow_key(sd.root, public, name or "client-" + "".join(
                c for c in public.decode() if c.isalnum())[:12])
            doc = {"allowed": public.decode(), "path": str(path)}
            click.echo(json.dumps(doc) if as_json else f"allowed {public.decode()} ({path})")
            return
        public, _ = keys.ensure_identity(sd.root, force=force)
    except keys.BadKeyError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    doc = {"public_key": public.decode(), "path": str(keys.keys_dir(sd.root) / "id.key")}
    click.echo(json.dumps(doc) if as_json else public.decode())
