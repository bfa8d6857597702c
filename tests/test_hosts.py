"""A task's hosts: what it may reach on the network, and nothing else.

Stories run real `fake`-worker tasks (one /bin/sh line per prompt line, as the task's own
user) against the suite's fake internet (conftest's `fake_internet`: gtinet behind the veth
gtv0, web servers on 198.18.0.10-.13, DNS and DoT on .53, and the tests' upstream DNS with its
ZONE; the private names there are only looked up).

198.18.0.0/15 is special-use (benchmarking): a name answering into it is refused unless the
task grants the address or its network, so `net_gurtd` lets names resolve into the fake
internet with the dnsAllowedNets setting, as an owner whose services live on a private
network would.

Traffic goes only to loopback and to addresses inside `gtinet`.  Each probe in a task is
timed in the task itself: a refused attempt must fail fast (a reset or an ICMP error), never
by a timeout.  Probe lines end with an `echo`, so a refused probe does not end the task.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

import gurtd as G
from conftest import (HOST_VETH, RESOLVER, A, B, C, Gurtd, Internet, XB, end_sleep, eventually,
                      forwarding, nft_table, sh, wait_for_step)

FAST_MS = 1000           # "fails fast": well under the 2 s of the task resolver's timeout
TASK_NET = ipaddress.IPv4Network("100.64.0.0/10")


# probes in a task ##############################################################################

# A raw-socket probe, run as `python3 -c ... KIND HOST PORT [NAME [QTYPE]]` in the task:
#   tcp      connect (v4 or v6), send a GET, print the first bytes of the answer;
#   udp53    a DNS query by UDP, print rcode and answer count;
#   tcp53    a DNS query by TCP, the same.
# HOST "GW" is the task's default gateway, read from /proc/net/route.  Exit 1 on any error.
PROBE = r'''
import socket, struct, sys
kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if host == "GW":
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            host = socket.inet_ntoa(struct.pack("<I", int(f[2], 16)))
def query(name, qtype):
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\x00" + struct.pack("!HH", qtype, 1)
def summary(d):
    return "rcode=%d an=%d" % (d[3] & 15, struct.unpack("!H", d[6:8])[0])
try:
    if kind == "udp53":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3)
        s.connect((host, port))
        s.send(query(sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 1))
        print("answer", host, summary(s.recv(4096)))
    elif kind == "tcp53":
        s = socket.create_connection((host, port), timeout=3)
        q = query(sys.argv[4], 1)
        s.sendall(struct.pack("!H", len(q)) + q)
        print("answer", host, summary(s.recv(4096)[2:]))
    else:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.settimeout(3)
        s.connect((host, port))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = b""
        while len(data) < 4096:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        print("connected", host, " ".join(data.decode(errors="replace").split()))
except Exception as e:
    print("refused", host, type(e).__name__, e)
    sys.exit(1)
'''
PY = "python3 -c 'import base64;exec(base64.b64decode(\"%s\"))'" % \
    base64.b64encode(PROBE.encode()).decode()
# the peer's index from netlink (`eth0@ifN`): a box has no /sys
IFLINK = "echo IFLINK $(ip -o link show eth0 | sed -n 's/^[0-9]*: eth0@if\\([0-9]*\\):.*/\\1/p')"


def timed(label: str, command: str) -> str:
    """A prompt line that runs command and prints `P label rc=.. ms=.. out=..` (one line)."""
    return (f's=$(date +%s%N); o=$({command} 2>&1); r=$?; e=$(date +%s%N); '
            f'printf "%s\\n" "P {label} rc=$r ms=$(( (e - s) / 1000000 )) '
            f'out=$(printf %s "$o" | tr "\\n" " ")"')


def curl(label: str, url: str, *options: str) -> str:
    return timed(label, " ".join(["curl -sS --max-time 3", *options, url]))


def py(label: str, *args: Any) -> str:
    return timed(label, " ".join([PY, *map(str, args)]))


@dataclass
class Probe:
    label: str
    rc: int
    ms: int
    out: str

    def ok(self, expect: str) -> None:
        assert self.rc == 0 and expect in self.out, self

    def refused(self, *codes: int) -> None:
        """Failed, fast; with one of codes (curl: 6 no such host, 7 no connection)."""
        assert self.rc != 0, self
        assert "hello from" not in self.out and "connected" not in self.out, self
        assert self.ms < FAST_MS, f"{self.label} took {self.ms} ms to fail: {self}"
        if codes:
            assert self.rc in codes, self


@dataclass
class Run:
    task: dict[str, Any]
    log: list[dict[str, Any]]
    probes: dict[str, Probe] = field(default_factory=dict)

    def __getitem__(self, label: str) -> Probe:
        assert label in self.probes, (label, self.log)
        return self.probes[label]

    def dns(self, name: str, qtype: str = "A") -> list[dict[str, Any]]:
        return [e for e in self.log if e["type"] == "dns" and e["name"] == name
                and e["qtype"] == qtype]

    def net(self) -> dict[str, Any]:
        entries = [e for e in self.log if e["type"] == "net"]
        assert len(entries) == 1, self.log
        return entries[0]

    def stdout(self) -> list[str]:
        return [e["text"] for e in self.log if e["type"] == "stdout"]


def finished(g: Gurtd, task_id: str, state: str = "done") -> Run:
    task = g.wait(task_id, timeout=40)
    log = g.log(task_id)
    assert task["state"] == state, (task, log)
    run = Run(task, log)
    for entry in log:
        m = re.fullmatch(r"P (\S+) rc=(\d+) ms=(-?\d+) out=(.*)", entry.get("text", ""))
        if entry["type"] == "stdout" and m:
            run.probes[m[1]] = Probe(m[1], int(m[2]), int(m[3]), m[4].strip())
    return run


def start(g: Gurtd, hosts: list[str] | None, *lines: str) -> str:
    fields: dict[str, Any] = {"hosts": hosts} if hosts is not None else {}
    return g.create("\n".join(lines), **fields)["id"]




# the host's view ###############################################################################

def nft_set(g: Gurtd, name: str) -> str:
    return sh("nft", "list", "set", "inet", nft_table(g.home), name)


def allowed(g: Gurtd, ifname: str) -> list[tuple[str, str]]:
    """The `allow` elements of one interface: (address or network, port or port range)."""
    return re.findall(rf'"{ifname}" \. ([0-9./]+) \. ([0-9-]+)', nft_set(g, "allow"))


def in_tasks_set(g: Gurtd, ifname: str) -> bool:
    return f'"{ifname}"' in nft_set(g, "tasks")


def links() -> list[str]:
    out = sh("ip", "-o", "link", "show")
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def task_ifname(g: Gurtd, task_id: str) -> str:
    """The host end of a running task's veth, by the peer index its eth0 reports."""
    texts = [t for t in g.output(task_id) if t.startswith("IFLINK ")]
    assert texts, g.log(task_id)
    index = texts[0].split()[1]
    for name in os.listdir("/sys/class/net"):
        try:
            with open(f"/sys/class/net/{name}/ifindex") as f:
                if f.read().strip() == index:
                    assert re.fullmatch(r"g\d+", name), name
                    return name
        except OSError:
            continue
    raise AssertionError(f"no host interface with index {index}")


def gone_soon(ifname: str, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while ifname in links():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# 1. what a list lets through ###################################################################

def test_a_name_reaches_every_port_and_a_name_with_a_port_only_that_port(net_gurtd: Gurtd) -> None:
    any_port = start(net_gurtd, ["a.test"],
                     curl("a80", "http://a.test/"),
                     curl("a8080", "http://a.test:8080/"))
    one_port = start(net_gurtd, ["a.test:8080"],
                     curl("a8080", "http://a.test:8080/"),
                     curl("a80", "http://a.test/"),
                     py("a80raw", "tcp", A, 80))

    run = finished(net_gurtd, any_port)
    run["a80"].ok(f"hello from {A}:80")
    run["a8080"].ok(f"hello from {A}:8080")
    assert run.dns("a.test")[0]["allowed"] is True
    assert run.dns("a.test")[0]["addresses"] == [A]
    assert run.net()["refused"] == 0, run.net()

    run = finished(net_gurtd, one_port)
    run["a8080"].ok(f"hello from {A}:8080")
    run["a80"].refused(7)
    run["a80raw"].refused()
    assert "ConnectionRefusedError" in run["a80raw"].out, run["a80raw"]
    assert run.net()["refused"] >= 2, run.net()


def test_a_wildcard_a_cidr_block_and_a_cname(net_gurtd: Gurtd) -> None:
    wildcard = start(net_gurtd, ["*.b.test"],
                     curl("sub", "http://x.b.test/"),
                     curl("apex", "http://b.test/"))
    cidr = start(net_gurtd, ["198.18.0.12/31:80"],
                 curl("b80", f"http://{B}/"),
                 curl("c80", f"http://{C}/"),
                 curl("b8080", f"http://{B}:8080/"),
                 curl("a80", f"http://{A}/"),
                 curl("byname", "http://b.test/"))
    cname = start(net_gurtd, ["cname.test"],
                  curl("cname", "http://cname.test/"),
                  curl("a", "http://a.test/"))

    run = finished(net_gurtd, wildcard)
    run["sub"].ok(f"hello from {XB}:80")
    run["apex"].refused(6)
    assert [e["allowed"] for e in run.dns("x.b.test")] == [True], run.log
    assert run.dns("b.test") and not any(e["allowed"] for e in run.dns("b.test")), run.log

    run = finished(net_gurtd, cidr)
    run["b80"].ok(f"hello from {B}:80")
    run["c80"].ok(f"hello from {C}:80")
    run["b8080"].refused(7)
    run["a80"].refused(7)
    run["byname"].refused(6)       # an address entry grants addresses, not names

    run = finished(net_gurtd, cname)
    run["cname"].ok(f"hello from {A}:80")
    entry = run.dns("cname.test")[0]
    assert entry["allowed"] is True and entry["addresses"] == [A], entry
    run["a"].refused(6)            # the CNAME's target is not a name of the list


def test_a_task_without_hosts_has_lo_only(net_gurtd: Gurtd) -> None:
    task_id = start(net_gurtd, None,
                    "cat /proc/net/dev",
                    curl("a", f"http://{A}/"),
                    py("raw", "tcp", A, 80))
    run = finished(net_gurtd, task_id)
    names = [line.split(":")[0].strip() for line in run.stdout() if ":" in line
             and not line.startswith("P ") and "|" not in line]
    assert names == ["lo"], run.stdout()
    run["a"].refused(7)
    run["raw"].refused()


# 2. what is refused ############################################################################

def test_what_no_list_grants_is_refused_fast(net_gurtd: Gurtd, fake_internet: Internet) -> None:
    loopback = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    anywhere = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        loopback.bind(("127.0.0.1", 0))
        anywhere.bind(("0.0.0.0", 0))
        for s in (loopback, anywhere):
            s.listen(8)
            s.setblocking(False)
        lo_port, any_port = loopback.getsockname()[1], anywhere.getsockname()[1]
        fake_internet.resolver.queries.clear()
        task_id = start(
            net_gurtd, ["a.test", "rebind.test", "self.test", RESOLVER],
            curl("granted", "http://a.test/"),
            curl("unlisted", "http://unlisted.test/"),
            py("unlisted_dns", "udp53", "127.0.0.53", 53, "unlisted.test"),
            curl("direct_ip", f"http://{XB}/"),
            py("direct_ip_raw", "tcp", XB, 8080),
            py("resolver_80", "tcp", RESOLVER, 80),
            py("resolver_udp53", "udp53", RESOLVER, 53, "a.test"),
            py("resolver_tcp53", "tcp53", RESOLVER, 53, "a.test"),
            py("resolver_853", "tcp", RESOLVER, 853),
            curl("v6_curl", "http://[::1]/", "-6"),
            py("v6_raw", "tcp", "::1", 80),
            curl("rebind", "http://rebind.test/"),
            py("rebind_dns", "udp53", "127.0.0.53", 53, "rebind.test"),
            curl("self", "http://self.test/"),
            py("self_dns", "udp53", "127.0.0.53", 53, "self.test"),
            py("host_loopback", "tcp", "127.0.0.1", lo_port),
            py("host_any_via_gw", "tcp", "GW", any_port),
            py("api_via_gw", "tcp", "GW", net_gurtd.port),
            py("api_loopback", "tcp", "127.0.0.1", net_gurtd.port),
            py("gw_resolver", "udp53", "GW", 53, "a.test"),
        )
        run = finished(net_gurtd, task_id)
        for s in (loopback, anywhere):
            with pytest.raises(BlockingIOError):
                s.accept()                    # nothing from the task ever reached them
    finally:
        loopback.close()
        anywhere.close()

    run["granted"].ok(f"hello from {A}:80")
    # a name off the list: NXDOMAIN from gurtd, which never asks the upstream about it
    run["unlisted"].refused(6)
    run["unlisted_dns"].ok("rcode=3 an=0")
    assert run.dns("unlisted.test") and not any(e["allowed"] for e in run.dns("unlisted.test"))
    assert not [q for q in fake_internet.resolver.queries if q[0] == "unlisted.test"], \
        fake_internet.resolver.queries
    # an address no entry and no answer granted
    run["direct_ip"].refused(7)
    run["direct_ip_raw"].refused()
    # another resolver, even at a granted address: UDP and TCP 53 and DNS over TLS are closed
    run["resolver_80"].ok(f"hello from {RESOLVER}:80")
    for label in ("resolver_udp53", "resolver_tcp53", "resolver_853"):
        run[label].refused()
        assert "refused" in run[label].out, run[label]
    # IPv6: none at all
    run["v6_curl"].refused()
    run["v6_raw"].refused()
    # rebinding: a granted name whose answer is loopback or the host's own address
    for name in ("rebind", "self"):
        run[name].refused(6)
        run[f"{name}_dns"].ok("rcode=5 an=0")
        entries = run.dns(f"{name}.test")
        assert entries and not any(e["allowed"] for e in entries), run.log
    # the host: its loopback is not the task's, its other addresses are closed to the task
    run["host_loopback"].refused()
    assert "ConnectionRefusedError" in run["host_loopback"].out, run["host_loopback"]
    gateway = run["host_any_via_gw"].out.split()[1]
    assert ipaddress.IPv4Address(gateway) in TASK_NET, run["host_any_via_gw"]
    for label in ("host_any_via_gw", "api_via_gw", "api_loopback", "gw_resolver"):
        run[label].refused()
    assert run.net()["refused"] >= 8, run.net()


def test_names_answering_private_or_host_addresses_are_refused_with_the_reason(
        net_gurtd: Gurtd) -> None:
    """DNS rebinding: a granted name that answers a private, loopback or link-local address is
    refused (REFUSED, and the reason in the log), even with the fake internet allowed; an ip
    entry opens a private address, never loopback or link-local (and no entry may hold them:
    0.0.0.0/0 is refused when the task is made)."""
    names = ("private.test", "home.test", "rebind.test", "metadata.test")
    code, body, _ = net_gurtd.request("POST", "/api/tasks", {"title": "t", "prompt": "p",
                                                             "worker": "fake",
                                                             "hosts": ["0.0.0.0/0:443"]})
    assert code == 400 and "127.0.0.0/8 (loopback)" in body["error"], body
    plain = start(net_gurtd, list(names), *(py(n, "udp53", "127.0.0.53", 53, n) for n in names))
    granted = start(net_gurtd, ["private.test", "10.1.2.3:443", "rebind.test", "10.0.0.0/8:443"],
                    py("private", "udp53", "127.0.0.53", 53, "private.test"),
                    py("rebind", "udp53", "127.0.0.53", 53, "rebind.test"))
    run = finished(net_gurtd, plain)
    for name, why in zip(names, ("(private)", "(private)", "(loopback)", "(link-local)")):
        run[name].ok("rcode=5 an=0")
        entry = run.dns(name)[0]
        assert entry["allowed"] is False and why in entry["refused"][0], entry
    run = finished(net_gurtd, granted)
    run["private"].ok("rcode=0 an=1")
    run["rebind"].ok("rcode=5 an=0")
    assert "(loopback)" in run.dns("rebind.test")[0]["refused"][0], run.log


def test_without_the_setting_a_name_reaches_198_18_only_with_its_network_granted(
        fake_internet: Internet, new_gurtd: Any) -> None:
    g = new_gurtd(env={"GURT_DNS_UPSTREAM": fake_internet.upstream})
    alone = start(g, ["a.test"], curl("a", "http://a.test/"))
    with_net = start(g, ["a.test", "198.18.0.0/24"], curl("a", "http://a.test/"))
    run = finished(g, alone)
    run["a"].refused(6)
    assert "198.18.0.0/15 (benchmarking)" in run.dns("a.test")[0]["refused"][0], run.log
    run = finished(g, with_net)
    run["a"].ok(f"hello from {A}:80")


def test_two_grants_of_one_address_with_different_ports_both_work(net_gurtd: Gurtd) -> None:
    """An address granted on every port, then a name answering it granted on one port (the
    crash of the issue: nftables said "File exists"); and one port widened to every port."""
    both = start(net_gurtd, [A, "a.test:8080"],
                 curl("name8080", "http://a.test:8080/"),
                 curl("ip80", f"http://{A}/"))
    widened = start(net_gurtd, ["cname.test:8080", "a.test"],
                    curl("cname8080", "http://cname.test:8080/"),
                    curl("a80", "http://a.test/"),
                    curl("cname8080_again", "http://cname.test:8080/"),
                    curl("a8080", "http://a.test:8080/"))
    run = finished(net_gurtd, both)
    run["name8080"].ok(f"hello from {A}:8080")
    run["ip80"].ok(f"hello from {A}:80")
    assert all(e["allowed"] for e in run.dns("a.test")), run.log
    run = finished(net_gurtd, widened)
    for label, port in (("cname8080", 8080), ("a80", 80), ("cname8080_again", 8080),
                        ("a8080", 8080)):
        run[label].ok(f"hello from {A}:{port}")
    assert net_gurtd.api("GET", "/api/health")


def test_a_grant_nftables_refuses_fails_that_lookup_only(net_gurtd: Gurtd) -> None:
    """198.18.0.0/24 on port 1, then a.test (every port) answering 198.18.0.10: nftables
    refuses an element that starts inside another ("File exists").  The lookup gets SERVFAIL
    and the reason is in the log; the task, gurtd and the next task go on."""
    task_id = start(net_gurtd, ["198.18.0.0/24:1", "a.test"],
                    py("dns", "udp53", "127.0.0.53", 53, "a.test"),
                    curl("a", "http://a.test/"))
    run = finished(net_gurtd, task_id)
    run["dns"].ok("rcode=2 an=0")
    run["a"].refused(6)
    entry = run.dns("a.test")[0]
    assert entry["allowed"] is False and "nftables refused" in entry["error"], entry
    run = finished(net_gurtd, start(net_gurtd, ["a.test"], curl("a", "http://a.test/")))
    run["a"].ok(f"hello from {A}:80")


# 3. the log ####################################################################################

def test_an_answer_of_hundreds_of_addresses_grants_a_few_and_a_task_a_bounded_number(
        net_gurtd: Gurtd) -> None:
    """An upstream answers 200 addresses a name: the task gets (and is granted) the first
    MAX_ANSWER_ADDRESSES of them.  Names after name: once the task holds MAX_TASK_GRANTS
    addresses, the next lookups fail (SERVFAIL) and say why, and the table stops growing."""
    net_gurtd.api("PUT", "/api/settings", {"dnsAllowedNets": ["198.18.0.0/16"]})
    per = G.MAX_ANSWER_ADDRESSES
    names = G.MAX_TASK_GRANTS // per + 2
    task = start(net_gurtd, ["*.m.test"], IFLINK,
                 *(py(f"n{i}", "udp53", "127.0.0.53", 53, f"many{i}.m.test")
                   for i in range(names)), "echo probed", "sleep 60")
    eventually(lambda: "probed" in net_gurtd.output(task), 60, "the lookups")
    granted = allowed(net_gurtd, task_ifname(net_gurtd, task))
    assert sorted(a for a, _ in granted if a.startswith("198.18.100.")) == \
        sorted(f"198.18.100.{i}" for i in range(1, per + 1)), granted
    assert len(granted) == G.MAX_TASK_GRANTS, len(granted)
    net_gurtd.api("POST", f"/api/tasks/{task}/stop")
    run = finished(net_gurtd, task, "failed")
    run["n0"].ok(f"rcode=0 an={per}")
    outcomes = [run[f"n{i}"].out for i in range(names)]
    assert sum("rcode=0" in o for o in outcomes) == G.MAX_TASK_GRANTS // per, outcomes
    assert sum("rcode=2" in o for o in outcomes) == 2, outcomes
    refused = [e for e in run.log if e.get("type") == "dns" and "at most" in e.get("error", "")]
    assert len(refused) == 2, refused


def test_the_log_tells_every_lookup_and_the_refused_attempts(net_gurtd: Gurtd) -> None:
    task_id = start(net_gurtd, ["a.test", "*.b.test"],
                    py("a_aaaa", "udp53", "127.0.0.53", 53, "a.test", 28),
                    curl("a", "http://a.test/"),
                    curl("sub", "http://x.b.test:8080/"),
                    curl("nope", "http://nope.test/"),
                    curl("c", "http://c-target.test/"),
                    curl("direct", f"http://{C}/"),
                    py("direct_raw", "tcp", C, 8080))
    run = finished(net_gurtd, task_id)
    run["a_aaaa"].ok("rcode=0 an=0")
    run["a"].ok(f"hello from {A}:80")
    run["sub"].ok(f"hello from {XB}:8080")
    for label in ("nope", "c"):
        run[label].refused(6)
    run["direct"].refused(7)
    run["direct_raw"].refused()

    for name, address in (("a.test", A), ("x.b.test", XB)):
        entries = run.dns(name)
        assert entries and all(e["allowed"] is True and e["addresses"] == [address]
                               for e in entries), (name, run.log)
    aaaa = run.dns("a.test", "AAAA")
    assert aaaa and all(e["allowed"] is True and e["addresses"] == [] for e in aaaa), run.log
    for name in ("nope.test", "c-target.test"):
        entries = run.dns(name)
        assert entries and all(e["allowed"] is False for e in entries), (name, run.log)
    lookups = [e for e in run.log if e["type"] == "dns"]
    assert {"a.test", "x.b.test", "nope.test", "c-target.test"} <= {e["name"] for e in lookups}
    for e in lookups:        # whatever else the resolver tried (a search domain) was refused
        granted = e["name"] in ("a.test", "x.b.test")
        assert e["allowed"] is granted and isinstance(e["qtype"], str), e

    net = run.net()
    assert net["refused"] >= 2, net
    assert net["text"] == f"refused connection attempts: {net['refused']}", net
    where = run.log.index(net)          # the task's last word on its network, after its end
    assert all(i < where for i, e in enumerate(run.log) if e["type"] in ("dns", "exit")), run.log


# 4. two tasks, two lists #######################################################################

def test_two_tasks_never_share_grants(net_gurtd: Gurtd) -> None:
    # each waits at "sleep 30 || true" until the test has looked at both and ends it (not
    # "sleep 2": on a busy machine one could be over before the other had its grant)
    a, b = (start(net_gurtd, [mine], IFLINK, curl("mine", f"http://{mine}/"), "sleep 30 || true",
                  py("other_raw", "tcp", ip, 80), curl("other_ip", f"http://{ip}/"),
                  curl("other_name", f"http://{other}/"))
            for mine, other, ip in (("a.test", "x.b.test", XB), ("x.b.test", "a.test", A)))
    wait_for_step(net_gurtd, a, "sleep 30 || true")
    wait_for_step(net_gurtd, b, "sleep 30 || true")
    a_if, b_if = task_ifname(net_gurtd, a), task_ifname(net_gurtd, b)
    assert a_if != b_if
    assert {addr for addr, _ in allowed(net_gurtd, a_if)} == {A}, nft_set(net_gurtd, "allow")
    assert {addr for addr, _ in allowed(net_gurtd, b_if)} == {XB}, nft_set(net_gurtd, "allow")
    for task_id in (a, b):
        end_sleep(net_gurtd, net_gurtd.task(task_id), "sleep 30")

    run_a, run_b = finished(net_gurtd, a), finished(net_gurtd, b)
    run_a["mine"].ok(f"hello from {A}:80")
    run_b["mine"].ok(f"hello from {XB}:80")
    for run in (run_a, run_b):
        run["other_raw"].refused()
        run["other_ip"].refused(7)
        run["other_name"].refused(6)
    # A tried B's address after B's grant existed, and the other way round
    granted_b = [e["time"] for e in run_b.dns("x.b.test") if e["allowed"]]
    granted_a = [e["time"] for e in run_a.dns("a.test") if e["allowed"]]
    tried_a = [e["time"] for e in run_a.log if e["type"] == "step" and "other_raw" in e["text"]]
    tried_b = [e["time"] for e in run_b.log if e["type"] == "step" and "other_raw" in e["text"]]
    assert granted_b and tried_a and min(granted_b) < tried_a[0], (run_a.log, run_b.log)
    assert granted_a and tried_b and min(granted_a) < tried_b[0], (run_a.log, run_b.log)


# 5. grants end with the task ###################################################################

def test_grants_end_when_a_task_is_done_stopped_or_undone(net_gurtd: Gurtd) -> None:
    ids = {how: start(net_gurtd, ["a.test"], IFLINK, curl("a", "http://a.test/"), sleep)
           for how, sleep in (("done", "sleep 30 || true"), ("stop", "sleep 30"),
                              ("undo", "sleep 30"))}
    ifnames = {}
    for how, task_id in ids.items():      # the done one: its sleep ended once looked at (not
        # "sleep 2", which a busy machine may outlast before the test has looked)
        wait_for_step(net_gurtd, task_id, "sleep 30 || true" if how == "done" else "sleep 30")
        ifnames[how] = task_ifname(net_gurtd, task_id)
        assert allowed(net_gurtd, ifnames[how]) == [(A, "1-65535")], nft_set(net_gurtd, "allow")
        assert in_tasks_set(net_gurtd, ifnames[how]), nft_set(net_gurtd, "tasks")
        assert ifnames[how] in links()
        if how == "done":
            end_sleep(net_gurtd, net_gurtd.task(task_id), "sleep 30")

    net_gurtd.api("POST", f"/api/tasks/{ids['stop']}/stop")
    net_gurtd.api("POST", f"/api/tasks/{ids['undo']}/undo")
    states = {"done": "done", "stop": "failed", "undo": "undone"}
    for how, task_id in ids.items():
        run = finished(net_gurtd, task_id, states[how])
        if how == "done":
            run["a"].ok(f"hello from {A}:80")
        ifname = ifnames[how]
        assert allowed(net_gurtd, ifname) == [], (how, nft_set(net_gurtd, "allow"))
        assert f'"{ifname}"' not in nft_set(net_gurtd, "allow"), how
        assert not in_tasks_set(net_gurtd, ifname), (how, nft_set(net_gurtd, "tasks"))
        assert run.net()["refused"] == 0, (how, run.net())
    for how, ifname in ifnames.items():
        assert gone_soon(ifname), f"{ifname} of the {how} task is still there: {links()}"


# 6. a crash of gurtd ###########################################################################

def test_after_a_kill_and_a_restart_nothing_of_the_old_task_net_is_left(net_gurtd: Gurtd) -> None:
    old = start(net_gurtd, ["a.test"], IFLINK, curl("a", "http://a.test/"), "sleep 30")
    wait_for_step(net_gurtd, old, "sleep 30")
    ifname = task_ifname(net_gurtd, old)
    assert allowed(net_gurtd, ifname) == [(A, "1-65535")], nft_set(net_gurtd, "allow")

    net_gurtd.restart(kill=True)

    task = net_gurtd.task(old)
    assert task["state"] == "failed", task
    assert f'"{ifname}"' not in nft_set(net_gurtd, "allow"), nft_set(net_gurtd, "allow")
    assert not in_tasks_set(net_gurtd, ifname), nft_set(net_gurtd, "tasks")
    assert gone_soon(ifname, timeout=5.0), f"{ifname} is still there: {links()}"
    new = start(net_gurtd, ["a.test"], curl("a", "http://a.test/"), curl("b", f"http://{XB}/"))
    run = finished(net_gurtd, new)
    run["a"].ok(f"hello from {A}:80")
    run["b"].refused(7)


# 7. gurtd's stop ###############################################################################

def test_a_stopped_gurtd_leaves_no_table_and_puts_forwarding_back(
        net_gurtd: Gurtd, fake_internet: Internet) -> None:
    assert forwarding(HOST_VETH) == fake_internet.forwarding_before
    assert f"table inet {nft_table(net_gurtd.home)}" in sh("nft", "list", "tables")
    run = finished(net_gurtd, start(net_gurtd, ["a.test"], curl("a", "http://a.test/")))
    run["a"].ok(f"hello from {A}:80")
    assert forwarding(HOST_VETH) == "1"      # on toward the granted address while gurtd runs

    assert net_gurtd.stop() == 0, net_gurtd.log_text()
    assert nft_table(net_gurtd.home) not in sh("nft", "list", "tables")
    assert forwarding(HOST_VETH) == fake_internet.forwarding_before


# 8. malformed entries ##########################################################################

MALFORMED = ["", "*", "*.com", "a..b", "-a.com", "a.com:0", "a.com:65536", "a b.com",
             "http://a.com", "a.com/x", "198.18.0.1/33", "::1"]


def test_malformed_entries_are_refused_at_creation(gurtd: Gurtd) -> None:
    wrong = []
    for entry in MALFORMED:
        body = {"title": "bad host", "prompt": "true", "worker": "fake",
                "hosts": ["a.test", entry]}
        code, data, _ = gurtd.request("POST", "/api/tasks", body)
        error = data.get("error", "") if isinstance(data, dict) else data
        if code != 400 or "hosts" not in error or json.dumps(entry) not in error:
            wrong.append((entry, code, data))
    assert wrong == [], wrong
    assert gurtd.api("GET", "/api/tasks") == []
