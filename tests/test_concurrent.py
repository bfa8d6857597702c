"""Tasks side by side (issue 21): the finish-time merge keeps every task's work.

Each story makes tasks that overlap in time on purpose: a task edits its view, then waits on
an `ask` (its gate) until the test answers it, so the test decides the order in which tasks
end.  A merge the tasks' layers cannot settle alone becomes an approval of kind `conflict`.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import http.client
import io
import json
import os
import random
import stat
import tarfile
import time
import tracemalloc
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import gurtd as G
from conftest import (Gurtd, eventually, gurtd_on_done_layers, read_until, registry,
                      running_gurtd, sse, started)

GATE = "gurtd tool ask '{\"question\": \"end?\"}'"


def gated(g: Gurtd, command: str, **fields: Any) -> str:
    """A task that runs command, then waits at its gate; its id once it waits there."""
    task = g.create(command + "\n" + GATE, tools=["ask"], **fields)
    gate(g, task["id"])
    return task["id"]


def pending(g: Gurtd, task_id: str, kind: str) -> dict[str, Any] | None:
    rows = g.api("GET", f"/api/approvals?state=pending&task={task_id}")
    return next((a for a in rows if a["kind"] == kind), None)


def gate(g: Gurtd, task_id: str) -> dict[str, Any]:
    def at_gate() -> Any:
        task = g.task(task_id)
        assert task["state"] in ("running", "waiting", "queued"), (task, g.log(task_id))
        return pending(g, task_id, "ask")
    return eventually(at_gate, 30, f"task {task_id} at its gate")


def end(g: Gurtd, task_id: str) -> dict[str, Any]:
    """Open the task's gate; the task once it is done, failed or waits on a conflict."""
    g.api("POST", f"/api/approvals/{gate(g, task_id)['id']}/answer", {"answer": "go"})
    return settled(g, task_id)


def settled(g: Gurtd, task_id: str) -> dict[str, Any]:
    def state() -> Any:
        task = g.task(task_id)
        if task["state"] in ("done", "failed", "undone"):
            return task
        return task if task["state"] == "waiting" and pending(g, task_id, "conflict") \
            else None
    return eventually(state, 30, f"task {task_id} settled")


def put(g: Gurtd, path: str, text: str) -> None:
    """A file in the view of home (an upload: a layer of its own)."""
    status, task, _ = g.request("PUT", f"/api/workspaces/home/files/{path}",
                                raw=text.encode(),
                                headers={"Content-Type": "application/octet-stream"})
    assert status == 201 and task["state"] == "done", task


def event_seen(g: Gurtd, match: Any) -> dict[str, Any]:
    """The first event on /api/events (replayed from the start) that match(kind, data)."""
    with g.stream("/api/events?since=0", timeout=15) as resp:
        assert resp.status == 200
        for _, kind, text in sse(resp):
            if match(kind, data := json.loads(text)):
                return data
    raise AssertionError("the event stream ended")


def lines(n: int) -> str:
    return "".join(f"line {i}\n" for i in range(1, n + 1))


def test_two_tasks_appending_to_one_file_both_kept(gurtd: Gurtd) -> None:
    """Two tasks made together each append a line to shared.txt: both lines stay, the one
    that ended first above; the later task says it merged shared.txt, in its log too."""
    put(gurtd, "shared.txt", "top\n")
    a = gated(gurtd, "echo from-a >> shared.txt")
    b = gated(gurtd, "echo from-b >> shared.txt")
    assert end(gurtd, b)["state"] == "done"
    task = end(gurtd, a)
    assert task["state"] == "done", task
    assert gurtd.file("home", "shared.txt") == b"top\nfrom-b\nfrom-a\n"
    assert task["merged"] == ["shared.txt"]
    assert "merged" not in gurtd.task(b)
    merges = [e for e in gurtd.log(a) if e["type"] == "merge"]
    assert merges and merges[0]["merged"] == ["shared.txt"]


def test_lines_2_and_19_of_a_20_line_file_merged(gurtd: Gurtd) -> None:
    """One task changes line 2, another line 19 of one file, side by side: the view holds
    both changes; a file only one of them changed is kept as that one left it."""
    put(gurtd, "f.txt", lines(20))
    a = gated(gurtd, "sed -i 's/^line 2$/two by a/' f.txt; echo a > only-a.txt")
    b = gated(gurtd, "sed -i 's/^line 19$/nineteen by b/' f.txt; echo b > only-b.txt")
    assert end(gurtd, a)["state"] == "done"
    assert end(gurtd, b)["state"] == "done"
    want = lines(20).replace("line 2\n", "two by a\n").replace("line 19\n", "nineteen by b\n")
    assert gurtd.file("home", "f.txt").decode() == want
    assert gurtd.file("home", "only-a.txt") == b"a\n"
    assert gurtd.file("home", "only-b.txt") == b"b\n"
    assert gurtd.task(b)["merged"] == ["f.txt"]


def test_a_merged_task_shows_its_own_change(gurtd: Gurtd) -> None:
    """After the merge of lines 2 and 19, the later task's diff and changes are taken
    against the version it merged with: its line 19 only, never a's line 2 as its own."""
    put(gurtd, "f.txt", lines(20))
    a = gated(gurtd, "sed -i 's/^line 2$/two by a/' f.txt")
    b = gated(gurtd, "sed -i 's/^line 19$/nineteen by b/' f.txt; echo b > only-b.txt")
    assert end(gurtd, a)["state"] == "done"
    assert end(gurtd, b)["state"] == "done"
    diff = gurtd.api("GET", f"/api/tasks/{b}/diff", status=200)
    changed = [line for line in diff.decode().splitlines()
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == ["-line 19", "+nineteen by b", "+b"], diff.decode()
    assert sorted(c["path"] for c in gurtd.api("GET", f"/api/tasks/{b}/changes")) == \
        ["f.txt", "only-b.txt"]
    status, diff, _ = gurtd.request("GET", f"/api/tasks/{a}/diff")
    assert b"+two by a" in diff and b"nineteen" not in diff


def checked_by_views(g: Gurtd, task_id: str) -> bool:
    """Did gurtd open views to check the task at its end (its log says so)?"""
    return f"task {task_id}: finish-time check by views" in g.log_text()


def stored(g: Gurtd, task_id: str) -> dict[str, Any]:
    with open(os.path.join(g.home, "tasks", task_id + ".json")) as f:
        return json.load(f)


def test_path_sets_meet_only_where_a_check_could_find_something(tmp_path: Any,
                                                                 monkeypatch: Any) -> None:
    """The first look's path sets: files in one folder of one mode do not meet; the same
    file, a file under the other's whiteout or opaque folder, a folder of another mode, or a
    set past its bound (unknown) do."""
    def layer(name: str, files: list[str], folders: dict[str, int] | None = None) -> Any:
        root = tmp_path / name
        for path, mode in (folders or {}).items():
            (root / path).mkdir(parents=True)
            os.chmod(root / path, mode)
        for path in files:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(name)
        root.mkdir(exist_ok=True)
        return root

    mine = G.layer_paths(str(layer("mine", ["src/a.py", "top.txt"], {"src": 0o755})))
    assert mine == {"src": 0o755, "src/a.py": -1, "top.txt": -1}
    beside = G.layer_paths(str(layer("beside", ["src/b.py"], {"src": 0o755})))
    assert not G.paths_meet(mine, beside) and not G.paths_meet(mine, {})
    assert G.paths_meet(mine, G.layer_paths(str(layer("same", ["top.txt"]))))
    assert G.paths_meet(mine, G.layer_paths(str(layer("mode", ["src/c.py"], {"src": 0o700}))))
    gone = layer("gone", [])
    os.mknod(gone / "src", 0o600 | stat.S_IFCHR, os.makedev(0, 0))      # a whiteout
    assert G.layer_paths(str(gone)) == {"src": G.PATH_WHITEOUT} and G.paths_meet(mine, {"src": -1})
    opaque = layer("opaque", ["src/new.py"], {"src": 0o755})
    os.setxattr(opaque / "src", "trusted.overlay.opaque", b"y")
    assert G.paths_meet(mine, G.layer_paths(str(opaque)))
    monkeypatch.setattr(G, "LAYER_PATHS_MAX", 2)
    assert G.layer_paths(str(tmp_path / "mine")) is None
    assert G.paths_meet(None, beside)


def test_a_layers_path_set_stops_at_its_cap_while_a_folder_is_read(tmp_path: Any,
                                                                     monkeypatch: Any) -> None:
    """A task's folder of 30,000 names: its path set is unknown past LAYER_PATHS_MAX, and a
    listing past CHANGES_MAX_BYTES of paths fails, each found while the folder is read:
    never all its names held at once on the merge thread (~5 MB here, gigabytes for a task
    that makes millions)."""
    many = tmp_path / "upper" / "many"
    many.mkdir(parents=True)
    for i in range(30_000):
        os.mknod(many / f"a-file-of-the-task-number-{i:06d}")
    monkeypatch.setattr(G, "LAYER_PATHS_MAX", 100)
    monkeypatch.setattr(G, "CHANGES_MAX_BYTES", 10_000)
    for listing in (lambda: G.layer_paths(str(tmp_path / "upper")),
                    lambda: G.layer_entries(str(tmp_path / "upper"))):
        tracemalloc.start()
        try:
            try:
                outcome: Any = listing()
            except OSError as exc:
                outcome = exc.errno
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert outcome in (None, errno.EFBIG), outcome
        assert peak < 500_000, f"{peak} bytes held to list a folder past the cap"


@pytest.mark.pure
def test_an_undos_region_meets_only_layers_that_could_change_its_revert() -> None:
    """A revert of src/a.py and top.txt, checked again once the stack moved: a layer that
    holds only src (a folder on the way, of the same kind) cannot change what it decided,
    unless it wrote a file there (the folder's mode) or read src's version; a layer that
    holds a marked path, hides one, changes one below, or is unknown can."""
    region = G.Region.of(["src/a.py", "top.txt"])
    beside = {"src": 0o755, "src/b.py": G.PATH_HIDES}
    assert region.entries(beside) == {"src": 0o755}
    assert not region.meets(beside, set(), False) and not region.meets({"x": -1}, set(), False)
    assert region.meets(beside, set(), True) and region.meets(beside, {"src"}, False)
    assert region.meets({"top.txt": G.PATH_WHITEOUT}, set(), False)
    assert region.meets({"src": G.PATH_WHITEOUT}, set(), False)
    assert region.meets(None, set(), False)
    below = {"src": 0o755, "src/a.py": G.PATH_OPAQUE, "src/a.py/n": G.PATH_HIDES,
             **{f"x{i}": G.PATH_HIDES for i in range(10)}}     # past the region's size
    assert region.entries(below) == {"src": 0o755, "src/a.py": G.PATH_OPAQUE,
                                     "src/a.py/n": G.PATH_HIDES}
    assert region.meets(below, set(), False)


def test_a_dense_file_past_the_digest_cap_is_a_version_of_its_own(tmp_path: Any,
                                                                    monkeypatch: Any) -> None:
    """A dense file past DIGEST_MAX_BYTES is not hashed: each read of it is a version equal
    to nothing (cannot say: a conflict, never a loss), while a smaller one is compared."""
    monkeypatch.setattr(G, "DIGEST_MAX_BYTES", 1 << 20)
    (tmp_path / "big").write_bytes(os.urandom(2 << 20))
    (tmp_path / "small").write_bytes(os.urandom(1 << 20))
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        big = [G.view_version(fd, "big") for _ in range(2)]
        assert [v.kind for v in big] == ["file", "file"] and not big[0].same(big[1])
        assert G.view_version(fd, "small").same(G.view_version(fd, "small"))
    finally:
        os.close(fd)


def test_a_task_that_changed_nothing_is_done_without_a_check(gurtd: Gurtd) -> None:
    """A task that changed no file, ending after another task became done beside it, is done
    at once: no check, so its record names no stack it was merged on."""
    a = gated(gurtd, "echo a > a.txt")
    quiet = gated(gurtd, "true")
    assert end(gurtd, a)["state"] == "done"
    assert end(gurtd, quiet)["state"] == "done"
    assert os.listdir(os.path.join(gurtd.home, "layers", quiet, "upper")) == []
    assert stored(gurtd, quiet)["mergedOn"] is None
    assert not checked_by_views(gurtd, quiet)
    assert gurtd.file("home", "a.txt") == b"a\n"


def test_a_task_on_other_paths_is_done_without_views(gurtd: Gurtd) -> None:
    """Tasks side by side on files of their own in one folder are done without a view
    opened (their paths do not meet); two appending to one file are checked by views, and
    both kept."""
    put(gurtd, "shared.txt", "top\n")
    a = gated(gurtd, "mkdir -p d && echo a > d/a.txt")
    b = gated(gurtd, "mkdir -p d && echo b > d/b.txt; echo b > b.txt")
    c = gated(gurtd, "echo from-c >> shared.txt")
    d = gated(gurtd, "echo from-d >> shared.txt")
    for task_id in (a, b, c, d):
        assert end(gurtd, task_id)["state"] == "done"
    assert not checked_by_views(gurtd, b)
    assert stored(gurtd, b)["mergedOn"] is not None     # based on the stack with a's layer
    assert checked_by_views(gurtd, d)
    assert gurtd.file("home", "d/a.txt") == b"a\n" and gurtd.file("home", "d/b.txt") == b"b\n"
    assert gurtd.file("home", "shared.txt") == b"top\nfrom-c\nfrom-d\n"
    assert gurtd.task(d)["merged"] == ["shared.txt"]


def conflict_story(g: Gurtd, later: str, earlier: str) -> tuple[str, dict[str, Any]]:
    """Two tasks side by side on f.txt; the later one's pending conflict approval."""
    put(g, "f.txt", lines(20))
    a = gated(g, later)
    b = gated(g, earlier)
    assert end(g, b)["state"] == "done"
    task = end(g, a)
    assert task["state"] == "waiting", task
    approval = pending(g, a, "conflict")
    assert approval is not None and approval["canAlwaysApprove"] is False
    return a, approval


def test_delete_against_edit_is_a_conflict(gurtd: Gurtd) -> None:
    """A task deletes a file another one edited meanwhile: a conflict names the file with
    its three versions; on /api/events like every approval; approve-all passes it by."""
    a, approval = conflict_story(gurtd, "rm f.txt", "sed -i 's/^line 5$/five/' f.txt")
    [path] = approval["args"]["paths"]
    assert path["path"] == "f.txt" and "deleted by the task" in path["why"]
    assert path["task"] == {"kind": "absent"}
    assert path["before"]["text"] == lines(20) and "five\n" in path["view"]["text"]
    assert event_seen(gurtd, lambda kind, data: kind == "approval" and
                      data["id"] == approval["id"])["kind"] == "conflict"
    assert gurtd.api("POST", "/api/approvals/approve-all", {})["approved"] == 0
    # a policy for it exists, and yet:
    gurtd.api("POST", "/api/policies", {"tool": "merge", "scope": "box"}, status=201)
    assert pending(gurtd, a, "conflict")["id"] == approval["id"]
    assert gurtd.file("home", "f.txt") is not None and b"five" in gurtd.file("home", "f.txt")


@pytest.mark.parametrize("answer", ["task", "view", "text", "deny"])
def test_a_conflict_answered(gurtd: Gurtd, answer: str) -> None:
    """Both tasks change line 5 (and the later one line 15): each answer gives its view."""
    a, approval = conflict_story(gurtd, "sed -i 's/^line 5$/five by a/; s/^line 15$/15 a/' "
                                 "f.txt; echo new > new.txt",
                                 "sed -i 's/^line 5$/five by b/' f.txt")
    path = approval["args"]["paths"][0]
    assert "<<<<<<< task" in path["diff3"] and "======" in path["diff3"]
    by_a = lines(20).replace("line 5\n", "five by a\n").replace("line 15\n", "15 a\n")
    by_b = lines(20).replace("line 5\n", "five by b\n")
    url = f"/api/approvals/{approval['id']}"
    if answer == "deny":
        gurtd.api("POST", url + "/deny", {"reason": "not like this"})
        task = gurtd.wait(a)
        assert task["state"] == "failed" and "not like this" in task["error"]
        assert gurtd.file("home", "f.txt").decode() == by_b
        assert gurtd.file("home", "new.txt") is None
        return
    body: dict[str, Any] = {}
    if answer == "view":
        body = {"args": {"keep": "view"}}
    if answer == "text":
        body = {"args": {"texts": {"f.txt": "merged by hand\n"}}}
    gurtd.api("POST", url + "/approve", body)
    assert gurtd.wait(a)["state"] == "done"
    want = {"task": by_a, "view": by_b, "text": "merged by hand\n"}[answer]
    assert gurtd.file("home", "f.txt").decode() == want
    assert gurtd.file("home", "new.txt") == b"new\n"   # what did not conflict stays


def test_a_huge_file_of_holes_changed_both_ways_is_a_conflict_at_once(gurtd: Gurtd) -> None:
    """Two tasks each make a 1 TiB file of holes at one path (one with a byte in it): the
    check reads only their data, so the conflict is asked in seconds (hashing the zeros
    would hold the merge thread, every task's, for hours); an undo under such a file, later
    grown by another task, is decided as quickly."""
    a = gated(gurtd, "truncate -s 1T big; echo a > a.txt")
    b = gated(gurtd, "truncate -s 1T big; printf x | dd of=big bs=1 seek=4096 conv=notrunc")
    assert end(gurtd, b)["state"] == "done"
    assert end(gurtd, a)["state"] == "waiting"
    [path] = pending(gurtd, a, "conflict")["args"]["paths"]
    assert path["path"] == "big" and "too large to merge" in path["why"]
    gurtd.api("POST", f"/api/approvals/{pending(gurtd, a, 'conflict')['id']}/deny", {})
    assert gurtd.wait(a)["state"] == "failed"
    grow = gurtd.run("printf y | dd of=big bs=1 seek=8192 conv=notrunc")
    assert grow["state"] == "done"
    answer = gurtd.api("POST", f"/api/tasks/{b}/undo")
    assert answer["state"] == "undone", answer
    said = answer.get("undoMerge") or {}
    if said.get("state") != "done":
        said = eventually(lambda: (gurtd.task(b).get("undoMerge") or {}).get("state") in
                          ("done", "failed") and gurtd.task(b)["undoMerge"], 60, "the revert")
    assert said["state"] == "done" and [k["path"] for k in said["kept"]] == ["big"], said


def test_the_views_huge_file_under_a_tasks_opaque_folder_is_copied_with_its_holes(
        gurtd: Gurtd) -> None:
    """A task makes d opaque (removed and made again, its file as it was) while another
    grows d/a to 1 TiB of holes: the view's version goes into the first one's layer piece by
    piece with its holes (read whole, it was a 1 TiB read into gurtd's memory)."""
    put(gurtd, "d/a", "x\n")
    put(gurtd, "d/b", "")
    a = gated(gurtd, "rm -rf d && mkdir d && printf 'x\\n' > d/a && : > d/b")
    b = gated(gurtd, "truncate -s 1T d/a d/b")                 # d/b: holes only
    assert end(gurtd, b)["state"] == "done"
    assert end(gurtd, a)["state"] == "done", gurtd.log(a)
    upper = os.path.join(gurtd.home, "layers", a, "upper")
    assert os.getxattr(os.path.join(upper, "d"), "trusted.overlay.opaque") == b"y"
    for name in ("a", "b"):
        st = os.stat(os.path.join(upper, "d", name))
        assert st.st_size == 1 << 40 and st.st_blocks * 512 < 1 << 20, (name, st)
    with open(os.path.join(upper, "d", "a"), "rb") as f:
        assert f.read(3) == b"x\n\0"
    assert not [n for n in os.listdir(os.path.join(upper, "d")) if n.startswith(".gurt")]


def test_every_kind_of_conflict_is_named(gurtd: Gurtd) -> None:
    """A folder against a file, a binary file, a mode and a symlink target changed both
    ways: one conflict names each path with why; keep view gives the view's for all."""
    assert gurtd.run("printf 'a\\0b' > bin; echo m > mode.txt; ln -s one link; "
                     "echo f > thing")["state"] == "done"
    a = gated(gurtd, "printf 'task\\0' > bin; chmod 755 mode.txt; ln -sfn two link; "
                     "rm thing; mkdir thing; echo in > thing/x")
    b = gated(gurtd, "printf 'view\\0' > bin; chmod 600 mode.txt; ln -sfn three link; "
                     "echo g > thing")
    assert end(gurtd, b)["state"] == "done"
    assert end(gurtd, a)["state"] == "waiting"
    approval = pending(gurtd, a, "conflict")
    why = {p["path"]: p["why"] for p in approval["args"]["paths"]}
    assert why["bin"] == "binary file changed both ways"
    assert why["mode.txt"] == "mode changed both ways"
    assert why["link"] == "symlink target changed both ways"
    assert why["thing"] == "a folder on one side, a file on the other"
    paths = {p["path"]: p for p in approval["args"]["paths"]}
    assert paths["link"]["task"] == {"kind": "symlink", "target": "two"}
    assert paths["mode.txt"]["view"]["mode"] == "0600"
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {"args": {"keep": "view"}})
    assert gurtd.wait(a)["state"] == "done"
    assert gurtd.file("home", "bin") == b"view\0" and gurtd.file("home", "thing") == b"g\n"
    code, data, _ = gurtd.request("GET", "/api/workspaces/home/files/thing/x")
    assert code == 404 or code == 400, (code, data)


def test_conflict_args_are_checked(gurtd: Gurtd) -> None:
    a, approval = conflict_story(gurtd, "echo x > f.txt", "echo y > f.txt")
    url = f"/api/approvals/{approval['id']}/approve"
    for args in ({"keep": "mine"}, {"texts": {"other.txt": "x"}}, {"texts": {"f.txt": 1}}):
        gurtd.api("POST", url, {"args": args}, status=400)
    gurtd.api("POST", f"/api/approvals/{approval['id']}/always", {"scope": "task"}, status=409)
    gurtd.api("POST", url, {})
    assert gurtd.wait(a)["state"] == "done" and gurtd.file("home", "f.txt") == b"x\n"


def test_merge_past_merged_groups() -> None:
    """With groups of 2 (merged layers from the fifth task on), the check reads the views
    through merged layers: the appends of two tasks side by side are both kept."""
    with running_gurtd({"GURT_LAYER_GROUP": "2", "GURT_LAYER_KEEP": "1"}) as g:
        put(g, "log.txt", "0\n")
        for i in range(1, 6):
            assert g.run(f"echo {i} >> log.txt")["state"] == "done"
        eventually(lambda: g.api("GET", "/api/workspaces/home")["mergedLayers"] >= 1, 20)
        a = gated(g, "echo a >> log.txt")
        b = gated(g, "echo b >> log.txt")
        assert end(g, b)["state"] == "done"
        assert end(g, a)["state"] == "done"
        assert g.file("home", "log.txt") == b"0\n1\n2\n3\n4\n5\nb\na\n"


def test_side_by_side_past_128_tasks_and_the_kernels_500_lowers() -> None:
    """600 done layers (four merged layers of 128 below the newest 64; past the kernel's
    500 lowers): two tasks side by side append to a file of the oldest merged layer and
    change one file at both ends: both kept; the undo of the one that ended first takes
    its change out of the other's copies."""
    with gurtd_on_done_layers(600) as (g, _):
        eventually(lambda: len(registry(g.home)["merged"]) >= 4, 300, "the merges")
        put(g, "f.txt", lines(20))
        a = gated(g, "echo a >> n5; sed -i 's/^line 2$/A/' f.txt")
        b = gated(g, "echo b >> n5; sed -i 's/^line 19$/B/' f.txt")
        assert end(g, b)["state"] == "done"
        task = end(g, a)
        assert task["state"] == "done" and task["merged"] == ["f.txt", "n5"], task
        assert g.file("home", "n5") == b"5\nb\na\n"
        both = lines(20).replace("line 2\n", "A\n")
        assert g.file("home", "f.txt").decode() == both.replace("line 19\n", "B\n")
        assert sorted(undo(g, b)["reverted"]) == ["f.txt", "n5"]
        assert g.file("home", "n5") == b"5\na\n"
        assert g.file("home", "f.txt").decode() == both
        assert g.file("home", "n1") == b"1\n" and g.file("home", "n600") == b"600\n"


@pytest.mark.parametrize("point", ["finish-merge-half-written", "merge-temp-written"])
def test_kill_during_a_merge_and_while_a_conflict_waits(point: str) -> None:
    """gurtd killed while a merge is written into the task's layer (after a file, or
    between a file's temp and its rename): after the restart the task is failed, no temp
    is left in a layer or beside them, and the view is the earlier task's alone; killed
    while a conflict waits: the task is failed too, its approval denied."""
    with running_gurtd({"GURT_TEST_CRASH_AT": point}) as g:
        put(g, "a.txt", lines(20))
        put(g, "b.txt", lines(20))
        a = gated(g, "sed -i 's/^line 2$/A/' a.txt b.txt")
        b = gated(g, "sed -i 's/^line 19$/B/' a.txt b.txt")
        assert end(g, b)["state"] == "done"
        g.api("POST", f"/api/approvals/{gate(g, a)['id']}/answer", {"answer": "go"})
        assert g.proc is not None and g.proc.wait(timeout=30) == 137
        layers = os.path.join(g.home, "layers")
        assert point != "merge-temp-written" or \
            [n for n in os.listdir(layers) if n.startswith(G.MERGE_TEMP)], "no temp written"
        g.proc = None
        g.env.pop("GURT_TEST_CRASH_AT")
        g.start()
        task = g.task(a)
        assert task["state"] == "failed" and "restarted" in task["error"]
        assert [n for top, dirs, files in os.walk(layers) for n in dirs + files
                if n.startswith((G.MERGE_TEMP, ".gurt-merge-"))] == []
        want = lines(20).replace("line 19\n", "B\n").encode()
        assert g.file("home", "a.txt") == want and g.file("home", "b.txt") == want
        c, approval = conflict_story(g, "echo c > f.txt", "echo d > f.txt")
        g.restart(kill=True)
        assert g.task(c)["state"] == "failed"
        assert g.api("GET", f"/api/approvals/{approval['id']}")["state"] == "denied"
        assert g.file("home", "f.txt") == b"d\n"


def test_a_conflict_waiting_for_a_person_holds_no_running_place(gurtd: Gurtd) -> None:
    """maxRunningTasks 2: while a task waits on a conflict (its processes ended), two more
    tasks run side by side; the conflict answered later still settles."""
    gurtd.api("PUT", "/api/settings", {"maxRunningTasks": 2})
    a, approval = conflict_story(gurtd, "echo a > f.txt", "echo b > f.txt")
    c = gurtd.create("echo c > c.txt\n" + GATE, tools=["ask"])["id"]
    d = gurtd.create("echo d > d.txt\n" + GATE, tools=["ask"])["id"]
    assert gate(gurtd, c) and gate(gurtd, d)          # both run: a takes no place
    assert gurtd.task(a)["state"] == "waiting"
    e = gurtd.create("echo e > e.txt")["id"]
    time.sleep(1)
    assert gurtd.task(e)["state"] == "queued"         # the limit still holds for the rest
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {})
    assert gurtd.wait(a)["state"] == "done" and gurtd.file("home", "f.txt") == b"a\n"
    for task_id in (c, d):
        assert end(gurtd, task_id)["state"] == "done"
    assert gurtd.wait(e)["state"] == "done"


# The random history: a plain model of what the view must hold ##############################

SLOTS = list(range(1, 30, 3))            # lines tasks edit: two untouched lines between
Files = dict[str, "list[str] | None"]    # a file's lines, None: deleted
BINARY = "d.bin"                          # a binary file: a whole-file slot, never merged
LOG = "log.txt"                           # appended to only: every task's line must stay
MODE = "m.sh"                             # its mode changed only; the model holds [mode]
SCRIPT = b"#!/bin/sh\n"                   # m.sh's content, never changed
MODES = ["0644", "0755", "0700", "0600"]


def starts(longer: list[str], prefix: list[str]) -> bool:
    return longer[:len(prefix)] == prefix


def subsequence(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return len(small) <= len(big) and all(line in it for line in small)


def diff3(base: list[str], theirs: list[str], ours: list[str]) -> list[str] | str:
    """A three-way merge of lines as git merge-file does it: each side's hunks against
    base; hunks of both sides that overlap or touch are a conflict unless they give the
    same lines."""
    def hunks(side: list[str], who: int) -> list[tuple[int, int, list[str], int]]:
        matcher = difflib.SequenceMatcher(None, base, side, autojunk=False)
        return [(i1, i2, side[j1:j2], who) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
                if tag != "equal"]
    groups: list[list[tuple[int, int, list[str], int]]] = []
    for hunk in sorted(hunks(ours, 0) + hunks(theirs, 1)):
        if groups and hunk[0] <= max(h[1] for h in groups[-1]):
            groups[-1].append(hunk)
        else:
            groups.append([hunk])
    out, at = [], 0
    for group in groups:
        start, end = group[0][0], max(h[1] for h in group)
        results = set()
        for who in {h[3] for h in group}:
            lines, pos = [], start
            for s, e, new, _ in (h for h in group if h[3] == who):
                lines += base[pos:s] + new
                pos = e
            results.add(tuple(lines + base[pos:end]))
        if len(results) > 1:
            return "conflict"
        out += base[at:start] + list(results.pop())
        at = end
    return out + base[at:]


def model_merge(base: list[str] | None, theirs: list[str] | None,
                ours: list[str] | None) -> list[str] | None | str:
    """The three-way rule on whole files of lines, as the README states it: one side's
    change wins; two appends keep both, the view's first; an append on one side and the
    base's tail cut on the other give both; deletions nested in one another give the larger;
    else git merge-file's (diff3); a delete against an edit: "conflict"."""
    if ours == theirs or theirs == base:
        return ours
    if ours == base:
        return theirs
    if base is None or theirs is None or ours is None:
        return "conflict"
    if base and starts(ours, base) and starts(theirs, base) or \
            starts(ours, base) and starts(base, theirs):
        return theirs + ours[len(base):]
    if starts(theirs, base) and starts(base, ours):
        return ours + theirs[len(base):]
    if subsequence(theirs, ours) and subsequence(ours, base):
        return theirs
    if subsequence(ours, theirs) and subsequence(theirs, base):
        return ours
    return diff3(base, theirs, ours)


class Model:
    """The workspace as gurtd must hold it: a base and a stack of layers (whole files)."""

    def __init__(self, base: Files) -> None:
        self.base = base
        self.layers: list[tuple[str, Files]] = []        # done, oldest first

    def view(self, layers: list[tuple[str, Files]] | None = None) -> Files:
        out = dict(self.base)
        for _, files in self.layers if layers is None else layers:
            out.update(files)
        return out

    def finish(self, base: Files, ours: Files, answer: Any) -> list[str]:
        """A task ends: the conflicting files (answer(conflicts, sides) gives the person's
        answer, ("task", {}) for none: None deny, or (keep, texts)); its layer joins unless
        denied."""
        view, layer = self.view(), {}
        results = {n: model_merge(base.get(n), view.get(n), o) for n, o in ours.items()}
        conflicts = sorted(n for n, r in results.items() if r == "conflict")
        sides = {n: (base.get(n), view.get(n), o, results[n]) for n, o in ours.items()}
        decision = answer(conflicts, sides)
        if decision is None:
            return conflicts
        keep, texts = decision
        for name, result in results.items():
            if name in texts:
                layer[name] = texts[name].splitlines()
            elif result != "conflict":
                layer[name] = result             # its copy, or the merged text
            elif keep == "task":
                layer[name] = ours[name]
        self.layers.append(("task", layer))
        return conflicts

    def undo(self, index: int) -> list[str]:
        """Undo of the layer at index: its change taken out of later copies (a layer of
        its own on top); the files kept whole.  A mode is one value: a later change of it
        wins (the content beside it is still reverted), never a file kept whole."""
        below, (_, mine), above = self.layers[:index], self.layers[index], \
            self.layers[index + 1:]
        top, under, now = self.view(below + [("", mine)]), self.view(below), self.view()
        del self.layers[index]
        revert, kept = {}, []
        for name in mine:
            if not any(name in files for _, files in above):
                continue
            if name == MODE:
                result = now[name] if now[name] != top[name] else under[name]
            else:
                result = model_merge(top.get(name), under.get(name), now.get(name))
            if result == "conflict":
                kept.append(name)
            elif result != now[name]:
                revert[name] = result
        if revert:
            self.layers.append(("revert", revert))
        return kept


def random_edits(rng: random.Random, made: int, view: Files) -> tuple[Files, list[str]]:
    """Task number made's random edits of the view: slot lines of one or two text files,
    a delete or a rename of one (to a new name), a line appended to the log, a new file in
    a new folder, the binary file replaced, the script's mode changed; (its files as the
    model holds them, the shell commands)."""
    ours: Files = {}
    commands = []
    texts = sorted(n for n, v in view.items() if v is not None and n.endswith(".txt") and
                   "/" not in n and n != LOG)
    for name in rng.sample(texts, min(len(texts), rng.randint(1, 2))):
        edit = rng.random()
        if edit < 0.1 or (edit < 0.15 and name.startswith("r")):
            ours[name] = None
            commands.append(f"rm {name}")
            continue
        if edit < 0.15:
            ours[name], ours[f"r{made}.txt"] = None, list(view[name] or [])
            commands.append(f"mv {name} r{made}.txt")
            continue
        ours[name] = list(view[name] or [])
        for slot in rng.sample(SLOTS, rng.randint(1, 2)):
            if slot < len(ours[name] or []):
                ours[name][slot] = f"t{made} {name} {slot}"       # type: ignore[index]
                commands.append(f"sed -i '{slot + 1}s/.*/t{made} {name} {slot}/' {name}")
        if ours[name] == view[name]:
            del ours[name]
    if rng.random() < 0.3:
        ours[LOG] = list(view[LOG] or []) + [f"t{made} was here"]
        commands.append(f"echo 't{made} was here' >> {LOG}")
    if rng.random() < 0.2:
        ours[f"d{made}/e/new.txt"] = [f"new by t{made}"]
        commands.append(f"mkdir -p d{made}/e && echo 'new by t{made}' > d{made}/e/new.txt")
    if rng.random() < 0.2 and view.get(BINARY) is not None:
        ours[BINARY] = [f"bin t{made}\0"]
        commands.append(f"printf 'bin t{made}\\000\\n' > {BINARY}")
    if rng.random() < 0.2:
        mode = rng.choice([m for m in MODES if [m] != view[MODE]])
        ours[MODE] = [mode]
        commands.append(f"chmod {mode} {MODE}")
    return ours, commands


def view_files(g: Gurtd) -> dict[str, tuple[bytes, str]]:
    """Every file of the view of home: (its bytes, its mode), from the view's archive."""
    data = g.api("GET", "/api/workspaces/home/archive", status=200)
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for info in tar.getmembers():
            if info.isfile():
                f = tar.extractfile(info)
                assert f is not None
                out[info.name.removeprefix("./")] = (f.read(), f"{info.mode:04o}")
    return out


def expected_files(view: Files) -> dict[str, tuple[bytes, str]]:
    """What view_files must give for the model's view (modes only for the script)."""
    out = {}
    for name, lines in view.items():
        if lines is not None:
            out[name] = (SCRIPT, lines[0]) if name == MODE else \
                (("\n".join(lines) + "\n").encode(), "")
    return out


SEEDS = [int(s) for s in os.environ.get("GURT_TEST_SEED", "21").split()]   # "21 1021 7": more


@pytest.mark.parametrize("seed", SEEDS)
def test_random_histories(gurtd: Gurtd, seed: int) -> None:
    """Thirty tasks in a random order of starts, ends and undos, up to six side by side,
    each making random_edits (lines, appends, deletes, renames, new folders, binary files,
    mode changes); conflicts answered at random.  After every end and every undo every file
    of the view, and its set of files, is exactly what the model says: no change is lost
    without a word (a conflict, a person's answer, an undo's kept list).  A failure names
    its seed: GURT_TEST_SEED=<seed> runs that history again."""
    try:
        random_history(gurtd, random.Random(seed))
    except AssertionError as exc:
        raise AssertionError(f"random history of seed {seed} (again: GURT_TEST_SEED={seed})"
                             f": {exc}") from exc


def random_history(gurtd: Gurtd, rng: random.Random) -> None:
    start = [f"line {i}" for i in range(1, 31)]
    base: Files = {name: list(start) for name in ("a.txt", "b.txt", "c.txt")}
    base.update({LOG: ["the log"], BINARY: ["bin base\0"], MODE: ["0644"]})
    for name, lines in base.items():
        if name != MODE:
            put(gurtd, name, "\n".join(lines or []) + "\n")
    assert gurtd.run(f"printf '#!/bin/sh\\n' > {MODE}; chmod 644 {MODE}")["state"] == "done"
    model = Model(base)                     # the uploads and the run above are its base
    running: dict[str, tuple[Files, Files]] = {}     # id -> (the view it saw, its files)
    ids: list[str] = []                     # the model's layers of tasks, by their ids
    made, seen = 0, {"conflict": 0, "merged": 0, "undo": 0, "kept": 0}
    while made < 30 or running:
        step = rng.random()
        if step < 0.12 and ids:
            task_id = rng.choice(ids)
            index = [i for i, (kind, _) in enumerate(model.layers) if kind == "task"][
                ids.index(task_id)]
            ids.remove(task_id)
            kept = model.undo(index)
            answer = gurtd.api("POST", f"/api/tasks/{task_id}/undo")
            assert answer["state"] == "undone"
            said = answer.get("undoMerge") or {"kept": [], "state": "done"}
            assert sorted(k["path"] for k in said["kept"]) == sorted(kept), (said, kept)
            if said["state"] == "writing":
                eventually(lambda: gurtd.task(task_id).get("undoMerge"), 30, "the revert")
            seen["undo"] += 1
            seen["kept"] += len(kept)
        elif made < 30 and (len(running) < 2 or (len(running) < 6 and step < 0.55)):
            made += 1
            view = model.view()
            ours, commands = random_edits(rng, made, view)
            task_id = gated(gurtd, "; ".join(commands) or "true", title=f"t{made}")
            running[task_id] = (view, ours)
        else:
            if not running:
                continue
            task_id = rng.choice(list(running))        # in the order made: ids are random
            task_base, ours = running.pop(task_id)
            task = end(gurtd, task_id)
            asked: dict[str, Any] = {}

            def answer(conflicts: list[str], sides: dict[str, Any]) -> Any:
                approval = pending(gurtd, task_id, "conflict")
                named = sorted(p["path"] for p in approval["args"]["paths"]) if approval \
                    else []
                if not conflicts and not named:
                    return "task", {}
                assert named == conflicts, {n: sides.get(n) for n in
                                            set(named) ^ set(conflicts)}
                choice = rng.choice(["task", "view", "text", "deny"])
                url = f"/api/approvals/{approval['id']}"
                asked["choice"] = choice
                if choice == "deny":
                    gurtd.api("POST", url + "/deny", {"reason": "no"})
                    return None
                args: dict[str, Any] = {"keep": "view" if choice == "view" else "task"}
                if choice == "text":
                    args["texts"] = {n: "".join(f"hand {task_id} {i}\n" for i in range(30))
                                     for n in conflicts if n != MODE}
                gurtd.api("POST", url + "/approve", {"args": args})
                return args["keep"], args.get("texts", {})
            conflicts = model.finish(task_base, ours, answer)
            if asked.get("choice") == "deny":
                assert gurtd.wait(task_id)["state"] == "failed"
            else:
                task = gurtd.wait_done(task_id)
                ids.append(task_id)
                seen["merged"] += bool(task.get("merged"))
            seen["conflict"] += bool(conflicts)
        got, want = view_files(gurtd), expected_files(model.view())
        got = {n: (data, mode if n == MODE else "") for n, (data, mode) in got.items()}
        assert got == want, ({n: (got.get(n), want.get(n)) for n in set(got) | set(want)
                              if got.get(n) != want.get(n)}, json.dumps(seen))
    assert seen["conflict"] >= 2 and seen["merged"] >= 2 and seen["undo"] >= 2, seen


def loop_wait(g: Gurtd) -> float:
    """Seconds a command of the loop takes to be answered (the stop of no task: the loop
    looks it up and refuses), the loop's wait as a client meets it."""
    began = time.monotonic()
    g.api("POST", "/api/tasks/no-such-task/stop", status=400)
    return time.monotonic() - began


def peak_memory(g: Gurtd) -> int:
    """gurtd's peak resident memory so far (VmHWM), in bytes."""
    assert g.proc is not None
    with open(f"/proc/{g.proc.pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def test_a_hostile_task_is_bounded(gurtd: Gurtd) -> None:
    """Side by side, two tasks change a file of 1,000,000 lines at both ends (merged, off
    the loop), one 100 MB line (a conflict that says it is too large to merge) and a file
    at the same 10,000 places both ways (one conflict, its diff3 cut at 64 KiB).  The loop
    answers all along (its worst wait measured) and gurtd's memory stays bounded."""
    made = gurtd.create("seq 1000000 > big.txt\nhead -c 100000000 /dev/zero | tr '\\0' x > "
                        "line.txt\nseq 20000 > many.txt")
    assert gurtd.wait(made["id"], timeout=120)["state"] == "done"
    a = gated(gurtd, "sed -i '1s/.*/by a/' big.txt; echo a >> line.txt; "
                     "sed -i '1~2s/$/ a/' many.txt")
    b = gated(gurtd, "sed -i '$s/.*/by b/' big.txt; echo b >> line.txt; "
                     "sed -i '1~2s/$/ b/' many.txt")
    assert end(gurtd, b)["state"] == "done"
    before = peak_memory(gurtd)
    gurtd.api("POST", f"/api/approvals/{gate(gurtd, a)['id']}/answer", {"answer": "go"})
    waits = [loop_wait(gurtd)]
    while gurtd.task(a)["state"] != "waiting" or not pending(gurtd, a, "conflict"):
        waits.append(loop_wait(gurtd))
    grown = peak_memory(gurtd) - before
    print(f"loop's worst wait {max(waits) * 1000:.0f} ms over {len(waits)} commands; "
          f"gurtd's peak memory grew {grown >> 20} MiB")
    assert max(waits) < 1.0, waits
    assert grown < 128 << 20, grown
    approval = pending(gurtd, a, "conflict")
    paths = {p["path"]: p for p in approval["args"]["paths"]}
    assert sorted(paths) == ["line.txt", "many.txt"]
    assert "too large to merge" in paths["line.txt"]["why"]
    assert paths["line.txt"]["task"]["shown"] == "too large to show"
    assert paths["many.txt"]["why"] == "overlapping changes"
    shown = paths["many.txt"]["diff3"]
    assert len(shown.encode()) <= 64 << 10 and shown.count("<<<<<<< task") > 100, len(shown)
    assert approval["args"]["merged"] == ["big.txt"]
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {"args": {"keep": "view"}})
    task = gurtd.wait(a, timeout=60)
    assert task["state"] == "done" and task["merged"] == ["big.txt"]
    big = gurtd.file("home", "big.txt").split(b"\n")
    assert big[0] == b"by a" and big[-2] == b"by b" and len(big) == 1000001
    assert gurtd.file("home", "many.txt").split(b"\n")[:2] == [b"1 b", b"2"]


# Exact undo ##################################################################################

def undo(g: Gurtd, task_id: str) -> dict[str, Any]:
    """Undo: its answer already names what the revert takes out of later copies and what
    it keeps whole; the task's undoMerge once its revert layer joined says the same."""
    answer = g.api("POST", f"/api/tasks/{task_id}/undo")
    assert answer["state"] == "undone"
    said = answer["undoMerge"]
    assert said["state"] in ("writing", "done"), said
    done = eventually(lambda: g.task(task_id).get("undoMerge"), 30, "the revert")
    assert done["state"] == "done" and (done["reverted"], done["kept"]) == \
        (said["reverted"], said["kept"]), (said, done)
    return done


@pytest.mark.pure
def test_an_undo_answer_waits_for_its_names_a_bounded_time(monkeypatch: Any) -> None:
    """The answer takes the revert's names once decided; a revert that takes longer than
    UNDO_ANSWER_WAIT answers `checking` (the record, log and an event name them later)."""
    monkeypatch.setattr(G, "UNDO_ANSWER_WAIT", 0.05)
    task = {"id": "t1", "state": "undone"}
    named: Future[dict[str, Any]] = Future()
    began = time.monotonic()
    assert G.undo_answer(task, named)["undoMerge"]["state"] == "checking"
    assert time.monotonic() - began < 1
    decided = {"reverted": ["a"], "kept": [], "layer": None, "state": "writing"}
    named.set_result(decided)
    assert G.undo_answer(task, named) == {**task, "undoMerge": decided}
    assert G.undo_answer(task, None) == task


def test_undo_takes_its_change_out_of_a_later_copy(gurtd: Gurtd) -> None:
    """t1 changes line 3, t2 (started after t1 ended) line 17: undo of t1 takes line 3 back
    inside t2's copy and leaves line 17; a second undo answers the same; undo of t2 then
    gives the file as it was before both."""
    put(gurtd, "f.txt", lines(20))
    t1 = gurtd.run("sed -i 's/^line 3$/three by t1/' f.txt")["id"]
    t2 = gurtd.run("sed -i 's/^line 17$/17 by t2/' f.txt")["id"]
    info = undo(gurtd, t1)
    assert info["reverted"] == ["f.txt"] and info["kept"] == []
    assert gurtd.file("home", "f.txt").decode() == lines(20).replace("line 17\n", "17 by t2\n")
    layer = gurtd.task(info["layer"])
    assert layer["state"] == "done" and layer["worker"] == "upload"
    again = gurtd.api("POST", f"/api/tasks/{t1}/undo")
    assert again["state"] == "undone" and again["undoMerge"] == info
    assert [e for e in gurtd.log(t1) if e["type"] == "undo"][0]["reverted"] == ["f.txt"]
    undo(gurtd, t2)
    assert gurtd.file("home", "f.txt").decode() == lines(20)


def test_undo_under_a_later_change_of_the_same_lines_keeps_it_whole(gurtd: Gurtd) -> None:
    """t2 changed t1's line again: the later version stays whole, and t1's record and log
    name the path and t2; an append under a later append is taken out alone."""
    put(gurtd, "f.txt", lines(20))
    put(gurtd, "log.txt", "top\n")
    t1 = gurtd.run("sed -i 's/^line 3$/three by t1/' f.txt; echo t1 >> log.txt")["id"]
    t2 = gurtd.run("sed -i 's/^three by t1$/three by t2/' f.txt; echo t2 >> log.txt")["id"]
    info = undo(gurtd, t1)
    assert info["reverted"] == ["log.txt"]
    assert [(k["path"], k["task"]) for k in info["kept"]] == [("f.txt", t2)]
    assert gurtd.file("home", "f.txt").decode() == lines(20).replace("line 3\n",
                                                                      "three by t2\n")
    assert gurtd.file("home", "log.txt") == b"top\nt2\n"
    text = [e for e in gurtd.log(t1) if e["type"] == "undo"][0]["text"]
    assert f"f.txt (in {t2})" in text
    said = event_seen(gurtd, lambda kind, data: kind == "task" and data["id"] == t1 and
                      "undoMerge" in data)
    assert [(k["path"], k["task"]) for k in said["undoMerge"]["kept"]] == [("f.txt", t2)]


def test_undo_of_a_file_a_later_task_left_alone_deletes_it(gurtd: Gurtd) -> None:
    """t1 made two files, t2 copied one without a change (touch) and changed the other:
    after the undo neither of t1's files shows t1's work."""
    t1 = gurtd.run("echo one > a.txt; printf 'x\\ny\\nz\\n' > b.txt")["id"]
    gurtd.run("chmod 644 a.txt; touch a.txt; sed -i 's/^z$/Z/' b.txt")
    info = undo(gurtd, t1)
    assert gurtd.file("home", "a.txt") is None
    assert [k["path"] for k in info["kept"]] == ["b.txt"]     # t2 built on it


def test_undo_under_a_later_deleted_folder_brings_nothing_back(gurtd: Gurtd) -> None:
    """t1 changed d/x and e/x, t2 deleted the folder d, t3 deleted e and made it again with
    another file (an opaque folder): the undo of t1 brings neither file back, and names both
    kept with the task that holds them."""
    gurtd.run("mkdir d e; echo x > d/x; echo y > d/y; echo x > e/x")
    t1 = gurtd.run("echo t1 >> d/x; echo t1 >> e/x")["id"]
    t2 = gurtd.run("rm -r d")["id"]
    t3 = gurtd.run("rm -r e; mkdir e; echo new > e/z")["id"]
    info = undo(gurtd, t1)
    assert info["reverted"] == [] and \
        [(k["path"], k["task"]) for k in info["kept"]] == [("d/x", t2), ("e/x", t3)], info
    assert gurtd.file("home", "d/x") is None and gurtd.file("home", "e/x") is None
    assert gurtd.file("home", "e/z") == b"new\n"


def test_undo_reads_later_copies_in_merged_layers() -> None:
    """Groups of 2 below the newest 1: the later copies of t1's files lie in a merged
    layer of t2 and t3 (the undo reads layers, not views): t3's copy is reverted, t2's
    change of t1's line is kept whole and named with t2 (not t3, its group's newest)."""
    with running_gurtd({"GURT_LAYER_GROUP": "2", "GURT_LAYER_KEEP": "1"}) as g:
        for name in ("e.txt", "f.txt", "g.txt"):          # t1 is the fourth: t2 and t3
            put(g, name, lines(20))                       # make the third group
        t1 = g.run("sed -i 's/^line 3$/three by t1/' f.txt g.txt")["id"]
        t2 = g.run("sed -i 's/^three by t1$/three by t2/' f.txt")["id"]
        t3 = g.run("sed -i 's/^line 17$/17 by t3/' g.txt")["id"]
        g.run("echo later > h.txt")
        g.run("echo later > i.txt")
        merged = eventually(lambda: [m for m in registry(g.home)["merged"]
                                     if sorted(m["members"]) == sorted([t2, t3])], 30,
                            "the merged layer of t2 and t3")
        info = undo(g, t1)
        assert info["reverted"] == ["g.txt"], (info, merged)
        assert [(k["path"], k["task"]) for k in info["kept"]] == [("f.txt", t2)]
        assert g.file("home", "g.txt").decode() == lines(20).replace("line 17\n",
                                                                      "17 by t3\n")
        assert g.file("home", "f.txt").decode() == lines(20).replace("line 3\n",
                                                                      "three by t2\n")


@pytest.mark.parametrize("seed", SEEDS)
def test_random_histories_through_merged_layers(seed: int) -> None:
    """The random histories with groups of 3 below the newest 2: the views the finish-time
    merge and the undos read stand mostly on merged layers (rebuilt after every undo)."""
    with running_gurtd({"GURT_LAYER_GROUP": "3", "GURT_LAYER_KEEP": "2"}) as g:
        test_random_histories(g, seed)


def test_a_burst_of_undos_while_reverts_are_decided_stays_exact(gurtd: Gurtd) -> None:
    """Undos at once while a revert is decided: t1's revert (t2's copy of f.txt holds t1's
    line) joins although the stack moved (the layers that went hold no path of it); then
    t2's revert under t3's copy, undone at the same moment as t3 (a layer that went holds
    f.txt: the revert is built again): f.txt is as it was, every other file gone."""
    put(gurtd, "f.txt", lines(20))
    t1 = gurtd.run("sed -i 's/^line 3$/three by t1/' f.txt")["id"]
    t2 = gurtd.run("sed -i 's/^line 17$/17 by t2/' f.txt")["id"]
    others = [gurtd.run(f"echo {n} > other{n}.txt")["id"] for n in range(4)]
    t3 = gurtd.run("sed -i 's/^line 10$/10 by t3/' f.txt")["id"]

    def undo_all(ids: list[str]) -> None:
        with ThreadPoolExecutor(len(ids)) as pool:
            answers = list(pool.map(lambda i: gurtd.api("POST", f"/api/tasks/{i}/undo"), ids))
        assert [a["state"] for a in answers] == ["undone"] * len(ids), answers
        for task_id in ids:
            eventually(lambda: (gurtd.task(task_id).get("undoMerge") or {}).get("state") ==
                       "done", 30, f"the revert of {task_id}")

    undo_all([t1, *others])
    assert gurtd.task(t1)["undoMerge"]["reverted"] == ["f.txt"]
    assert gurtd.file("home", "f.txt").decode() == lines(20).replace(
        "line 17\n", "17 by t2\n").replace("line 10\n", "10 by t3\n")
    undo_all([t2, t3])
    assert gurtd.file("home", "f.txt").decode() == lines(20)
    assert [n for n in range(4) if gurtd.file("home", f"other{n}.txt") is not None] == []


def test_an_undo_whose_revert_is_moot_once_the_layers_above_go_is_recorded_and_collected(
        gurtd: Gurtd) -> None:
    """t1 is undone and, while its revert under t2's copies of 2,000 files is decided, t2 is
    undone too: once nothing is above t1 its revert is moot; it is recorded as done (nothing
    reverted) and t1's layer is deleted (it stayed held by a revert never built again)."""
    gurtd.run_done("mkdir d; for i in $(seq 2000); do seq 20 > d/$i; done")
    t1 = gurtd.run_done("sed -i 's/^3$/three/' d/*")["id"]
    t2 = gurtd.run_done("sed -i 's/^17$/seventeen/' d/*")["id"]

    # t2's undo once t1's is taken (t1 shown undone: its revert being decided), not 0.05 s
    # after a thread for t1's began: on a busy machine that thread may start later than t2's
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(gurtd.api, "POST", f"/api/tasks/{t1}/undo")
        eventually(lambda: gurtd.task(t1)["state"] == "undone", 30, "t1's undo taken")
        gurtd.api("POST", f"/api/tasks/{t2}/undo")
        first.result()
    for task_id in (t1, t2):
        eventually(lambda: not os.path.lexists(os.path.join(gurtd.home, "layers", task_id)),
                   60, f"the layer of {task_id} deleted")
    assert gurtd.task(t1)["undoMerge"] == {"reverted": [], "kept": [], "layer": None,
                                          "state": "done"}
    assert gurtd.file("home", "d/7").decode() == "".join(f"{n}\n" for n in range(1, 21))


def test_kill_before_an_undos_revert_joins_takes_it_up_again() -> None:
    """gurtd killed once the revert layer of an undo is written but has not joined: after
    the restart the undo is taken up again, the view is exact and the record says so."""
    with running_gurtd({"GURT_TEST_CRASH_AT": "undo-revert-written"}) as g:
        put(g, "f.txt", lines(20))
        t1 = g.run("sed -i 's/^line 3$/three by t1/' f.txt")["id"]
        t2 = g.run("sed -i 's/^line 17$/17 by t2/' f.txt")["id"]
        with contextlib.suppress(OSError, http.client.HTTPException):   # it may die first
            g.api("POST", f"/api/tasks/{t1}/undo")
        assert g.proc is not None and g.proc.wait(timeout=30) == 137
        g.proc = None
        g.env.pop("GURT_TEST_CRASH_AT")
        g.start()
        info = eventually(lambda: g.task(t1).get("undoMerge"), 30, "the revert taken up")
        assert info["state"] == "done" and info["reverted"] == ["f.txt"], info
        assert g.file("home", "f.txt").decode() == lines(20).replace("line 17\n", "17 by t2\n")
        assert g.task(t1)["state"] == "undone" and g.task(t2)["state"] == "done"
        assert g.api("POST", f"/api/tasks/{t1}/undo")["undoMerge"] == info


def test_a_waiting_revert_record_a_save_took_to_disk_is_taken_up_at_the_next_start() -> None:
    """A revert's `waiting` record is the run's own (it is never written on purpose, but a
    save of its task for another reason takes it along): gurtd killed before the revert
    joined, t1's file holding such a record, the next start takes the undo up as one cut
    short and the record says done.  Before, a record on disk meant a revert that had ended:
    t1's change stayed in t2's copy and the record said waiting for good."""
    with running_gurtd({"GURT_TEST_CRASH_AT": "undo-revert-written"}) as g:
        put(g, "f.txt", lines(20))
        t1 = g.run("sed -i 's/^line 3$/three by t1/' f.txt")["id"]
        g.run("sed -i 's/^line 17$/17 by t2/' f.txt")
        with contextlib.suppress(OSError, http.client.HTTPException):   # it may die first
            g.api("POST", f"/api/tasks/{t1}/undo")
        assert g.proc is not None and g.proc.wait(timeout=30) == 137
        g.proc = None
        path = os.path.join(g.home, "tasks", t1 + ".json")
        with open(path) as f:
            data = json.load(f)
        data["undoMerge"] = G.undo_waiting("its layer not saved: No space left on device", 2)
        G.write_json(path, data)
        g.env.pop("GURT_TEST_CRASH_AT")
        g.start()
        info = eventually(lambda: (g.task(t1).get("undoMerge") or {}).get("state") == "done"
                          and g.task(t1)["undoMerge"], 30, "the revert taken up")
        assert info["reverted"] == ["f.txt"], info
        assert g.file("home", "f.txt").decode() == lines(20).replace("line 17\n", "17 by t2\n")

def test_run_wait_announces_a_conflict_with_the_commands_that_answer_it(gurtd: Gurtd) -> None:
    put(gurtd, "f.txt", "one\n")
    proc = started(gurtd, "run", "--worker", "fake", "--wait", "--tool", "ask",
                   "echo task > f.txt\n" + GATE)
    try:
        said = read_until(proc.stderr, r"gurtd answer (a\w+) 'TEXT'")
        [task_id] = [t["id"] for t in gurtd.api("GET", "/api/tasks?state=waiting")]
        assert end(gurtd, gated(gurtd, "echo view > f.txt"))["state"] == "done"
        gurtd.api("POST", f"/api/approvals/{gate(gurtd, task_id)['id']}/answer",
                  {"answer": "go"})
        said = read_until(proc.stderr, r"or: gurtd deny \S+ --reason TEXT")
        assert "changed f.txt too" in said, said
        ap = pending(gurtd, task_id, "conflict")["id"]
        assert f"""gurtd approve {ap} --args '{{"keep": "view"}}'""" in said
        assert gurtd.cli("approve", ap, "--args", '{"keep": "view"}').returncode == 0
        proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert gurtd.file("home", "f.txt") == b"view\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A folder gone on one side, a file added in it on the other (crash pass) ####################

@pytest.mark.parametrize("gone", ["mv d e", "rm -r d", "rm -r d && mkdir d"])
def test_a_file_added_in_a_folder_the_later_task_removed_is_a_conflict(gurtd: Gurtd,
                                                                       gone: str) -> None:
    """b adds d/new while a renames d away, deletes it, or makes it again empty (a whiteout
    or an opaque folder in a's layer): a ends after b, and its layer would hide b's file
    from the view without a word.  It is a conflict naming d/new (deleted by the task,
    changed in the view); keep view gives b's file back beside a's change."""
    put(gurtd, "d/g.txt", "g\n")
    a = gated(gurtd, gone)
    b = gated(gurtd, "echo new > d/new")
    assert end(gurtd, b)["state"] == "done"
    task = end(gurtd, a)
    assert task["state"] == "waiting", (task, gurtd.file("home", "d/new"))
    approval = pending(gurtd, a, "conflict")
    paths = {p["path"]: p for p in approval["args"]["paths"]}
    assert "d/new" in paths and "deleted by the task" in paths["d/new"]["why"], paths
    assert paths["d/new"]["view"]["text"] == "new\n"
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {"args": {"keep": "view"}})
    assert gurtd.wait(a)["state"] == "done"
    assert gurtd.file("home", "d/new") == b"new\n"
    assert gurtd.file("home", "d/g.txt") is None
    assert gurtd.file("home", "e/g.txt") == (b"g\n" if gone.startswith("mv") else None)


# Undo of a task while its finish-time merge is written into its layer (crash pass) #########

def test_undo_while_a_merge_is_written_into_the_layer_leaves_no_trash(gurtd: Gurtd) -> None:
    """a's merge of 1,000 files is being written into its layer (the first file replaced)
    when a is undone: the layer is deleted once the thread is done with it, and nothing of
    it is left in BOX_HOME/layers.  Before, the collection renamed the layer to its trash
    name and deleted it while the thread still wrote in it: `Directory not empty`, and the
    trash stayed there until the next start."""
    gurtd.run_done("mkdir d; for i in $(seq 1000); do seq 20 > d/$i; done")
    a = gated(gurtd, "sed -i 's/^3$/three/' d/*")
    b = gated(gurtd, "sed -i 's/^17$/seventeen/' d/*")
    assert end(gurtd, b)["state"] == "done"
    layers = os.path.join(gurtd.home, "layers")
    first = os.path.join(layers, a, "upper", "d", "1")      # the merge writes it first

    def merged() -> bool:
        with contextlib.suppress(FileNotFoundError):     # between its unlink and rename
            with open(first, "rb") as f:
                return b"seventeen" in f.read()
        return False

    gurtd.api("POST", f"/api/approvals/{gate(gurtd, a)['id']}/answer", {"answer": "go"})
    eventually(merged, 30, "the merge's first write")
    assert gurtd.api("POST", f"/api/tasks/{a}/undo")["state"] == "undone"
    eventually(lambda: gurtd.task(a).get("layerDeleted") or
               not os.path.lexists(os.path.join(layers, a)), 30, "a's layer deleted")
    eventually(lambda: [n for n in os.listdir(layers) if n.startswith(G.MERGE_TEMP)] == [],
               30, "no trash left in layers")
    assert "could not delete" not in gurtd.log_text()
    want = "".join(f"{n}\n" for n in range(1, 21)).replace("17\n", "seventeen\n")
    assert gurtd.file("home", "d/500").decode() == want


# A folder kept on one side, replaced by a file on the other (crash pass) ###################

@pytest.mark.parametrize("mine", ["echo new > d/new", "chmod 700 d"])
@pytest.mark.parametrize("theirs", ["rm -r d && echo file > d", "rm -r d && ln -s g.txt d"])
def test_a_folder_the_view_replaced_by_a_file_is_a_conflict(gurtd: Gurtd, mine: str,
                                                            theirs: str) -> None:
    """b replaces the folder d by a file or a symlink while a adds a file in d or only
    changes its mode: a ends after b, and the folder its layer holds would hide b's d from
    the view without a word.  It is a conflict naming d (a folder on one side, a file on
    the other); keep view gives b's d."""
    put(gurtd, "d/g.txt", "g\n")
    a = gated(gurtd, mine)
    b = gated(gurtd, theirs)
    assert end(gurtd, b)["state"] == "done"
    task = end(gurtd, a)
    assert task["state"] == "waiting", (task, gurtd.file("home", "d"))
    approval = pending(gurtd, a, "conflict")
    paths = {p["path"]: p for p in approval["args"]["paths"]}
    assert paths["d"]["why"] == "a folder on one side, a file on the other", paths
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {"args": {"keep": "view"}})
    assert gurtd.wait(a)["state"] == "done"
    seen = gurtd.run("if [ -L d ]; then readlink d; else cat d; fi")
    assert gurtd.output(seen["id"]) == ["g.txt" if "ln -s" in theirs else "file"], seen
