"""Undo latency at 10,000 layers, many undos on one built home (issue 23's figure).

    python tests/undo_timing.py TREE [TREE...] [-n N] [--template DIR]

TREE is the gurtd tree to run (its gurtd.py). The home of UNDO_LAYERS (10,000) done layers
is built once into DIR (kept, reused by later runs: a copy of it per gurtd, merges done),
then a gurtd of each TREE starts on a copy of its own and N undos of the oldest, N of the
newest and N of tasks in the middle are timed one after the other (POST
/api/tasks/{id}/undo until its answer); with several trees, they take turns by blocks of
10 undos back to back (a pair sees the same machine; the next block in the other order).
Prints p50 / p95 / max of each kind and of all, by tree.  UNDO_CLIENT_LOG=FILE: each undo's
(sent, answered) perf_counter_ns, to lay beside stamps taken inside gurtd.  The gurtds need
root and the network lock: flock /tmp/gurtd-net.lock."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PARSER = argparse.ArgumentParser(description="undo latency at 10,000 layers, trees side by side")
PARSER.add_argument("trees", nargs="+", help="gurtd trees (each holds gurtd.py)")
PARSER.add_argument("-n", type=int, default=40, help="undos of each kind per tree")
PARSER.add_argument("--template", default="/var/tmp/gurt-undo-template",
                    help="where the built home is kept between runs")
OPTS = PARSER.parse_args()
TREES = [os.path.abspath(t) for t in OPTS.trees]
N = OPTS.n
TEMPLATE = OPTS.template
COUNT = int(os.environ.get("UNDO_LAYERS", "10000"))
BLOCK = 10
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
import conftest  # noqa: E402
from conftest import Gurtd, make_done_layers, make_home, registry, remove_home  # noqa: E402

import gurtd as G  # noqa: E402


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def build_template() -> None:
    """A home of COUNT done layers whose merges are all built, made once."""
    if os.path.isdir(os.path.join(TEMPLATE, "box", "merged")):
        return
    home = os.path.join(TEMPLATE, "box")
    os.makedirs(TEMPLATE, exist_ok=True)
    t0 = time.monotonic()
    make_done_layers(home, COUNT)
    g = Gurtd(home)
    g.start(timeout=300)
    try:
        due = max(0, COUNT - G.LAYER_KEEP) // G.LAYER_GROUP
        while len(registry(home)["merged"]) < due:
            time.sleep(0.2)
    finally:
        g.stop()
    print(f"template built in {time.monotonic() - t0:.0f} s", file=sys.stderr)


CLIENT: list[tuple[int, int]] = []     # (sent, answered) ns, for UNDO_CLIENT_LOG


def timed(g: Gurtd, task_id: str) -> float:
    t0 = time.perf_counter_ns()
    g.api("POST", f"/api/tasks/{task_id}/undo")
    t1 = time.perf_counter_ns()
    CLIENT.append((t0, t1))
    return (t1 - t0) / 1e6


def started(tree: str) -> Gurtd:
    home = make_home()
    try:
        subprocess.run(["cp", "-a", os.path.join(TEMPLATE, "box"), home], check=True)
        conftest.ROOT = tree            # Gurtd.start runs `python -m gurtd` in ROOT
        g = Gurtd(home)
        g.start(timeout=300)
    except BaseException:
        remove_home(home)
        raise
    return g


def main() -> None:
    build_template()
    gs: list[Gurtd] = []
    try:
        for tree in TREES:              # each stopped and its home removed, whatever comes
            gs.append(started(tree))
        time.sleep(3)                   # the start's warm-up of path sets
        ids = [f"t{i:09d}" for i in range(1, COUNT + 1)]
        kinds = {"oldest": ids[:N], "newest": ids[-N:][::-1],
                 "middle": ids[COUNT // 2:COUNT // 2 + N]}
        out: dict[tuple[int, str], list[float]] = {}
        for kind, victims in kinds.items():     # blocks of BLOCK undos back to back
            for n in range(0, len(victims), BLOCK):
                order = list(range(len(gs))) if n // BLOCK % 2 == 0 else \
                    list(range(len(gs)))[::-1]
                for k in order:
                    out.setdefault((k, kind), []).extend(timed(gs[k], v)
                                                         for v in victims[n:n + BLOCK])
        for k, tree in enumerate(TREES):
            every = [t for (j, _), ts in out.items() if j == k for t in ts]
            print(tree)
            for kind, ts in [*((kd, out[(k, kd)]) for kd in kinds), ("all", every)]:
                print(f"  {kind:7s} p50 {statistics.median(ts):6.2f}  p95 {pct(ts, 95):6.2f}  "
                      f"max {max(ts):6.2f} ms  (n={len(ts)})")
    finally:
        if os.environ.get("UNDO_CLIENT_LOG"):
            Path(os.environ["UNDO_CLIENT_LOG"]).write_text(json.dumps(CLIENT))
        for g in gs:
            g.stop()
            remove_home(g.home)


if __name__ == "__main__":
    main()
