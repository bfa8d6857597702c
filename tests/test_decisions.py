"""Decisions that scale (issue 14): approve with changes, always-approve policies, and hosts a
task asks for at run time, told as the stories of a person answering fifty decisions a day.

Real gurtd, real `fake`-worker tasks (one /bin/sh line per prompt line as the task's own user)
paying with `gurtd tool wallet.pay` through the broker socket.  The host stories run against the
suite's fake internet (conftest's `fake_internet`: the web server on 198.18.0.10 inside `gtinet`,
names from a DNS server of the tests on 127.0.0.1).  Traffic goes only to loopback and into
`gtinet`.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import gurtd as G
from conftest import (A, Gurtd, droid_events, droid_installed, droid_replay, eventually, pay_line,
                      sse)

# helpers #####################################################################################


def pay_said(to: str, cents: Any, quiet: bool = True) -> str:
    """Pay with the tool client, then say `pay <its exit code>` (its result too if not quiet)."""
    return pay_line(to, cents) + (" >/dev/null" if quiet else "") + "; echo \"pay $?\""


def ask_line(question: str) -> str:
    return f"gurtd tool ask '{json.dumps({'question': question})}'"


def payments(g: Gurtd, task_id: str) -> list[tuple[str, float]]:
    return [(e["to"], e["cents"]) for e in g.payments(task_id)]


def auto_approvals(g: Gurtd, task_id: str) -> list[dict[str, Any]]:
    return [a for a in g.approvals(task=task_id) if a["answeredBy"] == "policy"]


def in_seconds(seconds: float) -> str:
    when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


@pytest.fixture(autouse=True)
def funded(request: pytest.FixtureRequest) -> None:
    """The wallet of the test's gurtd starts with 10000 cents."""
    if "gurtd" in request.fixturenames:
        request.getfixturevalue("gurtd").api("PUT", "/api/wallet", {"balanceCents": 10000})


# pure ########################################################################################

@pytest.mark.pure
def test_policy_limits_and_what_cannot_be_always_approved() -> None:
    policy = G.Policy(id="p123456789", tool="wallet.pay", scope="box", createdAt=G.now_iso(),
                      createdBy="api", maxCents=10, totalCents=12)
    assert G.policy_allows(policy, 10, None) is None
    assert "maxCents" in (G.policy_allows(policy, 11, None) or "")
    assert "neverAutoApproveCents" in (G.policy_allows(policy, 5, 4) or "")
    policy.spentCents = 10
    assert "totalCents" in (G.policy_allows(policy, 5, None) or "")
    policy.spentCents = 12
    assert "spent" in (policy.ended() or "") and not policy.to_api()["active"]
    policy.spentCents, policy.expiresAt = 0, "2000-01-01T00:00:00Z"
    assert "expired" in (G.policy_allows(policy, 1, None) or "")

    def approval(**kw: Any) -> G.Approval:
        fields = {"id": "a123456789", "task": "t123456789", "kind": "budget",
                  "tool": "wallet.pay", "args": {}, "cents": 50, "question": None,
                  "state": "pending", "createdAt": G.now_iso(), **kw}
        return G.Approval(**fields)
    assert G.always_blocked(approval(), None) is None
    assert "ask" in (G.always_blocked(approval(kind="ask", tool="ask"), None) or "")
    assert "neverAutoApproveCents" in (G.always_blocked(approval(), 49) or "")
    assert "budgetCents" in (G.always_blocked(approval(tool="model"), None) or "")

    for bad in ({"tool": "ask", "scope": "box"}, {"tool": "wallet.pay", "scope": "galaxy"},
                {"tool": "wallet.pay", "scope": "task"},
                {"tool": "wallet.pay", "scope": "box", "workspace": "home"},
                {"tool": "host", "scope": "box"}, {"tool": "host", "scope": "box",
                                                   "host": "127.0.0.1"},
                {"tool": "host", "scope": "box", "host": "a.test:80"},
                {"tool": "wallet.pay", "scope": "box", "maxCents": -1},
                {"tool": "wallet.pay", "scope": "box", "expiresAt": "tomorrow"},
                {"tool": "wallet.pay", "scope": "box", "expiresAt": "2030-01-01T00:00:00"},
                {"tool": "wallet.pay", "scope": "box", "extra": 1}, [], "x"):
        with pytest.raises(G.ApiError) as caught:
            G.validate_policy_body(bad)
        assert caught.value.status == 400, bad
    assert G.validate_policy_body({"tool": "host", "scope": "workspace", "workspace": "home",
                                   "host": "*.Example.com"})["host"] == "*.example.com"


# approve with changes ########################################################################

def test_approve_with_changed_args_pays_what_the_person_wrote(gurtd: Gurtd) -> None:
    task = gurtd.create(pay_said("mallory", 500, quiet=False), tools=["wallet.pay"], budgetCents=0)
    approval = gurtd.pending(task["id"])
    assert approval["canAlwaysApprove"] is True and approval["alwaysBlockedReason"] is None
    path = f"/api/approvals/{approval['id']}/approve"
    # checked like the originals: nothing changes on a bad one
    for body in ({"args": {"to": "alice", "cents": -5}}, {"args": {"to": "", "cents": 5}},
                 {"args": {"to": "alice", "cents": 5, "extra": 1}}, {"args": [1]},
                 {"args": {"to": "a", "cents": 5}, "budgetCents": 900}):
        gurtd.api("POST", path, body, status=400)
    assert gurtd.api("GET", f"/api/approvals/{approval['id']}")["state"] == "pending"

    answered = gurtd.api("POST", path, {"args": {"to": "alice", "cents": 5, "memo": "not 500"},
                                        "reason": "5 is plenty"})
    assert answered["approvedArgs"] == {"to": "alice", "cents": 5, "memo": "not 500"}
    assert answered["args"] == {"to": "mallory", "cents": 500}
    done = gurtd.wait(task["id"])
    assert done["state"] == "done" and done["costCents"] == 5, done
    assert payments(gurtd, task["id"]) == [("alice", 5)]
    # the tool's result, as the task received it: alice, 5
    assert gurtd.output(task["id"]) == [json.dumps({"paid": True, "to": "alice", "cents": 5,
                                                    "balanceCents": 9995}), "pay 0"]
    entry = [e for e in gurtd.log(task["id"]) if e["type"] == "approval" and "state" in e][0]
    assert entry["originalArgs"] == {"to": "mallory", "cents": 500}
    assert entry["args"]["to"] == "alice" and entry["reason"] == "5 is plenty"


def test_an_ask_takes_no_args_and_cannot_be_always_approved(gurtd: Gurtd) -> None:
    task = gurtd.create(ask_line("may I?"), tools=["ask"])
    approval = gurtd.pending(task["id"])
    assert approval["canAlwaysApprove"] is False
    assert "ask" in approval["alwaysBlockedReason"]
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve",
              {"args": {"question": "other"}}, status=409)
    code, data, _ = gurtd.request("POST", f"/api/approvals/{approval['id']}/always",
                                  {"scope": "box"})
    assert code == 409 and "ask" in data["error"], data
    assert gurtd.api("GET", "/api/policies") == []
    gurtd.api("POST", f"/api/approvals/{approval['id']}/answer", {"answer": "yes"})
    assert gurtd.wait(task["id"])["state"] == "done"


def test_a_budget_raise_lets_the_task_go_on_without_asking_again(gurtd: Gurtd) -> None:
    task = gurtd.create("\n".join([pay_said("a", 8), pay_said("b", 8), pay_said("c", 8)]),
                        tools=["wallet.pay"], budgetCents=10)
    approval = gurtd.pending(task["id"])
    assert approval["cents"] == 8 and payments(gurtd, task["id"]) == [("a", 8)]
    path = f"/api/approvals/{approval['id']}/approve"
    for low in (10, 16, -1):     # not above the cost with this call (8 + 8)
        gurtd.api("POST", path, {"budgetCents": low}, status=400)
    assert gurtd.task(task["id"])["budgetCents"] == 10
    answered = gurtd.api("POST", path, {"budgetCents": 30})
    assert answered["budgetCents"] == 30 and answered["state"] == "approved"
    done = gurtd.wait(task["id"])
    assert done["state"] == "done" and done["budgetCents"] == 30 and done["costCents"] == 24
    assert payments(gurtd, task["id"]) == [("a", 8), ("b", 8), ("c", 8)]
    assert len(gurtd.approvals(task=task["id"])) == 1          # c fitted: nobody was asked
    assert any(e["type"] == "budget" and e["was"] == 10 for e in gurtd.log(task["id"]))


# always-approve ##############################################################################

def test_always_at_each_scope_approves_exactly_that_scope(gurtd: Gurtd) -> None:
    gurtd.api("POST", "/api/workspaces", {"name": "other"})
    pay2 = pay_said("x", 20) + "\n" + pay_said("y", 20)

    t1 = gurtd.create(pay2, tools=["wallet.pay"])
    gurtd.api("POST", f"/api/approvals/{gurtd.pending(t1['id'])['id']}/always", {"scope": "task"})
    assert gurtd.wait(t1["id"])["costCents"] == 40
    assert len(auto_approvals(gurtd, t1["id"])) == 1              # y: by the task's policy

    t2 = gurtd.create(pay_said("x", 20), tools=["wallet.pay"])    # same workspace, other task
    answered = gurtd.api("POST", f"/api/approvals/{gurtd.pending(t2['id'])['id']}/always",
                         {"scope": "workspace", "reason": "home may pay"})
    assert answered["policy"] and answered["state"] == "approved"
    gurtd.wait(t2["id"])

    t3 = gurtd.create(pay2, tools=["wallet.pay"])                 # home: nobody asked
    assert gurtd.wait(t3["id"])["costCents"] == 40
    autos = auto_approvals(gurtd, t3["id"])
    assert len(autos) == 2 and {a["policy"] for a in autos} == {answered["policy"]}
    logged = [e for e in gurtd.log(t3["id"]) if e["type"] == "approval"]
    assert [e["policy"] for e in logged] == [answered["policy"]] * 2

    t4 = gurtd.create(pay_said("x", 20), tools=["wallet.pay"], workspace="other")
    gurtd.api("POST", f"/api/approvals/{gurtd.pending(t4['id'])['id']}/always", {"scope": "box"})
    gurtd.wait(t4["id"])
    t5 = gurtd.create(pay2, tools=["wallet.pay"], workspace="other")
    assert gurtd.wait(t5["id"])["costCents"] == 40 and len(auto_approvals(gurtd, t5["id"])) == 2

    policies = gurtd.api("GET", "/api/policies")
    assert sorted(p["scope"] for p in policies) == ["box", "task", "workspace"]
    by_scope = {p["scope"]: p for p in policies}
    assert by_scope["task"]["task"] == t1["id"] and by_scope["task"]["uses"] == 2
    assert by_scope["workspace"]["workspace"] == "home"
    assert by_scope["workspace"]["spentCents"] == 60          # t2's own call and t3's two
    assert all(p["createdBy"].startswith("approval a") for p in policies)
    for t in (t1, t3, t5):
        assert gurtd.task(t["id"])["state"] == "done"


def test_limits_and_expiry_end_a_policy(gurtd: Gurtd) -> None:
    policy = gurtd.api("POST", "/api/policies", {"tool": "wallet.pay", "scope": "box",
                                                 "maxCents": 10, "totalCents": 12}, status=201)
    task = gurtd.create("\n".join([pay_said("a", 5), pay_said("big", 11), pay_said("b", 5),
                                   pay_said("c", 5)]), tools=["wallet.pay"])
    big = gurtd.pending(task["id"])                              # above maxCents: asks
    assert big["cents"] == 11
    gurtd.api("POST", f"/api/approvals/{big['id']}/deny", {"reason": "too much"})
    over = eventually(lambda: [a for a in gurtd.approvals(state="pending", task=task["id"])],
                      30, "c asks: 15 would pass totalCents")[0]
    assert over["args"]["to"] == "c"
    gurtd.api("POST", f"/api/approvals/{over['id']}/deny", {})
    gurtd.wait(task["id"])
    assert payments(gurtd, task["id"]) == [("a", 5), ("b", 5)]
    assert gurtd.output(task["id"]) == ["pay 0", "pay 1", "pay 0", "pay 1"]
    assert gurtd.api("GET", "/api/policies")[0]["spentCents"] == 10

    gurtd.api("DELETE", f"/api/policies/{policy['id']}")
    soon = gurtd.api("POST", "/api/policies", {"tool": "wallet.pay", "scope": "box",
                                               "expiresAt": in_seconds(10)}, status=201)
    task = gurtd.create("\n".join([pay_said("early", 1), ask_line("expired yet?"),
                                   pay_said("late", 1)]), tools=["wallet.pay", "ask"])
    question = gurtd.pending(task["id"])
    assert [a["args"]["to"] for a in auto_approvals(gurtd, task["id"])] == ["early"]
    listed = eventually(lambda: [p for p in gurtd.api("GET", "/api/policies")
                                 if not p["active"]], 30, "the policy's expiry")
    assert listed[0]["id"] == soon["id"] and "expired" in listed[0]["endedBecause"]
    gurtd.api("POST", f"/api/approvals/{question['id']}/answer", {"answer": "yes"})
    late = eventually(lambda: [a for a in gurtd.approvals(state="pending", task=task["id"])],
                      30, "late asks")[0]
    assert late["args"]["to"] == "late" and late["kind"] == "budget"
    gurtd.api("POST", f"/api/approvals/{late['id']}/approve")
    assert gurtd.wait(task["id"])["costCents"] == 2


def test_a_deleted_policy_asks_again_and_events_tell_of_policy_changes(gurtd: Gurtd) -> None:
    with gurtd.stream("/api/events", timeout=30) as stream:
        assert stream.status == 200
        policy = gurtd.api("POST", "/api/policies", {"tool": "wallet.pay", "scope": "box"},
                           status=201)
        task = gurtd.create("\n".join([pay_said("a", 5), ask_line("go on?"), pay_said("b", 5)]),
                            tools=["wallet.pay", "ask"])
        question = gurtd.pending(task["id"])
        assert question["kind"] == "ask"
        assert [a["args"]["to"] for a in auto_approvals(gurtd, task["id"])] == ["a"]
        assert gurtd.api("DELETE", f"/api/policies/{policy['id']}")["id"] == policy["id"]
        gurtd.api("DELETE", f"/api/policies/{policy['id']}", status=404)
        assert gurtd.api("GET", "/api/policies") == []
        gurtd.api("POST", f"/api/approvals/{question['id']}/answer", {"answer": "yes"})
        again = eventually(lambda: [a for a in gurtd.approvals(state="pending",
                                                               task=task["id"])], 30, "b asks")[0]
        assert again["args"]["to"] == "b" and again["kind"] == "budget"
        gurtd.api("POST", f"/api/approvals/{again['id']}/deny", {"reason": "no more"})
        assert gurtd.wait(task["id"])["costCents"] == 5

        seen: list[tuple[str, Any]] = []
        deadline = time.monotonic() + 20
        for _, event, text in sse(stream.fp):
            if event == "policy":
                data = json.loads(text)
                assert data["policy"]["id"] == policy["id"]
                seen.append((event, data["action"]))
            if time.monotonic() > deadline or [a for _, a in seen].count("deleted") >= 1:
                break
        assert [a for _, a in seen] == ["created", "used", "deleted"], seen
    assert not os.path.exists(os.path.join(gurtd.home, "policies.json")) or \
        json.load(open(os.path.join(gurtd.home, "policies.json"))) == {"policies": []}


def test_never_auto_approve_and_approve_all_skip_and_count(gurtd: Gurtd) -> None:
    gurtd.api("PUT", "/api/settings", {"neverAutoApproveCents": -1}, status=400)
    gurtd.api("PUT", "/api/settings", {"neverAutoApproveCents": 100})
    big = gurtd.create(pay_said("big", 150), tools=["wallet.pay"])
    asker = gurtd.create(ask_line("which colour?"), tools=["ask"])
    small = gurtd.create(pay_said("small", 5), tools=["wallet.pay"])
    big_approval = gurtd.pending(big["id"])
    assert big_approval["canAlwaysApprove"] is False
    assert "neverAutoApproveCents" in big_approval["alwaysBlockedReason"]
    code, data, _ = gurtd.request("POST", f"/api/approvals/{big_approval['id']}/always",
                                  {"scope": "task"})
    assert code == 409 and "neverAutoApproveCents" in data["error"], data
    question = gurtd.pending(asker["id"])
    gurtd.pending(small["id"])

    # approve-all: the small payment; the ask and the big one wait for a person's own look
    assert gurtd.api("POST", "/api/approvals/approve-all", {}) == {"approved": 1, "skipped": 2}
    assert gurtd.wait(small["id"])["state"] == "done"
    assert payments(gurtd, small["id"]) == [("small", 5)]
    assert {a["id"] for a in gurtd.approvals(state="pending")} == {big_approval["id"],
                                                                   question["id"]}
    # a box policy does not reach past the owner's limit either
    gurtd.api("POST", "/api/policies", {"tool": "wallet.pay", "scope": "box"}, status=201)
    again = gurtd.create(pay_said("big", 150) + "\n" + pay_said("fine", 50), tools=["wallet.pay"])
    assert gurtd.pending(again["id"])["cents"] == 150
    # raising the setting lets a person always-approve the big one after all
    gurtd.api("PUT", "/api/settings", {"neverAutoApproveCents": None})
    assert gurtd.api("GET", f"/api/approvals/{big_approval['id']}")["canAlwaysApprove"] is True
    assert gurtd.api("POST", "/api/approvals/approve-all", {"task": again["id"]}) == \
        {"approved": 1, "skipped": 0}
    assert gurtd.wait(again["id"])["costCents"] == 200
    assert [a["args"]["to"] for a in auto_approvals(gurtd, again["id"])] == ["fine"]
    gurtd.api("POST", f"/api/approvals/{big_approval['id']}/deny", {})
    gurtd.api("POST", f"/api/approvals/{question['id']}/answer", {"answer": "red"})
    for t in (big, asker, small):
        assert gurtd.wait(t["id"])["state"] == "done"


def test_the_command_line_approves_with_args_always_and_manages_policies(gurtd: Gurtd) -> None:
    task = gurtd.create(pay_said("x", 40) + "\n" + pay_said("y", 40) + "\n" + pay_said("z", 40),
                        tools=["wallet.pay"])
    first = gurtd.pending(task["id"])
    proc = gurtd.cli("approve", first["id"], "--args", "not json")
    assert proc.returncode != 0 and "--args" in proc.stderr
    proc = gurtd.cli_ok("approve", first["id"], "--args", '{"to": "x", "cents": 4}')
    second = eventually(lambda: [a for a in gurtd.approvals(state="pending", task=task["id"])],
                        30, "y asks")[0]
    proc = gurtd.cli("approve", second["id"], "--always", "task")
    assert proc.returncode == 0 and "policy p" in proc.stdout, proc.stderr
    assert gurtd.wait(task["id"])["costCents"] == 84
    proc = gurtd.cli("policies")
    assert proc.returncode == 0 and "wallet.pay" in proc.stdout and task["id"] in proc.stdout
    policy_id = gurtd.api("GET", "/api/policies")[0]["id"]
    proc = gurtd.cli("policy", "rm", policy_id)
    assert proc.returncode == 0 and f"{policy_id} deleted" in proc.stdout, proc.stderr
    assert gurtd.api("GET", "/api/policies") == []
    proc = gurtd.cli("policy", "rm", policy_id)
    assert proc.returncode != 0 and "No policy with this id" in proc.stderr, proc.stderr


def test_a_damaged_policies_file_is_set_aside_and_gurtd_starts(gurtd: Gurtd) -> None:
    gurtd.api("POST", "/api/policies", {"tool": "wallet.pay", "scope": "box"}, status=201)
    path = os.path.join(gurtd.home, "policies.json")
    stored = json.load(open(path))
    assert len(stored["policies"]) == 1
    stored["policies"][0]["expiresAt"] = "not a time"       # a hand edit gone wrong
    Path(path).write_text(json.dumps(stored))
    gurtd.restart()
    assert gurtd.api("GET", "/api/policies") == []               # nothing half-trusted
    assert [n for n in os.listdir(gurtd.home) if n.startswith("policies.json.damaged-")]
    assert "policies.json set aside" in gurtd.log_text()
    task = gurtd.create(pay_said("x", 5), tools=["wallet.pay"])  # so a payment asks again
    gurtd.api("POST", f"/api/approvals/{gurtd.pending(task['id'])['id']}/deny", {})
    assert gurtd.wait(task["id"])["costCents"] == 0


# droid: a budget raise while paused, and what its system prompt says ##########################

@pytest.fixture
def droid_printing_prompt(gurtd: Gurtd) -> Iterator[Gurtd]:
    """gurtd with a stand-in Droid CLI that prints its system prompt (as plain output), then
    replays the documented stream-json events of tests/fixtures (usage passing 50 cents)."""
    with droid_installed(gurtd, droid_replay([json.dumps(e) for e in droid_events("documented")],
                                             "true", first="cat /run/gurt/system-prompt.md")):
        gurtd.api("PUT", "/api/settings", {"droidFactoryKey": True})   # the stream's usage
        yield gurtd


def test_a_paused_droid_task_goes_on_up_to_a_raised_budget(droid_printing_prompt: Gurtd) -> None:
    g = droid_printing_prompt
    task = g.create("go", title="raise", worker=None, budgetCents=50, askHosts=True)
    approval = g.pending(task["id"])
    assert approval["tool"] == "model" and approval["canAlwaysApprove"] is False
    assert "budgetCents" in approval["alwaysBlockedReason"]
    g.api("POST", f"/api/approvals/{approval['id']}/approve", {"budgetCents": 10_000})
    done = g.wait(task["id"], timeout=60)
    assert done["state"] == "done" and done["budgetCents"] == 10_000, done
    assert len(g.approvals(task=task["id"])) == 1      # no second pause below 10000 cents
    said = "\n".join(g.output(task["id"]))
    assert "Other hosts: looking up a name outside that list asks a person" in said
    plain = g.create("go", title="plain", worker=None, budgetCents=10_000)
    g.wait(plain["id"], timeout=60)
    assert "Other hosts" not in "\n".join(g.output(plain["id"]))


# hosts asked at run time #####################################################################

WEB = A                 # the fake internet's a.test: its names here all answer it

# in a task: one A query to gurtd's resolver that waits up to 40 s for its answer (a held
# query is answered when a person decides), printed as `dns NAME rcode=N addr=...`
DNS_PROBE = r'''
import random, socket, struct, sys
name = sys.argv[1]
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
qid = random.randrange(65536)
q = struct.pack("!HHHHHH", qid, 0x100, 1, 0, 0, 0)
for label in name.split("."):
    q += bytes([len(label)]) + label.encode()
q += b"\0" + struct.pack("!HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(40)
s.connect((ns, 53))
s.send(q)
d = s.recv(4096)
print("dns", name, "rcode=%d" % (d[3] & 15), "addr=" + (socket.inet_ntoa(d[-4:]) if d[7] else "-"))
'''


def dns_probe(name: str) -> str:
    code = base64.b64encode(DNS_PROBE.encode()).decode()
    return f"python3 -c 'import base64;exec(base64.b64decode(\"{code}\"))' {name}"


def fetch(name: str) -> str:
    return f"curl -sS --max-time 5 http://{name}/ 2>&1 | tr -d '\\r\\n' | head -c 200; echo"


def host_approval(g: Gurtd, task_id: str, name: str) -> dict[str, Any]:
    found = g.pending(task_id)
    assert found["kind"] == "host" and found["tool"] == "host", found
    assert found["args"]["name"] == name and found["canAlwaysApprove"] is True
    return found


def test_a_host_asked_at_run_time_is_reached_after_approve_and_refused_after_deny(
        net_gurtd: Gurtd) -> None:
    g = net_gurtd
    code, data, _ = g.request("POST", "/api/tasks", {"title": "t", "prompt": "true",
                                                     "worker": "fake", "askHosts": "yes"})
    assert code == 400 and "askHosts" in data["error"]
    task = g.create("\n".join([dns_probe("ask.test"), fetch("ask.test"), dns_probe("deny.test"),
                               "getent hosts deny.test; echo getent $?"]), askHosts=True)
    assert task["askHosts"] is True and task["hosts"] == []
    asked = host_approval(g, task["id"], "ask.test")
    assert g.task(task["id"])["state"] == "waiting"
    g.api("POST", f"/api/approvals/{asked['id']}/approve", {"reason": "docs"})
    denied = eventually(lambda: [a for a in g.approvals(state="pending", task=task["id"])],
                        40, "deny.test asks")[0]
    assert denied["args"]["name"] == "deny.test"
    g.api("POST", f"/api/approvals/{denied['id']}/deny", {"reason": "not that one"})
    g.wait_done(task["id"], timeout=60)
    out = g.output(task["id"])
    assert out[0] == f"dns ask.test rcode=0 addr={WEB}", out      # the held query, answered
    assert out[1] == f"hello from {WEB}:80", out
    assert out[2] == "dns deny.test rcode=3 addr=-", out           # NXDOMAIN
    assert out[3] == "getent 2", out                               # from then on, no asking
    log = g.log(task["id"])
    assert any(e["type"] == "net" and e.get("approval") == asked["id"] for e in log)
    refusals = [e for e in log if e["type"] == "dns" and e.get("name") == "deny.test"
                and e.get("allowed") is False]
    assert refusals and all(e["reason"] == "not that one" for e in refusals)
    assert len(g.approvals(task=task["id"])) == 2   # one per name, whatever the retries


def test_always_for_a_host_grants_later_tasks_of_the_workspace_only(net_gurtd: Gurtd) -> None:
    g = net_gurtd
    g.api("POST", "/api/workspaces", {"name": "elsewhere"})
    first = g.create(dns_probe("team.test"), askHosts=True)
    asked = host_approval(g, first["id"], "team.test")
    policy_id = g.api("POST", f"/api/approvals/{asked['id']}/always",
                      {"scope": "workspace"})["policy"]
    assert g.wait(first["id"], timeout=60)["state"] == "done"
    assert g.output(first["id"]) == [f"dns team.test rcode=0 addr={WEB}"]
    policy = g.api("GET", "/api/policies")[0]
    assert policy["tool"] == "host" and policy["host"] == "team.test"
    assert policy["workspace"] == "home" and policy["id"] == policy_id

    # a later task of home, without askHosts or hosts: granted by the policy, nobody asked
    later = g.run_done(fetch("team.test") + "\ngetent hosts later.test; echo getent $?")
    assert g.output(later["id"]) == [f"hello from {WEB}:80", "getent 2"]
    assert g.approvals(task=later["id"]) == []
    assert any(e.get("policy") == policy_id for e in g.log(later["id"]))
    # outside the workspace the name is refused as before
    away = g.run("getent hosts team.test; echo getent $?", workspace="elsewhere")
    assert g.output(away["id"]) == ["getent 2"] and g.approvals(task=away["id"]) == []


def test_a_policy_never_grants_a_name_that_resolves_to_loopback(net_gurtd: Gurtd) -> None:
    g = net_gurtd
    g.api("POST", "/api/policies", {"tool": "host", "scope": "box", "host": "loop.test"},
          status=201)
    task = g.run(dns_probe("loop.test") + "\n" + fetch("loop.test"), askHosts=True)
    out = g.output(task["id"])
    assert out[0] == "dns loop.test rcode=5 addr=-", out           # REFUSED, never 127.0.0.1
    assert "hello" not in out[1]
    refused = [e for e in g.log(task["id"]) if e["type"] == "dns" and e.get("refused")]
    assert refused and "loopback" in refused[0]["refused"][0]
    assert g.approvals(task=task["id"]) == []


@pytest.mark.parametrize("kill", [False, True], ids=["stopped", "killed"])
def test_a_restart_while_a_host_is_asked_denies_it(net_gurtd: Gurtd, kill: bool) -> None:
    g = net_gurtd
    task = g.create(dns_probe("restart.test"), askHosts=True)
    asked = host_approval(g, task["id"], "restart.test")
    g.restart(kill=kill)
    after = g.api("GET", f"/api/approvals/{asked['id']}")
    assert after["state"] == "denied" and after["answeredBy"] == "restart", after
    assert g.task(task["id"])["state"] == "failed"
    g.api("POST", f"/api/approvals/{asked['id']}/approve", status=409)


FLOOD = r'''
import socket, struct
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((ns, 53))
for i in range(100):
    q = struct.pack("!HHHHHH", i, 0x100, 1, 0, 0, 0)
    for label in ("n%d" % i, "flood", "test"):
        q += bytes([len(label)]) + label.encode()
    s.send(q + b"\0" + struct.pack("!HH", 1, 1))
s.settimeout(3)
nx = 0
try:
    while True:
        d = s.recv(4096)
        nx += (d[3] & 15) == 3
except OSError:
    pass
print("nxdomain", nx)
'''


def test_a_task_asking_for_a_flood_of_names_asks_a_bounded_number(net_gurtd: Gurtd) -> None:
    g = net_gurtd
    code = base64.b64encode(FLOOD.encode()).decode()
    task = g.create(f"python3 -c 'import base64;exec(base64.b64decode(\"{code}\"))'\nsleep 60",
                    askHosts=True)
    out = eventually(lambda: g.output(task["id"]), 60, "the flood's count")
    asked = g.approvals(state="pending", task=task["id"])
    assert len(asked) == G.MAX_PENDING_APPROVALS, len(asked)
    assert out == [f"nxdomain {100 - G.MAX_PENDING_APPROVALS}"], out   # the rest, at once
    assert any("not asked" in (e.get("reason") or "") for e in g.log(task["id"]))
    g.api("POST", f"/api/tasks/{task['id']}/stop")
    stopped = g.approvals(task=task["id"])
    assert len(stopped) == G.MAX_PENDING_APPROVALS
    assert all(a["state"] == "denied" and a["answeredBy"] == "stop" for a in stopped)
