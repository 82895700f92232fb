"""Control-plane benchmark: request round trip CLI-client -> scheduler, and one scheduler under many nodes.

Starts a real standalone scheduler (`elasticd scheduler`) on loopback TCP with CURVE, then
1. times `status` requests from a client (the CLI's `elasticd.cli.client.Client`) one after another;
2. connects --nodes simulated nodes (one CURVE DEALER each), submits jobs that the scheduler places
   on them, and has every node heartbeat every --heartbeat seconds (phases spread over the period)
   with the full report of its job, as a real daemon does; measures heartbeat -> ack latency, how
   many heartbeats were acked, the scheduler's CPU, and client round trips while under that load.

With --scrape S the scheduler also serves metrics (`--metrics 127.0.0.1:0`) and a thread plays Prometheus
and an open status page, fetching /metrics and /api/status.json every S seconds through the whole run
(scraping must not slow the control loop); compare the figures with and without it.

The last line is `rtt_p99_ms=X.XX` (idle round trip, 99th percentile).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elasticd import keys, transport  # noqa: E402
from elasticd import protocol as p  # noqa: E402
from elasticd.cli.client import Client, Target  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


_SCRAPER = """
import sys, threading, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
ms, nbytes = [], 0
while not stop.wait(every):
    for path in ("/metrics", "/api/status.json"):
        t = time.perf_counter()
        with urllib.request.urlopen(url + path, timeout=10) as r:
            nbytes += len(r.read())
        ms.append((time.perf_counter() - t) * 1000)
print(nbytes, *ms)
"""


class Scraper:
    """Prometheus and an open status page: GET /metrics and /api/status.json every `every` seconds, from a
    process of its own as they would be (a thread here would take the GIL from the simulated nodes and
    show up as the scheduler's latency)."""

    def __init__(self, url: str, every: float) -> None:
        self.every = every
        self.proc = subprocess.Popen([sys.executable, "-c", _SCRAPER, url, str(every)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.ms: list[float] = []
        self.bytes = 0

    def stop(self) -> None:
        out, _ = self.proc.communicate(timeout=30)   # closes its stdin: the scraper prints and exits
        fields = out.split()
        if self.proc.returncode != 0 or not fields:
            raise SystemExit(f"the scraper failed (exit {self.proc.returncode})")
        self.bytes, self.ms = int(fields[0]), [float(x) for x in fields[1:]]


def start_scheduler(state: Path, heartbeat: float, metrics: bool = False) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "elasticd", "scheduler", "--bind", "tcp://127.0.0.1:0",
                             "--state-dir", str(state), "--heartbeat", str(heartbeat), "--node-timeout",
                             str(max(10.0, 10 * heartbeat)), "--log-level", "WARNING",
                             *(["--metrics", "127.0.0.1:0"] if metrics else [])],
                            cwd=str(REPO), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(state.parent / "scheduler.err", "wb"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            info = json.loads((state / "scheduler.json").read_text())
            if info.get("pid") == proc.pid:
                return proc, info
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"scheduler exited: {(state.parent / 'scheduler.err').read_text()}")
        time.sleep(0.05)
    raise SystemExit("scheduler did not start")


def rtt(client: Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        client.request(p.Status(job_id=None))
        out.append((time.perf_counter() - t) * 1000)
    return out


class SimNodes:
    """Many nodes in one process: each hellos, then heartbeats its jobs' state like a daemon."""

    def __init__(self, ctx: zmq.Context, endpoint: str, state: Path, server: bytes, n: int) -> None:
        self.socks: list[zmq.Socket] = []
        self.jobs: list[dict[str, dict]] = [{} for _ in range(n)]
        self.ids = [f"sim{i:04d}" for i in range(n)]
        self.seq = [0] * n
        self.sent_at: dict[tuple[int, int], float] = {}
        self.lat: list[float] = []
        self.acked = 0
        self.sent = 0
        self.poller = zmq.Poller()
        self.index: dict[zmq.Socket, int] = {}
        for i in range(n):
            # Each node its own key, allowed as that node (a node key speaks only for its node id; the
            # scheduler's own admin key may not send node messages at all).
            ident = zmq.curve_keypair()
            keys.allow_key(state, ident[0], f"sim{i:04d}", role=keys.NODE, node_id=self.ids[i])
            s = transport.dealer(ctx, immediate=False)
            transport.curve_client(s, ident, server)
            s.connect(endpoint)
            self.socks.append(s)
            self.poller.register(s, zmq.POLLIN)
            self.index[s] = i

    def hello_all(self) -> None:
        for i, s in enumerate(self.socks):
            s.send(p.NodeHello(node_id=self.ids[i], host="127.0.0.1", pid=i,
                               devices=[p.DeviceInfo(device_id="cpu:0", type="cpu", index=0)]).encode())
        welcomed = 0
        deadline = time.monotonic() + 60
        while welcomed < len(self.socks) and time.monotonic() < deadline:
            welcomed += sum(isinstance(m, p.Welcome) for _i, m in self.drain(100))
        if welcomed < len(self.socks):
            raise SystemExit(f"only {welcomed}/{len(self.socks)} nodes welcomed")

    def report(self, i: int) -> list[p.JobReport]:
        out = []
        for job_id, j in self.jobs[i].items():
            j["step"] += 1
            out.append(p.JobReport(job_id=job_id, state="running", ranks=j["ranks"], master_port=29500,
                                   step=j["step"], steps_per_s=1.0, metrics={"loss": 1.0 / j["step"]},
                                   agents=[p.AgentReport(rank=r, device_id="cpu:0", pid=1000 + r, alive=True,
                                                         connected=True, rss=300 << 20, cpu=99.0)
                                           for r in j["ranks"]]))
        return out

    def beat(self, i: int) -> None:
        self.seq[i] += 1
        self.sent_at[(i, self.seq[i])] = time.perf_counter()
        self.socks[i].send(p.NodeStatus(node_id=self.ids[i], seq=self.seq[i], jobs=self.report(i)).encode())
        self.sent += 1

    def drain(self, timeout_ms: float) -> list[tuple[int, p.Message]]:
        got = []
        for s, _ in self.poller.poll(timeout_ms):
            i = self.index[s]
            while True:
                try:
                    m = p.decode(s.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                got.append((i, m))
                if isinstance(m, p.NodeAck):
                    t0 = self.sent_at.pop((i, m.seq), None)
                    if t0 is not None:
                        self.lat.append((time.perf_counter() - t0) * 1000)
                        self.acked += 1
                elif isinstance(m, p.LaunchJob):
                    self.jobs[i][m.job_id] = {"ranks": [pl.rank for pl in m.placements], "step": 0}
                elif isinstance(m, p.KillJob):
                    self.jobs[i].pop(m.job_id, None)
        return got

    def jobs_of_any(self) -> list[str]:
        return [job for jobs in self.jobs for job in jobs]

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--heartbeat", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--jobs", type=int, default=200, help="jobs of N=4 on 2..4 devices placed on the nodes")
    ap.add_argument("--scrape", type=float, default=0.0, metavar="S",
                    help="serve metrics and fetch /metrics and /api/status.json every S seconds (0: metrics off)")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as tmp:
        state = Path(tmp) / "sched"
        proc, info = start_scheduler(state, a.heartbeat, metrics=a.scrape > 0)
        scraper = Scraper(info["metrics"], a.scrape) if a.scrape > 0 else None
        try:
            ident = keys.load_identity(state)
            assert ident is not None
            server = info["public_key"].encode()
            ctx = zmq.Context()
            ctx.max_sockets = a.nodes + 64
            client = Client(Target(info["tcp"], server, ident, what="scheduler"), timeout_s=10)  # own I/O thread
            rtt(client, 200)  # warm-up: connections, CURVE handshake, caches
            idle = rtt(client, a.requests)
            print(f"idle round trip (status, {a.requests} requests): p50 {pct(idle, 50):.3f} ms  "
                  f"p99 {pct(idle, 99):.3f} ms  max {max(idle):.3f} ms")

            nodes = SimNodes(ctx, info["tcp"], state, server, a.nodes)
            t = time.perf_counter()
            nodes.hello_all()
            print(f"{a.nodes} nodes joined in {time.perf_counter() - t:.2f} s")
            for k in range(a.jobs):
                client.request(p.Submit(script="/bench/train.py", workers=4, min_devices=2, max_devices=4,
                                        name=f"bench{k}"))
            ps = psutil.Process(proc.pid)
            ps.cpu_percent(None)
            rng = random.Random(0)
            start = time.perf_counter()
            # (due time, node): heartbeat phases spread over the period; sent in 5 ms batches so the
            # driver polls its sockets ~200 times a second, not once per heartbeat.
            due = [(start + rng.random() * a.heartbeat, i) for i in range(a.nodes)]
            heapq.heapify(due)
            loaded: list[float] = []
            next_req = start
            watched = st_job = None
            while time.perf_counter() - start < a.duration:
                now = time.perf_counter()
                while due and due[0][0] <= now:
                    t_due, i = heapq.heappop(due)
                    nodes.beat(i)
                    heapq.heappush(due, (t_due + a.heartbeat, i))
                if now >= next_req:  # a client following one job 20 times a second, as `submit --wait` does
                    next_req = now + 0.05
                    st_job = st_job or next(iter(nodes.jobs_of_any()), None)
                    watched = p.Status(job_id=st_job)
                    t = time.perf_counter()
                    client.request(watched)
                    loaded.append((time.perf_counter() - t) * 1000)
                nodes.drain(max(0.0, min(due[0][0] - time.perf_counter(), 0.005)) * 1000)
            end = time.perf_counter() + 2 * a.heartbeat
            while nodes.sent_at and time.perf_counter() < end:
                nodes.drain(20)
            cpu = ps.cpu_percent(None)
            threads = sorted(((t.user_time + t.system_time), t.id) for t in ps.threads())[::-1]
            print("scheduler threads (cpu s): " + ", ".join(f"{tid}:{cs:.2f}" for cs, tid in threads[:4]))
            t = time.perf_counter()
            st = client.request(p.Status(job_id=None))
            full_ms = (time.perf_counter() - t) * 1000
            running = sum(j.state in ("starting", "running") for j in st.jobs)  # type: ignore[attr-defined]
            expected = a.nodes * a.duration / a.heartbeat
            lag99 = pct(nodes.lat, 99)
            keeps_up = nodes.acked >= 0.99 * nodes.sent and lag99 < a.heartbeat * 1000 / 2
            print(f"heartbeats: {nodes.sent} sent (~{expected:.0f} expected at {a.nodes / a.heartbeat:.0f}/s), "
                  f"{nodes.acked} acked; ack latency p50 {pct(nodes.lat, 50):.2f} ms  p99 {lag99:.2f} ms  "
                  f"max {max(nodes.lat, default=float('nan')):.2f} ms")
            print(f"scheduler cpu {cpu:.0f}% of one core; {running} jobs placed on the simulated nodes")
            print(f"round trip under load ({len(loaded)} `status JOB` requests): p50 {pct(loaded, 50):.3f} ms  "
                  f"p99 {pct(loaded, 99):.3f} ms; full `status` of {len(st.jobs)} jobs: {full_ms:.1f} ms")  # type: ignore[attr-defined]
            print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (tails include other "
                  "processes' CPU use)")
            print(f"keeps_up={'yes' if keeps_up else 'no'} (all heartbeats acked, p99 ack lag < half a period)")
            if scraper is not None:
                scraper.stop()
                print(f"scraper: {len(scraper.ms)} GETs of /metrics and /api/status.json every {a.scrape}s "
                      f"({scraper.bytes / max(1, len(scraper.ms)) / 1024:.0f} KiB each on average); "
                      f"p50 {pct(scraper.ms, 50):.1f} ms  p99 {pct(scraper.ms, 99):.1f} ms")
            nodes.close()
            client.close()
            ctx.term()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(f"rtt_p99_ms={pct(idle, 99):.2f}")


if __name__ == "__main__":
    main()
