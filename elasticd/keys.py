"""CURVE keys in a state directory: this side's identity and the allow-list of client keys.

Layout (all under ``STATE_DIR/keys``, directory mode 0700):
    id.key, id.key_secret   this daemon's / scheduler's / CLI's identity (ZeroMQ certificate files)
    allowed/*.key           public keys allowed to connect to the TCP sockets served from this
                            state dir; the own identity is always allowed, so tools sharing the
                            state dir can talk to it over TCP too.

A key is given on the command line either as a path to a certificate file or as its 40-character
Z85 text (what `elasticd keygen` prints).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import zmq
import zmq.auth

log = logging.getLogger(__name__)

_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


class BadKeyError(ValueError):
    """A key argument that is neither a readable certificate file nor a Z85 public key."""


def keys_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "keys"


def allowed_dir(state_dir: Path) -> Path:
    return keys_dir(state_dir) / "allowed"


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def ensure_identity(state_dir: Path, force: bool = False) -> tuple[bytes, bytes]:
    """The (public, secret) keypair of this state dir, created on first use.

    The secret file is mode 0600; the public key is also put on the allow-list.
    """
    kd = keys_dir(state_dir)
    _private_dir(Path(state_dir))
    _private_dir(kd)
    pub, sec = kd / "id.key", kd / "id.key_secret"
    if force or not sec.exists():
        old = os.umask(0o077)
        try:
            zmq.auth.create_certificates(str(kd), "id")
        finally:
            os.umask(old)
        os.chmod(sec, 0o600)
        log.info("created CURVE identity %s", pub)
    public, secret = zmq.auth.load_certificate(str(sec))
    if secret is None:
        raise BadKeyError(f"{sec} holds no secret key")
    allow_key(state_dir, public, "self")
    return public, secret


def load_identity(state_dir: Path) -> tuple[bytes, bytes] | None:
    sec = keys_dir(state_dir) / "id.key_secret"
    if not sec.exists():
        return None
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


def allow_key(state_dir: Path, key: str | bytes, name: str) -> Path:
    """Put a client's public key on the allow-list of this state dir.

    Raises:
        BadKeyError: for a malformed key or name.
    """
    public = parse_public_key(key)
    if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", name):
        raise BadKeyError(f"key name must be 1-64 of [A-Za-z0-9_.-], got {name!r}")
    ad = allowed_dir(state_dir)
    _private_dir(ad)
    target = ad / f"{name}.key"
    if target.exists():
        try:
            if zmq.auth.load_certificate(str(target))[0] == public:
                return target
        except Exception:
            pass
    tmp = ad / f".{name}.key.tmp"
    tmp.write_text(f'# elasticd allowed client key\nmetadata\ncurve\n    public-key = "{public.decode()}"\n')
    os.replace(tmp, target)
    return target


def allowed_keys(state_dir: Path) -> set[bytes]:
    """Public keys currently on the allow-list (unreadable files are skipped with a warning)."""
    out: set[bytes] = set()
    ad = allowed_dir(state_dir)
    if not ad.is_dir():
        return out
    for p in sorted(ad.glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(str(p))
            out.add(public)
        except Exception as e:
            log.warning("skipping unreadable allowed key %s: %s", p, e)
    return out
