"""Bad input gets a clear JSON error and changes nothing.

A person (or a web page, or a confused script) talks to gurtd on 127.0.0.1.  Whatever they
send that gurtd must not accept -- a missing token, a foreign Host or Origin, a broken task, a
path out of the workspace, a stalled connection -- they get {"error": ...} back, and the box is
exactly as it was: the task list, BOX_HOME/tasks, logs, layers, workspaces and settings.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
from typing import Any, Iterator

import pytest

import gurtd as gurtd_module
from conftest import UNKNOWN_ID, Gurtd, eventually, put_base_file, recv_all

# One gurtd for this module (a stop costs ~0.6 s): every test here checks that its refused
# requests changed nothing, so they can share it.  The base of workspace home holds readme.txt.
SHARED_GURTD = True


@pytest.fixture(scope="module", autouse=True)
def readme(module_gurtd: Gurtd) -> None:
    put_base_file(module_gurtd, "home", "readme.txt", "hello\n")


@pytest.fixture(scope="module")
def done_task(module_gurtd: Gurtd) -> dict[str, Any]:
    """A task that ran and finished: the one the routes below may name."""
    task = module_gurtd.run_done("echo hello", title="a finished task")
    return task


# helpers ######################################################################################

def snapshot(g: Gurtd) -> dict[str, Any]:
    """What a bad request must not change: the API's view and the files under BOX_HOME."""
    tasks = g.api("GET", "/api/tasks", status=200)
    settings = g.api("GET", "/api/settings", status=200)
    files = {sub: sorted(os.listdir(os.path.join(g.home, sub)))
             for sub in ("tasks", "logs", "layers", "workspaces")}
    settings_file = os.path.join(g.home, "settings.json")
    on_disk = open(settings_file, "rb").read() if os.path.exists(settings_file) else None
    with open("/etc/passwd") as f:    # the task users of this gurtd (others may run too)
        box_users = sorted(line.split(":")[0] for line in f
                           if line.split(":")[4:5] == [f"gurt task in {g.home}"])
    return {"tasks": tasks, "settings": settings, "files": files, "settings.json": on_disk,
            "box users": box_users}


@contextlib.contextmanager
def changes_nothing(g: Gurtd) -> Iterator[None]:
    before = snapshot(g)
    yield
    assert snapshot(g) == before, "a refused request changed the box"


def assert_json_error(response: tuple[int, Any, dict[str, str]], status: int,
                      code: str | None = None) -> dict[str, Any]:
    got, data, headers = response
    assert got == status, (got, data)
    assert headers.get("content-type", "").split(";")[0] == "application/json", headers
    assert isinstance(data, dict), data
    assert isinstance(data.get("error"), str) and data["error"].strip(), data
    if code is not None:
        assert data.get("code") == code, data
    return data


def valid_body(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"title": "a task", "prompt": "echo hi", "worker": "fake"}
    body.update(fields)
    return body


def raw_exchange(port: int, data: bytes, timeout: float = 20.0) -> bytes:
    """Send bytes on a fresh connection and read until gurtd closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return recv_all(s)


def body_of(response: bytes) -> bytes:
    """The body of a raw response (http.server answers HTTP/0.9 style, body only, to lines it
    cannot parse)."""
    if response.startswith(b"HTTP/"):
        return response.partition(b"\r\n\r\n")[2]
    return response


# auth #########################################################################################

def test_health_needs_no_token(gurtd: Gurtd) -> None:
    assert gurtd.api("GET", "/api/health", token=False, status=200)["ok"] is True


BODIES = {   # what a caller with the token would send to each writing route
    ("POST", "/api/tasks"): valid_body(),
    ("POST", "/api/workspaces"): {"name": "sneaky"},
    ("PUT", "/api/settings"): {"maxRunningTasks": 1},
}


def protected_routes(task_id: str) -> list[tuple[str, str, Any]]:
    """Every route of gurtd's routing table but GET /api/health and the portal's open three
    (its page, sign-in, am-I-signed-in), with real values filled in (a route added later is
    covered too)."""
    out = []
    for route in gurtd_module.ROUTES:
        method, pattern = route.method, route.path
        if route.open:
            continue                # a hook delivery's credential is its signature instead
        path = pattern.replace("{id}", task_id).replace("{name}", "home") \
            .replace("{path}", "readme.txt")
        body = BODIES.get((method, pattern), {} if method in ("POST", "PUT", "PATCH") else None)
        out.append((method, path, body))
    return out


def test_the_auth_check_covers_the_routes_people_use(done_task: dict[str, Any]) -> None:
    covered = {(m, p) for m, p, _ in protected_routes(done_task["id"])}
    tid = done_task["id"]
    assert {("GET", "/api/tasks"), ("POST", "/api/tasks"), ("GET", f"/api/tasks/{tid}"),
            ("POST", f"/api/tasks/{tid}/undo"), ("POST", f"/api/tasks/{tid}/stop"),
            ("GET", f"/api/tasks/{tid}/log"), ("GET", f"/api/tasks/{tid}/changes"),
            ("GET", "/api/workspaces"), ("POST", "/api/workspaces"),
            ("GET", "/api/workspaces/home"), ("GET", "/api/workspaces/home/files"),
            ("GET", "/api/workspaces/home/files/readme.txt"), ("GET", "/api/settings"),
            ("PUT", "/api/settings"), ("GET", "/api/openapi.json")} <= covered


@pytest.mark.parametrize("authorization", [
    None, "Bearer wrong-token", "Bearer ", "{token}", "Bearer {token}x", "Basic {token}",
    "Bearer  {token}",
], ids=["missing", "wrong", "empty", "no-scheme", "token-plus-one", "basic", "two-spaces"])
def test_every_route_but_health_needs_the_bearer_token(gurtd: Gurtd, done_task: dict[str, Any],
                                                       authorization: str | None) -> None:
    task = done_task
    headers = {} if authorization is None else \
        {"Authorization": authorization.format(token=gurtd.token)}
    for method, path, body in protected_routes(task["id"]):
        with changes_nothing(gurtd):
            response = gurtd.request(method, path, body, headers=headers, token=False)
            assert_json_error(response, 401, "unauthorized")
    assert gurtd.task(task["id"])["state"] == "done"
    assert not os.path.exists(os.path.join(gurtd.home, "workspaces", "sneaky"))


def test_the_right_token_opens_every_route(gurtd: Gurtd, done_task: dict[str, Any]) -> None:
    for method, path, _ in protected_routes(done_task["id"]):
        if method != "GET" or path == "/api/events":   # a stream: tested with the broker
            continue
        status, data, _ = gurtd.request(method, path)
        if path.startswith(("/api/approvals/", "/api/schedules/")):   # past auth: no such one
            assert status == 404 and data["code"] == "not_found", (path, data)
            continue
        assert status == 200, (path, data)


# request guard ################################################################################

def test_a_foreign_host_header_is_refused_before_auth(gurtd: Gurtd) -> None:
    port = gurtd.port
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.1",
                 f"localhost.evil.example:{port}", f"127.0.0.2:{port}", f"0.0.0.0:{port}"):
        for path in ("/api/health", "/api/tasks"):
            with changes_nothing(gurtd):
                # with the right token: the guard still says no
                assert_json_error(gurtd.request("GET", path, headers={"Host": host}),
                                  403, "host_not_allowed")
                # without a token: the guard answers first, not auth
                assert_json_error(gurtd.request("GET", path, headers={"Host": host},
                                                token=False), 403, "host_not_allowed")
        with changes_nothing(gurtd):
            assert_json_error(gurtd.request("POST", "/api/tasks", valid_body(),
                                            headers={"Host": host}), 403, "host_not_allowed")


def test_a_request_without_host_header_is_refused(gurtd: Gurtd) -> None:
    with changes_nothing(gurtd):
        raw = raw_exchange(gurtd.port, b"GET /api/health HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 403"), raw
        data = json.loads(body_of(raw))
        assert data["code"] == "host_not_allowed", data


def test_the_three_local_host_names_are_accepted(gurtd: Gurtd) -> None:
    port = gurtd.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        gurtd.api("GET", "/api/tasks", headers={"Host": host}, status=200)
        gurtd.api("GET", "/api/health", headers={"Host": host}, token=False, status=200)


def test_a_foreign_origin_is_refused_before_auth(gurtd: Gurtd) -> None:
    port = gurtd.port
    for origin in ("http://evil.example", "null", f"http://evil.example:{port}",
                   f"http://127.0.0.1:{port + 1}", f"https://127.0.0.1:{port}",
                   f"http://127.0.0.1.evil.example:{port}"):
        with changes_nothing(gurtd):
            assert_json_error(gurtd.request("GET", "/api/tasks", headers={"Origin": origin}),
                              403, "cross_origin")
            assert_json_error(gurtd.request("GET", "/api/tasks", headers={"Origin": origin},
                                            token=False), 403, "cross_origin")
            # a web page that learnt the token still cannot create a task
            assert_json_error(gurtd.request("POST", "/api/tasks", valid_body(),
                                            headers={"Origin": origin}), 403, "cross_origin")
            assert_json_error(gurtd.request("PUT", "/api/settings", {"maxRunningTasks": 1},
                                            headers={"Origin": origin}), 403, "cross_origin")


def test_a_cross_site_fetch_is_refused(gurtd: Gurtd) -> None:
    for site in ("cross-site", "same-site", "Cross-Site"):
        with changes_nothing(gurtd):
            assert_json_error(gurtd.request("GET", "/api/tasks",
                                            headers={"Sec-Fetch-Site": site}), 403, "cross_origin")
            assert_json_error(gurtd.request("POST", "/api/tasks", valid_body(),
                                            headers={"Sec-Fetch-Site": site}, token=False),
                              403, "cross_origin")
            assert_json_error(gurtd.request("POST", "/api/tasks", valid_body(),
                                            headers={"Sec-Fetch-Site": site}), 403, "cross_origin")


def test_our_own_origin_and_same_origin_fetches_are_fine(gurtd: Gurtd) -> None:
    port = gurtd.port
    for headers in ({"Origin": f"http://127.0.0.1:{port}"},
                    {"Origin": f"http://localhost:{port}"},
                    {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"},
                    {"Sec-Fetch-Site": "none"}):
        gurtd.api("GET", "/api/tasks", headers=headers, status=200)
    task = gurtd.api("POST", "/api/tasks", valid_body(),
                     headers={"Origin": f"http://127.0.0.1:{port}"}, status=201)
    assert gurtd.wait(task["id"])["state"] == "done"


# POST /api/tasks ##############################################################################

BAD_RAW_BODIES = {
    "malformed JSON": b'{"title": "a task", "prompt": ',
    "not JSON at all": b"title=a&prompt=b",
    "an array": b'[{"title": "a task", "prompt": "echo hi", "worker": "fake"}]',
    "a string": b'"echo hi"',
    "a number": b"42",
    "null": b"null",
    "empty": b"",
    "only spaces": b"   \n",
    "budgetCents NaN": b'{"title": "t", "prompt": "p", "worker": "fake", "budgetCents": NaN}',
    "budgetCents Infinity":
        b'{"title": "t", "prompt": "p", "worker": "fake", "budgetCents": Infinity}',
}


@pytest.mark.parametrize("raw", BAD_RAW_BODIES.values(), ids=BAD_RAW_BODIES.keys())
def test_a_body_that_is_not_a_task_object_is_refused(gurtd: Gurtd, raw: bytes) -> None:
    with changes_nothing(gurtd):
        assert_json_error(gurtd.request("POST", "/api/tasks", raw=raw,
                                        headers={"Content-Type": "application/json"}), 400)


BAD_FIELDS: dict[str, tuple[dict[str, Any], str]] = {
    # case: (fields over a valid body, a word the error must name)
    "unknown field": ({"colour": "blue"}, "colour"),
    "title is a number": ({"title": 7}, "title"),
    "title is empty": ({"title": ""}, "title"),
    "title is blank": ({"title": "   "}, "title"),
    "prompt is a list": ({"prompt": ["echo hi"]}, "prompt"),
    "prompt is empty": ({"prompt": ""}, "prompt"),
    "tools is a string": ({"tools": "git"}, "tools"),
    "hosts is an object": ({"hosts": {"example.com": True}}, "hosts"),
    "budgetCents is a string": ({"budgetCents": "100"}, "budgetCents"),
    "budgetCents is true": ({"budgetCents": True}, "budgetCents"),
    "budgetCents is -1": ({"budgetCents": -1}, "budgetCents"),
    "worker robot": ({"worker": "robot"}, "worker"),
    "workspace ..": ({"workspace": ".."}, "workspace"),
    "workspace .": ({"workspace": "."}, "workspace"),
    "workspace a/b": ({"workspace": "a/b"}, "workspace"),
    "workspace %2e%2e": ({"workspace": "%2e%2e"}, "workspace"),
    "workspace empty": ({"workspace": ""}, "workspace"),
    "workspace missing": ({"workspace": "nope"}, "workspace"),
    "host empty": ({"hosts": [""]}, "hosts"),
    "host *": ({"hosts": ["*"]}, "hosts"),
    "host is a URL": ({"hosts": ["http://x.com"]}, "hosts"),
    "host with a space": ({"hosts": ["a b.com"]}, "hosts"),
    "host port 0": ({"hosts": ["x.com:0"]}, "hosts"),
    "host port 70000": ({"hosts": ["x.com:70000"]}, "hosts"),
    "host empty label": ({"hosts": ["x..com"]}, "hosts"),
    "a good host and a bad one": ({"hosts": ["example.com", "x..com"]}, "hosts"),
    "tool empty": ({"tools": [""]}, "tools"),
    "tool Wallet Pay": ({"tools": ["Wallet Pay"]}, "tools"),
}


@pytest.mark.parametrize("fields,named", BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_a_bad_task_field_is_refused_by_name(gurtd: Gurtd, fields: dict[str, Any],
                                             named: str) -> None:
    with changes_nothing(gurtd):
        data = assert_json_error(gurtd.request("POST", "/api/tasks", valid_body(**fields)), 400)
    assert named in data["error"], data


@pytest.mark.parametrize("fields, why", [
    ({"folder": "/home/me-nobody/notes"}, "folder /home/me-nobody/notes: does not exist"),
    ({"folders": ["notes"]}, "folder notes: must be an absolute path")],
    ids=["folder", "folders"])
def test_a_personal_folder_that_cannot_be_is_refused_by_name(
        gurtd: Gurtd, fields: dict[str, Any], why: str) -> None:
    with changes_nothing(gurtd):
        data = assert_json_error(gurtd.request("POST", "/api/tasks", valid_body(**fields)), 400)
    assert data["error"] == why, data


@pytest.mark.parametrize("size", [(1 << 20) + 1, 8 << 20], ids=["1MiB+1", "8MiB"])
def test_a_body_over_one_mebibyte_is_refused(gurtd: Gurtd, size: int) -> None:
    body = json.dumps(valid_body(prompt="echo " + "a" * size)).encode()[:size]
    assert len(body) == size
    head = (f"POST /api/tasks HTTP/1.1\r\nHost: 127.0.0.1:{gurtd.port}\r\n"
            f"Authorization: Bearer {gurtd.token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    with changes_nothing(gurtd):
        with socket.create_connection(("127.0.0.1", gurtd.port), timeout=20) as s:
            try:
                s.sendall(head + body)
            except (BrokenPipeError, ConnectionResetError):
                pass    # gurtd answered without reading it all; its answer is there to read
            response = http.client.HTTPResponse(s)
            response.begin()
            payload = response.read()
            headers = {k.lower(): v for k, v in response.getheaders()}
        assert_json_error((response.status, json.loads(payload), headers), 413)


def test_the_same_body_done_right_is_accepted(gurtd: Gurtd) -> None:
    """The refusals above are about the field, not the route.  (No hosts here: a task with
    hosts gets a network of its own, and this file sends nothing beyond 127.0.0.1.)"""
    task = gurtd.api("POST", "/api/tasks", valid_body(
        tools=["git", "web.fetch"], hosts=[], budgetCents=150, workspace="home"), status=201)
    assert gurtd.wait(task["id"])["state"] == "done"


# unknown ids and queries ######################################################################

@pytest.mark.parametrize("task_id", [UNKNOWN_ID, "nope"])
def test_an_unknown_task_id_is_a_plain_400(gurtd: Gurtd, done_task: dict[str, Any],
                                           task_id: str) -> None:
    for method, path in (("GET", f"/api/tasks/{task_id}"),
                         ("POST", f"/api/tasks/{task_id}/undo"),
                         ("POST", f"/api/tasks/{task_id}/stop")):
        with changes_nothing(gurtd):
            status, data, _ = gurtd.request(method, path)
        assert (status, data) == (400, {"error": "No task with this id"}), (method, path)


@pytest.mark.parametrize("query", ["state=bogus", "limit=0", "limit=1001", "limit=x",
                                   "limit=-1", "limit=1.5"])
def test_a_bad_task_list_query_is_refused(gurtd: Gurtd, done_task: dict[str, Any],
                                          query: str) -> None:
    with changes_nothing(gurtd):
        assert_json_error(gurtd.request("GET", f"/api/tasks?{query}"), 400)


def test_good_task_list_queries_answer(gurtd: Gurtd, done_task: dict[str, Any]) -> None:
    everything = gurtd.api("GET", "/api/tasks?limit=1000")
    assert done_task["id"] in [t["id"] for t in everything]
    for query, expected in (("state=done", [t for t in everything if t["state"] == "done"]),
                            ("limit=1", everything[:1]),
                            ("workspace=home", everything),
                            ("workspace=nope", [])):
        data = gurtd.api("GET", f"/api/tasks?{query}", status=200)
        assert [t["id"] for t in data] == [t["id"] for t in expected], query


def test_a_list_of_some_fields_holds_each_tasks_own_of_them_in_the_order_asked(
        gurtd: Gurtd, done_task: dict[str, Any]) -> None:
    """?fields=: each task as its whole form has it, cut to the fields asked, in their order;
    a field its whole form leaves out (error of a done task) is left out too."""
    failed = gurtd.run("exit 3")
    assert failed["state"] == "failed" and "error" not in done_task
    everything = gurtd.api("GET", "/api/tasks?limit=1000")
    asked = ("state", "error", "id", "layers", "step")
    data = gurtd.api("GET", f"/api/tasks?fields={','.join(asked)}&limit=1000", status=200)
    assert data == [{k: t[k] for k in asked if k in t} for t in everything]
    assert all(list(t) == [k for k in asked if k in t] for t in data)    # the order asked
    by_id = {t["id"]: t for t in data}
    assert by_id[failed["id"]]["error"] == failed["error"]
    assert by_id[done_task["id"]]["state"] == "done" and "error" not in by_id[done_task["id"]]


# routes and methods ###########################################################################

@pytest.mark.parametrize("method,path", [
    ("GET", "/portal.html"), ("GET", "/api"), ("GET", "/api/nope"),
    ("GET", "/api/tasks/{id}/bogus"),
    ("POST", "/api/health/x"), ("GET", "/api/workspaces/home/bogus"),
])
def test_an_unknown_route_is_a_json_404(gurtd: Gurtd, done_task: dict[str, Any], method: str,
                                        path: str) -> None:
    with changes_nothing(gurtd):
        assert_json_error(gurtd.request(method, path.format(id=done_task["id"])), 404)


@pytest.mark.parametrize("method,path,allowed", [
    ("DELETE", "/api/tasks", {"GET", "POST"}),
    ("PUT", "/api/tasks/{id}", {"GET"}),
    ("DELETE", "/api/tasks/{id}", {"GET"}),
    ("GET", "/api/tasks/{id}/undo", {"POST"}),
    ("PATCH", "/api/settings", {"GET", "PUT"}),
])
def test_a_wrong_method_is_a_405_with_allow(gurtd: Gurtd, done_task: dict[str, Any],
                                            method: str, path: str, allowed: set[str]) -> None:
    task = done_task
    with changes_nothing(gurtd):
        response = gurtd.request(method, path.format(id=task["id"]), valid_body())
        assert_json_error(response, 405)
    allow = {m.strip() for m in response[2].get("allow", "").split(",") if m.strip()}
    assert allow == allowed, response[2]
    assert gurtd.task(task["id"])["state"] == "done"


# settings #####################################################################################

@pytest.mark.parametrize("body", [
    {"bogus": 1}, {"maxRunningTasks": 4, "bogus": 1}, {"defaultBudgetCents": -1},
    {"defaultBudgetCents": "5"}, {"maxRunningTasks": 0}, {"maxRunningTasks": "3"},
    {"maxRunningTasks": 2.5}, {"maxRunningTasks": True}, {"defaultBudgetCents": 5,
                                                           "maxRunningTasks": 0},
    [], "maxRunningTasks",
], ids=["unknown-key", "good-and-unknown", "negative-budget", "budget-string", "max-0",
        "max-string", "max-float", "max-bool", "good-and-bad", "array", "string"])
def test_bad_settings_are_refused_and_nothing_moves(gurtd: Gurtd, body: Any) -> None:
    before = gurtd.api("GET", "/api/settings")
    with changes_nothing(gurtd):
        assert_json_error(gurtd.request("PUT", "/api/settings", body), 400)
    assert gurtd.api("GET", "/api/settings") == before


# workspaces ###################################################################################

@pytest.mark.parametrize("body,status", [
    ({"name": ".."}, 400), ({"name": "."}, 400), ({"name": "a/b"}, 400), ({"name": ""}, 400),
    ({"name": "../escape"}, 400), ({"name": 5}, 400), ({"name": "x", "extra": 1}, 400),
    ({}, 400), ({"name": "home"}, 409),
], ids=["dotdot", "dot", "slash", "empty", "dotdot-slash", "number", "extra-key", "no-name",
        "existing"])
def test_a_bad_workspace_name_is_refused(gurtd: Gurtd, body: dict[str, Any],
                                         status: int) -> None:
    outside = sorted(os.listdir(os.path.dirname(gurtd.home)))
    with changes_nothing(gurtd):
        assert_json_error(gurtd.request("POST", "/api/workspaces", body), status)
    assert sorted(os.listdir(os.path.dirname(gurtd.home))) == outside
    assert not os.path.exists(os.path.join(gurtd.home, "escape"))


def test_an_unknown_workspace_is_a_404(gurtd: Gurtd) -> None:
    for path in ("/api/workspaces/nope", "/api/workspaces/nope/files",
                 "/api/workspaces/nope/files/a.txt"):
        with changes_nothing(gurtd):
            assert_json_error(gurtd.request("GET", path), 404)


# path traversal ###############################################################################

def _link_in_base(g: Gurtd, name: str, target: str) -> None:
    import pwd
    store = pwd.getpwnam("gurt-store")
    path = os.path.join(g.home, "workspaces", "home", name)
    os.symlink(target, path)
    os.lchown(path, store.pw_uid, store.pw_gid)


def test_no_path_leaves_the_workspace(gurtd: Gurtd) -> None:
    put_base_file(gurtd, "home", "inside.txt", "inside\n")
    _link_in_base(gurtd, "passwd", "/etc/passwd")
    _link_in_base(gurtd, "token-link", "../../token")
    _link_in_base(gurtd, "etc", "/etc")
    _link_in_base(gurtd, "up", "..")
    # a task can plant links too; people then read its layer through the view
    gurtd.run_done("ln -s ../../../../token planted-token\nln -s /etc/passwd planted-passwd"
                   "\nln -s / planted-root")
    token = gurtd.token.encode()
    with open("/etc/passwd", "rb") as f:
        passwd_line = f.readline().strip()
    assert passwd_line
    paths = [
        "../../token", "%2e%2e/%2e%2e/token", "..%2f..%2ftoken", "%2e%2e%2f%2e%2e%2ftoken",
        "inside.txt/../../../token", "..%5c..%5ctoken", "passwd", "token-link", "etc/passwd",
        "etc", "up/token", "up", "planted-token", "planted-passwd", "planted-root/etc/passwd",
        "planted-root", "%2fetc%2fpasswd", "/etc/passwd",
    ]
    for rel in paths:
        with changes_nothing(gurtd):
            status, data, _ = gurtd.request("GET", f"/api/workspaces/home/files/{rel}")
        text = data if isinstance(data, bytes) else json.dumps(data).encode()
        assert token not in text, rel
        assert passwd_line not in text, rel
        assert status in (400, 404), (rel, status, data)
        assert isinstance(data, dict) and "error" in data, (rel, data)
    for name in ("%2e%2e", "..%2f..", "home%2f..%2f.."):
        status, data, _ = gurtd.request("GET", f"/api/workspaces/{name}/files/token")
        assert status in (400, 404), (name, status, data)
        assert token not in json.dumps(data).encode()
    # and the workspace itself still reads fine
    assert gurtd.file("home", "inside.txt") == b"inside\n"


# slow and broken clients ######################################################################

def test_a_stalled_client_does_not_block_others_and_is_cut_off(gurtd: Gurtd) -> None:
    port = gurtd.port
    head = (f"POST /api/tasks HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Length: 100\r\n").encode()
    stalled = {
        "no token": head + b"\r\n{",
        "with token": head + f"Authorization: Bearer {gurtd.token}\r\n\r\n{{".encode(),
    }
    closed_after: dict[str, float] = {}
    sent: list[str] = []
    before = snapshot(gurtd)

    def stall(name: str, data: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            start = time.monotonic()
            s.sendall(data)
            sent.append(name)
            try:
                while s.recv(65536):
                    pass
            except ConnectionResetError:
                pass
            closed_after[name] = time.monotonic() - start

    threads = [threading.Thread(target=stall, args=item) for item in stalled.items()]
    for t in threads:
        t.start()
    # both stalled connections are in place (not 0.3 s after their threads began: on a busy
    # machine they may not be yet, and the answers below would be to an unstalled gurtd)
    eventually(lambda: len(sent) == len(stalled), 10, "the stalled connections")
    time.sleep(0.3)
    for _ in range(5):   # meanwhile, gurtd answers everyone else at once
        start = time.monotonic()
        status, data, _ = gurtd.request("GET", "/api/health", token=False)
        assert status == 200 and data["ok"] is True, data
        gurtd.api("GET", "/api/tasks", status=200)
        assert time.monotonic() - start < 1.0
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=25)
        assert not t.is_alive(), "a stalled connection was never closed"
    for name, seconds in closed_after.items():
        assert seconds < 15.0, (name, seconds)
    assert snapshot(gurtd) == before


@pytest.mark.parametrize("line", [b"GARBAGE\r\n\r\n", b"GET /api/health HTTP/1.1 extra\r\n\r\n",
                                  b"GET /api/health HTTP/2.0\r\n\r\n"],
                         ids=["garbage", "four-words", "http2"])
def test_a_malformed_request_line_gets_a_json_error(gurtd: Gurtd, line: bytes) -> None:
    with changes_nothing(gurtd):
        raw = raw_exchange(gurtd.port, line)
    data = json.loads(body_of(raw))
    assert isinstance(data, dict) and isinstance(data.get("error"), str) and data["error"], raw
    gurtd.api("GET", "/api/health", token=False, status=200)


# grants into special-use space ################################################################
# Each entry, and the network its refusal must name: the absolute special-use networks (the
# host itself, the task networks, link-local metadata services, multicast, reserved), every
# network that holds one (0.0.0.0/0, 0.0.0.0/1, 96.0.0.0/3, 128.0.0.0/1), and their IPv6 forms.
SPECIAL_ENTRIES = [
    ("169.254.77.1", "169.254.0.0/16"), ("169.254.169.254:80", "169.254.0.0/16"),
    ("169.254.0.0/16", "169.254.0.0/16"), ("127.0.0.1", "127.0.0.0/8"),
    ("127.8.9.10/31", "127.0.0.0/8"), ("0.0.0.0", "0.0.0.0/8"), ("0.1.2.3:22", "0.0.0.0/8"),
    ("100.64.0.1", "100.64.0.0/10"), ("100.127.255.254/31", "100.64.0.0/10"),
    ("224.0.0.251", "224.0.0.0/4"), ("239.255.255.250:1900", "224.0.0.0/4"),
    ("240.0.0.1", "240.0.0.0/4"), ("255.255.255.255", "255.255.255.255/32"),
    ("0.0.0.0/0", "0.0.0.0/8"), ("0.0.0.0/1", "127.0.0.0/8"), ("96.0.0.0/3", "100.64.0.0/10"),
    ("128.0.0.0/1", "169.254.0.0/16"), ("100.0.0.0/8", "100.64.0.0/10"),
    ("::1", "::1/128"), ("[::1]:8080", "::1/128"), ("::/0", "::/128"), ("fe80::1", "fe80::/10"),
    ("fd12:3456::1", "fc00::/7"), ("ff02::fb", "ff00::/8"),
    ("::ffff:169.254.169.254", "169.254.0.0/16"), ("::ffff:127.0.0.1", "127.0.0.0/8"),
]


def hook_delivery(g: Gurtd, hosts: list[str]) -> tuple[int, Any, dict[str, str]]:
    """A signed delivery to the module's hook "special" (its deliveries may set hosts)."""
    secret = g.special_hook_secret          # type: ignore[attr-defined]
    raw = json.dumps({"title": "t", "prompt": "p", "hosts": hosts}).encode()
    delivery, stamp = os.urandom(8).hex(), str(int(time.time()))
    return g.request("POST", "/api/hooks/special", token=False, raw=raw, headers={
        "Content-Type": "application/json", "X-Gurt-Delivery": delivery,
        "X-Gurt-Timestamp": stamp, "X-Gurt-Signature": gurtd_module.hook_signature(
            secret, stamp, delivery, raw)})


GRANT_ENTRY_POINTS: dict[str, Any] = {   # every place a grant is made, given one entry
    "task": lambda g, e: g.request("POST", "/api/tasks", valid_body(hosts=[e])),
    "hook": lambda g, e: g.request("POST", "/api/hooks", {
        "name": "special2", "source": "special", "task": {"worker": "fake", "hosts": [e]}}),
    "hook delivery": lambda g, e: hook_delivery(g, [e]),
    "schedule": lambda g, e: g.request("POST", "/api/schedules", {
        "name": "s", "cron": "0 3 * * *", "task": {"prompt": "p", "worker": "fake",
                                                   "hosts": [e]}}),
    "policy": lambda g, e: g.request("POST", "/api/policies", {
        "tool": "host", "scope": "box", "host": e}),
    "droidHosts": lambda g, e: g.request("PUT", "/api/settings", {"droidHosts": [e]}),
    "jira": lambda g, e: g.request("PUT", "/api/settings", {"jira": {
        "baseUrl": "http://127.0.0.1:9", "email": "a@example.com", "jql": "x", "hosts": [e]}}),
    "dnsAllowedNets": lambda g, e: g.request("PUT", "/api/settings", {"dnsAllowedNets": [
        e if "/" in e else e + "/32"]}),
}


@pytest.mark.parametrize("where", GRANT_ENTRY_POINTS)
def test_no_grant_opens_special_use_space_wherever_it_is_made(gurtd: Gurtd, where: str) -> None:
    """hosts: ["169.254.77.1"] let a task reach a link-local server (a cloud's metadata
    service), and a signed hook delivery could ask for it too: every entry point refuses
    each such entry with a 400 naming the network, and nothing changes."""
    if not hasattr(gurtd, "special_hook_secret"):
        gurtd.special_hook_secret = gurtd.api(       # type: ignore[attr-defined]
            "POST", "/api/hooks", {"name": "special", "source": "special",
                                   "task": {"worker": "fake"}, "allow": ["hosts"]},
            status=201)["secret"]
    entries = [(e, net) for e, net in SPECIAL_ENTRIES
               if where != "dnsAllowedNets" or (":" not in e)]   # IPv4 networks only
    others = [gurtd.api("GET", path) for path in ("/api/hooks", "/api/schedules",
                                                  "/api/policies")]
    with changes_nothing(gurtd):
        for entry, network in entries:
            data = assert_json_error(GRANT_ENTRY_POINTS[where](gurtd, entry), 400)
            assert network in data["error"], (where, entry, data)
    assert [gurtd.api("GET", path) for path in ("/api/hooks", "/api/schedules",
                                                "/api/policies")] == others
