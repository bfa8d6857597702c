"""gurtd never loses its footing or its data, told as an operator's and an attacker's stories.

A full disk (BOX_HOME on a small loop-mounted ext4 image the test makes and removes), kill -9
at chosen points (GURT_TEST_CRASH_AT, a test-only hook), a second gurtd on the same BOX_HOME,
a port in use, temp files of a crashed run, and an event handler that raises.  Real users,
mounts and nftables; every test cleans up what it made.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import gurtd as G
from conftest import (GURTD, ROOT, Gurtd, clean_env, eventually, gurtd_on_small_disk, make_home,
                      leftovers, nft_table, passwd_names, pay_line, remove_home, running_gurtd,
                      small_disk_made)


# helpers #####################################################################################

def nft_tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          check=True).stdout


def task_file(g: Gurtd, task_id: str) -> dict[str, Any] | None:
    try:
        return json.loads(Path(g.home, "tasks", task_id + ".json").read_text())
    except FileNotFoundError:
        return None


def wait_exit(g: Gurtd, timeout: float = 30.0) -> int:
    """gurtd died on its own (a crash point): its exit code, and g forgets the process."""
    assert g.proc is not None
    code = g.proc.wait(timeout=timeout)
    g.proc = None
    return code


def lock_holders(path: str) -> list[int]:
    """The pids with an open fd on path."""
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    holders.append(int(pid))
                    break
            except OSError:
                continue
    return sorted(holders)


def serve_env() -> dict[str, str]:
    return clean_env(GURT_DNS_UPSTREAM="127.0.0.1:9")      # the tests' nameserver: nothing


def serve_argv(home: str, listen: str) -> list[str]:
    return [sys.executable, GURTD, "serve", "--box-home", home, "--listen", listen]


# 1. a full disk ##############################################################################

def test_a_create_that_cannot_be_saved_answers_507_and_leaves_nothing() -> None:
    """The disk is nearly full and someone sends a 300 KB prompt: the answer is 507 with a
    clear error, and no task file, no log, no queued task is left anywhere.  Once there is
    room again, tasks run as before."""
    with gurtd_on_small_disk() as (g, disk):
        before = sorted(os.listdir(os.path.join(g.home, "tasks")))
        disk.fill(leave=64 * 1024)
        prompt = "echo never\n#" + "x" * 300_000
        code, body, _ = g.request("POST", "/api/tasks",
                                  {"title": "big", "prompt": prompt, "worker": "fake"})
        assert code == 507, (code, body)
        assert body == {"error": "cannot save the task: No space left on device",
                        "code": "insufficient_storage"}
        assert sorted(os.listdir(os.path.join(g.home, "tasks"))) == before   # no temp either
        assert os.listdir(os.path.join(g.home, "logs")) == []
        assert g.api("GET", "/api/tasks") == []
        disk.free()
        time.sleep(1.0)    # long enough for a queued ghost to start, were there one
        done = g.run_done("echo room again")
        assert [t["id"] for t in g.api("GET", "/api/tasks")] == [done["id"]]
        assert g.stop() == 0


FULL_DISK_ERRORS = ("cannot save the task: No space left on device",
                    "disk full: cannot save the approval: No space left on device")


def test_a_task_whose_log_cannot_be_written_fails_and_gurtd_keeps_serving() -> None:
    """A task writes output while the disk fills up: that task fails with the reason, its
    processes and user go, gurtd keeps answering, and once space is freed a new task runs
    and the failed state reaches the disk."""
    with gurtd_on_small_disk() as (g, disk):
        task = g.create("echo ready\nwhile true; do echo tick tick tick; sleep 0.05; done")
        eventually(lambda: "ready" in g.output(task["id"]), what="the task's first line")
        disk.fill()
        failed = g.wait(task["id"], timeout=60)
        assert failed["state"] == "failed", failed
        # Its own log line fails first, or the disk reserve pauses it and its `disk` approval
        # cannot be saved: either way the task fails and says why.
        assert failed["error"] in FULL_DISK_ERRORS, failed
        assert g.api("GET", "/api/health") is not None
        eventually(lambda: task["user"] not in passwd_names(), what="the user to go")
        assert g.worker_pids(failed) == []
        disk.free()
        g.run_done("echo fine")
        on_disk = eventually(lambda: (task_file(g, task["id"]) or {}).get("state") == "failed"
                             and task_file(g, task["id"]), what="the failed state on disk")
        assert on_disk["error"] == failed["error"]
        assert g.stop() == 0


def test_kill_9_then_a_start_on_a_full_disk_works_and_says_what_it_could_not_do() -> None:
    """gurtd is killed (-9) with a task running, and the disk is full when it comes back.
    It starts all the same: the task is failed with an error that says why, its user and
    processes are gone, the log says what could not be saved; SIGTERM, still on a full disk,
    leaves no user, nftables table or broker socket behind."""
    with gurtd_on_small_disk() as (g, disk):
        task = g.create("sleep 60", hosts=["example.com"])
        g.wait(task["id"], ("running",))
        pids = eventually(lambda: g.worker_pids(task), what="the task's processes")
        uid = G.task_users()[task["user"]]
        g.stop(signal.SIGKILL)
        disk.fill()
        offset = len(g.log_text())
        g.start()
        text = g.log_text()[offset:]
        failed = g.task(task["id"])
        assert failed["state"] == "failed"
        assert failed["error"] == "gurtd restarted while the task was running"
        assert f"reconcile: could not save task {task['id']}" in text, text
        assert task["user"] not in passwd_names()
        assert not set(pids) & set(G.processes_by_uid({uid}).get(uid, []))
        assert nft_table(g.home) in nft_tables()
        sock = os.path.join(g.home, "run", "broker.sock")
        assert os.path.exists(sock)

        # still full: nothing can be created
        g.api("POST", "/api/tasks", {"title": "t", "prompt": "sleep 60", "worker": "fake"},
              status=507)
        disk.free()
        running = g.create("sleep 60")
        g.wait(running["id"], ("running",))
        disk.fill()
        assert g.stop() == 0                    # SIGTERM on a full disk
        assert running["user"] not in passwd_names()
        assert nft_table(g.home) not in nft_tables()
        assert not os.path.exists(sock)
        disk.free()


# 2. crashes ##################################################################################

def test_a_payment_is_never_missing_from_its_task_log_after_kill_9() -> None:
    """gurtd dies (kill -9, a test hook) right after a payment's ledger line is synced and
    before the task's log line.  The next start writes the missing line from the ledger,
    with the same call id, and counts the cost in the task."""
    with running_gurtd({"GURT_TEST_CRASH_AT": "after-ledger"}) as g:
        g.api("PUT", "/api/wallet", {"balanceCents": 1000})
        task = g.create(pay_line("erin", 25) + "\necho paid", tools=["wallet.pay"],
                        budgetCents=100)
        assert wait_exit(g) == 137
        g.env = {}
        g.start()
        ledger = [e for e in g.api("GET", "/api/wallet")["ledger"] if e.get("task")]
        assert len(ledger) == 1 and ledger[0]["task"] == task["id"], ledger
        call = ledger[0]["call"]
        assert call.startswith("c") and len(call) == 10
        lines = [e for e in g.log(task["id"]) if e.get("call") == call]
        assert len(lines) == 1, lines
        assert lines[0]["text"] == "recovered from the ledger"
        assert lines[0]["cents"] == 25 and lines[0]["args"]["to"] == "erin"
        after = g.task(task["id"])
        assert after["costCents"] == 25
        assert after["state"] == "failed"
        assert g.api("GET", "/api/wallet")["balanceCents"] == 975
        # a second start finds nothing to recover: the line is not written twice
        g.restart()
        assert len([e for e in g.log(task["id"]) if e.get("call") == call]) == 1
        assert g.task(task["id"])["costCents"] == 25
        # and a payment without a crash carries its call id in both places
        paid = g.run_done(pay_line("frank", 5), tools=["wallet.pay"], budgetCents=100)
        entry = [e for e in g.api("GET", "/api/wallet")["ledger"]
                 if e.get("task") == paid["id"]][0]
        assert [e["call"] for e in g.log(paid["id"]) if e["type"] == "tool"] == [entry["call"]]
        # so does one paid after a person approved it
        asked = g.create(pay_line("hank", 50), tools=["wallet.pay"], budgetCents=10)
        pending = eventually(lambda: g.api("GET", "/api/approvals?state=pending&task=" +
                                           asked["id"]), what="the budget approval")
        g.api("POST", f"/api/approvals/{pending[0]['id']}/approve", {"reason": "ok"})
        assert g.wait(asked["id"])["state"] == "done"
        entry = [e for e in g.api("GET", "/api/wallet")["ledger"]
                 if e.get("task") == asked["id"]][0]
        assert [e["call"] for e in g.log(asked["id"]) if e["type"] == "tool"] == [entry["call"]]
        assert g.stop() == 0


def test_every_payment_is_in_its_task_cost_after_kill_9() -> None:
    """A task's later payments are held by the ledger alone until the task's next save:
    after kill -9 the next start adds them to costCents, each once, and logs none twice.
    Its first payment is saved in its costCents before its log line: gurtd dying right
    after that line loses nothing and writes nothing twice."""
    with running_gurtd() as g:
        g.api("PUT", "/api/wallet", {"balanceCents": 1000})
        task = g.create("\n".join([pay_line("jo", 10), pay_line("jo", 5), pay_line("jo", 2),
                                    "sleep 60"]), tools=["wallet.pay"], budgetCents=100)
        eventually(lambda: len([e for e in g.log(task["id"]) if e["type"] == "tool"]) == 3,
                   what="three payments in the log")
        assert g.task(task["id"])["costCents"] == 17
        g.restart(kill=True)
        assert g.task(task["id"])["costCents"] == 17
        lines = [e for e in g.log(task["id"]) if e["type"] == "tool"]
        assert [e["cents"] for e in lines] == [10, 5, 2], lines
        assert not any("recovered" in e for e in lines), lines
        g.env = {"GURT_TEST_CRASH_AT": "after-payment-log"}
        g.restart()                             # nothing more to add the second time
        assert g.task(task["id"])["costCents"] == 17
        first = g.create(pay_line("ida", 25) + "\necho paid", tools=["wallet.pay"],
                         budgetCents=100)
        assert wait_exit(g) == 137
        g.env = {}
        g.start()
        assert g.task(first["id"])["costCents"] == 25
        lines = [e for e in g.log(first["id"]) if e["type"] == "tool"]
        assert len(lines) == 1 and "recovered" not in lines[0], lines
        assert g.api("GET", "/api/wallet")["balanceCents"] == 958
        assert g.stop() == 0


def test_a_task_reported_done_stays_done_across_kill_9() -> None:
    """A task is done; gurtd is killed (-9) right after the done state reaches the disk and
    before it is logged.  After the restart the task is still done, and a task seen done
    through the API stays done across another kill -9."""
    with running_gurtd({"GURT_TEST_CRASH_AT": "after-saving-done"}) as g:
        task = g.create("echo kept > kept.txt\necho kept")
        assert wait_exit(g) == 137
        g.env = {}
        g.start()
        after = g.task(task["id"])
        assert after["state"] == "done", after
        assert "error" not in after
        assert g.file("home", "kept.txt") == b"kept\n"

        seen = g.run_done("echo second")
        g.restart(kill=True)
        again = g.task(seen["id"])
        assert again["state"] == "done" and again["updatedAt"] == seen["updatedAt"]
        assert g.states(seen["id"]) == ["queued", "running", "done"]
        assert g.stop() == 0


def test_users_made_for_a_start_that_a_kill_9_cut_short_are_removed_at_the_next_start(
        ) -> None:
    """gurtd is killed (-9) right after the users of the tasks it starts are written into
    the account files and before any of the tasks runs (the create is not answered: its
    start comes first).  The next start removes them (the task is still queued on disk),
    then starts the task afresh: it runs once and ends done, and no user of it is left."""
    with running_gurtd({"GURT_TEST_CRASH_AT": "after-making-users"}) as g:
        with contextlib.suppress(ConnectionError):
            g.create("echo once")
        assert wait_exit(g) == 137
        [name] = os.listdir(os.path.join(g.home, "tasks"))
        task = task_file(g, name.removesuffix(".json"))
        assert task["user"] in passwd_names()          # the window is real
        assert task_file(g, task["id"])["state"] == "queued"
        g.env = {}
        offset = len(g.log_text())
        g.start()
        assert f"reconcile: removing leftover user {task['user']}" in g.log_text()[offset:]
        done = g.wait(task["id"])
        assert done["state"] == "done", done
        assert g.states(task["id"]) == ["queued", "running", "done"]
        assert [e["text"] for e in g.log(task["id"]) if e["type"] == "stdout"] == ["once"]
        eventually(lambda: task["user"] not in passwd_names(), what="the task's user gone")
        assert g.stop() == 0


def spawned_workers(g: Gurtd) -> list[int]:
    """The spawner's children, the workers (gurtd's one child is its spawner)."""
    assert g.proc is not None
    def children(pid: str) -> list[str]:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(w) for spawner in children(str(g.proc.pid)) for w in children(spawner)]


def test_a_task_begins_only_once_its_user_is_written_and_fails_if_it_cannot_be() -> None:
    """A worker is spawned before its user is written into the account files (it builds its
    box meanwhile) and waits at its gate: gurtd stopped between the two (GURT_TEST_STOP_AT
    users-write), the worker is there and its task's command has not run, no user of it
    exists.  Let go, the task runs once and ends done.  Then the edit fails for real (the
    account files immutable while gurtd is stopped there): that task fails with why, its
    command never ran, no user or process of it is left, and the next one runs."""
    from concurrent.futures import ThreadPoolExecutor
    with running_gurtd({"GURT_TEST_STOP_AT": "users-write"}) as g, ThreadPoolExecutor(1) as pool:
        assert g.proc is not None
        create = pool.submit(g.create, "echo ran > ran.txt")   # answered after its start
        stopped(g)
        [task_id] = os.listdir(os.path.join(g.home, "layers"))
        eventually(lambda: spawned_workers(g), 10, "the worker spawned")
        time.sleep(0.5)                       # long enough to have run, had it not waited
        assert not os.path.exists(os.path.join(g.home, "layers", task_id, "upper", "ran.txt"))
        assert G.TASK_USER_PREFIX + task_id not in passwd_names()
        os.kill(g.proc.pid, signal.SIGCONT)
        task = create.result(timeout=30)
        assert task["id"] == task_id
        done = g.wait(task["id"])
        assert done["state"] == "done", done
        assert g.states(task["id"]) == ["queued", "running", "done"]
        assert g.file("home", "ran.txt") == b"ran\n"
        assert g.stop() == 0
    with running_gurtd({"GURT_TEST_STOP_AT": "users-write"}) as g, ThreadPoolExecutor(1) as pool:
        assert g.proc is not None
        create = pool.submit(g.create, "echo ran > ran.txt")
        stopped(g)
        subprocess.run(["chattr", "+i", "/etc/gshadow"], check=True)
        try:
            os.kill(g.proc.pid, signal.SIGCONT)
            task = create.result(timeout=30)
            failed = g.wait(task["id"])
        finally:
            subprocess.run(["chattr", "-i", "/etc/gshadow"], check=True)
        assert failed["state"] == "failed", failed
        assert failed["error"].startswith("could not start: its user: "), failed
        assert g.states(task["id"]) == ["queued", "failed"]
        assert g.file("home", "ran.txt") is None
        assert not [e for e in g.log(task["id"]) if e["type"] in ("step", "stdout")]
        assert task["user"] not in passwd_names()
        eventually(lambda: not spawned_workers(g), 10, "no process of the task")
        assert g.run_done("echo next")["state"] == "done"
        assert g.stop() == 0


def test_an_undone_layer_a_kill_9_cut_short_is_deleted_and_marked_at_the_next_start() -> None:
    """A task is undone; gurtd is killed (-9) after its layer went to its trash name and
    before the task file says so (that save is not synced: a crash may lose it).  The task
    stays undone, its file back in no view; the next start deletes the trash and marks the
    layer deleted, once, in the task's log too."""
    with running_gurtd({"GURT_TEST_CRASH_AT": "layer-trashed"}) as g:
        task = g.run_done("echo gone > gone.txt")
        with contextlib.suppress(ConnectionError, http.client.HTTPException):  # after it
            g.api("POST", f"/api/tasks/{task['id']}/undo")
        assert wait_exit(g) == 137
        layers = os.path.join(g.home, "layers")
        on_disk = task_file(g, task["id"])
        assert on_disk["state"] == "undone" and not on_disk["layerDeleted"]  # the window
        assert task["id"] not in os.listdir(layers)     # its trash name, or deleted already
        g.env = {}
        g.start()
        assert g.task(task["id"])["state"] == "undone"
        eventually(lambda: task_file(g, task["id"])["layerDeleted"], what="layer marked")
        assert os.listdir(layers) == []
        assert [e["text"] for e in g.log(task["id"]) if e["type"] == "layer"] == \
            ["layer files deleted"]
        assert g.file("home", "gone.txt") is None
        assert g.stop() == 0


def test_a_layer_whose_mark_cannot_be_saved_stops_no_other_layer_from_going() -> None:
    """Two tasks are undone while a running task still reads their layers; the first's
    file cannot be replaced (chattr +i, as a failing disk would) when the runner ends and
    the layers may go: the other layer is deleted and marked all the same, and the first is
    marked once its file can be replaced again."""
    with running_gurtd() as g:
        done = sorted((g.run_done("echo a > a.txt"), g.run_done("echo b > b.txt")),
                      key=lambda t: t["id"])            # the pass goes by id: first fails
        runner = g.create("sleep 30")
        eventually(lambda: g.task(runner["id"])["state"] == "running", what="the runner")
        for task in done:
            g.api("POST", f"/api/tasks/{task['id']}/undo")
        eventually(lambda: all(task_file(g, t["id"])["state"] == "undone" for t in done),
                   what="both undos saved")
        frozen = os.path.join(g.home, "tasks", done[0]["id"] + ".json")
        subprocess.run(["chattr", "+i", frozen], check=True)
        try:
            g.api("POST", f"/api/tasks/{runner['id']}/stop")
            eventually(lambda: task_file(g, done[1]["id"])["layerDeleted"], what="the other")
            assert not task_file(g, done[0]["id"])["layerDeleted"]
        finally:
            subprocess.run(["chattr", "-i", frozen], check=False)
        eventually(lambda: task_file(g, done[0]["id"])["layerDeleted"], what="the first")
        eventually(lambda: os.listdir(os.path.join(g.home, "layers")) == [runner["id"]],
                   what="the trash deleted (off the loop, after the mark)")
        for task in done:
            assert [e["text"] for e in g.log(task["id"]) if e["type"] == "layer"] == \
                ["layer files deleted"]
        assert g.stop() == 0


def test_temp_files_of_a_crashed_run_are_removed_at_start() -> None:
    """gurtd died in the middle of writes: temp files are left in BOX_HOME and beside
    /etc/group.  The next start removes them, but keeps a temp file of a gurtd that is alive
    (another BOX_HOME's, writing right now)."""
    home = make_home()
    g = Gurtd(home)
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    made = []
    try:
        g.start()
        assert g.stop() == 0
        leftovers = [os.path.join(home, "tasks", f"t0000000001.json.tmp-{dead.pid}-1"),
                     os.path.join(home, f"state.json.tmp-{dead.pid}-2"),
                     os.path.join(home, "approvals", f"a000000001.json.tmp-{dead.pid}-3"),
                     f"/etc/group.gurtd-{dead.pid}", f"/etc/shadow.gurtd-{dead.pid}"]
        others = [f"/etc/group.gurtd-{alive.pid}"]
        for path in leftovers + others:
            Path(path).write_text("half")
            made.append(path)
        g.start()
        assert [p for p in leftovers if os.path.exists(p)] == []
        assert [p for p in others if os.path.exists(p)] == others
        assert f"removed the leftover temp file /etc/group.gurtd-{dead.pid}" in g.log_text()
        assert g.run("echo fine")["state"] == "done"
        assert g.stop() == 0
    finally:
        alive.kill()
        alive.wait()
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if g.proc is not None:
            g.stop(signal.SIGKILL)
        remove_home(home)


# 3. one gurtd per BOX_HOME ###################################################################

def test_a_second_gurtd_on_the_same_box_home_exits_at_once_and_changes_nothing() -> None:
    """A task of the first gurtd waits for an answer.  A second `gurtd serve` on the same
    BOX_HOME exits at once with a clear message; the first one's task, user, broker socket
    and nftables table are untouched: the task, answered, pays through the broker and ends
    done."""
    with running_gurtd() as g:
        home = g.home
        g.api("PUT", "/api/wallet", {"balanceCents": 100})
        task = g.create("gurtd tool ask '{\"question\": \"go?\"}'\n" + pay_line("gina", 3),
                        tools=["ask", "wallet.pay"], budgetCents=10, hosts=["example.com"])
        pending = eventually(lambda: g.api("GET", f"/api/approvals?state=pending&task="
                                                  f"{task['id']}"), what="the ask")
        sock = os.path.join(home, "run", "broker.sock")
        inode = os.stat(sock).st_ino
        uid = G.task_users()[task["user"]]
        # only gurtd holds the lock: not its spawner, not a task (else a task that outlives
        # gurtd would keep the next start out)
        assert lock_holders(os.path.join(home, "gurtd.lock")) == [g.proc.pid]
        second = subprocess.run(serve_argv(home, "127.0.0.1:0"), env=serve_env(), cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second
        assert f"another gurtd (pid {g.proc.pid}) runs on BOX_HOME {home}" in second.stderr
        assert os.stat(sock).st_ino == inode
        assert nft_table(home) in nft_tables()
        assert G.task_users().get(task["user"]) == uid     # other tests' users come and go
        assert g.task(task["id"])["state"] == "waiting"
        g.api("POST", f"/api/approvals/{pending[0]['id']}/answer", {"answer": "yes"})
        assert g.wait_done(task["id"])["costCents"] == 3
        assert g.stop() == 0


def test_a_start_on_a_port_in_use_fails_and_leaves_nothing_behind() -> None:
    """The port is taken: gurtd exits non-zero saying so, and leaves no nftables table, no
    broker socket and no lock; a start on a free port then works."""
    home = make_home()
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        proc = subprocess.run(serve_argv(home, f"127.0.0.1:{port}"), env=serve_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1, proc
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
        assert nft_table(home) not in nft_tables()
        assert not os.path.exists(os.path.join(home, "run", "broker.sock"))
        g = Gurtd(home)
        g.start()
        assert g.run("echo fine")["state"] == "done"
        assert g.stop() == 0
    finally:
        holder.close()
        remove_home(home)


# 4. the loop guard ###########################################################################

def test_an_error_while_handling_a_task_fails_that_task_only() -> None:
    """A worker line makes its handler raise (GURT_TEST_RAISE_ON_OUTPUT, a test-only hook
    standing for any bug): that task fails with the error in its log, its processes go, the
    traceback is in gurtd's log, and gurtd goes on serving the other tasks."""
    with running_gurtd({"GURT_TEST_RAISE_ON_OUTPUT": "boom-line"}) as g:
        other = g.create("sleep 2\necho other")
        bad = g.run("echo before\necho boom-line\nsleep 30")
        assert bad["state"] == "failed", bad
        error = "internal error: RuntimeError: GURT_TEST_RAISE_ON_OUTPUT: a test's fault " \
                "on 'boom-line'"
        assert bad["error"] == error
        assert [e.get("error") for e in g.log(bad["id"]) if e.get("state") == "failed"] == \
            [error]
        assert g.worker_pids(bad) == []
        assert "Traceback" in g.log_text()
        assert g.wait(other["id"])["state"] == "done"
        assert g.run("echo after")["state"] == "done"
        assert g.stop() == 0


def test_a_task_whose_log_cannot_be_opened_at_its_start_fails_with_nothing_left() -> None:
    """A queued task's log cannot be opened as it starts (a folder in its place here; out of
    fds or an I/O error on a host): that task fails `could not start` with no process and no
    user of it left, and gurtd starts and runs the next task."""
    with running_gurtd() as g:
        g.api("PUT", "/api/settings", {"maxRunningTasks": 1})
        blocker = g.create("sleep 30")
        eventually(lambda: g.api("GET", f"/api/tasks/{blocker['id']}")["state"] == "running",
                   what="the blocker to run")
        bad = g.create("sleep 30")
        log_path = os.path.join(g.home, "logs", bad["id"] + ".jsonl")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(log_path)
        os.mkdir(log_path)
        g.api("POST", f"/api/tasks/{blocker['id']}/stop")
        failed = g.wait(bad["id"])
        assert failed["state"] == "failed", failed
        assert failed["error"].startswith("could not start: ") and "Is a directory" in \
            failed["error"], failed
        eventually(lambda: bad["user"] not in passwd_names(), what="its user to go")
        eventually(lambda: not G.processes_by_uid(), timeout=10,
                   what="no task process left (the failed one's worker did not start)")
        assert g.run("echo after")["state"] == "done"
        assert g.stop() == 0


# 5. the writes themselves ####################################################################

def test_writes_on_a_full_disk_fail_whole_and_leave_the_old_files_as_they_were() -> None:
    """A state file, a log line, a ledger line and an account file meet a nearly full disk:
    each write raises ENOSPC, no temp file stays, and every file keeps its old bytes (no
    truncated state file renamed into place, no half line glued to the next one)."""
    with small_disk_made(size_mb=8) as disk:
        state = os.path.join(disk.mnt, "task.json")
        G.write_json(state, {"state": "done"})
        logfile = os.path.join(disk.mnt, "log.jsonl")
        Path(logfile).write_bytes(b'{"n": 1}\n')
        accounts = os.path.join(disk.mnt, "passwd")
        Path(accounts).write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
        os.chmod(accounts, 0o644)
        disk.fill(leave=16 * 1024)
        big = b"x" * (300 * 1024)

        try:
            G.write_json(state, {"state": "failed", "prompt": big.decode()})
            raise AssertionError("a 300 KB state file fit on a nearly full disk")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        assert json.loads(Path(state).read_text()) == {"state": "done"}

        fd = os.open(logfile, os.O_RDWR | os.O_APPEND)
        try:
            try:
                G.append_line(fd, b'{"big": "' + big + b'"}\n')
                raise AssertionError("a 300 KB line fit on a nearly full disk")
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
            G.append_line(fd, b'{"n": 2}\n')          # the next line starts clean
        finally:
            os.close(fd)
        assert Path(logfile).read_bytes() == b'{"n": 1}\n{"n": 2}\n'

        try:
            G._replace_account_file(accounts, b"root:x:0:0:root:/root:/bin/bash\n" + big)
            raise AssertionError("a 300 KB account file fit on a nearly full disk")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        assert Path(accounts).read_bytes() == b"root:x:0:0:root:/root:/bin/bash\n"
        assert oct(os.stat(accounts).st_mode & 0o777) == oct(0o644)

        assert [n for n in os.listdir(disk.mnt) if ".tmp-" in n or ".gurtd-" in n] == []


def test_a_half_line_that_cannot_be_cut_off_keeps_the_next_lines_out_until_it_can() -> None:
    """A ledger line meets a full disk and the ledger is append-only (chattr +a), so its half
    line cannot be cut off either: the next payment's line is refused with the same error and
    nothing is glued to the half line; a start's recovery reads the whole lines; once the file
    can be cut again, the next line cuts the half one off and starts clean."""
    with small_disk_made(size_mb=8) as disk:
        ledger = os.path.join(disk.mnt, "wallet.jsonl")
        first, second = (json.dumps({"balanceAfterCents": c}).encode() + b"\n" for c in (100, 90))
        Path(ledger).write_bytes(first)
        fd = os.open(ledger, os.O_RDWR | os.O_APPEND)
        subprocess.run(["chattr", "+a", ledger], check=True)
        try:
            disk.fill(leave=16 * 1024)
            with pytest.raises(OSError) as full:
                G.append_line(fd, b'{"big": "' + b"x" * (300 * 1024) + b'"}\n', sync=True)
            assert full.value.errno == errno.ENOSPC
            half = Path(ledger).read_bytes()
            assert half.startswith(first) and len(half) > len(first)    # not cut: append-only
            disk.free()
            with pytest.raises(OSError) as refused:
                G.append_line(fd, second, sync=True)
            assert refused.value.errno == errno.ENOSPC
            assert Path(ledger).read_bytes() == half                     # nothing glued
            crashed = os.path.join(disk.mnt, "crashed.jsonl")            # a crash now
            Path(crashed).write_bytes(half)
            assert G.load_ledger(crashed) == {"balanceCents": 100,
                                              "ledger": [{"balanceAfterCents": 100}]}
            subprocess.run(["chattr", "-a", ledger], check=True)
            G.append_line(fd, second, sync=True)
        finally:
            subprocess.run(["chattr", "-a", ledger], check=False)
            os.close(fd)
        assert Path(ledger).read_bytes() == first + second
        assert G.load_ledger(ledger)["balanceCents"] == 90


def test_a_line_refused_whole_on_an_append_only_file_keeps_the_next_ones_coming() -> None:
    """The disk full to its last byte: nothing of the line reached the append-only ledger, so
    there is nothing to cut (ftruncate would be refused): the file was marked torn all the
    same and every later payment refused, the disk free again.  Now the next line goes in."""
    with small_disk_made(size_mb=8) as disk:
        ledger = os.path.join(disk.mnt, "wallet.jsonl")
        first = json.dumps({"balanceAfterCents": 100, "pad": "x" * 4058}).encode() + b"\n"
        assert len(first) == 4096                       # the file ends at a block's end
        Path(ledger).write_bytes(first)
        fd = os.open(ledger, os.O_RDWR | os.O_APPEND)
        subprocess.run(["chattr", "+a", ledger], check=True)
        try:
            disk.fill(leave=0)
            with pytest.raises(OSError) as full:
                G.append_line(fd, b'{"balanceAfterCents": 95}\n', sync=True)
            assert full.value.errno == errno.ENOSPC and Path(ledger).read_bytes() == first
            disk.free()
            G.append_line(fd, b'{"balanceAfterCents": 90}\n', sync=True)
        finally:
            subprocess.run(["chattr", "-a", ledger], check=False)
            os.close(fd)
        assert G.load_ledger(ledger)["balanceCents"] == 90


@pytest.mark.pure
def test_a_line_after_a_half_line_of_an_earlier_run_starts_on_a_line_of_its_own(
        tmp_path: Path) -> None:
    """A crash (or a cut that failed before a restart) left a log ending in half a line; the
    next run's first line was glued onto it and both were lost to a reader."""
    log = tmp_path / "t.jsonl"
    log.write_bytes(b'{"n": 1}\n{"type": "outp')
    fd = os.open(log, os.O_RDWR | os.O_APPEND)
    try:
        G.append_line(fd, b'{"n": 2}\n')
        G.append_line(fd, b'{"n": 3}\n')
    finally:
        os.close(fd)
    assert log.read_bytes().split(b"\n") == [b'{"n": 1}', b'{"type": "outp', b'{"n": 2}',
                                             b'{"n": 3}', b""]


def test_a_group_save_cut_short_after_a_rename_keeps_that_task_as_its_file_says() -> None:
    """Two queued tasks start in one schedule and are saved in one group commit; the second's
    file cannot be replaced (chattr +i: the kernel refuses its rename, after the first's, as
    a failing disk would): the first runs, as its file says, and only the second fails."""
    with running_gurtd() as g:
        g.api("PUT", "/api/settings", {"maxRunningTasks": 1})
        blocker = g.create("sleep 30")
        eventually(lambda: g.task(blocker["id"])["state"] == "running", what="the blocker")
        first, second = g.create("sleep 30"), g.create("sleep 30")
        frozen = os.path.join(g.home, "tasks", second["id"] + ".json")
        subprocess.run(["chattr", "+i", frozen], check=True)
        try:
            g.api("PUT", "/api/settings", {"maxRunningTasks": 3})
            assert g.wait(second["id"])["state"] == "failed"
            assert g.task(first["id"])["state"] == "running"
            assert (task_file(g, first["id"]) or {}).get("state") == "running"
        finally:
            subprocess.run(["chattr", "-i", frozen], check=False)
        for task in (blocker, first):
            g.api("POST", f"/api/tasks/{task['id']}/stop")
            assert g.wait(task["id"])["state"] == "failed"
        eventually(lambda: (task_file(g, second["id"]) or {}).get("state") == "failed",
                   what="the second's failure saved once its file can be replaced")
        assert g.stop() == 0


def children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        out += [int(p) for p in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def test_an_error_that_belongs_to_no_task_is_logged_and_gurtd_keeps_serving() -> None:
    """An operator kills gurtd's spawner (kill -9 on its pid).  Reading its socket fails on
    every turn of the loop: the error is logged once as the spawner being gone, gurtd keeps
    answering, a new task fails with a clear error instead of hanging, and SIGTERM stops
    gurtd cleanly."""
    with running_gurtd() as g:
        assert g.proc is not None
        spawner = children(g.proc.pid)
        assert len(spawner) == 1, spawner
        os.kill(spawner[0], signal.SIGKILL)
        gone = "<2>the spawner is gone: no task can start until gurtd restarts"
        eventually(lambda: gone in g.log_text(), what="the log line")
        assert g.api("GET", "/api/health") is not None
        task = g.run("echo never")
        assert task["state"] == "failed"
        assert task["error"].startswith("could not start: "), task
        assert g.log_text().count(gone) == 1               # once, not on every turn
        assert g.stop() == 0


def test_a_replaced_file_keeps_its_mode_and_owner_whatever_gurtd_s_umask(tmp_path) -> None:
    """Under systemd gurtd runs with UMask=0077: a rewritten /etc/passwd must still be 0644
    (a 0600 passwd breaks every program of every user).  The same write path, on a file of
    the test's own."""
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0::/root:/bin/sh\n")
    os.chmod(path, 0o644)
    os.chown(path, 0, 42)
    old = os.umask(0o077)
    try:
        G._replace_account_file(str(path), b"root:x:0:0::/root:/bin/sh\nx:x:1:1::/:/bin/sh\n")
    finally:
        os.umask(old)
    st = os.stat(path)
    assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == ("0o644", 0, 42)
    assert path.read_text().endswith("x:x:1:1::/:/bin/sh\n")
    assert sorted(os.listdir(tmp_path)) == ["passwd"]


def test_damaged_task_and_approval_files_are_set_aside_and_the_rest_loads() -> None:
    """A task file that is not JSON, one that is JSON but no task, and an approval file that
    is no approval: gurtd starts, sets each aside (nothing deleted), and loads the good task."""
    with running_gurtd() as g:
        good = g.run_done("echo good")
        g.stop()
        tasks, approvals = os.path.join(g.home, "tasks"), os.path.join(g.home, "approvals")
        for folder, name, text in ((tasks, "tbroken0001.json", "{not json"),
                                   (tasks, "tbroken0002.json", '{"id": 5, "state": "done"}'),
                                   (approvals, "abroken0001.json", '["an approval?"]')):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        g.start()
        assert g.task(good["id"])["state"] == "done"
        ids = {t["id"] for t in g.api("GET", "/api/tasks?limit=1000")}
        assert ids == {good["id"]}, ids
        for folder, name in ((tasks, "tbroken0001.json"), (tasks, "tbroken0002.json"),
                             (approvals, "abroken0001.json")):
            names = os.listdir(folder)
            assert name not in names and any(n.startswith(name + ".damaged-") for n in names)
        assert g.api("GET", "/api/approvals") == []


def test_a_task_whose_stack_file_is_damaged_keeps_its_file_and_loses_only_its_layers() -> None:
    """A stack file that is JSON of the wrong shape (its parent a number): the task that names
    it is loaded, its layers said lost in the log; its own file is not set aside."""
    with running_gurtd() as g:
        task = g.run_done("echo kept")
        g.stop()
        path = os.path.join(g.home, "tasks", task["id"] + ".json")
        with open(path) as f:
            data = json.load(f)
        data["layersRef"] = "0" * 32
        with open(path, "w") as f:
            json.dump(data, f)
        os.makedirs(os.path.join(g.home, "stacks"), exist_ok=True)
        with open(os.path.join(g.home, "stacks", "0" * 32 + ".json"), "w") as f:
            f.write('{"ids": [], "parent": 5}\n')
        g.start()
        assert g.task(task["id"])["state"] == "done"
        assert os.listdir(os.path.join(g.home, "tasks")) == [task["id"] + ".json"]
        assert "its layers are lost" in g.log_text()


def test_an_undo_whose_state_cannot_be_saved_keeps_the_layer_until_it_is() -> None:
    """The disk is full when a task is undone: its file still says done, so its layer stays
    on disk (a crash now would find a done task without its files); once there is room the
    undone state is saved and only then is the layer deleted."""
    with gurtd_on_small_disk() as (g, disk):
        task = g.run_done("echo kept > kept.txt")
        layer = os.path.join(g.home, "layers", task["id"])
        disk.fill()
        g.request("POST", f"/api/tasks/{task['id']}/undo")
        eventually(lambda: g.task(task["id"])["state"] == "undone", what="undone in memory")
        time.sleep(1.0)                    # a step or more: the collection would have run
        assert task_file(g, task["id"])["state"] == "done"
        assert os.path.isdir(layer)
        disk.free()
        eventually(lambda: task_file(g, task["id"])["state"] == "undone", timeout=30,
                   what="the undone state on disk")
        eventually(lambda: not os.path.lexists(layer), what="the layer deleted")
        assert g.stop() == 0


def test_an_undo_on_a_full_disk_takes_its_change_out_of_later_copies_once_there_is_room(
        ) -> None:
    """t2's copy of f.txt holds t1's change and t1 is undone on a full disk: the revert was
    begun at once, found no room for its work and was recorded failed, so once the disk was
    free t1's layer went and its line stayed in t2's copy for good.  Now the revert waits for
    the undone state on disk (save_unsaved) and runs then."""
    with gurtd_on_small_disk() as (g, disk):
        g.run_done("printf 'line 1\\nline 2\\nline 3\\nline 4\\nline 5\\n' > f.txt")
        t1 = g.run_done("sed -i 's/^line 2$/two by t1/' f.txt")
        g.run_done("sed -i 's/^line 5$/five by t2/' f.txt")
        disk.fill()
        g.request("POST", f"/api/tasks/{t1['id']}/undo")
        eventually(lambda: g.task(t1["id"])["state"] == "undone", what="undone in memory")
        time.sleep(1.0)
        disk.free()
        record = eventually(lambda: g.task(t1["id"]).get("undoMerge"), timeout=30,
                            what="the revert recorded")
        assert record["state"] == "done" and record["reverted"] == ["f.txt"], record
        assert g.file("home", "f.txt") == b"line 1\nline 2\nline 3\nline 4\nfive by t2\n"
        assert task_file(g, t1["id"])["undoMerge"] == record


def fill_to(disk: Any, free: int) -> None:
    """Fill disk until about `free` bytes are left, never through zero on the way (SmallDisk.fill
    goes to the last block first: a save at that moment would fail)."""
    st = os.statvfs(disk.mnt)
    size = st.f_bavail * st.f_frsize - free
    fd = os.open(disk.filler + "-part", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def let_go(g: Gurtd, task: dict[str, Any]) -> None:
    """Open and close for writing the FIFO /tmp/go of the task's own /tmp (not on BOX_HOME's
    disk): a `cat /tmp/go` in it ends."""
    for pid in g.worker_pids(task):
        with contextlib.suppress(OSError):
            os.close(os.open(f"/proc/{pid}/root/tmp/go", os.O_WRONLY | os.O_NONBLOCK))
            return
    raise AssertionError(f"no reader on /tmp/go of {task['id']}")


def end_on_a_full_disk(g: Gurtd, disk: Any, decoy: dict[str, Any], t1: dict[str, Any]
                       ) -> dict[str, Any]:
    """decoy writes 3 MB then sleeps; t1 waits on its /tmp/go FIFO: the disk filled below the
    reserve (the decoy takes the pause), then to the last block, t1 let go: t1 as it ends."""
    big = os.path.join(g.home, "layers", decoy["id"], "upper", "big")
    eventually(lambda: os.path.isfile(big) and os.path.getsize(big) == 3000000,
               what="the decoy's big file")
    eventually(lambda: any(os.path.exists(f"/proc/{p}/root/tmp/go")
                           for p in g.worker_pids(t1)), what="t1 waiting on /tmp/go")
    fill_to(disk, 256 << 10)                # below the reserve: the decoy is paused
    assert g.pending(decoy["id"])["kind"] == "disk"
    disk.fill()
    let_go(g, t1)
    return g.wait(t1["id"])


def test_undoing_a_task_whose_done_could_not_be_saved_keeps_a_later_task_s_own_change(
        ) -> None:
    """t1 ends on a full disk: its done state cannot be saved, so it is failed in memory
    (not_saved) and its layer never joins the stack; t2, once there is room, makes t1's change
    to f.txt itself (and one of its own).  t1 is undone while its failed state is still only
    in memory (held there by chattr +i on its file, as a disk that stays full would; let go
    just before the undo, on a disk with room): there is nothing of t1 to take out of any
    later copy, so f.txt keeps all of t2's change, and so after a restart.
    The brief's sequence (t1 done but unsaved, t2 on top of t1's change) cannot happen: a done
    state that cannot be saved is failed in memory and out of the stack (Steps.commit), so no
    later task ever sees its change.  Its doneSeq (set before the save) stays; a revert begun
    for it took t1's version out of t2's copy (t2's own line 2 gone): only a task undone from
    done is reverted, and this one's record says nothing reverted.  A decoy writer takes the
    disk reserve's pause (held, no second pause before free space falls 1 MiB more), so t1 is
    not paused for disk."""
    with gurtd_on_small_disk() as (g, disk):
        g.run_done("printf 'line 1\\nline 2\\nline 3\\nline 4\\nline 5\\n' > f.txt")
        decoy = g.create("head -c 3000000 /dev/zero > big\nsleep 120")
        t1 = g.create("sed -i 's/^line 2$/two/' f.txt\nmkfifo /tmp/go\ncat /tmp/go")
        failed = end_on_a_full_disk(g, disk, decoy, t1)
        assert (failed["state"], failed["error"]) == (
            "failed", "cannot save the task: No space left on device"), failed
        assert task_file(g, t1["id"])["state"] == "running"
        held = os.path.join(g.home, "tasks", t1["id"] + ".json")
        subprocess.run(["chattr", "+i", held], check=True)
        try:
            os.unlink(disk.filler + "-part")
            disk.free()
            g.api("POST", f"/api/tasks/{decoy['id']}/stop")
            g.run_done("sed -i -e 's/^line 2$/two/' -e 's/^line 5$/five by t2/' f.txt")
            assert task_file(g, t1["id"])["state"] == "running"     # still only in memory
        finally:
            subprocess.run(["chattr", "-i", held], check=True)
        answer = g.api("POST", f"/api/tasks/{t1['id']}/undo")
        assert answer["state"] == "undone", answer
        kept = b"line 1\ntwo\nline 3\nline 4\nfive by t2\n"
        eventually(lambda: task_file(g, t1["id"])["state"] == "undone", what="undone on disk")
        time.sleep(1.0)                          # a revert, had one begun, has joined
        assert g.task(t1["id"])["undoMerge"]["reverted"] == [], g.task(t1["id"])
        assert g.file("home", "f.txt") == kept
        assert g.stop() == 0
        g.start()
        assert g.task(t1["id"])["state"] == "undone"
        assert g.file("home", "f.txt") == kept


def test_a_personal_task_whose_done_could_not_be_saved_has_no_review_to_keep(
        owner_folder: str) -> None:
    """A personal task whose done state a full disk refuses is failed in memory, as any task
    whose end cannot be saved: it has no review (as any failed task), keep answers 409, and
    the owner's folder never gets its change, once the disk has room too."""
    with gurtd_on_small_disk() as (g, disk):
        decoy = g.create("head -c 3000000 /dev/zero > big\nsleep 120")
        t1 = g.create(f"echo task > {owner_folder}/a.txt\nmkfifo /tmp/go\ncat /tmp/go",
                      folder=owner_folder)
        failed = end_on_a_full_disk(g, disk, decoy, t1)
        assert (failed["state"], failed["error"]) == (
            "failed", "cannot save the task: No space left on device"), failed
        assert "review" not in failed, failed
        os.unlink(disk.filler + "-part")
        disk.free()
        g.api("POST", f"/api/tasks/{decoy['id']}/stop")
        refused = g.api("POST", f"/api/tasks/{t1['id']}/keep", {}, status=409)
        assert refused["code"] == "conflict" and "not open" in refused["error"], refused
        assert "review" not in g.task(t1["id"])
        assert open(os.path.join(owner_folder, "a.txt")).read() == "hello\n"
        eventually(lambda: not os.path.exists(os.path.join(g.home, "review", t1["id"])),
                   what="its review files gone")


# 6. a revert that finds no room (crash pass) #################################################

def test_a_revert_that_finds_no_room_is_built_again_once_there_is_room() -> None:
    """t2's copies of 300 files hold t1's change; t1 is undone with room for its state but
    not for the revert layer's files: the revert waits (its record not written, t1's layer
    kept) and is built again once the disk has room, so t1's line leaves t2's copies.
    Before, it was recorded failed at once, t1's layer went, and t1's change stayed in every
    later copy for good."""
    with gurtd_on_small_disk() as (g, disk):
        g.run_done("mkdir d; for i in $(seq 300); do seq 20 > d/$i; done")
        t1 = g.run_done("sed -i 's/^3$/three/' d/*")["id"]
        g.run_done("sed -i 's/^17$/seventeen/' d/*")
        fill_to(disk, 64 << 10)
        answer = g.api("POST", f"/api/tasks/{t1}/undo")
        assert answer["state"] == "undone"
        time.sleep(2.0)                       # the revert has found no room by now
        assert (g.task(t1).get("undoMerge") or {}).get("state") != "failed", g.task(t1)
        assert os.path.isdir(os.path.join(g.home, "layers", t1))
        os.unlink(disk.filler + "-part")
        disk.free()
        record = eventually(lambda: (g.task(t1).get("undoMerge") or {}).get("state") in
                            ("done", "failed") and g.task(t1)["undoMerge"], 30, "the revert")
        assert record["state"] == "done" and len(record["reverted"]) == 300, record
        want = "".join(f"{n}\n" for n in range(1, 21)).replace("17\n", "seventeen\n")
        assert g.file("home", "d/5").decode() == want
        assert task_file(g, t1)["undoMerge"] == record
        eventually(lambda: not os.path.lexists(os.path.join(g.home, "layers", t1)), 30,
                   "t1's layer deleted")
        assert g.stop() == 0


# 7. a clean stop while a finish-time merge holds a task (crash pass) #########################

def test_a_clean_stop_fails_a_task_the_finish_time_merge_holds() -> None:
    """A task waits on a conflict (its worker gone, held by the finish-time merge) when
    gurtd gets SIGTERM: the stop fails it as every running task (`gurtd stopped while the
    task was running`, its approval denied), on disk before gurtd exits.  Before, its file
    said waiting and its approval pending until a next start failed it as restarted."""
    from test_concurrent import conflict_story
    with running_gurtd() as g:
        a, approval = conflict_story(g, "echo a > f.txt", "echo b > f.txt")
        assert g.stop() == 0
        assert (task_file(g, a)["state"], task_file(g, a)["error"]) == (
            "failed", "gurtd stopped while the task was running")
        with open(os.path.join(g.home, "approvals", approval["id"] + ".json")) as f:
            assert json.load(f)["state"] == "denied"
        g.start()
        assert g.task(a)["error"] == "gurtd stopped while the task was running"
        assert g.file("home", "f.txt") == b"b\n"


# 8. a full disk at the revert layer's own save; a crash before an upload's save (crash pass) #

def stopped(g: Gurtd, timeout: float = 30.0) -> None:
    """Wait until gurtd stopped itself at its stop point (GURT_TEST_STOP_AT: state T)."""
    assert g.proc is not None
    stat = Path(f"/proc/{g.proc.pid}/stat")
    eventually(lambda: stat.read_text().rpartition(")")[2].split()[0] == "T", timeout,
               "gurtd stopped at its stop point")


def revert_stopped_on_a_broken_disk(g: Gurtd, break_disk: Callable[[], None]) -> str:
    """t2's copy of f.txt holds t1's change; t1 is undone and gurtd stops itself once the
    revert layer is written (the undone state saved); break_disk() runs, gurtd goes on.
    t1's id, once its revert waits."""
    from concurrent.futures import ThreadPoolExecutor
    g.run_done("seq 20 > f.txt")
    t1 = g.run_done("sed -i 's/^3$/three/' f.txt")["id"]
    g.run_done("sed -i 's/^17$/seventeen/' f.txt")
    with ThreadPoolExecutor(1) as pool:
        undo = pool.submit(g.api, "POST", f"/api/tasks/{t1}/undo")
        stopped(g)                          # the revert layer written, not joined
        break_disk()
        assert g.proc is not None
        os.kill(g.proc.pid, signal.SIGCONT)
        assert undo.result(timeout=30)["state"] == "undone"
    eventually(lambda: (g.task(t1).get("undoMerge") or {}).get("state") in
               ("waiting", "failed"), 30, "the revert's wait (or its failure)")
    return t1


def assert_waiting(g: Gurtd, t1: str, reason: str, readable: bool = True) -> None:
    """t1's revert waits for the disk and says so; nothing of it is lost meanwhile."""
    shown = g.task(t1)
    record = shown["undoMerge"]
    assert shown["state"] == "undone" and record["state"] == "waiting", shown
    assert reason in record["error"] and record["reverted"] == [] and \
        record["layer"] is None, record
    at = G.datetime.datetime.fromisoformat(record["retryAt"].replace("Z", "+00:00"))
    assert 0 < (at - G.datetime.datetime.now(G.datetime.timezone.utc)).total_seconds() <= 300
    if readable:
        assert os.path.isdir(os.path.join(g.home, "layers", t1))
        assert g.file("home", "f.txt").decode().count("three") == 1     # not reverted yet
    again = g.api("POST", f"/api/tasks/{t1}/undo")
    assert again["state"] == "undone" and again["undoMerge"]["state"] == "waiting", again
    from test_concurrent import event_seen
    event = event_seen(g, lambda kind, data: kind == "task" and data.get("id") == t1 and
                       (data.get("undoMerge") or {}).get("state") == "waiting")
    assert reason in event["undoMerge"]["error"], event


def assert_reverted(g: Gurtd, t1: str, timeout: float = 60.0) -> None:
    record = eventually(lambda: (g.task(t1).get("undoMerge") or {}).get("state") in
                        ("done", "failed") and g.task(t1)["undoMerge"], timeout, "the revert")
    assert record["state"] == "done" and record["reverted"] == ["f.txt"], record
    want = "".join(f"{n}\n" for n in range(1, 21)).replace("17\n", "seventeen\n")
    assert g.file("home", "f.txt").decode() == want
    assert task_file(g, t1)["undoMerge"] == record
    eventually(lambda: not os.path.lexists(os.path.join(g.home, "layers", t1)), 30,
               "t1's layer deleted")


def test_a_revert_whose_layer_cannot_be_saved_joins_once_there_is_room() -> None:
    """t1 is undone; its revert layer is written (t2's copy of f.txt without t1's line), and
    the disk is full when that layer's task is to be saved (a 507 inside gurtd).  Meanwhile
    t1 reads undone, its undoMerge not failed, its layer and t2's line kept; once the disk
    has room the revert is built again and joins, the view exact.  Before, the undo was
    recorded failed for good (and t1's layer deleted), t1's line left in t2's copy."""
    with gurtd_on_small_disk({"GURT_TEST_STOP_AT": "undo-revert-written"}) as (g, disk):
        t1 = revert_stopped_on_a_broken_disk(g, disk.fill)    # filled to the last block
        shown = g.task(t1)
        assert shown["state"] == "undone" and \
            (shown.get("undoMerge") or {}).get("state") != "failed", shown
        assert os.path.isdir(os.path.join(g.home, "layers", t1))
        assert g.file("home", "f.txt").decode().count("three") == 1     # not reverted yet
        again = g.api("POST", f"/api/tasks/{t1}/undo")["undoMerge"]     # not `writing`
        assert {k: again[k] for k in ("reverted", "kept", "layer", "state")} == {
            "reverted": [], "kept": [], "layer": None, "state": "waiting"}, again  # was checking
        assert "No space left on device" in again["error"] and again["retryAt"], again
        disk.free()
        assert_reverted(g, t1)
        assert not [n for n in os.listdir(os.path.join(g.home, "layers"))
                    if n.startswith(G.UPLOAD_STAGING)]
        assert g.stop() == 0


def test_a_kill_9_between_an_uploads_rename_and_its_save_leaves_no_orphan() -> None:
    """gurtd is killed (-9) after an upload's layer was renamed to layers/<id> and before
    the task that names it was saved: no record names that folder.  The next start moves
    it to the layer collection's trash (and what else under BOX_HOME no record names: a
    review folder, a finish-time merge's temp folder), never a layer a task names: a done
    one, an undone one still read, a running one's.  Before, layers/<id> stayed for good."""
    with running_gurtd() as g:
        kept = g.run_done("echo a > a.txt")["id"]
        undone = g.run_done("echo b > b.txt")["id"]
        g.api("POST", f"/api/tasks/{undone}/undo")
        runner = g.create("sleep 60")["id"]
        eventually(lambda: g.task(runner)["state"] == "running", what="the runner")
        g.stop(signal.SIGKILL)
        g.env = {"GURT_TEST_CRASH_AT": "upload-renamed"}
        g.start()
        with contextlib.suppress(OSError, http.client.HTTPException):   # it dies first
            g.request("PUT", "/api/workspaces/home/files/c.txt", raw=b"c\n",
                      headers={"Content-Type": "application/octet-stream"})
        assert wait_exit(g) == 137
        layers = os.path.join(g.home, "layers")
        named = {kept, runner} | ({undone} & set(os.listdir(layers)))
        [orphan] = set(os.listdir(layers)) - named
        assert os.path.isdir(os.path.join(layers, orphan, "upper"))
        assert not os.path.exists(os.path.join(g.home, "tasks", orphan + ".json"))
        planted = [os.path.join(g.home, "review", "t" + "9" * 9, "f0", "upper"),
                   os.path.join(g.home, "run", "merge-" + "ab" * 6)]
        for path in planted:
            os.makedirs(path)
        before = {t: sorted(os.listdir(os.path.join(layers, t, "upper"))) for t in named}
        g.env = {}
        g.start()
        gone = [os.path.join(layers, orphan), os.path.dirname(os.path.dirname(planted[0])),
                planted[1]]
        eventually(lambda: not any(os.path.lexists(p) for p in gone) and
                   not [n for n in os.listdir(layers) if n.startswith(G.MERGE_TEMP)] and
                   not [n for n in os.listdir(os.path.join(g.home, "review"))
                        if n.startswith(G.REVIEW_TRASH)], 30, "what no record names collected")
        assert f"layers/{orphan}" in g.log_text()
        assert g.task(kept)["state"] == "done" and g.file("home", "a.txt") == b"a\n"
        for task_id in named - {undone}:
            assert sorted(os.listdir(os.path.join(layers, task_id, "upper"))) == before[task_id]
        assert g.file("home", "c.txt") is None
        assert g.run("echo fine")["state"] == "done"
        assert g.stop() == 0


def test_a_kill_9_between_a_stack_file_and_its_task_file_leaves_no_orphan_stack() -> None:
    """A task's stack past STACK_INLINE layers is written to stacks/<ref>.json before the
    task file that names it; gurtd is killed (-9) between the two (an upload's task, here).
    The next start deletes that stack file, no task names it, and keeps every stack a task
    names (a done task's, one a damaged task file set aside names).  Before, it stayed for
    good: every crash at that point left one more file no record names."""
    def put(name: str) -> tuple[int, Any, Any]:
        return g.request("PUT", f"/api/workspaces/home/files/{name}", raw=b"x\n",
                         headers={"Content-Type": "application/octet-stream"})

    with running_gurtd() as g:
        for n in range(G.STACK_INLINE + 1):
            assert put(f"u{n}.txt")[0] == 201, n
        kept = g.run_done("echo a > a.txt")["id"]
        stacks = os.path.join(g.home, "stacks")
        named = task_file(g, kept)["layersRef"]
        assert os.listdir(stacks) == [named + ".json"]
        damaged_names = "f" * 32            # a stack only a damaged task file names
        with open(os.path.join(stacks, damaged_names + ".json"), "w") as f:
            f.write('{"ids": [], "parent": null}\n')
        with open(os.path.join(g.home, "tasks", "tbroken0001.json"), "w") as f:
            f.write('{"layersRef": "' + damaged_names + '", not json')
        g.stop()
        g.env = {"GURT_TEST_CRASH_AT": "stack-written"}
        g.start()
        with contextlib.suppress(OSError, http.client.HTTPException):   # it dies first
            put("c.txt")
        assert wait_exit(g) == 137
        task_texts = "".join(Path(g.home, "tasks", n).read_text()
                             for n in os.listdir(os.path.join(g.home, "tasks")))
        [orphan] = {n[:-5] for n in os.listdir(stacks)} - {named, damaged_names}
        assert orphan not in task_texts
        g.env = {}
        g.start()
        assert sorted(os.listdir(stacks)) == sorted([named + ".json", damaged_names + ".json"])
        assert f"stacks/{orphan}.json" in g.log_text()
        assert len(g.task(kept)["layers"]) == G.STACK_INLINE + 1
        assert g.file("home", "c.txt") is None and g.file("home", "u3.txt") == b"x\n"
        assert g.run_done("echo b > b.txt")["state"] == "done"
        assert g.stop() == 0


# 9. a read-only remount or I/O errors at the revert layer's save (crash pass) ################

def test_a_revert_on_a_disk_remounted_read_only_waits_and_joins_once_it_is_writable() -> None:
    """The disk under BOX_HOME is remounted read-only (as an admin or the kernel after an
    error does) when t1's revert layer is to join: t1 reads undone, its undoMerge `waiting`
    with the reason and the time of the next try, its layer and t2's line kept; once the
    disk is writable again the revert is built again and joins.  Before, the undo was
    recorded failed for good (Read-only file system) and t1's line stayed in t2's copy."""
    with gurtd_on_small_disk({"GURT_TEST_STOP_AT": "undo-revert-written"}) as (g, disk):
        def remount(mode: str) -> None:
            subprocess.run(["mount", "-o", f"remount,{mode}", disk.mnt], check=True)

        t1 = revert_stopped_on_a_broken_disk(g, lambda: remount("ro"))
        try:
            assert_waiting(g, t1, "Read-only file system")
        finally:
            remount("rw")
        assert_reverted(g, t1)
        assert not [n for n in os.listdir(os.path.join(g.home, "layers"))
                    if n.startswith(G.UPLOAD_STAGING)], os.listdir(os.path.join(g.home, "layers"))
        assert g.stop() == 0


def test_a_revert_waiting_for_room_says_so_and_a_restart_takes_it_up() -> None:
    """The disk is full when t1's revert layer is to join: the task's undoMerge says
    `waiting`, why (No space left on device) and when it is tried again, and an undo again
    answers the same, while its file on disk has no record (a restart takes it up).  gurtd
    is stopped and started once the disk has room: the revert joins.  Before, the task
    showed no undoMerge at all while it waited (and an undo again said `checking`)."""
    with gurtd_on_small_disk({"GURT_TEST_STOP_AT": "undo-revert-written"}) as (g, disk):
        t1 = revert_stopped_on_a_broken_disk(g, disk.fill)
        assert_waiting(g, t1, "No space left on device")
        assert task_file(g, t1)["state"] == "undone" and task_file(g, t1)["undoMerge"] is None
        assert g.stop() == 0
        disk.free()
        g.env = {}
        g.start()
        assert_reverted(g, t1)
        assert g.stop() == 0


EXT4_IOC_SHUTDOWN = 0x8004587D            # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2           # as a device that stops answering: no flush at all


def test_a_revert_on_a_disk_that_fails_with_io_errors_waits_and_joins_after_a_repair(
        ) -> None:
    """The disk under BOX_HOME fails (ext4 shut down: every call on it an I/O error, as a
    dead device's; there is no device-mapper here for dm-error) when t1's revert layer is
    to join: t1 reads undone, its undoMerge `waiting` (Input/output error, the next try's
    time).  The admin repairs it (gurtd killed, the disk mounted again): the next start
    finds t1 undone, its layer kept, and builds the revert, which joins.  Before, the undo
    was recorded failed for good in memory and t1's change would have stayed in t2's copy
    had the record reached the disk."""
    import fcntl
    import struct
    with gurtd_on_small_disk({"GURT_TEST_STOP_AT": "undo-revert-written"}) as (g, disk):
        def shut_down() -> None:
            fd = os.open(disk.mnt, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
            finally:
                os.close(fd)

        t1 = revert_stopped_on_a_broken_disk(g, shut_down)
        assert_waiting(g, t1, "Input/output error", readable=False)
        g.stop(signal.SIGKILL)
        eventually(lambda: subprocess.run(["umount", disk.mnt], check=False).returncode == 0,
                   30, "the failed disk unmounted")
        subprocess.run(["mount", "-t", "ext4", disk.loop, disk.mnt], check=True)
        g.env = {}
        g.start()
        assert g.task(t1)["state"] == "undone"
        assert_reverted(g, t1)
        assert g.stop() == 0


def processes_in_groups_of(task_ids: list[str]) -> list[int]:
    """Every live process whose cgroup names one of these tasks (a worker still root at its
    gate has no uid of the task's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
        if any(task_id in text for task_id in task_ids):
            found.append(int(pid))
    return found


def test_hosts_tasks_whose_workers_wait_at_their_gates_when_gurtd_is_killed_run_once_after(
        ) -> None:
    """Three tasks with hosts are posted at once; gurtd is killed (-9) once their users are
    written, their workers spawned and waiting at their gates, their namespaces made.  The
    workers end on their own (the gates' ends gone: none runs a line), and the next start
    leaves no user, veth or process of them; each task then runs once and ends done."""
    from concurrent.futures import ThreadPoolExecutor
    with running_gurtd({"GURT_TEST_CRASH_AT": "after-making-users"}) as g, \
            ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: _create_quietly(g, "echo once", hosts=["198.18.9.9:9"]),
                      range(3)))
        assert wait_exit(g) == 137
        ids = [n.removesuffix(".json") for n in os.listdir(os.path.join(g.home, "tasks"))]
        assert ids and all(task_file(g, i)["state"] == "queued" for i in ids)
        eventually(lambda: not processes_in_groups_of(ids), 10, "the workers gone")
        users = {task_file(g, i)["user"] for i in ids}
        g.env = {}
        g.start()
        done = [g.wait(i) for i in ids]
        assert [t["state"] for t in done] == ["done"] * len(ids), done
        for i in ids:
            assert g.states(i) == ["queued", "running", "done"]
            assert [e["text"] for e in g.log(i) if e["type"] == "stdout"] == ["once"]
        eventually(lambda: not users & passwd_names(), what="the tasks' users gone")
        assert g.stop() == 0
        assert nft_table(g.home) not in nft_tables()
    eventually(lambda: not [x for x in leftovers() if x.startswith("veth ")], 10, "no veth")


def _create_quietly(g: Gurtd, prompt: str, **fields: Any) -> None:
    try:
        g.create(prompt, **fields)
    except (ConnectionError, http.client.HTTPException, OSError):
        pass                               # gurtd died before its answer


def test_a_task_runs_nothing_before_its_running_state_is_on_disk() -> None:
    """gurtd is stopped right before it saves the running state of the task it starts
    (GURT_TEST_STOP_AT running-save): the task's user is written and its worker spawned, but
    it waits at its gate: its line has not run (its file says queued).  Killed -9 there, the
    next start runs it once: one line of output, done."""
    from concurrent.futures import ThreadPoolExecutor
    with running_gurtd({"GURT_TEST_STOP_AT": "running-save"}) as g, \
            ThreadPoolExecutor(1) as pool:
        assert g.proc is not None
        pool.submit(_create_quietly, g, "echo once | tee ran.txt")
        stopped(g)
        [task_id] = os.listdir(os.path.join(g.home, "layers"))
        time.sleep(0.5)                       # long enough to have run, had it not waited
        try:
            assert task_file(g, task_id)["state"] == "queued"
            assert not os.path.exists(os.path.join(g.home, "layers", task_id, "upper",
                                                   "ran.txt"))
            assert spawned_workers(g)         # at its gate
        finally:
            g.proc.kill()
        assert wait_exit(g) == -signal.SIGKILL
        g.env = {}
        g.start()
        done = g.wait(task_id)
        assert done["state"] == "done", done
        assert [e["text"] for e in g.log(task_id) if e["type"] == "stdout"] == ["once"]
        assert g.stop() == 0
