"""The tool broker, the wallet and approvals, told as users' stories.

Each test drives a real gurtd (the `gurtd` fixture): tasks run as real box users and call tools
with `gurtd tool` through the broker socket they see at /run/gurt/broker.sock; a person answers
through the HTTP API or the command line.  Nothing is mocked; all traffic goes to 127.0.0.1 and
unix sockets.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import gurtd as G
from conftest import (REJECTED, Gurtd, eventually, pay_line, python_line, recv_all, sse,
                      uid_processes)

# helpers #####################################################################################

def set_balance(g: Gurtd, cents: float) -> dict[str, Any]:
    wallet = g.api("PUT", "/api/wallet", {"balanceCents": cents})
    assert wallet["balanceCents"] == cents
    return wallet


def wallet(g: Gurtd) -> dict[str, Any]:
    return g.api("GET", "/api/wallet")


def pending_approval(g: Gurtd, task_id: str, timeout: float = 20.0) -> dict[str, Any]:
    """The task's pending approval, once there is one (and the task is waiting)."""
    found = g.pending(task_id, timeout)
    assert g.task(task_id)["state"] == "waiting"
    return found


def tool_entries(g: Gurtd, task_id: str) -> list[dict[str, Any]]:
    return [e for e in g.log(task_id) if e["type"] == "tool"]


def task_uid(task: dict[str, Any]) -> int:
    return pwd.getpwnam(task["user"]).pw_uid


def broker_path(g: Gurtd) -> str:
    return os.path.join(g.home, "run", "broker.sock")


def raw_broker_request(path: str, request: bytes, timeout: float = 10.0) -> tuple[int, Any]:
    """One raw HTTP request over a unix socket: (status, parsed JSON body)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(request)
        return parse_http_response(recv_all(s))


def parse_http_response(data: bytes) -> tuple[int, Any]:
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else None


def call_request(body: bytes) -> bytes:
    return (b"POST /call HTTP/1.1\r\nHost: box\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


# 1. allowed and unlisted tools ###############################################################

def test_a_granted_tool_works_and_others_are_refused(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    granted = gurtd.create(pay_line("alice", 7) +
                           "\ncurl -s --unix-socket /run/gurt/broker.sock http://box/tools",
                           tools=["wallet.pay"], budgetCents=100)
    unlisted = gurtd.create(pay_line("mallory", 9) + '; echo "pay exit $?"', tools=["ask"],
                            budgetCents=100)
    unknown = gurtd.create("gurtd tool nosuch.tool '{\"x\": 1}'; echo \"nosuch exit $?\"",
                           tools=["wallet.pay", "nosuch.tool"], budgetCents=100)

    # the granted call is paid and its result printed
    task = gurtd.wait_done(granted["id"])
    assert task["costCents"] == 7
    out = gurtd.output(task["id"])
    result = json.loads(out[0])
    assert result["paid"] is True and result["to"] == "alice" and result["cents"] == 7
    assert json.loads(out[1]) == {"tools": ["wallet.pay"]}       # the broker's GET /tools
    paid = gurtd.payments(task["id"])
    assert [(p["to"], p["cents"]) for p in paid] == [("alice", 7)]
    [entry] = tool_entries(gurtd, task["id"])
    assert entry["tool"] == "wallet.pay" and entry["result"]["paid"] is True
    assert entry["args"] == {"to": "alice", "cents": 7}
    assert isinstance(entry["caller"], int) and entry["caller"] >= G.UID_FIRST

    # a tool that is not in the task's tools: exit 1, nothing paid, an error in the log
    task = gurtd.wait_done(unlisted["id"])
    assert gurtd.output(task["id"]) == ["pay exit 1"]
    assert any("not granted" in line for line in gurtd.output(task["id"], "stderr")), \
        gurtd.output(task["id"], "stderr")
    assert gurtd.payments(task["id"]) == []
    assert task["costCents"] == 0
    [entry] = tool_entries(gurtd, task["id"])
    assert entry["tool"] == "wallet.pay" and "error" in entry and "result" not in entry

    # a tool name in tools without an executable behind it: a refusal too
    task = gurtd.wait_done(unknown["id"])
    assert gurtd.output(task["id"]) == ["nosuch exit 1"]
    assert any("nosuch.tool" in line for line in gurtd.output(task["id"], "stderr")), \
        gurtd.output(task["id"], "stderr")
    [entry] = tool_entries(gurtd, task["id"])
    assert entry["tool"] == "nosuch.tool" and "error" in entry and "result" not in entry

    assert wallet(gurtd)["balanceCents"] == 993
    assert gurtd.approvals() == []


# 2. payments within the budget, a short balance #################################################

def test_payments_within_the_budget_are_paid_at_once(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    task = gurtd.run_done(pay_line("bob", 30, memo="tea") + "\n" + pay_line("carol", 20),
                          tools=["wallet.pay"], budgetCents=100)
    assert task["costCents"] == 50
    paid = gurtd.payments(task["id"])
    assert [(p["task"], p["to"], p["cents"]) for p in paid] == \
        [(task["id"], "bob", 30), (task["id"], "carol", 20)]
    assert paid[0]["memo"] == "tea"
    assert paid[0]["balanceAfterCents"] == 970 and paid[1]["balanceAfterCents"] == 950
    assert wallet(gurtd)["balanceCents"] == 950
    # within the budget nobody was asked, and the task never waited
    assert gurtd.approvals(task=task["id"]) == []
    assert "waiting" not in gurtd.states(task["id"])
    results = [e["result"] for e in tool_entries(gurtd, task["id"])]
    assert [(r["to"], r["cents"], r["balanceCents"]) for r in results] == \
        [("bob", 30, 970), ("carol", 20, 950)]


def test_a_short_balance_refuses_the_payment(gurtd: Gurtd) -> None:
    set_balance(gurtd, 10)
    task = gurtd.run_done(pay_line("dave", 20) + '; echo "pay exit $?"', tools=["wallet.pay"],
                          budgetCents=100000)
    assert gurtd.output(task["id"]) == ["pay exit 1"]
    assert any("balance" in line for line in gurtd.output(task["id"], "stderr")), \
        gurtd.output(task["id"], "stderr")
    assert wallet(gurtd)["balanceCents"] == 10
    assert gurtd.payments() == []
    assert task["costCents"] == 0
    assert gurtd.approvals() == []
    assert not [e for e in tool_entries(gurtd, task["id"]) if "result" in e]



def test_the_wallet_and_answers_take_only_what_makes_sense(gurtd: Gurtd) -> None:
    set_balance(gurtd, 300)
    for body in ({"balanceCents": -1}, {"balanceCents": "5"}, {"balanceCents": True},
                 {"balanceCents": 5, "extra": 1}, {}, [5]):
        gurtd.api("PUT", "/api/wallet", body, status=400)
    assert wallet(gurtd)["balanceCents"] == 300
    assert len(wallet(gurtd)["ledger"]) == 1

    created = gurtd.create(pay_line("olga", 5), tools=["wallet.pay"])
    approval = pending_approval(gurtd, created["id"])
    for verb, body in (("approve", {"reason": 5}), ("deny", {"reason": ["x"]}),
                       ("approve", {"why": "x"}), ("answer", {})):
        code, data, _ = gurtd.request("POST", f"/api/approvals/{approval['id']}/{verb}", body)
        assert code in (400, 409), (verb, body, code, data)
    gurtd.api("GET", "/api/approvals?state=maybe", status=400)
    assert gurtd.api("GET", f"/api/approvals/{approval['id']}")["state"] == "pending"
    assert gurtd.task(created["id"])["state"] == "waiting"
    assert gurtd.payments() == []
    gurtd.api("POST", f"/api/approvals/{approval['id']}/deny", {})
    denied = gurtd.api("GET", f"/api/approvals/{approval['id']}")
    assert denied["state"] == "denied" and denied["reason"]      # a default reason
    assert gurtd.wait(created["id"])["state"] == "failed"
    assert gurtd.payments() == [] and wallet(gurtd)["balanceCents"] == 300

# 3. budget pauses ############################################################################

def test_a_budget_pause_answered_by_approve(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    # 5 and 5 reach the budget exactly (no pause); 20 more would pass it
    created = gurtd.create(pay_line("erin", 5) + "\n" + pay_line("fay", 5) + "\n" +
                           pay_line("frank", 20, memo="big") + "\necho after",
                           tools=["wallet.pay"], budgetCents=10)
    approval = pending_approval(gurtd, created["id"])
    assert approval["task"] == created["id"]
    assert approval["kind"] == "budget"
    assert approval["tool"] == "wallet.pay"
    assert approval["args"] == {"to": "frank", "cents": 20, "memo": "big"}
    assert approval["cents"] == 20
    assert approval["state"] == "pending"
    assert approval["answeredBy"] is None and approval["answeredAt"] is None
    assert gurtd.api("GET", f"/api/approvals/{approval['id']}") == approval
    # only the payment within the budget happened so far
    assert [(p["to"], p["cents"]) for p in gurtd.payments(created["id"])] == \
        [("erin", 5), ("fay", 5)]
    assert gurtd.task(created["id"])["costCents"] == 10

    answered = gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {"reason": "fine"})
    assert answered["state"] == "approved"
    assert answered["answeredBy"] == "api" and answered["reason"] == "fine"
    assert answered["answeredAt"]
    task = gurtd.wait_done(created["id"])
    assert gurtd.output(task["id"])[-1] == "after"
    assert [(p["to"], p["cents"]) for p in gurtd.payments(task["id"])] == \
        [("erin", 5), ("fay", 5), ("frank", 20)]
    assert wallet(gurtd)["balanceCents"] == 970
    assert task["costCents"] == 30
    # the task ran, waited, ran again on the approval, then finished
    assert gurtd.states(task["id"]) == ["queued", "running", "waiting", "running", "done"]
    assert gurtd.api("GET", f"/api/approvals/{approval['id']}")["state"] == "approved"


def test_a_budget_pause_answered_by_deny_hands_the_reason_to_the_task(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    created = gurtd.create(pay_line("gina", 5) + '; echo "pay exit $?"\necho next line',
                           tools=["wallet.pay"])           # budget 0: every spending asks
    assert created["budgetCents"] == 0
    approval = pending_approval(gurtd, created["id"])
    assert approval["cents"] == 5 and approval["kind"] == "budget"

    reason = "too expensive today"
    answered = gurtd.api("POST", f"/api/approvals/{approval['id']}/deny", {"reason": reason})
    assert answered["state"] == "denied"
    assert answered["reason"] == reason and answered["answeredBy"] == "api"
    task = gurtd.wait_done(created["id"])
    expected = REJECTED.format(tool="wallet.pay", reason=reason)
    assert any(expected in line for line in gurtd.output(task["id"], "stderr")), \
        gurtd.output(task["id"], "stderr")
    assert gurtd.output(task["id"]) == ["pay exit 1", "next line"]
    assert gurtd.payments() == []
    assert wallet(gurtd)["balanceCents"] == 1000
    assert task["costCents"] == 0
    assert not [e for e in tool_entries(gurtd, task["id"]) if "result" in e]
    assert gurtd.states(task["id"]) == ["queued", "running", "waiting", "running", "done"]


def test_approve_all_for_one_task_then_for_all(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    one = gurtd.create(pay_line("one", 11), tools=["wallet.pay"])
    two = gurtd.create(pay_line("two", 22), tools=["wallet.pay"])
    asker = gurtd.create("gurtd tool ask '{\"question\": \"which colour?\"}'", tools=["ask"])
    first = pending_approval(gurtd, one["id"])
    second = pending_approval(gurtd, two["id"])
    question = pending_approval(gurtd, asker["id"])
    assert question["kind"] == "ask"

    assert gurtd.api("POST", "/api/approvals/approve-all", {"task": one["id"]}) == \
        {"approved": 1, "skipped": 0}
    assert gurtd.api("GET", f"/api/approvals/{first['id']}")["state"] == "approved"
    assert gurtd.api("GET", f"/api/approvals/{second['id']}")["state"] == "pending"
    assert gurtd.wait(one["id"])["state"] == "done"
    assert gurtd.task(two["id"])["state"] == "waiting"
    assert [p["to"] for p in gurtd.payments()] == ["one"]

    # the rest: every pending spending (an ask is answered, not approved)
    assert gurtd.api("POST", "/api/approvals/approve-all", {}) == {"approved": 1, "skipped": 1}
    assert gurtd.api("GET", f"/api/approvals/{second['id']}")["state"] == "approved"
    assert gurtd.api("GET", f"/api/approvals/{second['id']}")["answeredBy"] == "api"
    assert gurtd.wait(two["id"])["state"] == "done"
    assert gurtd.api("GET", f"/api/approvals/{question['id']}")["state"] == "pending"
    assert gurtd.api("POST", "/api/approvals/approve-all", {}) == {"approved": 0, "skipped": 1}

    assert sorted((p["to"], p["cents"]) for p in gurtd.payments()) == [("one", 11), ("two", 22)]
    assert wallet(gurtd)["balanceCents"] == 1000 - 33
    gurtd.api("POST", f"/api/approvals/{question['id']}/answer", {"answer": "blue"})
    assert gurtd.wait(asker["id"])["state"] == "done"



# 4. asks, and answers that come too late or to the wrong thing ###################################

def test_an_ask_is_answered_and_answered_approvals_are_final(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    created = gurtd.create("gurtd tool ask '{\"question\": \"Deploy now?\"}'\n" +
                           pay_line("hank", 5) + '; echo "pay exit $?"',
                           tools=["ask", "wallet.pay"])
    ask = pending_approval(gurtd, created["id"])
    assert ask["kind"] == "ask" and ask["tool"] == "ask"
    assert ask["question"] == "Deploy now?" and ask["cents"] == 0
    assert ask["args"] == {"question": "Deploy now?"}

    answered = gurtd.api("POST", f"/api/approvals/{ask['id']}/answer", {"answer": "yes, go"})
    assert answered["state"] == "approved" and answered["answer"] == "yes, go"
    assert answered["answeredBy"] == "api"
    # answered once is answered: answer, approve and deny again are 409
    for verb, body in (("answer", {"answer": "no"}), ("approve", {}), ("deny", {})):
        gurtd.api("POST", f"/api/approvals/{ask['id']}/{verb}", body, status=409)
    assert gurtd.api("GET", f"/api/approvals/{ask['id']}")["answer"] == "yes, go"

    # the next line pays: a budget approval is approved or denied, not answered
    budget = eventually(lambda: [a for a in gurtd.approvals(state="pending", task=created["id"])
                                 if a["kind"] == "budget"], what="the budget approval")[0]
    gurtd.api("POST", f"/api/approvals/{budget['id']}/answer", {"answer": "ok"}, status=409)
    assert gurtd.api("GET", f"/api/approvals/{budget['id']}")["state"] == "pending"
    gurtd.api("POST", f"/api/approvals/{budget['id']}/approve", {})
    for verb, body in (("approve", {}), ("deny", {"reason": "late"}), ("answer", {"answer": "x"})):
        gurtd.api("POST", f"/api/approvals/{budget['id']}/{verb}", body, status=409)
    assert gurtd.api("GET", f"/api/approvals/{budget['id']}")["state"] == "approved"

    task = gurtd.wait_done(created["id"])
    out = gurtd.output(task["id"])
    assert json.loads(out[0]) == {"answer": "yes, go"}
    assert out[-1] == "pay exit 0"
    assert [(p["to"], p["cents"]) for p in gurtd.payments()] == [("hank", 5)]

    # an unknown approval is 404, whatever is asked of it
    for method, path, body in (("GET", "/api/approvals/azzzzzzzzz", None),
                               ("POST", "/api/approvals/azzzzzzzzz/approve", {}),
                               ("POST", "/api/approvals/azzzzzzzzz/deny", {}),
                               ("POST", "/api/approvals/azzzzzzzzz/answer", {"answer": "x"})):
        gurtd.api(method, path, body, status=404)


# 5. undo and stop while waiting ##############################################################

def test_undo_while_waiting_denies_the_approval_and_ends_the_task(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    created = gurtd.create(pay_line("ivan", 40) + "\necho never", tools=["wallet.pay"])
    approval = pending_approval(gurtd, created["id"])
    uid = task_uid(gurtd.task(created["id"]))
    assert uid_processes(uid), "the waiting task has no process"

    undone = gurtd.api("POST", f"/api/tasks/{created['id']}/undo")
    assert undone["state"] == "undone"
    after = gurtd.api("GET", f"/api/approvals/{approval['id']}")
    assert after["state"] == "denied"
    assert after["answeredBy"] == "undo" and after["reason"] == "answered by undo"
    assert after["answeredAt"]
    eventually(lambda: not uid_processes(uid), 10, "the task's processes to end")
    assert gurtd.worker_pids(undone) == []
    time.sleep(0.3)          # a call that slipped through would land now
    assert gurtd.task(created["id"])["state"] == "undone"
    assert "never" not in gurtd.output(created["id"])
    assert gurtd.payments() == [] and wallet(gurtd)["balanceCents"] == 1000
    assert gurtd.approvals(state="pending") == []


def test_stop_while_waiting_denies_the_approval_and_fails_the_task(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    created = gurtd.create(pay_line("judy", 40) + "\necho never", tools=["wallet.pay"])
    approval = pending_approval(gurtd, created["id"])
    uid = task_uid(gurtd.task(created["id"]))

    stopped = gurtd.api("POST", f"/api/tasks/{created['id']}/stop")
    assert stopped["state"] == "failed" and stopped["error"] == "stopped"
    after = gurtd.api("GET", f"/api/approvals/{approval['id']}")
    assert after["state"] == "denied" and after["answeredBy"] == "stop"
    eventually(lambda: not uid_processes(uid), 10, "the task's processes to end")
    task = gurtd.task(created["id"])
    assert task["state"] == "failed" and task["error"] == "stopped"
    assert "never" not in gurtd.output(created["id"])
    assert gurtd.payments() == [] and wallet(gurtd)["balanceCents"] == 1000
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {}, status=409)
    assert gurtd.payments() == []


@pytest.mark.parametrize("end", ["timeout", "stop", "undo"])
def test_a_call_whose_task_ends_while_it_waits_is_told_why_not_that_a_person_refused(
        gurtd: Gurtd, end: str) -> None:
    """Nobody answered: the call hears what ended its wait (the task timed out, was stopped,
    was undone), never 'rejected by the owner'."""
    set_balance(gurtd, 1000)
    created = gurtd.create(pay_line("kim", 40) + "\necho never", tools=["wallet.pay"])
    approval = pending_approval(gurtd, created["id"])
    if end == "timeout":
        gurtd.api("PUT", "/api/settings", {"taskTimeoutSeconds": 1})
        gurtd.wait(created["id"], timeout=15)
    elif end == "stop":
        gurtd.api("POST", f"/api/tasks/{created['id']}/stop")
    else:
        gurtd.api("POST", f"/api/tasks/{created['id']}/undo")
    after = gurtd.api("GET", f"/api/approvals/{approval['id']}")
    by, reason, why = {
        "timeout": ("stop", "timed out", "the task timed out (taskTimeoutSeconds)"),
        "stop": ("stop", "stopped", "the task was stopped"),
        "undo": ("undo", "answered by undo", "the task was undone")}[end]
    assert (after["state"], after["answeredBy"], after["reason"]) == ("denied", by, reason)
    told = eventually(lambda: [e["error"] for e in gurtd.log(created["id"])
                               if e["type"] == "tool" and "error" in e], 10, "the call's end")
    assert told == [f'Tool call "wallet.pay" was not run: {why} while it waited for approval']
    assert gurtd.payments() == [] and "never" not in gurtd.output(created["id"])


# 6. many payers at once ######################################################################

def test_twenty_tasks_paying_at_once_keep_the_books_straight(gurtd: Gurtd) -> None:
    gurtd.api("PUT", "/api/settings", {"maxRunningTasks": 20})
    set_balance(gurtd, 10000)
    created = {gurtd.create(pay_line(f"payee{i}", i), tools=["wallet.pay"], budgetCents=1000,
                            title=f"payer {i}")["id"]: i for i in range(1, 21)}
    for task_id, cents in created.items():
        assert gurtd.wait_done(task_id, timeout=60)["costCents"] == cents
    book = wallet(gurtd)
    paid = [e for e in book["ledger"] if "task" in e]
    assert len(paid) == 20
    assert sorted((e["task"], e["to"], e["cents"]) for e in paid) == \
        sorted((t, f"payee{i}", i) for t, i in created.items())
    assert book["balanceCents"] + sum(e["cents"] for e in paid) == 10000
    assert book["balanceCents"] == 10000 - 210
    # each entry's balance follows from the one before: no payment was lost in a race
    balance = 10000
    for entry in book["ledger"][1:]:
        balance -= entry["cents"]
        assert entry["balanceAfterCents"] == balance, entry
    assert gurtd.approvals() == []


# 7. callers that are not tasks ###############################################################

def _call_as_nobody(run_dir: str, request: bytes) -> tuple[int, Any]:
    """Connect to run_dir/broker.sock as uid 65534 (nobody) from a forked child."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.chdir(run_dir)                   # BOX_HOME's parent is 0700: connect relatively
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect("broker.sock")
                s.sendall(request)
                data = recv_all(s)
            os.write(write_fd, json.dumps({"uid": os.getuid(),
                                           "data": data.decode(errors="replace")}).encode())
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            os.write(write_fd, json.dumps({"exception": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        report = json.loads(f.read())
    os.waitpid(pid, 0)
    assert "exception" not in report, report
    assert report["uid"] == 65534
    return parse_http_response(report["data"].encode())


def test_a_process_that_is_not_a_task_is_refused(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    # a running task that may pay without asking: its grant is not for others to use
    sleeper = gurtd.create("sleep 30", tools=["wallet.pay"], budgetCents=1000)
    gurtd.wait(sleeper["id"], ("running",))
    pay = call_request(json.dumps({"tool": "wallet.pay",
                                   "args": {"to": "thief", "cents": 100}}).encode())
    tools = b"GET /tools HTTP/1.1\r\nHost: box\r\nConnection: close\r\n\r\n"

    # root, from the host
    status, body = raw_broker_request(broker_path(gurtd), pay)
    assert status == 403, body
    assert body["error"]
    status, body = raw_broker_request(broker_path(gurtd), tools)
    assert status == 403, body

    # a local user that is no task
    status, body = _call_as_nobody(os.path.join(gurtd.home, "run"), pay)
    assert status == 403, body
    status, body = _call_as_nobody(os.path.join(gurtd.home, "run"), tools)
    assert status == 403, body

    assert gurtd.payments() == [] and wallet(gurtd)["balanceCents"] == 1000
    assert gurtd.approvals() == []
    assert gurtd.task(sleeper["id"])["costCents"] == 0
    assert tool_entries(gurtd, sleeper["id"]) == []
    gurtd.api("POST", f"/api/tasks/{sleeper['id']}/stop")


# 8. a restart while a payment waits ##########################################################

def test_a_restart_fails_the_waiting_task_and_pays_nothing(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    created = gurtd.create(pay_line("kate", 60), tools=["wallet.pay"], budgetCents=50)
    approval = pending_approval(gurtd, created["id"])
    uid = task_uid(gurtd.task(created["id"]))
    before = wallet(gurtd)

    gurtd.restart(kill=True)

    task = gurtd.task(created["id"])
    assert task["state"] == "failed"
    assert task["error"] == "gurtd restarted while the task was running"
    after = gurtd.api("GET", f"/api/approvals/{approval['id']}")
    assert after["state"] == "denied" and after["answeredBy"] == "restart"
    assert wallet(gurtd) == before
    assert task["costCents"] == 0
    eventually(lambda: not uid_processes(uid), 10, "the old task's processes to end")
    # the approval is final: approving it now pays nothing, twice or half
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {}, status=409)
    assert gurtd.approvals(state="pending") == []
    time.sleep(0.3)
    assert wallet(gurtd) == before


# 9. bad input ################################################################################

PROBE = r"""
import json, socket
def send(name, raw):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("/run/gurt/broker.sock")
        s.settimeout(5)
        s.sendall(raw)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                if not data:
                    raise
                break       # the answer came; the server then dropped what it did not read
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        print(json.dumps({"case": name, "status": int(head.split(b" ")[1]),
                          "body": body.decode(errors="replace")}))
    except Exception as exc:
        print(json.dumps({"case": name, "status": 0, "body": repr(exc)}))
    finally:
        s.close()
def post(name, body, length=True):
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    head = b"POST /call HTTP/1.1\r\nHost: box\r\nContent-Type: application/json\r\n"
    head += b"Connection: close\r\n"
    if length:
        head += b"Content-Length: %d\r\n" % len(body)
    send(name, head + b"\r\n" + body)
for name, body in json.loads(CASES):
    post(name, body.encode() if isinstance(body, str) else body)
post("no length", b'{"tool": "wallet.pay", "args": {"to": "x", "cents": 1}}', length=False)
"""

BAD_CALLS: list[tuple[str, Any]] = [
    # malformed requests
    ("bad json", '{"tool": "wallet.pay", "args": {'),
    ("not an object", [1, 2]),
    ("missing tool", {"args": {"to": "x", "cents": 1}}),
    ("tool not a string", {"tool": 5, "args": {"to": "x", "cents": 1}}),
    ("extra key", {"tool": "wallet.pay", "args": {"to": "x", "cents": 1}, "budget": 9}),
    ("args not an object", {"tool": "wallet.pay", "args": [1]}),
    # wallet.pay arguments
    ("negative cents", {"tool": "wallet.pay", "args": {"to": "x", "cents": -5}}),
    ("string cents", {"tool": "wallet.pay", "args": {"to": "x", "cents": "5"}}),
    ("zero cents", {"tool": "wallet.pay", "args": {"to": "x", "cents": 0}}),
    ("true cents", {"tool": "wallet.pay", "args": {"to": "x", "cents": True}}),
    ("nan cents", '{"tool": "wallet.pay", "args": {"to": "x", "cents": NaN}}'),
    ("infinite cents", '{"tool": "wallet.pay", "args": {"to": "x", "cents": 1e999}}'),
    ("missing cents", {"tool": "wallet.pay", "args": {"to": "x"}}),
    ("missing to", {"tool": "wallet.pay", "args": {"cents": 5}}),
    ("empty to", {"tool": "wallet.pay", "args": {"to": " ", "cents": 5}}),
    ("extra argument", {"tool": "wallet.pay", "args": {"to": "x", "cents": 5, "tip": 1}}),
    ("memo not a string", {"tool": "wallet.pay", "args": {"to": "x", "cents": 5, "memo": 7}}),
    # ask arguments (a wrongly accepted one would wait for a person)
    ("ask without question", {"tool": "ask", "args": {}}),
    ("ask with extra", {"tool": "ask", "args": {"question": "q", "also": 1}}),
    ("ask empty question", {"tool": "ask", "args": {"question": ""}}),
    # too large: more than 64 KiB
    ("oversized", {"tool": "wallet.pay", "args": {"to": "x", "cents": 5,
                                                  "memo": "m" * (70 * 1024)}}),
]


def test_bad_calls_are_refused_and_spend_nothing(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    script = PROBE.replace("json.loads(CASES)", f"json.loads({json.dumps(json.dumps(BAD_CALLS))})")
    curl = ("curl -s --unix-socket /run/gurt/broker.sock -o /dev/null -w 'curl %{http_code}\\n' "
            "-H 'Content-Type: application/json' "
            "-d '{\"tool\": \"wallet.pay\", \"args\": {\"to\": \"x\", \"cents\": -1}' "
            "http://box/call")
    prompt = "\n".join([
        python_line(script),
        curl,
        pay_line("x", -3) + '; echo "client exit $?"',
        "gurtd tool wallet.pay '{\"to\": \"x\", \"cents\": true}'; echo \"client exit $?\"",
    ])
    # a budget this big would let any wrongly accepted payment through without asking
    task = gurtd.run_done(prompt, tools=["wallet.pay", "ask"], budgetCents=100000)
    out = gurtd.output(task["id"])
    results = {r["case"]: r for r in (json.loads(line) for line in out if line.startswith("{"))}
    assert set(results) == {name for name, _ in BAD_CALLS} | {"no length"}, out

    for name, _ in BAD_CALLS:
        result = results[name]
        assert result["status"] == (413 if name == "oversized" else 400), result
        body = json.loads(result["body"])
        assert isinstance(body.get("error"), str) and body["error"], result
    assert 400 <= results["no length"]["status"] < 500, results["no length"]
    assert "curl 400" in out, out
    assert out.count("client exit 1") == 2, out
    stderr = gurtd.output(task["id"], "stderr")
    assert any("cents" in line for line in stderr), stderr

    assert gurtd.payments() == [] and wallet(gurtd)["balanceCents"] == 1000
    assert task["costCents"] == 0
    assert gurtd.approvals() == []
    entries = tool_entries(gurtd, task["id"])
    assert entries, "bad arguments of a granted tool are logged with their error"
    assert not [e for e in entries if "result" in e], entries
    assert all(e.get("error") for e in entries), entries


# 10. an executable tool ######################################################################

ECHO_TOOL = """#!/bin/sh
input=$(cat)
printf '{"echo": %s, "costCents": 3, "user": "%s", "task": "%s"}\\n' \
  "$input" "$(id -un)" "$GURT_TASK"
"""


def test_an_executable_tool_runs_as_the_tools_user(gurtd: Gurtd) -> None:
    # gurt-tools must reach BOX_HOME/tools: the test's BOX_HOME parent is mkdtemp's 0700
    os.chmod(os.path.dirname(gurtd.home), 0o711)
    path = os.path.join(gurtd.home, "tools", "echo.tool")
    Path(path).write_text(ECHO_TOOL)
    os.chmod(path, 0o755)
    Path(gurtd.home, "tools", "notes.txt").write_text("not a tool\n")

    names = {t["name"]: t for t in gurtd.api("GET", "/api/tools")}
    assert {"wallet.pay", "ask", "echo.tool"} <= set(names), names
    assert names["echo.tool"]["kind"] == "executable"
    assert "notes.txt" not in names

    args = {"word": "hello", "n": [1, 2]}
    task = gurtd.run_done(f"gurtd tool echo.tool '{json.dumps(args)}'\nid -un",
                          tools=["echo.tool"])       # budget 0: a tool's cost is counted, not asked
    out = gurtd.output(task["id"])
    result = json.loads(out[0])
    assert result["echo"] == args
    assert result["costCents"] == 3
    assert result["task"] == task["id"]
    assert result["user"] == "gurt-tools"
    assert result["user"] not in ("root", task["user"])
    assert out[1] == task["user"]
    assert task["costCents"] == 3
    [entry] = tool_entries(gurtd, task["id"])
    assert entry["tool"] == "echo.tool" and entry["result"] == result and entry["cents"] == 3
    assert gurtd.approvals() == []
    assert gurtd.payments() == []


UNSHARE_TOOL = """#!/bin/sh
cat >/dev/null
said=$(unshare -U true 2>&1); user=$?
unshare -r -n true 2>/dev/null; net=$?
python3 -c 'import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x10000000))'; raw=$?
printf '{"user": %d, "net": %d, "raw": %d, "said": "%s"}\\n' "$user" "$net" "$raw" "$said"
"""


def test_an_executable_tool_makes_no_namespace(gurtd: Gurtd) -> None:
    """A tool ran as the tools user on the host with no kernel filter: with unprivileged user
    namespaces on (Debian) and no systemd's RestrictNamespaces, `unshare -U` made it root of
    a namespace of its own.  Now it is refused as in a worker, and so are the others."""
    os.chmod(os.path.dirname(gurtd.home), 0o711)
    path = os.path.join(gurtd.home, "tools", "unshare.tool")
    Path(path).write_text(UNSHARE_TOOL)
    os.chmod(path, 0o755)
    task = gurtd.run_done("gurtd tool unshare.tool '{}'", tools=["unshare.tool"])
    result = json.loads(gurtd.output(task["id"])[0])
    assert result["user"] != 0 and result["net"] != 0 and result["raw"] != 0, result
    assert "Operation not permitted" in result["said"], result


# 11. the events stream #######################################################################

def test_the_events_stream_tells_of_a_pending_approval_at_once(gurtd: Gurtd) -> None:
    set_balance(gurtd, 1000)
    waiting_at: list[float] = []

    def poll() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if gurtd.task(created["id"])["state"] == "waiting":
                waiting_at.append(time.monotonic())
                return
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    events: list[tuple[int, str, dict[str, Any]]] = []
    received_at = None
    with gurtd.stream("/api/events", timeout=15) as resp:
        assert resp.status == 200
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        created = gurtd.create(pay_line("liam", 5), tools=["wallet.pay"])
        poller.start()
        deadline = time.monotonic() + 20
        for event_id, kind, text in sse(resp):
            data = json.loads(text)
            assert event_id is not None and kind in ("task", "approval"), (event_id, kind)
            events.append((event_id, kind, data))
            if kind == "approval" and data["task"] == created["id"] and \
                    data["state"] == "pending":
                received_at = time.monotonic()
            if received_at is not None or time.monotonic() > deadline:
                break
        poller.join()
    assert received_at is not None, events
    assert waiting_at, "the task never went waiting"
    assert received_at - waiting_at[0] < 1.0, (received_at - waiting_at[0])
    ids = [e[0] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    assert ("task", created["id"], "running") in [(k, d.get("id"), d.get("state"))
                                                  for _, k, d in events]
    approval = [d for _, k, d in events if k == "approval"][-1]
    assert approval["kind"] == "budget" and approval["cents"] == 5
    gurtd.api("POST", f"/api/approvals/{approval['id']}/deny", {"reason": "no"})
    assert gurtd.wait(created["id"])["state"] == "failed"

    # ?since= replays what followed an event id: here the pending approval, then its answer
    pending_id = [i for i, k, d in events if k == "approval"][-1]
    replayed: list[tuple[str, dict[str, Any]]] = []
    with gurtd.stream(f"/api/events?since={pending_id - 1}", timeout=15) as resp:
        for _, kind, text in sse(resp):
            replayed.append((kind, json.loads(text)))
            if kind == "task" and replayed[-1][1]["state"] == "failed":
                break
    assert replayed[0] == ("approval", approval)
    denied = [d for k, d in replayed if k == "approval"][-1]
    assert denied["id"] == approval["id"] and denied["reason"] == "no"
    assert [(k, d["state"]) for k, d in replayed] == \
        [("approval", "pending"), ("task", "waiting"), ("approval", "denied"),
         ("task", "running"), ("task", "failed")]


# 12. the command line ########################################################################

def test_the_command_line_answers_approvals_and_shows_the_wallet(gurtd: Gurtd) -> None:
    proc = gurtd.cli_ok("wallet", "--set", "500", "--json")
    book = json.loads(proc.stdout)
    assert book["balanceCents"] == 500 and book["ledger"][-1]["set"] == 500
    assert wallet(gurtd)["balanceCents"] == 500

    created = gurtd.create("\n".join([
        pay_line("mia", 20),
        pay_line("noah", 30) + '; echo "second exit $?"',
        "gurtd tool ask '{\"question\": \"Ship it?\"}'",
    ]), tools=["wallet.pay", "ask"])

    first = pending_approval(gurtd, created["id"])
    proc = gurtd.cli_ok("approvals", "--json")
    listed = json.loads(proc.stdout)
    assert [a["id"] for a in listed] == [first["id"]]
    assert listed[0]["state"] == "pending" and listed[0]["args"] == {"to": "mia", "cents": 20}
    proc = gurtd.cli_ok("approve", first["id"])
    assert proc.stdout.strip() == f"{first['id']} approved"
    proc = gurtd.cli("approve", first["id"])            # once is enough: 409
    assert proc.returncode != 0 and "already" in proc.stderr, (proc.stdout, proc.stderr)

    second = eventually(lambda: [a for a in gurtd.approvals(state="pending", task=created["id"])
                                 if a["id"] != first["id"]], what="the second approval")[0]
    assert second["args"] == {"to": "noah", "cents": 30}
    proc = gurtd.cli_ok("deny", second["id"], "--reason", "not noah")
    assert proc.stdout.strip() == f"{second['id']} denied"
    assert gurtd.api("GET", f"/api/approvals/{second['id']}")["reason"] == "not noah"

    ask = eventually(lambda: [a for a in gurtd.approvals(state="pending", task=created["id"])
                              if a["kind"] == "ask"], what="the ask")[0]
    proc = gurtd.cli_ok("answer", ask["id"], "yes, ship")
    assert proc.stdout.strip() == f"{ask['id']} approved"

    task = gurtd.wait_done(created["id"])
    out = gurtd.output(task["id"])
    assert "second exit 1" in out, out
    assert json.loads(out[-1]) == {"answer": "yes, ship"}
    assert any(REJECTED.format(tool="wallet.pay", reason="not noah") in line
               for line in gurtd.output(task["id"], "stderr"))
    assert [(p["to"], p["cents"]) for p in gurtd.payments()] == [("mia", 20)]

    proc = gurtd.cli_ok("approvals", "--json", "--state", "denied")
    assert [a["id"] for a in json.loads(proc.stdout)] == [second["id"]]
    proc = gurtd.cli("approvals", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], proc.stdout

    proc = gurtd.cli_ok("wallet")
    assert re.search(r"^balance: 480(\.0)? cents$", proc.stdout, re.M), proc.stdout
    assert re.search(rf"{task['id']} paid 20 to mia$", proc.stdout, re.M), proc.stdout
    assert "set to 500" in proc.stdout
    assert "noah" not in proc.stdout


# 13. calls made at once #####################################################################

FAN_OUT = r"""
import json, socket, threading
def call(i):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("/run/gurt/broker.sock")          # blocking: the listen backlog is short
    s.settimeout(60)
    body = json.dumps({"tool": "wallet.pay", "args": {"to": "p%d" % i, "cents": 5}}).encode()
    req = (b"POST /call HTTP/1.1\r\nHost: box\r\nConnection: close\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    s.sendall(req[:-1])
    ready.wait(30)                    # all twenty calls arrive together
    s.sendall(req[-1:])
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    codes[i] = int(data.split(b" ")[1])
ready = threading.Barrier(20)
codes = {}
threads = [threading.Thread(target=call, args=(i,)) for i in range(20)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(sorted(codes.values())))
"""


def test_calls_made_at_once_cannot_spend_past_the_budget(gurtd: Gurtd) -> None:
    """An agent fires twenty 5-cent payments at once with a budget of 50: ten are paid, the
    other ten wait for a person (who denies them)."""
    set_balance(gurtd, 1000)
    created = gurtd.create(python_line(FAN_OUT), tools=["wallet.pay"], budgetCents=50)

    def settled() -> bool:
        pending = gurtd.approvals(state="pending", task=created["id"])
        return len(gurtd.payments(created["id"])) + len(pending) == 20 or \
            gurtd.task(created["id"])["state"] in ("done", "failed")
    eventually(settled, 30, "every call to be paid or waiting")
    time.sleep(0.2)
    paid_without_asking = sum(p["cents"] for p in gurtd.payments(created["id"]))
    for approval in gurtd.approvals(state="pending", task=created["id"]):
        gurtd.api("POST", f"/api/approvals/{approval['id']}/deny", {"reason": "over budget"})
    task = gurtd.wait(created["id"])
    assert paid_without_asking <= 50, \
        f"{paid_without_asking} cents were paid without approval on a budget of 50"
    assert paid_without_asking == 50
    assert task["state"] == "done", task
    assert json.loads(gurtd.output(task["id"])[-1]) == [200] * 10 + [403] * 10
    assert task["costCents"] == 50
    assert wallet(gurtd)["balanceCents"] == 950
    assert len(gurtd.approvals(state="denied", task=task["id"])) == 10


# 14. an oversized call, from the caller's side ###############################################

SLOW_OVERSIZED = r"""
import json, socket, time
body = json.dumps({"tool": "wallet.pay",
                   "args": {"to": "x", "cents": 5, "memo": "m" * (70 * 1024)}}).encode()
head = (b"POST /call HTTP/1.1\r\nHost: box\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("/run/gurt/broker.sock")
s.settimeout(10)
try:
    s.sendall(head)
    time.sleep(0.3)                # a caller that sends its body a little after the head
    s.sendall(body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head_out, _, rest = data.partition(b"\r\n\r\n")
    print(json.dumps({"status": int(head_out.split(b" ")[1]), "body": rest.decode()}))
except Exception as exc:
    print(json.dumps({"status": 0, "body": repr(exc)}))
"""


def test_an_oversized_call_gets_a_413_its_caller_can_read(gurtd: Gurtd) -> None:
    """Args over 64 KiB are refused with 413, and the caller reads that refusal (not a broken
    pipe) even when its body is still on the way when the broker answers."""
    set_balance(gurtd, 1000)
    task = gurtd.run_done("\n".join([
        python_line(SLOW_OVERSIZED),
        'gurtd tool wallet.pay "{\\"to\\": \\"x\\", \\"cents\\": 5, \\"memo\\": '
        '\\"$(head -c 70000 /dev/zero | tr \'\\0\' m)\\"}"; echo "client exit $?"',
    ]), tools=["wallet.pay"], budgetCents=100000)
    out = gurtd.output(task["id"])
    assert out[-1] == "client exit 1", out
    assert gurtd.payments() == [] and wallet(gurtd)["balanceCents"] == 1000
    assert task["costCents"] == 0
    assert not [e for e in tool_entries(gurtd, task["id"]) if "result" in e]
    slow = json.loads(out[0])
    assert slow["status"] == 413, slow
    assert "larger than" in json.loads(slow["body"])["error"], slow
    stderr = gurtd.output(task["id"], "stderr")
    assert any("larger than" in line for line in stderr), stderr
