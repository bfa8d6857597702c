"""The packaging: the systemd unit verifies, the OpenAPI description covers every route."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, unit_bounding_set

import gurtd as G


def test_the_unit_file_verifies_clean(tmp_path):
    # ExecStart must name an existing program for systemd-analyze, so point it at this checkout.
    unit = Path(ROOT, "gurtd.service").read_text()
    assert "Type=notify" in unit and "Restart=on-failure" in unit
    assert re.search(r"^ExecStart=/usr/local/bin/gurtd serve$", unit, re.M)
    unit = unit.replace("ExecStart=/usr/local/bin/gurtd",
                        f"ExecStart={sys.executable} {os.path.join(ROOT, 'gurtd.py')}")
    path = tmp_path / "gurtd.service"
    path.write_text(unit)
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out


def test_every_directive_of_the_unit_says_why():
    lines = Path(ROOT, "gurtd.service").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith(("#", "[")) and "=" in line:
            before = [x for x in lines[:i] if x.strip()]
            assert before and (before[-1].startswith("#") or "=" in before[-1]
                               or before[-1].startswith("[")), line


def test_the_openapi_description_has_exactly_the_routes(gurtd):
    doc = gurtd.api("GET", "/api/openapi.json")
    assert doc["openapi"].startswith("3.1")
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routed = {(r.method, r.path) for r in G.ROUTES}
    assert described == routed
    task = doc["components"]["schemas"]["Task"]
    for field in ("title", "prompt", "workspace", "worker", "tools", "hosts", "budgetCents",
                  "source", "id", "state", "user", "layers", "costCents", "createdAt",
                  "updatedAt"):
        assert field in task["required"], field
    assert task["properties"]["state"]["enum"] == list(G.STATES)


def test_health_needs_no_token_and_nothing_else_is_open(gurtd):
    code, body, _ = gurtd.request("GET", "/api/health", token=False)
    assert code == 200 and body["ok"] is True
    opened = {(r.method, r.path) for r in G.ROUTES if r.open}    # the hook's is signed
    assert opened == {("GET", "/api/health"), ("GET", "/"), ("POST", "/api/sessions"),
                      ("GET", "/api/sessions/current"), ("POST", "/api/hooks/{name}")}
    for route in G.ROUTES:
        method, pattern = route.method, route.path
        if route.open and pattern != "/api/hooks/{name}":
            continue
        if (method, pattern) == ("POST", "/api/hooks/{name}"):   # signed, not token-held:
            code, body, _ = gurtd.request(method, "/api/hooks/home", token=False)
            assert code == 401 and body["code"] == "bad_signature", body
            continue
        path = pattern.replace("{id}", "t000000000").replace("{name}", "home") \
            .replace("{path}", "x")
        code, body, _ = gurtd.request(method, path, token=False)
        assert code == 401 and body["code"] == "unauthorized", (method, path, code, body)


def test_make_install_and_the_readme_agree():
    readme = Path(ROOT, "README.md").read_text()
    first_block = readme.split("```sh", 1)[1].split("```", 1)[0]
    assert re.search(r"^make run ", first_block, re.M) and \
        re.search(r"^make test ", first_block, re.M), first_block   # as root: no sudo assumed
    for pattern in (r.path for r in G.ROUTES):
        forms = {pattern, pattern.replace("{id}", "$ID"), pattern.replace("{id}", "$AP"),
                 pattern.replace("/{path}", "/")}
        assert any(form in readme for form in forms), pattern
    assert "make test" in Path(ROOT, ".ci", "run").read_text()


# The unit's system call filter, watchdog and status (issue 12) ###############################

def unit_lines(key: str) -> list[str]:
    with open(os.path.join(ROOT, "gurtd.service")) as f:
        return [line.split("=", 1)[1] for line in f.read().splitlines()
                if line.startswith(key + "=")]


def syscall_groups() -> dict[str, list[str]]:
    """systemd's own syscall groups (systemd-analyze syscall-filter), as it expands them."""
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True,
                         check=True).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = line.strip()
            groups[current] = []
        elif current and line.strip() and not line.strip().startswith("#"):
            groups[current].append(line.strip())
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        out |= expand(groups[name], groups) if name.startswith("@") else {name}
    return out


def unit_allowed() -> tuple[set[str], set[str]]:
    """(what the unit's SystemCallFilter allows, every syscall systemd knows), native only."""
    import seccomp
    groups = syscall_groups()
    assert all(not line.startswith("~") for line in unit_lines("SystemCallFilter"))
    allowed = expand([n for line in unit_lines("SystemCallFilter") for n in line.split()], groups)
    native = {n for n in expand(["@known"], groups)
              if seccomp.resolve_syscall(seccomp.Arch.NATIVE, n) >= 0}
    return allowed & native, native


def gurtd_own_syscalls() -> set[str]:
    """What gurtd.py calls by name (syscall("x", ...), libc_call("x", ...)) and through os."""
    source = Path(ROOT, "gurtd.py").read_text()
    called = set(re.findall(r'(?:syscall|libc_call)\("([a-z_0-9]+)', source))
    called.discard("lckpwdf")          # a libc function (a lock file), not a system call
    return called | {"seccomp", "setgroups", "setresuid", "setresgid", "setrlimit", "prlimit64",
                     "kill", "clone", "fchownat", "chown", "pidfd_open", "wait4"}


def test_the_syscall_filter_keeps_what_gurtd_and_every_worker_may_call():
    allowed, native = unit_allowed()
    assert gurtd_own_syscalls() - allowed == set()
    # A worker may call anything its kernel filter does not refuse outright: the unit may cut
    # only what that filter refuses, what ProtectClock= refuses, or what this kernel lacks.
    refused_for_workers = {name for name, tests, _, _ in G.KERNEL_REFUSALS if not tests}
    clock = expand(["@clock"], syscall_groups()) if unit_lines("ProtectClock") == ["yes"] \
        else set()
    cut = native - allowed - refused_for_workers - clock
    probe = ("import ctypes, sys, seccomp\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "for name in sys.argv[1:]:\n"
             "    nr = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)\n"
             "    if libc.syscall(nr, 0, 0, 0, 0, 0, 0) != -1 or ctypes.get_errno() != 38:\n"
             "        print(name)\n")
    # only calls that refusing cannot cover are probed, and only in a child process
    out = subprocess.run([sys.executable, "-c", probe, *sorted(cut)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "", \
        f"the unit refuses what a worker may call: {out.stdout.split()} {out.stderr}"
    # and what it refuses on purpose stays refused
    for name in ("bpf", "perf_event_open", "init_module", "reboot", "kexec_load", "swapon",
                 "iopl", "settimeofday", "acct", "open_by_handle_at"):
        assert name not in allowed, name


def test_the_unit_scores_5_or_less_and_keeps_its_promises(tmp_path):
    unit = (tmp_path / "gurtd.service")
    unit.write_text(Path(ROOT, "gurtd.service").read_text())
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                         capture_output=True, text=True)
    score = float(re.search(r"Overall exposure level for gurtd.service: ([\d.]+)",
                            out.stdout).group(1))
    assert score <= 5.0, out.stdout[-3000:]
    assert int(unit_lines("LimitNOFILE")[0]) >= 8192
    assert unit_lines("WatchdogSec") and unit_lines("StateDirectory") == ["gurt"]
    assert any("README" in d or "readme" in d for d in unit_lines("Documentation"))
    assert "/run" not in " ".join(unit_lines("ReadWritePaths")).split()


def seccomp_sitecustomize(tmp_path, allowed: set[str], native: set[str]) -> str:
    """A sitecustomize.py that loads the unit's filter the way systemd builds it (allowed:
    yes; other known calls: EPERM; calls systemd does not know: ENOSYS) into the Python
    process that starts with it, before gurtd runs: gurtd and every worker inherit it."""
    folder = tmp_path / "filtered"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import errno, os, seccomp\n"
        f"ALLOWED, KNOWN = {sorted(allowed)!r}, {sorted(native)!r}\n"
        "if os.environ.get('GURT_TEST_UNIT_FILTER') == '1':\n"
        "    f = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.ENOSYS))\n"
        "    for name in KNOWN:\n"
        "        f.add_rule(seccomp.ALLOW if name in ALLOWED else seccomp.ERRNO(errno.EPERM),"
        " name)\n"
        "    f.load()\n")
    return str(folder)


def test_tasks_live_their_whole_life_under_the_units_filter(tmp_path, new_gurtd):
    allowed, native = unit_allowed()
    folder = seccomp_sitecustomize(tmp_path, allowed, native)
    g = new_gurtd({"PYTHONPATH": folder, "GURT_TEST_UNIT_FILTER": "1"})
    with open(f"/proc/{g.proc.pid}/status") as f:
        assert re.search(r"^Seccomp:\s+2$", f.read(), re.M)     # gurtd runs filtered
    g.api("PUT", "/api/wallet", {"balanceCents": 10})
    task = g.run_done("echo hi > made.txt\ncat /proc/self/status | grep ^Seccomp_filters\n"
                      "gurtd tool wallet.pay '{\"to\": \"shop\", \"cents\": 1}'",
                      tools=["wallet.pay"], budgetCents=5)
    out = g.output(task["id"])
    assert any(re.match(r"Seccomp_filters:\s+[2-9]", line) for line in out), out  # both
    assert g.file("home", "made.txt") == b"hi\n"
    g.api("POST", f"/api/tasks/{task['id']}/undo")
    g.wait(task["id"], ("undone",))
    assert g.file("home", "made.txt") is None
    assert g.api("GET", "/api/wallet")["balanceCents"] == 9


def test_tasks_of_every_kind_run_with_only_the_units_capabilities(tmp_path, new_gurtd):
    """gurtd with exactly the unit's bounding set and filter (setpriv, as systemd gives it):
    a task writes a file, an upload lands, a task with hosts gets its DNS on port 53 (no
    CAP_NET_BIND_SERVICE), the files API reads through openat2, an undo takes a task back.
    Short of CAP_SETFCAP every task failed "sandbox: Operation not permitted"."""
    allowed, native = unit_allowed()
    folder = seccomp_sitecustomize(tmp_path, allowed, native)
    g = new_gurtd({"PYTHONPATH": folder, "GURT_TEST_UNIT_FILTER": "1",
                   "GURT_TEST_UNIT_CAPS": "1"})
    status = Path(f"/proc/{g.proc.pid}/status").read_text()
    bounding = int(re.search(r"^CapBnd:\s+([0-9a-f]+)$", status, re.M).group(1), 16)
    assert bounding == sum(1 << getattr(__import__("prctl"), "CAP_" + c[1:].upper())
                           for c in unit_bounding_set().split(",")[1:])
    code, _, _ = g.request("PUT", "/api/workspaces/home/files/up/in.txt", raw=b"uploaded\n")
    assert code in (200, 201), code
    task = g.run_done("cat up/in.txt > made.txt")
    assert g.file("home", "made.txt") == b"uploaded\n"
    g.run_done("grep -c nameserver /etc/resolv.conf", hosts=["198.18.0.12/31:80"])
    # under the unit's UMask=0077 the tools folder came out 0700: gurt-tools could not run it
    os.chmod(os.path.dirname(g.home), 0o711)
    tool = os.path.join(g.home, "tools", "id.tool")
    with open(tool, "w") as f:
        f.write('#!/bin/sh\ncat >/dev/null\nprintf \'{"user": "%s"}\\n\' "$(id -un)"\n')
    os.chmod(tool, 0o755)
    called = g.run_done("gurtd tool id.tool '{}'", tools=["id.tool"])
    assert json.loads(g.output(called["id"])[0]) == {"user": "gurt-tools"}
    g.api("POST", f"/api/tasks/{task['id']}/undo")
    g.wait(task["id"], ("undone",))
    assert g.file("home", "made.txt") is None and g.file("home", "up/in.txt") == b"uploaded\n"


def test_the_loop_pings_the_watchdog_and_reports_its_tasks(tmp_path, new_gurtd):
    import socket
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(20)
    try:
        g = new_gurtd({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})

        def until(wanted: str) -> list[str]:
            seen = []
            while not any(m.startswith(wanted) for m in seen):
                seen.append(sock.recv(4096).decode())
            return seen

        assert "READY=1" in until("READY=1")
        assert until("STATUS=0 running, 0 waiting, 0 queued")
        pings = [m for m in until("WATCHDOG=1") + until("WATCHDOG=1") if m == "WATCHDOG=1"]
        assert pings
        task = g.create("sleep 30")
        assert until("STATUS=1 running, 0 waiting, 0 queued")
        assert until("WATCHDOG=1")         # still pinging while a task runs
        g.api("POST", f"/api/tasks/{task['id']}/stop")
        g.wait(task["id"])
        assert until("STATUS=0 running")
    finally:
        sock.close()


def test_make_install_takes_only_run_time_packages_and_uninstall_reloads_systemd():
    def read(name: str) -> str:
        return Path(ROOT, name).read_text()
    run_time = read("requirements.txt")
    for test_only in ("pytest", "mcp"):
        assert not re.search(rf"^{test_only}\b", run_time, re.M), test_only
        assert re.search(rf"^{test_only}==", read("requirements-test.txt"), re.M), test_only
    assert "-r requirements.txt" in read("requirements-test.txt")
    dry = subprocess.run(["make", "-n", "install", "uninstall", "PREFIX=/nonexistent/gurtd"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    pip_lines = [line for line in dry.stdout.splitlines() if "pip install" in line or
                 line.strip().startswith("-r ")]
    assert pip_lines and all("requirements-test" not in line for line in pip_lines), pip_lines
    assert "requirements-test" not in dry.stdout.split("uninstall")[0]
    uninstall = dry.stdout[dry.stdout.index("systemctl disable"):]
    assert "rm -rf" in uninstall and "systemctl daemon-reload" in uninstall, uninstall
    assert "`make uninstall`" in read("README.md")
