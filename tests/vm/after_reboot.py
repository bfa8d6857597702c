"""The systemd stories after the guest's reboot (tests/vm/stories.py left a task running, the
guest powered off and tests/vm/run.sh booted the same disk again): gurtd, enabled, is up at
boot with BOX_HOME as it was, and the task that ran failed with a clear error.  Then the
last story: stop, and nothing left behind.
"""

from __future__ import annotations

import json
import os
import pwd
import re
from pathlib import Path
from typing import Any

from stories import (BOX_HOME, REBOOT_NOTE, api, done, figure, journal, output, request, run,
                     sh, unit, wait_active, wait_running, create)


def test_after_the_reboot_gurtd_is_up_with_the_box_and_the_task_failed_clearly() -> None:
    note = json.loads(Path(REBOOT_NOTE).read_text())
    wait_active("")
    with open("/proc/uptime") as f:
        figure("boot -> gurtd active (enabled)", f"{float(f.read().split()[0]):.0f} s")
    task = api("GET", f"/api/tasks/{note['task']}")
    assert task["state"] == "failed", task
    assert task.get("error") in ("gurtd stopped while the task was running",
                                 "gurtd restarted while the task was running"), task
    assert note["user"] not in {p.pw_name for p in pwd.getpwall()}
    assert request("GET", "/api/workspaces/home/files/hello.txt") == (200, b"hello\n")
    read = run("cat hello.txt")
    done(read)
    assert output(read["id"]) == ["hello"]


def leftovers() -> dict[str, Any]:
    """What a stopped gurtd could have left on the machine."""
    mounts = [line for line in open("/proc/self/mountinfo")
              if " overlay " in line or "/gurt" in line.split()[4]]
    users = [p.pw_name for p in pwd.getpwall() if re.match(r"box-", p.pw_name)]
    group = "/sys/fs/cgroup/system.slice/gurtd.service"
    netns = sh("ip", "netns", "list").stdout.split()
    tables = [t for t in sh("nft", "list", "tables").stdout.splitlines() if "gurt" in t]
    links = [x for x in sh("ip", "-o", "link").stdout.splitlines() if ": lo:" not in x]
    found = {"mounts": mounts, "users": users, "cgroup": os.path.exists(group),
             "netns": netns, "nftables": tables, "links": links}
    return {k: v for k, v in found.items() if v}


def test_systemctl_stop_ends_the_tasks_and_leaves_nothing_behind() -> None:
    task = create("sleep 600", hosts=["example.test"])
    wait_running(task["id"], "sleep 600")
    out = sh("systemctl", "stop", "gurtd")
    assert out.returncode == 0, (out.stderr, journal())
    assert unit("ActiveState") == "inactive", journal()
    after = json.loads(Path(BOX_HOME, "tasks", task["id"] + ".json").read_text())
    assert after["state"] == "failed" and "stopped" in after.get("error", ""), after
    assert leftovers() == {}, leftovers()
    assert not [x for x in journal(400).splitlines() if "Traceback" in x], journal(400)
