"""A state dir that trusts no one: the daemon refuses to start, with one clear
line and a nonzero exit, in a dir another user owns or others may write (or below such a parent);
it does not append its log through a planted `daemon.log` symlink; and a key file on the allow-list
that it did not write (another owner, a symlink) lets no one in."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from util import cli, wait_until

from elasticd import keys
from elasticd.statedir import unsafe_dir

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")


def start(state_dir: Path, *extra: str):
    return cli("start", "--state-dir", str(state_dir), "--cpu-devices", "1", "--bind", "none", *extra, timeout=30)


def refused(r, *words: str) -> bool:
    return r.code == 1 and "Traceback" not in r.err and all(w in r.err for w in words)


@as_root
def test_state_dir_of_another_user_is_refused(tmp_path):
    sd = tmp_path / "theirs"
    sd.mkdir(mode=0o700)
    os.chown(sd, NOBODY, NOBODY)
    r = start(sd)
    assert refused(r, "refusing to use the state dir", f"owned by uid {NOBODY}"), (r.code, r.err)
    assert not (sd / "daemon.log").exists() and not (sd / "keys").exists()


@pytest.mark.parametrize("mode, who", [(0o770, "its group"), (0o707, "others"), (0o777, "group and others")])
def test_group_or_world_writable_state_dir_is_refused(tmp_path, mode, who):
    sd = tmp_path / "loose"
    sd.mkdir()
    sd.chmod(mode)
    r = start(sd)
    assert refused(r, f"writable by {who}"), (r.code, r.err)
    r = cli("keygen", "--state-dir", str(sd))
    assert refused(r, f"writable by {who}"), (r.code, r.err)


def test_a_parent_writable_by_others_is_refused_unless_sticky(tmp_path, cluster):
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    r = start(parent / "sd")
    assert refused(r, f"{parent} (a parent of the state dir", "writable by group and others"), (r.code, r.err)
    parent.chmod(0o1777)   # sticky, like /tmp: others cannot replace what we create there
    cluster.root = parent
    cluster.daemon("sd", cpu=1)


def test_a_planted_daemon_log_symlink_is_not_followed(tmp_path):
    sd = tmp_path / "sd"
    sd.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (sd / "daemon.log").symlink_to(victim)
    r = start(sd)
    assert refused(r, "daemon.log", "symlink"), (r.code, r.err)
    assert victim.read_text() == "precious\n"


def test_a_planted_lock_or_job_table_symlink_is_not_followed(tmp_path):
    sd = tmp_path / "sd"
    sd.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (sd / "lock").symlink_to(victim)
    r = start(sd)
    assert refused(r, "lock without following links"), (r.code, r.err)
    (sd / "lock").unlink()
    (sd / "scheduler.db").symlink_to(victim)
    r = start(sd)
    assert refused(r, "scheduler.db is a symlink"), (r.code, r.err)
    assert victim.read_text() == "precious\n"


def test_a_planted_allowed_key_lets_no_one_in(cluster, tmp_path):
    node = cluster.daemon(cpu=1)
    ad = keys.allowed_dir(node.state_dir)
    endpoint, server_key = node.info()["scheduler_tcp"], str(node.state_dir / "keys" / "id.key")
    intruders = []
    for name in ("linked", "loose") + (("foreign",) if os.geteuid() == 0 else ()):
        sd = tmp_path / name
        pub = cli("keygen", "--state-dir", str(sd)).out.strip()
        text = f'metadata\n    role = "admin"\ncurve\n    public-key = "{pub}"\n'
        if name == "linked":
            target = tmp_path / "elsewhere.key"
            target.write_text(text)
            (ad / f"{name}.key").symlink_to(target)
        else:
            path = ad / f"{name}.key"
            path.write_text(text)
            if name == "loose":
                path.chmod(0o666)
            else:
                os.chown(path, NOBODY, NOBODY)
        intruders.append(sd)
    for sd in intruders:
        r = cli("status", "--endpoint", endpoint, "--server-key", server_key, "--state-dir", str(sd), "--timeout", "3")
        assert r.code == 3 and "refused" in r.err, (sd.name, r.code, r.err)
    wait_until(lambda: all(f"not trusting allowed key {sd.name}.key" in node.output() for sd in intruders), 10,
               what="a warning for each planted key")
    # allowing a key under a planted name replaces the link, and leaves its target alone
    before = (tmp_path / "elsewhere.key").read_text()
    pub = keys.ensure_identity(tmp_path / "linked")[0].decode()
    assert cli("keygen", "--state-dir", str(node.state_dir), "--allow", pub, "--name", "linked").code == 0
    assert not (ad / "linked.key").is_symlink() and (tmp_path / "elsewhere.key").read_text() == before


def _st(uid: int, mode: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 2, uid, 0, 0, 0, 0, 0))


def test_the_ownership_predicate():
    me, other = 1000, 1001
    d = stat.S_IFDIR
    assert unsafe_dir(_st(me, d | 0o700), own=True, uid=me) is None
    assert unsafe_dir(_st(me, d | 0o755), own=True, uid=me) is None          # tightened to 0700 on start
    assert "owned by uid 1001" in unsafe_dir(_st(other, d | 0o700), own=True, uid=me)
    assert "owned by uid 0" in unsafe_dir(_st(0, d | 0o700), own=True, uid=me)    # root's dir is not ours
    assert "its group" in unsafe_dir(_st(me, d | 0o770), own=True, uid=me)
    assert unsafe_dir(_st(0, d | 0o755), own=False, uid=me) is None          # /home, /srv
    assert unsafe_dir(_st(0, d | 0o1777), own=False, uid=me) is None         # /tmp
    assert "others" in unsafe_dir(_st(0, d | 0o777), own=False, uid=me)
    assert "owned by uid 1001" in unsafe_dir(_st(other, d | 0o755), own=False, uid=me)
    assert unsafe_dir(_st(me, stat.S_IFREG | 0o600), own=True, uid=me) == "not a directory"
    f = stat.S_IFREG
    assert keys.trusted_file(_st(os.geteuid(), f | 0o600)) is None
    assert "owned by uid" in keys.trusted_file(_st(os.geteuid() + 1, f | 0o600))
    assert "writable by others" in keys.trusted_file(_st(os.geteuid(), f | 0o602))
