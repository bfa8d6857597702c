"""A task is boxed in.

Each story runs real `fake`-worker tasks (one /bin/sh command per prompt line, as the task's
own user box-<id>) that try to get out: read the token, peek at another task, write the base,
become root, call gurtd's API, keep a process running after the end.  None of it works.

Probe lines end in `; true` (or `|| ...`) so that a refused probe does not end the task early:
the task finishes and its whole log can be searched for what must not be there.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import gurtd as gurtd_module
from conftest import (ROOT, VIEW, Gurtd, end_sleep, processes_of_uid, prompt, put_base_file,
                      running_gurtd, wait_for_step)

SUID_COPY = "/usr/local/bin/gurt-test-suid-id"
ZERO = "0000000000000000"


# helpers ######################################################################################

def log_blob(g: Gurtd, task_id: str) -> str:
    """Everything the task's log holds, as one string to search."""
    data = g.api("GET", f"/api/tasks/{task_id}/log", status=200)
    return data.decode(errors="replace")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def account_names(path: str) -> set[str]:
    with open(path) as f:
        return {line.split(":", 1)[0] for line in f if line.strip()}


# the token and BOX_HOME #######################################################################

@pytest.fixture(params=["/var/tmp", "/var/lib"], ids=["box-home-in-var-tmp", "box-home-in-var-lib"])
def any_gurtd(request: pytest.FixtureRequest) -> Iterator[Gurtd]:
    """A gurtd whose BOX_HOME is under /var/tmp (where the fixtures put it; every box has its
    own /var/tmp anyway) or under /var/lib, as in production: the box's root is built from
    nothing and has no /var/lib at all."""
    parent = tempfile.mkdtemp(prefix="gurt-test-", dir=request.param)
    os.chmod(parent, 0o755)
    with running_gurtd(home=os.path.join(parent, "box")) as g:
        yield g


def test_a_task_cannot_read_the_token_or_look_into_box_home(any_gurtd: Gurtd) -> None:
    g = any_gurtd
    home = g.home
    assert os.path.exists(os.path.join(home, "token"))
    other = "other-" + secrets.token_hex(8)         # a file of another workspace's base
    g.api("POST", "/api/workspaces", {"name": "other"}, status=201)
    put_base_file(g, "other", "secret.txt", other + "\n")
    os.chmod(os.path.join(home, "workspaces", "other", "secret.txt"), 0o644)
    earlier = g.run_done("echo an earlier task")
    task = g.run_done(prompt(
        f"cat {home}/token || echo 'token: refused'",
        f"ls -la {home} || echo 'box home: refused'",
        f"ls -la {home}/tasks {home}/logs {home}/layers {home}/workspaces; true",
        f"cat {home}/tasks/{earlier['id']}.json {home}/state.json {home}/settings.json; true",
        f"ls -la {home}/workspaces/other; cat {home}/workspaces/other/secret.txt; true",
        f"ls -la {home}/layers/{earlier['id']}/upper; true",
        "env",
        "tr '\\0' '\\n' < /proc/self/environ",
        "cat /proc/*/environ /proc/*/cmdline; true",
        # a user namespace of its own gives mount powers, but not over the box's mounts
        f'unshare -rm sh -c "umount -l {home}; umount -l /var/tmp; cat {home}/token"; true',
        f'unshare -rm sh -c "mkdir /tmp/r && mount --rbind / /tmp/r && '
        f'umount -l /tmp/r{home}; cat /tmp/r{home}/token; ls /tmp/r{home}"; true',
        "echo probed",
    ))
    blob = log_blob(g, task["id"])
    assert g.token not in blob
    assert other not in blob
    out = g.output(task["id"], "stdout")
    assert "token: refused" in out and "box home: refused" in out, out
    assert "probed" in out
    errors = g.output(task["id"], "stderr")
    refused = ("Permission denied", "No such file or directory")
    for path in (f"{home}/token", f"'{home}'"):
        assert [e for e in errors if path in e and e.endswith(refused)], (path, errors)
    # nothing of BOX_HOME was listed or read
    for line in out:
        assert not re.search(r"\btoken$|state\.json|settings\.json|\.jsonl?\b|secret\.txt",
                             line), line
        assert earlier["id"] not in line, line


# other tasks ##################################################################################

def test_a_task_cannot_see_another_running_tasks_view(gurtd: Gurtd) -> None:
    home = gurtd.home
    marker = "gurt-view-secret-" + secrets.token_hex(8)
    a = gurtd.create(prompt(f"echo {marker} > a-marker.txt", "sleep 3"), title="task A")
    wait_for_step(gurtd, a["id"], "sleep 3")
    pids = gurtd.worker_pids(a)
    assert pids, "task A has no processes"
    each = " ".join(str(p) for p in pids)
    b = gurtd.run_done(prompt(
        f"for p in {each}; do ls -la /proc/$p/root/ /proc/$p/root{VIEW}/ /proc/$p/cwd/; done; true",
        f"for p in {each}; do cat /proc/$p/root{VIEW}/a-marker.txt /proc/$p/cwd/a-marker.txt; done;"
        " true",
        f"for p in {each}; do cat /proc/$p/environ /proc/$p/mountinfo; done; true",
        f"ls -la {VIEW}; cat {VIEW}/a-marker.txt; true",
        f"ls -la {home}/layers/{a['id']}/upper; true",
        f"cat {home}/layers/{a['id']}/upper/a-marker.txt; true",
        f"cat {home}/workspaces/home/a-marker.txt; true",
        f"ls /proc/*/root{VIEW}/; true",
        f"cat /proc/*/root{VIEW}/a-marker.txt /proc/*/cwd/a-marker.txt; true",
        "grep -rs gurt-view-secret- /run /tmp /var/tmp /home /dev/shm; true",
        f"find /run /tmp /var/tmp /home /root /dev/shm {home} -name a-marker.txt 2>/dev/null; true",
        "echo probed",
    ), title="task B")
    assert gurtd.task(a["id"])["state"] == "running", "task A ended before B had looked"
    assert marker not in log_blob(gurtd, b["id"])
    out = gurtd.output(b["id"], "stdout")
    assert "probed" in out
    assert not [line for line in out if "a-marker.txt" in line], out
    errors = "\n".join(gurtd.output(b["id"], "stderr"))
    for pid in pids:
        assert f"/proc/{pid}/root/" in errors, f"B could list /proc/{pid}/root"
    # the marker was real: A's layer holds it, and once A is done people see it
    assert gurtd.wait(a["id"])["state"] == "done"
    with open(os.path.join(home, "layers", a["id"], "upper", "a-marker.txt")) as f:
        assert f.read() == marker + "\n"
    assert gurtd.file("home", "a-marker.txt") == (marker + "\n").encode()


def test_a_task_cannot_see_or_kill_another_tasks_processes(gurtd: Gurtd) -> None:
    a = gurtd.create(prompt("sleep 3"), title="task A")
    wait_for_step(gurtd, a["id"], "sleep 3")
    deadline = time.monotonic() + 10     # the step is reported just before its shell forks
    while True:
        pids = gurtd.worker_pids(a)
        if any(cmdline(p) == "sleep 3" for p in pids):
            break
        assert time.monotonic() < deadline, [cmdline(p) for p in pids]
        time.sleep(0.005)
    b = gurtd.run_done(prompt(
        "ps ax -o pid=,user:32=,args=",
        "echo ---",
        "ls /proc",
        f"kill -9 {' '.join(map(str, pids))}; true",
    ), title="task B")
    out = gurtd.output(b["id"], "stdout")
    ps_lines, ls_lines = out[:out.index("---")], out[out.index("---") + 1:]
    seen = {int(line.split()[0]) for line in ps_lines if line.split()}
    seen |= {int(name) for name in ls_lines if name.isdigit()}
    assert any("ps ax" in line for line in ps_lines), ps_lines    # ps works: it sees B itself
    assert not seen & set(pids), (seen & set(pids), ps_lines)
    assert not [line for line in ps_lines if a["user"] in line or "sleep 3" in line], ps_lines
    assert gurtd.task(a["id"])["state"] == "running", "task A ended before B had looked"
    assert gurtd.wait(a["id"])["state"] == "done", "B's kill reached task A"


def test_tmp_and_home_are_private_to_each_running_task(gurtd: Gurtd) -> None:
    secret = "gurt-tmp-secret-" + secrets.token_hex(8)
    host_secret = "gurt-host-tmp-" + secrets.token_hex(8)
    host_file = f"/tmp/gurt-test-host-{secrets.token_hex(4)}"
    a_name = f"a-secret-{secrets.token_hex(4)}"
    Path(host_file).write_text(host_secret + "\n")
    try:
        a = gurtd.create(prompt(
            f"echo {secret} > /tmp/{a_name}",
            f'echo {secret} > "$HOME/{a_name}"',
            f"echo {secret} > /dev/shm/{a_name}",
            f"echo {secret} > /var/tmp/{a_name}",
            "sleep 3",
        ), title="task A")
        wait_for_step(gurtd, a["id"], "sleep 3")
        b = gurtd.run_done(prompt(
            "ls -la /tmp /dev/shm /var/tmp /home; true",
            f"cat /tmp/{a_name} /dev/shm/{a_name} /var/tmp/{a_name}; true",
            f"cat /home/{a['user']}/{a_name}; true",
            "cat /tmp/gurt-test-host-*; true",
            "echo b-was-here > /tmp/b-file",
            "cat /tmp/b-file",
            'echo "$HOME"',
            "ls -A /home",
        ), title="task B")
        assert gurtd.task(a["id"])["state"] == "running", "task A ended before B had looked"
        blob = log_blob(gurtd, b["id"])
        assert secret not in blob
        assert host_secret not in blob
        out = gurtd.output(b["id"], "stdout")
        assert not [line for line in out if a_name in line or "gurt-test-host" in line], out
        assert "b-was-here" in out
        assert out[-2:] == [f"/home/{b['user']}", b["user"]], out
        assert gurtd.wait(a["id"])["state"] == "done"
        assert not os.path.exists(f"/tmp/{a_name}")          # nor did A write the host's /tmp
        assert not os.path.exists(f"/var/tmp/{a_name}")
    finally:
        os.remove(host_file)


def test_home_is_a_private_writable_directory(gurtd: Gurtd) -> None:
    task = gurtd.run_done(prompt(
        'echo "home=$HOME"',
        'stat -c "%U %a" "$HOME"',
        'echo a note > "$HOME/note.txt"',
        'cat "$HOME/note.txt"',
        "ls -A /home",
        "echo tmp > /tmp/t && cat /tmp/t",
    ))
    assert gurtd.output(task["id"]) == [
        f"home=/home/{task['user']}", f"{task['user']} 700", "a note", task["user"], "tmp"]


# the base #####################################################################################

def base_state(g: Gurtd, workspace: str = "home") -> dict[str, tuple[Any, ...]]:
    base = os.path.join(g.home, "workspaces", workspace)
    out: dict[str, tuple[Any, ...]] = {}
    for root, dirs, files in os.walk(base):
        for name in dirs + files + ["."]:
            path = os.path.normpath(os.path.join(root, name))
            st = os.lstat(path)
            content = open(path, "rb").read() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(path, base)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns,
                                                content)
    return out


def test_a_task_edits_its_own_layer_never_the_base(gurtd: Gurtd) -> None:
    put_base_file(gurtd, "home", "notes.txt", "original\n")
    put_base_file(gurtd, "home", "keep.txt", "keep me\n")
    put_base_file(gurtd, "home", "dir/inner.txt", "inner\n")
    before = base_state(gurtd)
    task = gurtd.run_done(prompt(
        "echo changed > notes.txt",
        "rm keep.txt",
        "echo new > added.txt",
        "rm -r dir",
        "chmod 777 . && touch -d 2001-01-01 notes.txt",
        f"echo sneaky > {gurtd.home}/workspaces/home/notes.txt || echo 'base: refused'",
        "ls -A",
    ))
    assert gurtd.output(task["id"]) == ["base: refused", "added.txt", "notes.txt"]
    assert base_state(gurtd) == before, "the task changed the base on disk"
    # the edits are in the task's layer
    upper = os.path.join(gurtd.home, "layers", task["id"], "upper")
    assert Path(upper, "notes.txt").read_text() == "changed\n"
    assert Path(upper, "added.txt").read_text() == "new\n"
    for gone in ("keep.txt", "dir"):
        st = os.lstat(os.path.join(upper, gone))
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0, f"{gone} is not a whiteout"
    changes = gurtd.api("GET", f"/api/tasks/{task['id']}/changes")
    assert {(c["path"], c["change"]) for c in changes} >= {
        ("notes.txt", "modified"), ("added.txt", "added"), ("keep.txt", "deleted"),
        ("dir", "deleted")}, changes
    # people see the layer on top of the base; undo takes it away again
    assert gurtd.file("home", "notes.txt") == b"changed\n"
    assert gurtd.file("home", "keep.txt") is None
    gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert gurtd.file("home", "notes.txt") == b"original\n"
    assert gurtd.file("home", "keep.txt") == b"keep me\n"
    assert gurtd.file("home", "added.txt") is None
    assert base_state(gurtd) == before


# privileges ###################################################################################

def test_a_setuid_root_binary_does_not_make_a_task_root(gurtd: Gurtd) -> None:
    shutil.copy("/usr/bin/id", SUID_COPY)
    try:
        os.chown(SUID_COPY, 0, 0)
        os.chmod(SUID_COPY, 0o4755)
        # outside a box the copy really is a way to root: a plain user running it gets euid 0
        nobody = pwd.getpwnam("nobody")
        plain = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}",
                                f"--regid={nobody.pw_gid}", "--clear-groups", SUID_COPY],
                               capture_output=True, text=True, check=True).stdout
        assert "euid=0" in plain, plain
        task = gurtd.run_done(prompt(
            f"stat -c '%a %U' {SUID_COPY}",
            "id -u",
            f"{SUID_COPY}",
            f"{SUID_COPY} -u",
            f"{SUID_COPY} -ru",
        ))
        out = gurtd.output(task["id"])
        assert out[0] == "4755 root", out          # the bit is there, inside the box too
        uid = out[1]
        assert uid != "0"
        assert not re.search(r"\b(e?uid)=0\b", "\n".join(out)), out
        assert out[3:] == [uid, uid], out
    finally:
        os.remove(SUID_COPY)


def test_a_task_has_no_capabilities_and_no_new_privileges(gurtd: Gurtd) -> None:
    task = gurtd.run_done("grep -E '^(Cap|NoNewPrivs)' /proc/self/status")
    fields = dict(line.split(":\t", 1) for line in gurtd.output(task["id"]))
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert fields[cap] == ZERO, fields
    assert fields["NoNewPrivs"] == "1", fields


# what a prompt line's command is given ##########################################################

OPEN_FDS = ("import os; print('open', *[fd for fd in range(4096) "
            "if os.path.exists(f'/proc/self/fd/{fd}')])")


def test_a_lines_command_gets_dev_null_its_pipes_and_no_other_fd(gurtd: Gurtd) -> None:
    """A command of a prompt line has /dev/null as its stdin, its output pipes as 1 and 2, and
    no other fd: none of the worker's (spec, log pipe, view, broker, module)."""
    task = gurtd.run_done(prompt(f"python3 -c \"{OPEN_FDS}\"", "readlink /proc/self/fd/0",
                                 "echo to-stderr >&2"))
    assert gurtd.output(task["id"]) == ["open 0 1 2", "/dev/null"]
    assert gurtd.output(task["id"], "stderr") == ["to-stderr"]


RUN_LINE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import gurtd as G
leak = os.open("/dev/null", os.O_RDONLY)
os.set_inheritable(leak, True)          # an fd of the worker's that is not close-on-exec
r, w = os.pipe()
codes = [G._run_line([sys.executable, "-c", sys.argv[2]], {}, w),
         G._run_line(["/bin/sh", "-c", "echo out; echo err >&2; kill -KILL $$"], {}, w),
         G._run_line(["/bin/sh", "-c", "kill -TERM $$"], {}, w),
         G._run_line(["/nonexistent/command"], {}, w),
         G._run_line(["/bin/sh", "-c", "exit 5"], {}, w)]
os.close(w)
print(json.dumps({"codes": codes, "leak": leak, "lines": os.read(r, 65536).decode()}))
"""


def test_run_line_gives_no_fd_of_the_worker_and_128_plus_a_signal(tmp_path: Any) -> None:
    """_run_line itself, in a process holding an inheritable fd: the command does not see it;
    an exit by signal N is 128+N, a command that cannot be run 127, an exit code itself; the
    output comes back as lines of the worker's log."""
    proc = subprocess.run([sys.executable, "-c", RUN_LINE, ROOT, OPEN_FDS], capture_output=True,
                          text=True, timeout=60, check=True)
    got = json.loads(proc.stdout)
    assert got["leak"] > 2
    assert got["codes"] == [0, 128 + 9, 128 + 15, 127, 5], got
    lines = [json.loads(line) for line in got["lines"].splitlines()]
    assert lines == [{"t": "out", "text": "open 0 1 2"}, {"t": "out", "text": "out"},
                     {"t": "err", "text": "err"},
                     {"t": "err", "text": "/nonexistent/command: No such file or directory"}], lines



NO_PROCESS = """
import os, resource, sys
sys.path.insert(0, sys.argv[1])
import gurtd as G
alive_r, alive_w = os.pipe()
holder = os.fork()                  # one process of nobody's, so that nobody is over 0
if holder == 0:                     # it ends when this script does, however that ends
    os.close(alive_w)
    os.closerange(0, alive_r)
    os.setresuid(65534, 65534, 65534)
    os.read(alive_r, 1)
    os._exit(0)
G.filter_load(G.filter_bpf())       # the worker's: clone3 is ENOSYS, glibc falls back to clone
r, w = os.pipe()
missing = G._run_line(["/nonexistent/command"], {}, w)
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
got = []
for _ in range(3):    # nobody's real uid, root's euid: the clone is allowed (capabilities),
    os.setresuid(0, 0, 0)           # the exec refused with EAGAIN (over RLIMIT_NPROC)
    os.setresuid(65534, 0, 0)
    got.append(G._run_line(["/bin/true"], {}, w))
os.setresuid(0, 0, 0)
os.close(alive_w)
os.waitpid(holder, 0)
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)   # now no clone either: nobody may have no process more
try:
    G._run_line(["/bin/true"], {}, w)
except OSError as exc:
    os.close(w)
    lines = os.read(r, 65536).decode().splitlines()
    print(missing, *got, exc.errno, lines[-1])
"""


def test_a_line_that_gets_no_process_is_the_workers_error_not_the_commands(tmp_path: Any) -> None:
    """A clone refused (EAGAIN: no process more for the uid) is the worker's error, raised,
    as a fork of it was, where an exec that fails is the command's 127, its errno its error
    line: the exec's EAGAIN too (over RLIMIT_NPROC: raised as the worker's on the old code),
    under the worker's filter, where glibc's posix_spawn clones by clone, not clone3."""
    proc = subprocess.run([sys.executable, "-c", NO_PROCESS, ROOT], capture_output=True,
                          text=True, timeout=60, check=True)
    *codes, line = proc.stdout.split(maxsplit=5)
    assert codes == ["127", "127", "127", "127", str(errno.EAGAIN)], proc
    assert json.loads(line) == {"t": "err", "text": f"/bin/true: {os.strerror(errno.EAGAIN)}"}


IDMAP = """
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
import gurtd as G
threading.Thread(target=threading.Event().wait, daemon=True).start()   # as in gurtd: threads
fd = G._idmap_userns("0 0 1\\n1000 600123 1\\n", "0 0 1\\n1000 600124 1\\n")
children = open(f"/proc/self/task/{os.getpid()}/children").read().split()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    G.libc_call("setns", fd, G.CLONE_NEWUSER)
    maps = [open(f"/proc/self/{m}").read().split() for m in ("uid_map", "gid_map")]
    os.write(w, json.dumps(maps).encode())
    os._exit(0)
os.close(w)
print(json.dumps({"children": children, "maps": json.loads(os.read(r, 4096)),
                  "ns": os.readlink(f"/proc/self/fd/{fd}") != os.readlink("/proc/self/ns/user")}))
os.waitpid(pid, 0)
"""


def test_an_idmap_namespace_has_its_maps_and_leaves_no_process() -> None:
    """_idmap_userns (no fork: a clone of libc's _exit whose zombie holds the namespace while
    its maps are written): a namespace of its own with exactly the maps asked, its child
    reaped, in a process with threads as gurtd is."""
    proc = subprocess.run([sys.executable, "-c", IDMAP, ROOT], capture_output=True, text=True,
                          timeout=60, check=True)
    got = json.loads(proc.stdout)
    assert got == {"children": [], "ns": True, "maps": [["0", "0", "1", "1000", "600123", "1"],
                                                        ["0", "0", "1", "1000", "600124", "1"]]}


# network ######################################################################################

def test_a_task_cannot_reach_gurtds_api(gurtd: Gurtd) -> None:
    port = gurtd.port
    status, data, _ = gurtd.request("GET", "/api/health", token=False)
    assert status == 200 and data["ok"] is True      # it is there, for the host
    task = gurtd.run_done(prompt(
        f'curl -s --max-time 2 http://127.0.0.1:{port}/api/health; echo " curl exit $?"',
        "python3 -c 'import socket; s = socket.socket(); "
        f"print(\"connect\", s.connect_ex((\"127.0.0.1\", {port})))'",
    ))
    out = gurtd.output(task["id"])
    curl = [line for line in out if "curl exit" in line]
    assert len(curl) == 1, out
    assert re.fullmatch(r" curl exit [1-9]\d*", curl[0]), out
    assert not [line for line in out if "ok" in line], out
    assert "connect 111" in out, out                   # ECONNREFUSED
    assert '"ok"' not in log_blob(gurtd, task["id"])


def test_a_task_sees_no_network_interface_but_lo(gurtd: Gurtd) -> None:
    task = gurtd.run_done(prompt("cat /proc/net/dev", "echo ---", "ip -o link", "echo ---",
                                 "ls /sys/class/net || echo 'no sysfs'"))
    out = gurtd.output(task["id"])
    first, second = out.index("---"), len(out) - 1 - out[::-1].index("---")
    dev = {line.split(":")[0].strip() for line in out[2:first]}
    links = {line.split(":")[1].strip() for line in out[first + 1:second]}
    sys_names = set(out[second + 1:])
    assert dev == {"lo"}, out
    assert links == {"lo"}, out
    assert sys_names == {"no sysfs"}, out       # the box has no /sys: not even lo's name there


# the host's own files #########################################################################

def test_a_task_cannot_read_root_or_home_of_the_host(gurtd: Gurtd) -> None:
    secret = "gurt-host-secret-" + secrets.token_hex(8)
    markers = ["/root/gurt-test-marker", "/home/gurt-test-marker"]
    host_home = sorted(os.listdir("/home"))
    try:
        for path in markers:
            Path(path).write_text(secret + "\n")
            os.chmod(path, 0o644)
        task = gurtd.run_done(prompt(
            "cat /root/gurt-test-marker; true",
            "cat /home/gurt-test-marker; true",
            "ls -la /root; true",
            "ls -A /home",
            "grep -rs gurt-host-secret- /root /home; true",
        ))
        assert secret not in log_blob(gurtd, task["id"])
        out = gurtd.output(task["id"])
        assert not [line for line in out if "gurt-test-marker" in line], out
        assert out[-1:] == [task["user"]], out                  # /home holds only its own
        assert not set(host_home) & set(out), out
        errors = gurtd.output(task["id"], "stderr")         # and /root does not exist
        assert "ls: cannot access '/root': No such file or directory" in errors, errors
    finally:
        for path in markers:
            if os.path.exists(path):
                os.remove(path)


# the end of a task ############################################################################

ENDINGS = {   # how the task ends: its last prompt line, what the test does, its final state
    "finishes": ("sleep 30 || true", None, "done"),   # its sleep ended once the test has seen
    "fails": ("sleep 30; exit 3", None, "failed"),    # the others start (not 6 s: a busy machine)
    "is stopped": ("sleep 30", "stop", "failed"),
    "is undone while running": ("sleep 30", "undo", "undone"),
}


@pytest.mark.parametrize("ending", ENDINGS, ids=ENDINGS.keys())
def test_nothing_of_a_task_outlives_it(gurtd: Gurtd, ending: str) -> None:
    last, action, final = ENDINGS[ending]
    task = gurtd.create(prompt(
        "id -u",
        "sleep 300 &",
        "nohup sleep 301 > /dev/null 2>&1 &",
        "setsid sleep 302 &",
        "(sleep 303 &)",
        last,
    ))
    wait_for_step(gurtd, task["id"], last)
    uid = int(gurtd.output(task["id"])[0])
    assert uid != 0
    wanted = {"sleep 300", "sleep 301", "sleep 302", "sleep 303"}
    deadline = time.monotonic() + 5           # a loaded machine: the subshell's exec may lag
    while not wanted <= (running := {cmdline(p) for p in processes_of_uid(uid)}) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert wanted <= running, running
    assert task["user"] in account_names("/etc/passwd")
    if action:
        gurtd.api("POST", f"/api/tasks/{task['id']}/{action}")
    else:
        end_sleep(gurtd, task, "sleep 30")
    assert gurtd.wait(task["id"])["state"] == final
    left = {p: cmdline(p) for p in processes_of_uid(uid)}
    assert left == {}, f"processes of {task['user']} outlived it: {left}"
    assert gurtd_module.processes_by_uid({uid}) == {}
    for path in ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow"):
        assert task["user"] not in account_names(path), path
    with open("/etc/passwd") as f:
        assert not [line for line in f if line.split(":")[2:3] == [str(uid)]]


# what the box's mounts say ####################################################################

def task_mounts(way: str, folder: str) -> tuple[Gurtd, list[str]]:
    """The lines of /proc/self/mountinfo in a personal task on folder, with the given way of
    mounting overlays, and its gurtd (stopped by then: its BOX_HOME path is what counts)."""
    env = {gurtd_module.OVERLAY_API_ENV: "legacy"} if way == "legacy" else \
        {gurtd_module.NO_DETACHED_CLONE_ENV: "1"} if way == "no detached clone" else None
    with running_gurtd(env) as g:
        task = g.run_done(prompt("cat /proc/self/mountinfo", "gurtd --help | head -1"),
                          folder=folder)
        lines = g.output(task["id"])
    assert lines[-1].startswith("Usage:"), lines          # the tool client is there
    mounts = lines[:-1]
    assert len(mounts) > 10 and any(" /run/gurt/view " in m for m in mounts), mounts
    return g, mounts


@pytest.mark.parametrize("way", ["fd", "legacy"])
def test_the_tasks_mountinfo_names_no_checkout_and_no_folder_as_a_source(
        way: str, owner_folder: str) -> None:
    """/proc/self/mountinfo inside a task named the checkout's gurtd.py (the tool client was a
    bind of it).  Now the client is a copy in the box's /run, and no mount's source (its root
    in its file system, its options) names the checkout or the owner's folder; the folder
    appears only as the mount point where the task works on it.  Either way of mounting."""
    checkout = os.path.dirname(os.path.abspath(gurtd_module.__file__))
    _, mounts = task_mounts(way, owner_folder)
    assert not [m for m in mounts if checkout in m], mounts
    sources = [m.split()[3] + " " + m.split(" - ", 1)[1] for m in mounts]
    assert not [s for s in sources if owner_folder in s or "/home/" in s], sources
    assert [m for m in mounts if m.split()[4] == owner_folder], mounts


@pytest.mark.parametrize("way", ["fd", "legacy", "no detached clone"])
def test_the_tasks_mountinfo_names_no_box_home(way: str, owner_folder: str) -> None:
    """Nor does any line name BOX_HOME or the folder it is in, either way of mounting (the
    legacy one is what kernels before 6.15 take), nor where the kernel cannot clone a detached
    mount (before 6.15, forced here): the broker socket is bound from a tmpfs of gurtd's
    (Broker.mount), its line `/broker.sock` on it; before, a private root on a kernel before
    6.15 bound the one in BOX_HOME/run (this test's third way failed so)."""
    g, mounts = task_mounts(way, owner_folder)
    for needle in (g.home, os.path.dirname(g.home)):
        assert not [m for m in mounts if needle in m], (needle, mounts)
    broker = [m for m in mounts if m.split()[4] == "/run/gurt/broker.sock"]
    assert len(broker) == 1 and broker[0].split()[3] == "/broker.sock", mounts
    assert broker[0].split(" - ", 1)[1].startswith("tmpfs gurt "), broker


def mounts_at(point: str) -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4] == point)


def test_the_broker_tmpfs_an_old_kernel_attaches_goes_at_stop_and_after_a_kill() -> None:
    """Where the root is private and the kernel cannot clone a detached mount (forced), the
    tasks' broker tmpfs is attached at BOX_HOME/run/tasks in gurtd's namespace: one mount there
    while gurtd runs, a kill -9's swept at the next start (not stacked), none after a stop."""
    attached = 0 if gurtd_module.root_shared() else 1       # shared: the spawner's namespace
    with running_gurtd({gurtd_module.NO_DETACHED_CLONE_ENV: "1"}) as g:
        point = os.path.join(g.home, "run", "tasks")
        assert mounts_at(point) == attached
        g.restart(kill=True)
        assert mounts_at(point) == attached
        task = g.run_done(prompt("ls -l /run/gurt/broker.sock"))
        assert g.output(task["id"])[0].startswith("srw"), g.output(task["id"])
    assert mounts_at(point) == 0
