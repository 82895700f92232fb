"""Connection hygiene: idle unauthenticated TCP connections do not keep an
allowed client from getting answers, they are dropped after the short CURVE handshake interval, and a
flood of refused keys grows the log by a bounded number of lines."""

from __future__ import annotations

import resource
import socket
import statistics
import time

import psutil
import pytest
import zmq
from cluster import Cluster
from util import cli, wait_until

from elasticd import keys, transport
from elasticd import protocol as p

IDLE = 300
REQUESTS = 50


@pytest.fixture
def node(tmp_path):
    """A daemon started with a soft limit of 256 open files (as under a default `ulimit -n`), so that the
    idle connections below would fill its descriptor table unless it raises the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    c = Cluster(tmp_path)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, soft), hard))
    try:
        d = c.daemon(cpu=1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    yield d
    c.cleanup()


def _client(node) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = transport.dealer(ctx, immediate=False)
    transport.curve_client(s, keys.load_identity(node.state_dir),
                           keys.parse_public_key(str(node.state_dir / "keys" / "id.key")))
    s.connect(node.info()["scheduler_tcp"])
    return ctx, s


def _latencies(s: zmq.Socket, n: int) -> list[float]:
    out = []
    for rid in range(1, n + 1):
        t0 = time.perf_counter()
        s.send(p.Status(job_id=None, rid=rid).encode())
        assert s.poll(5000), f"request {rid}: no answer within 5 s"
        assert p.decode(s.recv()).rid == rid
        out.append(time.perf_counter() - t0)
    return out


def test_idle_unauthenticated_connections_do_not_starve_an_allowed_client(node):
    host, port = node.info()["scheduler_tcp"][len("tcp://"):].rsplit(":", 1)
    soft = psutil.Process(node.pid).rlimit(resource.RLIMIT_NOFILE)[0]
    assert soft >= 4 * IDLE, f"the daemon kept a soft limit of {soft} open files"
    ctx, s = _client(node)
    idle: list[socket.socket] = []
    try:
        _latencies(s, 3)   # connected and warm before the flood
        for _ in range(IDLE):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        lat = _latencies(s, REQUESTS)
        p50, worst = statistics.median(lat), max(lat)
        print(f"with {IDLE} idle unauthenticated connections: p50 {p50 * 1e3:.2f} ms, max {worst * 1e3:.2f} ms")
        assert worst < 0.1, f"an answer took {worst * 1e3:.0f} ms with {IDLE} idle connections open"

        def closed(c: socket.socket) -> bool:
            c.setblocking(False)
            try:
                while c.recv(1 << 16):   # the ZMTP greeting; the close (EOF) comes after it
                    pass
                return True
            except BlockingIOError:
                return False
            except ConnectionResetError:
                return True

        t0 = time.monotonic()

        def dropped() -> bool:   # the scheduler closes them once the handshake interval has passed
            return all(closed(c) for c in idle)
        wait_until(dropped, transport.HANDSHAKE_IVL_MS / 1000 + 10, interval=0.2,
                   what="the idle connections to be dropped after the handshake interval")
        print(f"idle connections dropped {time.monotonic() - t0:.1f} s after the requests")
    finally:
        for c in idle:
            c.close()
        s.close(linger=0)
        ctx.term()


def test_a_refused_key_flood_grows_the_log_by_a_bounded_amount(node, tmp_path):
    endpoint, server = node.info()["scheduler_tcp"], keys.parse_public_key(str(node.state_dir / "keys" / "id.key"))
    stranger = keys.ensure_identity(tmp_path / "stranger")
    marker = "elasticd.transport: refused"
    before, size0 = node.output().count(marker), len(node.output())
    ctx = zmq.Context()
    attempts = 0
    try:
        for _ in range(100):   # 100 reconnects with the same refused key
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            transport.curve_client(s, stranger, server)
            mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            s.connect(endpoint)
            assert mon.poll(5000), "no handshake failure reported"
            attempts += 1
            s.disable_monitor()
            mon.close(linger=0)
            s.close(linger=0)
    finally:
        ctx.term()
    wait_until(lambda: "refused CURVE client " + stranger[0].decode() in node.output(), 10, what="first refusal")
    lines, grown = node.output().count(marker) - before, len(node.output()) - size0
    print(f"{attempts} refused handshakes -> {lines} log lines, {grown} bytes")
    # the first refusal of the key, then one summary per minute (the test lasts well under one)
    assert attempts == 100 and 1 <= lines <= 2 and grown < 2000, (lines, grown)
    r = cli("status", "--state-dir", str(node.state_dir))   # and it still serves
    assert r.code == 0


def test_the_log_file_rotates_at_a_bounded_size(tmp_path):
    import logging

    from elasticd.logfiles import SafeRotatingFileHandler

    path = tmp_path / "daemon.log"
    handler = SafeRotatingFileHandler(str(path), max_bytes=10_000, backups=2)
    logger = logging.getLogger("test.rotation")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for i in range(2000):   # ~100 KB of lines
            logger.warning("refused CURVE client %06d: key not on the allow-list", i)
    finally:
        logger.removeHandler(handler)
        handler.close()
    files = sorted(tmp_path.glob("daemon.log*"))
    assert [f.name for f in files] == ["daemon.log", "daemon.log.1", "daemon.log.2"]
    assert sum(f.stat().st_size for f in files) <= 3 * 10_000
    assert all(f.stat().st_mode & 0o077 == 0 for f in files)
