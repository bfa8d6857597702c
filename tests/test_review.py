"""Personal mode, told as an owner's stories: a task works on a copy of my real folder, I read
the diff, keep it (or part of it), see conflicts with my own edits, and take it back.

A real unprivileged owner user is made by this module (and removed), with real folders in its
home: nested folders, a file of root's, a symlink to /etc/passwd, a name with spaces and
unicode.  Real gurtd, real overlays and idmapped mounts; kill -9 in the middle of a keep.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import gurtd as G
from conftest import (UNICODE_NAME, Gurtd, droid_installed, eventually, keep, python_line,
                      run_on, running_gurtd, sse, wait_for_step)

# helpers #####################################################################################

def snapshot(top: str) -> dict[str, tuple[Any, ...]]:
    """Every path under top: (type, mode, uid, gid, content or link target)."""
    out = {}
    for root, dirs, names in os.walk(top):
        for name in dirs + names:
            path = os.path.join(root, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, top)
            if stat.S_ISLNK(st.st_mode):
                data: Any = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                data = Path(path).read_bytes()
            else:
                data = None
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                        st.st_gid, data)
    return out


def no_leftovers(g: Gurtd, task_id: str, folder: str) -> None:
    """After undo: the task's review files are gone and no temp name is in the folder."""
    assert not os.path.exists(os.path.join(g.home, "review", task_id))
    for root, dirs, names in os.walk(folder):
        assert not [n for n in dirs + names if n.startswith(G.KEEP_TEMP)], (root, dirs, names)


# pure ########################################################################################

@pytest.mark.pure
def test_idmap_shows_the_owner_as_the_task_and_everyone_else_as_themselves() -> None:
    assert G.idmap_swap(1000, 600123) == ("0 0 1000\n1000 600123 1\n1001 1001 599122\n"
                                          "600124 600124 4294367171\n")
    assert G.idmap_swap(700000, 600123).splitlines()[2] == "700000 600123 1"


@pytest.mark.pure
def test_folder_fields_are_one_list() -> None:
    assert G.folders_of({"folder": "/home/a/p"}) == ["/home/a/p"]
    assert G.folders_of({"folders": ["/home/a/p", "/home/a/q"], "folder": "/home/a/p"}) == \
        ["/home/a/p", "/home/a/q"]
    assert G.folders_of({}) is None
    for bad in ({"folders": []}, {"folders": ["/srv/x"] * 17}, {"folders": [3]},
                {"folder": "/home/a/q", "folders": ["/home/a/p", "/home/a/q"]}):
        with pytest.raises(G.ApiError):
            G.folders_of(bad)


# stories #####################################################################################

def test_a_task_works_on_a_copy_and_keep_applies_exactly_its_diff(
        gurtd: Gurtd, owner_folder: str, owner: pwd.struct_passwd) -> None:
    before = snapshot(owner_folder)
    task = run_on(
        gurtd, owner_folder,
                "echo more >> a.txt",
        "mkdir -p newdir/inner && printf 'n\\n' > newdir/inner/n.txt",
        "rm sub/deeper/c.txt",
        "rm -r olddir",
        f"printf 'changed\\n' > '{UNICODE_NAME}'",
        "chmod 755 script.sh",
        "printf '\\000\\001\\002' > blob.bin",
        "echo pwned > root.txt || echo root-refused",
        "echo pwned > link || echo link-refused",
        "stat -c '%U' root.txt",
        "stat -c '%U' a.txt")
    assert task["state"] == "done", gurtd.log(task["id"])
    assert task["review"] == "pending" and task["folders"] == [owner_folder]
    assert task["folder"] == owner_folder
    out = gurtd.output(task["id"])
    assert "root-refused" in out and "link-refused" in out
    assert out[-1] == task["user"]               # the owner's files look like the task's own
    assert out[-2] == "root"                     # root's stay root's
    assert snapshot(owner_folder) == before            # nothing written while it ran, or after
    changes = gurtd.api("GET", f"/api/tasks/{task['id']}/changes")
    assert {(c["folder"], c["path"], c["change"]) for c in changes} >= {
        (owner_folder, "a.txt", "modified"), (owner_folder, "newdir/", "added"),
        (owner_folder, "sub/deeper/c.txt", "deleted"), (owner_folder, "olddir", "deleted"),
        (owner_folder, UNICODE_NAME, "modified"), (owner_folder, "script.sh", "modified")}
    code, diff, _ = gurtd.request("GET", f"/api/tasks/{task['id']}/diff")
    diff = diff.decode()
    assert code == 200 and "+more" in diff and "-sea" in diff and "old mode 100644" in diff
    assert f"+++ b/{UNICODE_NAME}" in diff and "+n" in diff
    assert "Binary files /dev/null and b/blob.bin differ" in diff

    code, kept = keep(gurtd, task["id"])
    assert code == 200 and kept["review"] == "kept", kept
    after = snapshot(owner_folder)
    uid, gid = owner.pw_uid, owner.pw_gid
    assert after["a.txt"] == (stat.S_IFREG, 0o644, uid, gid, b"hello\nmore\n")
    assert after["newdir/inner/n.txt"][2:] == (uid, gid, b"n\n")
    assert after["newdir"][2:4] == (uid, gid)
    assert "sub/deeper/c.txt" not in after and "olddir" not in after
    assert not [p for p in after if p.startswith("olddir")]
    assert after[UNICODE_NAME][4] == b"changed\n"
    assert after["script.sh"][1] == 0o755
    assert after["blob.bin"][4] == b"\0\1\2"
    assert after["root.txt"] == before["root.txt"] and after["root.txt"][2] == 0
    assert after["link"] == before["link"]
    assert "pwned" not in Path("/etc/passwd").read_text()
    assert gurtd.task(task["id"])["review"] == "kept"
    assert [e.get("action") for e in gurtd.log(task["id"]) if e["type"] == "review"] == ["kept"]

    undone = gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert undone["state"] == "undone" and undone["review"] == "undone"
    assert snapshot(owner_folder) == before            # byte for byte, modes and owners
    assert gurtd.api("POST", f"/api/tasks/{task['id']}/undo")["review"] == "undone"  # idempotent
    no_leftovers(gurtd, task["id"], owner_folder)


def test_my_edits_since_the_start_are_conflicts_then_paths_force_and_undo(
        gurtd: Gurtd, owner_folder: str) -> None:
    task = run_on(gurtd, owner_folder, "echo task > a.txt", "echo task > sub/b.txt",
                  "echo new > new.txt", "echo task >> script.sh")
    assert task["review"] == "pending"
    Path(owner_folder, "a.txt").write_text("mine\n")  # the owner, after the start
    os.unlink(os.path.join(owner_folder, "sub/b.txt"))
    code, data = keep(gurtd, task["id"])
    assert code == 409 and data["code"] == "conflict", data
    assert {(c["path"], c["why"]) for c in data["conflicts"]} == {
        ("a.txt", "changed by the owner after the task started"),
        ("sub/b.txt", "deleted by the owner after the task started")}
    assert all(c["folder"] == owner_folder for c in data["conflicts"])
    assert not os.path.exists(os.path.join(owner_folder, "new.txt"))          # nothing applied
    assert gurtd.task(task["id"])["review"] == "conflict"

    code, data = keep(gurtd, task["id"], {"paths": [f"{owner_folder}/new.txt", "script.sh"]})
    assert code == 200 and data["review"] == "pending", data
    assert open(os.path.join(owner_folder, "new.txt")).read() == "new\n"
    assert open(os.path.join(owner_folder, "script.sh")).read().endswith("task\n")
    assert open(os.path.join(owner_folder, "a.txt")).read() == "mine\n"
    code, data = keep(gurtd, task["id"], {"paths": ["nothing/here"]})
    assert code == 400, data

    code, data = keep(gurtd, task["id"], {"force": True})
    assert code == 200 and data["review"] == "kept", data
    assert open(os.path.join(owner_folder, "a.txt")).read() == "task\n"
    assert open(os.path.join(owner_folder, "sub/b.txt")).read() == "task\n"

    with open(os.path.join(owner_folder, "new.txt"), "a") as f:      # the owner edits a kept file
        f.write("mine too\n")
    code, data, _ = gurtd.request("POST", f"/api/tasks/{task['id']}/undo", {})
    assert code == 409 and [c["path"] for c in data["conflicts"]] == ["new.txt"], data
    assert open(os.path.join(owner_folder, "a.txt")).read() == "task\n"      # nothing changed
    assert gurtd.task(task["id"])["review"] == "kept"
    assert gurtd.api("POST", f"/api/tasks/{task['id']}/undo", {"force": True})["review"] == "undone"
    assert open(os.path.join(owner_folder, "a.txt")).read() == "mine\n"     # as before the keep
    assert not os.path.exists(os.path.join(owner_folder, "sub/b.txt"))
    assert not os.path.exists(os.path.join(owner_folder, "new.txt"))
    assert open(os.path.join(owner_folder, "script.sh")).read() == "#!/bin/sh\necho hi\n"
    no_leftovers(gurtd, task["id"], owner_folder)


def test_keep_never_follows_a_symlink_the_task_planted(gurtd: Gurtd, owner_folder: str,
                                                       scratch: Any) -> None:
    secret = scratch / "secret"          # root's file outside the folder
    secret.write_text("root only\n")
    os.chmod(scratch, 0o755)
    before = snapshot(owner_folder)
    task = run_on(gurtd, owner_folder, "ln -s /etc/shadow x", f"ln -s {secret} y",
                  "rm -r sub && ln -s /etc sub",
                  "ln /etc/passwd hard 2>/dev/null || echo no-hard-link",
                  "echo pwned > link || echo link-refused")
    assert task["state"] == "done" and "no-hard-link" in gurtd.output(task["id"])
    code, data = keep(gurtd, task["id"])
    assert code == 200, data
    assert os.readlink(os.path.join(owner_folder, "x")) == "/etc/shadow"
    assert os.readlink(os.path.join(owner_folder, "sub")) == "/etc"
    assert not os.path.exists(os.path.join(owner_folder, "hard"))
    assert os.readlink(os.path.join(owner_folder, "y")) == str(secret)
    assert secret.read_text() == "root only\n" and os.stat(secret).st_uid == 0
    assert "pwned" not in Path("/etc/passwd").read_text()
    gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert snapshot(owner_folder) == before
    no_leftovers(gurtd, task["id"], owner_folder)


def test_a_symlink_the_owner_put_on_the_way_stops_keep_even_forced(
        gurtd: Gurtd, owner_folder: str, scratch: Any) -> None:
    outside = scratch / "outside"
    outside.mkdir()
    task = run_on(gurtd, owner_folder, "echo task > sub/deeper/new.txt")
    shutil.rmtree(os.path.join(owner_folder, "sub/deeper"))
    os.symlink(str(outside), os.path.join(owner_folder, "sub/deeper"))
    code, data = keep(gurtd, task["id"], {"force": True})
    assert code == 409, data
    assert any("symlink" in c["why"] for c in data["conflicts"]), data
    assert os.listdir(outside) == []
    assert gurtd.api("POST", f"/api/tasks/{task['id']}/undo")["review"] == "undone"


def test_setid_bits_and_fifos_are_never_kept(gurtd: Gurtd, owner_folder: str) -> None:
    task = run_on(gurtd, owner_folder, "chmod u+s script.sh", "mkfifo pipe")
    code, data = keep(gurtd, task["id"], {"force": True})
    assert code == 409
    whys = {c["path"]: c["why"] for c in data["conflicts"]}
    assert "set-uid" in whys["script.sh"] and "fifo" in whys["pipe"]
    assert not os.path.exists(os.path.join(owner_folder, "pipe"))
    assert not os.stat(os.path.join(owner_folder, "script.sh")).st_mode & stat.S_ISUID
    assert gurtd.api("POST", f"/api/tasks/{task['id']}/undo")["review"] == "undone"


def test_a_failed_task_gets_no_review_and_nothing_is_kept(gurtd: Gurtd, owner_folder: str) -> None:
    task = run_on(gurtd, owner_folder, "echo x > failed.txt", "false")
    assert task["state"] == "failed" and "review" not in task
    code, data = keep(gurtd, task["id"])
    assert code == 409 and not os.path.exists(os.path.join(owner_folder, "failed.txt"))
    assert not os.path.exists(os.path.join(gurtd.home, "review", task["id"]))


def test_refused_folders_say_why_and_create_nothing(
        gurtd: Gurtd, owner_folder: str, owner: pwd.struct_passwd, scratch: Any) -> None:
    os.symlink(owner_folder, os.path.join(owner.pw_dir, "via-link"))
    afile = os.path.join(owner_folder, "a.txt")
    outside = str(scratch)
    cases = {
        "proj": "absolute", f"{owner_folder}/../x": "normal", "/": "root",
        f"{owner_folder}/missing": "does not exist", afile: "not a directory",
        os.path.join(owner.pw_dir, "via-link"): f"resolves to {owner_folder}",
        gurtd.home: "BOX_HOME", os.path.join(gurtd.home, "workspaces"): "BOX_HOME",
        "/proc/self": "pseudo", outside: "outside folderRoots",
    }
    for path, why in cases.items():
        code, data, _ = gurtd.request("POST", "/api/tasks", {"title": "t", "prompt": "true",
                                                             "worker": "fake", "folder": path})
        assert code == 400 and why in data["error"] and path in data["error"], (path, data)
    code, data, _ = gurtd.request("POST", "/api/tasks", {
        "title": "t", "prompt": "true", "worker": "fake",
        "folders": [owner_folder, os.path.join(owner_folder, "sub")]})
    assert code == 400 and "holds" in data["error"], data
    gurtd.api("POST", "/api/tasks", {"title": "t", "prompt": "true", "worker": "fake",
                                     "folders": [owner_folder] * 17}, status=400)
    for bad in ([], ["relative"], ["/proc"], ["/"], "/home", ["/home/../etc"], ["/usr/local"],
                ["/run/user"]):
        code, data, _ = gurtd.request("PUT", "/api/settings", {"folderRoots": bad})
        assert (code == 400) == (bad != []), (bad, data)
    assert gurtd.api("GET", "/api/tasks") == []
    os.unlink(os.path.join(owner.pw_dir, "via-link"))


def test_kill_9_in_the_middle_of_a_big_keep_finishes_it_at_the_next_start(
        owner_folder: str) -> None:
    with running_gurtd({"GURT_TEST_CRASH_AT": "keep-op-150"}) as box:
        task = run_on(box, owner_folder,
                      "mkdir many && for i in $(seq 300); do echo $i > many/f$i; done",
                      "echo task > a.txt")
        with pytest.raises(Exception):
            keep(box, task["id"])
        assert box.proc is not None and box.proc.wait(timeout=30) == 137
        box.proc = None
        written = len(os.listdir(os.path.join(owner_folder, "many")))
        assert 0 < written < 300                       # it did die in the middle
        box.env = {}
        box.start()               # the keep is finished in the review thread, the loop answering
        eventually(lambda: any(e.get("action") == "recovered" for e in box.log(task["id"])),
                   what="the keep finished")
        assert box.task(task["id"])["review"] == "kept"
        assert sorted(os.listdir(os.path.join(owner_folder, "many"))) == \
            sorted(f"f{i}" for i in range(1, 301))
        assert open(os.path.join(owner_folder, "a.txt")).read() == "task\n"
        box.api("POST", f"/api/tasks/{task['id']}/undo")
        assert not os.path.exists(os.path.join(owner_folder, "many"))
        assert open(os.path.join(owner_folder, "a.txt")).read() == "hello\n"
        no_leftovers(box, task["id"], owner_folder)


def test_kill_9_in_the_middle_of_an_undo_of_a_keep_loses_nothing_and_undo_goes_on(
        owner_folder: str) -> None:
    """Issue 25, class 3: undo of a keep runs off the loop, in the review thread.  gurtd
    killed in the middle of it (150 of 302 paths back) loses nothing: after the restart the
    undo is finished, and asked again it answers undone; the folder is as before the keep."""
    before = snapshot(owner_folder)
    with running_gurtd({"GURT_TEST_CRASH_AT": "undo-op-150"}) as box:
        task = run_on(box, owner_folder,
                      "mkdir many && for i in $(seq 300); do echo $i > many/f$i; done",
                      "echo task > a.txt")
        assert keep(box, task["id"])[0] == 200
        with pytest.raises(Exception):
            box.request("POST", f"/api/tasks/{task['id']}/undo")
        assert box.proc is not None and box.proc.wait(timeout=30) == 137
        box.proc = None
        assert 0 < len(os.listdir(os.path.join(owner_folder, "many"))) < 300   # in the middle
        box.env = {}
        box.start()
        code, data, _ = box.request("POST", f"/api/tasks/{task['id']}/undo")
        assert code == 200 and data["review"] == "undone", data
        assert snapshot(owner_folder) == before
        no_leftovers(box, task["id"], owner_folder)
        assert any(e.get("action") == "recovered" for e in box.log(task["id"]))


def test_kill_9_before_a_keep_writes_leaves_the_folder_untouched(owner_folder: str) -> None:
    with running_gurtd({"GURT_TEST_CRASH_AT": "keep-planned"}) as box:
        before = snapshot(owner_folder)
        task = run_on(box, owner_folder, "echo task > a.txt", "rm -r olddir")
        with pytest.raises(Exception):
            keep(box, task["id"])
        assert box.proc is not None and box.proc.wait(timeout=30) == 137
        box.proc = None
        box.env = {}
        box.start()
        assert snapshot(owner_folder) == before
        assert box.task(task["id"])["review"] == "pending"
        code, data = keep(box, task["id"])
        assert code == 200 and data["review"] == "kept"
        assert open(os.path.join(owner_folder, "a.txt")).read() == "task\n"
        box.api("POST", f"/api/tasks/{task['id']}/undo")
        assert snapshot(owner_folder) == before


def test_a_workspace_task_has_a_diff_of_its_layer(gurtd: Gurtd) -> None:
    first = gurtd.run("printf 'one\\n' > f.txt")
    second = gurtd.run("printf 'two\\n' > f.txt && printf 'b\\n' > g.txt")
    assert first["state"] == second["state"] == "done"
    code, diff, _ = gurtd.request("GET", f"/api/tasks/{second['id']}/diff")
    text = diff.decode()
    assert code == 200 and "-one" in text and "+two" in text and "+++ b/g.txt" in text
    code, diff, _ = gurtd.request("GET", f"/api/tasks/{second['id']}/diff?path=g.txt")
    assert "f.txt" not in diff.decode() and "g.txt" in diff.decode()


def test_two_folders_from_the_command_line(gurtd: Gurtd, owner_folder: str,
                                           owner: pwd.struct_passwd) -> None:
    second = os.path.join(owner.pw_dir, "second-" + secrets.token_hex(3))
    os.mkdir(second)
    os.chown(second, owner.pw_uid, owner.pw_gid)
    try:
        run = gurtd.cli_ok("run", "--worker", "fake", "--wait", "--folder", owner_folder,
                           "--folder", second,
                           f"echo one > {owner_folder}/one.txt && echo two > {second}/two.txt")
        task_id = run.stderr.split()[0]
        task = gurtd.task(task_id)
        assert task["folders"] == [owner_folder, second] and task["folder"] == owner_folder
        review = gurtd.cli("review")
        assert task_id in review.stdout and "pending" in review.stdout, review
        diff = gurtd.cli("diff", task_id)
        assert f"# folder {second}" in diff.stdout and "+two" in diff.stdout, diff
        diff = gurtd.cli("diff", task_id, "--path", f"{owner_folder}/one.txt")
        assert "+one" in diff.stdout and "two" not in diff.stdout, diff
        Path(second, "two.txt").write_text("mine\n")  # the owner was quicker
        refused = gurtd.cli("keep", task_id)
        assert refused.returncode == 1 and f"conflict  {second}/two.txt" in refused.stderr
        kept = gurtd.cli("keep", task_id, "--force")
        assert kept.returncode == 0 and kept.stdout.split() == [task_id, "kept"], kept
        assert open(os.path.join(second, "two.txt")).read() == "two\n"
        assert os.stat(os.path.join(owner_folder, "one.txt")).st_uid == owner.pw_uid
        assert task_id not in gurtd.cli("review").stdout
        os.unlink(os.path.join(owner_folder, "one.txt"))                 # the owner again
        assert gurtd.cli("undo", task_id).returncode == 1
        undone = gurtd.cli("undo", task_id, "--force", "--json")
        assert undone.returncode == 0 and '"review": "undone"' in undone.stdout, undone
        assert open(os.path.join(second, "two.txt")).read() == "mine\n"
        assert not os.path.exists(os.path.join(owner_folder, "one.txt"))
        no_leftovers(gurtd, task_id, second)
    finally:
        shutil.rmtree(second, ignore_errors=True)


def test_keep_and_undo_are_events(gurtd: Gurtd, owner_folder: str) -> None:
    import json
    task = run_on(gurtd, owner_folder, "echo task > a.txt")
    seen = []
    with gurtd.stream("/api/events", timeout=30) as resp:
        resp.fp.readline()
        assert keep(gurtd, task["id"])[0] == 200
        gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
        deadline = time.monotonic() + 20
        for _, kind, data in sse(resp):
            seen += [json.loads(data)] if kind == "review" else []
            if len(seen) == 2 or time.monotonic() > deadline:
                break
    assert [(e["task"], e["action"], e["review"]) for e in seen] == [
        (task["id"], "kept", "kept"), (task["id"], "undone", "undone")]


def test_a_stopped_task_drops_its_folder_changes(gurtd: Gurtd, owner_folder: str) -> None:
    task = gurtd.create(f"echo x > {owner_folder}/x.txt\nsleep 30", folder=owner_folder)
    wait_for_step(gurtd, task["id"], "sleep 30")
    stopped = gurtd.api("POST", f"/api/tasks/{task['id']}/stop")
    assert stopped["state"] == "failed" and "review" not in stopped
    assert not os.path.exists(os.path.join(gurtd.home, "review", task["id"]))
    assert not os.path.exists(os.path.join(owner_folder, "x.txt"))
    assert keep(gurtd, task["id"])[0] == 409


def test_an_edit_inside_a_folder_the_task_deleted_is_a_conflict(gurtd: Gurtd,
                                                                owner_folder: str) -> None:
    task = run_on(gurtd, owner_folder, "rm -r olddir", "rm -r sub && echo now-a-file > sub")
    with open(os.path.join(owner_folder, "olddir/y/z.txt"), "a") as f:
        f.write("mine\n")
    os.mkdir(os.path.join(owner_folder, "sub/deeper/mine"))
    code, data = keep(gurtd, task["id"])
    assert code == 409, data
    whys = {c["path"]: c["why"] for c in data["conflicts"]}
    assert whys == {"olddir": "olddir/y/z.txt changed by the owner after the task started",
                    "sub": "sub/deeper changed by the owner after the task started"}, whys
    assert os.path.isdir(os.path.join(owner_folder, "olddir"))
    code, data = keep(gurtd, task["id"], {"force": True})
    assert code == 200 and not os.path.exists(os.path.join(owner_folder, "olddir"))
    assert open(os.path.join(owner_folder, "sub")).read() == "now-a-file\n"
    gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert open(os.path.join(owner_folder, "olddir/y/z.txt")).read() == "z\nmine\n"
    assert os.path.isdir(os.path.join(owner_folder, "sub/deeper/mine"))


def test_keep_never_writes_where_the_owner_may_not(gurtd: Gurtd, owner_folder: str) -> None:
    locked = os.path.join(owner_folder, "sub/deeper")
    os.chmod(locked, 0o555)                  # the owner's own read-only folder
    time.sleep(0.05)
    task = run_on(gurtd, owner_folder, "chmod u+w sub/deeper && echo task > sub/deeper/new.txt")
    assert task["state"] == "done", gurtd.log(task["id"])
    code, data = keep(gurtd, task["id"], {"force": True})
    assert code == 409, data
    assert {c["path"]: c["why"] for c in data["conflicts"]} == {
        "sub/deeper/new.txt": "the folder's owner may not write in this folder"}
    assert sorted(os.listdir(locked)) == ["c.txt"]
    assert gurtd.api("POST", f"/api/tasks/{task['id']}/undo")["review"] == "undone"


def test_a_task_cut_short_by_a_restart_keeps_nothing(gurtd: Gurtd, owner_folder: str) -> None:
    task = gurtd.create(f"echo x > {owner_folder}/x.txt\nsleep 30", folder=owner_folder)
    wait_for_step(gurtd, task["id"], "sleep 30")
    gurtd.restart(kill=True)
    after = gurtd.task(task["id"])
    assert after["state"] == "failed" and "review" not in after
    assert not os.path.exists(os.path.join(gurtd.home, "review", task["id"]))
    assert not os.path.exists(os.path.join(owner_folder, "x.txt"))


def test_review_trash_a_crash_left_is_deleted_at_the_next_start(gurtd: Gurtd) -> None:
    """A .trash- folder of review files being deleted when gurtd was killed goes at the next
    start (the review thread), a file and a link in it too, what the link names kept."""
    trash = os.path.join(gurtd.home, "review", ".trash-t1-abcd")
    os.makedirs(os.path.join(trash, "deep", "er"))
    with open(os.path.join(trash, "deep", "er", "f"), "w") as f:
        f.write("x")
    os.symlink(gurtd.home, os.path.join(trash, "link"))
    gurtd.restart(kill=True)
    eventually(lambda: not os.path.exists(trash), what="the review trash deleted")
    assert os.path.isdir(os.path.join(gurtd.home, "tasks"))


def test_a_folder_made_anew_replaces_the_old_one_whole(gurtd: Gurtd, owner_folder: str) -> None:
    before = snapshot(owner_folder)
    task = run_on(gurtd, owner_folder, "rm -r olddir && mkdir olddir && echo fresh > olddir/x.txt")
    code, diff, _ = gurtd.request("GET", f"/api/tasks/{task['id']}/diff")
    text = diff.decode()
    assert "deleted file mode 100644" in text and "-z" in text and "+fresh" in text, text
    assert keep(gurtd, task["id"])[0] == 200
    assert sorted(os.listdir(os.path.join(owner_folder, "olddir"))) == ["x.txt"]
    assert open(os.path.join(owner_folder, "olddir/x.txt")).read() == "fresh\n"
    gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert snapshot(owner_folder) == before


def test_the_droid_worker_is_told_about_its_folders(gurtd: Gurtd, owner_folder: str) -> None:
    with droid_installed(gurtd, "#!/bin/sh\ncat /run/gurt/system-prompt.md > "   # it copies
                         f"{owner_folder}/seen.md\n"):                            # its prompt
        task = gurtd.run("look", title="droid", worker=None, folder=owner_folder)
    assert task["state"] == "done", gurtd.log(task["id"])
    assert keep(gurtd, task["id"])[0] == 200
    seen = open(os.path.join(owner_folder, "seen.md")).read()
    assert f"- Folders: {owner_folder} are your own copy-on-write copies" in seen, seen


def test_a_keep_cut_short_by_a_full_disk_goes_on_with_the_next_keep(
        gurtd: Gurtd, owner: pwd.struct_passwd, scratch: Any) -> None:
    """The owner's folder is on a small ext4 image under /srv; the disk fills mid-keep."""
    image, mnt = str(scratch / "disk.img"), f"/srv/gurt-review-{secrets.token_hex(3)}"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", "-F", image], check=True)
    os.mkdir(mnt)
    loop = subprocess.run(["losetup", "--find", "--show", image], check=True,
                          capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["mount", "-t", "ext4", loop, mnt], check=True)
        folder = os.path.join(mnt, "proj")
        os.mkdir(folder)
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        task = run_on(gurtd, folder,
                      "for i in $(seq 40); do head -c 100000 /dev/urandom > f$i; done")
        assert task["review"] == "pending", gurtd.log(task["id"])
        filler = os.path.join(mnt, "filler")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        os.truncate(filler, max(0, os.path.getsize(filler) - (1 << 20)))   # 1 MiB left
        code, data = keep(gurtd, task["id"])
        assert code == 507 and data["code"] == "insufficient_storage", data
        assert gurtd.task(task["id"])["review"] == "pending"
        os.unlink(filler)
        code, data = keep(gurtd, task["id"])
        assert code == 200 and data["review"] == "kept", data
        assert sorted(os.listdir(folder)) == sorted(f"f{i}" for i in range(1, 41))
        assert all(os.path.getsize(os.path.join(folder, f"f{i}")) == 100000
                   for i in range(1, 41))
        gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
        assert os.listdir(folder) == []
    finally:
        subprocess.run(["umount", mnt], check=False)
        subprocess.run(["losetup", "-d", loop], check=False)
        os.rmdir(mnt)



def _sticky_folder(top: str, owner: pwd.struct_passwd) -> str:
    """A root-owned sticky 1777 folder in the owner's folder, with a file of the owner's and
    one of root's (mode 0666: anyone may write it, only its owner remove it)."""
    shared = os.path.join(top, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    for name, ids in (("mine.txt", (owner.pw_uid, owner.pw_gid)), ("theirs.txt", (0, 0))):
        Path(shared, name).write_text(f"{name}\n")
        os.chown(os.path.join(shared, name), *ids)
        os.chmod(os.path.join(shared, name), 0o666)
    time.sleep(0.05)
    return shared


def test_a_kept_file_in_a_root_sticky_folder_is_the_owners(
        gurtd: Gurtd, owner: pwd.struct_passwd, owner_folder: str) -> None:
    """Issue 25, class 2: a file the task made in a root-owned 1777 folder was kept as root's,
    and the owner's own file there became root's; so was a new folder (one more member)."""
    shared = _sticky_folder(owner_folder, owner)
    task = run_on(gurtd, owner_folder, "echo new > shared/new.txt && chmod 755 shared/new.txt",
                  "echo edit >> shared/mine.txt",
                  "mkdir shared/made && echo in > shared/made/in.txt")
    code, data = keep(gurtd, task["id"])
    assert code == 200, data
    ids = (owner.pw_uid, owner.pw_gid)
    for rel in ("new.txt", "mine.txt", "made", "made/in.txt"):
        st = os.lstat(os.path.join(shared, rel))
        assert (st.st_uid, st.st_gid) == ids, (rel, st.st_uid, st.st_gid)
    assert open(os.path.join(shared, "mine.txt")).read() == "mine.txt\nedit\n"
    assert stat.S_IMODE(os.lstat(os.path.join(shared, "new.txt")).st_mode) == 0o755
    gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert sorted(os.listdir(shared)) == ["mine.txt", "theirs.txt"]
    assert os.lstat(os.path.join(shared, "mine.txt")).st_uid == owner.pw_uid


def test_keep_honours_the_sticky_bit_as_the_kernel_would(
        gurtd: Gurtd, owner: pwd.struct_passwd, owner_folder: str) -> None:
    """Another user's file in a sticky folder the owner does not own: the owner could write
    into it but not replace or remove it, so keep does neither, even forced: root's file the
    task wrote to, and a file another user made there after the task made its own."""
    shared = _sticky_folder(owner_folder, owner)
    task = run_on(gurtd, owner_folder,      # no O_CREAT: protected_regular would refuse it
                  "echo task | dd of=shared/theirs.txt conv=notrunc,nocreat oflag=append "
                  "status=none", "echo task > shared/late.txt", "rm -r olddir")
    assert task.get("review") == "pending", (task, gurtd.log(task["id"]))
    y = os.path.join(owner_folder, "olddir/y")      # made a sticky folder of root's since
    os.chown(y, 0, 0)
    os.chmod(y, 0o1777)
    for late in (os.path.join(shared, "late.txt"), os.path.join(y, "late.txt")):
        Path(late).write_text("another user's\n")
        os.chown(late, 4321, 4321)
    code, data = keep(gurtd, task["id"], {"force": True})
    assert code == 409, data
    why = "the folder is sticky and the file is another user's: its owner may not replace " \
          "or delete it"
    assert {c["path"]: c["why"] for c in data["conflicts"]} == {
        "shared/theirs.txt": why, "shared/late.txt": why,
        "olddir": "the folder holds another user's file in a sticky folder: its owner may not "
                  "delete it"}, data
    assert os.path.exists(os.path.join(y, "late.txt"))
    assert (os.lstat(os.path.join(shared, "theirs.txt")).st_uid,
            open(os.path.join(shared, "theirs.txt")).read()) == (0, "theirs.txt\n")
    assert os.lstat(os.path.join(shared, "late.txt")).st_uid == 4321


def test_an_undo_that_cannot_put_everything_back_says_so_and_can_be_tried_again(
        gurtd: Gurtd, owner_folder: str) -> None:
    """Issue 25, class 6: undo while a kept file's folder was swapped for a symlink answered
    200 undone and left the kept file; one more member: an original to put back under a
    folder that is now a file.  The undo names what it could not do, the task stays kept,
    and the next undo (the folders as they were) finishes it."""
    before = snapshot(owner_folder)
    task = run_on(gurtd, owner_folder, "echo new > sub/new.txt && echo changed > olddir/x.txt")
    assert keep(gurtd, task["id"])[0] == 200
    sub, olddir = os.path.join(owner_folder, "sub"), os.path.join(owner_folder, "olddir")
    os.rename(sub, sub + ".real")
    os.symlink("sub.real", sub)
    os.rename(olddir, olddir + ".real")
    Path(olddir).write_text("a file now\n")
    code, data, _ = gurtd.request("POST", f"/api/tasks/{task['id']}/undo", {"force": True})
    assert code == 409 and data["code"] == "conflict", data
    assert {c["path"]: c["why"] for c in data["notUndone"]} == {
        "olddir/x.txt": "olddir is not a folder",
        "sub/new.txt": "sub is a symlink in the real folder"}, data
    assert gurtd.task(task["id"])["review"] == "kept"
    assert os.path.exists(os.path.join(sub + ".real", "new.txt"))
    os.unlink(sub)
    os.rename(sub + ".real", sub)
    os.unlink(olddir)
    os.rename(olddir + ".real", olddir)
    undone = gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert undone["review"] == "undone", undone
    assert snapshot(owner_folder) == before
    no_leftovers(gurtd, task["id"], owner_folder)


def _diff_children(g: Gurtd) -> list[int]:
    """diff(1) processes gurtd runs now."""
    assert g.proc is not None
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == g.proc.pid and argv[:2] == [b"diff", b"-u"]:
            out.append(int(pid))
    return out


def test_a_costly_diff_is_bounded_and_stops_when_its_client_goes(gurtd: Gurtd) -> None:
    """Issue 25, class 3: the diff of two orderings of a 600 KB file of 200,000 lines never
    answered in 40 s and kept a core busy after the client left (difflib is quadratic).  One
    more member: a file of 8 MiB of short lines, shuffled.  Viewers who ask and leave stop
    their work; the one who waits gets an answer in bounded time; the loop answers all along."""
    gurtd.api("POST", "/api/workspaces", {"name": "difftest"}, status=201)
    lines = "".join(f"{i % 100:02d}\n" for i in range(200_000)).encode()
    assert len(lines) == 600_000
    for name, data in (("order.txt", lines), ("big.txt", b"".join(
            b"%07d\n" % i for i in range(1_000_000)))):
        gurtd.api("PUT", f"/api/workspaces/difftest/files/{name}", raw=data, status=201,
                  headers={"Content-Type": "application/octet-stream"})
    task = gurtd.run_done("sort -o order.txt order.txt && shuf -o big.txt big.txt",
                          workspace="difftest")
    url = f"/api/tasks/{task['id']}/diff"
    for _ in range(3):                         # the portal's views, opened and left
        conn = gurtd.connection()
        conn.request("GET", url, headers={"Authorization": f"Bearer {gurtd.token}"})
        eventually(lambda: _diff_children(gurtd), 20, "the diff's children")
        conn.close()
        eventually(lambda: not _diff_children(gurtd), 2,    # diff(1) ends with it, not in 10 s
                   "the diff's children to end with the client")
    slowest, answer = 0.0, []
    waiter = threading.Thread(target=lambda: answer.append(
        (time.monotonic(), gurtd.request("GET", url), time.monotonic())))
    waiter.start()
    while waiter.is_alive():
        began = time.monotonic()           # the loop's own answer: a stop of no task
        gurtd.request("POST", "/api/tasks/t000000000/stop")
        slowest = max(slowest, time.monotonic() - began)
        time.sleep(0.05)
    (began, (code, text, _), ended) = answer[0]
    assert code == 200, text
    print(f"diff answered in {ended - began:.1f} s, the loop's worst wait {slowest:.3f} s")
    assert ended - began < G.DIFF_SECONDS + 5 and slowest < 2.0, (ended - began, slowest)
    assert b"+++ b/order.txt" in text or b"order.txt differ (600000 -> 600000 bytes" in text
    assert b"big.txt differ (8000000 -> 8000000 bytes: too costly to diff here)" in text or \
        b"+++ b/big.txt" in text
    assert not _diff_children(gurtd)


def _small_files_shuffled(g: Gurtd) -> dict[str, Any]:
    """A task that shuffled the lines of 170 files of 24 KB: one diff -r of them all takes
    some seconds."""
    g.api("POST", "/api/workspaces", {"name": "together"}, status=201)
    g.run_done(python_line(
        "import random\nrng = random.Random(5)\nfor i in range(170):\n"
        "    open(f'f{i}.txt', 'w').write(''.join(f'{rng.randint(0, 99999)}\\n'"
        " for _ in range(4000)))\n"), workspace="together")
    return g.run_done(python_line(
        "import random\nfor i in range(170):\n"
        "    lines = open(f'f{i}.txt').read().splitlines(keepends=True)\n"
        "    random.Random(i).shuffle(lines)\n"
        "    open(f'f{i}.txt', 'w').write(''.join(lines))\n"), workspace="together")


def test_a_together_diff_ends_with_its_client_and_leaves_nothing_nor_a_warning(
        gurtd: Gurtd) -> None:
    """Small files (pairs up to 64 KiB) are diffed together, by one diff -r of copies under
    /dev/shm: a viewer who leaves in the middle ends that diff -r at once, its folder goes,
    and the log says nothing of it (the gone client, a ConnectionError, was taken for a full
    /dev/shm: a warning that the small files could not be written, for each such viewer)."""
    task = _small_files_shuffled(gurtd)
    before = os.path.getsize(gurtd.log_path)
    conn = gurtd.connection()
    conn.request("GET", f"/api/tasks/{task['id']}/diff",
                 headers={"Authorization": f"Bearer {gurtd.token}"})
    eventually(lambda: [p for p in _diff_children(gurtd)
                        if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[2] == b"-r"],
               20, "the diff -r of the small files")
    conn.close()
    eventually(lambda: not _diff_children(gurtd), 2, "the diff -r to end with its client")
    assert gurtd.proc is not None
    eventually(lambda: not glob.glob(f"{G.DIFF_TMP}/gurt-diff-{gurtd.proc.pid}-*"), 2,
               "the copies of the small files removed")
    assert gurtd.api("GET", "/api/health")
    with open(gurtd.log_path, "rb") as f:
        f.seek(before)
        logged = f.read().decode(errors="replace")
    assert "diff:" not in logged, logged


def test_a_stop_in_the_middle_of_a_together_diff_leaves_no_copies(gurtd: Gurtd) -> None:
    """gurtd stopped (SIGTERM, a clean stop) while it diffs small files together: its copies
    of them under /dev/shm go with it, where they stayed (8 MiB of memory) until a next
    start of a gurtd."""
    task = _small_files_shuffled(gurtd)
    assert gurtd.proc is not None
    pid = gurtd.proc.pid
    conn = gurtd.connection()
    conn.request("GET", f"/api/tasks/{task['id']}/diff",
                 headers={"Authorization": f"Bearer {gurtd.token}"})
    eventually(lambda: glob.glob(f"{G.DIFF_TMP}/gurt-diff-{pid}-*/b/169"), 20,
               "the copies of the small files written")
    try:
        assert gurtd.stop() == 0
    finally:
        conn.close()
    left = glob.glob(f"{G.DIFF_TMP}/gurt-diff-{pid}-*")
    for path in left:
        shutil.rmtree(path)
    assert not left


def test_a_name_that_is_not_utf8_is_kept_and_shown_escaped(gurtd: Gurtd,
                                                           owner_folder: str) -> None:
    """Issue 25, class 6, in a personal folder: a Latin-1 name goes through the changes, the
    diff, keep (the very bytes on disk) and the task's log (\\xNN, valid UTF-8)."""
    task = run_on(gurtd, owner_folder, "printf latin > \"$(printf 'caf\\351.txt')\"")
    assert task.get("review") == "pending", (task, gurtd.log(task["id"]))
    changes = gurtd.api("GET", f"/api/tasks/{task['id']}/changes")
    assert {"folder": owner_folder, "path": "caf\\xe9.txt", "change": "added"} in changes
    code, diff, _ = gurtd.request("GET", f"/api/tasks/{task['id']}/diff")
    assert code == 200 and b'+++ "b/caf\\351.txt"' in diff, diff
    assert keep(gurtd, task["id"])[0] == 200
    with open(os.path.join(os.fsencode(owner_folder), b"caf\xe9.txt"), "rb") as f:
        assert f.read() == b"latin"
    kept = [e for e in gurtd.log(task["id"]) if e.get("action") == "kept"]
    assert kept and f"{owner_folder}/caf\\xe9.txt" in kept[0]["paths"], kept
    json.dumps(kept, ensure_ascii=False).encode()
    gurtd.api("POST", f"/api/tasks/{task['id']}/undo")
    assert not os.path.lexists(os.path.join(os.fsencode(owner_folder), b"caf\xe9.txt"))


# a task's million files ######################################################################

def _many_empty_files(top: Path, count: int, wide: int) -> tuple[str, str, dict[str, Any]]:
    """A real folder (empty) and a task's copy of it holding count empty files in wide
    folders: (real, upper, its folderInfo)."""
    real, upper = top / "real", top / "upper"
    real.mkdir()
    for d in range(wide):
        (upper / str(d)).mkdir(parents=True)
        for i in range(count // wide):
            os.mknod(upper / str(d) / str(i))
    st = os.stat(real)
    return str(real), str(upper), {"path": str(real), "dev": st.st_dev, "ino": st.st_ino}


@pytest.mark.parametrize("wide", [1, 30])
def test_a_task_copy_of_many_empty_files_is_refused_at_the_changes_cap_in_memory(
        scratch: Path, monkeypatch: Any, wide: int) -> None:
    """Issue 23, the hostile round: a task made 1,000,000 empty files in its copy of my
    folder, and one GET of its changes (or its diff, or a keep) held 680 MB in gurtd, with no
    cap (a workspace task's changes have one).  30,000 (in one folder, or 30 of 1,000) under
    a 1 MiB cap: a 413 that says what and that nothing changed, and never much held past the
    cap, for the changes and for the listing diff and keep read; under 64 MiB, all of them."""
    real, upper, info = _many_empty_files(scratch, 30_000, wide)
    monkeypatch.setattr(G, "CHANGES_MAX_MEMORY", 1 << 20)
    for listing in (lambda: G.folder_change_list([real], [upper], [info]),
                    lambda: list(G.upper_changes(upper))):
        tracemalloc.start()
        try:
            try:
                outcome: Any = len(listing())
            except G.ApiError as exc:
                outcome = (exc.status, exc.code, str(exc))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert isinstance(outcome, tuple) and outcome[:2] == (413, "too_large"), \
            f"{outcome} changes listed, {peak} bytes at the peak"
        assert "the task's folders are more than 1 MiB" in outcome[2] and \
            "nothing was changed" in outcome[2], outcome
        assert peak < 1.25 * (1 << 20), f"{peak} bytes held to list changes past a 1 MiB cap"
    assert os.listdir(real) == []
    monkeypatch.setattr(G, "CHANGES_MAX_MEMORY", 64 << 20)      # under it: all of them
    changes = G.folder_change_list([real], [upper], [info])
    assert len(changes) == 30_000 + wide
    assert {"folder": real, "path": "0/", "change": "added"} in changes


def test_a_task_copy_of_many_files_is_listed_with_nothing_the_collector_walks(
        scratch: Path) -> None:
    """The same task's 1,000,000 files under the cap: the loop still waited up to 290 ms at
    a time while they were listed (a 1 ms ticker thread, as the red team measured): each
    entry was a dataclass object, and each full collection of the garbage collector walked
    them all with the GIL held (the more the longer, 150-290 ms at 1-2 million).  Listed now,
    30,000 entries add no object for the collector to walk, and are still each a Change."""
    _, upper, _ = _many_empty_files(scratch, 30_000, 3)
    gc.collect()
    before = len(gc.get_objects())
    changes = G.upper_changes(upper)
    gc.collect(0)                         # young tuples of plain values are let go here
    grown = len(gc.get_objects()) - before
    assert grown < 1_000, f"{grown} objects more for the collector to walk"
    listed = list(changes)
    assert len(listed) == 30_003 and listed[0] == G.Change("0", "dir", 0o755, False, False)
    assert listed[1].path == "0/0" and listed[1].kind == "file"


def test_a_keep_past_the_most_a_task_keeps_is_refused_and_a_part_of_it_is_kept(
        new_gurtd: Any, owner_folder: str) -> None:
    """Issue 23, the hostile round: keep of a task's 1,000,000 new files, and its undo, held
    the loop 5-6 s and gurtd 1.38 GB (the journal, kept.json and the undo's are JSON written
    and read whole, each one C call with the GIL held).  A task keeps at most
    KEEP_MAX_CHANGES paths in all (here 40): a keep of 51 is a 413 that says so and changes
    nothing; a part of it is kept with paths, the rest past the most is refused, and the
    undo puts my folder back."""
    g = new_gurtd({"GURT_KEEP_MAX_CHANGES": "40"})
    before = snapshot(owner_folder)
    task = run_on(g, owner_folder, "mkdir many && cd many && seq 1 50 | xargs touch")
    assert task["state"] == "done" and task["review"] == "pending", g.log(task["id"])
    code, data = keep(g, task["id"])
    assert (code, data["code"]) == (413, "too_large"), data
    assert "more than 40 changes to keep" in data["error"] and \
        "a task keeps at most 40 paths" in data["error"], data
    assert snapshot(owner_folder) == before and g.task(task["id"])["review"] == "pending"
    code, data = keep(g, task["id"], {"paths": [f"many/{i}" for i in range(1, 31)]})
    assert code == 200 and data["review"] == "pending", data     # many/ and 30 of its files
    assert len(os.listdir(os.path.join(owner_folder, "many"))) == 30
    code, data = keep(g, task["id"])                              # 20 more: 51 in all
    assert (code, data["code"]) == (413, "too_large") and "with paths" in data["error"], data
    assert len(os.listdir(os.path.join(owner_folder, "many"))) == 30
    code, data = keep(g, task["id"], {"paths": [f"many/{i}" for i in range(31, 40)]})
    assert code == 200, data                                      # 40 in all
    undone = g.api("POST", f"/api/tasks/{task['id']}/undo")
    assert undone["review"] == "undone", undone
    assert snapshot(owner_folder) == before
    no_leftovers(g, task["id"], owner_folder)
