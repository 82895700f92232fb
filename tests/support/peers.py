"""Raw CURVE peers of a test daemon's scheduler, each with a key of its own that `elasticd keygen --allow`
admitted with the roles a test gives it."""

from __future__ import annotations

from pathlib import Path

import zmq
from util import cli

from elasticd import keys, transport
from elasticd import protocol as p


class Peer:
    """A raw CURVE DEALER speaking with the identity of its own state dir."""

    def __init__(self, node, state_dir: Path) -> None:
        self.identity = keys.ensure_identity(state_dir)
        self.public = self.identity[0].decode()
        self.ctx = zmq.Context()
        self.sock = transport.dealer(self.ctx, immediate=False)
        transport.curve_client(self.sock, self.identity, keys.parse_public_key(str(node.state_dir / "keys" / "id.key")))
        self.sock.connect(node.info()["scheduler_tcp"])
        self.rid = 0

    def ask(self, msg: p.Message) -> p.Message:
        self.rid += 1
        msg.rid = self.rid
        self.sock.send(msg.encode())
        while True:
            assert self.sock.poll(5000), f"no answer to {msg.op}"
            reply = p.decode(self.sock.recv())
            if reply.rid == msg.rid or (reply.rid == 0 and isinstance(reply, p.Welcome)):
                return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def allow(node, peer_dir: Path, *args: str) -> Peer:
    pub = keys.ensure_identity(peer_dir)[0].decode()
    r = cli("keygen", "--state-dir", str(node.state_dir), "--allow", pub, *args)
    assert r.code == 0, r.err
    return Peer(node, peer_dir)
