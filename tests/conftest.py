"""Fixtures: a real gurtd on a free port with a temporary BOX_HOME, and a client for it.

The suite runs as root on a throwaway machine: real users, real overlay mounts, real
namespaces.  Under CI=true a missing prerequisite is a failure, never a skip.
GURT_TEST_UNIT_CAPS=1 starts every gurtd with only gurtd.service's capabilities (setpriv).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import py_compile
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GURTD = os.path.join(ROOT, "gurtd.py")
# Every gurtd the tests start runs `python -m gurtd`, which reads this cached bytecode
# (written even under PYTHONDONTWRITEBYTECODE) instead of compiling the module again.
py_compile.compile(GURTD, doraise=True)
sys.path.insert(0, ROOT)

TERMINAL = ("done", "failed", "undone")


def unit_bounding_set() -> str:
    """gurtd.service's CapabilityBoundingSet= as setpriv's --bounding-set takes it."""
    caps: list[str] = []
    with open(os.path.join(ROOT, "gurtd.service")) as f:
        for line in f:
            if line.startswith("CapabilityBoundingSet="):
                caps += line.split("=", 1)[1].split()
    return ",".join(["-all"] + ["+" + c.lower().removeprefix("cap_") for c in caps])


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.geteuid() != 0:
        pytest.exit("the gurtd suite runs as root (sudo make test)", returncode=1)


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
        if env.get("GURT_TEST_UNIT_CAPS") == "1":   # only the unit's capabilities, as under it
            argv = ["setpriv", "--bounding-set", unit_bounding_set()] + argv
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=ROOT)
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
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    # requests
    def connection(self, timeout: float = 30.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

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

    def api(self, method: str, path: str, body: Any = None, status: int | None = None) -> Any:
        code, data, _ = self.request(method, path, body)
        if status is not None:
            assert code == status, (code, data)
        else:
            assert 200 <= code < 300, (code, data)
        return data

    def create(self, prompt: str, **fields: Any) -> dict[str, Any]:
        body = {"title": fields.pop("title", "test task"), "prompt": prompt, "worker": "fake"}
        body.update(fields)
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

    def log(self, task_id: str) -> list[dict[str, Any]]:
        code, data, _ = self.request("GET", f"/api/tasks/{task_id}/log")
        assert code == 200, data
        return [json.loads(line) for line in data.decode().splitlines()]

    def output(self, task_id: str) -> list[str]:
        return [e["text"] for e in self.log(task_id) if e["type"] == "stdout"]

    def file(self, workspace: str, path: str) -> bytes | None:
        code, data, _ = self.request("GET", f"/api/workspaces/{workspace}/files/{path}")
        if code == 404:
            return None
        assert code == 200, (code, data)
        return data

    def worker_pids(self, task: dict[str, Any]) -> list[int]:
        """Live processes of a task's user."""
        import gurtd
        import pwd
        try:
            uid = pwd.getpwnam(task["user"]).pw_uid
        except KeyError:
            return []
        return gurtd.processes_by_uid({uid}).get(uid, [])


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


def make_home() -> str:
    base = tempfile.mkdtemp(prefix="gurt-test-", dir="/var/tmp")
    return os.path.join(base, "box")


def remove_home(home: str) -> None:
    shutil.rmtree(os.path.dirname(home), ignore_errors=True)


@contextlib.contextmanager
def running_gurtd(env: dict[str, str] | None = None) -> Iterator[Gurtd]:
    """A running gurtd with a fresh BOX_HOME; stopped (it must exit 0) and removed after."""
    g = Gurtd(make_home(), env)
    g.start()
    try:
        yield g
    finally:
        if g.proc is not None:
            code = g.stop()
            assert code == 0, f"gurtd exited with {code}:\n{g.log_text()}"
        remove_home(g.home)


@pytest.fixture
def gurtd() -> Iterator[Gurtd]:
    """A running gurtd with a fresh BOX_HOME; stopped and removed afterwards."""
    with running_gurtd() as g:
        yield g


@pytest.fixture
def new_gurtd() -> Iterator[Any]:
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


def put_base_file(g: Gurtd, workspace: str, rel: str, content: str) -> None:
    """Put a file into a workspace's base as its owner would, owned by the store user."""
    import pwd
    store = pwd.getpwnam("gurt-store")
    path = os.path.join(g.home, "workspaces", workspace, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(content)
    base = os.path.join(g.home, "workspaces", workspace)
    for root, dirs, files in os.walk(base):
        for name in dirs + files:
            os.chown(os.path.join(root, name), store.pw_uid, store.pw_gid)
