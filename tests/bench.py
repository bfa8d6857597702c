"""make bench: gurtd's figures side by side in one run (figures, not a pass/fail test).

Prints task start latency (POST until the worker runs inside its boxed view) with 1 and with
400 layers and with hosts, undo latency and the broker's round trip, each beside its floor
(what the kernel needs for the same work with none of gurtd's bookkeeping, in the same run)
and its ratio to it (`python tests/bench.py start`: those figures only); GET /api/tasks/{id}
rate with 10,000 stored tasks next to a bare http.server answering the same JSON, gurtd's
RSS with 100 tasks running, GET latencies while the loop is busy, and tasks per second
through a burst beside its floor's (`python tests/bench.py api`: those figures only); then the
portal's: a
state change to a real browser showing it, a fresh load's first paint and its task list
drawn, and the page's size (`python tests/bench.py portal`: those only); then the
finish-time merge's and the exact undo's (`python tests/bench.py merge`: those only); then
the model gateway's: a call and its first streamed byte through it against the same calls
straight to the model, one task and 50 at once (`python tests/bench.py gateway`: those
only); then task start with workers born in their cgroup (clone3 CLONE_INTO_CGROUP) against
forked ones (`python tests/bench.py cgroups`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import http.client
import http.server
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import (GURTD as GURTD_PATH, Gurtd, chromium, make_done_layers,  # noqa: E402
                      make_home, quit_browser, registry, remove_home, running_gurtd, sign_in,
                      sse)

from floor import FLOOR_STORE_UID, FLOOR_UID, busy  # noqa: E402

import gurtd as G  # noqa: E402

TARGETS = {"ratio400": 1.3, "undo": 5.0, "rate": 0.7, "rss": 80.0}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def ts(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def start_latencies(g: Gurtd, n: int, floor: Any = None, hosts: list[str] | None = None
                    ) -> tuple[list[float], list[float]]:
    """n tasks one after the other: ms from POST to the first step in the box; then undo ms.
    With floor (a Floor), one floor start before each task (into floor.times), so that
    both see the same machine."""
    starts, undos = [], []
    for _ in range(n):
        if floor is not None:
            floor.times.append(floor.start())
        t0 = time.time()
        task = g.create("true", title="bench", **({"hosts": hosts} if hosts else {}))
        task = g.wait_done(task["id"])
        step = next(e for e in g.log(task["id"]) if e["type"] == "step")
        starts.append((ts(step["time"]) - t0) * 1000)
        t1 = time.perf_counter()
        g.api("POST", f"/api/tasks/{task['id']}/undo")
        undos.append((time.perf_counter() - t1) * 1000)
    return starts, undos


def fill_layers(g: Gurtd, count: int) -> None:
    for i in range(count):
        g.run_done(f"echo {i} > f{i % 50}", title="layer")


def request_rate(port: int, paths: list[str], token: str, seconds: float) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": f"Bearer {token}"}
    count, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        conn.request("GET", random.choice(paths), headers=headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        count += 1
    conn.close()
    return count / seconds


def bare_server(body: bytes) -> http.server.ThreadingHTTPServer:
    class Bare(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bare)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def store_tasks(home: str, count: int) -> list[str]:
    """Write count finished tasks straight into BOX_HOME/tasks, as a long-lived box has."""
    os.makedirs(os.path.join(home, "tasks"), exist_ok=True)
    ids = []
    stamp = G.now_iso()
    for i in range(count):
        task = G.Task(id=G.new_task_id(), title=f"stored {i}", prompt="true", workspace="home",
                      worker="fake", tools=[], hosts=[], budgetCents=0, source="api",
                      state="failed", user="", layers=[], costCents=0, createdAt=stamp,
                      updatedAt=stamp, error="stored", seq=i + 1)
        task.user = "box-" + task.id
        G.write_json(os.path.join(home, "tasks", task.id + ".json"),
                     __import__("dataclasses").asdict(task), sync=False)
        ids.append(task.id)
    return ids


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def dns_server(zone: dict[str, str]) -> int:
    """A tiny upstream DNS server on 127.0.0.1 (UDP, a daemon thread); its port."""
    import socket

    import dns.message
    import dns.rcode
    import dns.rrset
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            data, addr = sock.recvfrom(4096)
            query = dns.message.from_wire(data)
            answer = dns.message.make_response(query)
            name = query.question[0].name.to_text()
            if name in zone:
                answer.answer.append(dns.rrset.from_text(name, 60, "IN", "A", zone[name]))
            else:
                answer.set_rcode(dns.rcode.NXDOMAIN)
            sock.sendto(answer.to_wire(), addr)

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1]


def dns_times(address: tuple[str, int], count: int, nsfd: int | None = None) -> list[float]:
    """ms per A query for a.test, one after the other (from inside nsfd when given)."""
    import socket

    import dns.message
    out: list[float] = []

    def run() -> None:
        if nsfd is not None:
            G.libc_call("setns", nsfd, G.CLONE_NEWNET)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(5)
            sock.connect(address)
            for _ in range(count):
                wire = dns.message.make_query("a.test", "A").to_wire()
                t0 = time.perf_counter()
                sock.send(wire)
                answer = dns.message.from_wire(sock.recv(4096))
                out.append((time.perf_counter() - t0) * 1000)
                assert answer.answer, answer

    G.in_thread(run)
    return out


def broker_times(path: str, uid: int, count: int) -> list[float]:
    """ms per wallet.pay call through the broker socket, from a child with the task's uid."""
    import socket
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            times = []
            body = json.dumps({"tool": "wallet.pay", "args": {"to": "bench", "cents": 1}})
            request = (f"POST /call HTTP/1.1\r\nHost: box\r\nContent-Type: application/json"
                       f"\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
                reader = sock.makefile("rb")
                for _ in range(count):
                    t0 = time.perf_counter()
                    sock.sendall(request)
                    status = reader.readline()
                    length = 0
                    while (line := reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    reader.read(length)
                    times.append((time.perf_counter() - t0) * 1000)
                    assert b" 200 " in status, status
            os.write(w, json.dumps(times).encode())
        except BaseException as exc:
            sys.stderr.write(f"broker bench: {exc!r}\n")
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)


# Floors (issue 23) ###########################################################################
# What the kernel needs for a task start with none of gurtd's bookkeeping: tests/floor.py, in a
# process of its own (gurtd's module loaded, not the bench's pytest and selenium), driven by
# Floor below.  The other floors (undo, broker) are here.

def floor_home() -> str:
    """A BOX_HOME-like folder with one layer (one file) over a base, owned as gurtd's are."""
    home = make_home()
    for sub in ("workspaces/home", "layers/l1/upper", "layers/t/upper", "layers/t/work"):
        os.makedirs(os.path.join(home, sub))
    Path(home, "layers/l1/upper/f").write_text("one layer\n")
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            os.chown(os.path.join(root, name), FLOOR_STORE_UID, FLOOR_STORE_UID)
    return home


class Floor:
    """tests/floor.py's process on a floor_home (with hosts: each start with its network):
    start() times one floor start (into times, as start_latencies keeps them), burst() runs
    many; a context: the process ends, its folder goes."""

    def __init__(self, hosts: bool = False) -> None:
        self.home, self.times = floor_home(), list[float]()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "floor.py"), self.home] + (["hosts"] if hosts else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the floor's process ended with {self.proc.wait()}"
        return json.loads(answer)

    def start(self) -> float:
        return float(self.ask("start"))

    def burst(self, count: int, at_once: int) -> tuple[float, float]:
        rate, cpu = self.ask(f"burst {count} {at_once}")
        return rate, cpu

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            assert self.proc.wait(timeout=60) == 0, "the floor's process failed"
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            remove_home(self.home)


def floor_undo(n: int) -> list[float]:
    """ms of what an undo must make durable at least: a task file written whole, synced and
    renamed into place (its folder synced), and one log line."""
    home = make_home()
    os.makedirs(home)
    data = json.dumps({"id": "t", "state": "undone", "layers": [], "pad": "x" * 600}).encode()
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            G.atomic_write(os.path.join(home, "t.json"), data)
            fd = os.open(os.path.join(home, "t.jsonl"), os.O_RDWR | os.O_APPEND | os.O_CREAT)
            G.append_line(fd, b'{"type":"state","state":"undone"}\n')
            os.close(fd)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        remove_home(home)
    return times


def bare_unix_server(path: str, answer: bytes, ledger: str | None = None) -> None:
    """A bare unix-socket server (a daemon thread): each request's head and body read, the
    same answer every time, as the broker's size; with ledger, the body appended to that
    file as a line and synced before the answer, as a payment is."""
    import socket
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o666)
    server.listen(4)

    def serve() -> None:
        conn, _ = server.accept()
        reader = conn.makefile("rb")
        fd = os.open(ledger, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600) if ledger else -1
        while True:
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line:
                if fd >= 0:
                    os.close(fd)
                return
            body = reader.read(length)
            if fd >= 0:
                os.write(fd, body + b"\n")
                os.fsync(fd)
            conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()


def floor_broker(count: int) -> list[float]:
    """ms per round trip to a bare unix-socket server, from a child of a task's uid, the
    same request and an answer of the broker's size, the server appending and syncing one
    line before it answers (a payment is durable before its answer), on BOX_HOME's disk."""
    home = make_home()
    os.makedirs(home)
    os.chmod(os.path.dirname(home), 0o711)
    os.chmod(home, 0o711)
    body = json.dumps({"ok": True, "result": {"paid": 1, "balanceCents": 999_999}}).encode()
    bare_unix_server(os.path.join(home, "bare.sock"),
                     b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body,
                     os.path.join(home, "ledger.jsonl"))
    try:
        return broker_times(os.path.join(home, "bare.sock"), FLOOR_UID, count)
    finally:
        remove_home(home)


def with_floor(name: str, values: list[float], floor: list[float], target: str
               ) -> list[tuple[str, str, str]]:
    """A figure's p50 / p95, its floor's, and the ratio of the p50s."""
    p50, f50 = statistics.median(values), statistics.median(floor)
    return [(name, f"{p50:.2f} / {pct(values, 95):.2f}", ""),
            ("  floor: the kernel's part, p50 / p95 (ms)", f"{f50:.2f} / {pct(floor, 95):.2f}", ""),
            ("  ratio to the floor (p50)", f"{p50 / f50:.2f}x", target)]


def pause_to_event(g: Gurtd) -> float:
    """ms from a budget pause (the approval's createdAt) to its event on /api/events."""
    with g.stream("/api/events", timeout=30) as resp:
        resp.readline()                              # ": gurtd events"
        task = g.create("gurtd tool wallet.pay '{\"to\": \"x\", \"cents\": 1}'",
                        title="pause", tools=["wallet.pay"], budgetCents=0)
        for _, kind, text in sse(resp):
            received = time.time()
            approval = json.loads(text) if kind == "approval" else {}
            if approval.get("state") == "pending" and approval["task"] == task["id"]:
                break
    g.api("POST", f"/api/tasks/{task['id']}/stop")
    return (received - ts(approval["createdAt"])) * 1000


class Sampler:
    """GET paths in a loop on one kept-alive connection (a thread); ms per request."""

    def __init__(self, g: Gurtd, paths: list[str]) -> None:
        self.g, self.paths = g, paths
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        conn = self.g.connection()
        headers = {"Authorization": f"Bearer {self.g.token}"}
        while not self.stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", random.choice(self.paths), headers=headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
            self.times.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.005)
        conn.close()

    def figure(self) -> str:
        return f"{statistics.median(self.times):.1f} / {pct(self.times, 95):.1f}"


def churn(g: Gurtd, stop: threading.Event) -> None:
    """50 tasks start and end, again and again, until stop."""
    while not stop.is_set():
        ids = [g.create("true", title="churn", workspace="churn")["id"] for _ in range(50)]
        for task_id in ids:
            g.wait(task_id, timeout=120)


BURST_FIGURE = ("burst of 300 fake tasks from 16 clients, maxRunningTasks 50 (tasks/s, "
                "machine CPU-s a task)")


def burst(g: Gurtd, count: int, clients: int = 16) -> tuple[float, float]:
    """count fake tasks posted at once, by `clients` clients side by side (maxRunningTasks
    50), on a workspace of their own (each done task is one more layer of it): tasks per
    second, from the first POST until the last one is done, and the CPU-seconds a task the
    whole machine was busy meanwhile (gurtd, its workers, the kernel's threads, and whatever
    else runs: read it beside the load average)."""
    def post(_: int) -> str:
        return str(g.create("true", title="burst", workspace="burst")["id"])

    g.api("POST", "/api/workspaces", {"name": "burst"}, status=201)
    cpu, t0 = busy(), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        ids = set(pool.map(post, range(count)))
    while True:
        done = {t["id"] for t in g.api("GET", "/api/tasks?state=done&limit=1000")}
        if ids <= done:
            return count / (time.perf_counter() - t0), (busy() - cpu) / count
        time.sleep(0.05)


def burst_rows(g: Gurtd) -> list[tuple[str, str, str]]:
    """The burst of 300 (maxRunningTasks 50), after its floor in the same minute."""
    with Floor() as floor:
        floor_rate, floor_cpu = floor.burst(300, 50)
    rate, cpu = burst(g, 300)
    return [(BURST_FIGURE, f"{rate:.0f} ({cpu:.3f} s)", ">= 100 (49 before)"),
            ("  floor: 300 of the kernel's part, 50 at a time (starts/s, CPU-s a start)",
             f"{floor_rate:.0f} ({floor_cpu:.3f} s)", ""),
            ("  ratio to the floor (tasks/s)", f"{rate / floor_rate:.2f}x", "")]


def rss_figures(g: Gurtd, idle: str) -> list[tuple[str, str, str]]:
    """gurtd's RSS idle and with 100 `sleep 60` tasks running (stopped after)."""
    g.api("PUT", "/api/settings", {"maxRunningTasks": 200})
    base_rss = rss_mb(g.proc.pid)
    running = [g.create("sleep 60", title="rss")["id"] for _ in range(100)]
    for task_id in running:
        g.wait(task_id, ("running",), timeout=60)
    with_tasks = rss_mb(g.proc.pid)
    for task_id in running:
        g.api("POST", f"/api/tasks/{task_id}/stop")
    for task_id in running:
        g.wait(task_id, timeout=60)
    return [(f"gurtd RSS idle, {idle} (MB)", f"{base_rss:.1f}", ""),
            ("gurtd RSS with 100 tasks running (MB)", f"{with_tasks:.1f}",
             f"<= {TARGETS['rss']}")]


def burst_figures() -> list[tuple[str, str, str]]:
    """A burst of 300 tasks on a fresh box, then its RSS with 100 running."""
    with running_gurtd() as g:
        g.api("PUT", "/api/settings", {"maxRunningTasks": 50})
        return burst_rows(g) + rss_figures(g, "300 tasks done")


def api_figures() -> list[tuple[str, str, str]]:
    """Reads while the loop is busy: tasks starting and ending, a 30,000-file layer's
    changes; and a burst of 300 tasks."""
    results: list[tuple[str, str, str]] = []
    with running_gurtd() as g:
        g.api("PUT", "/api/settings", {"maxRunningTasks": 50})
        g.api("POST", "/api/workspaces", {"name": "churn"}, status=201)
        big = g.run_done("mkdir d && cd d && seq 1 30000 | xargs touch", title="30,000 files")
        paths = ["/api/tasks?limit=20", f"/api/tasks/{big['id']}"]
        for label, make_load in (("50 tasks start and end", "churn"),
                                 ("a 30,000-file layer's changes", "changes")):
            stop = threading.Event()
            if make_load == "churn":
                load = threading.Thread(target=churn, args=(g, stop), daemon=True)
            else:
                def walk() -> None:
                    while not stop.is_set():
                        g.request("GET", f"/api/tasks/{big['id']}/changes")
                load = threading.Thread(target=walk, daemon=True)
            load.start()
            time.sleep(0.5)
            samplers = [Sampler(g, [p]) for p in paths]
            for sampler in samplers:
                sampler.thread.start()
            time.sleep(8)
            for sampler in samplers:
                sampler.stop.set()
                sampler.thread.join()
            stop.set()
            load.join(timeout=180)
            results += [
                (f"GET /api/tasks?limit=20 while {label}, p50 / p95 (ms)", samplers[0].figure(),
                 "p95 <= 20"),
                (f"GET /api/tasks/{{id}} while {label}, p50 / p95 (ms)", samplers[1].figure(),
                 "p95 <= 20"),
            ]
        results += burst_rows(g)
    return results


def homes_disk(path: str = "/var/tmp") -> str:
    """The file system the test homes are made on (make_home's /var/tmp), and for ext4
    whether it has a journal: without one, the allocator passes over inodes freed in the
    last minute (six, while their inode table block is unwritten: ext4's recently_deleted),
    so a figure taken after a large deletion (an earlier run, a figure's home removed) pays
    for walking past them."""
    dev = os.stat(path).st_dev
    fstype, source = "?", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:                       # the last mount of that device wins
            fields = line.split(" - ")
            if fields[0].split()[2] == f"{os.major(dev)}:{os.minor(dev)}":
                fstype, source = fields[1].split()[:2]
    if fstype != "ext4":
        return fstype
    try:
        with open(f"/proc/fs/ext4/{os.path.basename(source)}/options") as f:
            journal = "data=" in f.read()    # a data mode is a journal's
    except OSError:
        return "ext4"
    return "ext4 with a journal" if journal else "ext4 without a journal"


def print_results(results: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in results)
    print(f"\ngurtd {G.VERSION} bench, {os.cpu_count()} cores, kernel {os.uname().release}, "
          f"homes on {homes_disk()}")
    for name, value, target in results:
        print(f"{name:<{width}}  {value:>16}  {('target ' + target) if target else ''}")


def start_figures() -> list[tuple[str, str, str]]:
    """Start and undo latency, 1 layer then 400 layers, beside their floors (a floor start
    before each task start, so that both see the same machine)."""
    with running_gurtd() as g, Floor() as floor:
        fill_layers(g, 1)
        start1, undo1 = start_latencies(g, 60, floor)
        fill_layers(g, 399)
        start400, undo400 = start_latencies(g, 60)
        undo_floor = floor_undo(60)
    p50_1, p50_400 = statistics.median(start1), statistics.median(start400)
    undos = undo1 + undo400
    return [
        *with_floor("task start, 1 layer, p50 / p95 (ms)", start1, floor.times, "<= 1.2x"),
        ("task start, 400 layers, p50 / p95 (ms)",
         f"{p50_400:.2f} / {pct(start400, 95):.2f}", ""),
        ("  ratio 400 layers / 1 layer (p50)", f"{p50_400 / p50_1:.2f}x",
         f"<= {TARGETS['ratio400']}x"),
        *with_floor("undo, p50 / p95 (ms; 1 and 400 layers)", undos, undo_floor,
                    f"p50 <= {TARGETS['undo']} ms"),
    ]


def hosts_figures() -> list[tuple[str, str, str]]:
    """Start latency with hosts beside its floor (a veth pair and one nftables element
    more), and what gurtd's DNS adds on top of the upstream's own."""
    port = dns_server({"a.test.": "198.18.0.10"})
    with running_gurtd({"GURT_DNS_UPSTREAM": f"127.0.0.1:{port}"}) as g, \
            Floor(hosts=True) as floor:
        # 198.18/15 is special-use: the owner allows it
        g.api("PUT", "/api/settings", {"dnsAllowedNets": ["198.18.0.0/24"]})
        starts, _ = start_latencies(g, 60, floor, hosts=["a.test"])
        task = g.create("sleep 60", title="dns", hosts=["a.test"])
        g.wait(task["id"], ("running",))
        deadline = time.monotonic() + 10
        while not g.worker_pids(task) and time.monotonic() < deadline:
            time.sleep(0.01)                 # running, and soon the box user's own
        pid = g.worker_pids(task)[0]
        nsfd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        upstream, through = [], []
        for _ in range(3):                   # interleaved, so that both see the same machine
            upstream += dns_times(("127.0.0.1", port), 100)
            through += dns_times((G.DNS_ADDR, 53), 100, nsfd)
        os.close(nsfd)
        g.api("POST", f"/api/tasks/{task['id']}/stop")
        up50, th50 = statistics.median(upstream), statistics.median(through)
    return [
        *with_floor("task start with hosts, p50 / p95 (ms)", starts, floor.times, "<= 1.3x"),
        ("DNS A answer, upstream alone, p50 (ms)", f"{up50:.3f}", ""),
        ("DNS A answer through gurtd, p50 (ms)", f"{th50:.3f}", ""),
        ("  gurtd adds (p50, ms)", f"{th50 - up50:.3f}", "<= 2"),
    ]


def broker_figures() -> list[tuple[str, str, str]]:
    """The broker: a call that needs no approval beside a bare unix-socket round trip, and a
    budget pause reaching /api/events."""
    floor = floor_broker(150)
    with running_gurtd() as g:
        g.api("PUT", "/api/wallet", {"balanceCents": 1_000_000})
        task = g.create("sleep 60", title="broker", tools=["wallet.pay"], budgetCents=1_000_000)
        g.wait(task["id"], ("running",))
        deadline = time.monotonic() + 10
        while not g.worker_pids(task) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.chmod(os.path.dirname(g.home), 0o711)   # mkdtemp's 0700 would keep the task out
        calls = broker_times(os.path.join(g.home, "run", "broker.sock"),
                             os.stat(f"/proc/{g.worker_pids(task)[0]}").st_uid, 300)
        g.api("POST", f"/api/tasks/{task['id']}/stop")
        delays = []
        for _ in range(10):
            delays.append(pause_to_event(g))
    floor += floor_broker(150)
    return [
        *with_floor("broker round trip, wallet.pay, p50 / p95 (ms)", calls, floor,
                    "p50 <= 1 ms"),
        ("budget pause to its /api/events event, p50 (ms)",
         f"{statistics.median(delays):.1f}", "within a second"),
    ]


def main() -> None:
    if sys.argv[1:] == ["api"]:          # python tests/bench.py api: the API figures only
        print_results(api_figures())
        return
    if sys.argv[1:] == ["burst"]:        # python tests/bench.py burst: the burst and RSS only
        print_results(burst_figures())
        return
    if sys.argv[1:] == ["start"]:        # python tests/bench.py start: starts, undo, broker
        print_results(start_figures() + hosts_figures() + broker_figures())
        return
    results: list[tuple[str, str, str]] = start_figures()
    # 2. GET /api/tasks/{id} with 10,000 stored tasks, next to a bare http.server
    g = Gurtd(make_home())
    ids = store_tasks(g.home, 10_000)
    g.start()
    try:
        paths = [f"/api/tasks/{i}" for i in ids]
        body = g.api("GET", paths[0], status=200)
        bare = bare_server(json.dumps(body).encode())
        rates = {"gurtd": [], "bare": []}
        for _ in range(3):  # interleaved, so that both see the same machine
            rates["gurtd"].append(request_rate(g.port, paths, g.token, 2.0))
            rates["bare"].append(request_rate(bare.server_address[1], paths, "", 2.0))
        bare.shutdown()
        gurtd_rate, bare_rate = max(rates["gurtd"]), max(rates["bare"])
        results += [
            ("GET /api/tasks/{id}, 10,000 tasks (req/s)", f"{gurtd_rate:.0f}", ""),
            ("bare http.server, same JSON (req/s)", f"{bare_rate:.0f}", ""),
            ("  ratio gurtd / bare", f"{gurtd_rate / bare_rate:.2f}x",
             f">= {TARGETS['rate']}x"),
        ]
        # 3. RSS with 100 tasks running
        results += rss_figures(g, "10,000 tasks stored")
    finally:
        g.stop()
        remove_home(g.home)
    results += hosts_figures()
    results += broker_figures()
    results += api_figures()
    results += personal_figures()
    results += portal_figures()
    results += layer_figures()
    results += merge_figures()
    results += gateway_figures()
    results += cgroup_figures()
    print_results(results)


# personal mode: a task on a 100,000-file folder, keep and diff of 1,000 files ################

def folder_starts(g: Gurtd, n: int, folder: str | None) -> list[float]:
    """ms from POST to the first step in the box, n tasks, on folder or workspace-only."""
    starts = []
    for _ in range(n):
        fields = {"folder": folder} if folder else {}
        t0 = time.time()
        task = g.wait(g.create("true", title="bench", **fields)["id"])
        assert task["state"] == "done", task
        step = next(e for e in g.log(task["id"]) if e["type"] == "step")
        starts.append((ts(step["time"]) - t0) * 1000)
        g.api("POST", f"/api/tasks/{task['id']}/undo")
    return starts


def personal_figures() -> list[tuple[str, str, str]]:
    import pwd
    import shutil
    import subprocess
    name = "gurtbench" + os.urandom(2).hex()
    subprocess.run(["useradd", "-m", "-d", f"/home/{name}", "-s", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    owner = pwd.getpwnam(name)
    folder = f"/home/{name}/big"
    g = Gurtd(make_home())
    try:
        for d in range(100):                      # 100 folders of 1,000 files
            os.makedirs(f"{folder}/d{d}")
            for i in range(1000):
                Path(f"{folder}/d{d}/f{i}.txt").write_text(f"line one of {d}/{i}\nline two\n")
        subprocess.run(["chown", "-R", f"{owner.pw_uid}:{owner.pw_gid}", folder], check=True)
        g.start()
        plain, personal = [], []
        for _ in range(20):              # side by side, so that both see the same machine
            plain += folder_starts(g, 1, None)
            personal += folder_starts(g, 1, folder)
        edit = "for f in {}/d{}/*; do echo changed >> $f; done"
        task = g.run(edit.format(folder, 0), title="keep", folder=folder)
        t0 = time.perf_counter()
        kept = g.api("POST", f"/api/tasks/{task['id']}/keep")
        keep_s = time.perf_counter() - t0
        assert kept["review"] == "kept", kept
        task = g.run(edit.format(folder, 1), title="diff", folder=folder)
        t0 = time.perf_counter()
        code, diff, _ = g.request("GET", f"/api/tasks/{task['id']}/diff")
        diff_s = time.perf_counter() - t0
        assert code == 200 and diff.count(b"+changed") == 1000
    finally:
        if g.proc is not None:
            g.stop()
        remove_home(g.home)
        subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
        shutil.rmtree(f"/home/{name}", ignore_errors=True)
    p50_plain, p50_personal = statistics.median(plain), statistics.median(personal)
    return [
        ("task start, workspace only, p50 (ms)", f"{p50_plain:.1f}", ""),
        ("task start, one 100,000-file folder, p50 (ms)", f"{p50_personal:.1f}", ""),
        ("  folder start / workspace start", f"{p50_personal / p50_plain:.2f}x", "<= 1.2x"),
        ("keep of 1,000 changed files (s)", f"{keep_s:.2f}", "<= 1"),
        ("diff of 1,000 changed text files (s)", f"{diff_s:.2f}", "<= 1"),
    ]


# portal ########################################################################################

SEEN_DONE_JS = """
window.seenDone = {};
new MutationObserver(() => {
  for (const row of document.querySelectorAll('#task-rows tr[data-state="done"]')) {
    const id = row.id.slice(5);
    if (!(id in window.seenDone)) window.seenDone[id] = Date.now();
  }
}).observe(document.getElementById("task-rows"), {childList: true, subtree: true,
                                                  attributes: true});
"""


# A fresh load of the portal: the browser's first contentful paint, and the portal's own
# mark (gurtd:ready) once its first page is drawn with the live data, in ms from navigation.
PAINT_JS = """
const fcp = performance.getEntriesByName("first-contentful-paint")[0];
const ready = performance.getEntriesByName("gurtd:ready")[0];
return fcp && ready && document.querySelector("#task-rows tr") ? [fcp.startTime, ready.startTime] : null;
"""


def first_paints(driver: Any, count: int) -> tuple[list[float], list[float]]:
    """count reloads of the page as it is (a full load each: the same URL again would only be
    a move inside the page)."""
    paints, readies = [], []
    for _ in range(count):
        driver.refresh()
        deadline = time.monotonic() + 10
        while (got := driver.execute_script(PAINT_JS)) is None:
            assert time.monotonic() < deadline, "the portal never drew its task list"
            time.sleep(0.01)
        paints.append(got[0])
        readies.append(got[1])
    return paints, readies


def portal_figures() -> list[tuple[str, str, str]]:
    """A task's state change (its done, as saved) to the task list in a real headless
    Chromium showing it (a MutationObserver notes the time), p50 over 20 tasks one after the
    other; the first paint of a fresh load and its task list drawn, p50 over 10 loads (with
    those 20 tasks listed); and the page's size."""
    page = os.path.getsize(os.path.join(os.path.dirname(GURTD_PATH), "portal.html"))
    g = Gurtd(make_home())
    g.start()
    driver, profile = chromium()
    try:
        sign_in(driver, g)
        driver.execute_script("location.hash = '#/tasks'")
        time.sleep(0.2)
        driver.execute_script(SEEN_DONE_JS)
        delays = []
        for _ in range(20):
            task = g.wait(g.create("true", title="portal bench")["id"])
            assert task["state"] == "done", task
            deadline = time.monotonic() + 10
            while (seen := driver.execute_script("return window.seenDone[arguments[0]]",
                                                 task["id"])) is None:
                assert time.monotonic() < deadline, "the portal never showed the task done"
                time.sleep(0.01)
            delays.append(seen - ts(task["updatedAt"]) * 1000)
        paints, readies = first_paints(driver, 10)
    finally:
        quit_browser(driver, profile)
        g.stop()
        remove_home(g.home)
    return [
        ("portal: state change to shown in the browser, p50 / p95 (ms)",
         f"{statistics.median(delays):.1f} / {pct(delays, 95):.1f}", "p50 <= 300"),
        ("portal: first contentful paint, p50 / p95 (ms)",
         f"{statistics.median(paints):.1f} / {pct(paints, 95):.1f}", ""),
        ("portal: load to the task list drawn with live data, p50 / p95 (ms)",
         f"{statistics.median(readies):.1f} / {pct(readies, 95):.1f}", ""),
        ("portal: page size (KB, uncompressed)", f"{page / 1000:.1f}", "<= 100"),
    ]


# Layers (issue 10) ###########################################################################
# Workspaces of 1, 500, 2,000 and 10,000 done layers, made directly on disk the way gurtd
# makes them (test_layers.make_done_layers), gurtd started on them and its merges awaited.

def merged_due(count: int) -> int:
    return max(0, count - G.LAYER_KEEP) // G.LAYER_GROUP


def layer_home(count: int) -> tuple[Gurtd, list[str]]:
    g = Gurtd(make_home())
    ids = make_done_layers(g.home, count)
    g.start(timeout=120)
    deadline = time.monotonic() + 600
    while len(registry(g.home)["merged"]) < merged_due(count):
        assert time.monotonic() < deadline, "the merges did not end"
        time.sleep(0.2)
    return g, ids


def timed_ms(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def layer_figures() -> list[tuple[str, str, str]]:
    """Start p50 at 1/500/2,000/10,000 layers; at 10,000: undo of the oldest and newest
    tasks, a files API read, the bytes merging added, a list of 200 tasks of 10,000 layers."""
    results: list[tuple[str, str, str]] = []
    start_p50: dict[int, float] = {}
    for count in (1, 500, 2000, 10_000):
        g, ids = layer_home(count)
        try:
            starts, _ = start_latencies(g, 20)
            start_p50[count] = statistics.median(starts)
            results.append((f"task start, {count} layers, p50 / p95 (ms)",
                            f"{start_p50[count]:.1f} / {pct(starts, 95):.1f}",
                            "p50 <= 1.3x the 1-layer p50" if count == 10_000 else ""))
            if count != 10_000:
                continue
            results.append(("  ratio 10,000 layers / 1 layer (p50)",
                            f"{start_p50[count] / start_p50[1]:.2f}x", "<= 1.3x"))
            reads = [timed_ms(lambda: g.file("home", "n5000")) for _ in range(50)]
            results.append(("files API read of one file, 10,000 layers, p50 / p95 (ms)",
                            f"{statistics.median(reads):.1f} / {pct(reads, 95):.1f}", ""))
            singles = [os.path.join(g.home, "layers", i) for i in ids]
            merged = [os.path.join(g.home, "merged", n) for n in os.listdir(
                os.path.join(g.home, "merged")) if not n.endswith(".json")]
            added = G.layer_bytes(singles + merged) - G.layer_bytes(singles)
            results.append(("disk added by merging 10,000 layers (bytes)", f"{added}",
                            "no file data"))
            for name, victims in (("oldest", ids[:20]), ("newest", ids[-20:])):
                undos = [timed_ms(lambda v=v: g.api("POST", f"/api/tasks/{v}/undo"))
                         for v in victims]
                results.append((f"undo of the {name} tasks, 10,000 layers, p50 / p95 (ms)",
                                f"{statistics.median(undos):.1f} / {pct(undos, 95):.1f}",
                                "p95 <= 50"))
        finally:
            g.stop()
            remove_home(g.home)
    results += list_figures()
    return results


def list_figures() -> list[tuple[str, str, str]]:
    """GET /api/tasks?limit=200 where each of the 200 tasks saw 10,000 layers, whole and with
    ?fields=id,state."""
    g = Gurtd(make_home())
    ids = make_done_layers(g.home, 10_000)
    stack = ids[::-1]
    stamp = "2026-01-02T00:00:00Z"
    for n in range(200):
        task = G.Task(id=f"tz{n:08d}", title="saw them all", prompt="true",
                      workspace="home", worker="fake", tools=[], hosts=[], budgetCents=0,
                      source="api", state="failed", user="", layers=stack, costCents=0,
                      createdAt=stamp, updatedAt=stamp, seq=20_000 + n)
        with open(os.path.join(g.home, "tasks", task.id + ".json"), "w") as f:
            json.dump(dataclasses.asdict(task), f)
    g.start(timeout=120)
    try:
        out = []
        for query in ("limit=200", "limit=200&fields=id,state"):
            times = [timed_ms(lambda q=query: g.api("GET", f"/api/tasks?{q}")) for _ in range(5)]
            out.append((f"GET /api/tasks?{query}, 200 tasks of 10,000 layers, p50 (ms)",
                        f"{statistics.median(times):.1f}", ""))
        return out
    finally:
        g.stop()
        remove_home(g.home)


# Finish-time merge (issue 21) ################################################################
# A task waits at an ask (its gate) while others end, so the bench decides what its
# finish-time check meets; the time it adds is its answer-to-done time (log times) less the
# same for a task that met nothing.

GATE = "gurtd tool ask '{\"question\": \"end?\"}'"


def gated(g: Gurtd, command: str) -> tuple[str, str]:
    """A task that runs command, then waits at its gate: (task id, gate approval id)."""
    task = g.create(command + "\n" + GATE, title="bench", tools=["ask"])
    return task["id"], g.pending(task["id"])["id"]


def answer_to_done_ms(g: Gurtd, task_id: str, gate: str) -> float:
    """Open the gate; ms from the answer to done, from the task's log."""
    g.api("POST", f"/api/approvals/{gate}/answer", {"answer": "go"})
    assert g.wait(task_id)["state"] == "done", g.task(task_id)
    log = g.log(task_id)
    answered = next(e for e in log if e["type"] == "approval" and e.get("state"))
    done = next(e for e in log if e["type"] == "state" and e["state"] == "done")
    return (ts(done["time"]) - ts(answered["time"])) * 1000


def check_added(g: Gurtd, rounds: int, command: str, others: int, other_command: str
                ) -> tuple[list[float], list[float], list[float]]:
    """Answer-to-done ms of a task that ran command (with {r}) while `others` tasks ran
    other_command (with {r} and {n}) and ended during its run, and of one that met none;
    and its check replayed (replayed_check_ms)."""
    met, alone, checks = [], [], []
    for r in range(rounds):
        alone.append(answer_to_done_ms(g, *gated(g, command.format(r=f"alone-{r}"))))
        task_id, gate = gated(g, command.format(r=r))
        ended = [g.run(other_command.format(r=r, n=n))["id"] for n in range(others)]
        met.append(answer_to_done_ms(g, task_id, gate))
        checks += replayed_check_ms(g, task_id, ended[::-1], 3)
    return met, alone, checks


def replayed_check_ms(g: Gurtd, task_id: str, ended: list[str], runs: int) -> list[float]:
    """The finish-time check of a done task run again in this process (G.run_check, as the
    merge thread runs it): its view then, and the layers that ended while it ran."""
    import tempfile
    seen = g.task(task_id)["layers"]
    job = G.MergeCheck(task_id, 0, f"layers/{task_id}/upper", G.lower_layer_paths(seen),
                       G.lower_layer_paths(ended + seen), "workspaces/home",
                       [os.path.join(g.home, "layers", i, "upper") for i in ended], ended + seen)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(runs):
            times.append(timed_ms(lambda: G.run_check(job, g.home, tmp)))
    return times


def merge_text_ms(lines: int, runs: int) -> list[float]:
    """G.merge_text (in this process) of one file of `lines` lines, changed at its start on
    one side and at its end on the other: a clean merge."""
    import tempfile
    base = [f"line {i}\n".encode() for i in range(lines)]
    ours, theirs = list(base), list(base)
    ours[1], theirs[-2] = b"ours\n", b"theirs\n"
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(runs):
            t0 = time.perf_counter()
            clean, _ = G.merge_text(b"".join(ours), b"".join(base), b"".join(theirs), tmp)
            times.append((time.perf_counter() - t0) * 1000)
            assert clean
    return times


def undo_times(g: Gurtd, victims: int, copies: int) -> tuple[list[float], list[float]]:
    """Undo of `victims` tasks, each of which changed line 2 of `copies` files that `copies`
    later tasks then changed again (line 9, one file of each victim a task): the answer's
    ms (it names the reverted paths: the revert's check is decided by then), and ms until
    the revert layer joined (undoMerge in the record)."""
    for v in range(victims):
        g.run(f"mkdir -p u{v} && for i in $(seq {copies}); do seq 10 > u{v}/f$i; done")
    ids = [g.run(f"for i in $(seq {copies}); do sed -i 2s/.*/victim/ u{v}/f$i; done")["id"]
           for v in range(victims)]
    for i in range(1, copies + 1):
        g.run(" && ".join(f"sed -i 9s/.*/later/ u{v}/f{i}" for v in range(victims)))
    answers, joined = [], []
    for task_id in ids:
        t0 = time.perf_counter()
        said = g.api("POST", f"/api/tasks/{task_id}/undo")["undoMerge"]
        answers.append((time.perf_counter() - t0) * 1000)
        assert said["state"] in ("writing", "done") and len(said["reverted"]) == copies, said
        deadline = time.monotonic() + 120
        while "undoMerge" not in (task := g.task(task_id)):
            assert time.monotonic() < deadline, task
            time.sleep(0.005)
        joined.append((time.perf_counter() - t0) * 1000)
        assert len(task["undoMerge"]["reverted"]) == copies, task["undoMerge"]
    return answers, joined


def merge_figures() -> list[tuple[str, str, str]]:
    """The finish-time check's added time (10 tasks ended meanwhile, 1,000 files changed),
    a clean merge of one 10,000-line file (alone, and as the time added to a task's end),
    and undo with 100 later copies (the answer, and the revert layer joined)."""
    results: list[tuple[str, str, str]] = []
    with running_gurtd() as g:
        many = "mkdir -p many && for i in $(seq 1000); do echo {r} > many/f$i; done"
        met, alone, checks = check_added(g, 5, many, 10, "echo {n} > other-{r}-{n}.txt")
        results.append(("finish-time check, 1,000 files, 10 ended meanwhile, p50 / p95 (ms)",
                        f"{statistics.median(checks):.1f} / {pct(checks, 95):.1f}", "p50 <= 50"))
        results.append(("  answer to done with it / without, p50 (ms)",
                        f"{statistics.median(met):.1f} / {statistics.median(alone):.1f}", ""))
        texts = merge_text_ms(10_000, 20)
        results.append(("clean merge of one 10,000-line file (merge_text), p50 / p95 (ms)",
                        f"{statistics.median(texts):.1f} / {pct(texts, 95):.1f}", "<= 20"))
        g.run("seq 10000 > big.txt")
        met, alone, checks = check_added(g, 5, "sed -i 2s/.*/ours-{r}/ big.txt", 1,
                                         "sed -i 9999s/.*/theirs-{r}/ big.txt")
        results.append(("  its finish-time check (one 10,000-line file), p50 / p95 (ms)",
                        f"{statistics.median(checks):.1f} / {pct(checks, 95):.1f}", ""))
        answers, joined = undo_times(g, 5, 100)
        results.append(("undo of a task with 100 later copies: answer naming them, p50 (ms)",
                        f"{statistics.median(answers):.1f}", "<= 50"))
        results.append(("  until its revert layer joined, p50 / p95 (ms)",
                        f"{statistics.median(joined):.1f} / {pct(joined, 95):.1f}", ""))
    return results


# the model gateway: a call through it against the same call straight to the model ###########

def direct_timed(port: int, count: int, at: float, tasks: int) -> list[tuple[list[float],
                                                                           list[float]]]:
    """`tasks` processes (as many as tasks calling), each from `at` (epoch seconds) making
    count calls straight to the stand-in model, as the stand-in agent makes them through the
    gateway: (whole ms, first byte ms) of each."""
    from test_gateway import KEY, MODEL, TIMED
    code = TIMED + (f"import json, time\ntime.sleep(max(0.0, {at} - time.time()))\n"
                    f"print(json.dumps(timed('127.0.0.1', {port}, {KEY!r}, "
                    f"{{'model': {MODEL!r}, 'max_tokens': 100, 'messages': "
                    f"[{{'role': 'user', 'content': 'hi'}}]}}, {count})))")
    procs = [subprocess.Popen(["/usr/bin/python3", "-c", code], stdout=subprocess.PIPE)
             for _ in range(tasks)]
    return [tuple(json.loads(proc.communicate()[0])) for proc in procs]


def gateway_timed(g: Gurtd, count: int, at: float, tasks: int) -> list[tuple[list[float],
                                                                            list[float]]]:
    """The same from inside `tasks` tasks (the stand-in agent), through the gateway."""
    from test_gateway import results
    ids = [g.api("POST", "/api/tasks", {"title": "gateway", "prompt": f"at{at} time{count}",
                                        "budgetCents": 100_000}, status=201)["id"]
           for _ in range(tasks)]
    out = []
    for task_id in ids:
        g.wait_done(task_id, timeout=300)
        timed = results(g, task_id)[-1]      # earlier tasks' lines are in its view too
        out.append((timed["whole"], timed["first"]))
    return out


def gateway_figures() -> list[tuple[str, str, str]]:
    """A call's p50 and its first streamed byte's (every other call streams), through the
    gateway from inside a task against the same calls straight to the stand-in model (the
    floor), one after another, and 50 tasks calling at once."""
    from test_gateway import KEY, Upstream, agent_droid, gateway_settings
    os.environ.pop("FACTORY_API_KEY", None)
    upstream = Upstream(lambda api, body: ("Hello.", None))
    agent = agent_droid()
    results: list[tuple[str, str, str]] = []
    try:
        with running_gurtd() as g:
            g.api("PUT", "/api/secrets/model", {"key": KEY})
            g.api("PUT", "/api/settings", {**gateway_settings(upstream), "droidPath": agent,
                                           "maxRunningTasks": 60})
            for tasks, count, wait in ((1, 200, 0.0), (50, 20, 15.0)):
                at = time.time() + wait
                through = gateway_timed(g, count, at, tasks)
                direct = direct_timed(upstream.port, count, time.time() + wait / 3, tasks)
                results += gateway_rows(tasks, through, direct)
    finally:
        upstream.close()
        shutil.rmtree(os.path.dirname(agent), ignore_errors=True)
    return results


def gateway_rows(tasks: int, through: list[tuple[list[float], list[float]]],
                 direct: list[tuple[list[float], list[float]]]) -> list[tuple[str, str, str]]:
    rows = []
    for i, what in enumerate(("call", "first streamed byte")):
        gw = statistics.median([v for t in through for v in t[i]])
        floor = statistics.median([v for t in direct for v in t[i]])
        label = "one task, calls one after another" if tasks == 1 else \
            f"{tasks} tasks calling at once"
        rows += [(f"model {what} through the gateway, {label}, p50 (ms)", f"{gw:.2f}", ""),
                 ("  straight to the model (the floor), p50 (ms)", f"{floor:.2f}", ""),
                 ("  the gateway adds (p50, ms)", f"{gw - floor:.2f}",
                  "<= 1" if tasks == 1 else "")]
    return rows


# cgroups: a worker born in its group (clone3 CLONE_INTO_CGROUP) or forked and joining it #####

def spawn_us(group: str, way: str, count: int) -> list[float]:
    """The spawner's own time (us) to start a child in group the given way, count times."""
    os.environ[G.CLONE3_ENV] = "yes" if way == "clone3" else "no"
    spawner = G.Spawner()
    spawner.start()
    try:
        out = []
        for _ in range(count):
            answer = spawner.probe(group)
            assert answer["way"] == way, answer
            out.append(float(answer["us"]))
        return out
    finally:
        spawner.stop()
        os.environ.pop(G.CLONE3_ENV)


def cgroup_figures() -> list[tuple[str, str, str]]:
    """Task start p50 with workers born in their v2 group against forked ones that write
    cgroup.procs, two gurtds side by side, tasks alternating; then the spawner's start of a
    child alone, each way.  Needs a v2 hierarchy where this host allows groups."""
    ways = {"clone3": {}, "fork": {G.CLONE3_ENV: "no"}}
    gurtds = {way: Gurtd(make_home(), env) for way, env in ways.items()}
    starts: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for g in gurtds.values():
            g.start()
        for _ in range(30):
            for way, g in gurtds.items():
                starts[way] += start_latencies(g, 1)[0]
    finally:
        for g in gurtds.values():
            if g.proc is not None:
                g.stop()
            remove_home(g.home)
    group = os.path.join(G.cgroup_own_groups()[0] or "", "gurt-bench-spawn")
    os.makedirs(group, exist_ok=True)
    try:
        spawns = {way: spawn_us(group, way, 200) for way in ways}
    finally:
        os.rmdir(group)
    p50 = {way: statistics.median(v) for way, v in starts.items()}
    return [
        ("task start, worker born in its group (clone3), p50 (ms)", f"{p50['clone3']:.1f}", ""),
        ("task start, forked, then cgroup.procs, p50 (ms)", f"{p50['fork']:.1f}", ""),
        ("spawner: a child in its group, clone3 / fork+write, p50 (us)",
         f"{statistics.median(spawns['clone3']):.0f} / {statistics.median(spawns['fork']):.0f}",
         ""),
    ]


if __name__ == "__main__":
    if sys.argv[1:] == ["cgroups"]:      # python tests/bench.py cgroups: clone3 against fork
        print_results(cgroup_figures())
    elif sys.argv[1:] == ["personal"]:     # python tests/bench.py personal: this section only
        print_results(personal_figures())
    elif sys.argv[1:] == ["portal"]:     # python tests/bench.py portal: the portal's only
        print_results(portal_figures())
    elif sys.argv[1:] == ["layers"]:     # python tests/bench.py layers: these figures only
        print_results(layer_figures())
    elif sys.argv[1:] == ["merge"]:      # python tests/bench.py merge: issue 21's only
        print_results(merge_figures())
    elif sys.argv[1:] == ["gateway"]:    # python tests/bench.py gateway: the model gateway's
        print_results(gateway_figures())
    elif sys.argv[1:] in ([], ["api"], ["burst"], ["start"]):
        main()
    else:                                # -h, --help or a part it does not know: no run
        print(__doc__.strip())
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
