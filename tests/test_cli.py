"""The command line as people use it: `gurtd` run as a subprocess against a live gurtd, piped
(as scripts see it) and on a terminal (a pty from the pty module: spinner, colours, the
question on Ctrl-C).  Errors must say what to do, never print raw JSON or HTTP status numbers.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time

from conftest import (GURTD, ROOT, Gurtd, eventually, make_home, read_until, remove_home,
                      started, wait_for_step)

ID_RE = re.compile(r"t[a-z0-9]{9}")


# helpers #####################################################################################

def controlling_terminal() -> None:
    """In the child, after setsid: its pty becomes its controlling terminal (Ctrl-C works)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A CLI process on a pseudo-terminal: what a person at a terminal sees and types."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, env={**env, "TERM": "xterm", "COLUMNS": "100"},
                                     cwd=ROOT, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, preexec_fn=controlling_terminal)
        os.close(slave)
        self.seen = b""

    def expect(self, pattern: bytes, timeout: float = 30.0) -> bytes:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.seen):
            assert time.monotonic() < deadline, f"never saw {pattern!r} in {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:               # the process ended and closed the terminal
                    assert re.search(pattern, self.seen), (pattern, self.seen[-2000:])
        return self.seen

    def type(self, text: bytes) -> None:
        os.write(self.master, text)

    def close(self) -> int:
        try:
            code = self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)
        return code


def assert_said_for_people(proc: subprocess.CompletedProcess[str], *wanted: str) -> None:
    assert proc.returncode != 0, proc
    text = proc.stdout + proc.stderr
    assert "{" not in text and not re.search(r"\b[45]\d\d\b", text), text
    for word in wanted:
        assert word in text, (word, text)


# run --wait ##################################################################################

def test_run_wait_shows_the_id_first_then_steps_and_output_as_they_come(gurtd: Gurtd) -> None:
    proc = gurtd.cli_ok("run", "--worker", "fake", "--wait", "echo hi\necho note >&2")
    assert proc.stdout == "hi\n"                       # output only: scripts pipe it on
    lines = proc.stderr.strip().splitlines()
    task_id = ID_RE.match(lines[0])[0]                 # the id before anything else
    assert re.fullmatch(rf"{task_id} \w+: following it", lines[0]), lines[0]   # no Ctrl-C hint
    assert "> echo hi" in lines and "> echo note >&2" in lines and "note" in lines, lines
    assert lines[-1] == f"{task_id} done"
    assert "\x1b" not in proc.stderr                   # piped: no spinner, no colours
    assert gurtd.task(task_id)["state"] == "done"


def test_run_wait_says_at_once_which_approval_it_waits_for_and_how_to_answer(
        gurtd: Gurtd) -> None:
    gurtd.api("PUT", "/api/wallet", {"balanceCents": 100})
    proc = started(gurtd, "run", "--worker", "fake", "--wait", "--tool", "ask", "--tool",
                   "wallet.pay", "--budget", "1",
                   "gurtd tool ask '{\"question\": \"Ship it?\"}'\n"
                   "gurtd tool wallet.pay '{\"to\": \"shop\", \"cents\": 30}'")
    try:
        said = read_until(proc.stderr, r"gurtd answer (a\w+) 'TEXT'")
        assert "the task asks: Ship it?" in said, said
        ask = re.search(r"gurtd answer (\S+) 'TEXT'", said)[1]
        assert gurtd.cli("answer", ask, "yes").returncode == 0
        said = read_until(proc.stderr, r"gurtd approve \S+ ")
        assert re.search(r"waiting for approval \S+: wallet.pay .*30 cents", said), said
        ap = re.search(r"gurtd approve (\S+) ", said)[1]
        # approve on an ask says how to answer it; on this spending it pays
        wrong = gurtd.cli("approve", ask)
        assert_said_for_people(wrong)
        assert gurtd.cli("approve", ap).returncode == 0
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert json.loads(out.splitlines()[0]) == {"answer": "yes"}
        assert err.strip().splitlines()[-1].endswith("done (30 cents)"), err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_on_a_pipe_leaves_the_task_running_and_says_how_to_stop_it(gurtd: Gurtd) -> None:
    proc = started(gurtd, "run", "--worker", "fake", "--wait", "sleep 60")
    first = read_until(proc.stderr, r"following it.*\n")
    task_id = ID_RE.match(first)[0]
    assert "Ctrl-C" not in first, first        # on a pipe Ctrl-C offers no choice: no hint
    wait_for_step(gurtd, task_id, "sleep 60")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert f"gurtd stop {task_id}" in err and f"gurtd log -f {task_id}" in err, err
    assert "Traceback" not in err
    assert gurtd.task(task_id)["state"] == "running"
    gurtd.api("POST", f"/api/tasks/{task_id}/stop")
    gurtd.wait(task_id)


def test_on_a_terminal_a_spinner_turns_and_ctrl_c_asks_before_stopping(gurtd: Gurtd) -> None:
    term = Terminal([sys.executable, GURTD, "run", "--worker", "fake", "--wait", "sleep 60"],
                    gurtd.cli_env())
    try:
        first = term.expect(rb"(t[a-z0-9]{9}) \w+: following it.*\n")
        task_id = re.search(rb"(t[a-z0-9]{9}) \w+: following it", first)[1].decode()
        assert b"following it (Ctrl-C: stop it, or leave it running)" in first, first
        seen = term.expect(rb"running: sleep 60")
        assert any(frame.encode() + b" running" in seen for frame in "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏")
        assert b"\r\x1b[K" in seen                      # one line, rewritten in place
        term.type(b"\x03")                              # Ctrl-C, as the terminal sends it
        term.expect(rb"Stop task t[a-z0-9]{9}\? \[y/N\]")
        assert gurtd.task(task_id)["state"] == "running"    # nothing happens before the answer
        term.type(b"y\r")
        term.expect(rb"stopped")
        assert term.close() == 130
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    task = gurtd.wait(task_id)
    assert task["state"] == "failed" and task["error"] == "stopped"


# tables and colours ##########################################################################

def test_tables_say_when_cost_and_why_with_colours_only_on_a_terminal(gurtd: Gurtd) -> None:
    bad = gurtd.run("echo oops >&2; exit 3")
    good = gurtd.run("true")
    piped = gurtd.cli_ok("tasks")
    header, *rows = piped.stdout.splitlines()
    assert header.split() == ["ID", "STATE", "WORKER", "WORKSPACE", "SOURCE", "CREATED", "COST",
                              "TITLE", "ERROR"]
    assert rows[0].startswith(good["id"]) and rows[1].startswith(bad["id"])
    assert re.search(r"(just now|\d+ s ago)\s+0\s+test task\s+worker exited with 3", rows[1]), \
        rows[1]
    assert "\x1b" not in piped.stdout

    for no_color in ("", "1"):
        env = gurtd.cli_env()
        if no_color:
            env["NO_COLOR"] = no_color
        term = Terminal([sys.executable, GURTD, "tasks"], env)
        out = term.expect(bad["id"].encode() + rb".*\n.*\n?", 30)
        term.close()
        out = term.seen
        if no_color:
            assert b"\x1b[" not in out, out
        else:
            assert re.search(rb"\x1b\[31m(\x1b\[\d+m)*failed\x1b\[0m", out), out
            assert re.search(rb"\x1b\[32m(\x1b\[\d+m)*done\x1b\[0m", out), out


# errors that say what to do ##################################################################

def test_errors_say_what_to_do_never_json_or_status_numbers(gurtd: Gurtd) -> None:
    assert_said_for_people(gurtd.cli("log", "nope"), "gurtd tasks")
    assert_said_for_people(gurtd.cli("log", "-f", "nope"), "gurtd tasks")
    assert_said_for_people(gurtd.cli("show", "t000000000"), "gurtd tasks")
    assert_said_for_people(gurtd.cli("approve", "ap-nope"), "gurtd approvals")
    assert_said_for_people(gurtd.cli("files", "nope"), "gurtd workspaces")
    empty = gurtd.cli("run", "--worker", "fake", stdin="  \n")
    assert_said_for_people(empty, "prompt is empty")
    assert gurtd.api("GET", "/api/tasks") == []                 # and nothing was created
    away = subprocess.run([sys.executable, GURTD, "tasks"], capture_output=True, text=True,
                          env={**gurtd.cli_env(), "GURT_LISTEN": "127.0.0.1:1"}, timeout=60)
    assert_said_for_people(away, "cannot reach gurtd", "systemctl start gurtd")
    wrong = subprocess.run([sys.executable, GURTD, "tasks"], capture_output=True, text=True,
                           env={**gurtd.cli_env(), "GURT_TOKEN": "x" * 40}, timeout=60)
    assert_said_for_people(wrong, "gurtd token")
    unset = gurtd.cli("settings", "noSuchSetting")
    assert_said_for_people(unset, "maxRunningTasks")


def test_actions_answer_in_one_line_and_refusals_say_what_to_do(gurtd: Gurtd) -> None:
    assert_said_for_people(gurtd.cli("undo", "nope"), "gurtd tasks")
    assert_said_for_people(gurtd.cli("keep", "nope"), "gurtd tasks")
    done = gurtd.run("echo hi > a.txt")
    not_personal = gurtd.cli("keep", done["id"])
    assert_said_for_people(not_personal)
    sleeper = gurtd.create("sleep 60")
    wait_for_step(gurtd, sleeper["id"], "sleep 60")
    assert gurtd.cli("stop", sleeper["id"]).stdout == f"{sleeper['id']} failed: stopped\n"
    assert gurtd.cli("undo", done["id"]).stdout == f"{done['id']} undone\n"
    asker = gurtd.create("gurtd tool ask '{\"question\": \"Red?\"}'", tools=["ask"])
    ask = gurtd.pending(asker["id"])
    approve = gurtd.cli("approve", ask["id"])
    assert_said_for_people(approve, f"gurtd answer {ask['id']} 'TEXT'")
    assert "/api/" not in approve.stderr, approve.stderr
    gurtd.api("POST", f"/api/tasks/{asker['id']}/stop")


def test_show_says_values_for_people_and_empty_lists_say_so(gurtd: Gurtd) -> None:
    for args, said in ((("tasks",), "no tasks yet"), (("approvals",), "no pending approvals"),
                       (("hooks",), "no hooks"), (("schedules",), "no schedules"),
                       (("policies",), "no policies"), (("review",), "nothing to review")):
        proc = gurtd.cli(*args)
        assert proc.returncode == 0 and proc.stdout == "" and said in proc.stderr, proc
    task = gurtd.run("true", budgetCents=6, limits={"processes": 64, "memoryBytes": 1 << 28})
    shown = gurtd.cli("show", task["id"]).stdout
    assert "{" not in shown and "False" not in shown and "6.0" not in shown, shown
    assert re.search(r"^budgetCents:\s+6 cents$", shown, re.M), shown
    assert re.search(r"^limits:\s+processes 64, memoryBytes 256 MiB, ", shown, re.M), shown
    assert re.search(r"^askHosts:\s+no$", shown, re.M), shown
    assert re.search(r"^createdAt:\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \((just now|\d+ s ago)\)$",
                     shown, re.M), shown
    assert len({line.index(line.split(":", 1)[1].strip()) for line in shown.splitlines()
                if ":" in line and line.split(":", 1)[1].strip()}) == 1, shown   # aligned


def test_help_is_grouped_and_task_ids_complete(gurtd: Gurtd) -> None:
    helped = gurtd.cli("--help").stdout
    heads = [h for h in ("Tasks:", "Decisions:", "Files:", "Sources:", "The box:",
                         "Inside a task:") if h in helped]
    assert len(heads) == 6 and sorted(heads, key=helped.index) == heads, helped
    assert helped.index("  mcp") > helped.index("Inside a task:") > helped.index("  run"), helped
    task = gurtd.run("true", title="to complete")
    done = gurtd.cli(_GURTD_COMPLETE="bash_complete", COMP_WORDS=f"gurtd show {task['id'][:3]}",
                     COMP_CWORD="2")
    assert f"plain,{task['id']}" in done.stdout, done


def test_status_as_a_user_who_cannot_read_the_token_says_why(gurtd: Gurtd) -> None:
    env = {k: v for k, v in gurtd.cli_env().items() if k != "GURT_TOKEN"}
    proc = subprocess.run([sys.executable, GURTD, "status"], capture_output=True, text=True,
                          env=env, cwd="/", user=65534, group=65534, timeout=60)
    assert proc.returncode == 0, proc
    assert re.search(r"^gurtd \S+ at 127\.0\.0\.1:\d+: up$", proc.stdout, re.M), proc.stdout
    assert "cannot read gurtd's token" in proc.stdout and "as root" in proc.stdout, proc.stdout


def test_a_first_droid_run_without_a_model_says_how_to_set_one_up(gurtd: Gurtd) -> None:
    proc = gurtd.cli("run", "say hello")
    assert_said_for_people(proc, "gurtd secret model", "--worker fake")
    assert gurtd.api("GET", "/api/tasks") == []
    term = Terminal([sys.executable, GURTD, "mcp"], gurtd.cli_env())
    term.expect(rb"not inside a task.*gurtd run\s+--worker\s+fake")
    assert term.close() == 1


def test_events_are_stamped_with_their_own_time(gurtd: Gurtd) -> None:
    task = gurtd.run("true")
    time.sleep(1.5)                       # arrival would be another second
    events = started(gurtd, "events", "--since", "0")
    try:
        said = read_until(events.stdout, rf"task {task['id']} done")
    finally:
        events.send_signal(signal.SIGINT)
        events.communicate(timeout=30)
    stamp = datetime.datetime.fromisoformat(task["updatedAt"].replace("Z", "+00:00"))
    assert re.search(rf"^{stamp.astimezone():%H:%M:%S}  task {task['id']} done", said, re.M), said


# new commands ################################################################################

def test_status_workspaces_files_settings_and_the_wallet(gurtd: Gurtd) -> None:
    wallet = gurtd.cli("wallet", "--set", "100")
    assert wallet.returncode == 0 and wallet.stdout.splitlines()[0] == "balance: 100 cents", \
        wallet.stdout
    assert "set to 100\n" in wallet.stdout
    assert gurtd.cli("wallet", "--set", "2.5").stdout.splitlines()[0] == "balance: 2.5 cents"

    made = gurtd.run("mkdir -p src && printf 'one\\ntwo\\n' > src/notes.txt")
    sleeper = gurtd.create("sleep 60")
    wait_for_step(gurtd, sleeper["id"], "sleep 60")
    status = gurtd.cli_ok("status")
    assert re.search(r"^gurtd \S+ at 127\.0\.0\.1:\d+: up$", status.stdout, re.M), status.stdout
    assert "1 running, 0 waiting, 0 queued" in status.stdout
    assert "wallet:     2.5 cents" in status.stdout and "0 pending" in status.stdout
    as_json = json.loads(gurtd.cli("status", "--json").stdout)
    assert as_json["tasks"] == {"queued": 0, "running": 1, "waiting": 0}
    gurtd.api("POST", f"/api/tasks/{sleeper['id']}/stop")

    spaces = gurtd.cli("workspaces")
    assert spaces.stdout.split() == ["NAME", "LAYERS", "home", "1"], spaces.stdout
    top = gurtd.cli("files", "home")
    assert re.search(r"^directory\s+-\s+src/$", top.stdout, re.M), top.stdout
    inner = gurtd.cli("files", "home", "src")
    assert re.search(r"^file\s+8\s+notes.txt$", inner.stdout, re.M), inner.stdout
    assert gurtd.cli("files", "home", "src/notes.txt").stdout == "one\ntwo\n"
    assert made["state"] == "done"
    # a file a task wrote reaches a terminal with its escape sequences escaped
    assert gurtd.run(r"printf 'a\033[2Jb\n' > src/evil.txt")["state"] == "done"
    assert gurtd.cli("files", "home", "src/evil.txt").stdout == "a\x1b[2Jb\n"   # piped: as is
    term = Terminal([sys.executable, GURTD, "files", "home", "src/evil.txt"], gurtd.cli_env())
    term.expect(rb"a\\x1b\[2Jb")
    assert term.close() == 0 and b"\x1b[2J" not in term.seen, term.seen

    assert re.search(r"^maxRunningTasks: 8$", gurtd.cli("settings").stdout, re.M)
    assert gurtd.cli("settings", "maxRunningTasks").stdout == "8\n"
    changed = gurtd.cli("settings", "maxRunningTasks", "3")
    assert changed.returncode == 0 and changed.stdout == "3\n", changed
    assert gurtd.api("GET", "/api/settings")["maxRunningTasks"] == 3
    refused = gurtd.cli("settings", "maxRunningTasks", "lots")
    assert_said_for_people(refused, "maxRunningTasks")
    assert gurtd.api("GET", "/api/settings")["maxRunningTasks"] == 3


def test_approve_all_and_events_follow_what_happens(gurtd: Gurtd) -> None:
    gurtd.api("PUT", "/api/wallet", {"balanceCents": 100})
    events = started(gurtd, "events")
    try:
        read_until(events.stderr, "following gurtd's events")
        payer = gurtd.create("gurtd tool wallet.pay '{\"to\": \"a\", \"cents\": 5}'",
                             tools=["wallet.pay"], budgetCents=1)
        asker = gurtd.create("gurtd tool ask '{\"question\": \"Red or blue?\"}'", tools=["ask"])
        eventually(lambda: len(gurtd.api("GET", "/api/approvals?state=pending")) == 2, 30,
                   "two pending approvals")
        done = gurtd.cli_ok("approve-all")
        assert done.stdout.splitlines()[0] == "approved 1"
        assert re.search(r"asks: Red or blue\?\s+\(gurtd answer a\S* 'TEXT'\)", done.stdout), \
            done.stdout
        assert gurtd.wait(payer["id"])["state"] == "done"
        said = read_until(events.stdout, rf"task {payer['id']} done")
        assert re.search(rf"approval \S+ pending\s+budget of task {payer['id']}: wallet.pay 5 "
                         "cents", said), said
        assert re.search(r"approval \S+ approved", said), said
        assert re.search(rf"^\d\d:\d\d:\d\d  task {asker['id']} waiting", said, re.M), said
        gurtd.api("POST", f"/api/tasks/{asker['id']}/stop")
    finally:
        events.send_signal(signal.SIGINT)
        events.communicate(timeout=30)
    assert events.returncode == 130


# gurtd serve's own log #######################################################################

def test_serve_logs_times_on_a_terminal_and_priorities_to_journald() -> None:
    home = make_home()
    env = {k: v for k, v in os.environ.items() if k not in ("BOX_HOME", "GURT_TOKEN")}
    env["GURT_DNS_UPSTREAM"] = "127.0.0.1:9"
    term = Terminal([sys.executable, GURTD, "serve", "--box-home", home, "--listen",
                     "127.0.0.1:0"], env)
    try:
        out = term.expect(rb"listening on http://127\.0\.0\.1:\d+")
        line = re.search(rb"^.*listening on.*$", out, re.M)[0]
        assert re.match(rb"\d\d:\d\d:\d\d gurtd \S+ listening", line), line
        assert b"<6>" not in out
        os.kill(term.proc.pid, signal.SIGTERM)
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        remove_home(home)
    # piped (journald): <N> prefixes, and an uncaught exception of any thread is an error
    script = ("import threading, gurtd\ngurtd.log(6, 'hello')\ngurtd.log_uncaught_everywhere()\n"
              "def boom():\n    raise RuntimeError('boom')\n"
              "t = threading.Thread(target=boom, name='worker-x'); t.start(); t.join()\n"
              "raise ValueError('main')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.stderr.startswith("<6>hello\n"), proc.stderr
    assert "<3>uncaught RuntimeError in the worker-x thread: boom" in proc.stderr, proc.stderr
    assert "<3>uncaught ValueError in the main thread: main" in proc.stderr, proc.stderr
    assert proc.returncode == 1
