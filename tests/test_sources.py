"""Work that arrives by itself: schedules, a Jira project and signed webhooks start tasks.

Schedules are told as an owner's stories (a nightly job, a job that overlaps itself, a box that
was down for days, a daylight-saving night in Berlin); time is moved for gurtd with the
test-only GURT_TEST_CLOCK_OFFSET, never on the machine.  Jira is a stand-in of the tests' own
on 127.0.0.1 that follows the documented REST API v3 endpoints and records every request
gurtd sends.  Hooks are delivered the way an outside system would: signed, without a token,
under a tunnel's Host name.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import os
import stat
import time
import zoneinfo
from pathlib import Path
from typing import Any

import pytest

import gurtd as G
from conftest import Gurtd, eventually, jira_stand_in, loop_waits, running_gurtd

BERLIN = "Europe/Berlin"


def berlin(*args: int, fold: int = 0) -> float:
    return datetime.datetime(*args, tzinfo=zoneinfo.ZoneInfo(BERLIN), fold=fold).timestamp()


def local(stamp: float) -> str:
    return datetime.datetime.fromtimestamp(stamp, zoneinfo.ZoneInfo(BERLIN)).isoformat()


def schedule_tasks(g: Gurtd, sched_id: str) -> list[dict[str, Any]]:
    return [t for t in g.api("GET", "/api/tasks") if t.get("schedule") == sched_id]


# schedules: pure ###############################################################################

@pytest.mark.pure
def test_a_daily_run_in_berlin_is_neither_doubled_nor_skipped_by_daylight_saving() -> None:
    # spring: 02:30 does not exist on 29 March 2026; that night's run happens at 03:00, once
    runs = G.cron_next("30 2 * * *", BERLIN, berlin(2026, 3, 27, 12, 0), 4)
    assert [local(t) for t in runs] == [
        "2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00", "2026-03-31T02:30:00+02:00"]
    # autumn: 02:30 comes twice on 25 October 2026; the job runs at the first one only
    runs = G.cron_next("30 2 * * *", BERLIN, berlin(2026, 10, 24, 12, 0), 3)
    assert [local(t) for t in runs] == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00", "2026-10-27T02:30:00+01:00"]
    assert runs[1] - runs[0] == 25 * 3600        # the long day: 25 hours apart, one run each
    # after the first 02:30 has run, the repeated 02:30 is not a run of its own
    after_first = G.cron_next("30 2 * * *", BERLIN, berlin(2026, 10, 25, 2, 40), 1)
    assert local(after_first[0]) == "2026-10-26T02:30:00+01:00"


@pytest.mark.pure
def test_an_every_half_hour_job_keeps_real_time_across_both_switches() -> None:
    autumn = G.cron_next("*/30 * * * *", BERLIN, berlin(2026, 10, 25, 1, 50), 6)
    assert [b - a for a, b in zip(autumn, autumn[1:])] == [1800] * 5   # the repeated hour too
    spring = G.cron_next("0 * * * *", BERLIN, berlin(2026, 3, 29, 0, 30), 3)
    assert [local(t) for t in spring] == ["2026-03-29T01:00:00+01:00",
                                          "2026-03-29T03:00:00+02:00",
                                          "2026-03-29T04:00:00+02:00"]
    assert spring[1] - spring[0] == 3600         # an hour of real time, not two


@pytest.mark.pure
def test_cron_lines_are_checked_field_by_field() -> None:
    assert G.cron_check("0  9 * * mon-fri", "UTC") == "0 9 * * mon-fri"
    assert G.cron_check("*/15 0-6,22 1 JAN,JUL *", "UTC")
    for line, said in (("0 9 * *", "five fields"), ("61 * * * *", "cron"),
                       ("0 9 * * * *", "five fields"), ("0 9 30 2 *", "cron"),
                       ("0 $(id) * * *", "hour"), (7, "cron")):
        try:
            G.cron_check(line, "UTC")
        except G.ApiError as exc:
            assert exc.status == 400 and said in exc.message, (line, exc.message)
        else:
            raise AssertionError(f"{line!r} was taken")


# schedules: a real gurtd #######################################################################

def test_a_schedule_from_creation_to_a_run_now_and_its_deletion() -> None:
    with running_gurtd() as g:
        for body, field in (({"name": "x", "cron": "0 99 * * *", "task": {"prompt": "p"}},
                             "cron"),
                            ({"name": "x", "cron": "0 3 * * *", "timezone": "Mars/Base",
                              "task": {"prompt": "p"}}, "timezone"),
                            ({"name": "x", "cron": "0 3 * * *", "task": {}}, "prompt"),
                            ({"name": "x", "cron": "0 3 * * *", "overlap": "both",
                              "task": {"prompt": "p"}}, "overlap"),
                            ({"name": "x", "cron": "0 3 * * *", "task": {"prompt": "p",
                                                                          "worker": "x"}},
                             "worker")):
            code, answer, _ = g.request("POST", "/api/schedules", body)
            assert code == 400 and field in answer["error"], (body, answer)
        assert g.api("GET", "/api/schedules") == []          # bad input made nothing
        item = g.api("POST", "/api/schedules", {
            "name": "nightly", "cron": "17 3 * * *", "timezone": BERLIN,
            "task": {"prompt": "echo nightly run", "worker": "fake"}}, status=201)
        assert item["enabled"] and item["overlap"] == "skip" and len(item["nextRuns"]) == 5
        firsts = [datetime.datetime.fromisoformat(t) for t in item["nextRuns"]]
        assert all(t.hour == 3 and t.minute == 17 for t in firsts)
        assert firsts == sorted(firsts) and firsts[0].timestamp() > time.time()
        changed = g.api("PUT", f"/api/schedules/{item['id']}", {"cron": "0 12 * * SUN"})
        assert all(datetime.datetime.fromisoformat(t).weekday() == 6
                   for t in changed["nextRuns"])
        listed = g.cli("schedules")
        assert listed.returncode == 0 and item["id"] in listed.stdout and "0 12 * * SUN" in \
            listed.stdout, listed
        ran = g.cli_ok("schedule", "run", item["id"])
        task = g.wait(ran.stdout.strip())
        assert task["state"] == "done" and task["source"] == "schedule" and \
            task["schedule"] == item["id"] and task["title"] == "nightly"
        assert g.output(task["id"]) == ["nightly run"]
        after = eventually(lambda: (s := g.api("GET", f"/api/schedules/{item['id']}"))
                           ["lastState"] == "done" and s)
        assert after["lastTask"] == task["id"] and after["lastRun"]
        tasks = g.cli("tasks")
        assert "schedule" in tasks.stdout and "SOURCE" in tasks.stdout
        g.cli_ok("schedule", "add", "weekly", "0 6 * * MON", "--worker", "fake", "--", "echo",
                 "weekly")
        assert len(g.api("GET", "/api/schedules")) == 2
        off = g.api("PUT", f"/api/schedules/{item['id']}", {"enabled": False})
        assert off["nextRuns"] == [] and not off["enabled"]
        g.api("DELETE", f"/api/schedules/{item['id']}")
        code, _, _ = g.request("GET", f"/api/schedules/{item['id']}")
        assert code == 404 and len(g.api("GET", "/api/schedules")) == 1


def test_a_run_that_is_still_going_is_skipped_or_queued() -> None:
    with running_gurtd() as g:
        item = g.api("POST", "/api/schedules", {
            "name": "slow", "cron": "17 3 * * *",
            "task": {"prompt": "sleep 60", "worker": "fake"}}, status=201)
        first = g.api("POST", f"/api/schedules/{item['id']}/run", status=201)["task"]
        code, answer, _ = g.request("POST", f"/api/schedules/{item['id']}/run")
        assert code == 409 and first["id"] in answer["error"] and "skip" in answer["error"]
        assert len(schedule_tasks(g, item["id"])) == 1
        g.api("PUT", f"/api/schedules/{item['id']}", {"overlap": "queue",
                                                      "task": {"prompt": "echo second",
                                                               "worker": "fake"}})
        queued = g.api("POST", f"/api/schedules/{item['id']}/run", status=202)
        assert queued["queued"] and len(schedule_tasks(g, item["id"])) == 1
        g.api("POST", f"/api/tasks/{first['id']}/stop")
        second = eventually(lambda: [t for t in schedule_tasks(g, item["id"])
                                     if t["id"] != first["id"]], what="the queued run")
        assert len(second) == 1 and g.wait(second[0]["id"])["state"] == "done"
        assert g.output(second[0]["id"]) == ["second"]
        assert g.task(first["id"])["error"] == "stopped"


def test_a_box_down_for_three_days_runs_a_daily_job_once_and_keeps_it_after_kill_9() -> None:
    with running_gurtd() as g:
        item = g.api("POST", "/api/schedules", {
            "name": "daily", "cron": "17 3 * * *",
            "task": {"prompt": "echo caught up", "worker": "fake"}}, status=201)
        g.stop(9)                                   # kill -9: the schedule is on disk
        g.env["GURT_TEST_CLOCK_OFFSET"] = str(3 * 86400 + 3600)   # three days later
        g.start()
        runs = eventually(lambda: schedule_tasks(g, item["id"]), what="the catch-up run")
        time.sleep(2)                               # and no second one
        runs = schedule_tasks(g, item["id"])
        assert len(runs) == 1 and g.wait(runs[0]["id"])["state"] == "done"
        after = g.api("GET", f"/api/schedules/{item['id']}")
        assert after["lastNote"].startswith("missed 3 runs") or \
            after["lastNote"].startswith("missed 4 runs"), after
        assert any("missed" in e.get("text", "") for e in g.log(runs[0]["id"]))
        assert "missed" in g.log_text()
        # the clock goes back three days (a wrong clock corrected): no second run for the
        # time already spent; the next run is after it
        g.stop(9)
        g.env["GURT_TEST_CLOCK_OFFSET"] = "0"
        g.start()
        time.sleep(2)
        assert len(schedule_tasks(g, item["id"])) == 1
        after = g.api("GET", f"/api/schedules/{item['id']}")
        assert datetime.datetime.fromisoformat(after["nextRuns"][0]).timestamp() > \
            time.time() + 3 * 86400


# Jira ##########################################################################################

def adf(*paragraphs: str) -> dict[str, Any]:
    return {"type": "doc", "version": 1, "content": [
        {"type": "paragraph", "content": [{"type": "text", "text": p}]} for p in paragraphs]}


@pytest.mark.pure
def test_adf_becomes_plain_text_and_back() -> None:
    doc = {"type": "doc", "version": 1, "content": [
        {"type": "heading", "attrs": {"level": 2}, "content": [{"type": "text", "text": "Do"}]},
        {"type": "paragraph", "content": [{"type": "text", "text": "one"},
                                          {"type": "hardBreak"},
                                          {"type": "mention", "attrs": {"text": "@ann"}}]},
        {"type": "bulletList", "content": [
            {"type": "listItem", "content": [{"type": "paragraph", "content": [
                {"type": "text", "text": "a"}]}]},
            {"type": "listItem", "content": [{"type": "paragraph", "content": [
                {"type": "text", "text": "b"}]}]}]},
        {"type": "codeBlock", "content": [{"type": "text", "text": "make test"}]}]}
    assert G.adf_text(doc).strip() == "Do\n\none\n@ann\n\n- a\n- b\n\n```\nmake test\n```"
    nested: dict[str, Any] = {"type": "text", "text": "deep"}
    for _ in range(5000):                       # an attacker's issue: nested far too deep
        nested = {"type": "paragraph", "content": [nested]}
    assert G.adf_text(nested).strip() == ""
    back = G.text_adf("line one\nline two\n\nnext")
    assert back["type"] == "doc" and len(back["content"]) == 2
    assert G.adf_text(back).strip() == "line one\nline two\n\nnext"


def test_a_labelled_issue_becomes_one_task_and_hears_back_when_it_ends() -> None:
    with jira_stand_in() as jira, running_gurtd() as g:
        jira.issues["GT-7"] = {"summary": "Say hello", "description": adf("echo hello jira")}
        jira.issues["GT-8"] = {"summary": "Break", "description": adf("exit 3")}
        jira.status.update({"GT-7": "To Do", "GT-8": "To Do"})
        jira.fail_next.append(("/rest/api/3/search/jql", 429))     # Jira is busy at first
        jira.fail_next.append(("/rest/api/3/issue/GT-7/comment", 503))   # and then down
        config = {"baseUrl": jira.url, "email": "bot@example.com", "token": "wrong-token",
                  "jql": 'labels = gurt AND status = "To Do"', "worker": "fake",
                  "pollSeconds": 10, "transitions": {"done": "Done", "failed": "Failed"}}
        code, answer, _ = g.request("PUT", "/api/settings", {"jira": {**config,
                                                                     "baseUrl": "http://x.org"}})
        assert code == 400 and "baseUrl" in answer["error"]
        assert "token" not in g.api("PUT", "/api/settings", {"jira": config})["jira"]
        token_file = os.path.join(g.home, "secrets", "jira-token")
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert "wrong-token" not in json.dumps(g.api("GET", "/api/settings"))
        eventually(lambda: "401" in g.log_text(), what="the 401 of a wrong token")
        assert not [t for t in g.api("GET", "/api/tasks") if t["source"].startswith("jira")]
        # Jira hangs on the search: the box goes on meanwhile (a task runs to its end)
        jira.hold.clear()
        jira.searching.clear()
        g.api("PUT", "/api/settings", {"jira": {**config, "token": "right-token"}})
        assert open(token_file).read() == "right-token"
        assert jira.searching.wait(30)
        assert g.run("echo meanwhile")["state"] == "done"
        assert not [t for t in g.api("GET", "/api/tasks") if t["source"].startswith("jira")]
        jira.hold.set()
        done = eventually(lambda: [t for t in g.api("GET", "/api/tasks")
                                   if t["source"] == "jira:GT-7"], what="the GT-7 task")
        assert done[0]["title"] == "GT-7: Say hello" and done[0]["prompt"] == "echo hello jira"
        assert g.wait(done[0]["id"])["state"] == "done"
        eventually(lambda: jira.status["GT-7"] == "Done" and jira.status["GT-8"] == "Failed",
                   what="both issues moved")
        # what gurtd sent: basic auth, the JQL, an ADF comment naming the task and its end
        wrong = "Basic " + base64.b64encode(b"bot@example.com:wrong-token").decode()
        assert {r["auth"] for r in jira.requests} == {jira.auth, wrong}
        search = jira.calls("POST", "/rest/api/3/search/jql")[-1]["body"]
        assert search["jql"] == config["jql"] and "summary" in search["fields"]
        comments = jira.calls("POST", "/rest/api/3/issue/GT-7/comment")
        assert len(comments) == 2 and comments[0]["body"] == comments[1]["body"]  # the 503
        assert comments[0]["type"] == "application/json"
        text = G.adf_text(comments[0]["body"]["body"])
        assert comments[0]["body"]["body"]["type"] == "doc"
        assert done[0]["id"] in text and "done" in text and "Summary: hello jira" in text
        failed = G.adf_text(jira.calls("POST", "/rest/api/3/issue/GT-8/comment")[0]["body"]
                            ["body"])
        assert "failed" in failed and "exited with 3" in failed
        moves = jira.calls("POST", "/rest/api/3/issue/GT-7/transitions")
        assert [m["body"] for m in moves] == [{"transition": {"id": "31"}}]
        # a restart, and the issue back in To Do: still no second task for it (the kill once
        # both answers are recorded: one between Jira's 200 and the record is answered again)
        eventually(lambda: all("noticed" in jira_records(g)[k] for k in ("GT-7", "GT-8")),
                   what="both answers recorded")
        jira.status["GT-7"] = "To Do"
        searches = len(jira.calls("POST", "/rest/api/3/search/jql"))
        g.restart(kill=True)
        eventually(lambda: len(jira.calls("POST", "/rest/api/3/search/jql")) > searches,
                   what="a poll after the restart")
        time.sleep(1)
        assert len([t for t in g.api("GET", "/api/tasks") if t["source"] == "jira:GT-7"]) == 1
        assert len(jira.calls("POST", "/rest/api/3/issue/GT-7/comment")) == 2


def issue_answer(key: str, description: bytes) -> bytes:
    return b'{"id": "1", "key": "%s", "fields": {"summary": "hostile", "description": %s}}' % (
        key.encode(), description)


def jira_records(g: Gurtd) -> dict[str, dict[str, Any]]:
    return json.loads(Path(g.home, "jira.json").read_text())["issues"]


def jira_tasks(g: Gurtd) -> dict[str, dict[str, Any]]:
    return {t["source"][5:]: t for t in g.api("GET", "/api/tasks")
            if t["source"].startswith("jira:")}


JIRA_CONFIG = {"email": "bot@example.com", "token": "right-token", "worker": "fake",
               "jql": "labels = gurt", "pollSeconds": 10}


def test_a_transition_refused_once_does_not_comment_twice() -> None:
    """The comment went through and the transition got a 503: the retry commented again
    (the notice was marked only after both).  Now the comment is recorded first."""
    with jira_stand_in() as jira, running_gurtd() as g:
        jira.issues["GT-3"] = {"summary": "Once", "description": adf("true")}
        jira.status["GT-3"] = "To Do"
        jira.fail_next.append(("/rest/api/3/issue/GT-3/transitions", 503))
        g.api("PUT", "/api/settings", {"jira": {**JIRA_CONFIG, "baseUrl": jira.url,
                                                "transitions": {"done": "Done"}}})
        eventually(lambda: jira.status["GT-3"] == "Done", 60, "the issue moved")
        eventually(lambda: "noticed" in jira_records(g)["GT-3"], what="the answer recorded")
        assert len(jira.calls("POST", "/rest/api/3/issue/GT-3/comment")) == 1
        assert "commented" in jira_records(g)["GT-3"]
        assert len(jira.calls("GET", "/rest/api/3/issue/GT-3/transitions")) == 2


def test_an_issue_that_cannot_be_read_is_skipped_and_the_poll_goes_on() -> None:
    """One hostile issue stopped every poll at itself: a description nested 10,000 deep or
    of 9 MiB (and so an answer that is not JSON, or not an object) failed the read, the poll
    backed off and began again at that issue, and no later issue was ever taken.  Now each
    is skipped for good, with its reason in gurtd's log, in jira.json and in a comment on the
    issue, and the poll goes on to the next."""
    deep = b'{"type": "paragraph", "content": [' * 10_000 + b"{}" + b"]}" * 10_000
    big = json.dumps(adf("x" * (9 << 20))).encode()
    hostile = {"GT-1": issue_answer("GT-1", deep), "GT-2": issue_answer("GT-2", big),
               "GT-3": b'[{"fields": {"summary": "a list, not an issue"}}]',
               "GT-4": b"<html>Service Unavailable</html>",
               "GT-5": issue_answer("GT-5", json.dumps(adf("cut short")).encode())[:-1]}
    with jira_stand_in() as jira, running_gurtd() as g:
        for key, raw in hostile.items():
            jira.issues[key] = {"summary": "hostile"}
            jira.raw[key] = raw
        jira.issues["GT-9"] = {"summary": "After them", "description": adf("echo taken")}
        jira.status.update({k: "To Do" for k in jira.issues})
        with loop_waits(g, lambda: g.api("GET", "/api/hooks")) as waits:
            g.api("PUT", "/api/settings", {"jira": {**JIRA_CONFIG, "baseUrl": jira.url}})
            taken = eventually(lambda: jira_tasks(g).get("GT-9"), 30, "the issue after them")
        print(f"the loop's worst wait while the hostile issues were read: {max(waits):.3f} s")
        assert max(waits) < 1.0, max(waits)
        assert g.wait(taken["id"])["state"] == "done"
        assert set(jira_tasks(g)) == {"GT-9"}
        for key in hostile:
            path = f"/rest/api/3/issue/{key}/comment"
            comments = eventually(lambda path=path: jira.calls("POST", path),
                                  what=f"the comment on {key}")
            text = G.adf_text(comments[0]["body"]["body"])
            assert "skipped" in text and "could not be read" in text, (key, text)
        records = jira_records(g)
        assert {k: records[k]["state"] for k in hostile} == {k: "skipped" for k in hostile}
        assert "nested" in records["GT-1"]["error"], records["GT-1"]
        assert "larger than 8 MiB" in records["GT-2"]["error"], records["GT-2"]
        assert "not a JSON object" in records["GT-3"]["error"], records["GT-3"]
        assert "not JSON" in records["GT-4"]["error"] and "not JSON" in records["GT-5"]["error"]
        assert all(f"issue {k} skipped" in g.log_text() for k in hostile)
        # the next poll reads none of them again, and moves none of them
        searches = len(jira.calls("POST", "/rest/api/3/search/jql"))
        g.api("PUT", "/api/settings", {"jira": {**JIRA_CONFIG, "baseUrl": jira.url,
                                                "pollSeconds": 11}})      # wakes the thread
        eventually(lambda: len(jira.calls("POST", "/rest/api/3/search/jql")) > searches,
                   what="another poll")
        time.sleep(0.5)
        for key in hostile:
            assert len(jira.calls("GET", f"/rest/api/3/issue/{key}")) == 1, key
            assert jira.status[key] == "To Do"


def test_a_jira_that_trickles_an_answer_is_cut_off_and_the_poll_goes_on() -> None:
    """A Jira that sends its answer one byte at a time, each within the read timeout, held
    the Jira thread for as long as it liked.  A whole answer has a deadline now (3 s in this
    test, GURT_JIRA_DEADLINE): past it the read ends, and the poll goes on to the next
    issue (the trickled one is asked again at the next poll)."""
    with jira_stand_in() as jira, running_gurtd({"GURT_JIRA_DEADLINE": "3"}) as g:
        jira.issues["GT-1"] = {"summary": "slow"}
        jira.trickle["GT-1"] = 0.5
        jira.issues["GT-2"] = {"summary": "After it", "description": adf("echo taken")}
        jira.status.update({"GT-1": "To Do", "GT-2": "To Do"})
        start = time.monotonic()
        with loop_waits(g, lambda: g.api("GET", "/api/hooks")) as waits:
            g.api("PUT", "/api/settings", {"jira": {**JIRA_CONFIG, "baseUrl": jira.url}})
            taken = eventually(lambda: jira_tasks(g).get("GT-2"), 20, "the issue after it")
        assert time.monotonic() - start < 12
        print(f"the loop's worst wait while Jira trickled: {max(waits):.3f} s")
        assert max(waits) < 1.0, max(waits)
        assert "GT-1" not in jira_tasks(g)
        assert "no whole answer within 3 s" in g.log_text()
        assert g.wait(taken["id"])["state"] == "done"
        assert "GT-1" not in jira_records(g)


# Hooks #########################################################################################

def signed(secret: str, raw: bytes, delivery: str, stamp: float | None = None) -> dict[str, str]:
    """A sender's headers: X-Gurt-Timestamp (Unix seconds) and X-Gurt-Signature, the hex
    HMAC-SHA256 of "TIMESTAMP.DELIVERY.BODY" keyed with the hook's secret."""
    when = str(int(time.time() if stamp is None else stamp))
    mac = hmac.new(secret.encode(), f"{when}.{delivery}.".encode() + raw, hashlib.sha256)
    return {"X-Gurt-Timestamp": when, "X-Gurt-Signature": "sha256=" + mac.hexdigest()}


def deliver(g: Gurtd, name: str, body: Any, secret: str | None, delivery: str,
            host: str | None = None, signature: str | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, Any]:
    raw = json.dumps(body).encode()
    sent = {"Content-Type": "application/json", "X-Gurt-Delivery": delivery}
    if secret is not None:
        sent.update(signed(secret, raw, delivery))
        if signature:
            sent["X-Gurt-Signature"] = signature
    sent.update(headers or {})
    if host:
        sent["Host"] = host
    code, answer, _ = g.request("POST", f"/api/hooks/{name}", headers=sent, token=False,
                                raw=raw)
    return code, answer


def test_a_signed_delivery_is_taken_once_and_only_while_fresh() -> None:
    """Whoever saw one signed delivery (a log, a proxy) could send it again under a new
    delivery id: the signature covered the body only.  It covers the timestamp and the id
    now: a replay under a new id, an old or a future timestamp, and a body signed the old
    way are all refused, and start nothing."""
    with running_gurtd() as g:
        secret = g.api("POST", "/api/hooks", {"name": "gh", "source": "gh",
                                              "task": {"worker": "fake"}}, status=201)["secret"]
        body = {"title": "once", "prompt": "echo once"}
        raw = json.dumps(body).encode()
        code, task = deliver(g, "gh", body, secret, "r-1")
        assert code == 201, task
        seen = signed(secret, raw, "r-1")           # what an eavesdropper kept
        refused = {
            "the same delivery under a new id": ("r-2", seen),
            "an hour old": ("r-3", signed(secret, raw, "r-3", time.time() - 3600)),
            "six minutes old": ("r-4", signed(secret, raw, "r-4", time.time() - 360)),
            "ten minutes ahead": ("r-5", signed(secret, raw, "r-5", time.time() + 600)),
            "the body signed without the timestamp": ("r-6", {
                "X-Gurt-Timestamp": str(int(time.time())), "X-Gurt-Signature": "sha256=" +
                hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest()}),
            "no timestamp": ("r-7", {"X-Gurt-Signature": seen["X-Gurt-Signature"]}),
            "a timestamp that is not a number": ("r-8", {**signed(secret, raw, "r-8"),
                                                         "X-Gurt-Timestamp": "soon"}),
        }
        for why, (delivery, headers) in refused.items():
            sent = {"Content-Type": "application/json", "X-Gurt-Delivery": delivery, **headers}
            g.api("POST", "/api/hooks/gh", headers=sent, token=False, raw=raw, status=401)
        code, answer = deliver(g, "gh", body, secret, "r-1")
        assert code == 409 and answer["code"] == "replayed", answer
        assert [t["id"] for t in g.api("GET", "/api/tasks")] == [task["id"]]
        # a sender's clock a little ahead (within the skew), or a few minutes behind, is fine
        for delivery, stamp in (("r-9", time.time() + 20), ("r-10", time.time() - 240)):
            sent = {"Content-Type": "application/json", "X-Gurt-Delivery": delivery,
                    **signed(secret, raw, delivery, stamp)}
            g.api("POST", "/api/hooks/gh", headers=sent, token=False, raw=raw, status=201)
        g.wait(task["id"])


def test_a_signed_delivery_starts_a_task_and_nothing_else_does() -> None:
    with running_gurtd() as g:
        code, answer, _ = g.request("POST", "/api/hooks", {"name": "asi", "source": "jira"})
        assert code == 400 and "source" in answer["error"]
        hook = g.api("POST", "/api/hooks", {"name": "asi", "source": "asi1",
                                            "task": {"worker": "fake"}}, status=201)
        secret = hook["secret"]
        assert len(secret) == 64 and hook["url"] == "/api/hooks/asi"
        assert "secret" not in json.dumps(g.api("GET", "/api/hooks"))
        assert stat.S_IMODE(os.stat(os.path.join(g.home, "hooks.json")).st_mode) == 0o600
        listed = g.cli("hooks")
        assert listed.returncode == 0 and "asi1" in listed.stdout and secret not in listed.stdout
        body = {"title": "from asi1", "prompt": "echo delivered"}
        before = len(g.api("GET", "/api/tasks"))
        for sig_secret, signature in ((None, None), ("not-the-secret", None),
                                      (secret, "sha256=" + "0" * 64), (secret, "sha1=x")):
            code, answer = deliver(g, "asi", body, sig_secret, "d-1", signature=signature)
            assert code == 401, answer
        code, _ = deliver(g, "nohook", body, secret, "d-1")
        assert code == 401
        assert len(g.api("GET", "/api/tasks")) == before        # nothing was created
        code, task = deliver(g, "asi", body, secret, "d-1")
        assert code == 201 and task["source"] == "asi1", task
        assert g.wait(task["id"])["state"] == "done" and g.output(task["id"]) == ["delivered"]
        code, answer = deliver(g, "asi", body, secret, "d-1")
        assert code == 409 and "d-1" in answer["error"]          # a replay
        code, answer = deliver(g, "asi", {**body, "workspace": "home"}, secret, "d-2")
        assert code == 400 and "workspace" in answer["error"]    # not a field it allows
        code, answer = deliver(g, "asi", {**body, "source": "api"}, secret, "d-3")
        assert code == 400
        code, answer = deliver(g, "asi", body, secret, "")      # no delivery id
        assert code == 400 and "X-Gurt-Delivery" in answer["error"]
        # behind a tunnel: its Host name only when listed, and only on hook deliveries
        tunnel = "hooks.example.org"
        code, answer = deliver(g, "asi", body, secret, "d-4", host=tunnel)
        assert code == 403 and answer["code"] == "host_not_allowed"
        code, answer, _ = g.request("PUT", "/api/settings", {"hookHosts": ["Not a host"]})
        assert code == 400 and "hookHosts" in answer["error"]
        g.api("PUT", "/api/settings", {"hookHosts": [tunnel]})
        code, task2 = deliver(g, "asi", body, secret, "d-4", host=tunnel + ":443")
        assert code == 201 and task2["source"] == "asi1"
        for method, path in (("GET", "/api/tasks"), ("DELETE", "/api/hooks/asi"),
                             ("POST", "/api/hooks"), ("GET", "/api/settings")):
            code, answer, _ = g.request(method, path, headers={"Host": tunnel})
            assert code == 403 and answer["code"] == "host_not_allowed", (method, path)
        assert len(g.api("GET", "/api/hooks")) == 1
        # a replay after kill -9 is refused too: the delivery ids are on disk
        g.restart(kill=True)
        code, answer = deliver(g, "asi", body, secret, "d-1")
        assert code == 409
        g.wait(task2["id"])
        g.api("DELETE", "/api/hooks/asi")
        code, _ = deliver(g, "asi", body, secret, "d-9")
        assert code == 401
