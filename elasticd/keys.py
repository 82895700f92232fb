"""CURVE keys in a state directory: this side's identity and the allow-list of client keys.

Layout (all under ``STATE_DIR/keys``, directory mode 0700):
    id.key, id.key_secret   this daemon's / scheduler's / CLI's identity (ZeroMQ certificate files)
    allowed/*.key           public keys allowed to connect to the TCP sockets served from this
                            state dir, each with a role (client, node bound to one node id, admin);
                            the own identity is always allowed as admin, so tools sharing the
                            state dir can talk to it over TCP too.

Roles are written into the key file at `elasticd keygen --allow` time. A key file written before roles
existed (no ``role`` line) is read as a *client*: the least trust that keeps `status`/`submit` working.
Nothing upgrades it silently; a node allowed that way is refused until re-allowed with
``--role node --node-id ID`` (docs/security.md). Files the daemon did not write itself (another owner,
group/world-writable, a symlink) are skipped with a warning, never trusted.

A key is given on the command line either as a path to a certificate file or as its 40-character
Z85 text (what `elasticd keygen` prints).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from elasticd.core.errors import UsageError
from elasticd.protocol.limits import bad_user_name

log = logging.getLogger(__name__)

_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


CLIENT, NODE, ISLAND, ADMIN = "client", "node", "island", "admin"
ROLES = (CLIENT, NODE, ISLAND, ADMIN)   # in order of trust: one key in two files gets the lesser
BOUND = (NODE, ISLAND)   # roles bound to the one id they may speak for (a node's, an island scheduler's)
_NODE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_KEY_FILE = 4096   # a key file is ~200 bytes; anything bigger was not written by us


class BadKeyError(UsageError, ValueError):
    """A key argument that is neither a readable certificate file nor a Z85 public key."""


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What one allowed key may do: its role and, for a node or island key, the one node or island id it
    may speak for (`node_id`, whichever it is)."""

    name: str
    role: str
    node_id: str | None = None
    legacy: bool = False      # written before roles existed: read as a client
    run_as: str | None = None  # the Unix user its jobs run as on nodes that run jobs as other users


def keys_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "keys"


def allowed_dir(state_dir: Path) -> Path:
    return keys_dir(state_dir) / "allowed"


def _private_dir(path: Path) -> None:
    """Make `path` a 0700 dir of ours.

    Raises:
        BadKeyError: if it exists as a symlink or a dir we did not make (another owner, loose mode).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise BadKeyError(f"{path} is not a directory (a symlink?): not trusting it")
    why = trusted_file(st)
    if why:
        raise BadKeyError(f"not trusting {path}: it is {why}")
    os.chmod(path, 0o700)


def _own_file(path: Path) -> None:
    """Raises:
        BadKeyError: if `path` is a symlink, not a regular file, or not written by this user alone.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise BadKeyError(f"{path} is not a regular file (a symlink?): not trusting it")
    why = trusted_file(st)
    if why:
        raise BadKeyError(f"not trusting {path}: it is {why}")


def ensure_identity(state_dir: Path, force: bool = False) -> tuple[bytes, bytes]:
    """The (public, secret) keypair of this state dir, created on first use.

    The secret file is mode 0600; the public key is also put on the allow-list.
    """
    kd = keys_dir(state_dir)
    _private_dir(Path(state_dir))
    _private_dir(kd)
    pub, sec = kd / "id.key", kd / "id.key_secret"
    if force or not os.path.lexists(sec):
        old = os.umask(0o077)
        try:
            zmq.auth.create_certificates(str(kd), "id")
        finally:
            os.umask(old)
        os.chmod(sec, 0o600)
        log.info("created CURVE identity %s", pub)
    _own_file(sec)
    public, secret = zmq.auth.load_certificate(str(sec))
    if secret is None:
        raise BadKeyError(f"{sec} holds no secret key")
    allow_key(state_dir, public, "self", role=ADMIN)
    return public, secret


def load_identity(state_dir: Path) -> tuple[bytes, bytes] | None:
    sec = keys_dir(state_dir) / "id.key_secret"
    if not sec.exists():
        return None
    _own_file(sec)
    public, secret = zmq.auth.load_certificate(str(sec))
    return (public, secret) if secret is not None else None


def parse_public_key(value: str | os.PathLike[str] | bytes) -> bytes:
    """A Z85 public key from its text or from a certificate file.

    Raises:
        BadKeyError: if `value` is neither.
    """
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    text = str(value).strip()
    if _Z85.match(text) and not Path(text).exists():
        try:
            zmq.utils.z85.decode(text.encode())
        except Exception as e:
            raise BadKeyError(f"not a Z85 key: {text!r}") from e
        return text.encode()
    path = Path(text).expanduser()
    if not path.is_file():
        raise BadKeyError(f"{text!r} is neither a 40-character Z85 public key nor a certificate file")
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except Exception as e:
        raise BadKeyError(f"cannot read a public key from {path}: {e}") from e
    if not public:
        raise BadKeyError(f"{path} holds no public key")
    return public


def allow_key(state_dir: Path, key: str | bytes, name: str, role: str = CLIENT,
              node_id: str | None = None, run_as: str | None = None) -> Path:
    """Put a public key on the allow-list of this state dir with its role.

    Raises:
        BadKeyError: for a malformed key, name, role or node id, or a node key without a node id.
    """
    public = parse_public_key(key)
    if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", name):
        raise BadKeyError(f"key name must be 1-64 of [A-Za-z0-9_.-], got {name!r}")
    if role not in ROLES:
        raise BadKeyError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    a_role = f"{'an' if role == ISLAND else 'a'} {role} key"
    if (role in BOUND) != (node_id is not None):
        raise BadKeyError(f"{a_role} needs --{role}-id (the one {role} it may speak for)" if role in BOUND else
                          "only node and island keys take an id (--node-id, --island-id)")
    if node_id is not None and not _NODE_ID.match(node_id):
        raise BadKeyError(f"{role} id must be 1-128 of [A-Za-z0-9_.:-], got {node_id!r}")
    if run_as is not None and (role in BOUND or bad_user_name(run_as)):
        raise BadKeyError(f"--run-as {run_as!r}: " + (f"{a_role} submits no jobs of its own" if role in BOUND
                                                     else str(bad_user_name(run_as))))
    ad = allowed_dir(state_dir)
    _private_dir(ad)
    target = ad / f"{name}.key"
    want = KeyGrant(name, role, node_id, run_as=run_as)
    try:
        current = _read_grant(target)
    except BadKeyError as e:   # something we did not write: replaced below (os.replace swaps a link itself)
        log.warning("replacing %s: %s", target, e)
        current = None
    if current is not None and current[0] == public and current[1] == want:
        return target
    tmp = ad / f".{name}.key.tmp"
    meta = (f'    role = "{role}"\n' + (f'    {role}-id = "{node_id}"\n' if node_id else "")
            + (f'    run-as = "{run_as}"\n' if run_as else ""))
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'# elasticd allowed key\nmetadata\n{meta}curve\n    public-key = "{public.decode()}"\n')
    os.replace(tmp, target)
    return target


_FIELD = re.compile(r'^\s*(public-key|role|node-id|island-id|run-as)\s*=\s*"([^"]*)"\s*$', re.M)


def trusted_file(st: os.stat_result) -> str | None:
    """Why a file or directory we are about to trust was not written by us (None: it was).

    Ours means: owned by this process's user and not writable by group or others (sshd's
    StrictModes rule).
    """
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by {'group' if st.st_mode & stat.S_IWGRP else 'others'} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _read_grant(path: Path) -> tuple[bytes, KeyGrant] | None:
    """The key and grant of one allow-list file, or None if it is missing.

    Raises:
        BadKeyError: for a file we did not write (symlink, foreign owner, loose mode) or cannot parse.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:   # ELOOP: a symlink planted in our allow-list
        raise BadKeyError(f"cannot open {path} without following links: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadKeyError(f"{path} is not a regular file")
        why = trusted_file(st)
        if why:
            raise BadKeyError(f"{path} is {why}")
        text = os.read(fd, MAX_KEY_FILE + 1).decode("utf-8", "replace")
    finally:
        os.close(fd)
    if len(text) > MAX_KEY_FILE:
        raise BadKeyError(f"{path} is larger than a key file")
    fields = dict(_FIELD.findall(text))
    public = fields.get("public-key", "").encode()
    try:
        if len(public) != 40 or len(zmq.utils.z85.decode(public)) != 32:
            raise ValueError
    except Exception:
        raise BadKeyError(f"{path} holds no valid public key") from None
    role = fields.get("role")
    name = path.name[:-len(".key")]
    if role is None:
        return public, KeyGrant(name, CLIENT, None, legacy=True)
    node_id = fields.get(f"{role}-id") if role in BOUND else None
    if role not in ROLES or (role in BOUND) != bool(node_id) or (node_id and not _NODE_ID.match(node_id)):
        raise BadKeyError(f"{path}: role {role!r} with id {node_id!r} is not a valid grant")
    run_as = fields.get("run-as") or None
    if run_as is not None and (role in BOUND or bad_user_name(run_as)):
        raise BadKeyError(f"{path}: run-as {run_as!r} is not a valid grant for a {role} key")
    return public, KeyGrant(name, role, node_id, run_as=run_as)


def allowed_grants(state_dir: Path) -> dict[bytes, KeyGrant]:
    """Z85 public key -> grant for every file on the allow-list that we can trust.

    Files we did not write, or cannot read, are skipped with a warning: an attacker who could plant
    a file in the directory must not gain access by it.
    """
    out: dict[bytes, KeyGrant] = {}
    ad = allowed_dir(state_dir)
    if not ad.is_dir():
        return out
    for p in sorted(ad.glob("*.key")):
        try:
            got = _read_grant(p)
        except BadKeyError as e:
            log.warning("not trusting allowed key %s: %s", p.name, e)
            continue
        if got is None:
            continue
        public, grant = got
        if grant.legacy:
            log.warning("allowed key %s has no role (written before roles existed): treated as a client; "
                        "re-allow it with `elasticd keygen --allow KEY --role node --node-id ID` (or --role admin)"
                        " to give it more", p.name)
        prev = out.get(public)
        if prev is None or ROLES.index(grant.role) < ROLES.index(prev.role):
            out[public] = grant   # one key in two files: the lesser grant wins
    return out


def allowed_keys(state_dir: Path) -> set[bytes]:
    """Public keys currently on the allow-list (untrusted or unreadable files are skipped)."""
    return set(allowed_grants(state_dir))
