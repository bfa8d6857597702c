"""The portal, told by a person in a real browser (headless Chromium driven by selenium).

They sign in with the one-time URL that `gurtd portal` prints, start a fake task from the form
and watch it finish without reloading, follow a log, deny a spending with a reason, answer an
ask, undo a task and see its file go, and sign out.  A page from another origin, open in the
same browser, can neither start a task nor read one.  Every page (and every tab of a task's)
is photographed at 1280 and 390 px wide, light and dark, into the test's output folder, and
measured there: nothing scrolls sideways, the nav is one row inside the screen, and every
visible text passes WCAG AA contrast over the colour under it.  The browser's console stays
free of errors.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import (REJECTED, ROOT, By, Gurtd, Keys, Select, answer, chromium, end_sleep,
                      eventually, loopback_server, quit_browser, run_on, sign_in, sign_in_url, wait)

SHARED_GURTD = True
WIDTHS = (1280, 390)


# the browser ##################################################################################

def go(driver: Any, hash_: str, ready: str) -> None:
    """Follow a link inside the page (no reload) and wait for an element of the new page."""
    driver.execute_script("location.hash = arguments[0]", hash_)
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ready), hash_)


def confirm(driver: Any) -> None:
    """Say yes in the page's own confirm dialog (by keyboard: focus is on OK)."""
    wait(driver, lambda d: d.find_element(By.ID, "confirm").get_attribute("open") is not None,
         "the confirm dialog")
    assert driver.switch_to.active_element.get_attribute("id") == "confirm-yes"
    driver.switch_to.active_element.send_keys(Keys.ENTER)


def console_errors(driver: Any, allowed: tuple[str, ...] = ()) -> list[str]:
    """The console's errors since the last call, less those the story expects."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"
            and not any(a in e["message"] for a in allowed)]


def tab(driver: Any, name: str) -> None:
    """Show one tab of a task's page (log, changes, diff, decisions, details)."""
    click(driver, f"#tab-{name}")
    wait(driver, lambda d: d.find_element(By.ID, f"panel-{name}").is_displayed(),
         f"the {name} tab")


def more_answers(card: Any) -> None:
    """Unfold a decision card's rarer answers (always, raise the budget)."""
    fold = card.find_element(By.CSS_SELECTOR, "details.more")
    if fold.get_attribute("open") is None:
        fold.find_element(By.TAG_NAME, "summary").click()


def state_shown(driver: Any, task_id: str) -> str | None:
    rows = driver.find_elements(By.ID, f"task-{task_id}")
    return rows[0].get_attribute("data-state") if rows else None


# fixtures #####################################################################################

@pytest.fixture(scope="module")
def browser(module_gurtd: Gurtd) -> Iterator[Any]:
    driver, profile = chromium()
    try:
        sign_in(driver, module_gurtd)
        yield driver
    finally:
        quit_browser(driver, profile)


@pytest.fixture(scope="module")
def shots() -> str:
    """The test's output folder for screenshots, kept for people to look at:
    $GURT_TEST_OUTPUT/portal, else tests/output/portal (ignored by git); emptied first."""
    base = os.environ.get("GURT_TEST_OUTPUT") or os.path.join(ROOT, "tests", "output")
    path = os.path.join(base, "portal")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


@pytest.fixture(autouse=True)
def no_console_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "browser" in request.fixturenames:
        assert console_errors(request.getfixturevalue("browser")) == []


NOTIFICATION_RECORDER = """
window.shown = [];
const Real = window.Notification;
window.Notification = class extends Real {
  constructor(title, opts) { super(title, opts); window.shown.push(title + "|" + opts.body); }
};
"""


# sign-in ######################################################################################

def test_a_one_time_url_signs_in_once_and_leaves_nothing_secret_behind(gurtd: Gurtd,
                                                                       browser: Any,
                                                                       shots: str) -> None:
    d = browser
    # signed in by the fixture through the printed URL; the code left the address bar
    assert "code=" not in d.current_url
    assert d.execute_script("return location.search") == ""
    assert d.execute_script("return document.cookie") == ""          # HttpOnly
    cookie = next(c for c in d.get_cookies() if c["name"] == "gurt_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert cookie["expiry"] > time.time() + 3600
    html = d.page_source
    assert gurtd.token not in html and cookie["value"] not in html
    # on disk, only a hash of the secret
    stored = Path(gurtd.home, "sessions.json").read_text()
    assert cookie["value"] not in stored and '"hash"' in stored
    sessions = gurtd.api("GET", "/api/sessions")
    assert [s["via"] for s in sessions] == ["code"]
    assert sessions[0]["id"] not in d.find_element(By.TAG_NAME, "body").text

    # a second browser: its code works once; used again it gets the sign-in form
    url = sign_in_url(gurtd)
    other, profile = chromium()
    try:
        other.get(url)
        wait(other, lambda x: x.find_element(By.ID, "top").is_displayed(), "signed in")
        other.delete_all_cookies()
        other.get(url)                       # used already
        wait(other, lambda x: "did not work" in x.find_element(By.ID, "signin-error").text,
             "the refusal")
        assert not other.find_element(By.ID, "top").is_displayed()
        assert other.find_elements(By.ID, "task-rows") == []
        assert "code=" not in other.current_url
        for width in WIDTHS:                 # the sign-in form is measured like every page
            other.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                "width": width, "height": 800, "deviceScaleFactor": 1, "mobile": width < 600})
            check_layout(other, f"the sign-in form at {width} px")
            shoot(other, os.path.join(shots, f"signin-{width}-light.png"))
        other.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        # the token pasted into the form signs in too
        other.find_element(By.ID, "token").send_keys(gurtd.token + Keys.ENTER)
        wait(other, lambda x: x.find_element(By.ID, "top").is_displayed(), "the pages")
        assert console_errors(other, ("/api/sessions - Failed to load resource",)) == []
    finally:
        quit_browser(other, profile)
    assert sorted(s["via"] for s in gurtd.api("GET", "/api/sessions")) == ["code", "code", "token"]


# tasks ########################################################################################

def test_a_task_started_from_the_form_goes_to_done_without_a_reload(gurtd: Gurtd,
                                                                    browser: Any) -> None:
    d = browser
    go(d, "#/new", "#new-task")
    d.execute_script("window.notReloaded = true")
    # a bad host: the API's own error, next to its field, and no task
    before = len(gurtd.api("GET", "/api/tasks"))
    d.find_element(By.ID, "in-title").send_keys("bad")
    d.find_element(By.ID, "in-prompt").send_keys("true")
    d.find_element(By.ID, "in-hosts").send_keys("http://nope/")
    d.find_element(By.ID, "start").click()
    err = wait(d, lambda x: x.find_element(By.ID, "err-hosts").text, "the hosts error")
    assert err.startswith('hosts: "http://nope/"'), err
    assert d.switch_to.active_element.get_attribute("id") == "in-hosts"
    assert len(gurtd.api("GET", "/api/tasks")) == before
    assert console_errors(d, ("/api/tasks - Failed to load resource: the server responded "
                              "with a status of 400",)) == []
    for field in ("in-title", "in-prompt", "in-hosts"):
        d.find_element(By.ID, field).clear()
    # by keyboard: the title, Tab, the prompt
    d.find_element(By.ID, "in-title").send_keys("from the portal", Keys.TAB)
    assert d.switch_to.active_element.get_attribute("id") == "in-prompt"
    d.switch_to.active_element.send_keys("echo hello from the form\nsleep 0.5\n"
                                         "echo made > portal-made.txt")
    Select(d.find_element(By.ID, "in-worker")).select_by_visible_text("fake")
    d.find_element(By.ID, "start").click()
    wait(d, lambda x: "#/task/" in x.current_url, "the new task's page")
    task_id = d.current_url.rsplit("/", 1)[1]
    assert gurtd.task(task_id)["source"] == "portal"
    wait(d, lambda x: x.find_element(By.CSS_SELECTOR, "#task-fields .state")
         .get_attribute("data-state") == "done", "done on the task page")
    assert d.execute_script("return window.notReloaded") is True
    log = wait(d, lambda x: [e.text for e in x.find_elements(By.CSS_SELECTOR,
                                                               "#task-log li.k-stdout")],
               "stdout lines")
    assert any("hello from the form" in line for line in log)
    tab(d, "changes")
    wait(d, lambda x: "portal-made.txt" in x.find_element(By.ID, "task-changes").text,
         "the change")
    go(d, "#/tasks", "#task-rows")
    assert state_shown(d, task_id) == "done"
    # a task made elsewhere appears in the list by itself
    other = gurtd.create("sleep 0.3", title="made by curl")
    wait(d, lambda x: state_shown(x, other["id"]) == "done", "the curl task, done")
    assert d.execute_script("return window.notReloaded") is True
    # filters: by state
    Select(d.find_element(By.ID, "f-state")).select_by_value("failed")
    assert state_shown(d, other["id"]) is None
    Select(d.find_element(By.ID, "f-state")).select_by_value("")
    assert state_shown(d, other["id"]) == "done"


def test_a_log_follows_live_with_kinds_told_apart(gurtd: Gurtd, browser: Any) -> None:
    d = browser
    # it waits until the page has shown it running (not 1.5 s, which a busy machine's browser
    # may outlast: the task done before its page is up)
    task = gurtd.create("echo first\necho oops >&2\nsleep 30 || true\necho last", title="chatty")
    go(d, f"#/task/{task['id']}", "#task-log")
    wait(d, lambda x: x.find_elements(By.CSS_SELECTOR, "#task-log li.k-stderr"), "stderr")
    assert gurtd.task(task["id"])["state"] == "running"         # seen while it still runs
    kinds = [e.get_attribute("data-kind") for e in
             d.find_elements(By.CSS_SELECTOR, "#task-log li")]
    assert "stdout" in kinds and "state" in kinds and "step" in kinds
    end_sleep(gurtd, task, "sleep 30")
    wait(d, lambda x: "last" in x.find_element(By.ID, "task-log").text, "the last line")
    assert gurtd.wait(task["id"])["state"] == "done"


# decisions ####################################################################################

def test_a_budget_pause_reaches_the_inbox_within_a_second_and_a_denial_needs_a_reason(
        gurtd: Gurtd, browser: Any) -> None:
    d = browser
    gurtd.api("PUT", "/api/wallet", {"balanceCents": 1000})
    go(d, "#/inbox", "#inbox")
    # the person allowed notifications: a new decision raises one
    d.execute_cdp_cmd("Browser.grantPermissions", {"permissions": ["notifications"],
                                                   "origin": f"http://127.0.0.1:{gurtd.port}"})
    d.execute_script(NOTIFICATION_RECORDER)
    pay = "gurtd tool wallet.pay '{\"to\": \"shop\", \"cents\": 40}'; echo \"pay exit $?\""
    task = gurtd.create(pay, title="wants to pay", tools=["wallet.pay"])
    gurtd.wait(task["id"], ("waiting",))
    paused = time.monotonic()
    approval = gurtd.pending(task["id"], 20)
    card = wait(d, lambda x: x.find_elements(By.ID, f"approval-{approval['id']}"),
                "the approval card", timeout=5)[0]
    assert time.monotonic() - paused < 1.0
    assert "40" in card.text and "wants to pay" in card.text and "wallet.pay" in card.text
    assert [b.text for b in card.find_elements(By.CSS_SELECTOR, "button.primary")] == ["Approve"]
    assert not card.find_element(By.ID, f"budget-{approval['id']}").is_displayed()  # folded
    assert d.title.startswith("(1) ")
    assert wait(d, lambda x: x.execute_script("return window.shown"), "a notification") == [
        "gurtd: a decision waits|wants to pay: wallet.pay 40¢"]
    # deny without a reason: refused in the page, nothing sent
    card.find_element(By.CSS_SELECTOR, "button.danger").click()
    assert "reason is required" in card.find_element(By.CSS_SELECTOR, ".err").text
    assert gurtd.api("GET", f"/api/approvals/{approval['id']}")["state"] == "pending"
    reason = "not this month"
    card.find_element(By.ID, f"reason-{approval['id']}").send_keys(reason + Keys.ENTER)
    wait(d, lambda x: not x.find_elements(By.ID, f"approval-{approval['id']}"), "the card gone")
    assert not d.title.startswith("(")
    gurtd.wait_done(task["id"])
    stderr = [e["text"] for e in gurtd.log(task["id"]) if e["type"] == "stderr"]
    assert any(REJECTED.format(tool="wallet.pay", reason=reason) in s for s in stderr), stderr
    assert gurtd.api("GET", "/api/wallet")["balanceCents"] == 1000


def test_approve_all_pays_every_spending_and_the_wallet_shows_it(gurtd: Gurtd,
                                                                 browser: Any) -> None:
    d = browser
    gurtd.api("PUT", "/api/wallet", {"balanceCents": 500})
    go(d, "#/inbox", "#inbox")
    made = [gurtd.create(f"gurtd tool wallet.pay '{{\"to\": \"{to}\", \"cents\": {c}}}'",
                         title=f"pays {to}", tools=["wallet.pay"]) for to, c in (("ann", 7),
                                                                             ("bo", 9))]
    for task in made:
        approval = gurtd.pending(task["id"], 20)
        wait(d, lambda x: x.find_elements(By.ID, f"approval-{approval['id']}"), "its card")
    assert d.title.startswith("(2) ")
    click_and_confirm(d, "approve-all")
    for task in made:
        assert gurtd.wait(task["id"])["state"] == "done"
    wait(d, lambda x: not x.find_elements(By.CSS_SELECTOR, "#inbox article"), "an empty inbox")
    assert d.find_element(By.ID, "approve-all-result").text.startswith("Approved 2, skipped 0")
    go(d, "#/wallet", "#ledger tr")
    wait(d, lambda x: "4.84" in x.find_element(By.ID, "balance").text or
         "484" in x.find_element(By.ID, "balance").text, "the balance after paying")
    ledger = d.find_element(By.ID, "ledger").text
    assert "ann" in ledger and "bo" in ledger
    assert d.find_elements(By.CSS_SELECTOR, "#ledger time[title]")     # exact time on hover


def test_an_ask_is_answered_from_the_inbox(gurtd: Gurtd, browser: Any) -> None:
    d = browser
    go(d, "#/inbox", "#inbox")
    task = gurtd.create("gurtd tool ask '{\"question\": \"Which colour?\"}'", title="asks",
                        tools=["ask"])
    approval = gurtd.pending(task["id"], 20)
    card = wait(d, lambda x: x.find_elements(By.ID, f"approval-{approval['id']}"),
                "the ask")[0]
    assert card.text.count("Which colour?") == 1                   # once, not again as args
    assert len(card.find_elements(By.CSS_SELECTOR, "button.primary")) == 1
    assert "each one needs its own answer" in card.find_element(By.CLASS_NAME,
                                                                "always-blocked").text
    assert not card.find_elements(By.ID, f"always-{approval['id']}")
    card.find_element(By.ID, f"answer-{approval['id']}").send_keys("teal" + Keys.ENTER)
    wait(d, lambda x: not x.find_elements(By.ID, f"approval-{approval['id']}"), "answered")
    answered = gurtd.api("GET", f"/api/approvals/{approval['id']}")
    assert answered["state"] == "approved" and answered["answer"] == "teal"
    assert gurtd.wait(task["id"])["state"] == "done"
    assert any("teal" in line for line in gurtd.output(task["id"]))


def test_a_conflict_is_settled_from_the_inbox_with_a_merged_text(gurtd: Gurtd,
                                                                  browser: Any) -> None:
    """Two tasks side by side change line 3 of one file: the later one's conflict card names
    the file, why, its three versions and git's diff3; I write the merged text in the card,
    tick it and send it: the task is done and the view holds my text."""
    d = browser
    name = f"c-{secrets.token_hex(3)}.txt"
    gurtd.api("PUT", f"/api/workspaces/home/files/{name}", raw=b"1\n2\n3\n4\n",
              headers={"Content-Type": "application/octet-stream"}, status=201)
    ask = "gurtd tool ask '{\"question\": \"end?\"}'"
    a, b = (gurtd.create(f"sed -i 's/^3$/three by {n}/' {name}\n{ask}", title=f"edits {n}",
                         tools=["ask"])["id"] for n in "ab")
    gates = {t: gurtd.pending(t, 20)["id"] for t in (a, b)}    # both run side by side
    gurtd.api("POST", f"/api/approvals/{gates[b]}/answer", {"answer": "go"})
    assert gurtd.wait(b)["state"] == "done"            # b ends first: a's change meets it
    gurtd.api("POST", f"/api/approvals/{gates[a]}/answer", {"answer": "go"})
    conflict = eventually(lambda: next((x for x in gurtd.api(
        "GET", f"/api/approvals?state=pending&task={a}") if x["kind"] == "conflict"), None),
        30, "the conflict")
    go(d, "#/inbox", "#inbox")
    card = wait(d, lambda x: x.find_elements(By.ID, f"approval-{conflict['id']}"),
                "the conflict card")[0]
    assert card.get_attribute("data-kind") == "conflict"
    item = card.find_element(By.CSS_SELECTOR, f"li.conflict-path[data-path='{name}']")
    assert "overlapping changes" in item.find_element(By.CLASS_NAME, "why").text
    sides = {v.get_attribute("data-side"): v for v in item.find_elements(By.CLASS_NAME,
                                                                         "version")}
    assert set(sides) == {"before", "view", "task"}
    for side, line in (("before", "3"), ("view", "three by b"), ("task", "three by a")):
        sides[side].find_element(By.TAG_NAME, "summary").click()
        assert line in sides[side].find_element(By.TAG_NAME, "pre").text.splitlines()
    area = item.find_element(By.TAG_NAME, "textarea")
    assert "<<<<<<< task" in area.get_attribute("value")
    assert not card.find_elements(By.ID, f"approve-{conflict['id']}")
    area.clear()
    area.send_keys("1\n2\nthree by both\n4\n")
    item.find_element(By.CSS_SELECTOR, "input.use-text").click()
    card.find_element(By.ID, f"send-merged-{conflict['id']}").click()
    wait(d, lambda x: not x.find_elements(By.ID, f"approval-{conflict['id']}"), "answered")
    assert gurtd.wait(a)["state"] == "done"
    assert gurtd.file("home", name) == b"1\n2\nthree by both\n4\n"
    answered = gurtd.api("GET", f"/api/approvals/{conflict['id']}")
    assert answered["approvedArgs"] == {"keep": "task",
                                        "texts": {name: "1\n2\nthree by both\n4\n"}}


def test_undo_from_the_task_page_and_the_file_leaves_the_files_view(gurtd: Gurtd,
                                                                    browser: Any) -> None:
    d = browser
    task = gurtd.run_done("echo bye > portal-undo.txt", title="to be undone")
    go(d, "#/files/home", "#files li")
    wait(d, lambda x: x.find_elements(By.CSS_SELECTOR, '#files li[data-name="portal-undo.txt"]'),
         "the file listed")
    go(d, f"#/task/{task['id']}", "#btn-undo")
    click_and_confirm(d, "btn-undo")
    wait(d, lambda x: x.find_element(By.CSS_SELECTOR, "#task-fields .state")
         .get_attribute("data-state") == "undone", "undone")
    assert gurtd.task(task["id"])["state"] == "undone"
    assert not d.find_elements(By.ID, "btn-undo") and not d.find_elements(By.ID, "btn-stop")
    go(d, "#/files/home", "#files li")
    wait(d, lambda x: not x.find_elements(By.CSS_SELECTOR,
                                          '#files li[data-name="portal-undo.txt"]'),
         "the file gone")
    assert gurtd.file("home", "portal-undo.txt") is None


def test_a_stop_needs_a_yes(gurtd: Gurtd, browser: Any) -> None:
    d = browser
    task = gurtd.create("sleep 30", title="long")
    gurtd.wait(task["id"], ("running",))
    go(d, f"#/task/{task['id']}", "#btn-stop")
    d.find_element(By.ID, "btn-stop").click()
    wait(d, lambda x: x.find_element(By.ID, "confirm").get_attribute("open") is not None,
         "the dialog")
    d.switch_to.active_element.send_keys(Keys.ESCAPE)          # no: nothing happens
    time.sleep(0.3)
    assert gurtd.task(task["id"])["state"] == "running"
    click_and_confirm(d, "btn-stop")
    assert gurtd.wait(task["id"])["error"] == "stopped"


def test_settings_errors_show_next_to_their_field(gurtd: Gurtd, browser: Any) -> None:
    d = browser
    go(d, "#/settings", "#in-maxRunningTasks")
    field = d.find_element(By.ID, "in-maxRunningTasks")
    field.clear()
    field.send_keys("0")
    d.find_element(By.ID, "save-tasks").click()
    err = wait(d, lambda x: x.find_element(By.ID, "err-maxRunningTasks").text, "the error")
    assert "maxRunningTasks must be a whole number" in err
    assert gurtd.api("GET", "/api/settings")["maxRunningTasks"] == 8
    # the API's 400 is the one console line, and an expected one
    assert console_errors(d, ("/api/settings - Failed to load resource: the server responded "
                              "with a status of 400",)) == []
    field.clear()
    field.send_keys("9")
    d.find_element(By.ID, "save-tasks").click()
    eventually(lambda: gurtd.api("GET", "/api/settings")["maxRunningTasks"] == 9, 10, "saved")
    assert d.find_element(By.ID, "err-maxRunningTasks").text == ""
    gurtd.api("PUT", "/api/settings", {"maxRunningTasks": 8})


# What the eye checks, measured in the page: sideways scrolling of the page and of any part
# of it, the nav's rows and right edge, and the WCAG 2 contrast of every visible text (its
# colour over the first opaque background under it, translucent ones blended in): 4.5:1, or
# 3:1 for large text (24 px, or 18.66 px bold).
LAYOUT_JS = """
const rgba = s => { const m = (s.match(/[\\d.]+/g) || [0, 0, 0, 0]).map(Number); return m.length === 3 ? [...m, 1] : m; };
const lum = c => { const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
  return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
const over = (top, under) => [0, 1, 2].map(i => top[i] * top[3] + under[i] * (1 - top[3])).concat(1);
function under(node) {
  const layers = [];
  for (let n = node; n; n = n.parentElement) {
    const c = rgba(getComputedStyle(n).backgroundColor);
    if (c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
  }
  return layers.reverse().reduce((acc, c) => over(c, acc), [255, 255, 255, 1]);
}
const shown = n => n.getClientRects().length > 0 && getComputedStyle(n).visibility === "visible";
const root = document.documentElement, width = root.clientWidth;
const low = [];
for (const n of document.body.querySelectorAll("*")) {
  if (["SCRIPT", "STYLE", "OPTION"].includes(n.tagName) || !shown(n) || n.disabled) continue;
  const own = [...n.childNodes].some(c => c.nodeType === 3 && c.textContent.trim())
    || (["INPUT", "TEXTAREA"].includes(n.tagName) && n.type !== "checkbox" && n.type !== "file" && n.value);
  if (!own) continue;
  const st = getComputedStyle(n), bg = under(n), fg = over(rgba(st.color), bg);
  const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x), ratio = (a + 0.05) / (b + 0.05);
  const size = parseFloat(st.fontSize), large = size >= 24 || (size >= 18.66 && +st.fontWeight >= 700);
  if (ratio < (large ? 3 : 4.5)) low.push([(n.textContent || n.value).trim().slice(0, 40), n.tagName + "." + n.className,
    ratio.toFixed(2), st.color, "rgb(" + bg.slice(0, 3).map(Math.round).join(", ") + ")"]);
}
const sideways = [...document.querySelectorAll("main *")].filter(n => shown(n) && n.scrollWidth > n.clientWidth + 1
  && ["auto", "scroll"].includes(getComputedStyle(n).overflowX) && n.clientWidth > 0).map(n => n.tagName + "#" + n.id + "." + n.className);
const nav = [...document.querySelectorAll("#top nav > ul a, #nav-more > summary")].filter(shown);
const tops = new Set(nav.map(a => Math.round(a.getBoundingClientRect().top)));
return { page: root.scrollWidth, width, sideways, low, navRows: tops.size,
  navRight: Math.max(0, ...nav.map(a => a.getBoundingClientRect().right)),
  navPages: nav.map(a => a.dataset.page).filter(Boolean) };
"""


def check_layout(driver: Any, name: str) -> None:
    got = driver.execute_script(LAYOUT_JS)
    assert got["page"] <= got["width"], f"{name}: the page scrolls sideways: {got}"
    assert not got["sideways"], f"{name}: these parts scroll sideways: {got['sideways']}"
    assert not got["low"], f"{name}: text below WCAG AA contrast: {got['low']}"
    if driver.find_element(By.ID, "top").is_displayed():
        assert got["navRows"] == 1 and got["navRight"] <= got["width"], f"{name}: the nav: {got}"
        assert {"tasks", "inbox", "new", "files"} <= set(got["navPages"]), got["navPages"]


def shoot(driver: Any, path: str) -> None:
    """A picture of the whole page (beyond the window's height)."""
    png = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png",
                                                            "captureBeyondViewport": True})
    Path(path).write_bytes(base64.b64decode(png["data"]))
    assert os.path.getsize(path) > 1000


def test_every_page_at_1280_and_390_px_light_and_dark(gurtd: Gurtd, browser: Any,
                                                     shots: str) -> None:
    d = browser
    gurtd.run("printf 'one\\ntwo\\nthree\\nfour\\n' > shot.txt", title="makes the file")
    some = gurtd.run("sed -i 's/^two$/TWO/; /^four$/d' shot.txt; echo five >> shot.txt\n"
                     "echo new > shot-new.txt", title="for the pictures")
    asking = gurtd.create("gurtd tool ask '{\"question\": \"Ship the release?\"}'",
                          title="asks for the pictures", tools=["ask"])
    ask = gurtd.pending(asking["id"], 20)
    paying = gurtd.create("gurtd tool wallet.pay '{\"to\": \"shop\", \"cents\": 5}'",
                          title="pays for the pictures", tools=["wallet.pay"])
    spend = gurtd.pending(paying["id"], 20)
    sched = gurtd.api("POST", "/api/schedules", {"name": "weekly digest", "cron": "0 9 * * MON",
                                                 "timezone": "Europe/Berlin",
                                                 "task": {"worker": "fake", "prompt": "true"}})
    policy = gurtd.api("POST", "/api/policies", {"tool": "wallet.pay", "scope": "task",
                                                 "task": some["id"], "maxCents": 50})
    pages = [("tasks", "#/tasks", "#task-rows"), ("task", f"#/task/{some['id']}", "#task-log li"),
             ("asking", f"#/task/{asking['id']}", "#task-decisions article"),
             ("inbox", "#/inbox", "#inbox article"), ("new", "#/new", "#new-task"),
             ("files", "#/files/home", "#files li"), ("file", "#/files/home/shot.txt",
                                                      "#file-content"),
             ("wallet", "#/wallet", "#ledger"), ("settings", "#/settings", "#settings"),
             ("schedules", "#/schedules", "#schedule-rows tr"),
             ("policies", "#/policies", "#policy-rows tr")]
    tabs = {"task": ("changes", "diff", "details"), "asking": ("decisions",)}
    try:
        for scheme in ("light", "dark"):
            d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [
                {"name": "prefers-color-scheme", "value": scheme}]})
            for width in WIDTHS:
                d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                    "width": width, "height": 800, "deviceScaleFactor": 1, "mobile": width < 600})
                for name, hash_, ready in pages:
                    go(d, hash_, ready)
                    text = d.find_element(By.TAG_NAME, "main").text   # a diff names /dev/null
                    assert not re.search(r"(?<!/dev/)\bnull\b|\bundefined\b", text), (name, text)
                    # keyboard: the page's heading has focus
                    assert d.switch_to.active_element.tag_name == "h1"
                    check_layout(d, f"{name} at {width} px, {scheme}")
                    shoot(d, os.path.join(shots, f"{name}-{width}-{scheme}.png"))
                    for other in tabs.get(name, ()):
                        tab(d, other)
                        check_layout(d, f"{name} {other} at {width} px, {scheme}")
                        shoot(d, os.path.join(shots, f"{name}-{other}-{width}-{scheme}.png"))
                if width < 600:    # the pages the narrow nav folds away are one tap further
                    click(d, "#nav-more > summary")
                    check_layout(d, f"the nav's menu at {width} px, {scheme}")
                    shoot(d, os.path.join(shots, f"nav-menu-{width}-{scheme}.png"))
                    click(d, '#nav-more a[data-page="wallet"]')
                    wait(d, lambda x: x.current_url.endswith("#/wallet"), "the wallet")
                    assert d.find_element(By.ID, "nav-more").get_attribute("open") is None
            background = d.execute_script("return getComputedStyle(document.body).backgroundColor")
            assert (background == "rgb(255, 255, 255)") == (scheme == "light"), background
    finally:
        d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
        d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        gurtd.api("POST", f"/api/approvals/{ask['id']}/answer", {"answer": "yes"})
        gurtd.api("POST", f"/api/approvals/{spend['id']}/deny", {"reason": "only a picture"})
        gurtd.api("DELETE", f"/api/schedules/{sched['id']}")
        gurtd.api("DELETE", f"/api/policies/{policy['id']}")
    assert len(os.listdir(shots)) >= 2 * 2 * len(pages)


def test_the_task_list_shows_each_task_and_sorts_and_filters(gurtd: Gurtd, browser: Any) -> None:
    d = browser
    zz = gurtd.run("sleep 0.3", title="zz listed", budgetCents=30)
    aa = gurtd.run("true", title="aa listed", budgetCents=5)
    go(d, "#/tasks", f"#task-{aa['id']}")
    cells = [c.text for c in d.find_elements(By.CSS_SELECTOR, f"#task-{zz['id']} td")]
    assert cells[0] == zz["id"][:8] and cells[1] == "done" and cells[2].startswith("zz listed")
    assert cells[3:5] == ["fake", "api"] and cells[7] == "30¢", cells
    assert re.fullmatch(r"\d+(\.\d)? s", cells[5]), cells       # a duration
    order = lambda: [r.get_attribute("id")[5:] for r in d.find_elements(By.CSS_SELECTOR,
                                                                      "#task-rows tr")]
    click(d, 'th[data-key="title"] button')
    assert d.find_element(By.CSS_SELECTOR, 'th[data-key="title"]').get_attribute(
        "aria-sort") == "ascending"
    assert order().index(aa["id"]) < order().index(zz["id"])
    click(d, 'th[data-key="title"] button')
    assert order().index(zz["id"]) < order().index(aa["id"])
    click(d, 'th[data-key="budget"] button')
    budgets = [gurtd.task(i)["budgetCents"] for i in order()[:5]]
    assert budgets == sorted(budgets, reverse=True), budgets
    d.find_element(By.ID, "f-text").send_keys("zz list")
    wait(d, lambda x: order() == [zz["id"]], "only the task whose title matches")
    d.find_element(By.ID, "f-text").send_keys(Keys.BACKSPACE * 7 + zz["id"])
    wait(d, lambda x: order() == [zz["id"]], "the task of that id")
    d.find_element(By.ID, "f-text").clear()
    d.find_element(By.ID, "f-text").send_keys(" ")
    click(d, 'th[data-key="created"] button')          # back to the newest first
    wait(d, lambda x: x.find_element(By.CSS_SELECTOR, 'th[data-key="created"]').get_attribute(
        "aria-sort") == "descending", "newest first")


def test_an_answer_older_than_an_event_never_takes_a_task_back(gurtd: Gurtd,
                                                               browser: Any) -> None:
    """The POST's answer of a task (queued or running) can reach the page after the event of
    its end (it did under load: a schedule's run-now stayed running); the page keeps the end."""
    d = browser
    answer = gurtd.api("POST", "/api/tasks", {"prompt": "true", "worker": "fake",
                                              "title": "late answer"}, status=201)
    gurtd.wait(answer["id"])
    go(d, "#/tasks", f"#task-{answer['id']}")
    cell = lambda: d.find_element(By.CSS_SELECTOR, f"#task-{answer['id']} td:nth-child(2)").text
    wait(d, lambda x: cell() == "done", "the task done")
    d.execute_script("onTask(arguments[0])", answer)      # the 201, as a late answer
    d.execute_script("onTask(Object.assign({}, arguments[0], {state: 'running', "
                     "updatedAt: arguments[1]}))", answer, gurtd.task(answer["id"])["updatedAt"])
    assert d.execute_script("return S.tasks.get(arguments[0]).state", answer["id"]) == "done"
    go(d, "#/tasks", f"#task-{answer['id']}")
    assert cell() == "done"


def test_a_diff_is_a_card_per_file_with_line_numbers_and_tint(gurtd: Gurtd,
                                                               browser: Any) -> None:
    d = browser
    name = f"d-{secrets.token_hex(3)}.txt"
    gurtd.api("PUT", f"/api/workspaces/home/files/{name}", raw=b"a\nb\nc\n",
              headers={"Content-Type": "application/octet-stream"}, status=201)
    task = gurtd.run(f"sed -i 's/^b$/B/' {name}\necho n > new-{name}", title="edits for a diff")
    go(d, f"#/task/{task['id']}", "#task-log li")
    tab(d, "diff")
    card = wait(d, lambda x: x.find_elements(
        By.CSS_SELECTOR, f'article.file-card[data-path="{name}"]'), "its card")[0]
    head = card.find_element(By.TAG_NAME, "header").text
    assert "modified" in head and name in head and "+1" in head and "−1" in head, head
    added = d.find_element(By.CSS_SELECTOR, f'article.file-card[data-path="new-{name}"]')
    assert "added" in added.find_element(By.TAG_NAME, "header").text
    rows = [(r.get_attribute("class"), [c.text for c in r.find_elements(By.TAG_NAME, "td")])
            for r in card.find_elements(By.CSS_SELECTOR, "table.diff tr")]
    assert rows[0][0] == "hunk" and rows[0][1][2].startswith("@@ -1,3 +1,3 @@"), rows
    assert rows[1:] == [("ctx", ["1", "1", " a"]), ("del", ["2", "", "-b"]),
                        ("add", ["", "2", "+B"]), ("ctx", ["3", "3", " c"])], rows
    assert not [r for r in rows if r[1][2].startswith(("---", "+++"))]   # they name the file
    colour = "return getComputedStyle(arguments[0]).backgroundColor"
    tint = {kind: d.execute_script(colour, card.find_element(By.CSS_SELECTOR,
                                                             f"tr.{kind} td.code"))
            for kind in ("add", "del", "ctx", "hunk")}
    assert len(set(tint.values())) == 4, tint
    path = card.find_element(By.CSS_SELECTOR, "header .path")
    assert d.execute_script("return getComputedStyle(arguments[0]).color", path) == \
        d.execute_script("return getComputedStyle(document.body).color")


def test_settings_have_a_control_per_type_help_and_a_save_per_section(gurtd: Gurtd,
                                                                       browser: Any) -> None:
    d = browser
    described = gurtd.api("GET", "/api/openapi.json")["components"]["schemas"]["Settings"][
        "properties"]
    go(d, "#/settings", "#in-maxRunningTasks")
    assert d.find_element(By.ID, "in-askHostsDefault").get_attribute("type") == "checkbox"
    assert d.find_element(By.ID, "in-maxRunningTasks").get_attribute("type") == "number"
    assert d.find_element(By.ID, "in-droidAutonomy").tag_name == "select"
    roots = d.find_element(By.ID, "in-folderRoots")
    assert roots.tag_name == "textarea" and roots.get_attribute("value") == "/home\n/srv"
    for key in ("droidPath", "maxRunningTasks", "taskMemoryBytes", "folderRoots"):
        help_ = d.find_element(By.ID, f"help-{key}").text
        assert described[key]["description"].rstrip(".") in help_, (key, help_)
    # each section saves its own fields only
    field = d.find_element(By.ID, "in-maxRunningTasks")
    field.clear()
    field.send_keys("7")
    d.find_element(By.ID, "in-hookHosts").send_keys("hooks.example.org")
    try:
        click(d, "#save-network")
        eventually(lambda: gurtd.api("GET", "/api/settings")["hookHosts"] ==
                   ["hooks.example.org"], 10, "the network section saved")
        assert d.find_element(By.ID, "saved-network").text == "Saved."
        assert gurtd.api("GET", "/api/settings")["maxRunningTasks"] == 8
        click(d, "#in-askHostsDefault")
        click(d, "#save-tasks")
        eventually(lambda: gurtd.api("GET", "/api/settings")["askHostsDefault"] is True, 10,
                   "the tasks section saved")
        assert gurtd.api("GET", "/api/settings")["maxRunningTasks"] == 7
    finally:
        gurtd.api("PUT", "/api/settings", {"hookHosts": [], "askHostsDefault": False,
                                           "maxRunningTasks": 8})


def test_files_download_and_upload(gurtd: Gurtd, browser: Any, tmp_path: Any) -> None:
    d = browser
    name = f"dl-{secrets.token_hex(3)}.txt"
    gurtd.run(f"echo down > {name}", title="a file to download")
    go(d, "#/files/home", f'#files li[data-name="{name}"]')
    link = d.find_element(By.CSS_SELECTOR, f'#files li[data-name="{name}"] a[download]')
    assert link.get_attribute("download") == name
    got = d.execute_async_script("fetch(arguments[0]).then(r => r.text()).then(arguments[1])",
                                 link.get_attribute("href"))
    assert got == "down\n"
    up = tmp_path / f"up-{secrets.token_hex(3)}.txt"
    up.write_bytes(b"uploaded\n")
    os.chmod(tmp_path, 0o755)
    d.find_element(By.ID, "f-upload").send_keys(str(up))
    click(d, "#upload")
    wait(d, lambda x: x.find_elements(By.CSS_SELECTOR, f'#files li[data-name="{up.name}"]'),
         "the upload listed")
    assert "Uploaded" in d.find_element(By.ID, "upload-status").text
    assert gurtd.file("home", up.name) == b"uploaded\n"


# personal mode, decisions, sources ############################################################

def click(driver: Any, css: str) -> None:
    """Click what css finds (found again if a live update redrew it meanwhile)."""
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True, css)


def click_and_confirm(driver: Any, element_id: str) -> None:
    click(driver, "#" + element_id)
    confirm(driver)


def read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return None


def test_keep_a_personal_task_through_its_conflict_then_undo_it(gurtd: Gurtd, browser: Any,
                                                                owner_folder: str) -> None:
    d = browser
    task = run_on(gurtd, owner_folder, "echo task > a.txt", "echo new > new.txt",
                  title="edits my folder")
    assert task["state"] == "done" and task["review"] == "pending"
    Path(owner_folder, "a.txt").write_text("mine\n")  # my own edit since its start
    go(d, f"#/task/{task['id']}", "#task-changes input.pick")
    tab(d, "diff")
    wait(d, lambda x: "+task" in x.find_element(By.ID, "task-diff").text, "the diff")
    # keep: 409, the conflict named per path, nothing written
    click_and_confirm(d, "btn-keep")
    conflicts = wait(d, lambda x: x.find_elements(By.CSS_SELECTOR, "#conflicts li"),
                     "the conflicts")
    assert [c.get_attribute("data-path") for c in conflicts] == ["a.txt"]
    assert "a.txt" in conflicts[0].text and "owner" in conflicts[0].text
    assert read(os.path.join(owner_folder, "new.txt")) is None
    assert gurtd.task(task["id"])["review"] == "conflict"
    # keep only new.txt: it lands, owned by the folder's owner; mine stays
    go(d, f"#/task/{task['id']}", '#task-changes[data-review="conflict"] input.pick')
    tab(d, "changes")
    pick = d.find_element(By.CSS_SELECTOR, f'input.pick[value="{owner_folder}/new.txt"]')
    pick.click()
    click_and_confirm(d, "btn-keep-paths")
    eventually(lambda: read(os.path.join(owner_folder, "new.txt")) == "new\n", 10, "new.txt kept")
    assert os.stat(os.path.join(owner_folder, "new.txt")).st_uid == os.stat(owner_folder).st_uid
    assert read(os.path.join(owner_folder, "a.txt")) == "mine\n"
    wait(d, lambda x: x.find_elements(By.CSS_SELECTOR, '#task-changes[data-review="pending"]'),
         "the rest pending")
    # keep anyway: the task's version wins
    click_and_confirm(d, "btn-keep")
    click_and_confirm(d, "btn-keep-force")
    wait(d, lambda x: "kept" in x.find_element(By.ID, "task-fields").text, "review: kept")
    assert read(os.path.join(owner_folder, "a.txt")) == "task\n"
    # undo after my later edit: 409 naming it, then undo anyway puts back what was before
    Path(owner_folder, "a.txt").write_text("mine again\n")
    click_and_confirm(d, "btn-undo")
    wait(d, lambda x: x.find_elements(By.CSS_SELECTOR, '#conflicts li[data-path="a.txt"]'),
         "the undo's conflict")
    assert read(os.path.join(owner_folder, "a.txt")) == "mine again\n"
    click_and_confirm(d, "btn-undo-force")
    wait(d, lambda x: "undone" in x.find_element(By.ID, "task-fields").text, "undone")
    assert read(os.path.join(owner_folder, "a.txt")) == "mine\n"
    assert read(os.path.join(owner_folder, "new.txt")) is None
    assert gurtd.task(task["id"])["review"] == "undone"
    assert console_errors(d, ("/keep - Failed to load resource: the server responded with a "
                              "status of 409", "/undo - Failed to load resource: the server "
                              "responded with a status of 409")) == []


def test_always_at_task_scope_from_the_inbox_and_the_next_call_asks_no_one(
        gurtd: Gurtd, browser: Any) -> None:
    d = browser
    gurtd.api("PUT", "/api/wallet", {"balanceCents": 1000})
    pay = "gurtd tool wallet.pay '{{\"to\": \"shop\", \"cents\": {}}}'"
    go(d, "#/inbox", "#inbox")
    task = gurtd.create(pay.format(3) + "\nsleep 0.5\n" + pay.format(4), title="pays twice",
                        tools=["wallet.pay"])
    first = gurtd.pending(task["id"], 20)
    assert first["canAlwaysApprove"] is True
    card = wait(d, lambda x: x.find_elements(By.ID, f"approval-{first['id']}"), "its card")[0]
    more_answers(card)
    Select(card.find_element(By.ID, f"scope-{first['id']}")).select_by_value("task")
    card.find_element(By.ID, f"always-{first['id']}").click()
    wait(d, lambda x: not x.find_elements(By.ID, f"approval-{first['id']}"), "the card gone")
    assert gurtd.wait(task["id"])["state"] == "done"
    answers = gurtd.api("GET", f"/api/approvals?task={task['id']}")
    policy = gurtd.api("GET", f"/api/approvals/{first['id']}")["policy"]
    assert sorted(a["answeredBy"] for a in answers) == ["api", "policy"]
    assert all(a["policy"] == policy for a in answers)
    assert gurtd.task(task["id"])["costCents"] == 7
    # not outside its scope: another task's payment still asks
    other = gurtd.create(pay.format(2), title="pays once", tools=["wallet.pay"])
    asked = gurtd.pending(other["id"], 20)
    wait(d, lambda x: x.find_elements(By.ID, f"approval-{asked['id']}"), "the other's card")
    # a budget approval can raise the budget instead
    more_answers(d.find_element(By.ID, f"approval-{asked['id']}"))
    d.find_element(By.ID, f"budget-{asked['id']}").send_keys("25" + Keys.ENTER)
    wait(d, lambda x: not x.find_elements(By.ID, f"approval-{asked['id']}"), "answered")
    assert gurtd.wait(other["id"])["budgetCents"] == 25
    # the Policies page lists it, and its delete is seen live
    go(d, "#/policies", f"#policy-{policy}")
    row = d.find_element(By.ID, f"policy-{policy}")
    assert "wallet.pay" in row.text and "task" in row.text and "pays twice" in row.text
    click_and_confirm(d, f"delete-{policy}")
    wait(d, lambda x: not x.find_elements(By.ID, f"policy-{policy}"), "the policy gone")
    assert all(p["id"] != policy for p in gurtd.api("GET", "/api/policies"))
    made = gurtd.api("POST", "/api/policies", {"tool": "wallet.pay", "scope": "task",
                                               "task": other["id"], "maxCents": 5}, status=201)
    row = wait(d, lambda x: x.find_elements(By.ID, f"policy-{made['id']}"), "a new policy")[0]
    assert "5" in row.text
    gurtd.api("DELETE", f"/api/policies/{made['id']}")
    wait(d, lambda x: not x.find_elements(By.ID, f"policy-{made['id']}"), "deleted elsewhere")


def test_a_host_asked_at_run_time_is_shown_by_name_and_denied_from_the_inbox(
        gurtd: Gurtd, browser: Any) -> None:
    d = browser
    go(d, "#/inbox", "#inbox")
    task = gurtd.create("getent hosts portal.test; echo getent $?", title="wants a host",
                        askHosts=True)
    asked = gurtd.pending(task["id"], 20)
    assert asked["kind"] == "host"
    card = wait(d, lambda x: x.find_elements(By.ID, f"approval-{asked['id']}"), "its card")[0]
    assert card.text.startswith("Host portal.test") and "wants a host" in card.text
    assert card.find_elements(By.ID, f"always-{asked['id']}")      # a host can be always
    card.find_element(By.ID, f"reason-{asked['id']}").send_keys("not today" + Keys.ENTER)
    wait(d, lambda x: not x.find_elements(By.ID, f"approval-{asked['id']}"), "answered")
    assert gurtd.wait(task["id"], timeout=60)["state"] == "done"
    assert gurtd.output(task["id"])[-1] == "getent 2"                  # NXDOMAIN


def test_a_schedule_run_now_from_the_schedules_page_shows_its_task(gurtd: Gurtd,
                                                                   browser: Any) -> None:
    d = browser
    sched = gurtd.api("POST", "/api/schedules", {"name": "nightly report", "cron": "0 3 * * *",
                                                 "task": {"worker": "fake",
                                                      "prompt": "echo scheduled"}},
                  status=201)
    try:
        go(d, f"#/schedules/{sched['id']}", f"#schedule-{sched['id']}")
        row = d.find_element(By.ID, f"schedule-{sched['id']}")
        assert "never" in row.text and "0 3 * * *" in row.text
        assert len(row.find_elements(By.CSS_SELECTOR, "time[title]")) == 3   # next runs
        click_and_confirm(d, f"run-{sched['id']}")
        wait(d, lambda x: x.find_elements(By.CSS_SELECTOR, f"#schedule-{sched['id']} "
                                          '.state[data-state="done"]'), "its task done")
        ran = gurtd.api("GET", f"/api/schedules/{sched['id']}")
        assert ran["lastState"] == "done" and ran["lastTask"]
        click(d, f"#schedule-{sched['id']} a.last-task")
        wait(d, lambda x: x.current_url.endswith(f"#/task/{ran['lastTask']}"), "its page")
        task = gurtd.task(ran["lastTask"])
        assert task["source"] == "schedule" and task["schedule"] == sched["id"]
        click(d, "#task-schedule")
        wait(d, lambda x: x.find_elements(By.ID, f"schedule-{sched['id']}"), "back to it")
    finally:
        gurtd.api("DELETE", f"/api/schedules/{sched['id']}")


def test_a_jira_task_links_to_its_issue_only_with_a_base_url(gurtd: Gurtd, browser: Any) -> None:
    d = browser
    task = gurtd.run("true", title="from jira", source="jira:ABC-7")
    go(d, f"#/task/{task['id']}", "#task-fields")
    time.sleep(0.3)
    assert not d.find_elements(By.ID, "task-issue")           # no jira.baseUrl: no link
    gurtd.api("PUT", "/api/settings", {"jira": {"baseUrl": "http://127.0.0.1:9/", "email": "a@b.c",
                                                "jql": "labels = gurt", "enabled": False}})
    try:
        go(d, "#/tasks", "#task-rows")
        go(d, f"#/task/{task['id']}", "#task-issue")
        link = d.find_element(By.ID, "task-issue")
        assert link.get_attribute("href") == "http://127.0.0.1:9/browse/ABC-7"
    finally:
        gurtd.api("PUT", "/api/settings", {"jira": {}})


# other origins ################################################################################

EVIL_PAGE = """<!doctype html><meta charset="utf-8"><title>evil</title>
<form id="f" method="post" enctype="text/plain" action="http://127.0.0.1:{port}/api/tasks">
<input name='{{"title": "evil", "prompt": "touch evil", "worker": "fake", "x": "' value='"}}'>
</form>
<pre id="out"></pre>
<script>
const out = document.getElementById("out");
const target = "http://127.0.0.1:{port}";
async function tryIt(name, p) {{
  try {{ const r = await p; out.textContent += name + ": status " + r.status + " " +
           (r.type === "opaque" ? "opaque" : await r.text()) + "\\n"; }}
  catch (e) {{ out.textContent += name + ": refused\\n"; }}
}}
(async () => {{
  await tryIt("read", fetch(target + "/api/tasks", {{credentials: "include"}}));
  await tryIt("start", fetch(target + "/api/tasks", {{method: "POST", credentials: "include",
    mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
    body: JSON.stringify({{title: "evil", prompt: "touch evil", worker: "fake"}})}}));
  await tryIt("start-header", fetch(target + "/api/tasks", {{method: "POST",
    credentials: "include", headers: {{"X-Gurt-Portal": "1", "Content-Type": "application/json"}},
    body: JSON.stringify({{title: "evil", prompt: "touch evil", worker: "fake"}})}}));
  out.textContent += "done\\n";
}})();
</script>"""


@pytest.fixture
def evil_site(gurtd: Gurtd) -> Iterator[str]:
    """A page of another origin: the same loopback address on another port (same-site for a
    browser, so the SameSite=Strict cookie alone would not stop it)."""
    page = EVIL_PAGE.format(port=gurtd.port).encode()

    with loopback_server(lambda req: answer(req, 200, page, {"Content-Type": "text/html"})) \
            as (server, _):
        yield f"http://127.0.0.1:{server.server_address[1]}/"


def test_a_page_of_another_origin_can_neither_start_nor_read(gurtd: Gurtd, browser: Any,
                                                             evil_site: str) -> None:
    d = browser
    before = len(gurtd.api("GET", "/api/tasks"))
    d.get(evil_site)
    out = wait(d, lambda x: "done" in x.find_element(By.ID, "out").text and
               x.find_element(By.ID, "out").text, "the evil page's tries")
    assert "read: refused" in out, out                   # nothing read
    assert "start-header: refused" in out, out           # the preflight is not granted
    assert "opaque" in out or "start: refused" in out, out
    d.execute_script("document.getElementById('f').submit()")
    wait(d, lambda x: "cross" in x.find_element(By.TAG_NAME, "body").text, "gurtd's refusal")
    assert "cross-origin requests are refused" in d.find_element(By.TAG_NAME, "body").text
    time.sleep(0.3)
    assert len(gurtd.api("GET", "/api/tasks")) == before
    assert not any(t["title"] == "evil" for t in gurtd.api("GET", "/api/tasks"))
    d.get_log("browser")            # the evil page's own refusals are its console's errors
    sign_in(d, gurtd)                    # back home (a cross-site visit to / is refused too)


def test_a_change_with_the_cookie_needs_the_portal_header(gurtd: Gurtd, browser: Any) -> None:
    cookie = next(c for c in browser.get_cookies() if c["name"] == "gurt_session")["value"]
    jar = {"Cookie": f"gurt_session={cookie}", "Content-Type": "application/json"}
    body = {"title": "t", "prompt": "true", "worker": "fake"}
    code, data, _ = gurtd.request("POST", "/api/tasks", body, headers=jar, token=False)
    assert code == 403 and data["code"] == "cross_origin", data
    gurtd.api("POST", "/api/tasks", body, token=False, status=403,
              headers={**jar, "X-Gurt-Portal": "1", "Sec-Fetch-Site": "same-site"})
    code, data, _ = gurtd.request("GET", "/api/tasks", headers=jar, token=False)
    assert code == 200 and isinstance(data, list)
    # a sign-in code is made with the token only
    gurtd.api("POST", "/api/sessions/codes", {}, token=False, headers={**jar, "X-Gurt-Portal": "1"},
              status=403)


# last: sign out ###############################################################################

def test_sign_out_and_be_refused(gurtd: Gurtd, browser: Any) -> None:
    d = browser
    cookie = next(c for c in d.get_cookies() if c["name"] == "gurt_session")["value"]
    go(d, "#/settings", "#sign-out")
    click_and_confirm(d, "sign-out")
    wait(d, lambda x: x.find_elements(By.ID, "signin"), "the sign-in form")
    assert not d.find_element(By.ID, "top").is_displayed()
    assert not [c for c in d.get_cookies() if c["name"] == "gurt_session"]
    gurtd.api("GET", "/api/tasks", token=False,
              headers={"Cookie": f"gurt_session={cookie}"}, status=401)
    d.refresh()
    wait(d, lambda x: x.find_elements(By.ID, "signin"), "the sign-in form after a reload")
    assert d.find_elements(By.ID, "task-rows") == []


# sessions without a browser ###################################################################

def test_codes_and_sessions_expire_and_survive_a_restart(new_gurtd: Any) -> None:
    # sessions of 10 s, not 3: the first is used after a restart, which on a busy machine (the
    # VM tier beside the suite) can take seconds; its end is waited for from its making
    session = 10
    g = new_gurtd({"GURT_SESSION_SECONDS": str(session), "GURT_SIGN_IN_CODE_SECONDS": "1"})
    portal = {"X-Gurt-Portal": "1"}
    made = g.api("POST", "/api/sessions/codes", {}, status=201)
    time.sleep(1.2)
    # too late
    g.api("POST", "/api/sessions", {"code": made["code"]}, token=False, headers=portal, status=401)
    g.api("POST", "/api/sessions", {"token": "wrong"}, token=False, headers=portal, status=401)
    g.api("POST", "/api/sessions", {"token": g.token}, token=False, status=403)  # not from the page
    code, data, headers = g.request("POST", "/api/sessions", {"token": g.token}, token=False,
                                    headers=portal)
    assert code == 201, data
    made_at = time.monotonic()
    set_cookie = headers["set-cookie"]
    for part in ("HttpOnly", "SameSite=Strict", "Path=/", f"Max-Age={session}"):
        assert part in set_cookie, set_cookie
    secret = set_cookie.split(";")[0].split("=", 1)[1]
    jar = {"Cookie": f"gurt_session={secret}"}
    g.restart()                                               # sessions are kept on disk
    g.api("GET", "/api/tasks", token=False, headers=jar, status=200)
    assert secret not in Path(g.home, "sessions.json").read_text()
    # a revoked session's open event stream ends too
    code, data, headers = g.request("POST", "/api/sessions", {"token": g.token}, token=False,
                                    headers=portal)
    other = {"Cookie": headers["set-cookie"].split(";")[0]}
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=10)
    conn.request("GET", "/api/events", headers=other)
    stream = conn.getresponse()
    assert stream.status == 200 and stream.readline().startswith(b": gurtd events")
    code, listed, _ = g.request("GET", "/api/sessions", token=False, headers=other)
    mine = next(s for s in listed if s["current"])
    g.api("DELETE", f"/api/sessions/{mine['id']}")
    started = time.monotonic()
    assert stream.read() is not None                          # returns at the stream's end
    assert time.monotonic() - started < 5
    conn.close()
    time.sleep(max(0.0, made_at + session + 1.2 - time.monotonic()))
    g.api("GET", "/api/tasks", token=False, headers=jar, status=401)  # expired
    code, data, _ = g.request("GET", "/api/sessions/current", token=False, headers=jar)
    assert data == {"signedIn": False}
    # the page itself is no secret; it comes without a token and sets a strict policy
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=10)
    conn.request("GET", "/", headers={"Host": f"127.0.0.1:{g.port}"})
    resp = conn.getresponse()
    page = resp.read()
    conn.close()
    assert resp.status == 200 and b"<title>gurtd</title>" in page
    assert g.token.encode() not in page
    assert "script-src 'sha256-" in resp.getheader("Content-Security-Policy")
    assert len(page) <= 100_000


def test_a_damaged_sessions_file_is_set_aside_and_gurtd_starts(new_gurtd: Any) -> None:
    g = new_gurtd()
    path = os.path.join(g.home, "sessions.json")
    g.stop()
    with open(path, "w") as f:
        f.write('{"sessions": [{"id": "s1", "hash": ')          # cut short by a crash
    g.start()
    assert g.api("GET", "/api/sessions") == []
    assert [n for n in os.listdir(g.home) if n.startswith("sessions.json.damaged-")]
    g.stop()
    with open(path, "w") as f:
        json.dump({"sessions": 7}, f)                           # the wrong shape
    g.start()
    assert g.api("GET", "/api/sessions") == []
    code, data, headers = g.request("POST", "/api/sessions", {"token": g.token}, token=False,
                                    headers={"X-Gurt-Portal": "1"})
    assert code == 201 and len(g.api("GET", "/api/sessions")) == 1
