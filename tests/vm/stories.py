"""The systemd stories: gurtd as a person installs it on a stock Debian 12, run by systemd.

Runs inside the VM tier's guest only (tests/vm/inside, from the stories unit), as root, in
this order: each story starts from what the one before left.  The last one leaves a task
running for the reboot (the guest powers off and boots again); tests/vm/after_reboot.py goes
on from there.  The guest has no network device.  Figures go to GURTD_VM_OUT/figures.txt (the
run prints them on the host).
"""

from __future__ import annotations

import glob
import http.client
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.environ.get("GURTD_VM_OUT", "/tmp")
BOX_HOME = "/var/lib/gurt"
PORT = 7700
TERMINAL = ("done", "failed", "undone")
# Under TCG a fork+exec costs about 45 ms and a fake task about 3 s: waits are long.
TASK_TIMEOUT = 300.0
REBOOT_NOTE = "/var/lib/gurtd-vm-reboot.json"     # the reboot story's task, for after it
UNIT_GROUP = "/sys/fs/cgroup/system.slice/gurtd.service"


def figure(name: str, value: str) -> None:
    with open(os.path.join(OUT, "figures.txt"), "a") as f:
        f.write(f"{name}: {value}\n")


def sh(*argv: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def journal(lines: int = 60) -> str:
    return sh("journalctl", "-u", "gurtd", "-b", "--no-pager", "-n", str(lines)).stdout


def unit(prop: str) -> str:
    return sh("systemctl", "show", "-p", prop, "--value", "gurtd").stdout.strip()


# The API of the unit's gurtd ##################################################################

def request(method: str, path: str, body: Any = None, raw: bytes | None = None,
            home: str = BOX_HOME, port: int = PORT) -> tuple[int, Any]:
    token = Path(home, "token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    data = raw
    if raw is not None:
        headers["Content-Type"] = "application/octet-stream"
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
    finally:
        conn.close()
    if resp.getheader("Content-Type", "").split(";")[0].strip() == "application/json":
        return resp.status, json.loads(payload)
    return resp.status, payload


def api(method: str, path: str, body: Any = None, **where: Any) -> Any:
    code, data = request(method, path, body, **where)
    assert 200 <= code < 300, (method, path, code, data, journal())
    return data


def create(prompt: str, **fields: Any) -> dict[str, Any]:
    return api("POST", "/api/tasks", {"title": "vm story", "worker": "fake", "prompt": prompt,
                                      **fields})


def wait(task_id: str, states: tuple[str, ...] = TERMINAL,
         timeout: float = TASK_TIMEOUT, **where: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        task = api("GET", f"/api/tasks/{task_id}", **where)
        if task["state"] in states:
            return task
        assert time.monotonic() < deadline, (task, journal())
        time.sleep(0.2)


def run(prompt: str, **fields: Any) -> dict[str, Any]:
    return wait(create(prompt, **fields)["id"])


def output(task_id: str, **where: Any) -> list[str]:
    code, data = request("GET", f"/api/tasks/{task_id}/log", **where)
    assert code == 200, data
    return [e["text"] for e in map(json.loads, data.decode().splitlines())
            if e["type"] == "stdout"]


def done(task: dict[str, Any]) -> None:
    assert task["state"] == "done", (task, output(task["id"]), journal())


def wait_running(task_id: str, step: str, **where: Any) -> None:
    deadline = time.monotonic() + TASK_TIMEOUT
    while (task := api("GET", f"/api/tasks/{task_id}", **where)).get("step") != step:
        assert task["state"] in ("queued", "running"), (task, journal())
        assert time.monotonic() < deadline, (task, journal())
        time.sleep(0.2)


def wait_active(old_pid: str, timeout: float = 180.0) -> str:
    """The unit's new main pid, once systemd has it active again (READY said)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, state = unit("MainPID"), unit("ActiveState")
        if state == "active" and pid not in ("0", old_pid):
            return pid
        assert time.monotonic() < deadline, (pid, state, journal())
        time.sleep(0.5)


# The stories ##################################################################################

def test_make_install_works_offline_from_the_preinstalled_packages() -> None:
    started = time.monotonic()
    out = sh("make", "-C", SRC, "install", timeout=1800)
    figure("make install", f"{time.monotonic() - started:.0f} s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert os.path.exists("/etc/systemd/system/gurtd.service")
    # gurtd starts from the bytecode made at install (its folder is read-only to the unit)
    assert os.listdir("/usr/local/lib/gurtd/__pycache__"), "no bytecode installed"


def test_systemctl_enable_now_says_ready() -> None:
    started = time.monotonic()
    out = sh("systemctl", "enable", "--now", "gurtd")     # Type=notify: returns at READY=1
    figure("systemctl enable --now -> READY", f"{time.monotonic() - started:.1f} s")
    assert out.returncode == 0, (out.stderr, journal())
    assert unit("ActiveState") == "active", journal()
    assert unit("UnitFileState") == "enabled", journal()
    assert api("GET", "/api/health")["ok"] is True
    assert "running" in unit("StatusText"), unit("StatusText")
    with open(f"/proc/{unit('MainPID')}/cmdline", "rb") as f:
        assert b"\0-m\0gurtd\0" in f.read(), "not run as a module (its bytecode)"
    said = journal(400)
    assert "limits: cpu (v2), memory (v2), pids (v2)" in said, said
    # the unit sets no RestrictNamespaces= (its filter answers clone3 ENOSYS): workers are
    # born in their groups, no cgroup.procs write on the start path
    assert "workers: started in their cgroup by clone3(CLONE_INTO_CGROUP)" in said, said
    assert "workers: forked" not in said, said


def test_the_installed_unit_scores_5_or_less() -> None:
    # the installed, running unit, as systemd sees it (not --offline)
    out = sh("systemd-analyze", "security", "--no-pager", "gurtd.service")
    score = re.search(r"Overall exposure level for gurtd.service: ([\d.]+)", out.stdout)
    assert score, (out.stdout[-3000:], out.stderr)
    figure("systemd-analyze security gurtd", score.group(1))
    assert float(score.group(1)) <= 5.0, out.stdout[-3000:]


def task_cgroup(task_id: str) -> str:
    line = next(x for x in output(task_id) if x.startswith("0::"))
    return "/sys/fs/cgroup" + line[3:]


def read(path: str) -> str:
    return Path(path).read_text().strip()


def assert_limits_in(group: str, limits: dict[str, int], task_id: str, **where: Any) -> None:
    """The task's own v2 group holds every process of it, with its limits."""
    assert os.path.basename(group) == task_id, group
    assert int(read(os.path.join(group, "memory.max"))) == limits["memoryBytes"]
    assert read(os.path.join(group, "memory.swap.max")) == "0"
    assert read(os.path.join(group, "memory.oom.group")) == "1"
    assert int(read(os.path.join(group, "pids.max"))) == limits["processes"]
    assert int(read(os.path.join(group, "cpu.weight"))) == 100
    # the tasks' parent weighs half of gurtd on the CPU
    assert int(read(os.path.join(os.path.dirname(group), "cpu.weight"))) == 50
    user = api("GET", f"/api/tasks/{task_id}", **where)["user"]
    uid = pwd.getpwnam(user).pw_uid
    procs = set(read(os.path.join(group, "cgroup.procs")).split())
    mine = {p for p in os.listdir("/proc") if p.isdigit() and owner_of(p) == uid}
    assert procs and mine <= procs, (procs, mine)


def owner_of(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def test_a_fake_task_runs_with_its_limits_in_its_own_cgroup() -> None:
    started = time.monotonic()
    done(run("echo hello > hello.txt\ncat hello.txt"))
    figure("a fake task", f"{time.monotonic() - started:.1f} s")
    assert request("GET", "/api/workspaces/home/files/hello.txt") == (200, b"hello\n")
    # the delegated subtree: gurtd in a leaf of its own, controllers for its tasks
    assert unit("MainPID") in read(os.path.join(UNIT_GROUP, "gurtd", "cgroup.procs")).split()
    assert {"cpu", "memory", "pids"} <= set(read(os.path.join(UNIT_GROUP,
                                                             "cgroup.subtree_control")).split())
    limits = {"processes": 64, "memoryBytes": 256 << 20}
    task = create("cat /proc/self/cgroup\nsleep 600", limits=limits)
    wait_running(task["id"], "sleep 600")
    group = task_cgroup(task["id"])
    assert group.startswith(UNIT_GROUP + "/gurt-"), group
    assert_limits_in(group, limits, task["id"])
    api("POST", f"/api/tasks/{task['id']}/stop")          # cgroup.kill
    assert wait(task["id"])["state"] == "failed"
    assert not os.path.exists(group)


def test_a_task_past_its_memory_is_killed_whole() -> None:
    # memory.max holds: the hog and its shell, one group (memory.oom.group), are killed
    task = run("python3 -c 'x = b\"x\" * (200 << 20); print(len(x))'",
               limits={"memoryBytes": 64 << 20})
    assert (task["state"], task.get("error")) == ("failed", "out of memory"), task
    assert str(200 << 20) not in output(task["id"])


def test_a_task_with_hosts_runs_behind_its_grant() -> None:
    # No network device: the grant is set up (veth, nftables, gurtd's DNS) and the task runs.
    task = run("ip -o link | cut -d: -f2\ncat /etc/resolv.conf", hosts=["example.test"])
    done(task)
    out = output(task["id"])
    assert "nameserver 127.0.0.53" in out, out


def test_a_task_calls_a_tool_through_the_broker() -> None:
    path = os.path.join(BOX_HOME, "tools", "echo.tool")
    with open(path, "w") as f:
        f.write("#!/bin/sh\ninput=$(cat)\nprintf '{\"echo\": %s, \"user\": \"%s\"}\\n' "
                "\"$input\" \"$(id -un)\"\n")
    os.chmod(path, 0o755)
    task = run("gurtd tool echo.tool '{\"word\": \"hi\"}'", tools=["echo.tool"])
    # gurtd.service's UMask=0077 applies to what gurtd makes: the tools folder's mode tells.
    mode = oct(os.stat(os.path.dirname(path)).st_mode & 0o777)
    assert task["state"] == "done", (mode, task, journal())
    result = json.loads(output(task["id"])[0])
    assert result == {"echo": {"word": "hi"}, "user": "gurt-tools"}, result


def test_a_tasks_mountinfo_names_no_box_home() -> None:
    # before 6.15 (6.1, 6.12 here) the broker socket's bind named BOX_HOME/run: now it comes
    # from a tmpfs of gurtd's that only the spawner's namespace has, on every kernel
    task = run("cat /proc/self/mountinfo")
    done(task)
    mounts = output(task["id"])
    assert len(mounts) > 10 and not [m for m in mounts if BOX_HOME in m], mounts
    broker = [m.split() for m in mounts if m.split()[4] == "/run/gurt/broker.sock"]
    assert len(broker) == 1 and broker[0][3] == "/broker.sock", mounts
    assert " ".join(broker[0]).split(" - ", 1)[1].startswith("tmpfs gurt "), broker


@pytest.fixture(scope="module")
def owner() -> Any:
    name = "vmowner" + secrets.token_hex(2)
    sh("useradd", "-m", "-d", f"/home/{name}", "-s", "/usr/sbin/nologin", name)
    yield pwd.getpwnam(name)
    sh("userdel", "-r", name)


def test_a_personal_folder_is_worked_on_as_a_copy_then_kept(owner: Any) -> None:
    folder = os.path.join(owner.pw_dir, "proj")
    os.makedirs(folder)
    Path(folder, "a.txt").write_text("hello\n")
    for p in (folder, os.path.join(folder, "a.txt")):
        os.chown(p, owner.pw_uid, owner.pw_gid)
    time.sleep(0.05)                             # its ctimes are before the task's start
    task = run(f"cd {folder} && echo more >> a.txt", folder=folder)
    done(task)
    with open(os.path.join(folder, "a.txt")) as f:
        assert f.read() == "hello\n"             # a copy until kept
    diff = api("GET", f"/api/tasks/{task['id']}/diff")       # small files: one diff -r of
    assert b"\n hello\n+more\n" in diff, diff                # copies under /dev/shm, which
    assert "each diffed on its own" not in journal(200)   # the unit's private /dev has it
    assert not glob.glob("/dev/shm/gurt-diff-*")
    assert api("POST", f"/api/tasks/{task['id']}/keep", {})["review"] == "kept"
    assert Path(folder, "a.txt").read_text() == "hello\nmore\n"
    assert os.stat(os.path.join(folder, "a.txt")).st_uid == owner.pw_uid


def test_an_upload_is_a_layer_a_task_sees() -> None:
    code, task = request("PUT", "/api/workspaces/home/files/notes/todo.txt", raw=b"buy milk\n")
    assert code == 201, (code, task, journal())
    assert (task["worker"], task["state"]) == ("upload", "done"), task
    read = run("cat notes/todo.txt")
    done(read)
    assert output(read["id"]) == ["buy milk"]


def test_a_droid_task_without_a_key_fails_with_the_clis_own_error() -> None:
    task = run("say hello", worker="droid")
    assert task["state"] == "failed", task
    assert "Authentication failed" in task.get("error", ""), (task, journal())


def test_a_schedule_starts_its_task_at_its_minute() -> None:
    sched = api("POST", "/api/schedules", {"name": "every minute", "cron": "* * * * *",
                                           "task": {"worker": "fake", "prompt": "echo tick"}})
    deadline = time.monotonic() + 150
    while not (item := api("GET", f"/api/schedules/{sched['id']}")).get("lastTask"):
        assert time.monotonic() < deadline, (item, journal())
        time.sleep(1)
    api("DELETE", f"/api/schedules/{sched['id']}")
    task = wait(item["lastTask"])
    done(task)
    assert output(task["id"]) == ["tick"]


def test_kill_9_is_restarted_by_systemd_and_reconciled() -> None:
    task = create("sleep 600")
    wait_running(task["id"], "sleep 600")
    user = api("GET", f"/api/tasks/{task['id']}")["user"]
    pid = unit("MainPID")
    assert sh("systemctl", "kill", "-s", "KILL", "gurtd").returncode == 0
    started = time.monotonic()
    wait_active(pid)
    figure("kill -9 -> active again", f"{time.monotonic() - started:.1f} s")
    after = api("GET", f"/api/tasks/{task['id']}")
    assert after["state"] == "failed", after
    assert "restarted" in after.get("error", ""), after
    assert user not in {p.pw_name for p in pwd.getpwall()}
    assert "reconcile: could not" not in journal(400), journal(400)
    done(run("echo after the restart"))


def test_a_stuck_loop_is_restarted_by_the_watchdog() -> None:
    task = create("sleep 600")
    wait_running(task["id"], "sleep 600")
    pid = unit("MainPID")
    os.kill(int(pid), signal.SIGSTOP)           # the loop says WATCHDOG=1 no more
    started = time.monotonic()
    wait_active(pid, timeout=240)
    figure("SIGSTOP -> watchdog -> active again", f"{time.monotonic() - started:.1f} s")
    said = journal(400)
    assert "Watchdog timeout" in said, said
    after = api("GET", f"/api/tasks/{task['id']}")
    assert after["state"] == "failed" and "restarted" in after.get("error", ""), after


def test_systemctl_restart_keeps_the_box() -> None:
    pid = unit("MainPID")
    started = time.monotonic()
    out = sh("systemctl", "restart", "gurtd")
    figure("systemctl restart -> READY", f"{time.monotonic() - started:.1f} s")
    assert out.returncode == 0, (out.stderr, journal())
    wait_active(pid)
    assert request("GET", "/api/workspaces/home/files/hello.txt") == (200, b"hello\n")
    done(run("cat hello.txt"))


# Project quotas: Debian's kernels have them (QFMT_V2), a host suite's kernel may not ##########

def free_above(path: str) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_favail


def project_of(path: str) -> int:
    """The project id of a folder, as lsattr -p shows it."""
    return int(sh("lsattr", "-pd", path).stdout.split()[0])


def disk_approval(task_id: str, after: str = "") -> dict[str, Any]:
    """The task's pending disk approval (another than after), once there is one."""
    deadline = time.monotonic() + TASK_TIMEOUT
    while True:
        found = [a for a in api("GET", f"/api/approvals?state=pending&task={task_id}")
                 if a["kind"] == "disk" and a["id"] != after]
        if found:
            return found[0]
        assert time.monotonic() < deadline, (api("GET", f"/api/tasks/{task_id}"), journal())
        time.sleep(1)


def allocated(path: str) -> int:
    """The bytes the files below path take on disk."""
    return sum(os.lstat(os.path.join(top, name)).st_blocks * 512
               for top, _, names in os.walk(path) for name in names)


class LowestFree:
    """The lowest free space of BOX_HOME seen every 10 ms while it runs (a thread)."""

    def __init__(self) -> None:
        self.low, self.running = free_above(BOX_HOME)[0], True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while self.running:
            self.low = min(self.low, free_above(BOX_HOME)[0])
            time.sleep(0.01)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return self.low


def stopped_at_its_limit(task_id: str, what: str) -> dict[str, Any]:
    """The task once the kernel refused its write: failed with EDQUOT, or paused by gurtd's
    check at its limit (which can come while the refused call is still in the kernel, as a
    fallocate under TCG on 6.1), then denied.  The way it stopped is a figure."""
    task = wait(task_id, TERMINAL + ("waiting",))
    if task["state"] == "waiting":
        approval = disk_approval(task_id)
        api("POST", f"/api/approvals/{approval['id']}/deny", {"reason": "at its limit"})
        task = wait(task_id)
        assert task["error"] == "disk full: at its limit", task
        figure(f"{what}: stopped", "paused at its limit, denied")
    else:
        assert task["state"] == "failed" and "Disk quota exceeded" in task["error"], task
        figure(f"{what}: stopped", "EDQUOT")
    return task


def test_on_project_quotas_a_tasks_layer_stops_at_the_reserve() -> None:
    """After the stop: BOX_HOME becomes a 128 MiB ext4 (16,384 inodes) with the project and
    quota features, mounted with prjquota; gurtd says each layer has a project quota.  One
    fallocate of 1 GiB and a dd at full speed each stop at the limit (`Disk quota exceeded`,
    or a pause at it),
    the reserve untouched, the layer no bigger than the room; two dd at once stop together at
    the reserve (each layer has its share of the room); a task's chattr cannot take its file
    out of its project; a task making empty files without end is paused at its inode limit
    with a disk approval while another task stays running and gurtd still writes its state;
    approved, it is asked again at half the free inodes; an ended layer carries no project
    mark."""
    out = sh("systemctl", "stop", "gurtd")
    assert out.returncode == 0, (out.stderr, journal())
    image = "/var/tmp/gurt-quota.img"
    with open(image, "wb") as f:
        f.truncate(128 << 20)          # each attack's failed layer stays on it
    assert sh("mkfs.ext4", "-q", "-F", "-m", "0", "-N", "16384", "-O", "quota,project",
              image).returncode == 0
    out = sh("mount", "-o", "loop,prjquota", image, BOX_HOME)
    assert out.returncode == 0, out.stderr
    try:
        assert sh("systemctl", "start", "gurtd").returncode == 0, journal()
        wait_active("0")
        assert "each task's layer has a project quota" in journal(), journal()
        other = create("echo mine > mine.txt\nsleep 600")
        wait_running(other["id"], "sleep 600")
        for attack in ("fallocate -l 1G big",
                       "dd if=/dev/zero of=big bs=1M count=1000 status=none"):
            # 24 MiB above the reserve (the failed layer of the attack before stays on disk)
            reserve = free_above(BOX_HOME)[0] - (24 << 20)
            api("PUT", "/api/settings", {"diskReserveBytes": reserve})
            lowest = LowestFree()
            task = stopped_at_its_limit(create(attack)["id"], attack.split()[0])
            # ext4 takes a whole extent's blocks before it trims the request to the quota
            # (ext4_mb_new_blocks): while a refused fallocate is in the kernel free space dips
            figure(f"{attack.split()[0]}: lowest free while it ran, of the reserve",
                   f"{lowest.stop()} of {reserve}")
            # past the reserve by a step (the layer's least limit) and gurtd's own writes at
            # most; the poll cannot stop a call half way: unlimited, 1 GiB fills the disk
            upper = os.path.join(BOX_HOME, "layers", task["id"], "upper")
            assert free_above(BOX_HOME)[0] >= reserve - (1 << 20), (attack, free_above(BOX_HOME))
            assert allocated(upper) <= (25 << 20), allocated(upper)
            assert project_of(upper) == 0, sh("lsattr", "-pd", upper).stdout
        # two at once: each layer's limit is its share of the room, so together they stop
        # at the reserve (each a step past it at most); both start writing at one second
        reserve = free_above(BOX_HOME)[0] - (24 << 20)
        api("PUT", "/api/settings", {"diskReserveBytes": reserve})
        go = int(time.time()) + 30
        pair = [create(f"while [ $(date +%s) -lt {go} ]; do sleep 0.1; done\n"
                       "dd if=/dev/zero of=big bs=1M count=1000 status=none")["id"]
                for _ in range(2)]
        for task_id in pair:
            stopped_at_its_limit(task_id, "two dd at once")
        assert time.time() > go
        figure("two dd at once: free after, of the reserve",
               f"{free_above(BOX_HOME)[0]} of {reserve}")
        assert free_above(BOX_HOME)[0] >= reserve - (2 << 20), free_above(BOX_HOME)
        # chattr: refused (the kernel filter), the file stays in its layer's project
        task = run("echo x > f\nchattr -p 0 f 2>&1 || echo refused\nlsattr -p f")
        out = output(task["id"])
        project = project_of(os.path.join(BOX_HOME, "layers", task["id"], "upper", "f"))
        assert project != 0 and "refused" in out and f"{project} " in " ".join(out), (project, out)
        # a failed redirection of `true` (not a special builtin) does not end the shell
        eater = create("i=0; while [ $i -lt 100000 ]; do true 2>/dev/null >e$i; i=$((i+1)); done\n"
                       "sleep 600")
        first = disk_approval(eater["id"])
        st = os.statvfs(BOX_HOME)     # a step (64 inodes) into the reserve at most, and gurtd's
        assert st.f_favail >= min(1 << 16, st.f_files // 20) - 80, st
        figure("inodes free at the inode limit", f"{st.f_favail} of {st.f_files}")
        assert api("GET", f"/api/tasks/{other['id']}")["state"] == "running"
        api("PUT", "/api/settings", {"taskLogBytes": 1 << 20})       # gurtd's own writes go on
        # approved, it writes on until half the free inodes are gone, and is asked again
        api("POST", f"/api/approvals/{first['id']}/approve", {})
        second = disk_approval(eater["id"], first["id"])
        assert second["args"]["freeInodes"] < first["args"]["freeInodes"] * 0.6, (first, second)
        assert os.statvfs(BOX_HOME).f_favail > 0
        api("POST", f"/api/approvals/{second['id']}/deny", {"reason": "too many files"})
        assert wait(eater["id"])["error"] == "disk full: too many files"
        api("POST", f"/api/tasks/{other['id']}/stop")
        wait(other["id"])
    finally:          # the box as the later stories know it, even when this one failed
        sh("systemctl", "stop", "gurtd")
        assert sh("umount", BOX_HOME).returncode == 0
        os.unlink(image)
        assert sh("systemctl", "start", "gurtd").returncode == 0, journal()
        wait_active("0")


HAND_HOME, HAND_PORT = "/var/tmp/gurt-by-hand", 7701


def by_hand(env: dict[str, str], prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """`gurtd serve` started by hand from this story's own process (through prefix): its
    group is the stories unit's, not delegated, with other processes in it."""
    shutil.rmtree(HAND_HOME, ignore_errors=True)
    with open(os.path.join(OUT, "by-hand.log"), "wb") as log:
        proc = subprocess.Popen([*prefix, "/usr/local/bin/gurtd", "serve", "--box-home", HAND_HOME,
                                 "--listen", f"127.0.0.1:{HAND_PORT}"], stdout=log, stderr=log,
                                env={**os.environ, **env})
    deadline = time.monotonic() + 180
    while "listening on http://" not in hand_log():      # the token file comes before it
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(hand_log())
        time.sleep(0.5)
    return proc


def hand_log() -> str:
    """This by-hand run's log (by_hand empties it)."""
    with open(os.path.join(OUT, "by-hand.log"), errors="replace") as f:
        return f.read()[-6000:]


def hand_stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, hand_log()
    shutil.rmtree(HAND_HOME, ignore_errors=True)


def test_by_hand_gurtd_runs_in_a_delegated_scope_of_its_own() -> None:
    hand = {"home": HAND_HOME, "port": HAND_PORT}
    proc = by_hand({})
    try:
        own = Path(f"/proc/{proc.pid}/cgroup").read_text().strip()
        assert re.fullmatch(r"0::/system\.slice/run-[^/]+\.scope/gurtd", own), own
        # no systemd filter there: workers are born in their groups
        said = "workers: started in their cgroup by clone3(CLONE_INTO_CGROUP)"
        assert said in hand_log(), hand_log()
        limits = {"processes": 32, "memoryBytes": 128 << 20}
        task = api("POST", "/api/tasks", {"title": "by hand", "worker": "fake", "limits": limits,
                                          "prompt": "cat /proc/self/cgroup\nsleep 600"}, **hand)
        wait_running(task["id"], "sleep 600", **hand)
        line = next(x for x in output(task["id"], **hand) if x.startswith("0::"))
        assert_limits_in("/sys/fs/cgroup" + line[3:], limits, task["id"], **hand)
        api("POST", f"/api/tasks/{task['id']}/stop", **hand)
        assert wait(task["id"], **hand)["state"] == "failed"
    finally:
        hand_stop(proc)
    scope = "/sys/fs/cgroup" + own[3:].rsplit("/", 1)[0]
    deadline = time.monotonic() + 60
    while os.path.exists(scope):                # systemd removes an emptied scope
        assert time.monotonic() < deadline, f"the scope {scope} outlived gurtd"
        time.sleep(0.5)


def test_by_hand_with_nothing_delegated_tasks_refuse_to_start_unbounded() -> None:
    hand = {"home": HAND_HOME, "port": HAND_PORT}
    proc = by_hand({"GURT_SCOPE": "no"})      # stays in the stories unit's group
    try:
        assert "no task will start rather than run unbounded" in hand_log(), hand_log()
        task = api("POST", "/api/tasks", {"title": "by hand", "worker": "fake",
                                          "prompt": "echo unbounded"}, **hand)
        after = wait(task["id"], **hand)
        assert after["state"] == "failed", after
        assert "not delegated" in after["error"] and "Delegate=yes" in after["error"], after
        assert output(task["id"], **hand) == []
    finally:
        hand_stop(proc)


def test_by_hand_on_a_private_root_the_tasks_mountinfo_names_no_box_home() -> None:
    # a host without systemd (its root private) on a kernel before 6.15 (6.1, 6.12 here),
    # which refuses a clone of a detached mount: the broker's tmpfs is attached at
    # BOX_HOME/run/tasks in gurtd's namespace instead of binding BOX_HOME/run/broker.sock
    hand = {"home": HAND_HOME, "port": HAND_PORT}
    proc = by_hand({}, ("unshare", "-m", "--propagation", "private"))
    try:
        old = tuple(map(int, re.findall(r"\d+", os.uname().release)[:2])) < (6, 15)
        said = f"tasks' broker socket: on a tmpfs at {HAND_HOME}/run/tasks"
        assert said in hand_log() or not old, hand_log()
        task = api("POST", "/api/tasks", {"title": "by hand", "worker": "fake",
                                          "prompt": "cat /proc/self/mountinfo"}, **hand)
        assert wait(task["id"], **hand)["state"] == "done", hand_log()
        mounts = output(task["id"], **hand)
        assert len(mounts) > 10 and not [m for m in mounts if HAND_HOME in m], mounts
        broker = [m.split() for m in mounts if m.split()[4] == "/run/gurt/broker.sock"]
        assert len(broker) == 1 and broker[0][3] == "/broker.sock", mounts
    finally:
        hand_stop(proc)


def test_a_task_is_running_when_the_guest_reboots() -> None:
    # tests/vm/inside powers the guest off after this story; tests/vm/run.sh boots it again
    task = create("sleep 600")
    wait_running(task["id"], "sleep 600")
    with open(REBOOT_NOTE, "w") as f:
        json.dump({"task": task["id"], "user": api("GET", f"/api/tasks/{task['id']}")["user"],
                   "at": time.time()}, f)
