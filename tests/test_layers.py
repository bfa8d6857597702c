"""Ten thousand undoable layers (issue 10): views past overlay's 500-layer limit stay exact.

Stories: a random history of layers (files, folders, deletions, a folder replaced by a file and
back, opaque folders) merged in groups and viewed through the real kernel overlay, checked
after every step against a plain Python model of what the workspace must contain; the same
through gurtd's own tasks, undo and files API with tiny groups; a workspace with 10,000 done
layers (made directly on disk, see below) where tasks start, see everything, and any task is
undone at once; kill -9 of gurtd in the middle of a merge, and nothing half made is trusted.
"""

from __future__ import annotations

import os
import random
import stat
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from conftest import (Gurtd, deep_tree, end_sleep, eventually, gurtd_on_done_layers,
                      make_done_layers, make_home, registry, remove_home, running_gurtd,
                      wait_for_step)

import gurtd

O_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
NAMES = ["a", "b", "c"]


# A plain model: a layer is {path: entry}, entry ("f", text) | ("w",) | ("d", opaque)

def random_layer(rng: random.Random, depth: int = 3) -> dict[str, tuple[Any, ...]]:
    """A well-formed layer: every entry's parents are folders of the layer."""
    layer: dict[str, tuple[Any, ...]] = {}

    def fill(prefix: str, level: int) -> None:
        for name in NAMES:
            path = f"{prefix}/{name}" if prefix else name
            roll = rng.random()
            if roll < 0.45:
                continue
            if roll < 0.7 or level >= depth:
                layer[path] = ("f", f"{path}@{rng.randrange(10**6)}")
            elif roll < 0.8:
                layer[path] = ("w",)
            else:
                layer[path] = ("d", rng.random() < 0.25)
                fill(path, level + 1)

    fill("", 1)
    return layer


def model_view(layers_newest_first: list[dict[str, tuple[Any, ...]]]) -> dict[str, Any]:
    """What the stack must show, computed in Python (oldest applied first): a file or a
    whiteout replaces what was there with all below it; an opaque folder starts empty; a
    plain folder merges into a folder, and replaces a file."""
    view: dict[str, Any] = {}
    for layer in reversed(layers_newest_first):
        for path in sorted(layer, key=lambda p: p.count("/")):
            entry = layer[path]
            clear = entry[0] in ("f", "w") or (entry[0] == "d" and (entry[1] or
                                                                   view.get(path) != "d"))
            if clear:
                for key in [k for k in view if k == path or k.startswith(path + "/")]:
                    del view[key]
            if entry[0] == "f":
                view[path] = entry[1]
            elif entry[0] == "d":
                view[path] = "d"
    return view


def write_layer(top: str, layer: dict[str, tuple[Any, ...]], owner: tuple[int, int]) -> None:
    """A layer on disk as overlay makes it: files, whiteouts (char 0/0), opaque folders."""
    os.makedirs(top)
    os.chown(top, *owner)
    for path in sorted(layer, key=lambda p: p.count("/")):
        entry, full = layer[path], os.path.join(top, path)
        if entry[0] == "f":
            Path(full).write_text(entry[1])
            os.chown(full, *owner)
        elif entry[0] == "w":
            os.mknod(full, stat.S_IFCHR | 0o600, os.makedev(0, 0))
            if "/" in path:                   # copied up: overlay marks it with an origin
                os.setxattr(os.path.dirname(full), "trusted.overlay.origin", b"")
        else:
            os.mkdir(full, 0o755)
            os.chown(full, *owner)
            if entry[1]:
                os.setxattr(full, "trusted.overlay.opaque", b"y")


def read_tree(top: str) -> dict[str, Any]:
    """What a mounted view shows: {path: text or "d"}."""
    out: dict[str, Any] = {}
    for root, dirs, files in os.walk(top):
        rel = os.path.relpath(root, top)
        for name in dirs:
            out[os.path.normpath(os.path.join(rel, name))] = "d"
        for name in files:
            with open(os.path.join(root, name)) as f:
                out[os.path.normpath(os.path.join(rel, name))] = f.read()
    return out


def mounted_view(home: str, lowers: list[Any]) -> dict[str, Any]:
    """The real kernel overlay of a fitted plan, read whole."""
    home_fd = os.open(home, O_DIR)
    try:
        fd = gurtd.overlay_open_plan(home_fd, lowers)
    finally:
        os.close(home_fd)
    try:
        return read_tree(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def test_a_random_history_of_merged_layers_matches_the_model(scratch: str) -> None:
    """Hundreds of random layers; groups merged as they fill, rebuilt after undos of old and
    new layers; after every step the kernel's view of the plan (merged layers, single layers,
    an inner overlay past the limit) equals the model of the plain stack."""
    rng = random.Random(10)
    home = str(scratch)
    owner = (os.getuid(), os.getgid())
    base_layer = {p: ("d", False) if e[0] == "d" else e
                  for p, e in random_layer(rng).items() if e[0] != "w"}
    write_layer(os.path.join(home, "workspaces", "w"), base_layer, owner)
    os.makedirs(os.path.join(home, "layers"))
    stack = gurtd.LayerStack(home)
    stack.group, stack.keep = 8, 6
    stack.load()
    content: dict[str, dict[str, tuple[Any, ...]]] = {}
    ever: list[str] = []
    done: list[str] = []                               # oldest first
    limit, nested = 30, 0                               # a small limit, to nest too
    for step in range(260):
        if done and rng.random() < 0.2:
            victim = rng.choice(done[:8] if rng.random() < 0.5 else done[-8:])
            done.remove(victim)
        else:
            layer_id = f"t{step:09d}"
            content[layer_id] = random_layer(rng)
            write_layer(os.path.join(home, "layers", layer_id, "upper"), content[layer_id],
                        owner)
            ever.append(layer_id)
            done.append(layer_id)
        stack.regroup("w", ever)
        newest_first = done[::-1]
        if step % 3 == 0:                             # merges catch up now and then
            for group, members in stack.due("w", newest_first):
                merged = gurtd.MergedLayer(stack.new_name("w", group), "w", group, members)
                gurtd.merge_layers([os.path.join(home, "layers", m, "upper") for m in members],
                                   os.path.join(stack.dir, merged.name))
                stack.record(merged)
            stack.forget(stack.unused("w", newest_first, set()))
        plan = stack.plan("w", newest_first)
        lowers = gurtd.fit_lowers(plan, "workspaces/w", limit)
        expected = model_view([content[i] for i in newest_first] + [base_layer])
        assert mounted_view(home, lowers) == expected, (step, plan)
        nested += isinstance(lowers[-1], list)
    assert nested, "the view never needed an inner overlay"
    assert any(p.startswith("merged/") for p in plan), "no merged layer was ever used"
    # merged layers add no file data: every file in them is a hard link
    for root, _, files in os.walk(stack.dir):
        for name in files if root != stack.dir else []:     # not the records
            st = os.lstat(os.path.join(root, name))
            assert not stat.S_ISREG(st.st_mode) or st.st_nlink >= 2, name


def test_both_overlay_ways_show_the_same_views_to_the_limit_and_past_it(scratch: str) -> None:
    """Kernels before 6.15 mount no overlay of fds on a detached mount (Debian 12's 6.1 knows
    no `lowerdir+` at all), so gurtd takes the legacy way there: mount(2) in a thread's own
    namespace, layers named by fd.  The fd way (where this kernel has it) and the legacy way
    show 500 layers, 600 (an inner overlay), and a writable view alike; the legacy way leaves
    no mount behind, and its option string is refused before the kernel would cut it."""
    rng = random.Random(7)
    owner = (os.getuid(), os.getgid())
    layers = [random_layer(rng, depth=2) for _ in range(600)]
    for i, layer in enumerate(layers):
        write_layer(os.path.join(scratch, "layers", f"t{i:09d}", "upper"), layer, owner)
    write_layer(os.path.join(scratch, "workspaces", "w"), {"base.txt": ("f", "base")}, owner)
    saved = os.environ.pop(gurtd.OVERLAY_API_ENV, None)
    try:
        ways = ["legacy"] if gurtd.overlay_probe(None)[0] == "legacy" else ["fd", "legacy"]
    finally:
        if saved is not None:
            os.environ[gurtd.OVERLAY_API_ENV] = saved
    try:
        for count in (499, 600):
            ids = [f"t{i:09d}" for i in reversed(range(count))]        # newest first
            lowers = gurtd.fit_lowers(gurtd.lower_layer_paths(ids), "workspaces/w")
            assert isinstance(lowers[-1], list) == (count == 600)
            expected = model_view([layers[i] for i in reversed(range(count))] +
                                  [{"base.txt": ("f", "base")}])
            for way in ways:
                gurtd.overlay_way_set(way)
                assert mounted_view(scratch, lowers) == expected, (way, count)
        for way in ways:                                               # a task's view: rw
            gurtd.overlay_way_set(way)
            for name in ("upper", "work"):
                os.makedirs(os.path.join(scratch, way, name))
            home_fd = os.open(scratch, O_DIR)
            try:
                view = gurtd.overlay_open_plan(home_fd, ["layers/t000000001/upper",
                                                         "workspaces/w"], f"{way}/upper",
                                               f"{way}/work")
            finally:
                os.close(home_fd)
            Path(f"/proc/self/fd/{view}/new.txt").write_text(way)
            os.close(view)
            assert Path(scratch, way, "upper", "new.txt").read_text() == way
    finally:
        gurtd.overlay_way_set("")
    with open("/proc/self/mountinfo") as f:              # the builders' mounts went with them
        assert " - tmpfs gurt-overlay " not in f.read()
    assert len(gurtd.overlay_mount_data([str(65535 - i) for i in range(500)], "1", "2")) < \
        gurtd.MOUNT_DATA_MAX
    with pytest.raises(gurtd.SysError, match="past the 4000"):
        gurtd.overlay_mount_data(["/var/lib/gurt/layers/t000000000/upper"] * 120)


def test_a_merged_layer_keeps_owners_modes_links_and_deep_trees(scratch: str) -> None:
    """A folder's owner, mode and user xattrs come from the top layer; a symlink stays a
    symlink (never followed); a tree thousands of levels deep merges whole."""
    home, store = str(scratch), (4242, 4343)
    top, low = os.path.join(home, "top"), os.path.join(home, "low")
    for layer in (top, low):
        os.makedirs(os.path.join(layer, "d"))
    os.chown(os.path.join(top, "d"), *store)
    os.chmod(os.path.join(top, "d"), 0o750)
    os.setxattr(os.path.join(top, "d"), "user.note", b"kept")
    os.symlink("/etc/shadow", os.path.join(top, "d", "link"))
    deep = os.path.join(low, "deep")
    os.mkdir(deep)
    deep_tree(deep, 1500, "n" * 20, "bottom", 0o644)      # longer than PATH_MAX
    gurtd.merge_layers([top, low], os.path.join(home, "m"))
    st = os.lstat(os.path.join(home, "m", "d"))
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*store, 0o750)
    assert os.getxattr(os.path.join(home, "m", "d"), "user.note") == b"kept"
    assert os.readlink(os.path.join(home, "m", "d", "link")) == "/etc/shadow"
    root = os.open(os.path.join(home, "m", "deep"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = gurtd.open_dir_beneath(root, "/".join(["n" * 20] * 1500))
        assert fd is not None
        assert "bottom" in os.listdir(fd)
        os.close(fd)
    finally:
        os.close(root)


@pytest.mark.parametrize("wide", [1, 30])
def test_a_layer_of_many_empty_files_is_refused_at_the_changes_cap_in_memory(
        scratch: str, monkeypatch: Any, wide: int) -> None:
    """A task's layer of 30,000 empty files with short names (in one folder, or 30 of 1,000):
    listed whole, its changes hold ~250 bytes an entry (a dict, a str, list slots) of which
    ~6 are path, so a cap that counted the paths let millions of them grow gurtd by
    gigabytes.  Under a 1 MiB cap the listing is a 413 and never holds much past the cap."""
    upper, lower = os.path.join(scratch, "upper"), os.path.join(scratch, "lower")
    os.mkdir(lower)
    for d in range(wide):
        os.makedirs(os.path.join(upper, str(d)))
        for i in range(30_000 // wide):
            os.mknod(os.path.join(upper, str(d), str(i)))
    monkeypatch.setattr(gurtd, "CHANGES_MAX_MEMORY", 1 << 20)
    tracemalloc.start()
    try:
        try:
            outcome: Any = len(gurtd.changed_paths(upper, [lower]))
        except gurtd.ApiError as exc:
            outcome = exc.status
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcome == 413, f"{outcome} changes listed, {peak} bytes at the peak"
    assert peak < 1.25 * (1 << 20), f"{peak} bytes held to list changes past a 1 MiB cap"
    monkeypatch.setattr(gurtd, "CHANGES_MAX_MEMORY", 64 << 20)      # under it: all of them
    assert len(gurtd.changed_paths(upper, [lower])) == 30_000 + wide


GROUP_ENV = {"GURT_LAYER_GROUP": "3", "GURT_LAYER_KEEP": "2"}


def test_tasks_undo_and_files_through_merged_layers() -> None:
    """Through gurtd with tiny groups: tasks that add, change, delete files and folders;
    merges happen in the background; undo of old and new tasks answers at once and the
    files API and the next task see exactly the model; the undone tasks' layers go."""
    rng = random.Random(7)
    with running_gurtd(GROUP_ENV) as g:
        history: list[tuple[str, str, str | None]] = []   # (task, path, text or None)
        done: list[str] = []
        for step in range(18):
            if done and step % 5 == 4:
                victim = done.pop(rng.randrange(len(done)))
                t0 = time.monotonic()
                assert g.api("POST", f"/api/tasks/{victim}/undo")["state"] == "undone"
                assert time.monotonic() - t0 < 5
            else:
                name = f"f{rng.randrange(5)}"
                if rng.random() < 0.25:
                    prompt, text = f"rm -rf {name}", None
                elif rng.random() < 0.3:
                    prompt = f"rm -rf {name}; mkdir -p {name}/in; echo s{step} > {name}/in/x"
                    text = f"dir:s{step}"
                else:
                    prompt, text = f"rm -rf {name}; echo s{step} > {name}", f"s{step}"
                task = g.run_done(prompt)
                done.append(task["id"])
                history.append((task["id"], name, text))
            expected: dict[str, str | None] = {}
            for task_id, name, text in history:
                if task_id in done:
                    expected[name] = text
            for name, text in expected.items():
                if text is None:
                    assert g.file("home", name) is None, (step, name)
                elif text.startswith("dir:"):
                    assert g.file("home", f"{name}/in/x") == text[4:].encode() + b"\n"
                else:
                    assert g.file("home", name) == text.encode() + b"\n", (step, name)
        eventually(lambda: registry(g.home)["merged"], what="a merged layer")
        assert g.api("GET", "/api/workspaces/home")["layers"] == len(done)
        # a new task sees the same as the files API
        names = sorted({n for _, n, t in history})
        check = g.run("for f in " + " ".join(names) + "; do if [ -d $f ]; then cat $f/in/x; "
                      "elif [ -e $f ]; then cat $f; else echo none; fi; done")
        seen = g.output(check["id"])
        for name, line in zip(names, seen):
            text = None
            for task_id, n, t in history:
                if task_id in done and n == name:
                    text = t
            assert line == ("none" if text is None else text.removeprefix("dir:")), name


# 10,000 layers: made directly on disk (conftest's make_done_layers), because 10,000 real
# tasks would take too long for CI.

def test_ten_thousand_layers_start_view_and_undo_at_once() -> None:
    """A workspace with 10,000 done layers: gurtd merges the old ones in the background; a
    task starts and sees every layer's file; undo of the oldest and of the newest answer at
    once and are gone for the files API and the next task; merges then catch up."""
    with gurtd_on_done_layers(10_000) as (g, ids):
        home = g.home
        # 10,000 layers that were never merged need the merges first (a view takes at
        # most 499 x 2 layers): 409 until then, then every file at once
        eventually(lambda: len(registry(home)["merged"]) == (10_000 - 64) // 128,
                   timeout=120, what="every group merged")
        assert g.file("home", "n1") == b"1\n"
        assert g.file("home", "n7777") == b"7777\n"
        assert g.file("home", "shared") == b"10000\n"
        task = g.run("cat n1 n5000 n10000 shared")
        assert g.output(task["id"]) == ["1", "5000", "10000", "10000"], g.log(task["id"])
        assert len(task["layers"]) == 10_000 and task["layers"][0] == ids[-1]
        for victim, name in ((ids[0], "n1"), (ids[-1], "n10000")):
            t0 = time.monotonic()
            g.api("POST", f"/api/tasks/{victim}/undo")
            assert time.monotonic() - t0 < 10            # speed belongs to the bench
            assert g.file("home", name) is None
        assert g.file("home", "shared") == b"9000\n"
        again = g.run("cat n1 n2 shared 2>&1; true")
        assert g.output(again["id"])[1:] == ["2", "9000"], g.log(again["id"])
        info = g.api("GET", "/api/workspaces/home")
        assert info["layers"] == 10_000 - 2 + 2          # the two tasks of this test
        # the task file names its 10,000 layers by reference to a shared stack file
        assert os.path.getsize(os.path.join(home, "tasks", task["id"] + ".json")) < 4096
        listed = g.api("GET", "/api/tasks?fields=id,layers,state&limit=3")
        assert [set(t) for t in listed] == [{"id", "layers", "state"}] * 3
        assert listed[1]["layers"] == task["layers"]
        g.api("GET", "/api/tasks?fields=id,secret", status=400)
        # the two undos made their groups' merged layers stale: the rebuilds run in the
        # background, so a loaded machine may read the count before they end
        info = eventually(lambda: (i := g.api("GET", "/api/workspaces/home"))["mergedLayers"]
                          >= (10_000 - 64) // 128 and i, timeout=120, what="the rebuilds")
        assert info["mergedLayers"] >= (10_000 - 64) // 128
        assert info["layerBytes"] > 0
        g.restart()
        assert g.task(task["id"])["layers"] == task["layers"]   # read back whole


def test_a_task_on_an_inner_overlay_sees_and_changes_everything_as_its_own() -> None:
    """600 done layers and merging held back (as while many groups are rebuilt): the task's
    view nests its oldest layers in an inner overlay built from idmapped layers; the task
    reads the oldest and newest files, overwrites and deletes files of the inner overlay as
    their owner, and the files API (the same plan) agrees."""
    with gurtd_on_done_layers(600, {"GURT_LAYER_KEEP": "100000"}) as (g, _):   # no merges
        assert not registry(g.home)["merged"]
        task = g.run_done("cat n1 n600; stat -c %U n1; echo changed >> n1; rm n2; id -un")
        assert g.output(task["id"]) == ["1", "600", task["user"], task["user"]]
        assert g.file("home", "n1") == b"1\nchanged\n"
        assert g.file("home", "n2") is None and g.file("home", "n3") == b"3\n"
        changes = g.api("GET", f"/api/tasks/{task['id']}/changes")
        assert changes == [{"path": "n1", "change": "modified"},
                           {"path": "n2", "change": "deleted"}]


def test_a_running_task_keeps_the_merged_layer_it_started_on() -> None:
    """Undo of an old task while a task runs on the merged layer that holds it: the files API
    stops showing the undone file at once, the running task still reads it (its view is
    kept), a new generation replaces the group's merged layer, and the old one is deleted
    only once the running task has ended."""
    with gurtd_on_done_layers(20, GROUP_ENV) as (g, _):
        home = g.home
        eventually(lambda: len(registry(home)["merged"]) == 6, timeout=60,
                   what="the first merges")
        first = [m["name"] for m in registry(home)["merged"] if m["group"] == 0]
        # the task runs until the new generation is there and the old one seen kept (not 3 s,
        # which a busy machine's merge may outlast: the task over, nothing reading the old one)
        task = g.create("cat n1\nsleep 60 || true\ncat n1")
        wait_for_step(g, task["id"], "sleep 60 || true")
        g.api("POST", "/api/tasks/t000000001/undo")
        assert g.file("home", "n1") is None
        eventually(lambda: [m for m in registry(home)["merged"]
                            if m["group"] == 0 and m["name"] not in first],
                   timeout=60, what="the group's new generation")
        assert os.path.isdir(os.path.join(home, "merged", first[0]))   # still read
        end_sleep(g, task, "sleep 60")
        assert g.wait(task["id"])["state"] == "done"
        assert g.output(task["id"]) == ["1", "1"]
        g.run("true")          # a later step of the loop collects what nothing reads
        eventually(lambda: not os.path.exists(os.path.join(home, "merged", first[0])),
                   timeout=30, what="the old generation deleted")
        assert g.file("home", "n1") is None and g.file("home", "n2") == b"2\n"


def test_kill_9_in_the_middle_of_a_merge_loses_nothing() -> None:
    """gurtd dies (as kill -9) inside a merge, and again between the rename and the record;
    the next start throws away the half-made merged layers, keeps every done layer, and the
    view is whole."""
    home = make_home()
    try:
        make_done_layers(home, 300)
        for point in ("merge-half-built", "merge-renamed"):
            g = Gurtd(home, {"GURT_TEST_CRASH_AT": point, **GROUP_ENV})
            try:
                g.start(timeout=60)          # merges start before the API listens
            except AssertionError as exc:
                assert "exited with 137" in str(exc), exc
            else:
                assert g.proc is not None and g.proc.wait(timeout=60) == 137
            g.proc = None
            leftovers = [n for n in os.listdir(os.path.join(home, "merged"))
                         if n not in {m["name"] for m in registry(home)["merged"]}]
            assert leftovers, "the crash left nothing to throw away: not inside a merge"
        g = Gurtd(home, GROUP_ENV)
        g.start(timeout=60)
        try:
            for i in (1, 150, 300):
                assert g.file("home", f"n{i}") == f"{i}\n".encode()
            assert all(os.path.isdir(os.path.join(home, "layers", f"t{i:09d}", "upper"))
                       for i in range(1, 301))
            eventually(lambda: len(registry(home)["merged"]) == (300 - 2) // 3, timeout=60,
                       what="the merges redone")
            names = {n for n in os.listdir(os.path.join(home, "merged"))
                     if not n.endswith(".json")}
            assert names == {m["name"] for m in registry(home)["merged"]}
        finally:
            g.stop()
    finally:
        remove_home(home)



def test_a_merge_that_failed_is_built_once_it_can_be() -> None:
    """A build fails (its name is taken on disk by a folder that is not its own) when an undo
    makes a group's merged layer due again; the folder goes with the failed build, and the
    build is tried again after a short wait, not left unbuilt until the group's members change or gurtd restarts (a queued task
    past the kernel's limit would wait that long for its view)."""
    with running_gurtd({"GURT_LAYER_GROUP": "2", "GURT_LAYER_KEEP": "1"}) as g:
        ids = [g.run_done(f"echo {n} > f{n}")["id"] for n in range(3)]
        eventually(lambda: [m["members"] for m in registry(g.home)["merged"]] == [ids[1::-1]],
                   what="the first group merged")
        (name,) = [m["name"] for m in registry(g.home)["merged"]]
        group, gen, ws = name.split("-", 2)
        taken = Path(g.home, "merged", f"{group}-{int(gen) + 1}-{ws}")
        (taken / "not-its-own").mkdir(parents=True)        # its rename into place fails
        g.api("POST", f"/api/tasks/{ids[0]}/undo")
        eventually(lambda: f"merged layer {taken.name} of {ws}: " in g.log_text(),
                   what="the build of the group's new members failed")
        assert not taken.exists()          # thrown away with the failed build
        eventually(lambda: [m["members"] for m in registry(g.home)["merged"]] == [ids[1:2]],
                   timeout=30, what="the group's new members merged")
        assert g.file("home", "f1") == b"1\n" and g.file("home", "f2") == b"2\n"
