"""The HTTP side: `/metrics` (Prometheus text format), `/` (the status page), `/api/status.json` (what the
page polls). Read-only: GET and HEAD only; anything else gets 405, unknown paths 404, oversized or
malformed requests 400 at once (a request line that is not `METHOD PATH HTTP/1.x` included), and the
server thread outlives any one bad request.

A browser must not be turned against it: a request whose `Host` is a name other than this machine's
(`localhost`, its host name, or an IP address) gets 421, so a page on another site cannot read it through
DNS rebinding; responses forbid framing and sniffing, and the status page runs only its own script
(a Content-Security-Policy with the script's hash).

Served by the standard library's threading HTTP server in a daemon thread; it reads only the Observer's
published snapshot and Prometheus' thread-safe registry, never the scheduler's state.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from elasticd.core.errors import UsageError
from elasticd.observe.metrics import Observer

log = logging.getLogger(__name__)

DEFAULT_PORT = 9450
# /metrics of 500 nodes and 200 jobs takes prometheus_client ~36 ms to render, holding the GIL the
# scheduler's loop needs; Prometheus scrapes every 15-60 s, so a body up to 5 s old costs it nothing and
# keeps a scraper polling every 100 ms from costing the loop more than ~1% (docs/benchmarks.md).
METRICS_MAX_AGE_S = 5.0
_PAGE = "page.html"


class BadAddress(UsageError, ValueError):
    """An --metrics value that is not HOST:PORT."""


def parse_addr(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT` or `:PORT` (loopback) to (host, port).

    Raises:
        BadAddress: with the reason.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        raise BadAddress(f"expected HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}), got {text!r}")
    host = host.strip("[]") or "127.0.0.1"
    try:
        num = int(port)
    except ValueError:
        raise BadAddress(f"port must be a number, got {port!r}") from None
    if not 0 <= num <= 65535:
        raise BadAddress(f"port must be in 0..65535, got {num}")
    return host, num


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _csp(page: bytes) -> str:
    """The page's policy: its one inline script by hash, nothing from elsewhere, no framing."""
    text = page.decode()
    scripts = re.findall(r"<script>(.*?)</script>", text, flags=re.S)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    return (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
            f"img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def _names() -> set[str]:
    names = {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}
    return {n for n in names if n}


def host_allowed(header: str | None, names: set[str]) -> bool:
    """Whether a request's Host names this machine: absent (HTTP/1.0), an IP address, or one of `names`."""
    if not header:
        return True
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host.rstrip(".") in names


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], observer: Observer, page: bytes,
                 doc: Callable[[Any], dict[str, Any]]) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.observer = observer
        self.page, self.doc = page, doc
        self.csp = _csp(page)
        self.names = _names()
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[object, float, bytes]] = {}
        super().__init__(addr, _Handler)

    def rendered(self, what: str) -> bytes:
        """The body for the newest snapshot, rendered once per snapshot however often it is fetched, and
        /metrics at most every METRICS_MAX_AGE_S: rendering holds the GIL, which the scheduler's loop needs
        (measured: scrapes every 100 ms that rendered each time tripled the loop's request latency on 2
        busy cores). So /metrics may be up to 5 s old, counters and histograms included."""
        snapshot, now = self.observer.snapshot, time.monotonic()
        with self._lock:
            got = self._cache.get(what)
            if got is not None and (now - got[1] < METRICS_MAX_AGE_S if what == "metrics" else got[0] is snapshot):
                return got[2]
            data = (generate_latest(self.observer.registry) if what == "metrics"
                    else json.dumps(self.doc(self.observer)).encode())
            self._cache[what] = (snapshot, now, data)
            return data


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "elasticd"
    protocol_version = "HTTP/1.0"
    # http.server reads an unparsable request line as HTTP/0.9 and answers it without a status line;
    # every client of ours speaks 1.x and must see the 400.
    default_request_version = "HTTP/1.0"
    timeout = 10   # a client that opens a connection and sends nothing must not hold a thread forever

    def do_GET(self) -> None:   # noqa: N802 (http.server's naming)
        self._serve(body=True)

    def do_HEAD(self) -> None:   # noqa: N802
        self._serve(body=False)

    def _refuse(self) -> None:
        self.send_error(405, "read-only: GET or HEAD")

    def __getattr__(self, name: str) -> Any:
        # Any other method (POST, PUT, BREW, ...): http.server would answer 501, a server error; it is the
        # client's (a read-only endpoint), so 405.
        if name.startswith("do_"):
            return self._refuse
        raise AttributeError(name)

    def parse_request(self) -> bool:
        # A request line of fewer words (`GET /`, HTTP/0.9) would make http.server wait for headers the
        # client never sends, holding a thread until the timeout: answered now instead.
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        if len(line.split()) != 3:
            self.command, self.request_version, self.requestline = None, self.default_request_version, line
            self.close_connection = True
            self.send_error(400, "the request line must be METHOD PATH HTTP/1.x")
            return False
        return super().parse_request()

    def _serve(self, body: bool) -> None:
        if not host_allowed(self.headers.get("Host"), self.server.names):
            self.send_error(421, "Host names no address of this server")
            return
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            data, ctype = self.server.rendered("metrics"), CONTENT_TYPE_LATEST
        elif path in ("/", "/index.html"):
            data, ctype = self.server.page, "text/html; charset=utf-8"
        elif path == "/api/status.json":
            data, ctype = self.server.rendered("json"), "application/json"
        else:
            self.send_error(404, "not found: try /, /metrics or /api/status.json")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def end_headers(self) -> None:
        # On every response, errors included.
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Content-Security-Policy", self.server.csp)
        self.send_header("Referrer-Policy", "no-referrer")
        super().end_headers()

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("http %s: " + fmt, self.address_string(), *args)


def status_doc(observer: Observer) -> dict[str, Any]:
    s = observer.snapshot
    return {"at": s.at, "jobs": list(s.jobs), "nodes": list(s.nodes),
            "series": {k: [list(p) for p in v] for k, v in s.series.items()},
            "alloc": [[t, m] for t, m in s.alloc]}


class ObserveHTTP:
    """The HTTP endpoint of an `Observer` (or of anything with its `snapshot` and `registry`, such as a
    federation front's), serving in a daemon thread: `page` from this package, `doc` its JSON.

    Raises:
        OSError: if the address cannot be bound.
    """

    def __init__(self, observer: Any, host: str, port: int, page: str = _PAGE,
                 doc: Callable[[Any], dict[str, Any]] = status_doc) -> None:
        self._httpd = _Server((host, port), observer, resources.files("elasticd.observe").joinpath(page).read_bytes(),
                              doc)
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="elasticd-http", daemon=True)
        self._thread.start()
        where = "" if is_loopback(host) else " (NOT loopback: anyone who can reach it sees every job)"
        log.info("metrics and status page on http://%s:%d/%s", host, self.port, where)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
