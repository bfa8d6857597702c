"""Task-controlled input cannot crash or stall gurtd: stories of a task that attacks its host.

A task writes what it likes into its worker's stream, its DNS, its broker socket and its own
files; an owner reads the results with the API and the command line.  Each story runs real
tasks (real users, views, namespaces) against a real gurtd, then checks that gurtd still
answers, that the other tasks still work, and that its open files stayed bounded.  The pure
parsers come first.  All traffic goes to loopback, unix sockets, or the tasks' own namespaces.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import random
import shlex
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import gurtd as G
from conftest import SONNET, Gurtd, deep_tree, eventually, python_line, running_gurtd

# helpers #####################################################################################

def open_fds(g: Gurtd) -> int:
    assert g.proc is not None
    return len(os.listdir(f"/proc/{g.proc.pid}/fd"))


def strict_json(data: bytes) -> Any:
    """JSON as a browser reads it: NaN or Infinity is an error."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} in gurtd's answer")
    return json.loads(data, parse_constant=refuse)


# 1. the parsers take any input (pure) ########################################################

EVIL_LINES = [
    "[" * 100_000, "{\"a\":" * 70 + "1" + "}" * 70, "NaN", "[Infinity]", "1e400",
    "1" * 5000, "\"\\ud800\"", "null", "[1, 2]", "\"text\"", "{", "", " ", "\x00\xff",
]


@pytest.mark.pure
def test_bounded_json_gives_a_value_or_a_value_error_for_any_line() -> None:
    for line in EVIL_LINES + [line.encode("latin-1") for line in EVIL_LINES]:
        try:
            value = G.loads_bounded(line)
        except ValueError:
            continue
        json.dumps(value, allow_nan=False)       # whatever passed can be written back
    assert G.loads_bounded('{"a": [1, {"b": 2.5}]}') == {"a": [1, {"b": 2.5}]}
    with pytest.raises(ValueError, match="deeper"):
        G.loads_bounded("[" * 65 + "]" * 65)
    with pytest.raises(ValueError, match="too deeply"):
        G.loads_bounded("[" * 100_000)


@pytest.mark.pure
def test_droid_events_of_any_shape_give_a_step_or_none() -> None:
    for event in [None, [], "x", 1, {"type": []}, {"type": "tool_call", "parameters": [1]},
                  {"type": "tool_call", "toolName": {"a": 1}, "parameters": {"command": 5}},
                  {"type": "message", "role": "assistant", "text": " \n \u2028 "},
                  {"type": "message", "role": ["assistant"], "text": "x"}]:
        step = G.droid_step(event)
        assert step is None or isinstance(step, str)
    assert G.last_line(" ") == "" and G.last_line("a\n b \n\n") == "b"
    assert G.last_line(["x"]) == "['x']"


@pytest.mark.pure
def test_usage_costs_stay_finite_whatever_the_counts() -> None:
    for usage in [{"input_tokens": 1e308, "output_tokens": 1e308},
                  {"input_tokens": 10 ** 400}, {"input_tokens": -5},
                  {"input_tokens": float("nan")}, {"input_tokens": True},
                  {"input_tokens": "100"}, [1], None]:
        cents = G.usage_cents(usage, SONNET)
        assert math.isfinite(cents) and cents == 0, (usage, cents)
    assert G.usage_cents({"input_tokens": G.MAX_TOKENS}, {"input": 1e308}) == 0
    assert G.usage_cents({"input_tokens": 1_000_000}, SONNET) == 300
    assert G.usage_cents({"input_tokens": 1_000_000}, {"input": "cheap"}) == 0


@pytest.mark.pure
def test_a_payment_below_a_hundredth_of_a_cent_is_refused() -> None:
    """A task paying 1e-9 cents at a time could write millions of synced ledger lines inside
    a one-cent budget: a payment is at least MIN_PAYMENT_CENTS, so a budget bounds the count."""
    for cents in (1e-9, 0.001, 0, -1):
        with pytest.raises(ValueError, match="at least 0.01"):
            G.check_tool_args("wallet.pay", {"to": "x", "cents": cents})
    assert G.check_tool_args("wallet.pay", {"to": "x", "cents": 0.01}) == 0.01


@pytest.mark.pure
def test_printable_shows_terminal_controls_escaped() -> None:
    evil = "a\x1b]0;pwned\x07b\x1b[2Jc\rd\ne\x9bf\u202eg\th"
    shown = G.printable(evil)
    assert not any(ord(c) < 32 and c != "\t" or 0x7f <= ord(c) <= 0x9f for c in shown), shown
    assert shown == "a\\x1b]0;pwned\\x07b\\x1b[2Jc\\x0dd\\x0ae\\x9bf\\u202eg\th"
    assert G.printable("plain text: ünïcode ✓") == "plain text: ünïcode ✓"


@pytest.mark.pure
def test_special_use_answers_are_refused_unless_granted() -> None:
    own = {"192.0.2.7"}
    for addr in ("10.1.2.3", "192.168.1.1", "172.16.0.1", "198.18.0.5", "192.0.0.9",
                 "203.0.113.4"):
        reason = G.refused_address(addr, set())
        assert reason and "no ip or cidr entry grants it" in reason, addr
        assert G.refused_address(addr, set(), [ipaddress.IPv4Network(f"{addr}/32")]) is None
    everything = [ipaddress.IPv4Network("0.0.0.0/0")]
    for addr, what in (("127.0.0.1", "loopback"), ("169.254.169.254", "link-local"),
                       ("0.1.2.3", "this network"), ("100.64.0.1", "task networks"),
                       ("224.0.0.251", "multicast"), ("255.255.255.255", "broadcast"),
                       ("240.0.0.1", "reserved")):
        reason = G.refused_address(addr, set(), everything)
        assert reason and what in reason, (addr, reason)   # absolute: no grant opens these
    assert "address of this host" in G.refused_address("192.0.2.7", own, everything)
    assert G.refused_address("93.184.216.34", set()) is None
    assert G.refused_address("10.9.9.9", set(), [ipaddress.IPv4Network("10.0.0.0/8")]) is None
    assert G.refused_address("10.9.9.9", set(), [ipaddress.IPv4Network("10.1.0.0/16")])


@pytest.mark.pure
def test_a_grant_never_adds_what_is_covered_and_every_port_replaces_single_ports() -> None:
    granted: dict[str, set[int] | None] = {}
    assert G.grant_change(granted, "198.18.0.0/24", [None]) == ([None], [])
    granted["198.18.0.0/24"] = None
    assert G.grant_change(granted, "198.18.0.5", [8080]) == ([], [])      # inside the block
    granted = {"198.18.97.2": None}
    assert G.grant_change(granted, "198.18.97.2", [8080]) == ([], [])     # the reported crash
    granted = {"198.18.97.2": {80, 8080}}
    assert G.grant_change(granted, "198.18.97.2", [None]) == ([None], [80, 8080])
    assert G.grant_change(granted, "198.18.97.2", [80, 443]) == ([443], [])
    granted = {"198.18.0.0/24": {80}}
    assert G.grant_change(granted, "198.18.0.9", [80, 8080]) == ([8080], [])


def test_the_dns_allowed_nets_setting_takes_no_absolute_network(gurtd: Gurtd) -> None:
    for bad in ("10.0.0.0/33", "10.0.0.1/8", "0.0.0.0/0", "127.0.0.0/8", "169.254.0.0/16",
                "100.64.0.0/10", ["10.0.0.0/8"], 5):
        code, body, _ = gurtd.request("PUT", "/api/settings", {"dnsAllowedNets": [bad]})
        assert code == 400 and "dnsAllowedNets" in body["error"], (bad, body)
    assert gurtd.api("GET", "/api/settings")["dnsAllowedNets"] == []
    gurtd.api("PUT", "/api/settings", {"dnsAllowedNets": ["10.0.0.0/8", "192.168.7.0/24"]})
    assert gurtd.api("GET", "/api/settings")["dnsAllowedNets"] == ["10.0.0.0/8", "192.168.7.0/24"]


# 2. layer walks on disk ######################################################################

@pytest.fixture
def layers() -> Iterator[str]:
    top = tempfile.mkdtemp(prefix="gurt-test-walk-", dir="/var/tmp")
    for name in ("upper", "lower1", "base"):
        os.mkdir(os.path.join(top, name))
    yield top
    shutil.rmtree(top)


def test_a_walk_never_follows_a_lower_layers_symlink_to_the_host(layers: str) -> None:
    """A task made hostlink -> /etc; a later one made hostlink a directory with a shadow file.
    Through the symlink, root would see /etc/shadow and call it "modified": a probe of any host
    path.  The walk says "added", as it is for any name."""
    upper, lower, base = (os.path.join(layers, n) for n in ("upper", "lower1", "base"))
    os.symlink("/etc", os.path.join(lower, "hostlink"))
    os.mkdir(os.path.join(upper, "hostlink"))
    for name in ("shadow", "no-such-host-file"):
        Path(upper, "hostlink", name).write_text("x")
    os.symlink("/etc/passwd", os.path.join(upper, "link"))
    got = G.changed_paths(upper, [lower, base])
    assert {"path": "hostlink/shadow", "change": "added"} in got, got
    assert {"path": "hostlink/no-such-host-file", "change": "added"} in got, got
    assert {"path": "link", "change": "added"} in got, got


def test_whiteouts_opaque_dirs_and_files_replaced_by_dirs(layers: str) -> None:
    upper, lower, base = (os.path.join(layers, n) for n in ("upper", "lower1", "base"))
    os.makedirs(os.path.join(base, "kept", "sub"))
    for rel in ("kept/a", "kept/sub/b", "gone", "file-then-dir"):
        Path(base, rel).write_text("base")
    whiteout = stat.S_IFCHR | 0o600
    os.mknod(os.path.join(lower, "gone"), whiteout, 0)          # lower1 deleted it
    os.makedirs(os.path.join(upper, "kept"))
    Path(upper, "kept", "a").write_text("edited")
    os.mknod(os.path.join(upper, "kept", "sub"), whiteout, 0)   # whiteout of a dir
    os.mknod(os.path.join(upper, "gone"), whiteout, 0)          # already gone below
    os.makedirs(os.path.join(upper, "file-then-dir"))
    os.setxattr(os.path.join(upper, "file-then-dir"), "trusted.overlay.opaque", b"y")
    Path(upper, "file-then-dir", "x").write_text("new")
    assert G.changed_paths(upper, [lower, base]) == [
        {"path": "file-then-dir/", "change": "modified"},
        {"path": "file-then-dir/x", "change": "added"},
        {"path": "kept/a", "change": "modified"},
        {"path": "kept/sub", "change": "deleted"},
    ]
    assert G.changed_paths(os.path.join(layers, "deleted"), [lower, base]) == []


def test_a_tree_deeper_than_a_path_can_be_long_is_walked_whole(layers: str) -> None:
    """700 levels of 50-byte names (far past PATH_MAX, 4,096) in the upper and in the base:
    the walk finds the one modified file at the bottom and leaves no fd open."""
    upper, base = os.path.join(layers, "upper"), os.path.join(layers, "base")
    deep_tree(upper, 700, "d" * 50)
    deep_tree(base, 700, "d" * 50)
    before = len(os.listdir("/proc/self/fd"))
    got = G.changed_paths(upper, [os.path.join(layers, "lower1"), base])
    assert got == [{"path": "/".join(["d" * 50] * 700) + "/leaf", "change": "modified"}]
    assert len(os.listdir("/proc/self/fd")) == before
    got = G.changed_paths(upper, [os.path.join(layers, "lower1")])
    assert len(got) == 701 and got[0] == {"path": "d" * 50 + "/", "change": "added"}
    for tree in (upper, base):
        subprocess.run(["rm", "-rf", tree], check=True)    # rmtree trips on the depth


def random_stack(top: str, seed: int) -> list[str]:
    """An upper and three lowers (the last one a base) of random files, folders, whiteouts and
    opaque folders, three levels deep."""
    rnd = random.Random(seed)
    paths = [os.path.join(top, f"L{i}") for i in range(4)]

    def fill(directory: str, depth: int, special: bool) -> None:
        for name in "abc":
            r, path = rnd.random(), os.path.join(directory, name)
            if r < 0.3:
                continue
            if r < 0.5:
                open(path, "w").close()
            elif r < 0.6 and special:
                os.mknod(path, stat.S_IFCHR | 0o600, 0)
            elif depth < 3:
                os.mkdir(path)
                if special and rnd.random() < 0.2:
                    os.setxattr(path, "trusted.overlay.opaque", b"y")
                fill(path, depth + 1, special)
    for i, path in enumerate(paths):
        os.mkdir(path)
        fill(path, 0, i < 3)
    return paths


def overlay_truth(upper: str, merged: str) -> list[dict[str, str]]:
    """What the walk must say, read plainly: is each upper entry in the kernel's own overlay
    of the lowers (mounted at merged)?  Below an opaque upper folder nothing is."""
    out = []
    stack = [("", False)]
    while stack:
        rel, hidden = stack.pop()
        for name in os.listdir(os.path.join(upper, rel)):
            path = f"{rel}/{name}" if rel else name
            st = os.lstat(os.path.join(upper, path))
            found = not hidden and os.path.lexists(os.path.join(merged, path))
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                if found:
                    out.append({"path": path, "change": "deleted"})
            elif stat.S_ISDIR(st.st_mode):
                try:
                    opaque = os.getxattr(os.path.join(upper, path),
                                         "trusted.overlay.opaque") == b"y"
                except OSError:
                    opaque = False
                if not found:
                    out.append({"path": path + "/", "change": "added"})
                elif opaque:
                    out.append({"path": path + "/", "change": "modified"})
                stack.append((path, hidden or opaque))
            else:
                out.append({"path": path, "change": "modified" if found else "added"})
    return sorted(out, key=lambda c: c["path"])


@pytest.mark.parametrize("walk_fds", [G.WALK_FDS, 1, 3])
def test_the_walk_agrees_with_the_kernels_overlay_on_random_layers(
        layers: str, walk_fds: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forty random stacks: the walk's answer is what the kernel's own overlay of the lowers
    shows, also when it may keep only a few fds open (and reopens folders it comes back to)."""
    monkeypatch.setattr(G, "WALK_FDS", walk_fds)
    merged = os.path.join(layers, "merged")
    os.mkdir(merged)
    for seed in range(40):
        top = os.path.join(layers, f"s{seed}")
        os.mkdir(top)
        upper, *lowers = random_stack(top, seed)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        "ro,lowerdir=" + ":".join(lowers), merged], check=True)
        try:
            truth = overlay_truth(upper, merged)
        finally:
            subprocess.run(["umount", merged], check=True)
        before = len(os.listdir("/proc/self/fd"))
        assert G.changed_paths(upper, lowers) == truth, seed
        assert len(os.listdir("/proc/self/fd")) == before


# 3. a droid stream written by the task #######################################################

def evil_stream() -> list[str]:
    lines = [json.dumps({"type": "system", "subtype": "init", "session_id": "s-evil"}),
             json.dumps({"type": "error", "message": " "}),
             json.dumps({"type": "error", "message": ["not", "text"]}),
             "[" * 100_000,
             json.dumps({"type": "token_usage_update",
                         "usage": {"input_tokens": 1e308, "output_tokens": 1e308}}),
             '{"type": "token_usage_update", "usage": {"input_tokens": 1e400}}',
             '{"type": "token_usage_update", "usage": {"input_tokens": NaN}}',
             json.dumps({"type": "token_usage_update", "usage": {"input_tokens": -10 ** 9}}),
             "[1, 2, 3]", "null", "\x1b]0;title\x07",
             json.dumps({"type": "tool_call", "toolName": ["x"], "parameters": "rm -rf /"}),
             json.dumps({"type": "message", "role": "assistant", "text": {"a": 1}}),
             json.dumps({"type": "completion", "finalText": "survived",
                         "usage": {"input_tokens": 1_000_000, "output_tokens": 1000}})]
    return lines


@pytest.fixture
def evil_droid(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gurtd]:
    directory = tempfile.mkdtemp(prefix="gurt-test-droid-", dir="/var/tmp")
    path = os.path.join(directory, "droid")
    with open(path, "w") as f:          # printf is a shell builtin: no argument length limit
        f.write("#!/bin/sh\n" + "".join(f"printf '%s\\n' {shlex.quote(line)}\n"
                                        for line in evil_stream()))
    os.chmod(path, 0o755)
    os.chmod(directory, 0o755)
    monkeypatch.delenv("FACTORY_API_KEY", raising=False)
    try:
        with running_gurtd() as g:
            g.api("PUT", "/api/settings", {"droidPath": path, "droidFactoryKey": True})
            yield g                  # the stream's usage is spending: the mode its cost tests
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_an_evil_droid_stream_neither_crashes_gurtd_nor_breaks_its_json(
        evil_droid: Gurtd) -> None:
    g = evil_droid
    task = g.api("POST", "/api/tasks", {"title": "evil stream", "prompt": "go",
                                        "budgetCents": 100_000}, status=201)
    done = g.wait_done(task["id"], timeout=60)
    assert done["summary"] == "survived"
    assert done["costCents"] == pytest.approx(G.usage_cents(
        {"input_tokens": 1_000_000, "output_tokens": 1000}, SONNET))
    code, data, _ = g.request("GET", f"/api/tasks/{task['id']}/log")
    entries = [strict_json(line) for line in data.splitlines()]
    texts = [e.get("text", "") for e in entries if e["type"] == "stdout"]
    assert any(t.startswith("[[[[") for t in texts)          # logged as text, not parsed
    assert "NaN" in " ".join(texts) and "1e400" in " ".join(texts)
    for path in ("/api/tasks", f"/api/tasks/{task['id']}"):
        conn = g.connection()
        conn.request("GET", path, headers={"Authorization": f"Bearer {g.token}"})
        strict_json(conn.getresponse().read())
        conn.close()
    assert g.proc is not None and g.proc.poll() is None


def test_output_lines_of_any_shape_are_logged_as_they_are(gurtd: Gurtd) -> None:
    """Output that looks like the worker's own reports (deep JSON, a report object, numbers)
    or is one line of 3 MiB is logged as stdout; the task ends normally and gurtd stays up."""
    script = ("import sys\n"
              "w = sys.stdout.write\n"
              "w('[' * 100000 + '\\n'); w('{\"t\": [1]}\\n'); w('7\\n'); w('x' * (3 << 20))\n")
    task = gurtd.run_done(python_line(script))
    out = gurtd.output(task["id"])
    assert any(t.startswith("[[[") for t in out) and "7" in out
    assert sum(len(t) for t in out if t.startswith("xxx")) == 3 << 20
    assert gurtd.run("echo still here")["state"] == "done"


# 4. floods of the task's DNS, broker and log ##################################################

class SilentUpstream:
    """A UDP socket on loopback that reads nothing: an upstream DNS server that never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"


@pytest.fixture
def slow_dns_gurtd() -> Iterator[Gurtd]:
    silent = SilentUpstream()
    try:
        with running_gurtd({"GURT_DNS_UPSTREAM": silent.address}) as g:
            yield g
    finally:
        silent.sock.close()


DNS_FLOOD = r"""
import socket, struct, time
def query(i, name):
    q = struct.pack("!HHHHHH", i, 0x100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\x00" + struct.pack("!HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("127.0.0.53", 53))
codes = {}
def drain(wait):
    s.settimeout(wait)
    try:
        while True:
            d = s.recv(4096)
            codes[d[3] & 15] = codes.get(d[3] & 15, 0) + 1
    except (socket.timeout, BlockingIOError):
        pass
for i in range(500):          # in bursts, read in between: no buffer on the way overflows
    s.send(query(i, "a.test"))
    if i % 20 == 19:
        drain(0.02)
drain(1.0)                    # the 32 waiting upstream answer SERVFAIL only after 3 s
print("FLOOD", codes.get(2, 0))
tcp = []
for i in range(100):
    c = socket.create_connection(("127.0.0.53", 53), timeout=3)
    tcp.append(c)
for c in tcp:
    c.setblocking(False)
closed, unsettled = 0, list(tcp)
deadline = time.monotonic() + 30   # those past the cap are closed at once, or never: a busy
while closed < 100 - LIMIT and time.monotonic() < deadline:   # machine may take a while
    time.sleep(0.05)
    for c in list(unsettled):
        try:
            gone = c.recv(1) == b""
        except BlockingIOError:
            continue
        except OSError:
            gone = True
        closed += gone
        unsettled.remove(c)
print("TCP closed", closed)
s.settimeout(5)
s.send(query(9999, "not.granted.test"))
while True:
    d = s.recv(4096)
    if d[:2] == struct.pack("!H", 9999):
        print("AFTER rcode", d[3] & 15)
        break
"""


def test_a_dns_flood_on_a_slow_upstream_is_this_tasks_problem_only(
        slow_dns_gurtd: Gurtd) -> None:
    """500 queries for a granted name whose upstream never answers, then 100 TCP connections
    to the task's DNS: gurtd keeps at most MAX_DNS_PENDING upstream sockets and
    MAX_DNS_CONNS connections for the task, answers the rest SERVFAIL or closes them, and
    keeps answering the API and other tasks."""
    g = slow_dns_gurtd
    before = open_fds(g)
    flood = g.create(python_line(f"LIMIT = {G.MAX_DNS_CONNS}\n" + DNS_FLOOD), hosts=["a.test"])
    peak = 0
    deadline = time.monotonic() + 60
    while g.task(flood["id"])["state"] not in ("done", "failed"):
        peak = max(peak, open_fds(g))
        assert g.run("echo other task")["state"] == "done"
        assert time.monotonic() < deadline
    done = g.task(flood["id"])
    assert done["state"] == "done", (done, g.log(flood["id"]))
    out = " ".join(g.output(flood["id"]))
    servfail = int(out.split("FLOOD ")[1].split()[0])
    assert servfail >= 300, out       # at once, well before the upstream's 3 s
    assert int(out.split("TCP closed ")[1].split()[0]) >= 100 - G.MAX_DNS_CONNS, out
    assert "AFTER rcode 3" in out, out                 # NXDOMAIN: still answering
    assert peak - before < G.MAX_DNS_PENDING + G.MAX_DNS_CONNS + 40, (before, peak)
    assert any("too many queries" in e.get("error", "") for e in g.log(flood["id"])
               if e["type"] == "dns")


BROKER_FLOOD = r"""
import socket, time
conns, refused = [], 0
for i in range(300):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("/run/gurt/broker.sock")
    conns.append(s)
for s in conns:
    s.setblocking(False)
unanswered = list(conns)             # all kept open: the test counts gurtd's files meanwhile
deadline = time.monotonic() + 30     # those past the cap get a 429 at once, or never: a busy
while refused < 300 - LIMIT and time.monotonic() < deadline:   # machine may take a while
    time.sleep(0.05)
    for s in list(unanswered):
        try:
            refused += s.recv(64).startswith(b"HTTP/1.1 429")
        except BlockingIOError:
            continue
        unanswered.remove(s)
print("REFUSED", refused, flush=True)
time.sleep(3)
"""


def test_three_hundred_idle_broker_connections_cost_gurtd_a_bounded_count(
        gurtd: Gurtd) -> None:
    """A task without tools opens 300 broker connections and sits on them: all past
    MAX_BROKER_CONNS get 429 at once, gurtd's open files stay bounded, and another task's
    broker call works meanwhile."""
    before = open_fds(gurtd)
    flood = gurtd.create(python_line(f"LIMIT = {G.MAX_BROKER_CONNS}\n" + BROKER_FLOOD))
    eventually(lambda: any(t.startswith("REFUSED") for t in gurtd.output(flood["id"])), 30,
               "the flood to be counted")
    during = open_fds(gurtd)
    other = gurtd.run("curl -s --unix-socket /run/gurt/broker.sock http://box/tools",
                      tools=["wallet.pay"])
    assert other["state"] == "done" and json.loads(gurtd.output(other["id"])[-1]) == \
        {"tools": ["wallet.pay"]}
    refused = int(next(t for t in gurtd.output(flood["id"]) if t.startswith("REFUSED"))
                  .split()[1])
    assert refused >= 300 - G.MAX_BROKER_CONNS, refused
    assert during - before < G.MAX_BROKER_CONNS + 30, (before, during)
    assert gurtd.wait(flood["id"])["state"] == "done"


def test_a_broker_call_nested_too_deep_gets_a_400(gurtd: Gurtd) -> None:
    """A task sends a call whose args are 5,000 lists deep: the broker answers 400 (no
    RecursionError, no dropped connection), and the task's next call is answered."""
    deep = "[" * 5000 + "]" * 5000
    body = '{"tool": "wallet.pay", "args": ' + deep + '}'
    task = gurtd.run_done(f"curl -s -o /dev/null -w '%{{http_code}}\\n' --unix-socket "
                          f"/run/gurt/broker.sock -H 'Content-Type: application/json' "
                          f"-d '{body}' http://box/call\n"
                          "curl -s --unix-socket /run/gurt/broker.sock http://box/tools",
                          tools=["wallet.pay"])
    assert gurtd.output(task["id"]) == ["400", '{"tools": ["wallet.pay"]}']
    assert "RecursionError" not in gurtd.log_text()


def test_a_task_cannot_keep_more_than_its_share_of_approvals_waiting(gurtd: Gurtd) -> None:
    """Each `ask` waits for a person; past MAX_PENDING_APPROVALS the next one is refused with
    429 and a clear error, and the task's earlier asks are still there to answer."""
    n = G.MAX_PENDING_APPROVALS
    # All n + 1 at once, not n and then one more after a pause: on a busy machine n tool
    # clients took longer than any pause, and the one more was among the first n.
    script = (f"for i in $(seq {n + 1}); do (gurtd tool ask '{{\"question\": \"q'$i'\"}}' "
              "> /dev/null; echo \"exit $?\") & done; sleep 60")
    task = gurtd.create(script, tools=["ask"])
    eventually(lambda: any(t.startswith("exit") for t in gurtd.output(task["id"])), 60,
               "the extra ask to be answered")
    log = gurtd.log(task["id"])
    assert "exit 1" in gurtd.output(task["id"])
    assert any("calls waiting for a person" in e["text"] for e in log
               if e["type"] == "stderr"), log
    assert len(gurtd.api("GET", f"/api/approvals?state=pending&task={task['id']}")) == n
    gurtd.api("POST", f"/api/tasks/{task['id']}/stop")


def test_log_followers_of_one_task_are_capped(gurtd: Gurtd) -> None:
    task = gurtd.create("sleep 20")
    conns: list[Any] = []
    try:
        for _ in range(G.MAX_LOG_FOLLOWERS):
            conn = gurtd.connection(timeout=10)
            conn.request("GET", f"/api/tasks/{task['id']}/log?follow=1",
                         headers={"Authorization": f"Bearer {gurtd.token}"})
            response = conn.getresponse()            # holds the socket open
            assert response.status == 200
            conns.append(response)
        code, body, _ = gurtd.request("GET", f"/api/tasks/{task['id']}/log?follow=1")
        assert code == 429 and "followers" in body["error"], (code, body)
        assert gurtd.request("GET", f"/api/tasks/{task['id']}/log")[0] == 200
    finally:
        for conn in conns:
            conn.close()
    gurtd.api("POST", f"/api/tasks/{task['id']}/stop")


# 5. a task's files read by the owner #########################################################

def test_a_fifo_in_the_view_is_refused_at_once_and_the_api_goes_on(gurtd: Gurtd) -> None:
    assert gurtd.run("mkfifo pipe && echo data > file")["state"] == "done"
    results: list[int] = []

    def get_fifo() -> None:
        results.append(gurtd.request("GET", "/api/workspaces/home/files/pipe")[0])
    reader = threading.Thread(target=get_fifo)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "GET of a FIFO hangs"
    assert results == [400]
    assert gurtd.file("home", "file") == b"data\n"
    listing = gurtd.api("GET", "/api/workspaces/home/files")
    assert {"name": "pipe", "type": "other", "size": 0} in listing["entries"]


def test_changes_reveal_no_host_path_through_an_earlier_tasks_symlink(gurtd: Gurtd) -> None:
    assert gurtd.run("ln -s /etc hostlink")["state"] == "done"
    probe = gurtd.run_done("rm hostlink && mkdir hostlink && echo x > hostlink/shadow && "
                           "echo x > hostlink/no-such-file")
    got = gurtd.api("GET", f"/api/tasks/{probe['id']}/changes")
    assert {"path": "hostlink/shadow", "change": "added"} in got, got
    assert {"path": "hostlink/no-such-file", "change": "added"} in got, got


def test_a_700_deep_tree_comes_back_whole_while_the_api_answers(gurtd: Gurtd) -> None:
    deep = gurtd.run_done(python_line("import os\nfor i in range(700):\n    os.mkdir('d')\n"
                                 "    os.chdir('d')\nopen('leaf', 'w').write('x')\n"))
    got: list[Any] = []
    walker = threading.Thread(target=lambda: got.append(
        gurtd.api("GET", f"/api/tasks/{deep['id']}/changes")))
    walker.start()
    answered = 0
    while walker.is_alive() or answered == 0:
        assert gurtd.request("GET", "/api/tasks?limit=1")[0] == 200
        answered += 1
    walker.join()
    assert len(got[0]) == 701
    assert got[0][-1] == {"path": "d/" * 700 + "leaf", "change": "added"}


# 6. task text on the owner's terminal ########################################################

def test_escape_sequences_in_task_output_reach_the_terminal_escaped(gurtd: Gurtd) -> None:
    task = gurtd.run_done(
        r"printf 'title\033]0;pwned\007 clear\033[2J bell\007 csi\302\233 end\n'; "
        r"printf 'err\033[31m red\n' >&2")
    for args in (["log", task["id"]], ["show", task["id"]], ["tasks"]):
        out = gurtd.cli_ok(*args, text=False)
        raw = out.stdout + out.stderr
        assert b"\x1b" not in raw and b"\x07" not in raw and b"\xc2\x9b" not in raw, raw
    assert b"title\\x1b]0;pwned\\x07" in gurtd.cli("log", task["id"], text=False).stdout
    titled = gurtd.create("true", title="\x1b[2J\x1b]0;owned\x07 title")
    for args in (["show", titled["id"]], ["tasks"]):
        raw = gurtd.cli(*args, text=False).stdout
        assert b"\x1b" not in raw and b"\\x1b[2J\\x1b]0;owned\\x07 title" in raw, raw
    run = gurtd.cli("run", "--worker", "fake", "--wait", "printf 'a\\033[2Jb\\n'", text=False)
    assert b"\x1b" not in run.stdout + run.stderr and b"a\\x1b[2Jb" in run.stdout, run
