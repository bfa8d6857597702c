"""Red team, from outside: a hostile Jira, hook senders, browsers and operator accidents.

Each test is an attack someone outside the box could make (or an accident an operator
could have) and the effect gurtd must not let it have.  Peers are the tests' own servers on
127.0.0.1; nothing leaves the machine.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import time
from typing import Any, Iterator

import pytest

import gurtd as G
from conftest import (answer, eventually, gurtd_on_small_disk, jira_stand_in, loopback_server,
                      running_gurtd)


class BoxStandIn:
    """The part of the box a Jira uses: its settings, and a loop whose call and report run at
    once."""
    settings: dict[str, Any] = {}
    stopping = False

    def __init__(self) -> None:
        self.loop = self

    def setting(self, key: str | None = None) -> Any:
        return self.settings.get(key) if key else self.settings

    def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    report = call

    def stopped(self) -> bool:
        return self.stopping


@pytest.mark.pure
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_jira_that_redirects_elsewhere_never_gets_the_token_sent_there(status: int) -> None:
    """A hostile (or hijacked) Jira answers with a redirect to a host of its choosing: urllib
    would follow it with the Authorization header, handing the API token to that host."""
    with loopback_server(lambda req: answer(req, 200, b"{}")) as (thief, stolen):
        elsewhere = f"http://localhost:{thief.server_address[1]}/collect"
        with loopback_server(lambda req: answer(req, status, b"",
                                                {"Location": elsewhere})) as (jira, asked):
            config = {"baseUrl": f"http://127.0.0.1:{jira.server_address[1]}",
                      "email": "bot@example.com"}
            for method, path, body in (("GET", "/rest/api/3/issue/GT-1", None),
                                       ("POST", "/rest/api/3/search/jql", {"jql": "x"})):
                with pytest.raises(G.JiraError) as caught:
                    G.jira_request(config, "the-secret-token", method, path, body)
                assert "redirect" in str(caught.value) and caught.value.status == status
            assert len(asked) == 2 and asked[0]["headers"].get("Authorization")
            assert stolen == []                 # the other host never heard of us


@pytest.mark.pure
def test_an_issue_of_nested_lists_cannot_blow_up_its_prompt() -> None:
    """An issue's description is anyone's text: a million lines inside lists nested as deep
    as the JSON bound lets them would be indented again at every level, a prompt (and a loop
    thread's work) thirty times the issue's size.  What comes out is bounded by the cap."""
    node: dict[str, Any] = {"type": "text", "text": "a\n" * 1_000_000}
    for _ in range(15):
        node = {"type": "bulletList", "content": [{"type": "listItem", "content": [node]}]}
    raw = json.dumps({"type": "doc", "version": 1, "content": [node]})
    doc = G.loads_bounded(raw)                  # the bound Jira's answers are read with
    text = G.adf_text(doc)
    assert len(text) <= 2 * G.JIRA_TEXT_MAX
    assert text.startswith("- - - ") and "a\n" in text
    # a plain nested list still reads as before
    small = {"type": "bulletList", "content": [{"type": "listItem", "content": [
        {"type": "bulletList", "content": [{"type": "listItem", "content": [
            {"type": "paragraph", "content": [{"type": "text", "text": "x\ny"}]}]}]}]}]}
    assert G.adf_text(small).strip() == "- - x\n    y"


def test_a_name_with_a_trailing_newline_is_refused_everywhere_a_name_is_checked() -> None:
    """Python's `$` also matches before a final newline, so `^[\\w.-]+$` let "demo\\n" through:
    a workspace folder, a hook URL, a tool and a policy named with a newline, and a Jira
    search answer whose key "GT-1\\n" then broke every request line (the intake wedged)."""
    for pattern, good in ((G.JIRA_KEY_RE, "GT-1"), (G.WORKSPACE_RE, "demo"),
                          (G.HOOK_NAME_RE, "gh"), (G.TOOL_RE, "fs.read"),
                          (G.ID_RE, "t123456789"), (G.POLICY_ID_RE, "p123456789"),
                          (G.SCHEDULE_ID_RE, "s123456789")):
        assert pattern.fullmatch(good)
    assert not G.valid_workspace_name("demo\n")
    with running_gurtd() as g:
        before = sorted(os.listdir(os.path.join(g.home, "workspaces")))
        for path, body in (("/api/workspaces", {"name": "demo\n"}),
                           ("/api/hooks", {"name": "gh\n", "source": "gh",
                                           "task": {"worker": "fake"}}),
                           ("/api/tasks", {"title": "t", "prompt": "true", "worker": "fake",
                                           "tools": ["fs.read\n"]}),
                           ("/api/tasks", {"title": "t", "prompt": "true", "worker": "fake",
                                           "workspace": "home\n"}),
                           ("/api/policies", {"tool": "fs.read\n", "scope": "box"}),
                           ("/api/policies", {"tool": "fs.read", "scope": "task",
                                              "task": "t123456789\n"})):
            code, data, _ = g.request("POST", path, body)
            assert code == 400 and "error" in data, (path, body, code, data)
        assert sorted(os.listdir(os.path.join(g.home, "workspaces"))) == before
        assert g.api("GET", "/api/hooks") == [] and g.api("GET", "/api/tasks") == []
        assert g.api("GET", "/api/policies") == []
    with jira_search_answering(["GT-1\n", "GT-2"]) as (config, asked):
        assert one_poll_takes(config) == ["GT-2"]        # no error: GT-1\n is not a key
        assert [r["path"] for r in asked][1:] == ["/rest/api/3/issue/GT-2?fields=summary,"
                                                  "description"]


@contextlib.contextmanager
def jira_search_answering(keys: list[str]) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """A Jira whose search answers these keys and whose issues are all {summary: x}."""
    def handle(req: http.server.BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        req.rfile.read(length)
        if req.path.startswith("/rest/api/3/search/jql"):
            answer(req, 200, json.dumps({"issues": [{"key": k} for k in keys]}).encode())
        else:
            answer(req, 200, json.dumps({"fields": {"summary": "x"}}).encode())
    with loopback_server(handle) as (server, asked):
        yield {"baseUrl": f"http://127.0.0.1:{server.server_address[1]}",
               "email": "bot@example.com", "jql": "x"}, asked


def one_poll_takes(config: dict[str, Any]) -> list[str]:
    """The keys of the issues one poll of this Jira takes (for tasks), in order."""
    taken: list[str] = []
    jira = G.Jira(BoxStandIn())                     # type: ignore[arg-type]
    jira.token = lambda: "t"                         # type: ignore[method-assign]
    jira.take = lambda key, fields: taken.append(key)  # type: ignore[method-assign]
    jira.poll(config)
    return taken


@pytest.mark.pure
def test_a_jira_asking_to_be_left_alone_for_centuries_is_asked_again_within_the_backoff() -> None:
    """A hostile Jira answers 429 with Retry-After: 99999999999.  Obeyed as is, the poll
    thread died (Event.wait overflows) or would sleep for years: no issue taken, no ended
    task answered, until gurtd restarts.  It is capped at the backoff's maximum."""
    searches: list[int] = []

    def handle(req: http.server.BaseHTTPRequestHandler) -> None:
        req.rfile.read(int(req.headers.get("Content-Length") or 0))
        searches.append(1)
        if len(searches) == 1:
            answer(req, 429, b"{}", {"Retry-After": "99999999999"})
        else:
            answer(req, 200, b'{"issues": []}')

    with loopback_server(handle) as (server, _):
        config = {"baseUrl": f"http://127.0.0.1:{server.server_address[1]}",
                  "email": "bot@example.com", "jql": "x", "enabled": True, "pollSeconds": 10}
        box = BoxStandIn()
        box.settings = {"jira": config}
        jira = G.Jira(box)                              # type: ignore[arg-type]
        jira.token = lambda: "t"                         # type: ignore[method-assign]
        jira.start()
        try:
            deadline = time.monotonic() + 10
            while not searches and time.monotonic() < deadline:
                time.sleep(0.05)
            assert searches
            time.sleep(0.5)
            assert jira.thread is not None and jira.thread.is_alive()
            jira.wake.set()                  # what a settings change or an ended task does
            while len(searches) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(searches) == 2
        finally:
            box.stopping = True
            jira.stop()
        assert not jira.thread.is_alive()


def portal_sign_in(g: Any) -> tuple[str, str]:
    """A browser signs in with the token pasted into the portal: (its cookie, session id)."""
    code, data, headers = g.request("POST", "/api/sessions", {"token": g.token},
                                    headers={"X-Gurt-Portal": "1"}, token=False)
    assert code == 201, (code, data)
    cookie = headers["set-cookie"].split(";")[0]
    code, me, _ = g.request("GET", "/api/sessions/current", headers={"Cookie": cookie},
                            token=False)
    assert me["signedIn"], me
    return cookie, me["session"]["id"]


def test_a_stolen_session_revoked_on_a_full_disk_is_not_back_after_a_restart() -> None:
    """The owner revokes a stolen portal session while BOX_HOME is full: 507.  The revoke
    must then have changed nothing (before, it was gone in memory only: the retry said 404,
    "no session", and the next restart brought the thief's cookie back to life)."""
    with gurtd_on_small_disk() as (g, disk):
        stolen, stolen_id = portal_sign_in(g)
        disk.fill()
        try:
            code, data, _ = g.request("DELETE", f"/api/sessions/{stolen_id}")
            assert code == 507 and data["code"] == "insufficient_storage", (code, data)
            code, data, headers = g.request("POST", "/api/sessions", {"token": g.token},
                                            headers={"X-Gurt-Portal": "1"}, token=False)
            assert code == 507 and "set-cookie" not in headers, (code, data)
            # nothing changed: the session is listed and still signed in
            assert [s["id"] for s in g.api("GET", "/api/sessions")] == [stolen_id]
        finally:
            disk.free()
        assert g.api("DELETE", f"/api/sessions/{stolen_id}") == {"revoked": stolen_id}
        g.restart(kill=True)
        g.api("GET", "/api/tasks", headers={"Cookie": stolen}, token=False, status=401)
        assert g.api("GET", "/api/sessions") == []


def test_a_policy_expiring_at_the_edge_of_the_calendar_is_a_400_not_a_crash() -> None:
    """expiresAt of year 1 at +01:00 (or 9999-12-31 at -01:00) parses, but is no time in
    UTC: the policy's check crashed with OverflowError, a 500 for bad input."""
    with running_gurtd() as g:
        for when in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"):
            code, data, _ = g.request("POST", "/api/policies", {
                "tool": "fs.read", "scope": "box", "expiresAt": when})
            assert code == 400 and "expiresAt" in data["error"], (when, code, data)
        assert g.api("GET", "/api/policies") == []
        made = g.api("POST", "/api/policies", {"tool": "fs.read", "scope": "box",
                                               "expiresAt": "9999-12-31T00:00:00+01:00"})
        assert made["expiresAt"] == "9999-12-30T23:00:00Z" and made["active"]


@pytest.mark.pure
def test_a_jira_answering_thousands_of_issues_starts_at_most_a_page_of_them_per_poll() -> None:
    """gurtd asks for JIRA_MAX_ISSUES issues; a hostile Jira answers 2,000 keys (and some
    twice).  Each would be read and made a task in one poll, the loop saving jira.json
    after each: a task flood.  A poll takes at most the page it asked for, each key once."""
    keys = [f"GT-{n}" for n in range(1, 2001)]
    with jira_search_answering(keys[:3] + keys) as (config, asked):
        assert one_poll_takes(config) == keys[:G.JIRA_MAX_ISSUES]
        assert len(asked) == 1 + G.JIRA_MAX_ISSUES


def test_an_issue_whose_list_starts_at_x_still_becomes_its_task() -> None:
    """An ordered list's `order` is whatever the issue's author sent through Jira's API:
    "x" or {} raised in the middle of taking the issue, after it was recorded, so the issue
    stayed taken without a task (and without a comment) for good."""
    odd = [{"type": "orderedList", "attrs": {"order": order}, "content": [
        {"type": "listItem", "content": [{"type": "paragraph", "content": [
            {"type": "text", "text": "echo from a list"}]}]}]}
        for order in ("x", {}, [1], 10**30, True)]
    assert all(G.adf_text(doc).strip() == "1. echo from a list" for doc in odd)
    with jira_stand_in() as jira, running_gurtd() as g:
        jira.issues["GT-9"] = {"summary": "Odd list", "description": {
            "type": "doc", "version": 1, "content": odd[:1]}}
        jira.status["GT-9"] = "To Do"
        g.api("PUT", "/api/settings", {"jira": {
            "baseUrl": jira.url, "email": "bot@example.com", "token": "right-token",
            "jql": "labels = gurt", "worker": "fake", "pollSeconds": 10}})
        task = eventually(lambda: [t for t in g.api("GET", "/api/tasks")
                                   if t["source"] == "jira:GT-9"], what="the GT-9 task")[0]
        assert task["prompt"] == "1. echo from a list"
        g.wait(task["id"])


def test_a_task_file_of_many_names_comes_out_once_in_an_archive() -> None:
    """A hostile task writes a megabyte of noise and gives it 60 more names (hard links cost
    nothing).  The owner downloads its changes to review them: each name used to carry the
    whole data, 61 MB for 1 MB written (a gigabyte times 10,000 names fills the reviewer's
    disk).  The data goes in once; the other names come out as hard links, and back in."""
    import io
    import tarfile
    with running_gurtd() as g:
        t = g.run_done("head -c 1000000 /dev/urandom > noise\n"
                       "for i in $(seq 1 60); do ln noise name$i; done\n"
                       "echo small > other", title="many names")
        for path in (f"/api/tasks/{t['id']}/archive", "/api/workspaces/home/archive"):
            body = g.api("GET", path, status=200)
            assert len(body) < 3_000_000, len(body)
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
                members = {m.name: m for m in tar.getmembers()}
            regular = [m for m in members.values() if m.isreg() and m.size == 1_000_000]
            links = [m for m in members.values() if m.islnk()]
            assert len(regular) == 1 and len(links) == 60
            assert {m.linkname for m in links} == {regular[0].name}
        # what came out goes back in: every name, one file
        g.api("POST", "/api/workspaces", {"name": "copy"}, status=201)
        task = g.api("POST", "/api/workspaces/copy/upload", raw=body,
                     headers={"Content-Type": "application/gzip"}, status=201)
        upper = os.path.join(g.home, "layers", task["id"], "upper")
        inodes = {os.stat(os.path.join(upper, n)).st_ino
                  for n in ["noise"] + [f"name{i}" for i in range(1, 61)]}
        assert len(inodes) == 1
        assert g.file("copy", "other") == b"small\n"
