"""Red team, from outside: a hostile Jira, hook senders, browsers and operator accidents.

Each test is an attack someone outside the box could make (or an accident an operator
could have) and the effect gurtd must not let it have.  Peers are the tests' own servers on
127.0.0.1; nothing leaves the machine.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from typing import Any, Iterator

import pytest

import gurtd as G


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
