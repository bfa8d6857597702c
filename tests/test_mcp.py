"""`gurtd mcp`, the Model Context Protocol server an agent inside a task talks to, driven by
the official MCP Python SDK (and by hand for messages the SDK would never send).

Outside a task the server answers the protocol but the broker refuses its tools; inside a task
(the test enters the worker's own namespaces and root as its box user, where /run/gurt/bin/gurtd
is the in-box command) it lists and calls exactly the task's tools.  Nothing is mocked: a real
gurtd, a real broker socket, real approvals answered through the HTTP API.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from conftest import GURTD, ROOT, Gurtd, eventually, wait_for_step

NEWEST = "2025-11-25"


# helpers #####################################################################################

def outside(g: Gurtd) -> StdioServerParameters:
    """`gurtd mcp` run by root on the host, pointed at the broker socket: not a task."""
    return StdioServerParameters(command=sys.executable, args=[GURTD, "mcp"], cwd=ROOT,
                                 env={"GURT_BROKER": os.path.join(g.home, "run", "broker.sock")})


def inside(g: Gurtd, task: dict[str, Any]) -> list[str]:
    """The argv of `gurtd mcp` inside the task: the worker's namespaces, root and uid."""
    pids = eventually(lambda: g.worker_pids(task), 20, "the task's processes")
    user = pwd.getpwnam(task["user"])
    return ["nsenter", "-t", str(min(pids)), "-m", "-i", "-n", "-r", "-w",
            "-S", str(user.pw_uid), "-G", str(user.pw_gid), "--", "/run/gurt/bin/gurtd", "mcp"]


class Raw:
    """`gurtd mcp` spoken to line by line, for messages no SDK sends."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **(env or {})}, cwd=ROOT, text=True)

    def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((message if isinstance(message, str) else json.dumps(message))
                              + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"gurtd mcp ended (exit {self.proc.poll()})"
        return json.loads(line)

    def ask(self, message: Any) -> dict[str, Any]:
        self.send(message)
        return self.reply()

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


# outside a task ##############################################################################

def test_the_handshake_answers_a_version_gurtd_speaks(gurtd: Gurtd) -> None:
    raw = Raw([sys.executable, GURTD, "mcp"])
    try:
        for asked, answered in (("2025-03-26", "2025-03-26"), ("2025-06-18", "2025-06-18"),
                                ("banana", NEWEST), (None, NEWEST), (7, NEWEST)):
            params: dict[str, Any] = {"capabilities": {},
                                      "clientInfo": {"name": "t", "version": "1"}}
            if asked is not None:
                params["protocolVersion"] = asked
            out = raw.ask({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params})
            assert out["result"]["protocolVersion"] == answered, (asked, out)
            assert out["result"]["serverInfo"]["name"] == "gurtd"
    finally:
        assert raw.close() == 0


def test_malformed_messages_get_json_rpc_errors_and_the_session_goes_on(gurtd: Gurtd) -> None:
    raw = Raw([sys.executable, GURTD, "mcp"])
    try:
        def error(message: Any) -> tuple[Any, int]:
            out = raw.ask(message)
            assert "result" not in out, out
            return out["id"], out["error"]["code"]

        assert error({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1, 2]}) == \
            (1, -32602)
        assert error({"jsonrpc": "2.0", "id": "s", "method": "tools/call", "params": "x"}) == \
            ("s", -32602)
        assert error({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {}}) == \
            (2, -32602)                                           # a call without a name
        assert error({"jsonrpc": "2.0", "id": 3}) == (3, -32600)  # no method
        assert error({"jsonrpc": "2.0", "id": 4, "result": {}}) == (4, -32600)  # a response
        assert error({"jsonrpc": "1.0", "id": 5, "method": "ping"}) == (5, -32600)
        assert error({"id": 6, "method": "ping"}) == (6, -32600)
        assert error({"jsonrpc": "2.0", "id": 8, "method": 12}) == (8, -32600)
        assert error([{"jsonrpc": "2.0", "id": 9, "method": "ping"}]) == (None, -32600)
        assert error("{not json") == (None, -32700)
        assert error({"jsonrpc": "2.0", "id": 10, "method": "no/such"}) == (10, -32601)
        raw.send({"jsonrpc": "2.0", "method": "notifications/initialized"})   # no answer
        assert error({"jsonrpc": "2.0", "id": True, "method": "ping"}) == (None, -32600)
        raw.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": "x"})
        raw.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": [1, 2]}})                     # unhashable: ignored
        assert raw.ask({"jsonrpc": "2.0", "id": 11, "method": "ping"}) == \
            {"jsonrpc": "2.0", "id": 11, "result": {}}
        assert raw.proc.poll() is None
    finally:
        assert raw.close() == 0


def test_without_a_broker_tools_list_says_why_in_words_alone() -> None:
    """No broker socket at all: -32603 with the words a person reads, no exception name."""
    raw = Raw([sys.executable, GURTD, "mcp"], {"GURT_BROKER": "/nonexistent/broker.sock"})
    try:
        error = raw.ask({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})["error"]
        assert error["code"] == -32603
        assert error["message"].startswith("not inside a task (no broker at "
                                           "/nonexistent/broker.sock)"), error
    finally:
        assert raw.close() == 0


def test_the_sdk_connects_outside_a_task_and_the_broker_refuses_its_tools(gurtd: Gurtd) -> None:
    async def session() -> None:
        async with stdio_client(outside(gurtd)) as (read, write):
            async with ClientSession(read, write) as client:
                assert (await client.initialize()).protocol_version == NEWEST
                await client.send_ping()
                with pytest.raises(MCPError) as refused:
                    await client.list_tools()
                assert "only a running task" in refused.value.message

    anyio.run(session)


# inside a task ###############################################################################

def test_inside_a_task_the_sdk_lists_calls_cancels_and_pings_meanwhile(gurtd: Gurtd) -> None:
    g = gurtd
    g.api("PUT", "/api/wallet", {"balanceCents": 100})
    task = g.create("sleep 60", tools=["ask", "wallet.pay"], budgetCents=10)
    wait_for_step(g, task["id"], "sleep 60")
    task = g.task(task["id"])
    argv = inside(g, task)
    params = StdioServerParameters(command=argv[0], args=argv[1:])

    async def session() -> None:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as client:
                await client.initialize()
                tools = {t.name: t for t in (await client.list_tools()).tools}
                assert set(tools) == {"ask", "wallet.pay"}
                assert tools["wallet.pay"].output_schema["required"] == \
                    ["paid", "to", "cents", "balanceCents"]

                paid = await client.call_tool("wallet.pay", {"to": "shop", "cents": 5})
                assert not paid.is_error
                assert paid.structured_content == {"paid": True, "to": "shop", "cents": 5,
                                                   "balanceCents": 95}
                refused = await client.call_tool("wallet.pay", {"to": "shop", "cents": -1})
                assert refused.is_error                  # a refusal the model may read
                for name in ("nosuch.tool", "approve-all"):
                    with pytest.raises(MCPError) as unknown:
                        await client.call_tool(name, {})
                    assert unknown.value.code == -32602

                # an ask that waits for a person blocks neither ping nor other calls, and
                # cancelling it withdraws its approval: nobody answers a call no one awaits
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as group:
                        group.start_soon(client.call_tool, "ask", {"question": "Ship it?"})
                        pending = await anyio.to_thread.run_sync(
                            lambda: eventually(lambda: g.approvals(
                                state="pending", task=task["id"]), 20, "the ask"))
                        assert g.task(task["id"])["state"] == "waiting"
                        with anyio.fail_after(10):
                            await client.send_ping()
                            more = await client.call_tool("wallet.pay", {"to": "x",
                                                                         "cents": 1})
                        assert more.structured_content["balanceCents"] == 94
                        scope.cancel()
                gone = await anyio.to_thread.run_sync(
                    lambda: eventually(lambda: g.approvals(state="denied", task=task["id"]), 20,
                                       "the withdrawal"))
                assert gone[0]["id"] == pending[0]["id"]
                assert gone[0]["answeredBy"] == "task" and "withdrawn" in gone[0]["reason"]
                assert g.task(task["id"])["state"] == "running"

                # an ask answered through the API comes back as structured content
                async with anyio.create_task_group() as group:
                    answers: list[Any] = []

                    async def ask() -> None:
                        answers.append(await client.call_tool("ask", {"question": "Colour?"}))

                    group.start_soon(ask)
                    await anyio.to_thread.run_sync(lambda: eventually(
                        lambda: g.approvals(state="pending", task=task["id"]), 20,
                        "the second ask"))
                    asked = g.approvals(state="pending", task=task["id"])[0]
                    g.api("POST", f"/api/approvals/{asked['id']}/answer", {"answer": "teal"})
                assert answers[0].structured_content == {"answer": "teal"}

    try:
        anyio.run(session)
        assert g.task(task["id"])["state"] == "running"
        tool_lines = [e for e in g.log(task["id"]) if e["type"] == "tool"]
        assert [e["tool"] for e in tool_lines if "result" in e] == \
            ["wallet.pay", "wallet.pay", "ask"]
    finally:
        g.api("POST", f"/api/tasks/{task['id']}/stop")
        g.wait(task["id"])


def test_a_client_that_goes_away_withdraws_its_waiting_ask(gurtd: Gurtd) -> None:
    g = gurtd
    task = g.create("sleep 60", tools=["ask"])
    wait_for_step(g, task["id"], "sleep 60")
    raw = Raw(inside(g, g.task(task["id"])))
    try:
        raw.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                  "params": {"name": "ask", "arguments": {"question": "Still there?"}}})
        asked = eventually(lambda: g.approvals(state="pending", task=task["id"]), 20, "the ask")
        assert raw.ask({"jsonrpc": "2.0", "id": 2, "method": "ping"})["id"] == 2
        assert raw.close() == 0          # stdin closed: after a grace, the ask is withdrawn
        gone = eventually(lambda: g.approvals(state="denied", task=task["id"]), 20,
                          "the withdrawal")
        assert [a["id"] for a in gone] == [asked[0]["id"]] and gone[0]["answeredBy"] == "task"
        assert g.task(task["id"])["state"] == "running"
    finally:
        if raw.proc.poll() is None:
            raw.proc.kill()
        g.api("POST", f"/api/tasks/{task['id']}/stop")
        g.wait(task["id"])
