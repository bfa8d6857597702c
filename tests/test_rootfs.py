"""A task's root is built from nothing, its kernel surface is filtered, and it leaves nothing.

Stories of real `fake`-worker tasks (each prompt line is /bin/sh as the task's own user):
the host's other paths do not exist inside, /etc has no secrets, the tools a worker needs
work, /dev is minimal, /tmp, /var/tmp, /dev/shm and HOME share one tmpfs; every syscall the
kernel filter refuses is refused from inside a task (and from a root process that loads the
same filter, where the kernel alone would allow it); set-id bits never reach a layer on disk;
a task's uid holds no kernel keys after it.

Probe lines end in `; true` or `|| echo ...` so that a refused probe does not end the task.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import gurtd as G
from conftest import (ROOT, VIEW, Gurtd, end_sleep, eventually, prompt, put_base_file,
                      running_gurtd, wait_for_step)

def key_users() -> set[int]:
    with open(G.KEY_USERS) as f:
        return {int(line.split(":", 1)[0]) for line in f if line.strip()}


# the root #####################################################################################

def test_the_hosts_other_paths_do_not_exist_inside(gurtd: Gurtd) -> None:
    tag = secrets.token_hex(6)
    secret = f"gurt-rootfs-secret-{tag}"
    made = [f"/srv/gurt-test-{tag}", f"/opt/gurt-test-{tag}", f"/var/lib/gurt-test-{tag}",
            f"/mnt/gurt-test-{tag}"]
    other_home = f"/home/gurt-test-other-{tag}"
    try:
        for path in made:
            Path(path).write_text(secret + "\n")
            os.chmod(path, 0o644)              # world-readable: only its absence protects it
        os.mkdir(other_home, 0o755)
        Path(other_home, "notes.txt").write_text(secret + "\n")
        os.chmod(os.path.join(other_home, "notes.txt"), 0o644)
        probes = made + [other_home, "/srv", "/opt", "/var/lib", "/work", "/root", "/mnt",
                         "/media", "/boot", "/sys", gurtd.home, os.path.dirname(gurtd.home),
                         ROOT, G.__file__, "/etc/shadow", "/etc/gshadow"]
        task = gurtd.run_done(prompt(
            *[f"test -e '{p}' && echo 'visible {p}' || echo 'absent {p}'" for p in probes],
            f"cat {' '.join(made)} {other_home}/notes.txt 2>/dev/null; true",
            "ls -A /", "echo ---", "ls -A /var", "echo ---", "ls -A /home", "echo ---",
            "ls -A /run /run/gurt",
        ))
        out = gurtd.output(task["id"])
        for p in probes:
            assert f"absent {p}" in out, (p, out)
        assert not [line for line in out if secret in line], out
        cut = [i for i, line in enumerate(out) if line == "---"]
        top = set(out[len(probes):cut[0]])
        expected = {"dev", "etc", "home", "proc", "run", "tmp", "usr", "var"}
        expected |= {n for n in G.USRMERGE if os.path.lexists(os.path.join("/", n))}
        assert top == expected, top
        assert out[cut[0] + 1:cut[1]] == ["tmp"], out
        assert out[cut[1] + 1:cut[2]] == [task["user"]], out
        assert "broker.sock" in out[cut[2] + 1:] and "view" in out[cut[2] + 1:], out
    finally:
        for path in made:
            if os.path.exists(path):
                os.remove(path)
        shutil.rmtree(other_home, ignore_errors=True)


def test_usr_and_the_usrmerge_links_are_the_hosts_read_only(gurtd: Gurtd) -> None:
    task = gurtd.run_done(prompt(
        *[f"readlink /{n} || echo 'real /{n}'" for n in G.USRMERGE
          if os.path.lexists(os.path.join("/", n))],
        "touch /usr/gurt-test 2>&1 || true",
        "touch /bin/gurt-test 2>&1 || true",
        "mkdir /gurt-test 2>&1 || true",
    ))
    out = gurtd.output(task["id"])
    wanted = [os.readlink(os.path.join("/", n)) if os.path.islink(os.path.join("/", n))
              else f"real /{n}" for n in G.USRMERGE if os.path.lexists(os.path.join("/", n))]
    assert out[:len(wanted)] == wanted, out
    errors = out[len(wanted):]
    assert len(errors) == 3 and all("Read-only file system" in e for e in errors), errors
    assert not os.path.exists("/usr/gurt-test") and not os.path.exists("/gurt-test")


def test_etc_is_the_hosts_without_its_secrets(gurtd: Gurtd) -> None:
    tag = secrets.token_hex(6)
    key_file = f"/etc/gurt-test-{tag}.key"         # matched by ETC_HIDDEN's *.key
    Path(key_file).write_text(f"gurt-key-secret-{tag}\n")
    os.chmod(key_file, 0o644)
    try:
        task = gurtd.run_done(prompt(
            "cat /etc/shadow || echo 'shadow: none'",
            "cat /etc/gshadow || echo 'gshadow: none'",
            f"cat {key_file} || echo 'key: none'",
            "ls /etc/ssl/private || echo 'ssl private: none'",
            "ls /etc/sudoers /etc/sudoers.d || echo 'sudoers: none'",
            "ls /etc/ssh | grep _key$ || echo 'host keys: none'",
            "whoami",
            'grep -c "^$(whoami):" /etc/passwd',
            "grep -c '^root:' /etc/passwd",
            "cat /etc/resolv.conf",
            "touch /etc/gurt-test 2>&1 || true",
        ))
        out = gurtd.output(task["id"])
        assert out[:6] == ["shadow: none", "gshadow: none", "key: none", "ssl private: none",
                           "sudoers: none", "host keys: none"], out
        assert out[6:9] == [task["user"], "1", "1"], out
        assert out[9] == "nameserver 127.0.0.53", out
        assert "Read-only file system" in out[-1], out
        assert f"gurt-key-secret-{tag}" not in json.dumps(gurtd.log(task["id"]))
    finally:
        os.remove(key_file)


def test_a_running_task_keeps_its_etc_masks_while_other_tasks_come_and_go(gurtd: Gurtd) -> None:
    # gurtd replaces /etc/shadow by rename when it adds or removes a task user; a mask bound
    # over the file would be detached by that rename.  The box's /etc is an overlay instead.
    # a waits until the other task is over (not 2 s, which a busy machine may outlast: a's
    # look at /etc/shadow before any user was added or removed)
    a = gurtd.create(prompt("sleep 30 || true", "test -e /etc/shadow && echo shadow-visible || "
                                                "echo shadow-hidden"))
    wait_for_step(gurtd, a["id"], "sleep 30 || true")
    gurtd.run_done("true")                     # a user added and removed meanwhile
    end_sleep(gurtd, a, "sleep 30")
    assert gurtd.wait(a["id"])["state"] == "done"
    assert gurtd.output(a["id"]) == ["shadow-hidden"]


def test_the_worker_has_python_git_node_and_a_shell(gurtd: Gurtd) -> None:
    assert shutil.which("node"), "node is needed (the droid worker's runtime)"
    task = gurtd.run_done(prompt(
        "sh -c 'echo shell works'",
        "git --version | cut -d' ' -f1,2",
        "git init -q /tmp/repo && git -C /tmp/repo -c user.email=t@t -c user.name=t "
        "commit -q --allow-empty -m one && git -C /tmp/repo log --format=%s",
        # a hot loop that V8 compiles (the JIT needs writable-executable memory)
        "node -e 'let s = 0; const f = (i) => i * i % 7; "
        "for (let i = 0; i < 2e7; i++) s += f(i); console.log(\"node\", s)'",
        "node -e 'const {Worker} = require(\"worker_threads\"); "
        "new Worker(\"console.log(\\\"node worker thread\\\")\", {eval: true})'",
        "python3 -c 'import threading; r = []; "
        "ts = [threading.Thread(target=lambda: r.append(1)) for _ in range(8)]; "
        "[t.start() for t in ts]; [t.join() for t in ts]; print(\"python threads\", len(r))'",
        "python3 -c 'import os; m, s = os.openpty(); print(\"pty\", os.ttyname(s))'",
        "echo view > view.txt && cat view.txt",
        'echo home > "$HOME/h" && cat "$HOME/h"',
        "echo tmp > /tmp/t && cat /tmp/t",
    ))
    expected = sum(i * i % 7 for i in range(20_000_000))
    assert gurtd.output(task["id"]) == [
        "shell works", "git version", "one", f"node {expected}", "node worker thread",
        "python threads 8", "pty /dev/pts/0", "view", "home", "tmp"]


def test_dev_is_minimal(gurtd: Gurtd) -> None:
    task = gurtd.run_done(prompt(
        "ls -A /dev",
        "echo ---",
        "ls -A /dev/pts",
        "echo ---",
        "for d in sda vda mem kmem kmsg port console loop0 loop-control fuse kvm; do "
        "test -e /dev/$d && echo visible $d; done; true",
        "head -c 8 /dev/urandom | wc -c",
        "echo gone > /dev/null && echo null works",
        "readlink /dev/ptmx /dev/fd",
        "touch /dev/gurt-test 2>&1 || true",
    ))
    out = gurtd.output(task["id"])
    cut = [i for i, line in enumerate(out) if line == "---"]
    nodes = {n for n in G.DEV_NODES if os.path.exists(os.path.join("/dev", n))}
    assert set(out[:cut[0]]) == nodes | set(G.DEV_LINKS) | {"pts", "shm"}, out
    assert out[cut[0] + 1:cut[1]] == ["ptmx"], out       # a devpts of its own: no host ptys
    rest = out[cut[1] + 1:]
    assert not [line for line in rest if line.startswith("visible")], rest
    assert rest[:4] == ["8", "null works", "pts/ptmx", "/proc/self/fd"], rest
    assert "Read-only file system" in rest[4], rest


def test_tmp_var_tmp_shm_and_home_are_one_tmpfs_of_1_gib(gurtd: Gurtd) -> None:
    put_base_file(gurtd, "home", "fs.py", "\n".join([
        "import os, sys",
        "places = ['/tmp', '/var/tmp', '/dev/shm', os.environ['HOME']]",
        "devs = {os.stat(p).st_dev for p in places}",
        "sizes = {os.statvfs(p).f_blocks * os.statvfs(p).f_frsize for p in places}",
        "before = os.statvfs('/dev/shm').f_bavail * os.statvfs('/dev/shm').f_frsize",
        "with open('/tmp/fill', 'wb') as f:",
        "    f.write(b'x' * (8 << 20))",
        "after = os.statvfs('/dev/shm').f_bavail * os.statvfs('/dev/shm').f_frsize",
        "print(len(devs), sorted(sizes), (before - after) >> 20)",
    ]) + "\n")
    task = gurtd.run_done("python3 fs.py")
    # one file system for the four, 1 GiB in all; 8 MiB written to /tmp is 8 MiB less in shm
    assert gurtd.output(task["id"]) == [f"1 [{G.DEFAULT_TMP_BYTES}] 8"]


def test_every_mount_of_the_box_is_nosuid(gurtd: Gurtd) -> None:
    task = gurtd.run_done("cat /proc/self/mountinfo")
    mounts = {}
    for line in gurtd.output(task["id"]):
        fields = line.split()
        mounts[fields[4]] = fields[5].split(",")
    for point in ("/", "/usr", "/etc", "/dev", "/dev/shm", "/dev/pts", "/proc", "/tmp",
                  "/var/tmp", f"/home/{task['user']}", "/run", VIEW, "/run/gurt/broker.sock"):
        assert "nosuid" in mounts[point], (point, mounts)
    for point, options in mounts.items():
        assert "nosuid" in options, (point, options)
        if not point.startswith("/dev/") or point in ("/dev/shm", "/dev/pts"):
            assert "nodev" in options or point == "/dev/pts", (point, options)  # pty nodes


def kernel_at_least(major: int, minor: int) -> bool:
    """The running kernel is major.minor or later (a release such as 6.12.95+deb12-amd64)."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    assert found, os.uname().release
    return (int(found[1]), int(found[2])) >= (major, minor)


def tool_mounts_held(dev: int) -> list[str]:
    """Who on the host still holds the tool client's tmpfs (device dev, gurtd.py in it): a
    mount of it in any process's namespace, or an open fd (a detached mount is in no mount
    table: only an fd keeps it)."""
    held, majmin = [], f" {os.major(dev)}:{os.minor(dev)} "
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fds: list[str] = []
        with contextlib.suppress(OSError):              # a process gone as we read
            with open(f"/proc/{pid}/mountinfo") as f:
                held += [f"mount of {pid}" for line in f if majmin in line and "gurt-tool" in line]
            fds = os.listdir(f"/proc/{pid}/fd")
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            with contextlib.suppress(OSError):          # an fd closed as we read
                if os.stat(path).st_dev == dev and os.path.exists(f"{path}/gurtd.py"):
                    held.append(f"fd {fd} of {pid}")
    return held


@pytest.mark.parametrize("way", ["as the kernel allows", "no detached clone"])
def test_the_tool_client_is_one_read_only_mount_where_the_kernel_allows_else_a_copy(
        way: str) -> None:
    """The `gurtd` command's module was a copy written at each task's start.  Now, where the
    kernel clones a detached mount into a fresh namespace (Linux 6.15+), it is the spawner's
    one read-only tmpfs bound at /run/gurt/lib; before (or forced), a copy, as it was.  Either
    way it is the same client, and the task can neither write, chmod nor remount it."""
    env = {G.NO_DETACHED_CLONE_ENV: "1"} if way == "no detached clone" else None
    bind = way == "as the kernel allows" and kernel_at_least(6, 15)
    with running_gurtd(env) as g:
        task = g.run_done(prompt(
            "grep ' /run/gurt/lib ' /proc/self/mountinfo || echo 'no mount'",
            "sha256sum /run/gurt/lib/gurtd.py",
            "stat -c %d /run/gurt/lib/gurtd.py",
            "echo x >> /run/gurt/lib/gurtd.py && echo 'wrote it' || echo 'write refused'",
            "touch /run/gurt/lib/other && echo 'made one' || echo 'make refused'",
            "chmod 777 /run/gurt/lib/gurtd.py && echo 'chmod it' || echo 'chmod refused'",
            "mount -o remount,rw /run/gurt/lib && echo 'remounted' || echo 'remount refused'",
            "gurtd --help | head -1"))
        out = g.output(task["id"])
        if bind:                            # the spawner's fd keeps it while gurtd runs
            assert tool_mounts_held(int(out[2])), out
    with open(G.__file__, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if bind:
        fields = out[0].split()
        assert fields[3] == "/" and "ro" in fields[5].split(","), out
        assert out[0].split(" - ", 1)[1].startswith("tmpfs gurt-tool ro,"), out
    else:
        assert out[0] == "no mount", out
    assert out[1].split()[0] == digest, out
    assert [line for line in out if line.endswith("refused")] == [
        "write refused", "make refused", "chmod refused", "remount refused"], out
    assert out[-1].startswith("Usage:"), out
    assert tool_mounts_held(int(out[2])) == [], out         # none on the host, after the stop


# the kernel filter ############################################################################

PROBE = r'''
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def sc(*args):
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    r = libc.syscall(*args)
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]


def clone_newuser():
    r = libc.syscall(ctypes.c_long(56), ctypes.c_long(0x10000000 | 17), 0, 0, 0, 0)
    if r == 0:
        os._exit(0)
    if r > 0:
        os.waitpid(r, 0)
        return "ok"
    return errno.errorcode[ctypes.get_errno()]


probes = {
    "unshare user": lambda: sc(272, 0x10000000),
    "unshare net": lambda: sc(272, 0x40000000),
    "unshare files": lambda: sc(272, 0x400),
    "clone newuser": clone_newuser,
    "clone3": lambda: sc(435, 0, 0),
    "setns": lambda: sc(308, -1, 0),
    "io_uring_setup": lambda: sc(425, 1, 0),
    "keyctl": lambda: sc(250, 0, -4, 1),
    "add_key": lambda: sc(248, b"user", b"gurt-test", b"v", 1, -4),
    "request_key": lambda: sc(249, b"user", b"gurt-test", 0, 0),
    "bpf": lambda: sc(321, 0, 0, 0),
    "perf_event_open": lambda: sc(298, 0, 0, -1, -1, 0),
    "userfaultfd": lambda: sc(323, 1),
    "ioctl TIOCSTI": lambda: sc(16, -1, 0x5412, 0),
    "ioctl TIOCSTI high bits": lambda: sc(16, -1, 0x100005412, 0),
    "ioctl TIOCLINUX": lambda: sc(16, -1, 0x541C, 0),
    "ioctl TCGETS": lambda: sc(16, -1, 0x5401, 0),
    "personality no aslr": lambda: sc(135, 0x40000),
    "personality query": lambda: sc(135, 0xFFFFFFFF),
    "mount": lambda: sc(165, b"none", b"/tmp", b"tmpfs", 0, 0),
    "open_tree": lambda: sc(428, -100, b"/", 1),
    "open_by_handle_at": lambda: sc(304, -1, 0, 0),
    "kexec_load": lambda: sc(246, 0, 0, 0, 0),
    "init_module": lambda: sc(175, 0, 0, b""),
    "clock_settime": lambda: sc(227, 0, 0),
    "socket vsock": lambda: sc(41, 40, 1, 0),
    "socketpair vsock": lambda: sc(53, 40, 1, 0, ctypes.create_string_buffer(8)),
    "socket unix": lambda: sc(41, 1, 1, 0),
    "ioctl FS_IOC_FSSETXATTR": lambda: sc(16, -1, 0x401C5820, 0),
    "ioctl FS_IOC_FSSETXATTR high bits": lambda: sc(16, -1, 0x1401C5820, 0),
    "ioctl FS_IOC_SETFLAGS": lambda: sc(16, -1, 0x40086602, 0),
    "ioctl FS_IOC32_SETFLAGS": lambda: sc(16, -1, 0x40046602, 0),
    "ioctl FS_IOC_FSGETXATTR": lambda: sc(16, -1, 0x801C581F, 0),
    "ioctl FS_IOC_GETFLAGS": lambda: sc(16, -1, 0x80086601, 0),
    "file_setattr": lambda: sc(469, -100, b".", 0, 0, 0),
}
for name, probe in probes.items():
    print(f"{name}: {probe()}", flush=True)
'''

# what each probe gets inside a box; the kernel alone would answer EBADF, EFAULT, EINVAL or
# success to most of them (the control, TCGETS on a bad fd, shows the filter is not blanket)
REFUSED = {
    "unshare user": "EPERM", "unshare net": "EPERM", "unshare files": "ok",
    "clone newuser": "EPERM", "clone3": "ENOSYS", "setns": "EPERM", "io_uring_setup": "EPERM",
    "keyctl": "EPERM", "add_key": "EPERM", "request_key": "EPERM", "bpf": "EPERM",
    "perf_event_open": "EPERM", "userfaultfd": "EPERM", "ioctl TIOCSTI": "EPERM",
    "ioctl TIOCSTI high bits": "EPERM", "ioctl TIOCLINUX": "EPERM", "ioctl TCGETS": "EBADF",
    "personality no aslr": "EPERM", "personality query": "ok", "mount": "EPERM",
    "open_tree": "EPERM", "open_by_handle_at": "EPERM", "kexec_load": "EPERM",
    "init_module": "EPERM", "clock_settime": "EPERM",
    "socket vsock": "EPERM", "socketpair vsock": "EPERM", "socket unix": "ok",
    "ioctl FS_IOC_FSSETXATTR": "EPERM", "ioctl FS_IOC_FSSETXATTR high bits": "EPERM",
    "ioctl FS_IOC_SETFLAGS": "EPERM", "ioctl FS_IOC32_SETFLAGS": "EPERM",
    "ioctl FS_IOC_FSGETXATTR": "EBADF", "ioctl FS_IOC_GETFLAGS": "EBADF", "file_setattr": "EPERM",
}

INT80 = r'''
import ctypes, mmap
code = bytes([0xB8, 0x14, 0, 0, 0, 0xCD, 0x80, 0xC3])       # mov eax, 20 (getpid); int 0x80; ret
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
print("int80 returned", call(), flush=True)
'''


def test_the_kernel_filter_binding_is_there_and_every_name_resolves() -> None:
    import seccomp                       # python3-seccomp, linked into the venv by make deps
    assert G.kernel_filter() is not None
    for name, _tests, err, closes in G.KERNEL_REFUSALS:
        if isinstance(name, int):       # newer than libseccomp's table: by number
            assert 0 < name < 1024, name
        else:
            assert seccomp.resolve_syscall(seccomp.Arch.X86_64, name) >= 0, name
        assert err in (errno.EPERM, errno.ENOSYS) and closes.strip(), name


def test_a_task_is_refused_the_kernels_risky_syscalls(gurtd: Gurtd) -> None:
    put_base_file(gurtd, "home", "probe.py", PROBE)
    put_base_file(gurtd, "home", "int80.py", INT80)
    task = gurtd.run_done(prompt(
        "grep -E '^Seccomp(_filters)?:' /proc/self/status",
        "python3 probe.py",
        "unshare -U true 2>&1 || true",
        "unshare -rm true 2>&1 || true",
        "setarch x86_64 -R true 2>&1 || true",
        "python3 int80.py; echo \"int80 exit $?\"",
    ))
    out = gurtd.output(task["id"])
    assert out[:2] == ["Seccomp:\t2", "Seccomp_filters:\t1"], out
    assert dict(line.split(": ", 1) for line in out[2:2 + len(REFUSED)]) == REFUSED
    rest = out[2 + len(REFUSED):]
    assert "Operation not permitted" in rest[0] and "Operation not permitted" in rest[1], rest
    assert "Operation not permitted" in rest[2], rest
    assert rest[3:] == ["int80 exit 159"], rest     # SIGSYS: a 32-bit syscall kills


def test_a_task_cannot_change_its_files_flags_or_project_but_can_read_them(gurtd: Gurtd) -> None:
    """Project quotas count a layer's files by their project id, which the kernel lets a
    file's owner change, and overlay does it with the mounter's rights: chattr (setting the
    project id, the project-inherit flag, or any flag) is refused with EPERM and the file in
    the upper layer keeps its flags and its project; lsattr (the reading ioctls) works."""
    task = gurtd.run_done(prompt(
        "mkdir d; echo x > d/f",
        "chattr -p 7 d/f 2>&1; echo \"project $?\"",
        "chattr +P d 2>&1; echo \"inherit $?\"",
        "chattr +d d/f 2>&1; echo \"nodump $?\"",
        "lsattr -p d/f; echo \"lsattr $?\"",
    ))
    out = gurtd.output(task["id"])
    assert [line.split()[-1] for line in out if line[-2:] in (" 0", " 1")] == \
        ["1", "1", "1", "0"], out
    assert sum("Operation not permitted" in line for line in out) == 3, out
    upper = os.path.join(gurtd.home, "layers", task["id"], "upper", "d")
    inside = [line for line in out if line.endswith(" d/f") and "chattr" not in line]
    for path, flag in ((os.path.join(upper, "f"), 0x40), (upper, 0x20000000)):  # d, P
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            flags = int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], sys.byteorder)
            attr = fcntl.ioctl(fd, G.FS_IOC_FSGETXATTR, bytes(28))
        finally:
            os.close(fd)
        assert not flags & flag and int.from_bytes(attr[12:16], sys.byteorder) == 0, path
    assert inside and inside[0].split()[0] == "0", out       # its project, read inside


def _in_child(fn: Callable[[], dict[str, str]]) -> dict[str, str]:
    """fn's answer, computed in a forked child of this (root) test process."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _root_probes(filtered: bool, exported: bool = False) -> dict[str, str]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def sc(*args: Any) -> str:
        res = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        return "ok" if res >= 0 else errno.errorcode[ctypes.get_errno()]

    # a private mount namespace first, so that a mount made here stays in this child
    assert libc.unshare(G.CLONE_NEWNS) == 0
    assert libc.mount(b"none", b"/", None, ctypes.c_ulong(G.MS_REC | (1 << 18)), None) == 0
    if exported:                         # as a worker loads it: the BPF exported before
        G.filter_load(G.filter_bpf())
    elif filtered:
        G.kernel_filter().load()
    bpf_attr = (ctypes.c_uint32 * 32)(2, 4, 4, 1)           # an array map of one entry
    ring = (ctypes.c_uint32 * 32)()
    perf = (ctypes.c_uint32 * 32)(1, 64)                     # software clock, ABI size 64
    return {
        "mount": sc(165, b"none", b"/mnt", b"tmpfs", 0, 0),
        "bpf": sc(321, 0, bpf_attr, ctypes.sizeof(bpf_attr)),
        "io_uring_setup": sc(425, 4, ring),
        "perf_event_open": sc(298, perf, 0, -1, -1, 0),
        "keyctl": sc(250, 0, -1, 0),
        "unshare user": sc(272, G.CLONE_NEWUSER),       # last: it leaves root's namespace
    }


def test_the_filter_refuses_even_root_what_the_kernel_would_allow() -> None:
    plain = _in_child(lambda: _root_probes(False))
    assert plain == {"mount": "ok", "unshare user": "ok", "bpf": "ok", "io_uring_setup": "ok",
                     "perf_event_open": "ok", "keyctl": "ENOKEY"}, plain
    filtered = _in_child(lambda: _root_probes(True))
    assert filtered == {name: "EPERM" for name in plain}, filtered
    exported = _in_child(lambda: _root_probes(True, exported=True))
    assert exported == filtered, exported


# what a task leaves ###########################################################################

def layer_modes(g: Gurtd, task_id: str) -> dict[str, int]:
    upper = os.path.join(g.home, "layers", task_id, "upper")
    out = {}
    for root, dirs, files in os.walk(upper):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), upper)] = st.st_mode
    return out


@pytest.fixture
def host_setuid_file() -> Any:
    """A setuid-root file on the host (in /usr, so a task sees it), removed afterwards."""
    path = f"/usr/local/bin/gurt-test-setid-{secrets.token_hex(4)}"
    shutil.copy("/usr/bin/id", path)
    os.chmod(path, 0o4755)
    try:
        yield path
    finally:
        os.remove(path)


def test_set_id_bits_never_reach_the_layer_on_disk(gurtd: Gurtd, host_setuid_file: str) -> None:
    task = gurtd.run_done(prompt(
        "cp /usr/bin/id suid-id && chmod 4755 suid-id",
        "cp /usr/bin/id sgid-id && chmod 2755 sgid-id",
        "mkdir -p deep/er && cp /usr/bin/id deep/er/both && chmod 6750 deep/er/both",
        f"ln -s {host_setuid_file} link-to-host",
        "mkfifo a-fifo",
        "stat -c '%n %a' suid-id sgid-id deep/er/both",
    ))
    # the bits were there while the task ran ...
    assert gurtd.output(task["id"]) == ["suid-id 4755", "sgid-id 2755", "deep/er/both 6750"]
    modes = layer_modes(gurtd, task["id"])
    # ... and its layer on disk keeps none of them, nor lost anything else
    assert {k: stat.S_IMODE(v) for k, v in modes.items() if stat.S_ISREG(v)} == {
        "suid-id": 0o755, "sgid-id": 0o755, "deep/er/both": 0o750}, modes
    assert stat.S_ISLNK(modes["link-to-host"]) and stat.S_ISFIFO(modes["a-fifo"])
    # the symlink was not followed: the host's setuid file is untouched
    assert stat.S_IMODE(os.stat(host_setuid_file).st_mode) == 0o4755
    with open(os.path.join(gurtd.home, "layers", task["id"], "upper", "suid-id"), "rb") as f:
        assert f.read() == Path("/usr/bin/id").read_bytes()


ENDS = {   # how a running task ends early: stopped, or gurtd killed (the next one reconciles)
    "stopped": lambda g, task_id: g.api("POST", f"/api/tasks/{task_id}/stop"),
    "kill -9": lambda g, task_id: g.restart(kill=True),
}


@pytest.mark.parametrize("end", ENDS)
def test_a_task_ended_early_leaves_a_layer_without_set_id_bits(gurtd: Gurtd, end: str) -> None:
    task = gurtd.create(prompt("cp /usr/bin/id suid-id && chmod 4755 suid-id", "sleep 30"))
    wait_for_step(gurtd, task["id"], "sleep 30")
    path = os.path.join(gurtd.home, "layers", task["id"], "upper", "suid-id")
    assert os.stat(path).st_mode & stat.S_ISUID          # it is there while the task runs
    ENDS[end](gurtd, task["id"])
    assert gurtd.wait(task["id"])["state"] == "failed"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755


def test_a_set_id_root_file_in_a_view_does_not_elevate(gurtd: Gurtd) -> None:
    put_base_file(gurtd, "home", "root-id", "")
    path = os.path.join(gurtd.home, "workspaces", "home", "root-id")
    shutil.copy("/usr/bin/id", path)
    os.chown(path, 0, 0)                # the idmap keeps root as root: the task sees 4755 root
    os.chmod(path, 0o4755)
    task = gurtd.run_done(prompt("stat -c '%a %u' root-id", "./root-id -u", "id -u"))
    out = gurtd.output(task["id"])
    assert out[0] == "4755 0", out
    assert out[1] == out[2] != "0", out


def test_a_tasks_uid_holds_no_kernel_keys_after_it(gurtd: Gurtd) -> None:
    put_base_file(gurtd, "home", "probe.py", PROBE)
    # the task waits until the test has added its keys and seen them (not 2 s, which a busy
    # machine may outlast: the task over, its keys gone, before the test looks)
    task = gurtd.create(prompt("id -u", "python3 probe.py", "sleep 30 || true"))
    wait_for_step(gurtd, task["id"], "sleep 30 || true")
    uid = int(gurtd.output(task["id"])[0])
    assert "add_key: EPERM" in gurtd.output(task["id"])       # the task cannot make keys
    # keys made for its uid from outside (as a kernel upcall or a leak could) ...
    add = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
           "libc.syscall.restype = ctypes.c_long; "
           "print(libc.syscall(248, b'user', b'gurt-test', b'v', 1, ctypes.c_long(-4)))")
    made = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           sys.executable, "-c", add], capture_output=True, text=True,
                          check=True)
    assert int(made.stdout) > 0, made
    assert uid in key_users()
    end_sleep(gurtd, task, "sleep 30")
    # ... are gone once it ends
    assert gurtd.wait(task["id"])["state"] == "done"
    eventually(lambda: uid not in key_users(), timeout=10, what=f"uid {uid} keys to go")


def test_setid_strip_never_follows_a_symlink(tmp_path: Any) -> None:
    outside = tmp_path / "outside"
    outside.write_text("x")
    outside.chmod(0o4755)
    top = tmp_path / "upper"
    (top / "d").mkdir(parents=True)
    (top / "d" / "s").write_text("y")
    (top / "d" / "s").chmod(0o6755)
    (top / "link").symlink_to(outside)
    (top / "dirlink").symlink_to(tmp_path)
    assert G.setid_strip(str(top)) == [str(top / "d" / "s")]
    assert stat.S_IMODE((top / "d" / "s").stat().st_mode) == 0o755
    assert stat.S_IMODE(outside.stat().st_mode) == 0o4755
    assert G.setid_strip(str(tmp_path / "missing")) == []


DEEP_SUID = r'''
import os
import re
fd = os.open(".", os.O_RDONLY)
for _ in range(1200):                       # one level at a time: no path gets too long
    os.mkdir("d" * 60, dir_fd=fd)
    down = os.open("d" * 60, os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = down
with open("/usr/bin/id", "rb") as src:
    out = os.open("deep-id", os.O_CREAT | os.O_WRONLY, 0o755, dir_fd=fd)
    os.write(out, src.read())
    os.fchmod(out, 0o6755)
    os.close(out)
print("planted", oct(os.stat("deep-id", dir_fd=fd).st_mode & 0o7777))
'''


def test_a_layer_too_deep_for_a_path_is_stripped_and_undone_whole(gurtd: Gurtd) -> None:
    """A task hides a set-id file 1,200 folders deep (its path is far past PATH_MAX, and
    Python's own recursion stops near 1,000): the bits are gone from the layer on disk, and
    an undo deletes the whole layer."""
    # the fake worker runs one line at a time: the script travels as one line of hex
    task = gurtd.run_done(f"python3 -c \"exec(bytes.fromhex('{DEEP_SUID.encode().hex()}'))\"")
    assert gurtd.output(task["id"]) == ["planted 0o6755"]
    upper = os.path.join(gurtd.home, "layers", task["id"], "upper")
    modes: list[int] = []
    G.tree_visit(upper, lambda fd, name, st, parents: modes.append(st.st_mode)
                 if name == "deep-id" else None)
    assert [stat.S_IMODE(m) for m in modes] == [0o755]
    undone = gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert undone["state"] == "undone", undone
    eventually(lambda: not os.path.exists(os.path.join(gurtd.home, "layers", task["id"])),
               what="the deep layer to be deleted")


def test_tree_remove_and_setid_strip_go_deeper_than_a_path(tmp_path: Any) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    os.mkdir("top", dir_fd=fd)
    for name in ["top"] + ["x" * 100] * 2500:     # 250,000 bytes of path
        if name != "top":
            os.mkdir(name, dir_fd=fd)
        down = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = down
    out = os.open("s", os.O_CREAT | os.O_WRONLY, 0o4755, dir_fd=fd)
    os.fchmod(out, 0o4755)
    os.close(out)
    os.mknod("whiteout", stat.S_IFCHR, 0, dir_fd=fd)
    os.close(fd)
    cleared = G.setid_strip(str(tmp_path / "top"))
    assert len(cleared) == 1 and cleared[0].endswith("/s") and len(cleared[0]) > 250_000
    G.tree_remove(str(tmp_path / "top"))
    assert os.listdir(tmp_path) == []
    G.tree_remove(str(tmp_path / "top"))          # idempotent
