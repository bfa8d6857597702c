"""Limits and tracking: nothing of a task outlives it, and nothing it takes is unbounded.

Real `fake`-worker tasks (each prompt line runs /bin/sh as the task's own user) try what an
agent gone wrong would: a thread that outlives its main thread, a double-forked daemon, a
survivor of a gurtd killed with -9, a fork bomb, a memory hog, a flood of output, a disk filled
to the last byte.  Each story checks the real effect (processes in /proc, cgroups in
/sys/fs/cgroup, interfaces in /sys/class/net, bytes on a small loop-mounted file system) and
that no task group is left behind.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import os
import signal
import socket
import tarfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import gurtd as G
from conftest import (Gurtd, end_sleep, eventually, gurtd_on_small_disk, python_arg_line,
                      running_gurtd, wait_for_step)


# helpers ######################################################################################



def threads_of_uid(uid: int) -> list[str]:
    """Every live thread (any process, any thread of it) whose real uid is uid."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            if fields.get("Uid", "").split()[:1] == [str(uid)] and \
                    fields.get("State", "").split()[:1] not in (["Z"], ["X"]):
                out.append(f"{pid}/{tid}")
    return out


def start_time(pid: int) -> int | None:
    """When a process started (clock ticks since boot), to tell it from a later one with its
    pid; None once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def task_group_parents(home: str) -> list[str]:
    """Where gurtd (a child of this test, so in the same groups) keeps the groups of its
    tasks: gurt-<hash of BOX_HOME> below its own group in each hierarchy."""
    v2, v1 = G.cgroup_own_groups()
    name = "gurt-" + hashlib.sha1(os.path.abspath(home).encode()).hexdigest()[:12]
    if v2 is not None and not os.path.isdir(os.path.join(v2, name)):
        # a gurtd that re-ran itself in a scope of its own (systemd-run, the VM tier)
        v2 = next((top for top, subs, _ in os.walk(v2_mount()) if name in subs), v2)
    return [os.path.join(p, name) for p in [v2] + list(v1.values()) if p]


def v2_mount() -> str:
    """Where the v2 hierarchy is mounted (/sys/fs/cgroup or /sys/fs/cgroup/unified)."""
    with open("/proc/self/mountinfo") as f:
        return next(line.split()[4] for line in f if " - cgroup2 " in line)


def task_groups(home: str) -> list[str]:
    return [os.path.join(p, n) for p in task_group_parents(home) if os.path.isdir(p)
            for n in os.listdir(p) if os.path.isdir(os.path.join(p, n))]


def no_groups_left(g: Gurtd) -> None:
    assert task_groups(g.home) == [], "task groups outlived their tasks"


def stopped_and_clean(g: Gurtd) -> None:
    """Stop gurtd (it must exit 0): its groups' parents are removed with it."""
    code = g.stop()
    assert code == 0, g.log_text()
    assert [p for p in task_group_parents(g.home) if os.path.exists(p)] == []


@pytest.fixture
def box() -> Iterator[Gurtd]:
    """A gurtd of its own whose task groups are checked after the story."""
    with running_gurtd() as g:
        yield g
        no_groups_left(g)
        stopped_and_clean(g)


# the limits, as data (no root needed) #######################################################

@pytest.mark.pure
def test_limits_in_a_body_are_checked_and_the_rest_comes_from_settings() -> None:
    settings = dict(G.DEFAULT_SETTINGS)
    fields = G.validate_task_body({"title": "t", "prompt": "p",
                                   "limits": {"processes": 50, "logBytes": 65536}}, settings)
    assert fields["limits"] == {"processes": 50, "logBytes": 65536}
    limits = G.effective_limits(fields["limits"], settings, 8 << 30)
    assert limits == {"processes": 50, "memoryBytes": 4 << 30, "tmpBytes": 1 << 30,
                      "logBytes": 65536}
    assert G.effective_limits({}, {**settings, "taskMemoryBytes": 64 << 20}, 8 << 30)[
        "memoryBytes"] == 64 << 20
    for bad, words in [({"processes": 0}, "limits.processes"),
                       ({"processes": "50"}, "limits.processes"),
                       ({"memoryBytes": True}, "limits.memoryBytes"),
                       ({"memoryBytes": 1 << 20}, "limits.memoryBytes"),
                       ({"logBytes": 1.5}, "limits.logBytes"),
                       ({"tmpBytes": -1}, "limits.tmpBytes"),
                       ({"cpu": 2}, "unknown limit: cpu"),
                       ([], "limits must be an object")]:
        with pytest.raises(G.ApiError) as err:
            G.validate_task_body({"title": "t", "prompt": "p", "limits": bad}, settings)
        assert err.value.status == 400 and words in err.value.message, (bad, err.value.message)


@pytest.mark.pure
def test_limit_settings_are_checked_and_the_disk_reserve_has_a_default() -> None:
    settings = dict(G.DEFAULT_SETTINGS)
    assert (settings["taskMaxProcesses"], settings["taskMemoryBytes"], settings["taskTmpBytes"],
            settings["taskLogBytes"], settings["diskReserveBytes"]) == \
        (1024, 0, 1 << 30, 50 << 20, 0)
    new = G.validate_settings({"taskMaxProcesses": 64, "diskReserveBytes": 0,
                               "taskMemoryBytes": 0}, settings)
    assert new["taskMaxProcesses"] == 64
    for bad in ({"taskMaxProcesses": 2}, {"taskMemoryBytes": 1000}, {"taskLogBytes": "1"},
                {"diskReserveBytes": -1}, {"taskTmpBytes": 0}):
        with pytest.raises(G.ApiError):
            G.validate_settings(bad, settings)
    assert G.disk_reserve(0, 100 << 30) == 1 << 30          # 5% would be 5 GiB
    assert G.disk_reserve(0, 1 << 30) == (1 << 30) // 20     # 5% of 1 GiB
    assert G.disk_reserve(12345, 1 << 30) == 12345


def test_a_task_shows_its_effective_limits_and_bad_ones_create_nothing(box: Gurtd) -> None:
    box.api("PUT", "/api/settings", {"taskMaxProcesses": 200, "taskLogBytes": 1 << 20})
    task = box.run_done("echo hi", limits={"processes": 100})
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert task["limits"] == {"processes": 100, "memoryBytes": total // 2,
                              "tmpBytes": 1 << 30, "logBytes": 1 << 20}
    before = box.api("GET", "/api/tasks")
    code, data, _ = box.request("POST", "/api/tasks", {"title": "t", "prompt": "echo",
                                                       "worker": "fake",
                                                       "limits": {"processes": -5}})
    assert code == 400 and "limits.processes" in data["error"], data
    assert box.api("GET", "/api/tasks") == before


# tracking: nothing of a task outlives it ######################################################

# the main thread ends (SYS_exit: that thread only); another beats
ORPHAN_THREAD = python_arg_line(
    "import ctypes, threading, time\n"
    "def beat():\n"
    "    while True:\n"
    "        open('beat', 'a').write('.'); time.sleep(0.02)\n"
    "threading.Thread(target=beat).start(); time.sleep(0.2); ctypes.CDLL(None).syscall(60, 0)\n")


def test_a_thread_that_outlives_its_main_thread_ends_with_the_task(box: Gurtd) -> None:
    """A task leaves a process whose main thread exited while another thread keeps writing to
    its layer: gurtd sees that process (a zombie leader with a live thread), and when the task
    ends no thread of its uid is left and the layer stops changing."""
    # The task waits for its program's main thread to be gone (not 1.5 s: on a busy machine
    # Python's start alone may take that), then sleeps until the test has looked (not 0.5 s).
    task = box.create(f"id -u\n{ORPHAN_THREAD} > /dev/null 2>&1 & p=$!; for i in $(seq 600); "
                      "do grep -qs '^State:.Z' /proc/$p/status && break; sleep 0.05; done\n"
                      "sleep 30 || true")
    wait_for_step(box, task["id"], "sleep 30 || true")
    uid = int(box.output(task["id"])[0])
    leftover = G.processes_by_uid({uid}).get(uid, [])
    zombies = []
    for pid in leftover:
        with open(f"/proc/{pid}/status") as f:
            if "\nState:\tZ" in f.read():
                zombies.append(pid)
    assert zombies, f"the zombie leader with a live thread is not seen: {leftover}"
    end_sleep(box, task, "sleep 30")     # looked: the task goes on to its end
    assert box.wait(task["id"])["state"] == "done"
    assert threads_of_uid(uid) == []
    assert G.processes_by_uid({uid}) == {}
    beat = os.path.join(box.home, "layers", task["id"], "upper", "beat")
    size = os.path.getsize(beat)
    assert size > 0
    time.sleep(0.3)
    assert os.path.getsize(beat) == size, "something still writes the finished layer"


def test_a_double_forked_daemon_ends_with_the_task(box: Gurtd) -> None:
    """A task starts a classic daemon (fork, setsid, fork again: reparented, its own session)
    and finishes; the daemon ends with it."""
    daemon = python_arg_line("import os, time\nif os.fork(): os._exit(0)\nos.setsid()\n"
                             "if os.fork(): os._exit(0)\n"
                             "open('daemon.pid', 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    # waits for the pid file (not 0.5 s: on a busy machine the daemon may not have written it)
    task = box.create(f"id -u\n{daemon} > /dev/null 2>&1 < /dev/null\n"
                      "for i in $(seq 600); do [ -s daemon.pid ] && break; sleep 0.05; done\n"
                      "cat daemon.pid")
    box.wait_done(task["id"])
    uid, pid = (int(x) for x in box.output(task["id"]))
    assert pid not in G.processes_by_uid({uid}).get(uid, [])
    assert threads_of_uid(uid) == []


def test_after_kill_9_a_survivor_of_an_earlier_task_is_ended_even_without_its_user(
        box: Gurtd) -> None:
    """gurtd dies by SIGKILL while a task runs; a background process of the task survives it
    (reparented to init), and its user is gone too (deleted by hand, as a crash between the
    steps of an end could leave it).  The restart finds it by its cgroup and ends it."""
    task = box.create("id -u\nsetsid sleep 300 > /dev/null 2>&1 &\nsleep 30")
    wait_for_step(box, task["id"], "sleep 30")
    uid = int(box.output(task["id"])[0])
    box.stop(signal.SIGKILL)
    def survivor() -> bool:
        for pid in G.processes_by_uid({uid}).get(uid, []):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read() == b"sleep\0" + b"300\0":
                        return True
            except OSError:
                pass
        return False
    eventually(survivor, what="the survivor")
    survivors = {pid: start_time(pid) for pid in G.processes_by_uid({uid}).get(uid, [])}
    G.user_del(task["user"])
    assert task_groups(box.home), "the survivor's group is there to find"
    box.start()
    assert box.task(task["id"])["state"] == "failed"
    # (its uid is free now: another gurtd on this machine may already have given it to a task)
    alive = G.processes_by_uid({uid}).get(uid, [])        # zombies (unreaped) are not
    assert [p for p, t in survivors.items() if p in alive and start_time(p) == t] == []


# the network of a task ends with it ##########################################################

CLONE_NEWNET = 0x40000000


def in_netns(nsfd: int, fn: Any) -> Any:
    """Run fn in a thread that entered the network namespace nsfd (root, as the tests are)."""
    result: dict[str, Any] = {}

    def inside() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(nsfd, CLONE_NEWNET) != 0:
            result["error"] = OSError(ctypes.get_errno(), "setns")
            return
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=inside)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def host_links() -> dict[int, str]:
    out = {}
    for name in os.listdir("/sys/class/net"):
        try:
            out[int(Path(f"/sys/class/net/{name}/ifindex").read_text())] = name
        except OSError:
            pass
    return out


def test_a_task_with_hosts_loses_its_veth_at_its_end_and_a_survivor_reaches_nothing(
        box: Gurtd) -> None:
    """While a task with hosts runs, the test holds its network namespace (as a survivor
    would).  Right after the task is stopped, the host end of its veth is gone, and from
    inside that namespace nothing answers: no interface but lo, the gateway unreachable."""
    task = box.create("sleep 30", hosts=["example.com"])
    wait_for_step(box, task["id"], "sleep 30")
    pid = box.worker_pids(task)[0]
    nsfd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        def peer_index() -> int:    # eth0's other end, as an interface index of the host
            from pyroute2 import IPRoute
            with IPRoute() as ipr:
                return ipr.get_links(ipr.link_lookup(ifname="eth0")[0])[0].get_attr(
                    "IFLA_LINK")
        name = host_links().get(in_netns(nsfd, peer_index), "")
        assert name.startswith("g") and name[1:].isdigit(), (name, host_links())
        assert sorted(in_netns(nsfd, lambda: [n for _, n in socket.if_nameindex()])) == \
            ["eth0", "lo"]
        listener = socket.socket()
        listener.bind(("0.0.0.0", 0))     # a host listener on every address, as in the issue
        listener.listen(1)
        port = listener.getsockname()[1]
        try:
            box.api("POST", f"/api/tasks/{task['id']}/stop")
            assert name not in host_links().values(), f"{name} outlived its task"

            def probe() -> tuple[list[str], str]:
                names = [n for _, n in socket.if_nameindex()]
                with socket.socket() as s:
                    s.settimeout(2)
                    try:
                        s.connect((G.net_addresses(int(name[1:]))[0], port))
                        outcome = "connected"
                    except OSError as exc:
                        outcome = type(exc).__name__
                return names, outcome
            names, outcome = in_netns(nsfd, probe)
            assert names == ["lo"], names
            assert outcome != "connected"
        finally:
            listener.close()
    finally:
        os.close(nsfd)


def test_a_survivor_reaches_nothing_while_its_task_network_is_taken_down(box: Gurtd) -> None:
    """A survivor (the test, holding the task's network namespace) connects to a host listener
    over and over while the task is stopped: refused while the task runs, never connected
    while its network is taken down (its veth goes before its interface leaves the tasks set,
    outside which the host's policy accepts), and unreachable after."""
    task = box.create("sleep 30", hosts=["example.com"])
    wait_for_step(box, task["id"], "sleep 30")
    pid = box.worker_pids(task)[0]
    nsfd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(64)
    port, done = listener.getsockname()[1], threading.Event()
    outcomes: dict[str, int] = {}
    try:
        def gateway() -> str:
            with open("/proc/net/route") as f:     # eth0's default route: the host end
                rows = [line.split() for line in f.readlines()[1:]]
            gw = next(int(r[2], 16) for r in rows if r[1] == "00000000")
            return socket.inet_ntoa(gw.to_bytes(4, "little"))

        host = in_netns(nsfd, gateway)

        def probe() -> None:
            while not done.is_set():
                with socket.socket() as s:
                    s.settimeout(0.5)
                    try:
                        s.connect((host, port))
                        outcome = "connected"
                    except OSError as exc:
                        outcome = type(exc).__name__
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        prober = threading.Thread(target=in_netns, args=(nsfd, probe))
        prober.start()
        eventually(lambda: sum(outcomes.values()) >= 20, what="20 refused connections")
        box.api("POST", f"/api/tasks/{task['id']}/stop")
        time.sleep(0.3)
        done.set()
        prober.join()
        assert "connected" not in outcomes, outcomes
        assert outcomes.get("ConnectionRefusedError", 0) >= 20, outcomes
    finally:
        done.set()
        listener.close()
        os.close(nsfd)


# limits #######################################################################################

FORK_BOMB = python_arg_line("import os, time\nn = 0\nfor i in range(400):\n"
                            "    try:\n        pid = os.fork()\n    except OSError:\n"
                            "        continue\n"
                            "    if pid == 0:\n        time.sleep(60); os._exit(0)\n"
                            "    n += 1\nprint(n)\n")


def test_a_fork_bomb_stops_at_the_process_limit_and_gurtd_keeps_answering(box: Gurtd) -> None:
    """With limits.processes 50, a task forks 400 sleepers: the forks past the limit fail, the
    task never has more than 50 processes and threads, gurtd answers, and stop ends them all."""
    task = box.create("id -u\n" + FORK_BOMB + "\nsleep 30",
                      limits={"processes": 50})
    wait_for_step(box, task["id"], "sleep 30")
    uid, forked = (int(x) for x in box.output(task["id"]))
    assert 20 <= forked < 50, forked
    assert len(G.processes_by_uid({uid}).get(uid, [])) <= 50
    assert len(threads_of_uid(uid)) <= 50
    assert box.api("GET", "/api/health")
    groups = task_groups(box.home)
    assert groups
    stopped = box.api("POST", f"/api/tasks/{task['id']}/stop")
    assert stopped["state"] == "failed"
    assert threads_of_uid(uid) == []
    assert [p for p in groups if os.path.exists(p)] == []


def test_a_task_that_takes_too_much_memory_fails_with_out_of_memory(box: Gurtd) -> None:
    """With limits.memoryBytes 64 MiB, a line that fills 200 MiB is killed by the kernel and the
    task fails with exactly `out of memory`; 20 MiB is fine."""
    task = box.run("python3 -c 'b = bytearray(200 << 20); print(len(b))'",
                   limits={"memoryBytes": 64 << 20})
    assert task["state"] == "failed", task
    assert task["error"] == "out of memory", task
    assert task["limits"]["memoryBytes"] == 64 << 20
    box.run_done("python3 -c 'b = bytearray(20 << 20); print(len(b))'",
                 limits={"memoryBytes": 64 << 20})


def test_the_tmp_mounts_together_are_bounded_by_tmp_bytes(box: Gurtd) -> None:
    """With limits.tmpBytes 8 MiB, 6 MiB in /tmp and 6 more in /dev/shm do not fit: the
    second write fails with ENOSPC (they are one tmpfs)."""
    task = box.run("head -c 6291456 /dev/zero > /tmp/a\nhead -c 6291456 /dev/zero > /dev/shm/b",
                   limits={"tmpBytes": 8 << 20})
    assert task["state"] == "failed", task
    assert "No space left on device" in task["error"], task


def test_a_flood_of_output_is_stored_up_to_log_bytes_and_the_rest_counted(box: Gurtd) -> None:
    """With limits.logBytes 64 KiB, a task prints 20,000 lines: the stored log stops near 64 KiB
    (its first lines, in order), one `log` line counts the rest, the state lines are all there."""
    task = box.run_done("seq 1 20000\necho after", limits={"logBytes": 65536})
    entries = box.log(task["id"])
    size = os.path.getsize(os.path.join(box.home, "logs", task["id"] + ".jsonl"))
    assert size < 65536 + 2048, size
    stored = [e["text"] for e in entries if e["type"] == "stdout"]
    assert stored == [str(i) for i in range(1, len(stored) + 1)]
    assert 300 < len(stored) < 20000
    notes = [e for e in entries if e["type"] == "log"]
    assert len(notes) == 1, notes
    assert notes[0]["droppedLines"] >= 20000 - len(stored)
    assert f"{notes[0]['droppedLines']} lines" in notes[0]["text"]
    assert notes[0]["droppedBytes"] > 20000 - len(stored)
    assert [e["state"] for e in entries if e["type"] == "state"] == ["queued", "running", "done"]


# the disk reserve #############################################################################

@pytest.fixture
def box_on_small_disk() -> Iterator[Gurtd]:
    """A gurtd whose BOX_HOME is on a 64 MiB ext4 file system of its own (5% kept for root),
    whose task groups are checked after the story."""
    with gurtd_on_small_disk(size_mb=64, reserved_pct=5) as (g, _):
        yield g
        no_groups_left(g)
        stopped_and_clean(g)


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def disk_approval(g: Gurtd, task_id: str) -> dict[str, Any]:
    g.wait(task_id, ("waiting", "failed", "done"))
    pending = [a for a in g.api("GET", f"/api/approvals?state=pending&task={task_id}")
               if a["kind"] == "disk"]
    assert len(pending) == 1, (g.task(task_id), pending)
    return pending[0]


def test_a_task_that_fills_the_disk_is_paused_at_the_reserve(box_on_small_disk: Gurtd) -> None:
    """BOX_HOME is on a 64 MiB disk with a reserve that leaves a task 12 MiB.  A task that
    writes 1 MiB at a time until it cannot is paused (frozen) with a disk approval naming the
    bytes; approved, it writes on and is paused again only once free space has halved; denied,
    it fails with disk full and the reason."""
    g = box_on_small_disk
    reserve = free_bytes(g.home) - (12 << 20)
    g.api("PUT", "/api/settings", {"diskReserveBytes": reserve})
    task = g.create("i=0; while [ $i -lt 100 ]; do head -c 1048576 /dev/zero > f$i || exit 1; "
                    "i=$((i+1)); sleep 0.05; done")
    first = disk_approval(g, task["id"])
    assert g.task(task["id"])["state"] == "waiting"
    assert first["tool"] == "disk"
    assert first["args"]["freeBytes"] < reserve
    assert first["args"]["bytes"] >= 8 << 20
    assert str(first["args"]["bytes"]) in first["question"]
    upper = os.path.join(g.home, "layers", task["id"], "upper")
    frozen = len(os.listdir(upper))
    time.sleep(0.5)
    assert len(os.listdir(upper)) == frozen, "a paused task wrote on"

    g.api("POST", f"/api/approvals/{first['id']}/approve", {})
    eventually(lambda: len(os.listdir(upper)) > frozen + 2, what="the task to write on")
    second = disk_approval(g, task["id"])
    assert second["id"] != first["id"]
    assert second["args"]["freeBytes"] < first["args"]["freeBytes"] * 0.6   # about half
    assert free_bytes(g.home) > 0

    g.api("POST", f"/api/approvals/{second['id']}/deny", {"reason": "enough"})
    failed = g.wait(task["id"])
    assert failed["state"] == "failed", failed
    assert failed["error"] == "disk full: enough"


WRITER = ("i=0; while [ $i -lt 100 ]; do head -c 1048576 /dev/zero > f$i || exit 1; "
          "i=$((i+1)); sleep 0.2; done")


def test_two_tasks_writing_at_once_are_both_paused_near_the_reserve(
        box_on_small_disk: Gurtd) -> None:
    """Two tasks write 1 MiB at a time at once, into 12 MiB above the reserve: together they
    take no more than one of them could (the first paused at the reserve, the other a step
    below it); approved, both write on and are paused again at about half the free space
    (each was let go to half of it, not twice that together)."""
    g = box_on_small_disk
    reserve = free_bytes(g.home) - (12 << 20)
    g.api("PUT", "/api/settings", {"diskReserveBytes": reserve})
    tasks = [g.create(WRITER)["id"] for _ in range(2)]
    first = [disk_approval(g, t) for t in tasks]
    low = free_bytes(g.home)
    print("two writers: bytes past the reserve when both were paused:", reserve - low)
    assert reserve - (6 << 20) < low < reserve, (reserve, low, first)
    free_before = min(a["args"]["freeBytes"] for a in first)
    for approval in first:
        g.api("POST", f"/api/approvals/{approval['id']}/approve", {})
    for task_id in tasks:
        eventually(lambda: any(a["id"] not in [f["id"] for f in first] for a in g.api(
            "GET", f"/api/approvals?state=pending&task={task_id}")), what="a second pause")
    low = free_bytes(g.home)
    print("two writers: free at the second pauses, of free at the first:",
           f"{low} of {free_before}")
    assert free_before // 2 - (6 << 20) < low < free_before, (free_before, low)
    for task_id in tasks:
        g.api("POST", f"/api/tasks/{task_id}/stop")
        g.wait(task_id)


INODE_EATER = python_arg_line(    # empty files, 100 at a time: no bytes, only inodes
    "import os, time\n"
    "n = 0\n"
    "while n < 40000:\n"
    "    for _ in range(100):\n"
    "        open('e%d' % n, 'w').close(); n += 1\n"
    "    time.sleep(0.05)\n")


def test_a_task_that_eats_inodes_is_paused_at_the_reserve_too(box_on_small_disk: Gurtd) -> None:
    """A task makes empty files: bytes stay plenty, inodes run out.  Free inodes count against
    the reserve like free bytes, so the task is paused with a disk approval before the last
    inode goes, and the box can still take new tasks; denied, the task fails."""
    g = box_on_small_disk
    st = os.statvfs(g.home)
    assert st.f_favail > 10000 and free_bytes(g.home) > 40 << 20
    task = g.create(INODE_EATER)
    approval = disk_approval(g, task["id"])
    st = os.statvfs(g.home)
    assert 0 < approval["args"]["freeInodes"] < G.inode_reserve(st.f_files), approval
    assert st.f_favail > 0 and free_bytes(g.home) > 40 << 20
    other = g.api("POST", "/api/tasks", {"title": "t", "prompt": "echo room", "worker": "fake"},
                  status=201)
    g.api("POST", f"/api/approvals/{approval['id']}/deny", {"reason": "too many files"})
    assert g.wait(task["id"])["error"] == "disk full: too many files"
    assert g.wait(other["id"])["state"] == "done"


def empty_members(names: list[str], kind: bytes) -> bytes:
    """A gzipped tar of empty members (files or folders): headers only."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.type = kind
            tar.addfile(info)
    return buf.getvalue()


@pytest.fixture
def box_on_a_16_mib_disk() -> Iterator[Gurtd]:
    """A gurtd on a 16 MiB ext4 (4,096 inodes): an upload as many members long is quick."""
    with gurtd_on_small_disk(size_mb=16) as (g, _):
        yield g
        stopped_and_clean(g)


@pytest.mark.parametrize("kind", [tarfile.REGTYPE, tarfile.DIRTYPE], ids=["files", "folders"])
def test_an_upload_of_empty_members_is_counted_in_inodes(box_on_a_16_mib_disk: Gurtd,
                                                         kind: bytes) -> None:
    """The attack: an upload of 49,886 empty members was admitted (no bytes) and left 1,275
    free inodes against a reserve of 2,560.  Here: as many empty files (or empty folders) as
    the free inodes above the inode reserve, and 50 more: 507 naming the inodes, nothing
    written, the inodes as free as before; 100 fewer fit."""
    g = box_on_a_16_mib_disk
    st = os.statvfs(g.home)
    room = st.f_favail - G.inode_reserve(st.f_files)
    assert 1000 < room < G.UPLOAD_MAX_MEMBERS - 100, st
    layers = sorted(os.listdir(os.path.join(g.home, "layers")))
    status, answer, _ = g.request("POST", "/api/workspaces/home/upload",
                                  raw=empty_members([f"e{i}" for i in range(room + 50)], kind),
                                  headers={"Content-Type": "application/x-tar"})
    assert (status, answer.get("code")) == (507, "insufficient_storage"), answer
    assert f"{room + 1} inodes" in answer["error"], answer
    assert sorted(os.listdir(os.path.join(g.home, "layers"))) == layers
    assert os.statvfs(g.home).f_favail >= st.f_favail - 8      # gurtd's own files at most
    g.api("POST", "/api/workspaces/home/upload",
          raw=empty_members([f"e{i}" for i in range(room - 100)], kind),
          headers={"Content-Type": "application/x-tar"}, status=201)
    assert os.statvfs(g.home).f_favail >= G.inode_reserve(st.f_files)


def test_a_box_on_a_disk_without_project_quotas_says_it_polls(box_on_small_disk: Gurtd) -> None:
    """The small disk is a plain ext4 (no project feature): gurtd's start says the layers have
    no kernel limit and free space is polled, with the reason."""
    log = box_on_small_disk.log_text()
    assert "disk: no project quotas on BOX_HOME (quotactl: " in log, log
    assert "free space is polled every" in log


def test_cgroups_of_this_box_and_the_cpu_share_of_its_tasks(box: Gurtd) -> None:
    """gurtd makes its tasks' parent groups below its own (half its CPU weight), one group per
    running task in each, and removes them when the task ends."""
    parents = [p for p in task_group_parents(box.home) if os.path.isdir(p)]
    assert parents, "no task parent group"
    cpu = [p for p in parents if os.path.exists(os.path.join(p, "cpu.shares"))]
    for parent in cpu:
        own = int(Path(os.path.dirname(parent), "cpu.shares").read_text())
        assert int(Path(parent, "cpu.shares").read_text()) == own // 2
    task = box.create("sleep 30")
    wait_for_step(box, task["id"], "sleep 30")
    groups = task_groups(box.home)
    assert sorted(os.path.basename(p) for p in groups) == [task["id"]] * len(parents)
    pid = box.worker_pids(task)[0]
    mine = Path(f"/proc/{pid}/cgroup").read_text()
    assert f"/{os.path.basename(parents[0])}/{task['id']}\n" in mine, mine
    box.api("POST", f"/api/tasks/{task['id']}/undo")
    assert [p for p in groups if os.path.exists(p)] == []
    assert json.loads(json.dumps(box.task(task["id"])))["state"] == "undone"


@pytest.mark.parametrize("way", ["clone3", "fork"])
def test_a_worker_is_born_in_its_v2_group_or_joins_it_first(way: str) -> None:
    """The spawner starts a worker straight in its task's v2 group (clone3 with
    CLONE_INTO_CGROUP) or, where clone3 is refused (GURT_CLONE_INTO_CGROUP=no stands in for
    systemd's filter), forks it and the worker writes itself in first; the start says which.
    Either way every process of the task is in the group, the sandbox's first line too."""
    env = {"GURT_CLONE_INTO_CGROUP": "no"} if way == "fork" else {}
    with running_gurtd(env) as g:
        said = "started in their cgroup by clone3(CLONE_INTO_CGROUP)" if way == "clone3" \
            else "forked, then they write themselves into cgroup.procs (GURT_CLONE_INTO_CGROUP=no)"
        assert f"workers: {said}" in g.log_text(), g.log_text()
        task = g.create("cat /proc/self/cgroup\nsleep 30")
        wait_for_step(g, task["id"], "sleep 30")
        line = next(x for x in g.output(task["id"]) if x.startswith("0::"))
        # (found from the task's own line: where gurtd runs in a scope of its own, in the VM
        # tier, its groups are not this test's)
        v2 = os.path.dirname(v2_mount() + line[3:])
        name = "gurt-" + hashlib.sha1(os.path.abspath(g.home).encode()).hexdigest()[:12]
        assert line.endswith(f"/{name}/{task['id']}"), line
        assert not os.path.exists(os.path.join(v2, "probe")), "the probe's group stayed"
        def same() -> bool:        # read twice: the shell may be forking its `sleep` (TCG)
            with open(os.path.join(v2, task["id"], "cgroup.procs")) as f:
                procs = sorted(int(p) for p in f.read().split())
            return procs == sorted(g.worker_pids(task))
        eventually(same, 10, "the group's processes to be the task's")
        g.api("POST", f"/api/tasks/{task['id']}/stop")
        assert g.wait(task["id"])["state"] == "failed"
        assert not os.path.exists(os.path.join(v2, task["id"]))


def test_fork_into_keeps_pythons_fork_bookkeeping(tmp_path: Any) -> None:
    """fork_into is a fork for Python too: the child runs os.register_at_fork's child hooks
    (PyOS_AfterFork_Child) and the parent its own; with hooks=False (a worker's) neither
    runs; a bad group fd fails as clone3 says."""
    group = os.path.join(G.cgroup_own_groups()[0] or "", "gurt-fork-into-test")
    os.makedirs(group, exist_ok=True)
    fd = os.open(group, os.O_RDONLY | os.O_DIRECTORY)
    seen: list[str] = []
    os.register_at_fork(after_in_parent=lambda: seen.append("parent"),
                        after_in_child=lambda: seen.append("child"))
    r, w = os.pipe()
    r2, w2 = os.pipe()
    try:
        pid = G.fork_into(fd)
        if pid == 0:
            os.write(w, (json.dumps(seen) + "\n").encode() +
                     Path("/proc/self/cgroup").read_text().encode())
            os._exit(0)
        os.close(w)
        assert os.waitpid(pid, 0)[1] == 0
        text = os.read(r, 4096).decode()
        assert text.splitlines()[0] == '["child"]', text        # the child's hook ran there
        assert text.splitlines()[-1].endswith("/gurt-fork-into-test"), text
        assert seen == ["parent"]
        pid = G.fork_into(fd, hooks=False)  # the spawner's way for a worker: no hook runs
        if pid == 0:
            os.write(w2, f"{os.getpid()} {json.dumps(seen)}".encode())
            os._exit(0)
        os.close(w2)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.read(r2, 4096).decode() == f'{pid} ["parent"]' and seen == ["parent"]
        with pytest.raises(OSError) as exc:
            G.fork_into(r)                  # a pipe is no cgroup
        assert exc.value.errno == errno.EBADF, exc.value
    finally:
        os.close(fd)
        os.close(r)
        os.close(r2)
        for _ in range(100):               # a reaped child's group may be busy a moment
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.01)


@pytest.mark.parametrize("cgroups, mountinfo, v2, v1", [
    (   # this kind of VM: v1 hierarchies, a v2 one without controllers; memory in a group
        "8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
        "30 25 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "31 25 0:27 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
        "32 25 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "33 25 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n",
        "/sys/fs/cgroup/unified",
        {"pids": "/sys/fs/cgroup/pids", "memory": "/sys/fs/cgroup/memory/process_api/abc",
         "cpu": "/sys/fs/cgroup/cpu,cpuacct"}),
    (   # Debian 12 under systemd: pure v2, gurtd in its service's group
        "0::/system.slice/gurtd.service\n",
        "35 24 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        "/sys/fs/cgroup/system.slice/gurtd.service", {}),
    (   # a container whose cgroupfs is mounted at its own group (mount root is not /)
        "0::/lxc/box1/init.scope\n",
        "40 30 0:31 /lxc/box1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "/sys/fs/cgroup/init.scope", {}),
])
def test_gurtds_own_groups_are_found_on_every_kind_of_host(cgroups: str, mountinfo: str,
                                                           v2: str, v1: dict) -> None:
    assert G.cgroup_own_groups(cgroups, mountinfo) == (v2, v1)
