"""The suite's one set of fixtures and helpers: a real gurtd on a free port with a temporary
BOX_HOME, the things stories need around it, and the check that nothing of gurtd is left.

Tiers.  A test marked `pure` (`@pytest.mark.pure`, or `pytestmark = pytest.mark.pure` in a module
of pure tests only) starts no gurtd, touches no system state and needs no root: validation, host
patterns, nftables text, the droid stream, prices, cron, the merge planner, OpenAPI generation.
`make test-pure` runs only those (`pytest -m pure`), as any user, in seconds.  Every other test
runs as root on a throwaway machine: real users, overlay mounts, namespaces, no mocks of the
system layer.  Under CI=true a missing prerequisite is a failure, never a skip.
GURT_TEST_UNIT_CAPS=1 starts every gurtd with only gurtd.service's capabilities (setpriv)
and its UMask.

Fixtures, one meaning per name:
  gurtd          a started gurtd with a fresh BOX_HOME, stopped (it must exit 0) and removed
                 afterwards: one per test, or one per module where the module sets
                 SHARED_GURTD = True; GURTD_ENV of the module is added to its environment.
  module_gurtd   that one gurtd of a module, for the module's own module-scoped fixtures.
  new_gurtd      a factory of more gurtds, with an environment of the test's choosing.
  droid_gurtd    a gurtd whose environment holds no FACTORY_API_KEY (the droid stories).
  cli            the `gurtd` command line against the test's gurtd (Gurtd.cli for any other).
  fake_internet  the network namespace gtinet and its servers, with the tests' upstream DNS;
                 once a session.  Tests using it run under `flock /tmp/gurtd-net.lock`.
  net_gurtd      a gurtd whose names resolve through the fake internet.
  small_disk     (gurtd, disk): a gurtd whose BOX_HOME is on a small loop-mounted ext4.
  owner          a real unprivileged user with a home, for the module; removed after.
  owner_folder   a project folder of that owner's: nested folders, a file of root's, a
                 symlink out, a unicode name.
  scratch        a folder of root's under /var/tmp, removed after however deep its tree.

Sections, in this order: the tiers (markers, the root check, the leftover check), the daemon
(Gurtd and its fixtures), stories' helpers, a small disk, the owner's real folder, the fake
internet, stand-ins (Droid, HTTP peers, Jira), stored layers, the browser.

When the run held any root test, its end (pytest_sessionfinish) fails it with a list of what
gurtd left behind: a mount, user, group, process, network namespace, veth, nftables table,
cgroup or test BOX_HOME.  GURT_TEST_LEFTOVERS=skip turns that off on a machine where other runs
of the suite go on at the same time (their live tasks would count).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import glob
import hashlib
import http.client
import http.server
import json
import os
import pathlib
import pwd
import py_compile
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import dns.flags
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

try:
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys  # noqa: F401 (for test_portal.py)
    from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: F401
except ImportError:                         # a missing prerequisite fails, never skips
    webdriver = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GURTD = os.path.join(ROOT, "gurtd.py")
sys.path.insert(0, ROOT)

import gurtd as G  # noqa: E402  (importing it does nothing: no root, no files)

TERMINAL = ("done", "failed", "undone")
VIEW = "/run/gurt/view"                 # a task's view of its workspace
UNKNOWN_ID = "tzzzzzzzzz"               # a well formed task id, never issued
SONNET = G.DEFAULT_DROID_PRICES["claude-sonnet-5"]
REJECTED = 'Tool call "{tool}" was rejected by the owner: {reason}'
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def unit_umask() -> int:
    """gurtd.service's UMask=."""
    with open(os.path.join(ROOT, "gurtd.service")) as f:
        return int(re.search(r"^UMask=(\d+)$", f.read(), re.M).group(1), 8)


def unit_bounding_set() -> str:
    """gurtd.service's CapabilityBoundingSet= as setpriv's --bounding-set takes it."""
    caps: list[str] = []
    with open(os.path.join(ROOT, "gurtd.service")) as f:
        for line in f:
            if line.startswith("CapabilityBoundingSet="):
                caps += line.split("=", 1)[1].split()
    return ",".join(["-all"] + ["+" + c.lower().removeprefix("cap_") for c in caps])


# The tiers ###################################################################################
###############################################################################################

def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pure: starts no gurtd and needs no root (make test-pure)")


def root_tests(session: pytest.Session) -> bool:
    return any(item.get_closest_marker("pure") is None for item in session.items)


def pytest_collection_finish(session: pytest.Session) -> None:
    if root_tests(session) and os.geteuid() != 0:
        pytest.exit("the gurtd suite runs as root (sudo make test); without root only "
                    "make test-pure", returncode=1)


# The VM tier's image build (tests/vm/image.sh), which .ci/run runs beside the suite, has the
# host's /proc, /sys and /dev mounted in its chroot below here: not gurtd's.
VM_IMAGE_CACHE = os.environ.get("GURTD_VM_CACHE", "/var/cache/gurtd-vm").rstrip("/")


def leftovers() -> list[str]:
    """What of gurtd is on this machine: none of it outlives a run of the suite."""
    left = [f"task user {name}" for name in G.task_users()]
    with open("/etc/group") as f:
        left += [f"group {line.split(':')[0]}" for line in f
                 if line.startswith(G.TASK_USER_PREFIX)]
    left += [f"process {pid} of uid {uid}" for uid, pids in G.processes_by_uid().items()
             for pid in pids]
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {line.split()[4]}" for line in f
                 if "gurt" in line and not line.split()[4].startswith(VM_IMAGE_CACHE + "/")]
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    left += [f"network namespace {n}" for n in netns if n.startswith("gurt")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    left += [f"veth {n}" for n in names if n.startswith("g") and n[1:].isdigit()]
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                            check=True).stdout
    left += [f"nftables {line}" for line in tables.splitlines() if "gurt" in line]
    left += [f"test BOX_HOME /var/tmp/{d}" for d in os.listdir("/var/tmp")
             if d.startswith("gurt-test-")]
    left += [f"diff copies {path}" for path in glob.glob(os.path.join(G.DIFF_TMP, "gurt-diff-*"))]
    return left + [f"cgroup {path}" for path in gurt_cgroups()]


def gurt_cgroups(depth: int = 6) -> list[str]:
    """gurtd's groups (gurt-<hash>, with its tasks' below) anywhere in every cgroup hierarchy,
    not only below this process's own group: a gurtd started from another session or scope
    (another shell's group in a v1 memory hierarchy, a scope of its own) is seen too."""
    with open("/proc/self/mountinfo") as f:
        roots = {line.split()[4] for line in f
                 if line.partition(" - ")[2].split()[0] in ("cgroup", "cgroup2")}
    found = []
    for root in sorted(roots):
        for top, dirs, _ in os.walk(root):
            if top.count("/") - root.count("/") >= depth:
                dirs[:] = []
            found += [os.path.join(top, d) for d in dirs if d.startswith("gurt-")]
            dirs[:] = [d for d in dirs if not d.startswith("gurt-")]
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run of root tests fails when it leaves anything of gurtd behind."""
    if not root_tests(session) or os.geteuid() != 0 or \
            os.environ.get("GURT_TEST_LEFTOVERS") == "skip":
        return
    left = leftovers()
    if left:
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = ["the suite left these of gurtd behind:"] + [f"  {what}" for what in left]
        if report is not None:
            report.ensure_newline()
            report.write_sep("=", "leftovers", red=True)
            for line in lines:
                report.write_line(line, red=True)
        else:
            sys.stderr.write("\n".join(lines) + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The daemon ##################################################################################
###############################################################################################

@functools.cache
def compiled() -> None:
    """Every gurtd the tests start runs `python -m gurtd`, which reads this cached bytecode
    (written even under PYTHONDONTWRITEBYTECODE) instead of compiling 13,000 lines again."""
    py_compile.compile(GURTD, doraise=True)


def clean_env(**extra: str) -> dict[str, str]:
    """The tests' environment without what would point a gurtd or its client elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BOX_HOME", "GURT_TOKEN", "NO_COLOR")}
    env.update(extra)
    return env


class Gurtd:
    """A gurtd process of the tests' own, and requests to it."""

    def __init__(self, home: str, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.token = ""
        self.log_path = os.path.join(os.path.dirname(home), "gurtd.log")

    # process
    def start(self, timeout: float = 20.0) -> None:
        compiled()
        env = {k: v for k, v in os.environ.items() if k not in ("BOX_HOME", "GURT_TOKEN")}
        # Network safety: a granted name is resolved at a loopback port where nothing
        # listens (an instant SERVFAIL), never at the host's real nameserver.
        env["GURT_DNS_UPSTREAM"] = "127.0.0.1:9"
        env.update(self.env)
        offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        log = open(self.log_path, "ab")
        # -m from ROOT: the module's cached bytecode, not a compile of 13,000 lines per start
        argv = [sys.executable, "-m", "gurtd", "serve", "--box-home", self.home, "--listen",
                "127.0.0.1:0"]
        umask = -1
        if env.get("GURT_TEST_UNIT_CAPS") == "1":   # only the unit's capabilities, as under it
            argv = ["setpriv", "--bounding-set", unit_bounding_set()] + argv
            umask = unit_umask()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=ROOT,
                                     umask=umask)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
            if m:
                self.port = int(m.group(1))
                with open(os.path.join(self.home, "token")) as f:
                    self.token = self.env.get("GURT_TOKEN") or f.read().strip()
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"gurtd exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.02)
        raise AssertionError("gurtd did not start:\n" + self.log_text())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=30)
        self.proc = None
        return code

    def restart(self, kill: bool = False) -> None:
        self.stop(signal.SIGKILL if kill else signal.SIGTERM)
        self.start()

    def log_text(self) -> str:
        return Path(self.log_path).read_bytes().decode(errors="replace")

    def cli_env(self, **extra: str) -> dict[str, str]:
        """The environment of a `gurtd` command line that talks to this gurtd."""
        return clean_env(BOX_HOME=self.home, GURT_LISTEN=f"127.0.0.1:{self.port}", **extra)

    def cli(self, *args: str, stdin: str | bytes | None = None, cwd: str = ROOT,
            text: bool = True, **env: str) -> subprocess.CompletedProcess[Any]:
        """The `gurtd` command line against this gurtd, its output captured."""
        return subprocess.run(
            [sys.executable, GURTD, *args], input=("" if text else b"") if stdin is None
            else stdin, capture_output=True, text=text, cwd=cwd, timeout=60,
            env=self.cli_env(**env))

    def cli_ok(self, *args: str, **how: Any) -> subprocess.CompletedProcess[Any]:
        """The `gurtd` command line against this gurtd, which must exit 0."""
        proc = self.cli(*args, **how)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        return proc

    # requests
    def connection(self, timeout: float = 30.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    @contextlib.contextmanager
    def stream(self, path: str, timeout: float = 20.0) -> Iterator[http.client.HTTPResponse]:
        """An answer still coming (an event stream, a log followed), read by the with block;
        its connection closed after."""
        conn = self.connection(timeout)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}"})
            yield conn.getresponse()
        finally:
            conn.close()

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None, token: bool = True,
                raw: bytes | None = None) -> tuple[int, Any, dict[str, str]]:
        """(status, parsed JSON or bytes, headers) of one request."""
        hdrs = {"Authorization": f"Bearer {self.token}"} if token else {}
        hdrs.update(headers or {})
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        conn = self.connection()
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            payload = resp.read()
            out_headers = {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()
        if out_headers.get("content-type", "").split(";")[0] == "application/json":
            return resp.status, json.loads(payload), out_headers
        return resp.status, payload, out_headers

    def api(self, method: str, path: str, body: Any = None, status: int | None = None,
            **request: Any) -> Any:
        """The answer of one request (headers, token, raw as request takes them), whose
        status must be status (any 2xx without one)."""
        code, data, _ = self.request(method, path, body, **request)
        if status is not None:
            assert code == status, (code, data)
        else:
            assert 200 <= code < 300, (code, data)
        return data

    def create(self, prompt: str, **fields: Any) -> dict[str, Any]:
        """A new task of the fake worker, or of worker=...; worker=None: the default (droid)."""
        body = {"title": fields.pop("title", "test task"), "prompt": prompt, "worker": "fake"}
        body.update(fields)
        if body["worker"] is None:
            del body["worker"]
        return self.api("POST", "/api/tasks", body, status=201)

    def task(self, task_id: str) -> dict[str, Any]:
        return self.api("GET", f"/api/tasks/{task_id}")

    def wait(self, task_id: str, states: tuple[str, ...] = TERMINAL,
             timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            task = self.task(task_id)
            if task["state"] in states:
                return task
            if time.monotonic() > deadline:
                raise AssertionError(f"task {task_id} still {task['state']}: {task}")
            time.sleep(0.02)

    def run(self, prompt: str, **fields: Any) -> dict[str, Any]:
        """Create a task and wait for its end."""
        return self.wait(self.create(prompt, **fields)["id"])

    def wait_done(self, task_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the end of a task, which must end done."""
        task = self.wait(task_id, timeout=timeout)
        assert task["state"] == "done", (task, self.log(task_id))
        return task

    def run_done(self, prompt: str, **fields: Any) -> dict[str, Any]:
        """Run a task that must end done."""
        task = self.run(prompt, **fields)
        assert task["state"] == "done", (task, self.log(task["id"]))
        return task

    def log(self, task_id: str) -> list[dict[str, Any]]:
        data = self.api("GET", f"/api/tasks/{task_id}/log", status=200)
        return [json.loads(line) for line in data.decode().splitlines()]

    def output(self, task_id: str, kind: str | None = "stdout") -> list[str]:
        """The texts of a task's log entries of one kind (stdout, stderr) or of all."""
        return [e.get("text", "") for e in self.log(task_id) if kind in (None, e["type"])]

    def states(self, task_id: str) -> list[str]:
        """The states a task's log says it went through."""
        return [e["state"] for e in self.log(task_id) if e["type"] == "state"]

    def approvals(self, **query: str) -> list[dict[str, Any]]:
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        return self.api("GET", "/api/approvals" + (f"?{qs}" if qs else ""))

    def pending(self, task_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The task's one pending approval, once there is one."""
        found = eventually(lambda: self.approvals(state="pending", task=task_id), timeout,
                           f"a pending approval of {task_id}")
        assert len(found) == 1, found
        return found[0]

    def payments(self, task_id: str | None = None) -> list[dict[str, Any]]:
        """The ledger's payments (not balance settings), of one task or all."""
        return [e for e in self.api("GET", "/api/wallet")["ledger"] if "task" in e and
                (task_id is None or e["task"] == task_id)]

    def file(self, workspace: str, path: str) -> bytes | None:
        code, data, _ = self.request("GET", f"/api/workspaces/{workspace}/files/{path}")
        if code == 404:
            return None
        assert code == 200, (code, data)
        return data

    def worker_pids(self, task: dict[str, Any]) -> list[int]:
        """Live processes of a task's user."""
        try:
            uid = pwd.getpwnam(task["user"]).pw_uid
        except KeyError:
            return []
        return uid_processes(uid)


def uid_processes(uid: int) -> list[int]:
    return G.processes_by_uid({uid}).get(uid, [])


HOME_PARENTS = ("/var/tmp", "/var/lib")       # make_home's; test_containment's any_gurtd's
HOME_FOLDER = re.compile(r"gurt-test-[a-z0-9_]{8}")   # tempfile.mkdtemp's, prefix gurt-test-


def make_home() -> str:
    base = tempfile.mkdtemp(prefix="gurt-test-", dir="/var/tmp")
    return os.path.join(base, "box")


def remove_home(home: str) -> None:
    """The test's BOX_HOME and the folder around it, however deep a task's tree in it: only a
    home such as make_home makes (<parent>/gurt-test-XXXXXXXX/box, the parent one of
    HOME_PARENTS, the folder not a link); any other path raises ValueError and nothing is
    removed (given a folder of /var/tmp, it once removed /var/tmp)."""
    path = os.path.abspath(home)
    base = os.path.dirname(path)
    if os.path.basename(path) != "box" or not HOME_FOLDER.fullmatch(os.path.basename(base)) \
            or os.path.dirname(base) not in HOME_PARENTS or os.path.islink(base):
        raise ValueError(f"remove_home: {home!r} is not a BOX_HOME that make_home made")
    with contextlib.suppress(FileNotFoundError):
        G.tree_remove(base)


@contextlib.contextmanager
def running_gurtd(env: dict[str, str] | None = None, home: str | None = None,
                  timeout: float = 20.0) -> Iterator[Gurtd]:
    """A running gurtd with a fresh BOX_HOME (or home); stopped (it must exit 0) and its
    BOX_HOME's folder removed after."""
    g = Gurtd(home or make_home(), env)
    try:
        g.start(timeout)
        yield g
        if g.proc is not None:
            code = g.stop()
            assert code == 0, f"gurtd exited with {code}:\n{g.log_text()}"
    finally:
        if g.proc is not None:
            g.stop()
        remove_home(g.home)


@pytest.fixture(scope="module")
def module_gurtd(request: pytest.FixtureRequest) -> Iterator[Gurtd]:
    with running_gurtd(getattr(request.module, "GURTD_ENV", None)) as g:
        yield g


@pytest.fixture
def gurtd(request: pytest.FixtureRequest) -> Iterator[Gurtd]:
    if getattr(request.module, "SHARED_GURTD", False):
        yield request.getfixturevalue("module_gurtd")
        return
    with running_gurtd(getattr(request.module, "GURTD_ENV", None)) as g:
        yield g


@pytest.fixture
def droid_gurtd(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gurtd]:
    """A gurtd whose environment holds no FACTORY_API_KEY."""
    monkeypatch.delenv("FACTORY_API_KEY", raising=False)
    with running_gurtd() as g:
        yield g


@pytest.fixture
def cli(gurtd: Gurtd) -> Callable[..., subprocess.CompletedProcess[Any]]:
    return gurtd.cli


@pytest.fixture
def new_gurtd() -> Iterator[Callable[..., Gurtd]]:
    """A factory for gurtd instances with settings of the test's choosing (env)."""
    made: list[Gurtd] = []

    def factory(env: dict[str, str] | None = None) -> Gurtd:
        g = Gurtd(make_home(), env)
        g.start()
        made.append(g)
        return g

    yield factory
    for g in made:
        if g.proc is not None:
            g.stop()
        remove_home(g.home)


# Stories' helpers ############################################################################
###############################################################################################

def eventually(check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    """Poll check() until it returns something truthy; its value, or AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.02)


def recv_all(sock: socket.socket, timeout: float | None = None, reset_ends: bool = False) -> bytes:
    """What the peer sends until it closes the connection (with reset_ends, a reset too)."""
    if timeout is not None:
        sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(*((ConnectionResetError,) if reset_ends else ())):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def sse(resp: Any) -> Iterator[tuple[int | None, str, str]]:
    """The events of a text/event-stream as they come, (id, kind, data) at each data line
    (kind "message" where the event names none, id None without one), until it ends."""
    event_id, kind = None, "message"
    while raw := resp.readline():
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield event_id, kind, line[6:]
        elif not line:
            event_id, kind = None, "message"


class loop_waits:  # noqa: N801 (used as a context manager, as a function would be)
    """How long each of a stream of calls on the loop waited while the with block ran, in
    seconds.  The call is ask(), else a stop of no task, on a connection of its own: a 503
    (the loop held past the call timeout) counts as the wait it was, and the client waits as
    long as it takes."""

    def __init__(self, g: Gurtd, ask: Callable[[], Any] | None = None) -> None:
        self.g, self.waits, self.done = g, [0.0], threading.Event()
        self.call = ask or self.stop_nothing
        self.thread = threading.Thread(target=self.ask)

    def __enter__(self) -> list[float]:
        self.thread.start()
        return self.waits

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join()

    def stop_nothing(self) -> None:
        conn = self.g.connection(timeout=600)
        try:
            conn.request("POST", "/api/tasks/t000000000/stop",
                         headers={"Authorization": f"Bearer {self.g.token}"})
            conn.getresponse().read()
        finally:
            conn.close()

    def ask(self) -> None:
        while not self.done.is_set():
            began = time.monotonic()
            try:
                self.call()
            finally:
                self.waits.append(time.monotonic() - began)
            self.done.wait(0.05)


def wait_for_step(g: Gurtd, task_id: str, step: str, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the task is running the prompt line `step`; the task then."""
    deadline = time.monotonic() + timeout
    while True:
        task = g.task(task_id)
        if task["state"] == "running" and task.get("step") == step:
            return task
        assert task["state"] in ("queued", "running"), (task, g.log(task_id))
        assert time.monotonic() < deadline, f"task never reached {step!r}: {task}"
        time.sleep(0.02)


def end_sleep(g: Gurtd, task: dict[str, Any], line: str = "sleep 30",
              timeout: float = 30.0) -> None:
    """End the task's running `line` (a sleep that holds the task while the test looks, which
    the test ends once it has, where a fixed pause may be outlasted on a busy machine); its
    process may not be there yet (a step is reported just before its shell forks)."""
    argv = line.encode().split()

    def sleepers() -> list[int]:
        found = []
        for pid in g.worker_pids(task):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:-1] == argv:
                    found.append(pid)
        return found
    for pid in eventually(sleepers, timeout, f"the task's {line!r}"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def put_base_file(g: Gurtd, workspace: str, rel: str, content: str) -> None:
    """Put a file into a workspace's base as its owner would, owned by the store user."""
    store = pwd.getpwnam("gurt-store")
    path = os.path.join(g.home, "workspaces", workspace, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_text(content)
    base = os.path.join(g.home, "workspaces", workspace)
    for root, dirs, files in os.walk(base):
        for name in dirs + files:
            os.chown(os.path.join(root, name), store.pw_uid, store.pw_gid)


def nft_table(home: str) -> str:
    """gurtd's nftables table for a BOX_HOME (one table an instance)."""
    return "gurt_" + hashlib.sha1(os.path.abspath(home).encode()).hexdigest()[:8]


def prompt(*lines: str) -> str:
    """A fake task's prompt: one shell line each."""
    return "\n".join(lines)


def pay_line(to: str, cents: Any, **extra: Any) -> str:
    """A prompt line that pays with the tool client (JSON in single quotes)."""
    return f"gurtd tool wallet.pay '{json.dumps({'to': to, 'cents': cents, **extra})}'"


def python_line(script: str) -> str:
    """A prompt line that runs a Python script (any quotes, any lines) with the box's python3."""
    encoded = base64.b64encode(script.encode()).decode()
    return f"printf %s {encoded} | base64 -d | python3 -I -"


def python_arg_line(code: str) -> str:
    """A prompt line that runs this Python program from its argument (python3 -c), so that the
    line's stdin stays free for a redirection of the test's."""
    return ("python3 -c \"import base64; exec(base64.b64decode('"
            + base64.b64encode(code.encode()).decode() + "'))\"")


def started(g: Gurtd, *args: str) -> subprocess.Popen[str]:
    """A CLI process still going (run --wait, events), its output piped."""
    return subprocess.Popen([sys.executable, GURTD, *args], env=g.cli_env(), cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def read_until(stream: Any, pattern: str, timeout: float = 30.0) -> str:
    """What a piped stream says until pattern appears in it (read unbuffered, from its fd)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, seen.decode(errors="replace")):
        assert time.monotonic() < deadline, f"never saw {pattern!r} in {seen!r}"
        ready, _, _ = select.select([stream], [], [], 1.0)
        if ready:
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, f"the stream ended before {pattern!r}: {seen!r}"
            seen += chunk
    return seen.decode(errors="replace")


def passwd_names() -> set[str]:
    with open("/etc/passwd") as f:
        return {line.split(":", 1)[0] for line in f if line.strip()}


def processes_of_uid(uid: int) -> list[int]:
    """Every live process with uid as its real, effective, saved or filesystem uid."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").split()[:1] == ["Z"]:
            continue
        if str(uid) in fields.get("Uid", "").split():
            out.append(int(entry))
    return out


def deep_tree(top: str, depth: int, name: str, leaf: str = "leaf", mode: int = 0o777) -> None:
    """depth folders called name, each in the one before, below top (past PATH_MAX if need be:
    each made beneath the last one's fd), and an empty file called leaf at the bottom."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        fd_next = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = fd_next
    os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, mode, dir_fd=fd))
    os.close(fd)


@pytest.fixture
def scratch() -> Iterator[pathlib.Path]:
    """A folder of root's outside every folder root (pytest's tmp_path is shared with other
    suites' leftovers), removed after however deep its trees."""
    path = tempfile.mkdtemp(prefix="gurt-scratch-", dir="/var/tmp")
    try:
        yield pathlib.Path(path)
    finally:
        G.tree_remove(path)


# A small disk ################################################################################
###############################################################################################

class SmallDisk:
    """A small ext4 image, loop-mounted; BOX_HOME lives on it, gurtd's own log beside it."""

    def __init__(self, base: str, size_mb: int = 32, reserved_pct: int = 0) -> None:
        self.base = base
        self.image = os.path.join(base, "disk.img")
        self.mnt = os.path.join(base, "mnt")
        self.home = os.path.join(self.mnt, "box")
        self.filler = os.path.join(self.mnt, "filler")
        self.loop = ""
        with open(self.image, "wb") as f:
            f.truncate(size_mb << 20)
        subprocess.run(["mkfs.ext4", "-q", "-m", str(reserved_pct), "-F", self.image],
                       check=True)
        self.loop = subprocess.run(["losetup", "--find", "--show", self.image], check=True,
                                   capture_output=True, text=True).stdout.strip()
        try:
            os.mkdir(self.mnt)
            subprocess.run(["mount", "-t", "ext4", self.loop, self.mnt], check=True)
        except BaseException:
            subprocess.run(["losetup", "-d", self.loop], check=False)
            raise

    def fill(self, leave: int = 0) -> None:
        """Fill the file system to the last block, then give back `leave` bytes."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 20, 1 << 16, 4096, 512, 1):
                while True:
                    try:
                        if os.write(fd, b"\0" * chunk) < chunk:
                            continue
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC, exc
                        break
            os.fsync(fd)
            size = os.fstat(fd).st_size
            os.ftruncate(fd, max(0, size - leave))
            os.fsync(fd)
        finally:
            os.close(fd)

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.filler)
        os.sync()

    def close(self) -> None:
        if subprocess.run(["umount", self.mnt], check=False).returncode != 0:
            subprocess.run(["umount", "-l", self.mnt], check=False)   # busy: detach it
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], check=False)


@contextlib.contextmanager
def small_disk_made(size_mb: int = 32, reserved_pct: int = 0) -> Iterator[SmallDisk]:
    """A small disk (no gurtd on it), unmounted and removed afterwards."""
    base = tempfile.mkdtemp(prefix="gurt-test-", dir="/var/tmp")
    disk = None
    try:
        disk = SmallDisk(base, size_mb, reserved_pct)
        yield disk
    finally:
        if disk is not None:
            disk.close()
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def gurtd_on_small_disk(env: dict[str, str] | None = None, size_mb: int = 32,
                        reserved_pct: int = 0) -> Iterator[tuple[Gurtd, SmallDisk]]:
    """A gurtd whose BOX_HOME is a small file system; everything removed afterwards."""
    with small_disk_made(size_mb, reserved_pct) as disk:
        g = Gurtd(disk.home, env)
        g.log_path = os.path.join(disk.base, "gurtd.log")   # not on the disk that fills up
        try:
            g.start()
            yield g, disk
        finally:
            if g.proc is not None:
                g.stop(signal.SIGKILL)
            disk.free()
            cleanup_box(disk.home)      # what a killed gurtd left: users, mounts, a table


def cleanup_box(home: str) -> None:
    """Start and stop a gurtd on home once more: reconcile removes a dead one's leftovers."""
    g = Gurtd(home)
    g.log_path = os.path.join(os.path.dirname(os.path.dirname(home)), "gurtd.log")
    g.start()
    assert g.stop() == 0


@pytest.fixture
def small_disk() -> Iterator[tuple[Gurtd, SmallDisk]]:
    with gurtd_on_small_disk() as made:
        yield made


# The owner's real folder #####################################################################
###############################################################################################

UNICODE_NAME = "my file é ✓.txt"


@pytest.fixture(scope="module")
def owner() -> Iterator[pwd.struct_passwd]:
    """A real unprivileged user with a home under /home, removed afterwards."""
    name = "gurtrv" + secrets.token_hex(3)
    subprocess.run(["useradd", "-m", "-d", f"/home/{name}", "-s", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
        shutil.rmtree(f"/home/{name}", ignore_errors=True)
        assert not os.path.exists(f"/home/{name}")


@pytest.fixture
def owner_folder(owner: pwd.struct_passwd) -> Iterator[str]:
    """The owner's project: nested folders, root's file, a symlink out, a unicode name."""
    top = os.path.join(owner.pw_dir, "proj-" + secrets.token_hex(3))
    files = {"a.txt": "hello\n", "sub/b.txt": "bee\n", "sub/deeper/c.txt": "sea\n",
             "olddir/x.txt": "x\n", "olddir/y/z.txt": "z\n", UNICODE_NAME: "unicode\n",
             "script.sh": "#!/bin/sh\necho hi\n"}
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(top, rel)), exist_ok=True)
        Path(top, rel).write_text(text)
    os.symlink("/etc/passwd", os.path.join(top, "link"))
    for root, dirs, names in os.walk(top):
        for name in [root] + [os.path.join(root, n) for n in dirs + names]:
            os.chown(name, owner.pw_uid, owner.pw_gid, follow_symlinks=False)
    Path(top, "root.txt").write_text("root's own\n")  # root's, inside the owner's
    os.chmod(os.path.join(top, "root.txt"), 0o644)
    time.sleep(0.05)                 # the folder's ctimes are before any task's start
    yield top
    shutil.rmtree(top, ignore_errors=True)


def run_on(g: Gurtd, folder: str, *lines: str, **fields: Any) -> dict[str, Any]:
    """A fake task on folder; each line runs in the folder (the fake worker's lines are each
    their own shell)."""
    return g.run("\n".join(f"cd '{folder}' && {line}" for line in lines), folder=folder,
                 **fields)


def keep(g: Gurtd, task_id: str, body: Any = None) -> tuple[int, Any]:
    code, data, _ = g.request("POST", f"/api/tasks/{task_id}/keep", body or {})
    return code, data


# The fake internet ###########################################################################
###############################################################################################

# gtinet: a network namespace reached from the host by the veth gtv0 (198.18.0.1/24) whose other
# end, eth0 inside, holds 198.18.0.10 (a.test), .11 (x.b.test), .12 (b.test), .13 and .53; no
# default route in there, so nothing in it can reach anything but the host.  One process in it
# serves `hello from <addr>:<port>` over HTTP on 80 and 8080 of .10-.13 (and 80 of .53), DNS
# on 198.18.0.53:53 (UDP and TCP) that answers anything, and a TCP listener on .53:853.  The
# tests' DNS server on 127.0.0.1 (gurtd's upstream) answers ZONE, NXDOMAIN for other names.
NETNS = "gtinet"
HOST_VETH = "gtv0"
HOST_ADDR = "198.18.0.1"
A, XB, B, C, RESOLVER = "198.18.0.10", "198.18.0.11", "198.18.0.12", "198.18.0.13", "198.18.0.53"

ZONE = {  # the tests' upstream DNS: name -> (type, value)
    "a.test": ("A", A),
    "x.b.test": ("A", XB),
    "b.test": ("A", B),
    "rebind.test": ("A", "127.0.0.1"),
    "self.test": ("A", HOST_ADDR),
    "cname.test": ("CNAME", "a.test"),
    "private.test": ("A", "10.1.2.3"),        # only ever looked up, never connected to
    "home.test": ("A", "192.168.1.1"),
    "metadata.test": ("A", "169.254.169.254"),
    # names the tasks of test_decisions.py ask for at run time
    **{name: ("A", A) for name in ("ask.test", "deny.test", "team.test", "later.test",
                                   "restart.test")},
    "loop.test": ("A", "127.0.0.1"),
}



# Runs inside gtinet as root.  Sockets are bound by hand (http.server's server_bind looks names
# up).  It dies with the test process (PR_SET_PDEATHSIG) and after 15 minutes in any case.
SERVER = r'''
import ctypes, socket, struct, sys, threading, time
ctypes.CDLL(None).prctl(1, 9)

def listener(addr, port, kind=socket.SOCK_STREAM):
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    if kind == socket.SOCK_STREAM:
        s.listen(64)
    return s

def recv_exact(c, n):
    data = b""
    while len(data) < n:
        chunk = c.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data

def http_one(c, addr, port):
    try:
        c.settimeout(3)
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = c.recv(4096)
            if not chunk:
                break
            data += chunk
        body = ("hello from %s:%d\n" % (addr, port)).encode()
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                  b"Connection: close\r\n\r\n" % len(body) + body)
    except Exception:
        pass
    finally:
        c.close()

def http(s, addr, port):
    while True:
        c, _ = s.accept()
        threading.Thread(target=http_one, args=(c, addr, port), daemon=True).start()

def answer(q):
    """A response to any query: its id and question, and one A record, 198.18.0.10."""
    if len(q) < 17:
        return None
    end = 12
    while end < len(q) and q[end]:
        end += 1 + q[end]
    end += 5
    return (q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + q[12:end]
            + b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04" + socket.inet_aton("198.18.0.10"))

def dns_udp(s):
    while True:
        q, peer = s.recvfrom(4096)
        r = answer(q)
        if r:
            s.sendto(r, peer)

def dns_tcp(s):
    while True:
        c, _ = s.accept()
        try:
            c.settimeout(3)
            n = struct.unpack("!H", recv_exact(c, 2))[0]
            r = answer(recv_exact(c, n))
            c.sendall(struct.pack("!H", len(r)) + r)
        except Exception:
            pass
        finally:
            c.close()

def dot(s):
    while True:
        c, _ = s.accept()
        try:
            c.sendall(b"853 here\n")
        except Exception:
            pass
        c.close()

jobs = []
for addr in ("198.18.0.10", "198.18.0.11", "198.18.0.12", "198.18.0.13"):
    for port in (80, 8080):
        jobs.append((http, listener(addr, port), addr, port))
jobs.append((http, listener("198.18.0.53", 80), "198.18.0.53", 80))
jobs.append((dns_udp, listener("198.18.0.53", 53, socket.SOCK_DGRAM)))
jobs.append((dns_tcp, listener("198.18.0.53", 53)))
jobs.append((dot, listener("198.18.0.53", 853)))
for fn, *args in jobs:
    threading.Thread(target=fn, args=args, daemon=True).start()
print("ready", flush=True)
time.sleep(900)
'''


class FakeResolver:
    """The tests' upstream DNS server on 127.0.0.1 (UDP and TCP, one port), with ZONE."""

    def __init__(self) -> None:
        self.queries: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        for _ in range(50):
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind(("127.0.0.1", 0))
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                tcp.bind(("127.0.0.1", udp.getsockname()[1]))
            except OSError:
                udp.close()
                tcp.close()
                continue
            break
        else:
            raise AssertionError("no free port for the tests' DNS server")
        tcp.listen(16)
        self.udp, self.tcp = udp, tcp
        self.port = udp.getsockname()[1]
        self.threads = [threading.Thread(target=self.serve, daemon=True, name="fake-dns")]
        self.threads[0].start()

    def respond(self, wire: bytes) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except Exception:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        self.queries.append((name, dns.rdatatype.to_text(question.rdtype)))
        many = re.fullmatch(r"many(\d+)\.m\.test", name)
        if many and question.rdtype == dns.rdatatype.A:   # 200 addresses, 198.18.(100+N).*
            response.answer.append(dns.rrset.from_text(
                question.name, 60, "IN", "A",
                *(f"198.18.{100 + int(many[1])}.{i}" for i in range(1, 201))))
            return response.to_wire()
        if name not in ZONE:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        owner = question.name
        for _ in range(8):
            kind, value = ZONE[name]
            if kind == "CNAME":
                response.answer.append(dns.rrset.from_text(owner, 60, "IN", "CNAME",
                                                           value + "."))
                owner, name = dns.name.from_text(value), value
                continue
            if question.rdtype == dns.rdatatype.A:
                response.answer.append(dns.rrset.from_text(owner, 60, "IN", "A", value))
            break
        return response.to_wire()

    def serve(self) -> None:
        while not self.stopping.is_set():
            ready, _, _ = select.select([self.udp, self.tcp], [], [], 0.2)
            if self.udp in ready:
                try:
                    wire, peer = self.udp.recvfrom(4096)
                except OSError:
                    continue
                reply = self.respond(wire)
                if reply:
                    self.udp.sendto(reply, peer)
            if self.tcp in ready:
                try:
                    conn, _ = self.tcp.accept()
                except OSError:
                    continue
                with conn:
                    try:
                        conn.settimeout(2)
                        size = int.from_bytes(conn.recv(2), "big")
                        wire = b""
                        while len(wire) < size:
                            chunk = conn.recv(size - len(wire))
                            if not chunk:
                                break
                            wire += chunk
                        reply = self.respond(wire)
                        if reply:
                            conn.sendall(len(reply).to_bytes(2, "big") + reply)
                    except OSError:
                        pass

    def close(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=5)
        self.udp.close()
        self.tcp.close()


@dataclass
class Internet:
    resolver: FakeResolver
    server: subprocess.Popen[bytes]
    forwarding_before: str

    @property
    def upstream(self) -> str:
        return f"127.0.0.1:{self.resolver.port}"


def sh(*argv: str, check: bool = True) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {proc.returncode}\n{proc.stderr}")
    return proc.stdout


def netns_exists() -> bool:
    return NETNS in sh("ip", "netns", "list").split()


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def forwarding(ifname: str) -> str:
    return Path(f"/proc/sys/net/ipv4/conf/{ifname}/forwarding").read_text().strip()


def remove_fake_internet() -> None:
    """Each step on its own: one failure skips none."""
    if netns_exists():
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    deadline = time.monotonic() + 5
    while link_exists(HOST_VETH) and time.monotonic() < deadline:
        time.sleep(0.05)
    if link_exists(HOST_VETH):
        subprocess.run(["ip", "link", "del", HOST_VETH], capture_output=True)


@pytest.fixture(scope="session")
def fake_internet() -> Iterator[Internet]:
    """gtinet and its servers, with the tests' DNS server on 127.0.0.1; built once a run."""
    if netns_exists():
        pids = sh("ip", "netns", "pids", NETNS).split()
        if pids:
            pytest.fail(f"network namespace {NETNS} is in use (pids {pids}): another run of "
                        "this suite?")
    remove_fake_internet()          # what a killed earlier run left
    resolver: FakeResolver | None = None
    server: subprocess.Popen[bytes] | None = None
    try:
        sh("ip", "netns", "add", NETNS)
        sh("ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", "eth0",
           "netns", NETNS)
        sh("ip", "addr", "add", f"{HOST_ADDR}/24", "dev", HOST_VETH)
        sh("ip", "link", "set", HOST_VETH, "up")
        inside = ["ip", "netns", "exec", NETNS]
        for addr in (A, XB, B, C, RESOLVER):
            sh(*inside, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
        sh(*inside, "ip", "link", "set", "lo", "up")
        sh(*inside, "ip", "link", "set", "eth0", "up")
        assert "default" not in sh(*inside, "ip", "route")
        before = forwarding(HOST_VETH)     # recorded before any gurtd on it runs
        server = subprocess.Popen([*inside, sys.executable, "-c", SERVER],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ready, _, _ = select.select([server.stdout], [], [], 15)
        assert ready and server.stdout is not None, "the fake internet did not start"
        line = server.stdout.readline()
        assert line == b"ready\n", (line, server.poll(),
                                    server.stderr.read() if server.poll() is not None else "")
        resolver = FakeResolver()
        # the fake internet answers the host, so whatever a task cannot reach is refused
        conn = http.client.HTTPConnection(A, 8080, timeout=2)     # no proxy: straight there
        try:
            conn.request("GET", "/")
            assert conn.getresponse().read() == f"hello from {A}:8080\n".encode()
        finally:
            conn.close()
        q = dns.message.make_query("anything.example", "A")
        assert dns.query.udp(q, RESOLVER, timeout=2).answer
        assert dns.query.tcp(q, RESOLVER, timeout=2).answer
        with socket.create_connection((RESOLVER, 853), timeout=2) as s:
            assert s.recv(16) == b"853 here\n"
        r = dns.query.udp(dns.message.make_query("cname.test", "A"), "127.0.0.1",
                          port=resolver.port, timeout=2)
        assert {rr.to_text() for rrset in r.answer for rr in rrset} == {"a.test.", A}
        resolver.queries.clear()
        yield Internet(resolver, server, before)
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=10)
            for pipe in (server.stdout, server.stderr):
                if pipe is not None:
                    pipe.close()
        if resolver is not None:
            resolver.close()
        remove_fake_internet()
        assert not netns_exists() and not link_exists(HOST_VETH)



@pytest.fixture
def net_gurtd(fake_internet: Internet, new_gurtd: Callable[..., Gurtd]) -> Gurtd:
    """A gurtd whose DNS upstream is the tests' server, and whose owner lets granted names
    resolve into the fake internet's benchmarking network (special-use, refused otherwise)."""
    g = new_gurtd(env={"GURT_DNS_UPSTREAM": fake_internet.upstream})
    g.api("PUT", "/api/settings", {"dnsAllowedNets": ["198.18.0.0/24"]})
    return g


# Stand-ins: Droid, HTTP peers, Jira ##########################################################
###############################################################################################

def droid_events(part: str) -> list[dict[str, Any]]:
    """The stream-json events of one part of tests/fixtures/droid-stream.json."""
    return json.loads(Path(FIXTURES, "droid-stream.json").read_text())[part]["events"]


def droid_replay(lines: list[str], after_usage: str, first: str = "") -> str:
    """A droid script that does first, prints these stream-json lines, then (after the usage
    line, when a person may have paused it) does after_usage and prints the rest."""
    body = ["#!/bin/sh"] + ([first] if first else [])
    for line in lines:
        body.append("printf '%s\\n' " + shlex.quote(line))
        if '"token_usage_update"' in line:
            body += ["sleep 1", after_usage]
    return "\n".join(body) + "\n"


def droid_file(script: str) -> str:
    """script as an executable `droid` in a new folder of /var/tmp that a box user may read
    (the caller removes the folder; droid_installed does)."""
    directory = tempfile.mkdtemp(prefix="gurt-test-droid-", dir="/var/tmp")
    path = os.path.join(directory, "droid")
    Path(path).write_text(script)
    os.chmod(path, 0o755)
    os.chmod(directory, 0o755)
    return path


@contextlib.contextmanager
def droid_installed(g: Gurtd, script: str) -> Iterator[str]:
    """script as g's Droid CLI (droidPath) in the with block; its folder removed after."""
    path = droid_file(script)
    try:
        g.api("PUT", "/api/settings", {"droidPath": path})
        yield path
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@contextlib.contextmanager
def loopback_server(handle: Any) -> Iterator[tuple[http.server.HTTPServer, list[Any]]]:
    """A tiny HTTP server on 127.0.0.1 whose every GET/POST calls handle(req, seen)."""
    seen: list[Any] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            seen.append({"path": self.path, "headers": dict(self.headers)})
            handle(self)

        do_POST = do_GET

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, seen
    finally:
        server.shutdown()
        server.server_close()


def answer(req: http.server.BaseHTTPRequestHandler, status: int, body: bytes = b"",
           headers: dict[str, str] | None = None) -> None:
    req.send_response(status)
    for key, value in (headers or {}).items():
        req.send_header(key, value)
    req.send_header("Content-Length", str(len(body)))
    req.end_headers()
    req.wfile.write(body)


class JiraStandIn:
    """Jira Cloud REST API v3 as documented, on 127.0.0.1: POST /rest/api/3/search/jql, GET
    /rest/api/3/issue/{key}, POST .../comment (ADF body), GET/POST .../transitions; 401 for a
    wrong basic auth, and 429/503 answers the test asks for.  Every request is recorded."""

    def __init__(self, email: str, token: str) -> None:
        self.auth = "Basic " + base64.b64encode(f"{email}:{token}".encode()).decode()
        self.issues: dict[str, dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []
        self.fail_next: list[tuple[str, int]] = []      # (path prefix, status) answered once
        self.status: dict[str, str] = {}
        self.searching = threading.Event()   # a search arrived
        self.hold = threading.Event()        # searches are answered once it is set
        self.hold.set()
        self.lock = threading.Lock()
        self.raw: dict[str, bytes] = {}      # an issue answered with these bytes (hostile)
        self.trickle: dict[str, float] = {}  # an issue answered a byte every so many seconds
        self.closing = threading.Event()
        self.url = ""                        # once it serves

    def calls(self, method: str, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["method"] == method and
                    r["path"].split("?")[0] == path]

    def handle(self, req: http.server.BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        raw = req.rfile.read(length) if length else b""
        record = {"method": req.command, "path": req.path, "auth": req.headers.get(
            "Authorization"), "type": req.headers.get("Content-Type"),
                  "body": json.loads(raw) if raw else None}
        with self.lock:
            self.requests.append(record)
            failure = next((f for f in self.fail_next if req.path.startswith(f[0])), None)
            if failure:
                self.fail_next.remove(failure)
        if failure:
            return self.answer(req, failure[1], {"errorMessages": ["try later"]},
                               {"Retry-After": "1"})
        if req.headers.get("Authorization") != self.auth:
            return self.answer(req, 401, {"errorMessages": ["not authenticated"]})
        path = req.path.split("?")[0]
        parts = path.split("/")
        if req.command == "POST" and path == "/rest/api/3/search/jql":
            self.searching.set()
            self.hold.wait(60)
            keys = [k for k in self.issues if self.status[k] == "To Do"]
            return self.answer(req, 200, {"issues": [
                {"id": str(i), "key": k, "fields": {"summary": self.issues[k]["summary"]}}
                for i, k in enumerate(keys)], "isLast": True})
        if len(parts) >= 6 and parts[5] in self.issues:
            key = parts[5]
            if req.command == "GET" and len(parts) == 6 and key in self.trickle:
                return self.drip(req, self.trickle[key])
            if req.command == "GET" and len(parts) == 6 and key in self.raw:
                return answer(req, 200, self.raw[key], {"Content-Type": "application/json"})
            if req.command == "GET" and len(parts) == 6:
                return self.answer(req, 200, {"id": "1", "key": key,
                                              "fields": self.issues[key]})
            if req.command == "POST" and parts[6:] == ["comment"]:
                return self.answer(req, 201, {"id": "100", "body": record["body"]["body"]})
            if req.command == "GET" and parts[6:] == ["transitions"]:
                return self.answer(req, 200, {"transitions": [
                    {"id": "11", "name": "Start", "to": {"name": "In Progress"}},
                    {"id": "31", "name": "Finish", "to": {"name": "Done"}},
                    {"id": "41", "name": "Give up", "to": {"name": "Failed"}}]})
            if req.command == "POST" and parts[6:] == ["transitions"]:
                names = {"11": "In Progress", "31": "Done", "41": "Failed"}
                self.status[key] = names[record["body"]["transition"]["id"]]
                return self.answer(req, 204, None)
        return self.answer(req, 404, {"errorMessages": ["no such thing"]})

    def drip(self, req: http.server.BaseHTTPRequestHandler, every: float) -> None:
        """A Jira that sends its answer, status line and all, one byte at a time: no read
        of gurtd's ever waits long, yet the answer never ends."""
        data = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + \
            b"Content-Length: 100000\r\n\r\n" + b" " * 100_000
        for byte in data:
            if self.closing.wait(every):
                return
            try:
                req.wfile.write(bytes([byte]))
                req.wfile.flush()
            except OSError:
                return

    def answer(self, req: http.server.BaseHTTPRequestHandler, status: int, body: Any,
               headers: dict[str, str] | None = None) -> None:
        answer(req, status, json.dumps(body).encode() if body is not None else b"",
               {**(headers or {}), "Content-Type": "application/json"})


@contextlib.contextmanager
def jira_stand_in() -> Iterator[JiraStandIn]:
    jira = JiraStandIn("bot@example.com", "right-token")
    with loopback_server(jira.handle) as (server, _):
        jira.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield jira
        finally:
            jira.hold.set()                  # a held search ends too
            jira.closing.set()               # and a trickle


# Stored layers ###############################################################################
###############################################################################################

def registry(home: str) -> dict[str, Any]:
    """The merged layers gurtd has recorded (BOX_HOME/merged/<name>.json each)."""
    top = os.path.join(home, "merged")
    out = []
    for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
        if name.endswith(".json"):
            out.append(json.loads(Path(top, name).read_text()))
    return {"merged": out}



# 10,000 layers: made directly on disk with the structure gurtd makes (layers/<id>/upper and
# work owned by the store user, tasks/<id>.json in the Task record's format, doneSeq in order),
# because 10,000 real tasks would take too long for CI.

def make_done_layers(home: str, count: int) -> list[str]:
    """count done tasks of workspace home, each writing n<i>, every 1000th rewriting
    `shared`."""
    store = pwd.getpwnam("gurt-store")
    owner = (store.pw_uid, store.pw_gid)
    for sub in ("tasks", "logs", "layers", "workspaces/home"):
        os.makedirs(os.path.join(home, sub), exist_ok=True)
    os.chown(os.path.join(home, "workspaces", "home"), *owner)
    ids = []
    stamp = "2026-01-01T00:00:00Z"
    for i in range(1, count + 1):
        task_id = f"t{i:09d}"
        ids.append(task_id)
        layer = os.path.join(home, "layers", task_id)
        for sub in ("", "upper", "work"):
            os.makedirs(os.path.join(layer, sub), exist_ok=True)
            os.chown(os.path.join(layer, sub), *owner)
        for name, text in [(f"n{i}", f"{i}\n")] + [("shared", f"{i}\n")] * (i % 1000 == 0):
            path = os.path.join(layer, "upper", name)
            Path(path).write_text(text)
            os.chown(path, *owner)
        task = {"id": task_id, "title": "made on disk", "prompt": "true", "workspace": "home",
                "worker": "fake", "tools": [], "hosts": [], "budgetCents": 0, "source": "api",
                "state": "done", "user": f"box-{task_id}", "layers": [], "costCents": 0,
                "createdAt": stamp, "updatedAt": stamp, "seq": i, "doneSeq": i}
        Path(home, "tasks", task_id + ".json").write_text(json.dumps(task))
    return ids


@contextlib.contextmanager
def gurtd_on_done_layers(count: int, env: dict[str, str] | None = None
                         ) -> Iterator[tuple[Gurtd, list[str]]]:
    """A gurtd started on a BOX_HOME of count done layers made on disk: (gurtd, their ids)."""
    home = make_home()
    try:
        ids = make_done_layers(home, count)
    except BaseException:
        remove_home(home)
        raise
    with running_gurtd(env, home=home, timeout=60) as g:
        yield g, ids


# The browser #################################################################################
###############################################################################################

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

def chromium() -> tuple[Any, str]:
    """A headless Chromium under chromedriver with an empty profile of its own: (driver,
    profile dir).  The flags keep it off every network but loopback (no updates, sync, QUIC)."""
    assert webdriver is not None, "selenium is missing: pip install -r requirements-test.txt"
    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.access(path, os.X_OK), f"{path} is missing: apt-get install chromium " \
                                         "chromium-driver"
    profile = tempfile.mkdtemp(prefix="gurt-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--disable-breakpad",
                 f"--user-data-dir={profile}", "--window-size=1280,900"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # its HOME and caches in the profile too, so that nothing lands in root's home
    env = {**os.environ, "HOME": profile, "XDG_CONFIG_HOME": os.path.join(profile, "config"),
           "XDG_CACHE_HOME": os.path.join(profile, "cache")}
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER, env=env)
    return webdriver.Chrome(options=opts, service=service), profile


def quit_browser(driver: Any, profile: str) -> None:
    """Quit, and check that no process of this browser outlives it."""
    pid = driver.service.process.pid
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
    eventually(lambda: not os.path.exists(f"/proc/{pid}"), 10, "chromedriver to exit")
    left = subprocess.run(["pgrep", "-f", profile], capture_output=True, text=True).stdout.split()
    assert not left, f"browser processes left behind: {left}"


def sign_in_url(g: Gurtd) -> str:
    """What `gurtd portal` prints: a one-time sign-in URL."""
    out = subprocess.run([sys.executable, GURTD, "portal", "--listen", f"127.0.0.1:{g.port}",
                          "--box-home", g.home], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    url = out.stdout.strip()
    assert url.startswith(f"http://127.0.0.1:{g.port}/?code="), url
    return url


def sign_in(driver: Any, g: Gurtd) -> None:
    driver.get(sign_in_url(g))
    wait(driver, lambda d: d.find_element(By.ID, "top").is_displayed(), "the portal's pages")


def wait(driver: Any, check: Any, what: str, timeout: float = 20.0) -> Any:
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.02,
                             ignored_exceptions=(StaleElementReferenceException,)).until(check)
    except TimeoutException:
        raise AssertionError(f"timed out waiting for {what}; page:\n" +
                             driver.find_element(By.TAG_NAME, "body").text[:3000]) from None

