"""Pure functions: ids, validation, host patterns, paths, the Task record.  No root needed."""

from __future__ import annotations

import glob
import os
import re
import secrets
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

import gurtd as G

pytestmark = pytest.mark.pure
SETTINGS = dict(G.DEFAULT_SETTINGS)


def test_ids_look_like_the_seed_pages():
    ids = {G.new_task_id() for _ in range(500)}
    assert len(ids) == 500
    for task_id in ids:
        assert re.fullmatch(r"t[a-z0-9]{9}", task_id)


def test_a_minimal_body_gets_every_default_of_the_seed_page():
    fields = G.validate_task_body({"title": "t", "prompt": "p"}, SETTINGS)
    assert fields == {"title": "t", "prompt": "p", "workspace": "home", "worker": "droid",
                      "tools": [], "hosts": [], "budgetCents": 0, "source": "api",
                      "limits": {}}


def test_the_default_budget_comes_from_settings():
    fields = G.validate_task_body({"title": "t", "prompt": "p"},
                                  {**SETTINGS, "defaultBudgetCents": 250})
    assert fields["budgetCents"] == 250


@pytest.mark.parametrize("body, words", [
    ([], "JSON object"),
    ({"prompt": "p"}, "title"),
    ({"title": " ", "prompt": "p"}, "title"),
    ({"title": "t", "prompt": ""}, "prompt"),
    ({"title": "t", "prompt": "p", "colour": "red"}, "unknown field: colour"),
    ({"title": 3, "prompt": "p"}, "title must be a string"),
    ({"title": "t", "prompt": "p", "tools": "wallet.pay"}, "tools must be an array"),
    ({"title": "t", "prompt": "p", "budgetCents": True}, "budgetCents must be a number"),
    ({"title": "t", "prompt": "p", "budgetCents": -1}, "budgetCents"),
    ({"title": "t", "prompt": "p", "worker": "robot"}, "worker"),
    ({"title": "t", "prompt": "p", "workspace": ".."}, "workspace"),
    ({"title": "t", "prompt": "p", "workspace": "a/b"}, "workspace"),
    ({"title": "t", "prompt": "p", "workspace": "%2e%2e"}, "workspace"),
    ({"title": "t", "prompt": "p", "tools": ["Wallet Pay"]}, "tools"),
    ({"title": "t", "prompt": "p", "hosts": ["*"]}, "hosts"),
    ({"title": "t", "prompt": "p", "folders": []}, "at least one folder"),
    ({"title": "t", "prompt": "p", "folder": "/a", "folders": ["/b"]}, "folders[0]"),
])
def test_bad_bodies_name_what_is_wrong(body, words):
    with pytest.raises(G.ApiError) as err:
        G.validate_task_body(body, SETTINGS)
    assert err.value.status == 400
    assert words in err.value.message


def test_counts_in_messages_agree_with_their_noun():
    assert [G.counted(n, "conflict") for n in (0, 1, 2)] == \
        ["0 conflicts", "1 conflict", "2 conflicts"]


@pytest.mark.parametrize("entry, parsed", [
    ("example.com", ("name", "example.com", None)),
    ("Example.COM:8080", ("name", "example.com", 8080)),
    ("*.example.com", ("wildcard", "example.com", None)),
    ("*.b.test:443", ("wildcard", "b.test", 443)),
    ("198.18.0.1", ("ip", "198.18.0.1", None)),
    ("198.18.0.0/15:80", ("cidr", "198.18.0.0/15", 80)),
])
def test_host_entries_parse(entry, parsed):
    assert G.parse_host(entry) == parsed


@pytest.mark.parametrize("entry", [
    "", "*", "*.com", "a..com", ".a.com", "a.com:0", "a.com:65536", "a.com:08", "a b.com",
    " a.com", "http://a.com", "a.com/path", "-a.com", "a-.com", "198.18.0.1/33",
    "198.18.0.1/15", "1.2.3", 3, None,
])
def test_malformed_host_entries_are_refused(entry):
    with pytest.raises(ValueError):
        G.parse_host(entry)


def test_settings_updates_are_checked():
    assert G.validate_settings({"maxRunningTasks": 3}, SETTINGS)["maxRunningTasks"] == 3
    for bad in ({"maxRunningTasks": 0}, {"maxRunningTasks": "3"}, {"defaultBudgetCents": -1},
                {"defaultBudgetCents": True}, {"colour": 1}, []):
        with pytest.raises(G.ApiError):
            G.validate_settings(bad, SETTINGS)


@pytest.mark.parametrize("raw, clean", [
    ("", ""), ("a/b.txt", "a/b.txt"), ("a//./b", "a/b"), ("%61.txt", "a.txt")])
def test_paths_in_urls_are_cleaned(raw, clean):
    assert G.clean_relpath(raw) == clean


@pytest.mark.parametrize("raw", ["..", "a/../../x", "%2e%2e/x", "a/%2E%2E", "a%00b", "a\\b"])
def test_paths_that_climb_out_are_refused(raw):
    with pytest.raises(G.ApiError):
        G.clean_relpath(raw)


def test_a_task_record_round_trips_and_hides_bookkeeping():
    stamp = G.now_iso()
    task = G.Task(id="t123456789", title="t", prompt="p", workspace="home", worker="fake",
                  tools=[], hosts=[], budgetCents=0, source="api", state="queued",
                  user="box-t123456789", layers=[], costCents=0, createdAt=stamp,
                  updatedAt=stamp, seq=4, uid=600001)
    api = task.to_api()
    assert "uid" not in api and "seq" not in api and "step" not in api and "error" not in api
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", api["createdAt"])
    import dataclasses
    assert G.Task.from_dict(dataclasses.asdict(task)) == task
    with pytest.raises(ValueError):
        G.Task.from_dict({**dataclasses.asdict(task), "state": "sleeping"})


def test_changes_of_a_layer_against_its_lowers(tmp_path):
    base, upper = tmp_path / "base", tmp_path / "upper"
    (base / "dir").mkdir(parents=True)
    (base / "kept.txt").write_text("k")
    (base / "edited.txt").write_text("e")
    (base / "gone.txt").write_text("g")
    (upper / "newdir").mkdir(parents=True)
    (upper / "newdir" / "f").write_text("n")
    (upper / "edited.txt").write_text("E")
    (upper / "new.txt").write_text("N")
    os.mknod(upper / "gone.txt", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
    os.mknod(upper / "never.txt", 0o600 | 0o020000, os.makedev(0, 0))
    changes = G.changed_paths(str(upper), [str(base)])
    assert changes == [
        {"path": "edited.txt", "change": "modified"},
        {"path": "gone.txt", "change": "deleted"},
        {"path": "new.txt", "change": "added"},
        {"path": "newdir/", "change": "added"},
        {"path": "newdir/f", "change": "added"},
    ]


def test_atomic_json_files_and_damaged_ones_set_aside(tmp_path):
    path = str(tmp_path / "x.json")
    G.write_json(path, {"a": 1})
    assert G.load_json(path) == {"a": 1}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with open(path, "w") as f:
        f.write("{not json")
    assert G.load_json(path) is None
    assert not os.path.exists(path)
    assert any(name.startswith("x.json.damaged-") for name in os.listdir(tmp_path))
    assert G.load_json(str(tmp_path / "missing.json")) is None


def test_routes_match_and_refuse():
    route, params = G.match_route("GET", "/api/tasks/t123456789")
    assert route.handler is G.h_task_get and params == {"id": "t123456789"}
    route, params = G.match_route("GET", "/api/workspaces/home/files/a/b%20c")
    assert route.handler is G.h_workspace_files and params == {"name": "home", "path": "a/b%20c"}
    with pytest.raises(G.ApiError) as err:
        G.match_route("DELETE", "/api/tasks")
    assert err.value.status == 405 and err.value.headers["Allow"] == "GET, POST"
    with pytest.raises(G.ApiError) as err:
        G.match_route("GET", "/api/nothing")
    assert err.value.status == 404


def test_importing_the_module_starts_nothing():
    import subprocess
    import sys
    code = ("import threading, gurtd; "
            "assert threading.active_count() == 1, threading.enumerate(); "
            "assert gurtd._LIBC is None; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "ok", out.stderr


def test_the_ledger_keeps_whole_lines_and_cuts_a_torn_one(tmp_path):
    path = tmp_path / "wallet.jsonl"
    assert G.load_ledger(str(path)) == {"balanceCents": 0, "ledger": []}
    path.write_text('{"set": 50, "balanceAfterCents": 50}\n'
                    'damaged\n'
                    '{"task": "t1", "cents": 5, "balanceAfterCents": 45}\n'
                    '{"task": "t1", "cents": 5, "bal')
    wallet = G.load_ledger(str(path))
    assert wallet["balanceCents"] == 45
    assert [e["balanceAfterCents"] for e in wallet["ledger"]] == [50, 45]
    assert path.read_text().endswith('"balanceAfterCents": 45}\n')   # the torn line is gone


@pytest.mark.parametrize("entry, network", [
    ("169.254.77.1", "169.254.0.0/16"), ("127.0.0.1:8080", "127.0.0.0/8"),
    ("0.0.0.0/0", "0.0.0.0/8"), ("0.0.0.0/1", "127.0.0.0/8"), ("128.0.0.0/1", "169.254.0.0/16"),
    ("100.64.0.0/10", "100.64.0.0/10"), ("224.0.0.1", "224.0.0.0/4"), ("240.0.0.1", "240.0.0.0/4"),
    ("255.255.255.255", "255.255.255.255/32"), ("::1", "::1/128"), ("[fe80::1]:80", "fe80::/10"),
    ("::ffff:169.254.169.254", "169.254.0.0/16"),
])
def test_no_host_entry_grants_absolute_special_use_space(entry, network):
    """The one check (grant_refusal) of grants: a host entry, dnsAllowedNets and a DNS answer
    into such space are refused alike, naming the network."""
    with pytest.raises(ValueError, match=re.escape(network)):
        G.parse_host(entry)
    if ":" not in entry:
        net = G.ipaddress.IPv4Network(entry)
        assert network in G.grant_refusal(net)
        with pytest.raises(G.ApiError, match=re.escape(network)):
            G.valid_answer_nets([str(net)])
        inside = str(G.ipaddress.IPv4Network(network).network_address)
        assert network in G.refused_address(inside, set(), [G.ipaddress.IPv4Network("0.0.0.0/0")])
    assert G.grant_refusal(G.ipaddress.IPv4Network("198.18.0.0/15")) is None
    assert G.parse_host("8.8.8.8:53") == ("ip", "8.8.8.8", 53)
    with pytest.raises(ValueError, match="IPv4 only"):
        G.parse_host("[2606:4700::1]:443")          # any IPv6: a task reaches IPv4 only


def test_a_report_waits_for_a_slow_loop_where_a_call_gives_up(monkeypatch):
    """A call past its time is withdrawn (503, nothing done); a report of what a thread has
    already done (a keep, a tool's cost, a Jira issue) waits and is carried out; only a
    stopping gurtd gives it up."""
    monkeypatch.setenv("GURT_CALL_TIMEOUT", "0.3")
    loop = G.Loop(None)
    loop.wake_r, loop.wake_w = os.pipe()
    monkeypatch.setattr(loop, "publish", lambda: None)       # no box: the queue alone
    ran, answers = [], {}

    def ask(name, how):
        try:
            answers[name] = how(lambda: ran.append(name) or name)
        except G.ApiError as exc:
            answers[name] = exc

    threads = [threading.Thread(target=ask, args=("call", loop.call)),
               threading.Thread(target=ask, args=("report", loop.report))]
    held = time.monotonic()
    for t in threads:
        t.start()
    threads[0].join(timeout=10)        # the call gave up: the loop is held past call_timeout
    time.sleep(max(0.0, held + 1.2 - time.monotonic()))   # and the report waits on, 1.2 s
    assert isinstance(answers["call"], G.ApiError) and answers["call"].status == 503
    assert "report" not in answers
    loop.run_commands()
    threads[1].join(timeout=5)
    assert answers["report"] == "report" and ran == ["report"]
    loop.stopping = True
    late = threading.Thread(target=ask, args=("late", loop.report))
    late.start()
    late.join(timeout=5)
    assert isinstance(answers["late"], G.ApiError) and ran == ["report"]
    loop.run_commands()
    assert ran == ["report"]
    os.close(loop.wake_r)
    os.close(loop.wake_w)


# what tries a namespace: `unshare -U` (a user namespace, where it is root), `unshare -r -n`
# (a user and a network one), unshare(2) itself with CLONE_NEWUSER
UNSHARES = ("for how in 'unshare -U true' 'unshare -r -n true' \"python3 -c 'import ctypes, sys;"
            " sys.exit(ctypes.CDLL(None).unshare(0x10000000))'\"; do"
            " if sh -c \"$how\" 2>/dev/null; then echo made; else echo refused; fi; done")


def test_no_namespaces_refuses_each_way_to_a_namespace() -> None:
    """What the tools run under (no_namespaces, their preexec_fn): each of UNSHARES refused,
    as in a worker; without it each one made its namespace, root or not."""
    plain = subprocess.run(["sh", "-c", UNSHARES], capture_output=True, text=True, check=True)
    assert plain.stdout == "made\n" * 3, plain
    refused = subprocess.run(["sh", "-c", UNSHARES], capture_output=True, text=True, check=True,
                             preexec_fn=G.no_namespaces)
    assert refused.stdout == "refused\n" * 3, refused


class DiskBox:
    """What DiskReserve.on_sizes asks of a box: BOX_HOME (a temp folder) with a reserve above
    its free space, running tasks and their workers, and the pause (recorded)."""

    def __init__(self, home) -> None:
        self.home, self.paused = str(home), []
        st = os.statvfs(self.home)
        self.reserve = 2 * st.f_bavail * st.f_frsize

    def path(self, *parts: str) -> str:
        return os.path.join(self.home, *parts)

    def setting(self, name: str) -> int:
        assert name == "diskReserveBytes"
        return self.reserve

    def task(self, task_id: str) -> SimpleNamespace:
        return SimpleNamespace(id=task_id, state="running")

    def worker(self, task_id: str) -> SimpleNamespace:
        return SimpleNamespace(holds=set(), disk_floor=1 << 62, disk_wait=None)

    def pause_and_ask(self, task: SimpleNamespace, *_: object) -> str:
        self.paused.append(task.id)
        return "approval"


def test_a_quota_task_past_one_of_its_limits_is_paused_whatever_the_other(tmp_path):
    """Short of the reserve, a task with a layer quota was paused only if its upper's bytes
    plus its inodes at their worth passed its byte limit plus its inode limit at that worth:
    50 MiB in its upper against a 1 MiB byte limit went on, its inode limit paying for it.
    Now each is weighed against its own limit: bytes, or (one more) inodes past theirs."""
    box = DiskBox(tmp_path)
    disk = G.DiskReserve(box)
    assert disk.inode_bytes() > 0 and disk.free_and_reserve()[0] < box.reserve
    disk.layers = {"bytes": G.LayerQuota(1, [], limit=(1 << 20, 100_000)),
                   "inodes": G.LayerQuota(2, [], limit=(1 << 40, 1_000)),
                   "held": G.LayerQuota(3, [], limit=(1 << 20, 1_000))}
    for task_id, usage in (("bytes", (50 << 20, 10)), ("inodes", (1 << 20, 2_000)),
                           ("held", (1 << 20, 1_000))):
        disk.on_sizes({task_id: usage})
    assert box.paused == ["bytes", "inodes"]


def test_the_box_hides_of_etc_what_glob_would_find(tmp_path):
    """A worker matches ETC_HIDDEN by one listing per folder, not glob.glob per pattern: the
    same paths, on a /etc with secrets of each kind, dot names and near misses beside them."""
    for rel in ("shadow", "a.key", ".dot.key", "x.keys", "sudoers.d/r", "ssh/ssh_host_ed_key",
                "ssh/ssh_host_ed_key.pub", "ssh/.ssh_host_x_key", "ppp/chap-secrets",
                "ppp/options", "wireguard/wg0.conf", "ssl/certs/c.pem"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    os.symlink("/nonexistent", tmp_path / "dangling.key")
    os.symlink("/nonexistent", tmp_path / "gshadow")
    found = G.etc_hidden(G.etc_hidden_plan(G.ETC_HIDDEN), str(tmp_path))
    globbed = [os.path.relpath(p, tmp_path) for pattern in G.ETC_HIDDEN
               for p in glob.glob(os.path.join(tmp_path, pattern))]
    assert sorted(found) == sorted(globbed) == [
        "a.key", "dangling.key", "gshadow", "ppp/chap-secrets", "shadow",
        "ssh/ssh_host_ed_key", "sudoers.d", "wireguard"]
    with pytest.raises(ValueError):
        G.etc_hidden_plan(("ssh*/key",))


def test_the_tests_remove_only_a_home_that_make_home_made(tmp_path):
    """remove_home (conftest) takes the folder around a BOX_HOME: it refuses any path but
    <parent>/gurt-test-XXXXXXXX/box, and leaves what it refused in place."""
    from conftest import make_home, remove_home
    home = make_home()
    os.makedirs(os.path.join(home, "tasks"))
    link = os.path.join("/var/tmp", "gurt-test-" + secrets.token_hex(4))   # unique a run
    os.symlink(tmp_path, link)
    try:
        for path in ("/", "/tmp", "/var/tmp", "/var/tmp/box", "box", "/tmp/gurt-test-abcd1234/box",
                     os.path.dirname(home), os.path.join(home, "tasks"), home + "/../../box",
                     "/var/tmp/gurt-test-/box", "/home/gurt-test-abcd1234/box", link + "/box"):
            with pytest.raises(ValueError):
                remove_home(path)
        assert os.path.isdir(os.path.join(home, "tasks")) and os.path.isdir(tmp_path)
        remove_home(home)
        remove_home(home)               # gone already: nothing to do
        assert not os.path.exists(os.path.dirname(home))
    finally:
        os.unlink(link)
        G.tree_remove(os.path.dirname(home))


def test_a_state_saved_again_every_5_s_logs_a_line_per_error_not_per_try(monkeypatch):
    """save_unsaved on a disk that refuses: the first failure logged, the same error again
    not, another error logged, the save logged, and a failure after it logged again."""
    lines: list[str] = []
    monkeypatch.setattr(G, "log", lambda priority, message: lines.append(message))
    errors = [OSError(28, "No space left on device")] * 3 + [OSError(5, "Input/output error"),
                                                           None, OSError(28, "No space left")]
    task = SimpleNamespace(state="failed")

    def save(_task):
        error = errors.pop(0)
        if error is not None:
            raise error
    box = SimpleNamespace(tasks={"t1": task}, unsaved={"t1"}, unsaved_why={}, save=save,
                          loop=SimpleNamespace(stopping=False))
    for _ in range(6):
        G.Box.save_unsaved(box)
    assert [line.split(": ", 1)[1] for line in lines] == [
        "still cannot save its state: [Errno 28] No space left on device",
        "still cannot save its state: [Errno 5] Input/output error",
        "its state (failed) is saved now",
        "still cannot save its state: [Errno 28] No space left"]


def test_tree_remove_takes_a_file_or_a_link_itself_never_what_the_link_names(tmp_path):
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "f").write_text("x")
    (tmp_path / "file").write_text("y")
    os.symlink(tmp_path / "kept", tmp_path / "link")
    for name in ("file", "link", "missing"):
        G.tree_remove(str(tmp_path / name))
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == ["f"]


def test_times_from_the_environment_are_bounded_and_said(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]):
    two_weeks = 14 * 86400
    monkeypatch.setenv("GURT_SESSION_SECONDS", str(two_weeks))
    assert G.env_seconds("GURT_SESSION_SECONDS", 7.0) == two_weeks
    assert capsys.readouterr().err == ""
    for text in ("0", "-5", "nan", "inf", "ten", str(G.ENV_SECONDS_MAX + 1)):
        monkeypatch.setenv("GURT_SESSION_SECONDS", text)
        assert G.env_seconds("GURT_SESSION_SECONDS", 7.0) == 7.0
        assert "GURT_SESSION_SECONDS" in capsys.readouterr().err
    monkeypatch.delenv("GURT_SESSION_SECONDS")
    assert G.env_seconds("GURT_SESSION_SECONDS", 7.0) == 7.0
    assert capsys.readouterr().err == ""


def _diff_of(pairs: list[tuple[str, bytes | None, bytes | None]], batch: int,
             left: int = G.DIFF_MAX_BYTES) -> str:
    budget, out = G.DiffBudget(left=left), []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G, "DIFF_BATCH_FILE", batch)
        for rel, a, b in pairs:
            out.append(G.file_diff(rel, None if a is None else ("file", 0o100644, a),
                                   None if b is None else ("file", 0o100644, b), budget))
        return budget.final("".join(out))


def test_small_files_diffed_together_read_as_each_diffed_alone() -> None:
    """The diff of many small files (one diff -r of them all) is, to the byte, the diff of
    each in a diff(1) of its own: added, deleted, reordered, without a last newline, a name
    to quote, between larger files; and none of its temp folders is left."""
    rng = __import__("random").Random(7)
    pairs: list[tuple[str, bytes | None, bytes | None]] = []
    for i in range(200):
        lines = [f"{rng.randint(0, 9)}\n" for _ in range(rng.randint(0, 30))]
        old = "".join(lines).rstrip("\n" if i % 7 == 0 else "")
        rng.shuffle(lines)
        pairs.append((f"d/f{i}\n.txt" if i == 5 else f"d/f{i}.txt", old.encode(),
                      ("".join(lines) + ("tail" if i % 3 == 0 else "")).encode()))
    pairs += [("new.txt", None, b"x\ny\n"), ("gone.txt", b"x\n", None),
              ("big.txt", b"a\n" * 40_000, b"b\n" + b"a\n" * 40_000), ("same", b"s", b"s")]
    alone = _diff_of(pairs, -1)
    assert alone.count("diff --git") == sum(a != b for _, a, b in pairs) > 150
    assert "\\ No newline at end of file" in alone and '"b/d/f5\\n.txt"' in alone
    assert _diff_of(pairs, G.DIFF_BATCH_FILE) == alone
    assert not glob.glob(os.path.join(G.DIFF_TMP, f"gurt-diff-{os.getpid()}-*"))


def test_a_spent_diff_names_as_too_costly_the_same_files_together_as_alone() -> None:
    """The answer's budget is spent in the files' order whether small files are diffed
    together or not: a small file before a large one is shown, the small one after it is
    named as too costly.  Held back for the together diff, the first small one was judged
    after the large one had spent the budget, and was named too (so were the small files
    before 3 large files whose diffs took the 30 s)."""
    pairs: list[tuple[str, bytes | None, bytes | None]] = [
        ("a.txt", b"one\n", b"two\n"),
        ("big.txt", b"a\n" * 40_000, b"b\n" * 40_000),
        ("z.txt", b"three\n", b"four\n")]
    alone = _diff_of(pairs, -1, left=10_000)
    assert "+two" in alone and "+b" in alone and "z.txt differ (6 -> 5 bytes: too costly" \
        in alone
    assert _diff_of(pairs, G.DIFF_BATCH_FILE, left=10_000) == alone


def test_a_together_diff_cut_by_its_time_keeps_the_files_it_finished(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The diff -r of the small files has one file's time (DIFF_FILE_SECONDS), for up to
    1,000 of them: cut short, it threw all it had printed away and each pair was diffed
    again on its own (400 shuffled files of 3,276 lines: 257 shown in the 30 s, where a diff(1)
    each had shown all 400 in 28 s).  The files it finished are kept, the others diffed on
    their own, and the whole reads, to the byte, as each diffed alone."""
    rng = __import__("random").Random(9)
    pairs: list[tuple[str, bytes | None, bytes | None]] = []
    for i in range(80):
        lines = [f"{rng.randint(0, 99999)}\n" for _ in range(2000)]
        old = "".join(lines).encode()
        rng.shuffle(lines)
        pairs.append((f"f{i}.txt", old, "".join(lines).encode()))
    monkeypatch.setattr(G, "DIFF_SECONDS", 3600.0)      # the whole answer's time: not what
    t0 = time.monotonic()                                # is tested (a guest without KVM
    alone = _diff_of(pairs, -1)                          # took more than 30 s alone)
    assert alone.count("\n+++ b/f") == 80
    # the diff -r's cut: a third of the pairs' time alone, at least 1 s (each ~30 ms here; a
    # guest without KVM is many times slower)
    monkeypatch.setattr(G, "DIFF_FILE_SECONDS", max(1.0, (time.monotonic() - t0) / 3))
    calls: list[str] = []
    text_diff = G.text_diff
    monkeypatch.setattr(G, "text_diff", lambda *a: calls.append(a[2]) or text_diff(*a))
    assert _diff_of(pairs, G.DIFF_BATCH_FILE) == alone
    assert len(calls) < 80, f"all {len(calls)} pairs were diffed again on their own"


def test_a_diff_folder_of_a_dead_gurtd_is_removed_and_a_live_ones_kept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    paths = [os.path.join(G.DIFF_TMP, f"gurt-diff-{pid}-test{secrets.token_hex(3)}")
             for pid in (dead.pid, os.getpid())]
    for path in paths:
        os.makedirs(os.path.join(path, "a"))
    try:
        G.diff_temp_leftovers()
        assert [os.path.exists(p) for p in paths] == [False, True]
    finally:
        for path in paths:
            __import__("shutil").rmtree(path, ignore_errors=True)


def test_a_call_whose_approval_ended_without_a_yes_is_told_who_or_what_ended_it():
    def told(by, reason):
        approval = G.Approval(id="a000000000", task="t000000000", kind="budget", tool="x",
                              args={}, cents=1, question=None, state="denied", createdAt="",
                              reason=reason, answeredBy=by)
        return G.call_not_run("wallet.pay", approval)
    assert told("api", "too dear") == 'Tool call "wallet.pay" was rejected by the owner: too dear'
    assert told("task", "withdrawn: the task cancelled the call") == \
        'Tool call "wallet.pay" was withdrawn: the task cancelled the call'
    waited = " while it waited for approval"
    assert told("stop", "timed out") == \
        'Tool call "wallet.pay" was not run: the task timed out (taskTimeoutSeconds)' + waited
    assert told("stop", "stopped") == 'Tool call "wallet.pay" was not run: the task was stopped' \
        + waited
    assert told("undo", "answered by undo").endswith("the task was undone" + waited)
    for reason in ("gurtd restarted", "gurtd stopped while the task was running"):
        assert told("restart", reason).endswith(": gurtd stopped" + waited)
    assert told("gurtd", "disk full: no room").endswith("the task ended (disk full: no room)" +
                                                          waited)
    assert told("stop", "gurtd could not handle the task's DNS: x").endswith(
        "the task ended (gurtd could not handle the task's DNS: x)" + waited)
    assert all("rejected" not in told(by, "r") for by in ("task", "stop", "undo", "restart",
                                                           "gurtd"))


def test_the_cli_says_an_undo_whose_revert_waits_for_the_disk(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`gurtd undo` of a task whose revert waits: the line says why and when it is tried
    again.  Before, a waiting record printed nothing past `t… undone`."""
    record = G.undo_waiting("its layer not saved: cannot save the upload: Read-only file "
                            "system", 4)
    G.say_task({"id": "t0123456789", "state": "undone", "undoMerge": record})
    out = capsys.readouterr().out
    assert out.startswith("t0123456789 undone\n"), out
    assert "later copies: waiting for the disk (its layer not saved: cannot save the upload: " \
           "Read-only file system); tried again at " + record["retryAt"] in out, out
