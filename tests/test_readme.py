"""Every fenced shell example of README.md, read from the README and run as written against a
live gurtd: as root, with `gurtd` on the PATH as `make link` writes it (pointing at this tree),
BOX_HOME a test folder.  Two things are put in as a reader's machine would have them: the
test gurtd's address for 127.0.0.1:7700 and its BOX_HOME for /var/lib/gurt; TOKEN, ID (a done
task) and AP (a pending approval) as the README says its examples assume.  Examples that need
what a test machine has not got are skipped by name below, each with its reason, never
silently; the summary line says how many ran of all."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any, Iterator

import pytest

from conftest import ROOT, Gurtd, eventually

README = os.path.join(ROOT, "README.md")
SHARED_GURTD = True

# name -> why it does not run here
SKIPPED = {
    "Set up #1": "make run and make test set up this machine and start gurtd on 7700 or run "
                 "this suite itself; the test is the live gurtd they start",
    "Jira #1": "needs a Jira site (acme.atlassian.net) and the network",
    "A real droid run, by hand #1": "needs an Anthropic model key and the network",
}
# run as a fake task's prompt, each line in the task, asks answered and spending approved
INSIDE = {"Tools, the wallet and approvals #1"}
# a stream that stays open by design: run until this many seconds, then ended
STREAMS = {"The wallet, the tool list and events #1": 3.0,
           "The wallet, the tool list and events #2": 3.0}
SHELLS = {"sh": "bash", "zsh": "zsh", "fish": "fish"}


def examples() -> list[tuple[str, str, str]]:
    """(name, shell, code) of every fenced sh, zsh or fish block: the name is the heading
    above it and its number under that heading (```text blocks are usage, not examples)."""
    out: list[tuple[str, str, str]] = []
    heading, fence, body, count = "", None, [], {}   # type: ignore[var-annotated]
    for line in open(README).read().split("\n"):
        if fence is None and (m := re.match(r"#{1,5} (.+)", line)):
            heading = m[1].strip()
        elif fence is None and (m := re.match(r"```(\w*)$", line)):
            fence, body = m[1], []
        elif fence is not None and line == "```":
            if fence in SHELLS:
                count[heading] = count.get(heading, 0) + 1
                out.append((f"{heading} #{count[heading]}", fence, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
    return out


EXAMPLES = examples()
RESULTS: dict[str, str] = {}
SESSION: dict[str, str] = {}      # ID and AP as the reader's shell has them, by section
TRAILER = '\nprintf "\\n__vars %s %s\\n" "${ID:--}" "${AP:--}"'


@pytest.fixture(scope="module")
def reader(module_gurtd: Gurtd) -> Iterator[dict[str, Any]]:
    """The reader's machine: `gurtd` on the PATH from `make link`, a scratch folder to work in
    (with the checkout's .venv, as in a checkout)."""
    g = module_gurtd
    scratch = tempfile.mkdtemp(prefix="gurt-readme-", dir="/var/tmp")
    try:
        subprocess.run(["make", "-s", "-C", ROOT, "link", f"PREFIX={scratch}"], check=True)
        os.symlink(os.path.join(ROOT, ".venv"), os.path.join(scratch, ".venv"))
        g.api("PUT", "/api/wallet", {"balanceCents": 1000})
        yield {"g": g, "cwd": scratch, "env": {
               **os.environ, "PATH": f"{scratch}/bin:{os.environ['PATH']}",
               "BOX_HOME": g.home, "GURT_LISTEN": f"127.0.0.1:{g.port}", "TOKEN": g.token}}
    finally:
        for task in g.api("GET", "/api/tasks?limit=1000"):
            if task["state"] in ("queued", "running", "waiting"):
                g.api("POST", f"/api/tasks/{task['id']}/stop")
        shutil.rmtree(scratch, ignore_errors=True)
        ran = sum(r == "ran" for r in RESULTS.values())
        print(f"\nREADME examples run as written: {ran}/{len(EXAMPLES)}; skipped by name: " +
              "; ".join(f"{n} ({r})" for n, r in RESULTS.items() if r != "ran"))


def as_written(code: str, g: Gurtd) -> str:
    return code.replace("127.0.0.1:7700", f"127.0.0.1:{g.port}").replace("/var/lib/gurt",
                                                                           g.home)


def a_done_task(g: Gurtd) -> str:
    task = g.run_done("echo hello > hello.txt\nmkdir -p src && echo 'print(1)' > src/main.py")
    return task["id"]


def a_pending_approval(g: Gurtd) -> str:
    task = g.create("gurtd tool wallet.pay '{\"to\": \"alice\", \"cents\": 5}'",
                    tools=["wallet.pay"], budgetCents=1)
    return g.pending(task["id"])["id"]


def inside_a_task(g: Gurtd, code: str) -> subprocess.CompletedProcess[str]:
    """The block as a fake task's prompt; its asks answered, its spending approved."""
    task = g.create(code, tools=["wallet.pay", "ask"])

    def answered() -> bool:
        for ap in g.approvals(state="pending", task=task["id"]):
            g.api("POST", f"/api/approvals/{ap['id']}/" + ("answer" if ap["kind"] == "ask"
                                                          else "approve"),
                  {"answer": "yes"} if ap["kind"] == "ask" else {})
        return g.task(task["id"])["state"] in ("done", "failed")
    eventually(answered, 60, "the task's end")
    done = g.task(task["id"])
    return subprocess.CompletedProcess([], 0 if done["state"] == "done" else 1,
                                       "\n".join(g.output(task["id"])), str(done.get("error")))


@pytest.mark.parametrize("name,shell,code", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_the_readme_example_runs_as_written(reader: dict[str, Any], name: str, shell: str,
                                            code: str, request: pytest.FixtureRequest) -> None:
    g = reader["g"]
    if name in SKIPPED:
        RESULTS[name] = SKIPPED[name]
        pytest.skip(SKIPPED[name])
    if not shutil.which(SHELLS[shell]):
        RESULTS[name] = f"{shell} is not installed"
        assert not os.environ.get("CI"), f"{RESULTS[name]} (make test-deps installs it)"
        pytest.skip(RESULTS[name])
    code = as_written(code, g)
    env = dict(reader["env"])
    section = name.rsplit(" #", 1)[0]
    for var, make in (("ID", a_done_task), ("AP", a_pending_approval)):
        if f"${var}" in code and f"{var}=" not in code:   # an earlier block's, else a new one
            env[var] = SESSION.get(f"{section} {var}") or make(g)
    if "~/notes" in code or section == "Personal mode":   # a person's ~/notes/todo.md
        person = request.getfixturevalue("owner")
        env["HOME"] = reader["notes"] = person.pw_dir
        notes = pathlib.Path(person.pw_dir, "notes")      # the person is the module's
        notes.mkdir(exist_ok=True)
        (notes / "todo.md").write_text("buy milk\n")
        for path in (notes, notes / "todo.md"):
            shutil.chown(path, person.pw_name, person.pw_gid)
        time.sleep(0.05)                      # its ctimes are before the task's start
        if section == "Personal mode":        # $ID: a personal task on it, done
            env["ID"] = g.run("echo done >> todo.md", folder=str(notes))["id"]
    if name in INSIDE:
        proc = inside_a_task(g, code)
    else:
        argv = [SHELLS[shell], "-c", code] if shell == "fish" else \
            [SHELLS[shell], "-e", "-o", "pipefail", "-c", code + TRAILER]
        try:
            proc = subprocess.run(argv, cwd=reader["cwd"], env=env, capture_output=True,
                                  text=True, timeout=STREAMS.get(name, 120))
        except subprocess.TimeoutExpired as exc:
            assert name in STREAMS, f"{name} did not end: {exc.stdout!r}"
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            assert "gurtd events" in out or "event:" in out, out   # the stream was open
            proc = subprocess.CompletedProcess(argv, 0, out, "")
    assert proc.returncode == 0, f"{name}:\n{code}\n--- stdout\n{proc.stdout}\n--- " \
                                 f"stderr\n{proc.stderr}"
    assert "command not found" not in proc.stderr, proc.stderr
    if m := re.search(r"^__vars (\S+) (\S+)$", proc.stdout, re.M):
        SESSION.update({f"{section} {var}": value for var, value in zip(("ID", "AP"), m.groups())
                        if value != "-"})
    check_effects(name, reader, proc)
    RESULTS[name] = "ran"


def check_effects(name: str, reader: dict[str, Any], proc: subprocess.CompletedProcess[str]
                  ) -> None:
    """What the tour says happens, happened."""
    if name == "A five-minute tour #2":
        assert "+hello" in proc.stdout and "hello" in proc.stdout.split("+hello")[1], proc.stdout
        assert re.search(r"^state:\s+done$", proc.stdout, re.M), proc.stdout
    elif name == "A five-minute tour #3":
        assert re.search(r"^t\w+ undone$", proc.stdout, re.M) and "hello.txt" not in \
            proc.stdout.split("undone", 1)[1], proc.stdout
    elif name == "A five-minute tour #4":
        assert '{"answer": "yes, ship"}' in proc.stdout, proc.stdout
    elif name == "A five-minute tour #5":
        assert "+done" in proc.stdout and re.search(r"^t\w+ kept$", proc.stdout, re.M)
        assert pathlib.Path(reader["notes"], "notes", "todo.md").read_text() == \
            "buy milk\ndone\n"
    elif name == "Personal mode #1":        # kept, then undone: as before the task
        assert "+done" in proc.stdout and '"review": "kept"' in proc.stdout, proc.stdout
        assert pathlib.Path(reader["notes"], "notes", "todo.md").read_text() == "buy milk\n"
    elif name == "MCP from the host #1":
        assert '"name": "ask"' in proc.stdout and '"inputSchema"' in proc.stdout, proc.stdout


# README claims checked one by one ##############################################################
# Lines of the README that are not examples, tried against the module's gurtd.

def test_a_payment_refused_for_a_short_balance_is_in_the_tasks_log(module_gurtd: Gurtd) -> None:
    """Tools, the wallet and approvals: "every call, with its arguments, result, cost and
    caller, is in the task's log", a refused one too (here: the balance is short, 409)."""
    g = module_gurtd
    task = g.run_done("gurtd tool wallet.pay '{\"to\": \"bob\", \"cents\": 100000000}' || true",
                      tools=["wallet.pay"], budgetCents=100000000)
    calls = [e for e in g.log(task["id"]) if e["type"] == "tool"]
    assert len(calls) == 1, g.log(task["id"])
    assert calls[0]["tool"] == "wallet.pay" and calls[0]["args"]["cents"] == 100000000
    assert calls[0]["error"].startswith("insufficient balance"), calls[0]
    assert isinstance(calls[0]["caller"], int) and calls[0]["call"].startswith("c"), calls[0]
