"""The API always answers, and answers right: told with raw sockets, as an attacker would.

A request on a kept-alive connection is judged on its own, never on the bytes another request
left behind; a client that drips bytes is cut off once the whole request is late; a body that
is not a JSON object, or nests too deep, is a 400 on every route; any method on a known path
gets 405 with Allow; a busy loop answers 503 instead of dropping the connection; every state a
task takes is an event, and a reconnecting browser (Last-Event-ID) misses none.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Any

import pytest

import gurtd as G
from conftest import UNKNOWN_ID, Gurtd, eventually, recv_all

DEADLINE = 3.0          # GURT_REQUEST_DEADLINE of this module's gurtd
# One gurtd for the module, with a short whole-request deadline; each test checks that what
# it refused changed nothing.
SHARED_GURTD = True
GURTD_ENV = {"GURT_REQUEST_DEADLINE": str(DEADLINE)}


# raw HTTP #####################################################################################

def head(g: Gurtd, method: str, path: str, body: bytes = b"", token: bool = True,
         extra: str = "", close: bool = False) -> bytes:
    """One request's bytes, with a Content-Length for its body."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{g.port}"]
    if token:
        lines.append(f"Authorization: Bearer {g.token}")
    if body:
        lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode() + body


def read_responses(sock: socket.socket, limit: float = 15.0) -> list[tuple[int, dict[str, str],
                                                                             bytes]]:
    """Every response on the connection until gurtd closes it: (status, headers, body)."""
    data = recv_all(sock, limit, reset_ends=True)
    out = []
    while data:
        top, sep, data = data.partition(b"\r\n\r\n")
        assert sep, top
        status_line, *header_lines = top.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in header_lines)}
        length = int(headers.get("content-length", "0"))
        out.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return out


def exchange(g: Gurtd, data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    with socket.create_connection(("127.0.0.1", g.port), timeout=15) as s:
        s.sendall(data)
        return read_responses(s)


def smuggled(g: Gurtd) -> bytes:
    """A request hidden in a body: with the token, it would set maxRunningTasks to 7."""
    body = b'{"maxRunningTasks": 7}'
    return head(g, "PUT", "/api/settings", body)


# 7. keep-alive never desyncs #################################################################

CARRIERS = {   # a first request that is refused (or ignores its body), with a body
    "401 no token": ("POST", "/api/tasks", False, ""),
    "403 foreign origin": ("POST", "/api/tasks", True, "Origin: http://evil.example\r\n"),
    "403 foreign host": ("POST", "/api/tasks", True, "Host: evil.example\r\n"),
    "404 unknown route": ("POST", "/api/nope", True, ""),
    "405 wrong method": ("DELETE", "/api/tasks", True, ""),
    "400 bad query": ("GET", "/api/tasks?limit=0", True, ""),
    "200 GET with a body": ("GET", "/api/health", False, ""),
    "200 undo ignores its body": ("POST", f"/api/tasks/{UNKNOWN_ID}/undo", True, ""),
}


@pytest.mark.parametrize("method,path,token,extra", CARRIERS.values(), ids=CARRIERS.keys())
def test_a_body_is_never_taken_for_the_next_request(gurtd: Gurtd, method: str, path: str,
                                                    token: bool, extra: str) -> None:
    before = gurtd.api("GET", "/api/settings")
    first = head(gurtd, method, path, smuggled(gurtd), token=token, extra=extra)
    if extra.startswith("Host:"):       # the foreign Host replaces ours
        first = first.replace(f"Host: 127.0.0.1:{gurtd.port}\r\n".encode(), b"", 1)
    last = head(gurtd, "GET", "/api/health", token=False, close=True)
    responses = exchange(gurtd, first + last)
    # the smuggled PUT was not answered, nor carried out
    assert not [r for r in responses if b"maxRunningTasks" in r[2]], responses
    assert gurtd.api("GET", "/api/settings") == before
    assert 1 <= len(responses) <= 2, responses
    assert responses[0][0] != 500, responses
    if len(responses) == 2:     # kept alive: the next request is the one after the body
        assert responses[1][0] == 200 and json.loads(responses[1][2])["ok"] is True
    else:
        assert responses[0][1].get("connection") == "close", responses


def test_a_chunked_body_is_answered_then_the_connection_closes(gurtd: Gurtd) -> None:
    before = gurtd.api("GET", "/api/settings")
    inner = smuggled(gurtd)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
    for method, path in (("POST", "/api/tasks"), ("GET", "/api/tasks"),
                         ("POST", "/api/nope")):
        first = head(gurtd, method, path, extra="Transfer-Encoding: chunked\r\n") + chunked
        responses = exchange(gurtd, first + head(gurtd, "GET", "/api/health"))
        assert len(responses) == 1, responses
        status, headers, body = responses[0]
        assert status in (404, 411), responses
        assert headers["connection"] == "close" and "error" in json.loads(body)
    assert gurtd.api("GET", "/api/settings") == before


def test_two_content_lengths_are_refused_and_close(gurtd: Gurtd) -> None:
    data = head(gurtd, "POST", "/api/workspaces", b'{"name": "twice"}',
                extra="Content-Length: 3\r\n")
    responses = exchange(gurtd, data + head(gurtd, "GET", "/api/health"))
    assert [r[0] for r in responses] == [400], responses
    assert not os.path.exists(os.path.join(gurtd.home, "workspaces", "twice"))


def test_a_content_length_of_non_ascii_digits_gets_400(gurtd: Gurtd) -> None:
    """"²" is a digit to str.isdigit() (and \xb2 is "²" in latin-1, http.server's header
    charset) but not to int(): the request gets a 400, not a dropped connection."""
    data = head(gurtd, "POST", "/api/workspaces", extra="Content-Length: ²\r\n")
    responses = exchange(gurtd, data.replace("²".encode(), b"\xb2"))
    assert [r[0] for r in responses] == [400], responses
    assert b"Traceback" not in open(gurtd.log_path, "rb").read()


def test_an_http_0_9_request_gets_its_body_as_before_and_no_error(gurtd: Gurtd) -> None:
    """A request line of HTTP/0.9 (any local client may send one): http.server answers it
    with the body alone, no status line nor headers.  An answer that leaves in one send with
    its headers once found no header buffer there (http.server makes none for 0.9): the
    client got nothing and gurtd logged two errors with a traceback a request."""
    before = os.path.getsize(gurtd.log_path)
    with socket.create_connection(("127.0.0.1", gurtd.port), timeout=15) as s:
        s.sendall(f"GET /api/health HTTP/0.9\r\nHost: 127.0.0.1:{gurtd.port}\r\n\r\n".encode())
        answer = recv_all(s, 15, reset_ends=True)
    assert json.loads(answer)["ok"] is True, answer
    with open(gurtd.log_path, "rb") as f:
        f.seek(before)
        logged = f.read()
    assert b"AttributeError" not in logged and b"Traceback" not in logged, logged


def test_pipelined_good_requests_all_get_their_answers_in_order(gurtd: Gurtd) -> None:
    body = b'{"name": "pipelined"}'
    data = (head(gurtd, "GET", "/api/health") + head(gurtd, "POST", "/api/workspaces", body) +
            head(gurtd, "GET", "/api/workspaces/pipelined") +
            head(gurtd, "GET", "/api/tasks?limit=1", close=True))
    responses = exchange(gurtd, data)
    assert [r[0] for r in responses] == [200, 201, 200, 200], responses
    assert json.loads(responses[2][2]) == {"name": "pipelined", "layers": 0, "stack": [],
                                           "mergedLayers": 0, "layerBytes": 0}


# 10. the whole request has a deadline ########################################################

def drip(g: Gurtd, data: bytes, every: float) -> tuple[float, bytes]:
    """Send data a byte at a time, one every `every` seconds, until gurtd hangs up (bounded:
    never longer than the deadline plus a margin).  Seconds until the hang-up, and the answer."""
    with socket.create_connection(("127.0.0.1", g.port), timeout=1) as s:
        start = time.monotonic()
        answer = b""
        for byte in data:
            if time.monotonic() - start > DEADLINE + 10:
                break
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            end = time.monotonic() + every
            try:
                while time.monotonic() < end:
                    s.settimeout(max(0.01, end - time.monotonic()))
                    chunk = s.recv(65536)
                    if not chunk:
                        return time.monotonic() - start, answer
                    answer += chunk
            except TimeoutError:
                pass
            except ConnectionResetError:
                return time.monotonic() - start, answer
        return time.monotonic() - start, answer


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_client_dripping_a_byte_at_a_time_is_dropped_at_the_deadline(gurtd: Gurtd,
                                                                       part: str) -> None:
    body = json.dumps({"title": "drip", "prompt": "true", "worker": "fake"}).encode() * 4
    request = head(gurtd, "POST", "/api/tasks", body)
    before = gurtd.api("GET", "/api/tasks")
    if part == "headers":
        seconds, answer = drip(gurtd, request, 0.5)
    else:
        with socket.create_connection(("127.0.0.1", gurtd.port), timeout=30) as s:
            split = request.index(b"\r\n\r\n") + 4
            s.sendall(request[:split])
            start = time.monotonic()
            stop = start + DEADLINE + 10
            answer = b""
            for byte in request[split:]:   # 1 byte every 0.5 s: each read is quick
                if time.monotonic() > stop:
                    break
                try:
                    s.sendall(bytes([byte]))
                    s.settimeout(0.5)
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                except TimeoutError:
                    continue
                except OSError:
                    break
            seconds = time.monotonic() - start
    assert DEADLINE - 0.5 < seconds < DEADLINE + 5, seconds
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert gurtd.api("GET", "/api/tasks") == before


def test_a_kept_alive_connection_may_idle_between_requests(gurtd: Gurtd) -> None:
    """The clock starts at a request's first byte, not at the end of the previous one."""
    with socket.create_connection(("127.0.0.1", gurtd.port), timeout=15) as s:
        s.sendall(head(gurtd, "GET", "/api/health"))
        time.sleep(DEADLINE + 1)
        s.sendall(head(gurtd, "GET", "/api/health", close=True))
        responses = read_responses(s)
    assert [r[0] for r in responses] == [200, 200], responses


# 9. odd bodies and methods ###################################################################

DEEP_ARRAY = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a": ' * 50_000 + b"1" + b"}" * 50_000
ODD_BODIES = {"null": b"null", "array": b"[]", "true": b"true", "zero": b"0",
              "string": b'"x"', "deep array": DEEP_ARRAY, "deep object": DEEP_OBJECT}


def filled(pattern: str) -> str:
    return pattern.replace("{id}", UNKNOWN_ID).replace("{name}", "home") \
        .replace("{path}", "readme.txt")


@pytest.mark.parametrize("name", ODD_BODIES)
def test_every_body_route_refuses_a_body_that_is_not_an_object(gurtd: Gurtd,
                                                               name: str) -> None:
    before = (gurtd.api("GET", "/api/tasks"), gurtd.api("GET", "/api/settings"),
              gurtd.api("GET", "/api/wallet"), gurtd.api("GET", "/api/workspaces"))
    routes = [(r.method, r.path) for r in G.ROUTES
              if r.method in ("POST", "PUT") and not r.streamed]   # files: any bytes
    assert len(routes) >= 9
    for method, pattern in routes:
        status, data, headers = gurtd.request(method, filled(pattern), raw=ODD_BODIES[name],
                                              headers={"Content-Type": "application/json"})
        signed = pattern == "/api/hooks/{name}"     # no signature: 401 before the body
        assert status in ((401,) if signed else (400, 404, 409)), (method, pattern, status, data)
        assert headers["content-type"] == "application/json" and data["error"], data
        if name.startswith("deep") and status == 400 and pattern.count("{") == 0:
            assert data["error"] == "JSON nested too deeply", (pattern, data)
    after = (gurtd.api("GET", "/api/tasks"), gurtd.api("GET", "/api/settings"),
             gurtd.api("GET", "/api/wallet"), gurtd.api("GET", "/api/workspaces"))
    assert after == before
    assert gurtd.proc is not None and gurtd.proc.poll() is None


def answer_headers(g: Gurtd, method: str, path: str, token: bool = True) -> tuple[int,
                                                                             dict[str, str]]:
    """The status and headers of one answer, read raw (a stream's body is never waited for)."""
    with socket.create_connection(("127.0.0.1", g.port), timeout=15) as s:
        s.sendall(head(g, method, path, token=token, close=True))
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, (method, path, data)
            data += chunk
    status_line, *lines = data.partition(b"\r\n\r\n")[0].decode().split("\r\n")
    headers: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        assert key.lower() not in headers, (method, path, key)    # each header once
        headers[key.lower()] = value.strip()
    return int(status_line.split()[1]), headers


def test_every_answer_says_cache_control_no_store(gurtd: Gurtd) -> None:
    """An answer of gurtd (tasks, logs, settings, a session, an archive) must not be kept by
    a browser's or a proxy's cache: every route answers Cache-Control: no-store, streams and
    errors too, with the token and without."""
    task = gurtd.run("echo cached")
    for route in G.ROUTES:
        path = filled(route.path).replace(UNKNOWN_ID, task["id"])
        for token in (True, False):
            status, headers = answer_headers(gurtd, route.method, path, token)
            assert headers.get("cache-control") == "no-store", (route.method, path, status,
                                                                 headers)
    status, headers = answer_headers(gurtd, "GET", "/api/nope")
    assert status == 404 and headers.get("cache-control") == "no-store", headers


def test_any_method_on_a_known_path_is_405_with_allow(gurtd: Gurtd) -> None:
    allowed: dict[str, set[str]] = {}      # every method whose route matches the path
    for route in G.ROUTES:
        path = filled(route.path)
        allowed[path] = {r.method for r in G.ROUTES if r.regex.match(path)}
    for path, methods in allowed.items():
        for method in ("TRACE", "OPTIONS", "PATCH", "HEAD", "DELETE", "PUT", "POST", "BREW"):
            if method in methods:
                continue
            if method == "HEAD":    # a HEAD answer has headers only: read it raw
                (status, headers, data), = exchange(gurtd, head(gurtd, method, path,
                                                                close=True))
                assert data == b"", data
            else:
                status, data, headers = gurtd.request(method, path)
                assert data["code"] == "method_not_allowed", data
            assert status == 405, (method, path, status, data)
            assert {m.strip() for m in headers["allow"].split(",")} == methods, headers


def test_any_method_on_an_unknown_path_is_404(gurtd: Gurtd) -> None:
    for method in ("GET", "TRACE", "OPTIONS", "PATCH", "BREW", "POST"):
        assert gurtd.api(method, "/api/nope", status=404)["code"] == "not_found"


# 11. a droid model without a price is refused ################################################

def test_a_model_without_a_price_is_refused(gurtd: Gurtd) -> None:
    before = gurtd.api("GET", "/api/settings")
    status, data, _ = gurtd.request("PUT", "/api/settings", {"droidModel": "claude-free-1"})
    assert status == 400 and "droidPrices" in data["error"], data
    assert "claude-sonnet-5" in data["error"]          # it names the priced ones
    prices = {k: v for k, v in before["droidPrices"].items() if k != before["droidModel"]}
    status, data, _ = gurtd.request("PUT", "/api/settings", {"droidPrices": prices})
    assert status == 400 and before["droidModel"] in data["error"], data
    assert gurtd.api("GET", "/api/settings") == before
    # a price and the model together are fine, and are kept
    price = {"input": 1, "output": 2, "cacheRead": 0, "cacheWrite": 1}
    new = G.validate_settings({"droidModel": "claude-new-1",
                               "droidPrices": {**prices, "claude-new-1": price}}, before)
    assert new["droidModel"] == "claude-new-1"


# 8. a busy loop answers 503, and reads do not wait for it ####################################

def test_a_busy_loop_answers_503_and_reads_still_answer(new_gurtd: Any, tmp_path: Any) -> None:
    """The loop is held 4 s by a slow droid CLI asked for its models; calls give up after 1 s."""
    g = new_gurtd({"GURT_CALL_TIMEOUT": "1"})
    os.chmod(tmp_path, 0o755)
    slow = tmp_path / "slow-droid"
    slow.write_text("#!/bin/sh\nsleep 4\necho 'Available built-in models:'\n"
                    "echo '  claude-opus-5, claude-sonnet-5'\n")
    slow.chmod(0o755)
    tasks_before = g.api("GET", "/api/tasks")
    held: dict[str, Any] = {}

    def hold() -> None:
        held["answer"] = g.request("PUT", "/api/settings",
                                   {"droidPath": str(slow), "droidModel": "claude-opus-5"})

    def held_loop() -> bool:            # the loop runs the slow droid: it is held (not 0.5 s
        for pid in filter(str.isdigit, os.listdir("/proc")):   # after the PUT: a busy machine)
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(slow).encode() in f.read():
                    return True
        return False

    holder = threading.Thread(target=hold)
    holder.start()
    eventually(held_loop, 10, "the slow droid to run")
    reads = []
    for path in ("/api/tasks?limit=20", "/api/settings", "/api/approvals", "/api/wallet",
                 "/api/workspaces", "/api/workspaces/home"):
        start = time.monotonic()
        status, data, _ = g.request("GET", path)
        reads.append(time.monotonic() - start)
        assert status == 200, (path, data)
    status, data, headers = g.request("POST", "/api/tasks",
                                      {"title": "t", "prompt": "true", "worker": "fake"})
    assert (status, data["code"]) == (503, "busy"), data
    assert "nothing was done" in data["error"] and headers["retry-after"] == "1"
    holder.join(timeout=30)
    status, data, _ = held["answer"]
    assert (status, data["code"]) == (503, "busy"), data
    assert "still being carried out" in data["error"]
    # the busy loop's work went on; the refused create did not happen
    eventually(lambda: g.api("GET", "/api/settings")["droidModel"] == "claude-opus-5",
               what="the held PUT to be carried out")
    assert g.api("GET", "/api/tasks") == tasks_before
    assert max(reads) < 1.0, reads      # each read answered while the loop was held


# 12. events: every state, ids, Last-Event-ID ##################################################

def read_events(s: socket.socket, until: Any, limit: float = 20.0) -> list[dict[str, Any]]:
    """SSE events from a raw stream, until until(events) says enough."""
    events: list[dict[str, Any]] = []
    buf = b""
    deadline = time.monotonic() + limit
    s.settimeout(1.0)
    while not until(events):
        assert time.monotonic() < deadline, events
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        assert chunk, events
        buf += chunk
        while b"\n\n" in buf:
            block, _, buf = buf.partition(b"\n\n")
            event: dict[str, Any] = {}
            for line in block.decode().split("\n"):
                key, _, value = line.partition(": ")
                if key in ("id", "event", "data"):
                    event[key] = value
            if "data" in event:
                event["data"] = json.loads(event["data"])
                events.append(event)
    return events


def open_events(g: Gurtd, last_id: str | None = None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", g.port), timeout=10)
    extra = f"Last-Event-ID: {last_id}\r\n" if last_id is not None else ""
    s.sendall(head(g, "GET", "/api/events", extra=extra))
    return s


def test_a_queued_task_is_an_event_and_last_event_id_resumes(gurtd: Gurtd) -> None:
    before = gurtd.api("GET", "/api/settings")["maxRunningTasks"]
    gurtd.api("PUT", "/api/settings", {"maxRunningTasks": 1})
    stream = open_events(gurtd)
    try:
        blocker = gurtd.create("sleep 30", title="blocker")
        gurtd.wait(blocker["id"], ("running",))
        waiting = gurtd.create("true", title="waits its turn")
        assert waiting["state"] == "queued"

        def seen_queued(events: list[dict[str, Any]]) -> bool:
            return any(e["data"].get("id") == waiting["id"] for e in events)

        events = read_events(stream, seen_queued)
        mine = [e for e in events if e["data"].get("id") == waiting["id"]]
        assert mine[0]["event"] == "task" and mine[0]["data"]["state"] == "queued", mine
        ids = [int(e["id"]) for e in events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        gurtd.api("POST", f"/api/tasks/{blocker['id']}/stop")
        gurtd.wait(waiting["id"])

        def waiting_done(events: list[dict[str, Any]]) -> bool:
            return any(e["data"].get("id") == waiting["id"] and e["data"]["state"] == "done"
                       for e in events)

        events += read_events(stream, waiting_done)
    finally:
        stream.close()
    states = [e["data"]["state"] for e in events if e["data"].get("id") == waiting["id"]]
    assert states == ["queued", "running", "done"], states
    # a browser reconnects, saying the last id it saw: it gets exactly the events after it
    resume_from = events[1]
    again = open_events(gurtd, resume_from["id"])
    try:
        replay = read_events(again, lambda ev: len(ev) >= len(events) - 2)
    finally:
        again.close()
    assert [e["id"] for e in replay] == [e["id"] for e in events[2:]]
    assert [e["data"] for e in replay] == [e["data"] for e in events[2:]]
    # an id from long ago (or from before a restart): the stream says what was missed
    old = open_events(gurtd, "1")
    try:
        first = read_events(old, lambda ev: len(ev) >= 1)[0]
    finally:
        old.close()
    assert first["event"] == "reset" and first["data"]["missed"] is True, first
    gurtd.api("PUT", "/api/settings", {"maxRunningTasks": before})


def test_a_bad_last_event_id_is_a_400(gurtd: Gurtd) -> None:
    with open_events(gurtd, "abc") as s:
        (status, _, body), = read_responses_one(s)
    assert status == 400 and "since" in json.loads(body)["error"]


def read_responses_one(s: socket.socket) -> list[tuple[int, dict[str, str], bytes]]:
    """The first response on a connection gurtd keeps open."""
    s.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    top, _, rest = data.partition(b"\r\n\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in top.decode().split("\r\n")[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        rest += s.recv(65536)
    return [(int(top.split()[1]), headers, rest[:length])]


# 10. logs: followers of one task, logs streamed from the file ################################

def test_followers_wake_only_for_their_own_task() -> None:
    followers = G.LogFollowers()
    with followers.follow("ta") as a, followers.follow("tb") as b:
        seen_a, seen_b = a.generation, b.generation
        followers.notify("tb")
        followers.notify("tc")             # nobody follows it: nothing to wake
        assert (a.generation, b.generation) == (seen_a, seen_b + 1)
        start = time.monotonic()
        a.wait(seen_a, 0.3)                # not woken by tb's line
        assert time.monotonic() - start >= 0.25
        woke: list[float] = []
        t = threading.Thread(target=lambda: (a.wait(seen_a, 10), woke.append(time.monotonic())))
        t.start()
        time.sleep(0.1)
        followers.notify("ta")
        t.join(timeout=10)
        assert woke, "the follower of ta was not woken by ta's line"
    assert followers.watches == {}         # the last follower leaving removes the watch


def test_a_long_log_is_streamed_whole_with_its_length(gurtd: Gurtd) -> None:
    task = gurtd.run_done("seq 1 30000", title="long log")
    path = os.path.join(gurtd.home, "logs", task["id"] + ".jsonl")
    size = os.path.getsize(path)
    status, data, headers = gurtd.request("GET", f"/api/tasks/{task['id']}/log")
    assert status == 200 and int(headers["content-length"]) == size == len(data)
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert [e["text"] for e in lines if e["type"] == "stdout"] == \
        [str(i) for i in range(1, 30001)]
    # and followed: every line, then the end
    with socket.create_connection(("127.0.0.1", gurtd.port), timeout=20) as s:
        s.sendall(head(gurtd, "GET", f"/api/tasks/{task['id']}/log?follow=1"))
        events = read_events(s, lambda ev: len(ev) >= len(lines) + 1, limit=60)
    assert [e["data"] for e in events[:-1]] == lines
    assert events[-1]["event"] == "end" and events[-1]["data"] == {"state": "done"}


def test_a_reader_never_sees_half_a_step(gurtd: Gurtd) -> None:
    """An ask makes an approval pending and its task waiting in one step of the loop: whoever
    reads (from the snapshots, without the loop) sees both or neither."""
    task = gurtd.create("gurtd tool ask '{\"question\": \"go on?\"}'", tools=["ask"])
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, gurtd.task(task["id"])
        pending = gurtd.api("GET", f"/api/approvals?state=pending&task={task['id']}")
        if pending:
            assert gurtd.task(task["id"])["state"] == "waiting"
            break
        # (read after the approvals: the step may have come in between, so waiting is fine)
        assert gurtd.task(task["id"])["state"] in ("queued", "running", "waiting"), task
    gurtd.api("POST", f"/api/approvals/{pending[0]['id']}/answer", {"answer": "yes"})
    assert gurtd.wait(task["id"])["state"] == "done"


def test_a_flood_of_stalled_connections_does_not_stop_the_api(gurtd: Gurtd) -> None:
    """100 connections each send half a request and stall; gurtd keeps answering everyone
    else, and every stalled one is dropped once its deadline has passed."""
    stalled = []
    try:
        for i in range(100):
            s = socket.create_connection(("127.0.0.1", gurtd.port), timeout=5)
            s.sendall(b"POST /api/tasks HTTP/1.1\r\nHost: x\r\n" if i % 2 else
                      head(gurtd, "POST", "/api/tasks", b"{" * 50)[:-40])
            stalled.append(s)
        start = time.monotonic()
        for _ in range(5):
            gurtd.api("GET", "/api/tasks?limit=5", status=200)
        assert time.monotonic() - start < DEADLINE, "the API waited for the stalled ones"
        time.sleep(DEADLINE + 1)
        for s in stalled:
            answer = recv_all(s, 5, reset_ends=True)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer
    finally:
        for s in stalled:
            s.close()


def test_a_get_declaring_a_huge_body_is_refused_and_closed(gurtd: Gurtd) -> None:
    data = (f"GET /api/tasks HTTP/1.1\r\nHost: 127.0.0.1:{gurtd.port}\r\n"
            f"Authorization: Bearer {gurtd.token}\r\nContent-Length: {64 << 20}\r\n\r\n").encode()
    responses = exchange(gurtd, data + smuggled(gurtd))
    assert [r[0] for r in responses] == [413], responses
    assert responses[0][1]["connection"] == "close"
