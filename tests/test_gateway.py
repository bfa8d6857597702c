"""The model gateway: droid tasks call their model through gurtd, which adds the owner's key
outside the box and meters what the calls cost from the upstream's answers.

The upstream is a stand-in model server on 127.0.0.1 (the tests' own, in the host's network
namespace, which no task can reach) speaking Anthropic's Messages API and OpenAI's chat
completions, streamed or not, scripted from the tool list the agent sends.  The agent is the
real Droid CLI, or a small Python stand-in for the calls Droid would not make (forged lines,
searches for the key, a budget held and denied).
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from conftest import Gurtd, droid_file, droid_installed, eventually, put_base_file

import gurtd as G

MODEL = G.DEFAULT_DROID_MODEL
PRICES = G.DEFAULT_DROID_PRICES[MODEL]
KEY = "sk-ant-gurtd-test-" + os.urandom(12).hex()


# the stand-in model server ######################################################################

def tool_names(api: str, body: dict[str, Any]) -> list[str]:
    if api == "anthropic":
        return [t.get("name") for t in body.get("tools") or []]
    return [(t.get("function") or {}).get("name") for t in body.get("tools") or []]


def turns(api: str, body: dict[str, Any]) -> int:
    """How many answers of the model the conversation holds: the script's step."""
    return sum(1 for m in body.get("messages") or [] if m.get("role") == "assistant")


class Backlogged(http.server.ThreadingHTTPServer):
    request_queue_size = 1024        # as many callers at once as a bench's 50 tasks and more


class Upstream:
    """A model server: each POST is answered by script(api, body) -> (text, tool call or None),
    with a usage of its own, recorded with the request."""

    def __init__(self, script: Callable[[str, dict[str, Any]], tuple[str, Any]]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.usages: list[dict[str, int]] = []
        self.delay = 0.0
        self.mode = "answer"           # or "endless": a stream that never ends; "html";
        #                                "flood": an answer without end, as fast as it goes
        self.cut = threading.Event()   # an endless answer's reader went away
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0   # calls being answered at once
        self.hang_up = False           # close each connection after its answer, unsaid
        self.vanish = False            # read a call, then close with no answer (done or not)
        self.cache_1h = 0              # of each Messages answer's 70 cache writes, 1-hour ones
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                hang_up = upstream.hang_up     # as it was when the call came, not after its
                with upstream.lock:            # answer (the test may have set it since)
                    upstream.in_flight += 1
                    upstream.most_in_flight = max(upstream.most_in_flight, upstream.in_flight)
                try:
                    self.answer()
                finally:
                    with upstream.lock:
                        upstream.in_flight -= 1
                    self.close_connection = self.close_connection or hang_up

            def answer(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api = "anthropic" if self.path.endswith("/v1/messages") else "chat"
                upstream.requests.append({"path": self.path, "headers": dict(self.headers),
                                          "body": body, "peer": self.client_address[1]})
                if upstream.vanish:
                    self.close_connection = True
                    return
                text, tool = upstream.script(api, body)
                n = len(upstream.usages)
                usage = {"input_tokens": 1000 + n, "output_tokens": 40 + n,
                         "cache_read_input_tokens": 300, "cache_creation_input_tokens": 70 if
                         api == "anthropic" else 0}
                if upstream.cache_1h and api == "anthropic":
                    usage["cache_creation"] = {"ephemeral_5m_input_tokens": 70 - upstream.cache_1h,
                                               "ephemeral_1h_input_tokens": upstream.cache_1h}
                upstream.usages.append(usage)
                time.sleep(upstream.delay)
                chunks = (anthropic_answer if api == "anthropic" else chat_answer)(
                    body, text, tool, usage)
                self.send_response(200)
                self.send_header("Content-Type", "text/html" if upstream.mode == "html" else
                                 "text/event-stream" if body.get("stream")
                                 else "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if upstream.mode == "html":
                    chunks = [b"<html>a proxy's error page</html>"]
                elif upstream.mode == "flood":
                    chunks = chunks[:1] + [b"x" * (1 << 20)] * 1000
                elif upstream.mode == "endless":
                    chunks = chunks[:1] + [b"event: ping\ndata: {\"type\": \"ping\"}\n\n"] * 10 ** 6
                try:
                    for chunk in chunks:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                        if upstream.mode == "endless":
                            time.sleep(0.05)
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    upstream.cut.set()

        self.server = Backlogged(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def sse_frames(events: list[dict[str, Any]], named: bool) -> list[bytes]:
    return [((f"event: {e['type']}\n" if named else "") + f"data: {json.dumps(e)}\n\n")
            .encode() for e in events] + ([] if named else [b"data: [DONE]\n\n"])


def anthropic_answer(body: dict[str, Any], text: str, tool: Any,
                     usage: dict[str, int]) -> list[bytes]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if tool:
        content.append({"type": "tool_use", "id": f"toolu_{os.urandom(4).hex()}",
                        "name": tool[0], "input": tool[1]})
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
               "content": content, "stop_reason": "tool_use" if tool else "end_turn",
               "stop_sequence": None, "usage": usage}
    if not body.get("stream"):
        return [json.dumps(message).encode()]
    start = {**message, "content": [], "stop_reason": None,
             "usage": {**usage, "output_tokens": 1}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for i, block in enumerate(content):
        if block["type"] == "text":
            events += [{"type": "content_block_start", "index": i,
                        "content_block": {"type": "text", "text": ""}},
                       {"type": "content_block_delta", "index": i,
                        "delta": {"type": "text_delta", "text": block["text"]}}]
        else:
            events += [{"type": "content_block_start", "index": i,
                        "content_block": {**block, "input": {}}},
                       {"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta",
                                  "partial_json": json.dumps(block["input"])}}]
        events.append({"type": "content_block_stop", "index": i})
    events += [{"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                   "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]}},
               {"type": "message_stop"}]
    return sse_frames(events, named=True)


def chat_answer(body: dict[str, Any], text: str, tool: Any,
                usage: dict[str, int]) -> list[bytes]:
    calls = [{"index": 0, "id": f"call_{os.urandom(4).hex()}", "type": "function",
              "function": {"name": tool[0], "arguments": json.dumps(tool[1])}}] if tool else []
    wire = {"prompt_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"],
            "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"] +
            usage["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage["cache_read_input_tokens"]}}
    finish = "tool_calls" if tool else "stop"
    base = {"id": "c1", "created": 1, "model": body["model"]}
    if not body.get("stream"):
        message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls
                                                           else {})}
        return [json.dumps({**base, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": finish}], "usage": wire})
            .encode()]
    chunk = {**base, "object": "chat.completion.chunk"}
    delta: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        delta["tool_calls"] = calls
    return sse_frames([
        {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
        {**chunk, "choices": [], "usage": wire}], named=False)


def create_then_done(api: str, body: dict[str, Any]) -> tuple[str, Any]:
    """The agent creates hello.txt with its Create tool, then says it is done."""
    if not body.get("tools"):
        return "Hello.", None              # the stand-in agent's own calls
    if turns(api, body) == 0:
        assert "Create" in tool_names(api, body), tool_names(api, body)
        return "I will create the file.", ("Create", {"file_path": f"{G.VIEW_DIR}/hello.txt",
                                                     "content": "hello from the model\n"})
    return "Created hello.txt.", None


# fixtures #######################################################################################

@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream(create_then_done)
    yield server
    server.close()


def gateway_settings(upstream: Upstream, api: str = "anthropic") -> dict[str, Any]:
    base = f"http://127.0.0.1:{upstream.port}" + ("" if api == "anthropic" else "/v1")
    return {"modelGateway": {"api": api, "baseUrl": base}, "droidAutonomy": "high"}


@pytest.fixture
def model_gurtd(droid_gurtd: Gurtd, upstream: Upstream) -> Gurtd:
    """A gurtd with the owner's model key set and its gateway pointed at the stand-in."""
    droid_gurtd.api("PUT", "/api/secrets/model", {"key": KEY})
    droid_gurtd.api("PUT", "/api/settings", gateway_settings(upstream))
    return droid_gurtd


def test_the_gateways_overhead_per_call_is_small(agent_gurtd: Gurtd, upstream: Upstream) -> None:
    """Figures (printed): p50 of a whole call and of its first byte, through the gateway and
    straight; the bound asserted is loose (a loaded test machine), the figures are the point."""
    import statistics
    g = agent_gurtd
    task = g.create("time", title="time", worker=None, budgetCents=100_000)
    assert g.wait(task["id"], timeout=120)["state"] == "done"
    timed = results(g, task["id"])[0]
    scope: dict[str, Any] = {}
    exec(TIMED, scope)                  # the same calls, straight to the stand-in
    whole, first = scope["timed"]("127.0.0.1", upstream.port, KEY,
                                  {"model": MODEL, "max_tokens": 100, "messages": []}, 100)
    figures = {name: round(statistics.median(values), 2) for name, values in (
        ("gateway call ms, back to back", timed["whole"][:100]),
        ("gateway first byte ms, back to back", timed["first"][:100]),
        ("gateway call ms, 20 ms apart", timed["whole"][100:]),
        ("gateway first byte ms, 20 ms apart", timed["first"][100:]),
        ("direct call ms", whole), ("direct first byte ms", first))}
    print(f"\n{figures}")
    assert figures["gateway call ms, 20 ms apart"] - figures["direct call ms"] < 50


def pending(g: Gurtd, task_id: str) -> list[dict[str, Any]]:
    return g.approvals(state="pending", task=task_id)


def cost(usages: list[dict[str, int]], prices: dict[str, float] = PRICES) -> float:
    return sum(G.usage_cents(u, prices) for u in usages)


def changes(g: Gurtd, task_id: str) -> list[dict[str, Any]]:
    return g.api("GET", f"/api/tasks/{task_id}/changes")


def model_lines(g: Gurtd, task_id: str) -> list[dict[str, Any]]:
    return [e for e in g.log(task_id) if e["type"] == "model" and "status" in e]


# the real Droid CLI ##############################################################################

@pytest.mark.parametrize("api", ["anthropic", "chat-completions"])
def test_droid_creates_a_file_through_the_models_tool_call(
        model_gurtd: Gurtd, upstream: Upstream, api: str) -> None:
    g = model_gurtd
    g.api("PUT", "/api/settings", gateway_settings(upstream, api))
    task = g.create("create hello.txt", title="hello", worker=None, budgetCents=1000)
    done = g.wait_done(task["id"], timeout=120)
    assert done["summary"] == "Created hello.txt."
    assert changes(g, task["id"]) == [{"path": "hello.txt", "change": "added"}]
    assert g.file("home", "hello.txt") == b"hello from the model\n"
    # two calls, each through the gateway with the owner's key and the stand-in's usage
    assert len(upstream.requests) == 2
    for request in upstream.requests:
        headers = {k.lower(): v for k, v in request["headers"].items()}
        if api == "anthropic":
            assert request["path"] == "/v1/messages" and headers["x-api-key"] == KEY
        else:
            assert request["path"] == "/v1/chat/completions"
            assert headers["authorization"] == f"Bearer {KEY}"
        assert request["body"]["model"] == MODEL and request["body"]["stream"] is True
    assert done["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)
    lines = model_lines(g, task["id"])
    assert [(e["model"], e["status"]) for e in lines] == [(MODEL, 200)] * 2
    assert [e["usage"] for e in lines] == upstream.usages
    steps = [G.droid_step(e["event"]) for e in g.log(task["id"]) if e["type"] == "event"]
    assert f"Create: {G.VIEW_DIR}/hello.txt" in steps


def execute(command: str, summary: str) -> tuple[str, dict[str, Any]]:
    """A call of Droid's Execute tool (its schema asks for a summary and a risk level)."""
    return "Execute", {"summary": summary, "command": command, "riskLevel": "medium",
                       "riskLevelReason": "This command calls a tool of the gurtd box."}


def pay_and_ask(g: Gurtd, upstream: Upstream,
                script: Callable[[str, dict[str, Any]], tuple[str, Any]]) -> dict[str, Any]:
    """A task with wallet.pay and ask whose model (script) pays bob 7 cents, asks which
    colour, and writes down the answer (blue) in colour.txt: done, as a fake worker's."""
    upstream.script = script
    g.api("PUT", "/api/wallet", {"balanceCents": 100})
    task = g.create("pay bob 7 cents", title="pay", worker=None, tools=["wallet.pay", "ask"],
                    budgetCents=1000)
    question = eventually(lambda: [a for a in pending(g, task["id"]) if a["kind"] == "ask"],
                          timeout=90)[0]
    assert question["args"] == {"question": "which colour?"}
    g.api("POST", f"/api/approvals/{question['id']}/answer", {"answer": "blue"})
    done = g.wait_done(task["id"], timeout=90)
    assert done["summary"] == "Paid and noted."
    assert g.api("GET", "/api/wallet")["balanceCents"] == 93
    assert done["costCents"] == pytest.approx(7 + cost(upstream.usages), rel=1e-12)
    assert changes(g, task["id"]) == [{"path": "colour.txt", "change": "added"}]
    assert g.file("home", "colour.txt") == b"blue\n"
    return done


def test_droid_runs_commands_that_call_gurtds_tools(model_gurtd: Gurtd,
                                                     upstream: Upstream) -> None:
    """The model has Droid pay through wallet.pay and ask a person (`gurtd tool`, as the
    system prompt says), as a fake worker would; then write down what it heard."""
    def script(api: str, body: dict[str, Any]) -> tuple[str, Any]:
        step = turns(api, body)
        if step == 0:
            return "Paying bob.", execute("gurtd tool wallet.pay '{\"to\": \"bob\", "
                                          "\"cents\": 7}'", "Pay bob seven cents now")
        if step == 1:
            return "Asking.", execute("gurtd tool ask '{\"question\": \"which colour?\"}'",
                                      "Ask a person the colour")
        if step == 2:            # what the command printed is in the conversation
            heard = "blue" if "blue" in json.dumps(body["messages"][-1]) else "missing"
            return "Noting it.", ("Create", {"file_path": f"{G.VIEW_DIR}/colour.txt",
                                             "content": heard + "\n"})
        return "Paid and noted.", None
    g, task = model_gurtd, pay_and_ask(model_gurtd, upstream, script)
    steps = [G.droid_step(e["event"]) for e in g.log(task["id"]) if e["type"] == "event"]
    assert any(s and s.startswith("Execute: gurtd tool wallet.pay") for s in steps), steps


def test_droid_offers_gurtds_mcp_tools_and_the_model_calls_them(model_gurtd: Gurtd,
                                                                 upstream: Upstream) -> None:
    """Droid lists the MCP server's tools among its deferred ones (it waits for `gurtd mcp`
    before its first call); the model loads them with ToolSearch, sees them in the tool list,
    pays through wallet.pay and asks a person through ask, as a fake worker would."""
    mcp_tools = ["gurtd___wallet_pay", "gurtd___ask"]

    def script(api: str, body: dict[str, Any]) -> tuple[str, Any]:
        step, last = turns(api, body), json.dumps(body["messages"][-1])
        if step == 0:            # deferred: named in a reminder, loaded on request
            assert not set(mcp_tools) & set(tool_names(api, body))
            reminder = json.dumps(body)
            assert all(f"\\n{name}\\n" in reminder for name in mcp_tools), reminder[:2000]
            return "Loading gurtd's tools.", ("ToolSearch", {"query": "select:" +
                                                             ",".join(mcp_tools)})
        if step == 1:
            assert set(mcp_tools) <= set(tool_names(api, body)), tool_names(api, body)
            return "Paying bob.", ("gurtd___wallet_pay", {"to": "bob", "cents": 7})
        if step == 2:
            assert '\\"paid\\": true' in last, last
            return "Asking.", ("gurtd___ask", {"question": "which colour?"})
        if step == 3:
            heard = "blue" if "blue" in last else "missing"
            return "Noting it.", ("Create", {"file_path": f"{G.VIEW_DIR}/colour.txt",
                                             "content": heard + "\n"})
        return "Paid and noted.", None
    g, task = model_gurtd, pay_and_ask(model_gurtd, upstream, script)
    assert len(upstream.requests) == 5
    events = [e["event"] for e in g.log(task["id"]) if e["type"] == "event"]
    called = [e.get("toolName") for e in events if e.get("type") == "tool_call"]
    assert called == ["ToolSearch", *mcp_tools, "Create"], called
    failed = [e for e in events if e.get("type") == "tool_result" and e.get("isError")]
    assert failed == [], failed


@pytest.mark.parametrize("answer", ["approve", "deny", "stop"])
def test_droids_next_call_waits_at_the_budget_for_a_person(
        model_gurtd: Gurtd, upstream: Upstream, answer: str) -> None:
    g = model_gurtd
    task = g.create("create hello.txt", title="budget", worker=None, budgetCents=0.1)
    approval = eventually(lambda: pending(g, task["id"]), timeout=90)[0]
    assert approval["kind"] == "budget" and approval["tool"] == "model"
    assert len(upstream.requests) == 1               # the Create call went; the next waits
    assert g.task(task["id"])["state"] == "waiting"
    assert g.task(task["id"])["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)
    if answer == "approve":
        g.api("POST", f"/api/approvals/{approval['id']}/approve", {"budgetCents": 1000})
        done = g.wait(task["id"], timeout=90)
        assert done["state"] == "done" and done["summary"] == "Created hello.txt."
        assert len(upstream.requests) == 2
    elif answer == "stop":        # nobody answered: the held call hears the task ended
        g.api("POST", f"/api/tasks/{task['id']}/stop")
        done = g.wait(task["id"], timeout=30)
        assert done["state"] == "failed" and done["error"] == "stopped"
        assert len(upstream.requests) == 1
        refused = eventually(lambda: [e for e in model_lines(g, task["id"])
                                      if e["status"] == 403])[0]
        assert "the task has ended" in refused["text"] and "person" not in refused["text"], \
            refused
    else:
        g.api("POST", f"/api/approvals/{approval['id']}/deny", {"reason": "not today"})
        done = g.wait(task["id"], timeout=30)
        assert done["state"] == "failed" and done["error"] == "budget exceeded: not today"
        assert len(upstream.requests) == 1
        refused = eventually(lambda: [e for e in model_lines(g, task["id"])
                                      if e["status"] == 403])[0]
        assert "a person denied more: not today" in refused["text"]
    assert done["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)


def test_without_a_model_key_droid_has_no_key_at_all(droid_gurtd: Gurtd,
                                                     upstream: Upstream) -> None:
    """No model key and droidFactoryKey off: droid starts as before, with no key, and the
    Factory key on disk stays outside."""
    g = droid_gurtd
    assert g.api("GET", "/api/settings")["droidFactoryKey"] is False
    assert g.api("GET", "/api/secrets") == {"model": {"set": False}}
    os.makedirs(os.path.join(g.home, "secrets"), mode=0o700, exist_ok=True)
    Path(g.home, "secrets", "factory-api-key").write_text("fk-not-for-the-box\n")
    g.api("PUT", "/api/settings", gateway_settings(upstream))
    task = g.create("hi", title="t", worker=None)
    done = g.wait(task["id"], timeout=90)
    assert done["state"] == "failed" and "FACTORY_API_KEY" in done["error"]
    assert upstream.requests == []


# the secret #####################################################################################

def test_the_model_key_is_write_only(model_gurtd: Gurtd) -> None:
    g = model_gurtd
    path = os.path.join(g.home, "secrets", "model-key")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert Path(path).read_text() == KEY
    answer = g.api("PUT", "/api/secrets/model", {"key": KEY})
    assert answer == {"model": {"set": True}} == g.api("GET", "/api/secrets")
    for bad in ({"key": ""}, {"key": "a b"}, {"key": "x\r\nHost: evil"}, {"key": 1},
                {"key": "k", "more": 1}):
        g.api("PUT", "/api/secrets/model", bad, status=400)
    seen = json.dumps([g.api("GET", "/api/settings"), g.api("GET", "/api/secrets"),
                       g.api("GET", "/api/openapi.json")]) + g.log_text()
    assert KEY not in seen
    assert g.api("DELETE", "/api/secrets/model") == {"model": {"set": False}}
    assert not os.path.exists(path)


def test_the_command_line_sets_and_removes_the_key(droid_gurtd: Gurtd) -> None:
    g = droid_gurtd
    out = g.cli("secret", "model", "--stdin", stdin=KEY + "\n")
    assert out.returncode == 0 and out.stdout == "the model key is set\n", out
    assert KEY not in out.stdout + out.stderr
    assert Path(g.home, "secrets", "model-key").read_text() == KEY
    out = g.cli("secret", "model", "--delete")
    assert out.returncode == 0 and g.api("GET", "/api/secrets") == {"model": {"set": False}}


def test_gateway_settings_are_checked(model_gurtd: Gurtd) -> None:
    g = model_gurtd
    for bad in ({"api": "openai"}, {"baseUrl": "http://example.com"},
                {"baseUrl": "ftp://127.0.0.1"}, {"baseUrl": "https://u:p@example.com"},
                {"models": "x"}, {"maxOutputTokens": 0}, {"nope": 1}):
        g.api("PUT", "/api/settings", {"modelGateway": bad}, status=400)
    g.api("PUT", "/api/settings", {"droidFactoryKey": "yes"}, status=400)
    config = g.api("PUT", "/api/settings", {"modelGateway": {
        "baseUrl": "https://api.anthropic.com"}})["modelGateway"]
    assert config == {**G.DEFAULT_MODEL_GATEWAY, "baseUrl": "https://api.anthropic.com"}


# a stand-in agent: calls of its own from inside the task ######################################

TIMED = r'''
def timed(host, port, key, message, count):
    """Milliseconds of calls (every other one streamed), whole and to the first byte; past
    the first 100, 20 ms apart, as an agent calls between its tools' runs."""
    import http.client, json, time
    whole, first = [], []
    for n in range(count):
        if n >= 100:
            time.sleep(0.02)
        started = time.perf_counter()
        conn = http.client.HTTPConnection(host, port, timeout=60)
        conn.request("POST", "/v1/messages", json.dumps({**message, "stream": n % 2 == 1}),
                     {"x-api-key": key, "Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read1(1)
        first.append((time.perf_counter() - started) * 1000)
        resp.read()
        whole.append((time.perf_counter() - started) * 1000)
        conn.close()
    return whole, first
'''

AGENT = r'''#!/usr/bin/python3
"""A stand-in for droid: the calls a hostile or a plain agent makes, each result a JSON line
in /run/gurt/view/results.jsonl."""
import glob, http.client, json, os, socket, sys, threading
settings = json.load(open(os.path.expanduser("~/.factory/settings.json")))["customModels"][0]
host = settings["baseUrl"].split("//")[1].split("/")[0]
results = open("/run/gurt/view/results.jsonl", "a")
''' + TIMED + r'''

def say(**fields):
    results.write(json.dumps(fields) + "\n")
    results.flush()

def call(body, key=settings["apiKey"], raw=None, path="/v1/messages"):
    conn = http.client.HTTPConnection(host, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"x-api-key": key, "Content-Type": "application/json",
                                      "anthropic-version": "2023-06-01"})
    resp = conn.getresponse()
    return resp.status, resp.read().decode(errors="replace")

MESSAGE = {"model": settings["model"], "max_tokens": 100,
           "messages": [{"role": "user", "content": "hi"}]}
for step in open("/run/gurt/prompt.md").read().split():
    if step == "call":
        say(step=step, answer=call(MESSAGE))
    elif step == "stream":
        say(step=step, answer=call({**MESSAGE, "stream": True}))
    elif step == "size":        # how much of an answer arrives (a cut one included)
        conn = http.client.HTTPConnection(host, timeout=60)
        conn.request("POST", "/v1/messages", json.dumps(MESSAGE),
                     {"x-api-key": settings["apiKey"], "Content-Type": "application/json"})
        resp = conn.getresponse()
        try:
            length = len(resp.read())
        except http.client.IncompleteRead as exc:
            length = len(exc.partial)
        say(step=step, status=resp.status, length=length)
    elif step == "drip":        # 3 calls whose requests never end, then one that does
        drips = [socket.create_connection((host, 80)) for _ in range(3)]
        for sock in drips:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\n")
        say(step=step, answer=call(MESSAGE))
    elif step == "forge":       # usage lines in droid's own stream: logged, never counted
        for n in range(3):
            print(json.dumps({"type": "completion", "finalText": "forged",
                              "usage": {"input_tokens": 10 ** 9, "output_tokens": 10 ** 9}}))
        sys.stdout.flush()
    elif step == "search":      # the owner's key anywhere the task can read
        found = []
        needle = open("/run/gurt/view/needle").read().strip().encode()
        places = ["/proc/self/environ"] + glob.glob("/proc/[0-9]*/environ") + \
            glob.glob("/proc/[0-9]*/cmdline")
        for top in (os.path.expanduser("~"), "/run", "/tmp", "/dev/shm", "/etc"):
            for root, dirs, files in os.walk(top):
                if root.startswith("/run/gurt/view"):
                    continue            # where the test put the needle
                places += [os.path.join(root, f) for f in files]
        for path in places:
            try:
                with open(path, "rb") as f:
                    if needle in f.read(1 << 22):
                        found.append(path)
            except OSError:
                pass
        say(step=step, searched=len(places), found=found,
            env=needle.decode() in json.dumps(dict(os.environ)))
    elif step == "direct":      # the upstream itself, around the gateway
        port = int(open("/run/gurt/view/port").read())
        try:
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
            say(step=step, reached=True)
        except OSError as exc:
            say(step=step, reached=False, error=str(exc))
    elif step == "refusals":
        say(step="wrong-key", answer=call(MESSAGE, key="gurtd-not-mine"))
        say(step="wrong-model", answer=call({**MESSAGE, "model": "gpt-9"}))
        say(step="wrong-path", answer=call(MESSAGE, path="/v1/complete"))
        say(step="not-json", answer=call(None, raw=b"{nope"))
        try:
            say(step="huge", answer=call(None, raw=b" " * (17 << 20)))
        except OSError as exc:
            say(step="huge", answer=[0, str(exc)])
    elif step == "twice":       # a key twice: the upstream might read the other one
        m, tail = json.dumps(settings["model"]), '"messages": [{"role": "user", "content": "hi"}]'
        for name, raw in {
                "model": '{"model": "gpt-9", "model": %s, "max_tokens": 100, %s}',
                "model-last": '{"model": %s, "model": "gpt-9", "max_tokens": 100, %s}',
                "escaped": '{"model": %s, "mod\\u0065l": "gpt-9", "max_tokens": 100, %s}',
                "stream": '{"model": %s, "stream": false, "stream": true, "max_tokens": 1, %s}',
                "max_tokens": '{"model": %s, "max_tokens": 1, "max_tokens": 100000, %s}',
                "deep": '{"model": %s, "max_tokens": 1, "tools": [{"name": "t", "input_schema":'
                        ' {"type": "object", "type": "x"}}], %s}',
                "message": '{"model": %s, "max_tokens": 1, "messages": [{"role": "user", '
                           '"content": "hi", "content": "ho"}], "x": %s}'}.items():
            tail_or_list = tail if name != "message" else "[]"
            say(step="twice-" + name, answer=call(None, raw=(raw % (m, tail_or_list)).encode()))
        say(step="once", answer=call(MESSAGE))
    elif step.startswith("time"):   # ms of calls one after another, and to a first byte
        whole, first = timed(host, 80, settings["apiKey"], MESSAGE, int(step[4:] or 200))
        say(step=step, whole=whole, first=first)
    elif step.startswith("at"):     # wait for a moment (epoch seconds): many tasks at once
        import time
        time.sleep(max(0.0, float(step[2:]) - time.time()))
    elif step == "crowd":       # 1,000 calls at once: a few go on, the rest refused at once
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
        data = json.dumps(MESSAGE).encode()
        request = ("POST /v1/messages HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
                   f"\r\nx-api-key: {settings['apiKey']}\r\nContent-Length: {len(data)}"
                   "\r\n\r\n").encode() + data
        socks = []
        for _ in range(1000):
            sock = socket.socket()
            sock.settimeout(60)
            try:
                sock.connect((host, 80))
                sock.sendall(request)
            except OSError:
                pass
            socks.append(sock)
        answers = []
        for sock in socks:
            got = b""
            try:
                while chunk := sock.recv(65536):
                    got += chunk
            except OSError:
                pass
            answers.append(int(got.split(b" ")[1]) if got.startswith(b"HTTP/1.1 ") else 0)
            sock.close()
        say(step=step, answers=answers)
'''


def agent_droid() -> str:
    """AGENT as an executable droid in a new folder of /var/tmp the box user may read."""
    return droid_file(AGENT)


@pytest.fixture
def agent_gurtd(model_gurtd: Gurtd) -> Iterator[Gurtd]:
    with droid_installed(model_gurtd, AGENT):
        yield model_gurtd


def agent_done(g: Gurtd, prompt: str, timeout: float = 60) -> dict[str, Any]:
    """A task of the stand-in agent that takes the steps of prompt: done."""
    task = g.create(prompt, title=prompt, worker=None, budgetCents=1000)
    done = g.wait_done(task["id"], timeout=timeout)
    return done


def results(g: Gurtd, task_id: str) -> list[dict[str, Any]]:
    path = os.path.join(g.home, "layers", task_id, "upper", "results.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_forged_usage_lines_change_nothing_and_a_whole_answer_is_metered(
        agent_gurtd: Gurtd, upstream: Upstream) -> None:
    g = agent_gurtd
    done = agent_done(g, "call forge stream")
    answers = results(g, done["id"])
    assert [a["answer"][0] for a in answers] == [200, 200]
    assert json.loads(answers[0]["answer"][1])["usage"] == upstream.usages[0]
    assert done["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)
    forged = [e for e in g.log(done["id"]) if e["type"] == "event" and
              e["event"].get("finalText") == "forged"]
    assert len(forged) == 3                        # logged as they are, never counted
    assert [e["usage"] for e in model_lines(g, done["id"])] == upstream.usages


def test_the_key_is_nowhere_inside_and_the_upstream_out_of_reach(
        agent_gurtd: Gurtd, upstream: Upstream) -> None:
    g = agent_gurtd
    put_base_file(g, "home", "needle", KEY)
    put_base_file(g, "home", "port", str(upstream.port))
    task = agent_done(g, "search direct call")
    search, direct, call = results(g, task["id"])
    assert search["searched"] > 50 and search["found"] == []
    assert search["env"] is False
    assert direct["reached"] is False
    assert call["answer"][0] == 200                 # while the gateway reaches it
    assert KEY not in json.dumps(g.log(task["id"]))


def test_refusals_are_said_to_the_agent(agent_gurtd: Gurtd, upstream: Upstream) -> None:
    g = agent_gurtd
    task = g.create("refusals crowd", title="refusals", worker=None, budgetCents=100_000)
    upstream.delay = 1.0
    waits = []                               # the loop answers meanwhile
    while g.task(task["id"])["state"] not in ("done", "failed") and len(waits) < 500:
        started = time.monotonic()
        g.api("PUT", "/api/wallet", {"balanceCents": 100})
        waits.append(time.monotonic() - started)
        time.sleep(0.05)
    assert max(waits) < 1.0, max(waits)
    done = g.wait_done(task["id"], timeout=90)
    by_step = {r["step"]: r for r in results(g, task["id"])}
    status = {step: r["answer"][0] for step, r in by_step.items() if "answer" in r}
    assert status == {"wrong-key": 401, "wrong-model": 400, "wrong-path": 404,
                      "not-json": 400, "huge": 413}
    error = json.loads(by_step["wrong-model"]["answer"][1])["error"]
    assert error["type"] == "invalid_request_error" and "gpt-9" in error["message"]
    assert "not one the owner allows" in error["message"]
    crowd = by_step["crowd"]["answers"]
    assert crowd.count(200) >= G.GATEWAY_TASK_CALLS and len(crowd) == 1000
    # never more of the task's calls at the upstream at once than its cap (how many end 200
    # in all depends on how fast the upstream answers)
    assert upstream.most_in_flight <= G.GATEWAY_TASK_CALLS, upstream.most_in_flight
    assert set(crowd) <= {200, 429, 0}          # 0: refused before its answer was read
    assert crowd.count(429) > 0
    said = [e["text"] for e in g.log(task["id"]) if e["type"] == "model" and "status" not in e]
    assert len(said) == 1 and said[0].startswith("model calls refused as too many at once: ")
    assert crowd.count(429) <= int(said[0].split()[-1]) <= 1000 - crowd.count(200)
    assert len([a for a in crowd if a == 200]) == len(upstream.usages)
    assert done["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)


def test_a_body_with_a_key_twice_at_any_depth_is_refused_before_the_upstream(
        agent_gurtd: Gurtd, upstream: Upstream) -> None:
    """json.loads keeps a key's last value, another parser may keep its first: a call of
    model gpt-9 then the allowed one (or stream, max_tokens twice, a key spelt with an escape,
    a key twice deep in a tool or a message) would reach the upstream as something gurtd
    never checked or priced.  Each is a 400 that says so, and the upstream sees none."""
    g = agent_gurtd
    done = agent_done(g, "twice")
    by_step = {r["step"]: r["answer"] for r in results(g, done["id"])}
    twice = {step: answer for step, answer in by_step.items() if step.startswith("twice-")}
    assert len(twice) == 7 and {a[0] for a in twice.values()} == {400}, twice
    for step, (_, text) in twice.items():
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error", text
        assert "is in one object twice" in error["message"], text
    assert '\\"model\\"' in twice["twice-escaped"][1]
    assert by_step["once"][0] == 200
    assert len(upstream.requests) == 1 and upstream.requests[0]["body"]["max_tokens"] == 100
    assert done["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)


def test_one_hour_cache_writes_cost_their_price_streamed_or_not(
        agent_gurtd: Gurtd, upstream: Upstream) -> None:
    """Of 70 cache writes an answer, 50 live an hour (usage.cache_creation): those cost
    cacheWrite1h (600 cents a million for the default model, twice input), not cacheWrite
    (375), in a whole answer and in a stream (its message_start)."""
    g = agent_gurtd
    upstream.cache_1h = 50
    done = agent_done(g, "call stream")
    assert [r["answer"][0] for r in results(g, done["id"])] == [200, 200]

    def cents(n: int, write_1h: float) -> float:
        return ((1000 + n) * 300 + (40 + n) * 1500 + 300 * 30 + 20 * 375 + 50 * write_1h) / 1e6
    assert PRICES["cacheWrite1h"] == 600
    assert done["costCents"] == pytest.approx(cents(0, 600) + cents(1, 600), rel=1e-12)
    assert done["costCents"] - (cents(0, 375) + cents(1, 375)) == pytest.approx(2 * 50 * 225 / 1e6)
    usages = [e["usage"] for e in model_lines(g, done["id"])]
    assert [u["ephemeral_1h_input_tokens"] for u in usages] == [50, 50]
    assert [u["ephemeral_5m_input_tokens"] for u in usages] == [20, 20]


@pytest.mark.parametrize("end", ["stop", "undo"])
def test_a_stop_in_the_middle_of_a_streamed_answer_ends_it_and_counts_what_it_used(
        agent_gurtd: Gurtd, upstream: Upstream, end: str) -> None:
    g = agent_gurtd
    upstream.mode = "endless"
    task = g.create("stream", title="endless", worker=None, budgetCents=1000)
    eventually(lambda: upstream.requests)
    time.sleep(0.5)                                 # pings pass on meanwhile
    g.api("POST", f"/api/tasks/{task['id']}/{end}")
    done = g.wait(task["id"], timeout=15)
    assert (done["state"], done.get("error")) == (("failed", "stopped") if end == "stop" else
                                                  ("undone", None)), done
    assert upstream.cut.wait(10)                    # the upstream call ended too
    # what the answer's start said it used was spent: input, and the output so far
    used = {**upstream.usages[0], "output_tokens": 1}
    line = eventually(lambda: model_lines(g, task["id"]))[0]
    assert line["usage"] == used
    assert g.task(task["id"])["costCents"] == pytest.approx(cost([used]), rel=1e-12)


def test_an_answer_without_end_is_cut_at_its_bound(agent_gurtd: Gurtd,
                                                   upstream: Upstream) -> None:
    g = agent_gurtd
    upstream.mode = "flood"
    done = agent_done(g, "size", 120)
    got = results(g, done["id"])[0]
    # the read that would cross the bound (64 KiB at most) is not passed on
    assert got["status"] == 200
    assert G.GATEWAY_MAX_ANSWER - 65536 < got["length"] <= G.GATEWAY_MAX_ANSWER, got
    assert upstream.cut.wait(10)                    # the upstream call ended too
    line = model_lines(g, done["id"])[0]
    assert line["status"] == 200 and "the answer was cut" in line["text"], line
    # a whole (not streamed) answer is read for its usage only up to GATEWAY_MAX_PARSED
    assert line["usage"] is None and done["costCents"] == 0


def test_requests_that_drip_hold_only_their_own_calls(agent_gurtd: Gurtd,
                                                      upstream: Upstream) -> None:
    """Three calls whose requests never end hold three of the task's four calls, and the
    fourth goes through meanwhile; they end with the task, and the loop never waits."""
    g, started = agent_gurtd, time.monotonic()
    done = agent_done(g, "drip")
    assert time.monotonic() - started < G.GATEWAY_REQUEST_SECONDS  # never waited for them
    assert results(g, done["id"])[0]["answer"][0] == 200
    lines = eventually(lambda: len(model_lines(g, done["id"])) == 4 and
                       model_lines(g, done["id"]))
    assert sorted(e["status"] for e in lines) == [0, 0, 0, 200], lines
    assert len(upstream.requests) == 1
    assert done["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)


def test_an_answer_that_is_not_json_passes_on_and_costs_nothing(
        agent_gurtd: Gurtd, upstream: Upstream) -> None:
    g = agent_gurtd
    upstream.mode = "html"
    done = agent_done(g, "call")
    assert results(g, done["id"])[0]["answer"] == [200, "<html>a proxy's error page</html>"]
    assert done["costCents"] == 0
    line = model_lines(g, done["id"])[0]
    assert line["usage"] is None and line["text"].endswith("(no usage)")


def test_a_call_at_the_budget_is_held_until_approved_and_a_denial_fails_the_task(
        agent_gurtd: Gurtd, upstream: Upstream) -> None:
    g = agent_gurtd
    one = G.usage_cents({"input_tokens": 1000, "output_tokens": 40,
                         "cache_read_input_tokens": 300, "cache_creation_input_tokens": 70},
                        PRICES)
    task = g.create("call call call", title="budget", worker=None, budgetCents=one / 2)
    approval = eventually(lambda: pending(g, task["id"]))[0]   # the second call is held
    assert approval["kind"] == "budget" and approval["tool"] == "model"
    assert len(upstream.requests) == 1
    assert g.task(task["id"])["state"] == "waiting"
    time.sleep(0.5)
    assert len(upstream.requests) == 1
    g.api("POST", f"/api/approvals/{approval['id']}/approve")
    second = eventually(lambda: pending(g, task["id"]))[0]     # one more budget: spent again
    assert second["id"] != approval["id"] and len(upstream.requests) == 2
    g.api("POST", f"/api/approvals/{second['id']}/deny", {"reason": "too dear"})
    done = g.wait(task["id"], timeout=30)
    assert done["state"] == "failed" and done["error"] == "budget exceeded: too dear"
    assert len(upstream.requests) == 2
    assert done["costCents"] == pytest.approx(cost(upstream.usages), rel=1e-12)
    denied = [e for e in model_lines(g, task["id"]) if e["status"] == 403]
    assert denied and "too dear" in denied[0]["text"]


# pure: usage from answers and streams ##########################################################

def anthropic_stream_usage(chunks: list[bytes]) -> dict[str, int] | None:
    meter = G.UsageMeter("anthropic", True)
    for chunk in chunks:
        meter.feed(chunk)
    return meter.result()


@pytest.mark.pure
def test_usage_of_a_messages_stream_is_its_start_and_last_delta() -> None:
    usage = {"input_tokens": 1200, "output_tokens": 345, "cache_read_input_tokens": 30,
             "cache_creation_input_tokens": 7}
    data = b"".join(anthropic_answer({"model": MODEL, "stream": True}, "hi", ("Create", {}),
                                     usage))
    assert anthropic_stream_usage([data]) == usage
    # cut anywhere, a byte at a time: the same
    assert anthropic_stream_usage([data[i:i + 1] for i in range(len(data))]) == usage
    # a stream cut after its start: the input it used
    start = data[:data.index(b"content_block_start")]
    assert anthropic_stream_usage([start]) == {**usage, "output_tokens": 1}
    assert anthropic_stream_usage([b"data: not json\n\ndata: [DONE]\n\n"]) is None
    # a line too long to read is skipped, the rest still read
    long = b"data: {\"type\": \"ping\", \"x\": \"" + b"x" * (G.GATEWAY_MAX_LINE + 10) + b"\"}\n"
    assert anthropic_stream_usage([long[:100], long[100:], data]) == usage


@pytest.mark.pure
def test_usage_of_a_whole_answer_and_of_chat_completions() -> None:
    usage = {"input_tokens": 10, "output_tokens": 20, "cache_read_input_tokens": 5,
             "cache_creation_input_tokens": 0}
    meter = G.UsageMeter("anthropic", False)
    meter.feed(anthropic_answer({"model": MODEL}, "hi", None, usage)[0])
    assert meter.result() == usage
    for stream in (False, True):
        meter = G.UsageMeter("chat-completions", stream)
        for chunk in chat_answer({"model": "m", "stream": stream}, "hi", None, usage):
            meter.feed(chunk)
        assert meter.result() == usage      # prompt_tokens less the cached ones, as input
    assert G.chat_usage({"prompt_tokens": 5, "completion_tokens": True}) == {}
    assert G.chat_usage({"prompt_tokens": 5, "completion_tokens": 1,
                         "prompt_tokens_details": {"cached_tokens": 9}})["input_tokens"] == 5
    assert G.anthropic_usage({"input_tokens": -1, "output_tokens": 1e30}) == {}
    meter = G.UsageMeter("anthropic", False)
    meter.feed(b"<html>not json</html>")
    assert meter.result() is None


@pytest.mark.pure
def test_cost_is_usage_times_each_price() -> None:
    usage = {"input_tokens": 1_000_000, "output_tokens": 100_000,
             "cache_read_input_tokens": 200_000, "cache_creation_input_tokens": 40_000}
    assert G.usage_cents(usage, PRICES) == pytest.approx(
        PRICES["input"] + PRICES["output"] / 10 + PRICES["cacheRead"] / 5 +
        PRICES["cacheWrite"] / 25)


@pytest.mark.pure
def test_one_hour_cache_writes_cost_more_and_never_less_than_before() -> None:
    """A 1-hour cache write costs cacheWrite1h (twice input without it), the rest of the
    writes cacheWrite; counts that disagree are metered at the most they can mean."""
    usage = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 1_000_000,
             "cache_creation": {"ephemeral_5m_input_tokens": 400_000,
                                "ephemeral_1h_input_tokens": 600_000}}
    flat = G.anthropic_usage(usage)
    assert flat == {"input_tokens": 0, "output_tokens": 0,
                    "cache_creation_input_tokens": 1_000_000,
                    "ephemeral_5m_input_tokens": 400_000, "ephemeral_1h_input_tokens": 600_000}
    assert G.usage_cents(flat, PRICES) == pytest.approx(0.4 * 375 + 0.6 * 600)
    own = {"input": 400, "output": 0, "cacheRead": 0, "cacheWrite": 500}    # no cacheWrite1h
    assert G.usage_cents(flat, own) == pytest.approx(0.4 * 500 + 0.6 * 800)
    assert G.usage_cents(flat, {**own, "input": 100}) == pytest.approx(500)  # not under 500
    # 1-hour writes past the total, or parts without it: the most they can mean
    assert G.usage_cents({"ephemeral_1h_input_tokens": 2_000_000,
                          "cache_creation_input_tokens": 1_000_000}, PRICES) == 1200
    assert G.usage_cents({"ephemeral_5m_input_tokens": 1_000_000,
                          "ephemeral_1h_input_tokens": 1_000_000}, PRICES) == 975
    # a stream: message_start carries them
    chunks = anthropic_answer({"model": MODEL, "stream": True}, "hi", None, usage)
    assert anthropic_stream_usage(chunks) == {**flat, "output_tokens": 0}
    for prices, ok in (({**own, "cacheWrite1h": 600}, True), ({**own, "cacheWrite1h": 499}, False),
                       ({**own, "cacheWrite1h": -1}, False), ({**own, "cacheWrite2h": 9}, False)):
        rule = G.SETTING_RULES["droidPrices"][0]
        assert bool(rule({MODEL: prices})) is ok, prices
    assert G.SETTING_RULES["droidPrices"][0](G.DEFAULT_DROID_PRICES)


@pytest.mark.pure
def test_upstream_urls() -> None:
    assert G.upstream_url("https://api.anthropic.com") == ("https", "api.anthropic.com", 443, "")
    assert G.upstream_url("http://127.0.0.1:8080/v1/") == ("http", "127.0.0.1", 8080, "/v1")
    assert G.upstream_url("http://[::1]:9/v1")[1] == "::1"
    for bad in ("http://localhost:1", "http://10.0.0.1", "https://h/?q", "https://h/#f",
                "https://h:99999", "file:///etc/passwd", "https://u@h", 3):
        with pytest.raises(ValueError):
            G.upstream_url(bad)


@pytest.mark.pure
def test_a_refusal_speaks_the_tasks_api() -> None:
    refusal = G.GatewayRefusal(403, "permission_error", "no more budget: too dear")
    answer = G.refusal_answer("anthropic", refusal)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert json.loads(body) == {"type": "error", "error": {
        "type": "permission_error", "message": "gurtd: no more budget: too dear"}}
    body = G.refusal_answer("chat-completions", refusal).partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["message"] == "gurtd: no more budget: too dear"


def straight_call(upstream: Upstream) -> Callable[[], tuple[G.UpstreamConn,
                                                          http.client.HTTPResponse, bytes]]:
    """Calls through Gateway.request alone (no task, no box): each gives the connection it
    went on, the answer's head and its body."""
    gateway = G.Gateway(None)               # type: ignore[arg-type]  # request needs no box
    tg = G.TaskGateway("t", "token", "anthropic", f"http://127.0.0.1:{upstream.port}")
    body = json.dumps({"model": MODEL, "max_tokens": 10, "messages": []}).encode()
    head = G.upstream_head(tg.api, tg.base_url, KEY) + b"Content-Length: %d\r\n\r\n" % len(body)

    def call() -> tuple[G.UpstreamConn, http.client.HTTPResponse, bytes]:
        with socket.socket() as unused:          # the task's side: not used by request
            conn, answer = gateway.request(tg, head, body, G.GatewayCall(unused))
        return conn, answer, read_all(conn, answer)
    call.gateway, call.where = gateway, tg.where       # type: ignore[attr-defined]
    return call


@pytest.mark.pure
def test_upstream_connections_are_kept_alive_and_one_closed_meanwhile_is_replaced(
        upstream: Upstream) -> None:
    call = straight_call(upstream)
    pool, where = call.gateway.pool, call.where          # type: ignore[attr-defined]

    def kept() -> G.UpstreamConn:
        conn, answer, data = call()
        assert answer.status == 200 and json.loads(data)["content"]
        assert not answer.will_close
        pool.put(where, conn)
        return conn
    kept()
    kept()
    upstream.hang_up = True                  # closed once answered, as an idle timeout does
    closed = kept()
    assert select.select([closed.sock], [], [], 10)[0]      # its end has come
    upstream.hang_up = False
    kept()                                   # found closed before use: a new one, sent once
    peers = [r["peer"] for r in upstream.requests]
    assert len(peers) == 4 and peers[0] == peers[1] == peers[2] != peers[3], peers
    assert len(pool.idle[where]) == 1 and closed.sock.fileno() == -1


@pytest.mark.pure
def test_a_call_that_went_out_whole_is_never_sent_again(upstream: Upstream) -> None:
    """An upstream that reads a call on a kept connection and closes it unanswered may have
    carried it out: the call fails (502) rather than go again, spent twice, once unmetered."""
    call = straight_call(upstream)
    conn, _, _ = call()
    call.gateway.pool.put(call.where, conn)              # type: ignore[attr-defined]
    upstream.vanish = True
    with pytest.raises(G.GatewayRefusal) as refused:
        call()
    assert refused.value.status == 502
    assert [r["peer"] for r in upstream.requests] == [upstream.requests[0]["peer"]] * 2


@pytest.mark.pure
def test_idle_upstream_connections_close_past_their_time_and_at_the_stop(
        upstream: Upstream) -> None:
    call = straight_call(upstream)
    gateway, where = call.gateway, call.where            # type: ignore[attr-defined]
    old, new = gateway.pool.connect(*where), gateway.pool.connect(*where)
    gateway.pool.put(where, old)
    gateway.pool.put(where, new)
    old.since -= G.GATEWAY_IDLE_SECONDS + 1              # idle past its time
    gateway.pool.sweep_all()                             # the accept thread's timer
    assert old.sock.fileno() == -1 and gateway.pool.idle[where] == [new]
    gateway.stop()
    assert new.sock.fileno() == -1 and not gateway.pool.idle
    late = gateway.pool.connect(*where)
    gateway.pool.put(where, late)                        # after the stop: closed, not kept
    assert late.sock.fileno() == -1 and not gateway.pool.idle


def read_all(conn: G.UpstreamConn, answer: http.client.HTTPResponse) -> bytes:
    data, ended = conn.piece(answer)
    while not ended:
        more, ended = conn.piece(answer)
        data += more
    return data


@pytest.mark.pure
def test_an_answers_body_comes_off_its_framing_however_it_is_cut() -> None:
    a, b = socket.socketpair()
    with a, b:
        conn = G.UpstreamConn(a)
        b.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: "
                  b"chunked\r\n\r\n")
        answer = conn.answer()
        assert (answer.status, answer.chunked, answer.will_close) == (200, True, False)

        def drip() -> None:                      # one byte after another
            for byte in b"5;x=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-T: 1\r\n\r\n":
                b.sendall(bytes([byte]))
                time.sleep(0.001)
        dripping = threading.Thread(target=drip)
        dripping.start()
        got = read_all(conn, answer)
        dripping.join()
        assert got == b"hello world" and answer.isclosed() and conn.alive()
        b.sendall(b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 4\r\nRetry-After: 3"
                  b"\r\n\r\nslowX")
        answer = conn.answer()
        assert (conn.piece(answer), answer.getheader("retry-after")) == ((b"slow", True), "3")
        assert not conn.alive()                  # a stray byte, held in the reader alone
        assert conn.reader.read1(1) == b"X" and conn.alive()
        b.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        with pytest.raises(http.client.HTTPException):
            conn.piece(conn.answer())
        b.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\ncut")
        answer = conn.answer()
        assert conn.piece(answer) == (b"cut", False)
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(http.client.IncompleteRead):
            conn.piece(answer)
    a, b = socket.socketpair()
    with a, b:
        conn = G.UpstreamConn(a)
        b.sendall(b"HTTP/1.0 200 OK\r\n\r\nto the end")
        b.shutdown(socket.SHUT_WR)
        answer = conn.answer()
        assert (answer.length, answer.will_close) == (None, True)
        assert read_all(conn, answer) == b"to the end"


@pytest.mark.pure
def test_a_request_is_read_within_its_caps() -> None:
    a, b = socket.socketpair()
    try:
        b.sendall(b"POST /v1/messages HTTP/1.1\r\nContent-Length: 2\r\nX-Api-Key: k\r\n\r\n{}")
        request = G.read_request(a, time.monotonic() + 5)
        assert (request.method, request.path, request.body) == ("POST", "/v1/messages", b"{}")
        assert request.headers["x-api-key"] == "k"
        b.sendall(b"POST / HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
        with pytest.raises(G.GatewayRefusal) as refused:
            G.read_request(a, time.monotonic() + 5)
        assert refused.value.status == 413
        b.sendall(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n{")      # a slow drip
        with pytest.raises(G.GatewayRefusal) as refused:
            G.read_request(a, time.monotonic() + 0.3)
        assert refused.value.status == 408
    finally:
        a.close()
        b.close()


# pure: the gateway's threads and a task's end ###################################################

class NoBox:
    """What the gateway's threads ask of the box for a call refused at its path: no prices,
    and a loop that takes its record (none here)."""

    loop = type("NoLoop", (), {"post": staticmethod(lambda *_: None)})()

    def setting(self, name: str) -> dict[str, Any]:
        return {}


def listening_gateway() -> tuple[G.Gateway, G.TaskGateway, int]:
    """A Gateway (no box) with one task's listener on the host's 127.0.0.1: its threads run."""
    gateway = G.Gateway(NoBox())                 # type: ignore[arg-type]
    tg = G.TaskGateway("t", "token", "anthropic", "http://127.0.0.1:1")
    tg.listener = socket.socket()
    tg.listener.bind(("127.0.0.1", 0))
    tg.listener.listen(64)
    tg.listener.setblocking(False)
    gateway.tasks["t"] = tg
    gateway.change(True, tg)
    return gateway, tg, tg.listener.getsockname()[1]


def gateway_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "gateway")


@pytest.mark.pure
def test_a_bursts_gateway_threads_end_once_idle() -> None:
    """Each call beyond the idle threads starts one; they never ended, so one burst of calls
    left that many threads waiting for good.  Now all but GATEWAY_SPARE end once idle."""
    before = gateway_threads()
    gateway, tg, port = listening_gateway()
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(G.GATEWAY_TASK_CALLS)]
    try:
        for conn in conns:
            conn.sendall(b"GET / HTTP/1.1\r\n")                      # a head not yet whole
        eventually(lambda: gateway.running == len(conns), timeout=10)
        assert gateway_threads() - before == len(conns) + 1         # one each and a leader
        for conn in conns:
            conn.sendall(b"\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 404 ")      # not its path
        eventually(lambda: gateway_threads() - before == G.GATEWAY_SPARE, timeout=10)
        assert gateway.idle == G.GATEWAY_SPARE and gateway.running == 0
    finally:
        for conn in conns:
            conn.close()
        gateway.change(False, tg)


@pytest.mark.pure
def test_a_call_with_no_thread_to_be_had_gives_its_slot_back(monkeypatch: Any) -> None:
    """A call whose new accepting thread could not start kept its place among the task's calls
    in flight (and gurtd's) for good, unanswered: four such and the task had no model.  Now
    it is answered 503 and its slot is free again."""
    gateway, tg, port = listening_gateway()

    class NoThread(threading.Thread):
        def start(self) -> None:
            if self.name == "gateway":
                raise RuntimeError("can't start new thread")
            super().start()
    try:
        monkeypatch.setattr(G.threading, "Thread", NoThread)
        for _ in range(G.GATEWAY_TASK_CALLS + 1):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                assert conn.recv(100).startswith(b"HTTP/1.1 503 ")
        assert (gateway.running, tg.calls, gateway.idle) == (0, set(), 1)
        monkeypatch.undo()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 404 ")
    finally:
        gateway.change(False, tg)


@pytest.mark.pure
def test_a_tasks_end_cuts_no_socket_its_call_let_go() -> None:
    """Gateway.close read a call's upstream outside the lock and shut it after the call had
    closed it (the fd number by then maybe another's).  Now a call lets go of its upstream
    under the lock, and close cuts only sockets still the call's."""
    shut_after_close: list[str] = []
    cutting = threading.Event()

    class Watched(socket.socket):
        delay = 0.0

        def shutdown(self, how: int) -> None:
            if self.name == "task":
                cutting.set()
            time.sleep(self.delay)
            if self.fileno() == -1:
                shut_after_close.append(self.name)
            super().shutdown(how)
    gateway = G.Gateway(NoBox())                 # type: ignore[arg-type]
    tg = G.TaskGateway("t", "token", "anthropic", "http://127.0.0.1:1")
    gateway.tasks["t"] = tg
    task_side, upstream_side = Watched(), Watched()
    task_side.name, task_side.delay, upstream_side.name = "task", 0.3, "upstream"
    call = G.GatewayCall(task_side, upstream=upstream_side)
    tg.calls.add(call)
    closing = threading.Thread(target=gateway.close, args=("t",))
    closing.start()
    assert cutting.wait(10)                      # close is cutting the task's side (not a
    # 0.1 s pause: on a busy machine close may not have begun, and the call's end came first)
    gateway.upstream_done(tg, call, G.UpstreamConn(upstream_side), True)    # the call's end
    closing.join()
    task_side.close()
    assert shut_after_close == [] and upstream_side.fileno() == -1
    assert gateway.pool.idle.get(tg.where, []) == []     # the task ended: not kept either
