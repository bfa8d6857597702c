"""Red team from inside tasks, round 2: what a task's own moves do to its owner's review.

A task in personal mode renames and hard-links files of the owner's real folder (the most
ordinary things a tool does: `mv`, `git mv`, `ln`); the overlay copies each file up under its
new name with the origin xattr of the real file.  Keep must not take such a name for one the
owner deleted, and must still see what the owner did to the original meanwhile.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import gurtd as G
from conftest import Gurtd, end_sleep, keep, run_on, wait_for_step


def test_a_file_the_task_renamed_or_linked_is_kept_as_the_tasks_new_name(
        gurtd: Gurtd, owner_folder: str) -> None:
    """The task renames a.txt and hard-links sub/b.txt: both new names were taken for paths
    "deleted by the owner after the task started" (the origin xattr of a copy-up says a real
    file was there), and keep refused without force.  Now they are kept as the task's: the
    new names hold the contents, a.txt is gone, sub/b.txt stays."""
    task = run_on(gurtd, owner_folder, "mv a.txt renamed.txt", "ln sub/b.txt sub/hl")
    assert task["state"] == "done", gurtd.log(task["id"])
    code, kept = keep(gurtd, task["id"])
    assert code == 200 and kept["review"] == "kept", kept
    assert Path(owner_folder, "renamed.txt").read_text() == "hello\n"
    assert not os.path.lexists(os.path.join(owner_folder, "a.txt"))
    assert Path(owner_folder, "sub/hl").read_text() == "bee\n"
    assert Path(owner_folder, "sub/b.txt").read_text() == "bee\n"


def test_the_owners_delete_or_edit_of_a_file_the_task_renamed_is_still_a_conflict(
        gurtd: Gurtd, owner_folder: str) -> None:
    """The same renames, but while the task runs the owner deletes one original and edits
    the other: both new names are conflicts (the owner's work) as the old ones are, and
    nothing is kept."""
    task = gurtd.create("\n".join(f"cd '{owner_folder}' && {line}" for line in (
        "mv a.txt renamed.txt", "mv script.sh run.sh", "sleep 30; true")), folder=owner_folder)
    wait_for_step(gurtd, task["id"], f"cd '{owner_folder}' && sleep 30; true")
    os.unlink(os.path.join(owner_folder, "a.txt"))
    with open(os.path.join(owner_folder, "script.sh"), "a") as f:
        f.write("echo the owner's line\n")
    end_sleep(gurtd, task)
    assert gurtd.wait(task["id"])["state"] == "done"
    code, answer = keep(gurtd, task["id"])
    assert code == 409, answer
    assert {(c["path"], c["why"]) for c in answer["conflicts"]} == {
        ("a.txt", "deleted by the owner after the task started"),
        ("script.sh", "changed by the owner after the task started"),
        ("renamed.txt", "deleted by the owner after the task started"),
        ("run.sh", "deleted by the owner after the task started")}
    assert not os.path.lexists(os.path.join(owner_folder, "renamed.txt"))
    assert not os.path.lexists(os.path.join(owner_folder, "run.sh"))


def longest_gil_hold(work: Callable[[], Any]) -> tuple[Any, float, float]:
    """(work's result, its seconds, the longest a thread that wakes each ms waited for the
    GIL meanwhile): what the loop thread would have waited."""
    gap, done = [0.0], threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gap[0], last = max(gap[0], now - last), now
    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    gap[0] = 0.0
    start = time.monotonic()
    try:
        result = work()
    finally:
        spent = time.monotonic() - start
        done.set()
        ticker.join()
    return result, spent, gap[0]


def test_a_million_changed_paths_are_sorted_and_encoded_without_holding_the_loop() -> None:
    """A task that made 1,000,000 empty files in my folder (four minutes of a task): GET
    /changes held the loop 2.65 s (GET /api/tasks at its slowest meanwhile), its diff 1.96
    s: the list was sorted, then encoded as JSON, each in one C call, which holds the GIL
    from the loop thread for all of it.  Now each is done in slices: no wait past a quarter
    of the work (a slice is a fiftieth of it), and the same list and text as before."""
    paths = [f"many/{n}" for n in range(600_000)]
    random.Random(7).shuffle(paths)
    key = lambda path: path.split("/")            # noqa: E731 (upper_changes' key)
    ordered, spent, held = longest_gil_hold(lambda: G.sorted_in_slices(paths, key))
    assert ordered == sorted(paths, key=key)
    assert held < spent / 4, (held, spent)
    changes = [{"folder": "/home/me/proj", "path": path, "change": "added"} for path in paths]
    text, spent, held = longest_gil_hold(lambda: G.json_text(changes))
    assert text == json.dumps(changes).encode()
    assert held < spent / 4, (held, spent)


def test_the_json_of_a_million_changes_is_written_without_one_call_the_size_of_it() -> None:
    """After the sort and the encoding were sliced, GET /changes of 1,000,000 changes still
    held the loop 150-190 ms at once: the slices' texts were joined into one 70 MB str, a
    fresh allocation written in one C call (its page faults), and then encoded into another.
    Now each slice's bytes are appended to one bytearray as it is made: no wait past an eighth
    of the work, and the same bytes as json.dumps."""
    changes = [{"folder": "/home/me/proj", "path": f"many/{n}", "change": "added"}
               for n in range(600_000)]
    text, spent, held = longest_gil_hold(lambda: G.json_text(changes))
    assert text == json.dumps(changes).encode()
    assert held < spent / 8, (held, spent)


def test_the_diff_of_a_million_new_files_is_written_once_a_part_at_a_time() -> None:
    """The diff of a task's 500,000 new files in my folder held the loop 77 ms at once: its
    parts were joined, the folder's line put before them, the text encoded: three fresh 27 MB
    texts, each written in one C call (and held two at a time).  The parts now go one by one
    into the answer's bytes: the same bytes, held about once."""
    parts = ["# folder /home/me/proj\n"] + [
        f"diff --git a/many/{n} b/many/{n}\nnew file mode 100644\n" for n in range(600_000)]
    size = sum(map(len, parts))
    tracemalloc.start()
    try:
        text = G.DiffBudget().final_bytes(parts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert text == "".join(parts).encode()
    assert peak < 1.3 * size, (peak, size)


def test_a_task_folder_of_600000_files_is_listed_and_walked_without_holding_the_loop(
        scratch: Any) -> None:
    """A task's folder of 1,000,000 empty files in my folder's copy: reading it for the
    changes, the diff or a keep still held the loop 270-300 ms at once (the red team's 1 ms
    ticker): the folder's names were sorted in one C call, every full collection of the
    garbage collector walked the entries listed so far, and a listing cut short (a 413) let
    go of a million entries in one call.  600,000 now: no wait past a fortieth of the work
    (old: 190-200 ms of 5 s), every entry listed.  Any other walk of it (its size counted,
    its removal once the task is undone) put its names in a set and sorted them, each one
    call (194 ms of 1.55 s): no wait past a thirtieth."""
    upper = os.path.join(str(scratch), "upper", "many")
    os.makedirs(upper)
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n in range(600_000):
            os.mknod(str(n), dir_fd=fd)
    finally:
        os.close(fd)
    count, spent, held = longest_gil_hold(lambda: sum(
        1 for _ in G.upper_changes(os.path.dirname(upper))))
    assert count == 600_001
    assert held < spent / 40, (held, spent)
    (_, entries), spent, held = longest_gil_hold(lambda: G.tree_usage(upper))
    assert entries == 600_000
    assert held < spent / 30, (held, spent)


def test_a_keep_record_of_200000_paths_is_written_and_read_without_holding_the_loop(
        scratch: Any) -> None:
    """Keep and undo of a task's 199,000 new files held the loop 329 and 249 ms at once (a
    real gurtd): kept.json of 200,000 ops was written in one C call (184 ms) and read in one
    (430-580 ms, most of it collections walking the lists of each op's after and the dicts
    holding them).  Now written a slice at a time, the very bytes, and read with a hook that
    makes each after a tuple: no wait past a fifth of either."""
    ops = [{"folder": 0, "path": f"many/{n}", "kind": "file", "mode": 0o644, "saved": None,
            "replace": False, "after": (1000 + n, 1764800000123456789)} for n in range(200_000)]
    record = {"applied": [f"0:many/{n}" for n in range(200_000)],
              "keeps": [{"id": "k1", "at": "2026-12-04T01:00:00Z", "ops": ops}]}
    path = os.path.join(str(scratch), "kept.json")
    _, spent, held = longest_gil_hold(lambda: G.write_record(path, record))
    assert held < spent / 5, ("written", held, spent)
    with open(path, "rb") as f:
        assert f.read() == json.dumps(record, separators=(",", ":")).encode() + b"\n"
    loaded, spent, held = longest_gil_hold(lambda: G.load_json(path, hook=G.kept_op))
    assert loaded == record
    assert held < spent / 5, ("read", held, spent)


# the worker's gate (red team: a task's code only past it) ######################################

FORGE = r"""
import os
forged = opened = 0
for pid in os.listdir('/proc'):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        fds = os.listdir(f'/proc/{pid}/fd')
    except OSError:
        continue
    for fd in fds:
        try:
            w = os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        opened += 1
        try:
            os.write(w, b'{"t":"step","text":"forged","at":0}\n{"t":"exit","code":0}\n')
            forged += 1
        except OSError:
            pass
        os.close(w)
print('opened', opened, 'forged', forged)
"""


def test_a_task_cannot_write_its_workers_report_pipe_through_proc(gurtd: Gurtd) -> None:
    """The task's line opens every fd of every process it can see under /proc for writing
    and writes a forged step (timed at the epoch) and exit there: its worker runs as its uid
    but is not dumpable, so none of its fds opens (what opens is the line's own output pipes:
    stdout lines); the log has no forged step or exit, and every step is timed after the
    task was created, in order."""
    from conftest import python_line
    task = gurtd.run_done(python_line(FORGE) + "; sleep 0.2", hosts=["198.18.9.9:9"])
    entries = gurtd.log(task["id"])
    assert [e for e in entries if e["type"] == "step" and e["text"] == "forged"] == []
    assert [e["code"] for e in entries if e["type"] == "exit"] == [0], entries
    steps = [e["time"] for e in entries if e["type"] == "step"]
    assert len(steps) == 1 and steps[0] >= task["createdAt"], (steps, task)
    times = [e["time"] for e in entries]
    assert times == sorted(times), entries


def test_a_burst_of_hosts_tasks_each_begins_in_its_own_namespace_as_its_own_user(
        gurtd: Gurtd) -> None:
    """50 tasks with hosts posted at once (maxRunningTasks 50): the first line of each runs
    past its gate, as its own user (named: its passwd entry written), in a network
    namespace of its own, never the host's, where the host's loopback listener is out of
    reach (each holds its namespace till all 50 have run their lines).  After, no user or
    veth of them is left."""
    import socket
    import conftest
    from concurrent.futures import ThreadPoolExecutor
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    host_ns = os.readlink("/proc/self/ns/net")
    reach = ("python3 -c \"import socket; s=socket.socket(); s.settimeout(2); "
             f"print('reach', s.connect_ex(('127.0.0.1', {port})) == 0)\"")
    gurtd.api("PUT", "/api/settings", {"maxRunningTasks": 50})
    lines = "\n".join(["id -un; readlink /proc/self/ns/net", reach, "sleep 30; true"])
    try:
        with ThreadPoolExecutor(16) as pool:
            made = list(pool.map(lambda _: gurtd.create(lines, hosts=["198.18.9.9:9"]),
                                 range(50)))
            for task in made:                  # all 50 at once: their namespaces alive
                wait_for_step(gurtd, task["id"], "sleep 30; true", timeout=120)
            list(pool.map(lambda t: end_sleep(gurtd, t), made))
        ended = [gurtd.wait(t["id"], timeout=60) for t in made]
    finally:
        listener.close()
    assert [t["state"] for t in ended] == ["done"] * 50, [t.get("error") for t in ended]
    namespaces = set()
    for task in ended:
        out = gurtd.output(task["id"])
        assert out[0] == task["user"] and out[2] == "reach False", (task["id"], out)
        assert out[1] != host_ns, (task["id"], out)
        namespaces.add(out[1])
    assert len(namespaces) == 50
    names = {t["user"] for t in ended}
    conftest.eventually(lambda: not names & conftest.passwd_names(), 20, "the tasks' users gone")
    conftest.eventually(lambda: not [x for x in conftest.leftovers() if x.startswith("veth ")], 20,
               "no veth left")


def test_starts_whose_network_fails_after_the_spawn_leave_no_worker_and_no_fd(
        gurtd: Gurtd) -> None:
    """gurtd's nftables table is deleted behind its back: each start of a task with hosts
    spawns its worker, then fails to make its network (nft refuses the task's elements).
    50 such tasks fail `could not start`, none of them ran a line, no worker of them is left
    at its gate (the spawner's children), gurtd holds no more fds than before, and no user
    or veth of them stays."""
    import subprocess
    import conftest
    assert gurtd.proc is not None
    table = conftest.nft_table(gurtd.home)
    gurtd.run_done("true", hosts=["198.18.9.9:9"])      # what a first network opens, opened
    fds = f"/proc/{gurtd.proc.pid}/fd"
    before = len(os.listdir(fds))
    subprocess.run(["nft", "delete", "table", "inet", table], check=True)
    try:
        made = [gurtd.create("echo ran", hosts=["198.18.9.9:9"]) for _ in range(50)]
        ended = [gurtd.wait(t["id"]) for t in made]
    finally:
        subprocess.run(["nft", "add", "table", "inet", table], check=True)
    assert {t["state"] for t in ended} == {"failed"}, ended
    assert all(t["error"].startswith("could not start: ") for t in ended), ended[0]
    for task in ended:
        assert not [e for e in gurtd.log(task["id"]) if e["type"] in ("step", "stdout")]
    spawner = Path(f"/proc/{gurtd.proc.pid}/task/{gurtd.proc.pid}/children").read_text().split()

    def workers() -> list[str]:
        return [w for s in spawner for w in Path(f"/proc/{s}/task/{s}/children").read_text()
                .split()]
    conftest.eventually(lambda: not workers(), 10, "no worker left")
    conftest.eventually(lambda: len(os.listdir(fds)) <= before, 10,   # an API connection's
                        f"at most {before} fds")                     # socket may linger
    names = {t["user"] for t in ended}
    assert not names & conftest.passwd_names()
    conftest.eventually(lambda: not [x for x in conftest.leftovers() if x.startswith("veth ")],
                        10, "no veth left")
    assert gurtd.run_done("echo next")["state"] == "done"
