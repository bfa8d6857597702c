"""Runs last: the suite leaves no mount, user, namespace, veth or nftables table of gurtd."""

from __future__ import annotations

import os
import subprocess

import gurtd as G


def test_no_task_user_is_left():
    assert G.task_users() == {}
    with open("/etc/group") as f:
        assert not [line for line in f if line.startswith(G.TASK_USER_PREFIX)]


def test_no_task_process_is_left():
    assert G.processes_by_uid() == {}


def test_no_gurtd_mount_is_left():
    with open("/proc/self/mountinfo") as f:
        mounts = f.read()
    assert "gurt" not in mounts


def test_no_network_namespace_veth_or_nftables_table_is_left():
    netns = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert not [n for n in netns if n.startswith("gurt")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    assert not [n for n in names if n.startswith("g") and n[1:].isdigit()]
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                            check=True).stdout
    assert "gurt" not in tables


def test_no_test_box_home_is_left():
    assert not [d for d in os.listdir("/var/tmp") if d.startswith("gurt-test-")]


def test_no_task_cgroup_is_left():
    """gurtd's task groups (gurt-<hash>/<id>) and their parents, below this process's own
    group in each hierarchy (gurtd runs as a child of the tests, in the same groups)."""
    v2, v1 = G.cgroup_own_groups()
    left = [os.path.join(p, n) for p in [v2] + list(v1.values()) if p and os.path.isdir(p)
            for n in os.listdir(p) if n.startswith("gurt-")]
    assert left == []
