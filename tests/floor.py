"""The floors of make bench (issue 23): what the kernel needs for the work of a task start
with none of gurtd's bookkeeping, run in a process of its own that loads gurtd's module and
nothing else (the bench's pytest, selenium and dnspython would make each fork copy half as much
again as gurtd's spawner's do: 45 MB against 28).

Built from gurtd's own primitives: a child born in a new cgroup (clone3 with
CLONE_INTO_CGROUP, as gurtd's workers are; one cgroup.procs write where it is refused), new
mount, network, IPC and PID namespaces, an idmapped overlay of one layer (G._view_open), a
tmpfs, then in the PID namespace's first process the dropped privileges, the kernel filter and
exec of `true`.  A start is timed from the fork until the moment before exec, as a task start
is timed until its first step; with hosts, a veth pair into a new network namespace and one
nftables element first, as Network.prepare makes them.  A burst is count starts, at_once of
them at a time, each with its layer's folders made first, as a task's are.

`python tests/floor.py HOME [hosts]` reads commands from stdin, one a line, and answers each
with one JSON line: `start` (ms), `burst COUNT AT_ONCE` ([starts a second, machine CPU-s a
start]).  HOME is a folder with workspaces/home and layers/l1/upper (the one layer) owned by
FLOOR_STORE_UID, made by the bench (bench.floor_home).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gurtd as G  # noqa: E402

def busy() -> float:
    """CPU-seconds the whole machine has been busy (/proc/stat: user, nice, system, irq,
    softirq)."""
    with open("/proc/stat") as f:
        ticks = [int(t) for t in f.readline().split()[1:8]]
    return (sum(ticks[:3]) + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


FLOOR_UID, FLOOR_STORE_UID = 60998, 60999     # no account needed: the kernel takes numbers
FLOOR_TABLE, FLOOR_IFNAME = "gurt_floor23", "gfl23"
CLONE_NEWPID = 0x20000000


def floor_fork(group: str) -> tuple[int, str | None]:
    """fork, the child born in group (clone3 CLONE_INTO_CGROUP); else forked, with the
    cgroup.procs file it joins by."""
    fd = os.open(group, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return G.fork_into(fd), None
    except OSError:
        return os.fork(), os.path.join(group, "cgroup.procs")
    finally:
        os.close(fd)


def floor_child(home: str, procs: str | None, nsfd: int, stamp_w: int, layer: str = "t"
                ) -> None:
    """The floor's child (its upper in layers/<layer>): never returns; the moment before exec
    goes to stamp_w."""
    code = 1
    try:
        if procs is not None:
            Path(procs).write_text("0")
        if nsfd >= 0:
            G.libc_call("setns", nsfd, G.CLONE_NEWNET)
            G.libc_call("unshare", G.CLONE_NEWNS | G.CLONE_NEWIPC)
        else:
            G.libc_call("unshare", G.CLONE_NEWNS | G.CLONE_NEWNET | G.CLONE_NEWIPC)
        G._mount("none", "/", None, G.MS_REC | G.MS_SLAVE, None)
        spec = {"uid": FLOOR_UID, "gid": FLOOR_UID, "storeUid": FLOOR_STORE_UID,
                "storeGid": FLOOR_STORE_UID, "boxHome": home,
                "lowers": ["layers/l1/upper", "workspaces/home"],
                "upper": f"layers/{layer}/upper", "work": f"layers/{layer}/work"}
        view = G._view_open(spec)
        G._mount("tmpfs", G.NEW_ROOT, "tmpfs", G.MS_NOSUID | G.MS_NODEV, "mode=0755,size=1m")
        os.mkdir(G.NEW_ROOT + "/view")
        G.syscall("move_mount", G.SYS_MOVE_MOUNT, view, b"", -100,
                  (G.NEW_ROOT + "/view").encode(), G.MOVE_MOUNT_F_EMPTY_PATH)
        G.libc_call("unshare", CLONE_NEWPID)   # last: the view's helper child must not be its
        pid = os.fork()                        # first process, this one is
        if pid == 0:
            try:
                G._drop_privileges(FLOOR_UID, FLOOR_UID)
                G._kernel_filter_load()
                os.write(stamp_w, str(time.monotonic_ns()).encode())
                os.execv("/bin/true", ["true"])
            finally:
                os._exit(127)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except BaseException as exc:
        sys.stderr.write(f"floor: {exc!r}\n")
    finally:
        os._exit(code)


def floor_net(nft: Any) -> int:
    """A new network namespace with a veth pair to this one (its host end up) and one
    nftables element, as a task with hosts gets them; the namespace's fd."""
    from pyroute2 import IPRoute
    host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def setup() -> None:
        with IPRoute() as ipr:
            ipr.link("set", index=1, state="up")
            ipr.link("add", ifname="eth0", kind="veth",
                     peer={"ifname": FLOOR_IFNAME, "net_ns_fd": host_ns})
            eth0 = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=eth0, address="10.252.23.1", prefixlen=31)
            ipr.link("set", index=eth0, state="up")
    try:
        nsfd, _ = G.netns_new(setup)
    finally:
        os.close(host_ns)
    with IPRoute() as ipr:
        link = ipr.link_lookup(ifname=FLOOR_IFNAME)[0]
        ipr.addr("add", index=link, address="10.252.23.0", prefixlen=31)
        ipr.link("set", index=link, state="up")
    nft.run(f'add element inet {FLOOR_TABLE} tasks {{ "{FLOOR_IFNAME}" }}')
    return nsfd


def floor_net_release(nft: Any, nsfd: int) -> None:
    from pyroute2 import IPRoute
    nft.run(f'delete element inet {FLOOR_TABLE} tasks {{ "{FLOOR_IFNAME}" }}')
    with IPRoute() as ipr:
        links = ipr.link_lookup(ifname=FLOOR_IFNAME)
        if links:
            ipr.link("del", index=links[0])
    os.close(nsfd)


class Floor:
    """The floor's starts (with hosts: and their network) in this process, one at a time or a
    burst, each in a new cgroup of its own; its nftables table goes in close()."""

    def __init__(self, home: str, hosts: bool = False) -> None:
        G.overlay_way()                      # probed once, as gurtd does at its start
        G.sandbox_preload()                  # as gurtd does before its spawner forks
        v2, _ = G.cgroup_own_groups()
        assert v2 is not None, "no cgroup v2 hierarchy"
        self.v2, self.count, self.home = v2, 0, home
        self.nft = G.Nft() if hosts else None
        if self.nft is not None:
            self.nft.table_del(FLOOR_TABLE)
            self.nft.run(f"add table inet {FLOOR_TABLE}\n"
                         f"add set inet {FLOOR_TABLE} tasks {{ type ifname; }}")

    def close(self) -> None:
        if self.nft is not None:
            self.nft.table_del(FLOOR_TABLE)

    def group(self) -> str:
        """A new cgroup for the next start."""
        self.count += 1
        group = os.path.join(self.v2, f"gurt-floor23-{os.getpid()}-{self.count}")
        os.mkdir(group)
        return group

    def start(self) -> float:
        """ms from the fork (the cgroup made first) to the moment before exec."""
        stamp_r, stamp_w = os.pipe()
        t0 = time.monotonic_ns()
        group = self.group()
        try:
            nsfd = floor_net(self.nft) if self.nft is not None else -1
            while len(os.listdir("/proc/self/task")) > 1:   # floor_net's thread, joined, may
                time.sleep(0.0002)                          # still hold a lock of libc's,
            pid, procs = floor_fork(group)                  # which a clone3 would copy held
            if pid == 0:
                os.close(stamp_r)
                floor_child(self.home, procs, nsfd, stamp_w)
            os.close(stamp_w)
            stamp = os.read(stamp_r, 64)
            os.close(stamp_r)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            assert code == 0 and stamp, f"the floor's child ended with {code}"
            if self.nft is not None:
                floor_net_release(self.nft, nsfd)
        finally:
            os.rmdir(group)
        return (int(stamp) - t0) / 1e6

    def burst(self, count: int, at_once: int) -> tuple[float, float]:
        """count starts, at_once of them at a time (each with its layer's folders made first,
        as a task's are), each waited for and its cgroup removed: starts a second, and the
        machine's CPU-seconds a start (as the bench's burst counts them)."""
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        running: dict[int, tuple[int, str]] = {}     # pidfd: (pid, its cgroup)
        started, cpu, t0 = 0, busy(), time.perf_counter()
        try:
            while started < count or running:
                while started < count and len(running) < at_once:
                    started += 1
                    layer = f"b{self.count + 1}"
                    for sub in ("upper", "work"):
                        path = os.path.join(self.home, "layers", layer, sub)
                        os.makedirs(path)
                        os.chown(path, FLOOR_STORE_UID, FLOOR_STORE_UID)
                    group = self.group()
                    pid, procs = floor_fork(group)
                    if pid == 0:
                        floor_child(self.home, procs, -1, null, layer)
                    running[os.pidfd_open(pid)] = (pid, group)
                for fd in select.select(list(running), [], [])[0]:
                    pid, group = running.pop(fd)
                    os.close(fd)
                    status = os.waitpid(pid, 0)[1]
                    assert os.waitstatus_to_exitcode(status) == 0, f"a floor start: {status}"
                    os.rmdir(group)
            return count / (time.perf_counter() - t0), (busy() - cpu) / count
        finally:
            for fd, (pid, group) in running.items():
                os.close(fd)
                os.waitpid(pid, 0)
                os.rmdir(group)
            os.close(null)


def main() -> None:
    floor = Floor(sys.argv[1], hosts=sys.argv[2:] == ["hosts"])
    try:
        for line in sys.stdin:
            verb, *args = line.split()
            answer: Any = floor.start() if verb == "start" else \
                floor.burst(int(args[0]), int(args[1]))
            print(json.dumps(answer), flush=True)
    finally:
        floor.close()


if __name__ == "__main__":
    main()
