#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""gurtd: the daemon of a box, where AI agent tasks run unattended, each boxed in and undoable.

A task is a worker (``droid``: the Droid CLI with a Claude model; ``fake``: one shell command
per prompt line) running as its own Linux user ``box-<id>`` on its own copy-on-write OverlayFS
view of a workspace, reaching only its hosts and calling only its tools.  Finished tasks' layers
stack up; any task can be undone at any time and the others keep their changes.
The contract is the GurtOS page "Undo a task" (the Task object, its states, undo).

Map of this file (each section starts with a ``# Name ###`` banner that grep finds):

    Constants and paths   defaults, the uid range, limits, syscall numbers
    Errors                ApiError (an HTTP answer; loop_handler, a route handler of the
                          commonest shape), SysError (a failed system verb)
    Pure model            ids, validation, host patterns, Task and Approval records, nftables
                          text, the droid stream (steps, prices, bounded JSON), printable;
                          long lists sorted, encoded and let go in slices (the GIL, so the
                          loop, free)
    Persistence           atomic JSON files under BOX_HOME, set-aside of damaged files, the
                          append-only wallet ledger; whole writes or an error, temp leftovers
                          of a crash, the test-only crash and stop points
    System layer          users, processes, mounts, network namespaces, nftables; each verb
                          beside its inverse, idempotent
    Layer walks           the one walker of every tree (beneath root fds, no symlink followed,
                          bounded fds, a moved folder an error); changes (their memory
                          capped: ListingCap), copies, sizes
    Limits and tracking   a cgroup per task (tracking, kill, freeze; processes, memory, CPU),
                          task limits, the log cap, BOX_HOME's disk reserve (a project
                          quota on each task's layer where the file system has them)
    Spawner               a single-threaded process forked before any thread: it forks workers
    Sandbox               what a worker's child does as root before it becomes the box user:
                          the task's root built from nothing, pivot_root, its gate (gurtd's
                          word: its user is written; its network namespace), the fake worker
    Kernel filter         the seccomp refusals every worker runs under, one table by name
    Task leftovers        set-id bits of a finished layer, kernel keys of a finished uid
    Review                personal mode: a task's real folders checked, their copy-on-write
                          overlays, conflicts, keep with its journal (a task's at most
                          KEEP_MAX_CHANGES paths), undo of a keep (both in the review thread,
                          off the loop), diff
    Layer stack           views past 500 layers: which lowers a view uses, merged layers of
                          old groups (built off the loop), their generations and registry;
                          Views: each workspace's views, its stack, merges due, layer collection
    Finish-time merge     tasks side by side: a task's layer checked against the layers that
                          became done while it ran (git merge-file off the loop, conflicts as
                          approvals); undo taken out of later copies (a revert layer,
                          built again later when the disk refused it: full, read-only, I/O errors)
    Tasks                 StepGroup: a loop step's saves, ends, starts and account edits,
                          each made together; the Box, which owns the state and wires its
                          parts: lifecycle, undo, reconcile, settings; add_task, the one way
                          any task is made
    Droid worker          DroidWorker: the Droid CLI's spec, its stream, pause for budget
    Hosts                 task networks: veth, grants, and gurtd's DNS for the tasks; names
                          outside the grants asked of a person (askHosts)
    Policies              always-approve: standing yeses for a tool or a host in a scope, with
                          limits and expiry, stored as one atomic JSON file
    Model gateway         droid's model calls through gurtd: a listener in each task's
                          namespace, the owner's key added outside, usage metered from the
                          upstream's answer, a call held at the budget
    Broker and approvals  tools called from tasks, the wallet, approvals, the broker socket
    Files in and out      uploads (a file, a tar archive) as layers of their own, each member
                          checked; tar.gz archives of a view or a task's changes, streamed
                          (a file with holes as a sparse member)
    Portal sessions       the portal page at /, one-time sign-in codes, session cookies
                          (hashed on disk), the cookie's check beside the bearer token
    Schedules             cron lines in a time zone start tasks: runs spent up to now, missed
                          runs once, overlap skip or queue, daylight saving neither doubled
                          nor skipped; the loop's timeout is the next run
    Jira                  a Jira Cloud poll thread: one task per matching issue (recorded
                          before it is made), a comment and a transition when it ends
    Hooks                 signed webhooks (HMAC-SHA256 of timestamp, delivery id and body;
                          an id refused twice a day, a timestamp past 5 minutes refused)
    HTTP                  request guard, auth, one table of Route records (method, path,
                          handler, open or streamed, OpenAPI operation), JSON errors
    OpenAPI               the description generated from the routes and the validation tables
    Loop                  the BOX_HOME lock, the start as steps with their undo, sd_notify
                          (READY, WATCHDOG from the loop, STATUS with the task counts); Loop:
                          call, report and post from other threads, guard, emit, render and
                          publish, the published snapshots and events, signals, the select loop
    CLI                   click commands: serve, token, run (--wait follows the task: spinner,
                          approvals, Ctrl-C), tasks, show, undo, stop, log, approvals, approve,
                          deny, answer, wallet, status, workspaces, files, approve-all, events,
                          settings, review, diff, keep, policies, policy rm, put, get, portal,
                          schedules, schedule add and run, hooks, secret; errors said for
                          people; inside a task tool, and mcp (the McpServer: a thread per
                          request, cancellation withdraws approvals)

Threads: the loop thread owns the state.  HTTP and broker handler threads hand it commands
through ``box.loop.call`` and wait for the answer (503 busy past a time limit); they read
finished JSON renderings, published by the loop after each change, without waiting for it.
Long work on files has threads of its own (layer merges: the merger; keep and undo of a keep:
the review thread), which hand what they have done to the loop with ``box.loop.report``: the
same, but waited for however long it takes (what is done is never withdrawn by a 503).
Importing this module does nothing: no root check, no threads, no mounts.

Crashes and full disks: a terminal state is on disk before anyone hears of it; a write that
fails fails its task (or answers 507), never the loop; the next start repairs what a crash
cut short (temp files, a payment's log line).
"""

from __future__ import annotations

import array
import base64
import bisect
import contextlib
import ctypes
import ctypes.util
import dataclasses
import datetime
import errno
import fcntl
import fnmatch
import glob
import hashlib
import heapq
import hmac
import http.client
import http.server
import importlib
import io
import ipaddress
import json
import math
import operator
import os
import queue
import re
import resource
import secrets
import select
import selectors
import shutil
import signal
import socket
import socketserver
import ssl
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, NamedTuple

import click

# Constants and paths ###########################################################################
###############################################################################################

VERSION = "0.1.0"
DEFAULT_BOX_HOME = "/var/lib/gurt"
DEFAULT_LISTEN = "127.0.0.1:7700"

STORE_USER = "gurt-store"            # owns every base and layer on disk
TASK_USER_PREFIX = "box-"
UID_FIRST = 600_000                  # task uids come from [UID_FIRST, UID_FIRST + UID_COUNT)
UID_COUNT = 100_000

MAX_LOWER_LAYERS = 500               # the kernel's overlay limit; the base is one of them
MAX_BODY = 1 << 20                   # larger request bodies get 413
HANDLER_TIMEOUT = 10.0               # seconds a client may stall in the middle of a request
MAX_WORKER_LINE = 1 << 20            # a longer line from a worker is cut into pieces this long
CALL_TIMEOUT = 30.0                  # seconds an HTTP thread waits for the loop

REQUEST_DEADLINE = 30.0              # seconds for a whole request (GURT_REQUEST_DEADLINE)
HEADER_DEADLINE = 10.0               # seconds for the request line and headers
EVENTS_KEPT = 1000                   # /api/events replays at most this many past events

VIEW_DIR = "/run/gurt/view"          # where a worker sees its view, inside its mount namespace
TASK_PATH = "/usr/local/bin:/usr/bin:/bin"

ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
ID_RE = re.compile(r"^t[a-z0-9]{9}$")
WORKSPACE_RE = re.compile(r"^[\w.-]+$", re.ASCII)
TOOL_RE = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)*$")
LABEL_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

STATES = ("queued", "running", "waiting", "done", "failed", "undone")
ACTIVE_STATES = ("queued", "running", "waiting")
TERMINAL_STATES = ("done", "failed", "undone")
WORKERS = ("droid", "fake")

DROID_VERSION = "0.215.0"             # the pinned Droid CLI (npm package droid), see Makefile
DEFAULT_DROID_MODEL = "claude-sonnet-5"
# US cents per million tokens; a setting, so that an owner can keep it in step with Factory.
# cacheWrite is a 5-minute cache write (1.25 times input), cacheWrite1h a 1-hour one (twice
# input, CACHE_WRITE_1H_RATIO: Anthropic's prompt caching prices), cacheRead 0.1 times input.
DEFAULT_DROID_PRICES = {
    "claude-sonnet-5": {"input": 300, "output": 1500, "cacheRead": 30, "cacheWrite": 375,
                        "cacheWrite1h": 600},
    "claude-opus-5": {"input": 500, "output": 2500, "cacheRead": 50, "cacheWrite": 625,
                      "cacheWrite1h": 1000},
    "claude-haiku-4-5-20251001": {"input": 100, "output": 500, "cacheRead": 10,
                                  "cacheWrite": 125, "cacheWrite1h": 200},
}
CACHE_WRITE_1H_RATIO = 2             # a price without cacheWrite1h: twice its input
DEFAULT_SETTINGS: dict[str, Any] = {
    "defaultBudgetCents": 0, "maxRunningTasks": 8, "upstreamDns": "",
    "taskTimeoutSeconds": 3600, "droidPath": "", "droidModel": DEFAULT_DROID_MODEL,
    "droidAutonomy": "high", "droidHosts": ["factory.ai", "*.factory.ai"],
    "droidPrices": DEFAULT_DROID_PRICES, "dnsAllowedNets": [],
    "taskMaxProcesses": 1024, "taskMemoryBytes": 0, "taskTmpBytes": 1 << 30,
    "taskLogBytes": 50 << 20, "diskReserveBytes": 0,
    "folderRoots": ["/home", "/srv"],      # personal mode: where a task's folders may be
    "neverAutoApproveCents": None, "askHostsDefault": False,
    "uploadMaxBytes": 1 << 30,
    "jira": {}, "hookHosts": [],
    # droid's model calls through gurtd's gateway (the Model gateway section)
    "modelGateway": {"api": "anthropic", "baseUrl": "https://api.anthropic.com", "model": "",
                     "models": [], "maxOutputTokens": 16384},
    "droidFactoryKey": False,          # FACTORY_API_KEY inside the box: the old way, if asked
}

# x86_64 and aarch64 share these numbers for the new mount API.
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 428, 429, 430, 431, 432
SYS_OPENAT2, SYS_MOUNT_SETATTR = 437, 442
OPEN_TREE_CLONE, AT_RECURSIVE, AT_EMPTY_PATH = 1, 0x8000, 0x1000
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_IDMAP = 0x2, 0x4, 0x100000
FSCONFIG_SET_STRING, FSCONFIG_SET_FD, FSCONFIG_CMD_CREATE = 1, 5, 6
SYS_FSPICK, FSPICK_CLOEXEC, FSPICK_EMPTY_PATH = 433, 0x1, 0x8
FSCONFIG_SET_FLAG, FSCONFIG_CMD_RECONFIGURE = 0, 7
MOVE_MOUNT_F_EMPTY_PATH = 0x4
RESOLVE_NO_MAGICLINKS, RESOLVE_BENEATH = 0x02, 0x08
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_SLAVE = 0x2, 0x4, 0x8, 0x4000, 1 << 19
MNT_DETACH = 2


# Errors ########################################################################################
###############################################################################################

class ApiError(Exception):
    """An answer to an HTTP request that is not a success: status, message, optional code."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = headers or {}
        self.extra = extra or {}          # more fields of the JSON answer (conflicts)


def loop_handler(status: int, method: str, *names: str, body: bool = False
                 ) -> Callable[..., Any]:
    """A route handler of the commonest shape: status, and what the box's method (a dotted
    path: "broker.policies.delete") answers on the loop thread, given the path parameters
    named and then, with body, the request's JSON object."""
    get = operator.attrgetter(method)

    def handler(req: Any, params: dict[str, str]) -> Any:
        args = [params[name] for name in names] + ([req.json_body()] if body else [])
        return status, req.box.loop.call(get(req.box), *args)
    return handler


class SysError(Exception):
    """A system verb failed: what was run, its error number or exit code, and its stderr."""

    def __init__(self, what: str, code: int, stderr: str = "") -> None:
        super().__init__(f"{what}: {code}: {stderr}".strip())
        self.what, self.code, self.stderr = what, code, stderr


def log(priority: int, message: str) -> None:
    """One line to stderr with a journald priority prefix (3 error, 4 warning, 6 info, 7 debug)
    when stderr is not a terminal (journald reads it); on a terminal, the time instead.
    Control characters are shown escaped (a task's error text may carry escape sequences for
    the terminal that shows this log); a traceback keeps its lines."""
    message = "\n".join(printable(line) for line in message.split("\n"))
    try:
        tty = sys.stderr.isatty()
    except ValueError:                  # stderr closed
        return
    prefix = time.strftime("%H:%M:%S ") + ("error: " if priority <= 3 else "warning: "
                                            if priority == 4 else "") if tty else f"<{priority}>"
    sys.stderr.write(f"{prefix}{message}\n")
    sys.stderr.flush()


def log_uncaught(kind: type[BaseException], exc: BaseException, tb: Any,
                 thread: str = "main") -> None:
    """sys.excepthook and threading.excepthook of `gurtd serve`: an uncaught exception is an
    error (priority 3), with its traceback, never an info line."""
    if issubclass(kind, KeyboardInterrupt):
        return
    log(3, f"uncaught {kind.__name__} in the {thread} thread: {exc}\n" +
        "".join(traceback.format_exception(kind, exc, tb)).rstrip())


# Pure model ####################################################################################
###############################################################################################

def is_digits(text: str) -> bool:
    """Only the ASCII digits 0-9: str.isdigit() also takes "²" and "٣", which int() refuses
    (a header `Content-Length: ²` would raise where a 400 is due)."""
    return text.isascii() and text.isdigit()


def now_iso(at: float | None = None) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2026-11-29T19:50:40.123Z (of at, seconds since
    the epoch, if given)."""
    when = datetime.datetime.now(datetime.timezone.utc) if at is None else \
        datetime.datetime.fromtimestamp(at, datetime.timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_task_id(prefix: str = "t") -> str:
    """Ten characters, lowercase letters and digits, starting with t: t3k9x2a1b2 (approvals
    start with a)."""
    n = secrets.randbelow(len(ID_ALPHABET) ** 9)     # one read of the kernel's random, not 9
    return prefix + "".join(ID_ALPHABET[n // len(ID_ALPHABET) ** i % len(ID_ALPHABET)]
                            for i in range(9))


def valid_workspace_name(name: Any) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 64 and bool(WORKSPACE_RE.fullmatch(name))
            and name not in (".", ".."))


_PSL: Any = None


def public_suffixes() -> Any:
    """The Public Suffix List (the publicsuffixlist package ships it; loaded once, ~30 ms)."""
    global _PSL
    if _PSL is None:
        from publicsuffixlist import PublicSuffixList
        _PSL = PublicSuffixList()
    return _PSL


def parse_host(entry: Any) -> tuple[str, str, int | None]:
    """Parse one `hosts` entry into (kind, name, port); kind is name, wildcard, ip or cidr.

    Accepted: example.com, example.com:8080, *.example.com, 198.18.0.1, 198.18.0.0/24, each
    optionally with :port.  Raises ValueError with the reason otherwise: an address or network
    that touches absolute special-use space (grant_refusal) is refused here, so every place a
    grant is made refuses it; IPv6 is refused (a task reaches IPv4 only).
    """
    if not isinstance(entry, str) or not entry:
        raise ValueError("must be a non-empty string")
    if entry != entry.strip() or any(c.isspace() for c in entry):
        raise ValueError("must not contain spaces")
    if "://" in entry:
        raise ValueError("must be a host, not a URL")
    if entry.count(":") > 1 or entry.startswith("["):
        raise ValueError(ipv6_refusal(entry))
    host, port = entry, None
    if ":" in entry:
        host, _, port_text = entry.rpartition(":")
        if not is_digits(port_text) or not 1 <= int(port_text) <= 65535 or port_text[0] == "0":
            raise ValueError("port must be a number from 1 to 65535")
        port = int(port_text)
    host = host.lower()
    if re.fullmatch(r"[0-9./]+", host):
        try:
            net = ipaddress.IPv4Network(host, strict=True)
        except ValueError as exc:
            raise ValueError(f"not an IPv4 address or CIDR block ({exc})") from None
        refusal = grant_refusal(net)
        if refusal:
            raise ValueError(refusal)
        if "/" in host:
            return "cidr", str(net), port
        return "ip", str(net.network_address), port
    if "/" in host or "?" in host or "#" in host or "@" in host:
        raise ValueError("must be a host, not a URL")
    kind = "name"
    if host.startswith("*."):
        kind, host = "wildcard", host[2:]
    labels = host.rstrip(".").split(".") if host else []
    if not labels or len(host) > 253 or not all(LABEL_RE.match(label) for label in labels):
        raise ValueError("not a valid host name")
    if kind == "wildcard" and (len(labels) < 2 or public_suffixes().is_public(".".join(labels))):
        raise ValueError("a wildcard must name a domain under a public suffix, like "
                         "*.example.com, not a public suffix itself")
    if is_digits(labels[-1]):
        raise ValueError("not a valid host name")
    return kind, ".".join(labels), port


@dataclass(frozen=True)
class Grant:
    """One parsed `hosts` entry: a name, a wildcard domain, an address or a network; a port or
    None for any port."""

    kind: str
    value: str
    port: int | None

    def matches_name(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        if self.kind == "name":
            return name == self.value
        if self.kind == "wildcard":
            return name.endswith("." + self.value)
        return False


def grants_of(hosts: list[str]) -> list[Grant]:
    return [Grant(*parse_host(h)) for h in hosts]


def ports_for_name(grants: list[Grant], name: str) -> list[int | None]:
    """The ports a name is granted on ([None] is any port); [] when it is not granted."""
    ports = sorted({g.port for g in grants if g.matches_name(name)}, key=lambda p: p or 0)
    return [None] if None in ports else ports


# Special-use IPv4 networks a granted name's DNS answer may not point into (DNS rebinding):
# (network, what it is, absolute).  Absolute ones no grant opens: they reach the host itself,
# the task networks or nothing routable; the rest open with an explicit `ip` or `cidr` entry of
# the task (or the dnsAllowedNets setting), e.g. a service of the owner's on 10.0.0.0/8.
SPECIAL_NETS = tuple((ipaddress.IPv4Network(net), what, absolute) for net, what, absolute in (
    ("0.0.0.0/8", "this network", True), ("127.0.0.0/8", "loopback", True),
    ("169.254.0.0/16", "link-local", True), ("100.64.0.0/10", "shared, the task networks", True),
    ("224.0.0.0/4", "multicast", True), ("255.255.255.255/32", "broadcast", True),
    ("10.0.0.0/8", "private", False), ("172.16.0.0/12", "private", False),
    ("192.168.0.0/16", "private", False), ("192.0.0.0/24", "IETF protocol assignments", False),
    ("192.0.2.0/24", "documentation", False), ("198.51.100.0/24", "documentation", False),
    ("203.0.113.0/24", "documentation", False), ("198.18.0.0/15", "benchmarking", False),
    ("240.0.0.0/4", "reserved", True)))

# The IPv6 ones, named in the refusal of an IPv6 entry (every IPv6 entry is refused: a task's
# namespace has IPv6 off and the firewall refuses IPv6, but a mapped ::ffff:169.254.169.254 is
# still told as what it is).
SPECIAL_NETS6 = tuple((ipaddress.IPv6Network(net), what) for net, what in (
    ("::/128", "unspecified"), ("::1/128", "loopback"), ("::ffff:0:0/96", "IPv4-mapped"),
    ("64:ff9b::/96", "IPv4/IPv6 translation"), ("100::/64", "discard"),
    ("2001:db8::/32", "documentation"), ("2002::/16", "6to4"), ("fc00::/7", "unique local"),
    ("fe80::/10", "link-local"), ("ff00::/8", "multicast")))


def grant_refusal(net: ipaddress.IPv4Network) -> str | None:
    """Why no grant may open net, or None: it is in, or holds, an absolute special-use network
    (0.0.0.0/0 and 0.0.0.0/1 hold 0.0.0.0/8 and 127.0.0.0/8).  The one check of grants: host
    entries (parse_host), dnsAllowedNets and DNS answers (refused_address) ask it."""
    held = [(special, what) for special, what, absolute in SPECIAL_NETS
            if absolute and net.overlaps(special)]
    if not held:
        return None
    name = net.with_prefixlen if net.prefixlen < 32 else str(net.network_address)
    if net.subnet_of(held[0][0]):
        return f"{name} is in {held[0][0]} ({held[0][1]}), which no grant opens"
    return f"{name} holds {', '.join(f'{s} ({w})' for s, w in held)}, which no grant opens"


def ipv6_refusal(entry: str) -> str:
    """Why an IPv6 host entry is refused: the special network it is in (for a mapped IPv4
    address, the IPv4 one's refusal), else that tasks reach IPv4 only."""
    text = entry.lower()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    try:
        net = ipaddress.IPv6Network(text, strict=False)
    except ValueError:
        return "not a valid host: an IPv6 address is not granted either (a task reaches " \
               "IPv4 only)"
    mapped = net.network_address.ipv4_mapped
    if mapped is not None and net.prefixlen >= 96:
        refusal = grant_refusal(ipaddress.IPv4Network(f"{mapped}/{net.prefixlen - 96}",
                                                      strict=False))
        if refusal:
            return f"{text} is IPv4-mapped: {refusal}"
    for special, what in SPECIAL_NETS6:
        if net.overlaps(special):
            where = "is in" if net.subnet_of(special) else "holds"
            return f"{text} {where} {special} ({what}), which no grant opens"
    return f"{text}: IPv6 is not granted (a task reaches IPv4 only)"


def refused_address(addr: str, own: set[str],
                    granted: list[ipaddress.IPv4Network] | None = None) -> str | None:
    """Why an answer's address must not become a grant (DNS rebinding), or None.

    Public addresses pass.  Special-use ones pass only when granted (the task's ip and cidr
    entries), and never the absolute ones or an address of this host.
    """
    ip = ipaddress.IPv4Address(addr)
    refusal = grant_refusal(ipaddress.IPv4Network(addr))
    if refusal:
        return refusal
    for net, what, _ in SPECIAL_NETS:
        if ip in net:
            break
    else:
        net, what = ipaddress.IPv4Network(f"{addr}/32"), "special-use"
    if addr in own:
        return f"{addr} is an address of this host"
    if what == "special-use" and ip.is_global:
        return None
    if any(ip in g for g in granted or ()):
        return None
    return f"{addr} is in {net} ({what}) and no ip or cidr entry grants it"


def valid_answer_nets(value: Any) -> list[str]:
    """The dnsAllowedNets setting: IPv4 networks of special-use space that granted names of
    every task may resolve into (never an absolute one); ApiError(400) says why not."""
    if not isinstance(value, list) or len(value) > 100:
        raise ApiError(400, "dnsAllowedNets must be an array of IPv4 networks (at most 100)")
    out = []
    for text in value:
        try:
            net = ipaddress.IPv4Network(text, strict=True) if isinstance(text, str) else None
        except ValueError:
            net = None
        if net is None:
            raise ApiError(400, f"dnsAllowedNets: {json.dumps(text)} is not an IPv4 network "
                                "such as 10.0.0.0/8")
        refusal = grant_refusal(net)
        if refusal:
            raise ApiError(400, f"dnsAllowedNets: {refusal}")
        out.append(str(net))
    return out


def nft_quote(ifname: str) -> str:
    if not re.fullmatch(r"[a-z0-9]{1,15}", ifname):
        raise ValueError(f"bad interface name {ifname!r}")
    return f'"{ifname}"'


def nft_ruleset(table: str) -> str:
    """gurtd's one table.  Base chains keep policy accept: only traffic that comes from (or
    goes to) a task interface is judged here, so other tables (Docker...) are unaffected."""
    return f"""
table inet {table} {{
  set tasks {{ type ifname; }}
  set allow {{ type ifname . ipv4_addr . inet_service; flags interval; }}
  map refused {{ type ifname : counter; }}
  chain refuse {{
    counter name iifname map @refused
    meta l4proto tcp reject with tcp reset
    reject with icmpx type admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    oifname @tasks ct state established,related accept
    oifname @tasks reject with icmpx type admin-prohibited
    iifname != @tasks accept
    meta nfproto ipv6 jump refuse
    th dport {{ 53, 853 }} jump refuse
    ct state established,related accept
    meta l4proto {{ tcp, udp }} iifname . ip daddr . th dport @allow accept
    jump refuse
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname @tasks jump refuse
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname @tasks oifname != @tasks masquerade
  }}
}}
"""


def nft_allow_elements(ifname: str, target: str, ports: list[int | None]) -> str:
    """The `allow` set elements for one address or network and its ports."""
    return ", ".join(f"{nft_quote(ifname)} . {target} . {p if p else '1-65535'}"
                     for p in ports)


def grant_change(granted: dict[str, set[int] | None], target: str,
                 ports: list[int | None]) -> tuple[list[int | None], list[int]]:
    """(ports to add, ports to delete) for target (an address or network) to be granted ports,
    given what is granted already (target -> ports, None for every port).

    nftables refuses an interval element that starts inside another ("File exists"), so
    nothing already covered is added: not by the same target, nor by a network holding it.
    Every port for a target that has single ports replaces them (deleted in the same step).
    """
    net = ipaddress.IPv4Network(target)
    have: set[int] = set()
    for other, other_ports in granted.items():
        if net.subnet_of(ipaddress.IPv4Network(other)):
            if other_ports is None:
                return [], []
            have |= other_ports
    if None in ports:
        return [None], sorted(granted.get(target) or ())
    return [p for p in ports if p not in have], []


TASK_FIELDS = {
    "title": str, "prompt": str, "workspace": str, "worker": str, "tools": list, "hosts": list,
    "budgetCents": (int, float), "source": str, "folder": str, "folders": list,
    "limits": dict, "askHosts": bool,
}


def validate_task_body(body: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Check a POST /api/tasks body; return the task's fields with defaults filled in.

    Raises ApiError(400) naming the first field that is wrong.  Pure: whether the workspace
    exists is the caller's question.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    check_field_types(body, TASK_FIELDS, "", lambda key, kind: f"{key} must be " + {
        str: "a string", list: "an array", (int, float): "a number", dict: "an object",
        bool: "true or false"}[kind])
    out: dict[str, Any] = {}
    folders = folders_of(body)                 # on disk: Box.create_task (folders_check)
    if folders:
        out["folders"] = folders
    for key in ("title", "prompt"):
        if key not in body or not body[key].strip():
            raise ApiError(400, f"{key} is required and must be a non-empty string")
        out[key] = body[key]
    if len(body["title"]) > 200:
        raise ApiError(400, "title must be at most 200 characters")
    out["workspace"] = body.get("workspace", "home")
    if not valid_workspace_name(out["workspace"]):
        raise ApiError(400, "workspace must match ^[\\w.-]+$ and not be . or ..")
    out["worker"] = body.get("worker", "droid")
    if out["worker"] not in WORKERS:
        raise ApiError(400, "worker must be one of: droid, fake")
    out["tools"] = body.get("tools", [])
    for tool in out["tools"]:
        if not isinstance(tool, str) or len(tool) > 64 or not TOOL_RE.fullmatch(tool):
            raise ApiError(400, f"tools: not a tool name: {json.dumps(tool)}")
    out["hosts"] = body.get("hosts", [])
    for host in out["hosts"]:
        try:
            parse_host(host)
        except ValueError as exc:
            raise ApiError(400, f"hosts: {json.dumps(host)}: {exc}") from None
    budget = body.get("budgetCents", settings["defaultBudgetCents"])
    if budget != budget or budget < 0 or budget in (float("inf"),):
        raise ApiError(400, "budgetCents must be a number of at least 0")
    out["budgetCents"] = budget
    out["source"] = body.get("source", "api")
    if not out["source"] or len(out["source"]) > 100:
        raise ApiError(400, "source must be a non-empty string of at most 100 characters")
    out["limits"] = validate_limits(body.get("limits", {}))
    if body.get("askHosts", bool(settings.get("askHostsDefault"))):
        out["askHosts"] = True        # (the Task's default is false)
    return out


def check_task_defaults(body: dict[str, Any], settings: dict[str, Any], prefix: str) -> None:
    """Task fields given ahead of the tasks (a schedule's, a hook's, Jira's), checked as a
    task body; its ApiError(400) said under prefix."""
    try:
        validate_task_body(body, settings)
    except ApiError as exc:
        raise ApiError(400, f"{prefix}{exc.message}") from None


def check_field_types(body: dict[str, Any], fields: dict[str, Any], prefix: str,
                      wrong: Callable[[str, Any], str]) -> None:
    """ApiError(400) for the first key of body that fields does not know (prefix: whose), or
    whose value is not of its type (true is no number), said by wrong(key, type)."""
    for key, value in body.items():
        kind = fields.get(key)
        if kind is None:
            raise ApiError(400, f"{prefix}unknown field: {key}")
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ApiError(400, wrong(key, kind))


def _whole(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: not isinstance(v, bool) and isinstance(v, int) and low <= v <= high


def _host_entries(value: Any) -> bool:
    for host in value if isinstance(value, list) else ():
        try:
            parse_host(host)
        except ValueError as exc:
            raise ApiError(400, f"droidHosts: {json.dumps(host)}: {exc}") from None
    return isinstance(value, list)


def _upstream(value: Any) -> bool:
    try:
        return isinstance(value, str) and (not value or bool(parse_upstream(value)))
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


# A setting's check, (whether a value is good, what it must be), may say more by ApiError;
# SETTING_VALUES check and normalize (dnsAllowedNets' networks in their short form).
SETTING_RULES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "defaultBudgetCents": (lambda v: is_cents(v) and v >= 0, "be a number of at least 0"),
    "maxRunningTasks": (_whole(1, 1000), "be a whole number from 1 to 1000"),
    "taskTimeoutSeconds": (_whole(1, 7 * 86400), "be a whole number from 1 to 604800"),
    "droidPath": (lambda v: isinstance(v, str) and (not v or os.path.isabs(v)),
                  "be an absolute path, or empty for the one make installs"),
    "droidModel": (lambda v: isinstance(v, str) and re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,99}", v),
                   "be a model id such as claude-sonnet-5"),
    "droidAutonomy": (lambda v: v in ("low", "medium", "high"), "be one of: low, medium, high"),
    "droidHosts": (_host_entries, "be an array of host entries"),
    "droidPrices": (lambda v: isinstance(v, dict) and all(
        isinstance(p, dict) and set(p) - {"cacheWrite1h"} == {"input", "output", "cacheRead",
                                                               "cacheWrite"}
        and all(is_cents(c) and c >= 0 for c in p.values())
        and p.get("cacheWrite1h", p["cacheWrite"]) >= p["cacheWrite"] for p in v.values()),
        "map model ids to {input, output, cacheRead, cacheWrite, cacheWrite1h (optional, at "
        "least cacheWrite; else twice input)} in cents per million tokens"),
    "upstreamDns": (_upstream, "be a string: HOST[:PORT], or empty"),
    "neverAutoApproveCents": (lambda v: v is None or (is_cents(v) and v >= 0), "be a number "
                              "of at least 0, or null (no call is too large for a policy)"),
    "askHostsDefault": (lambda v: isinstance(v, bool), "be true or false"),
    "droidFactoryKey": (lambda v: isinstance(v, bool), "be true or false"),
    "hookHosts": (lambda v: isinstance(v, list) and len(v) <= 20 and all(
        isinstance(h, str) and re.fullmatch(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", h)
        and "." in h for h in v), "be an array of lower-case host names (without port) that "
                                  "hook deliveries may arrive under"),
}
SETTING_VALUES: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "dnsAllowedNets": lambda v, current: valid_answer_nets(v),
    "folderRoots": lambda v, current: valid_folder_roots(v),
    "jira": lambda v, current: validate_jira(v, current),
    "modelGateway": lambda v, current: validate_model_gateway(v),
}


def validate_settings(body: Any, current: dict[str, Any]) -> dict[str, Any]:
    """Check a PUT /api/settings body (a partial update); return the new settings."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    new = dict(current)
    for key, value in body.items():
        if key not in DEFAULT_SETTINGS:
            raise ApiError(400, f"unknown setting: {key}")
        if key in SETTING_RULES and not SETTING_RULES[key][0](value):
            raise ApiError(400, f"{key} must {SETTING_RULES[key][1]}")
        if key in LIMIT_SETTINGS or key == "uploadMaxBytes":
            check_limit(key, value, *LIMIT_SETTINGS.get(key, (1 << 10, False)))
        new[key] = SETTING_VALUES[key](value, current) if key in SETTING_VALUES else value
    if new["droidModel"] not in new["droidPrices"]:   # an unpriced model would be free
        raise ApiError(400, f"droidModel {new['droidModel']} has no droidPrices entry (its "
                            "usage would cost nothing and its budget never pause it); priced: "
                            f"{', '.join(sorted(new['droidPrices'])) or 'none'}")
    return new


PUBLIC_FIELDS = ("id", "title", "prompt", "workspace", "worker", "tools", "hosts", "budgetCents",
                 "source", "state", "user", "layers", "costCents", "step", "createdAt",
                 "updatedAt", "error", "summary", "limits", "folder", "folders", "review",
                 "askHosts", "schedule", "merged", "moreMerged", "undoMerge")
OPTIONAL_FIELDS = ("step", "error", "summary", "limits", "folder", "folders", "review",
                   "schedule", "merged", "moreMerged", "undoMerge")
ABSENT = object()                   # a field a task's API form leaves out (Loop.listed_api)
# Interned when a task is read (Task.from_dict); not error: its values vary, and from Python
# 3.12 an interned string may never be freed.
TASK_SHARED = ("workspace", "worker", "source", "state", "review", "schedule")


@dataclass(slots=True)
class Task:
    """A task as the seed page defines it, plus gurtd's own bookkeeping (not in the API).
    Slotted: past 30 attributes an instance's own dict is ~1.5 KB (CPython shares the keys of
    smaller ones only), 15 MB of RSS in a box with 10,000 tasks."""

    id: str
    title: str
    prompt: str
    workspace: str
    worker: str
    tools: list[str]
    hosts: list[str]
    budgetCents: float
    source: str
    state: str
    user: str
    layers: list[str]
    costCents: float
    createdAt: str
    updatedAt: str
    step: str | None = None
    error: str | None = None
    summary: str | None = None
    limits: dict[str, int] | None = None    # the effective limits, fixed when it is created
    seq: int = 0                    # creation order, for first in first out
    doneSeq: int = 0                # finish order of done tasks: the stack order
    uid: int = 0                    # while the box user exists
    layerDeleted: bool = False
    # personal mode (Review): the real folders, their owners and inodes as checked at create,
    # the review, and when the task started (what changed since is a conflict)
    folder: str | None = None
    folders: list[str] | None = None
    review: str | None = None
    folderInfo: list[dict[str, Any]] | None = None
    folderStartNs: int = 0
    askHosts: bool = False          # a name outside hosts asks a person (a host approval)
    schedule: str | None = None     # the schedule that started it
    merged: list[str] | None = None  # paths its finish-time merge joined with the view's
    moreMerged: int | None = None   # ... past the first MERGE_CONFLICTS_SHOWN, counted
    undoMerge: dict[str, Any] | None = None   # its undo in later copies: reverted, kept
    mergedOn: str | None = None     # the stack its layer was merged with (a StackStore ref)
    paidCall: str | None = None     # its last payment that costCents holds (recover_ledger)

    def to_api(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in PUBLIC_FIELDS}
        for key in OPTIONAL_FIELDS:
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Task":
        """A stored task; the fields of few values (workspace, state...) one string each
        across the box, not one per task file read (10,000 tasks: 2.7 MB)."""
        task = record_from(cls, data, lambda t: t.state in STATES and ID_RE.fullmatch(t.id))
        for name in TASK_SHARED:
            value = getattr(task, name)
            if type(value) is str:
                setattr(task, name, sys.intern(value))
        return task


def record_from(cls: Any, data: Any, valid: Callable[[Any], Any]) -> Any:
    """A dataclass record from stored JSON, or ValueError; keys it does not know (a newer
    file) are left out."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    names = {f.name for f in dataclasses.fields(cls)}
    record = cls(**{k: v for k, v in data.items() if k in names})
    if not valid(record):
        raise ValueError(f"not a {cls.__name__} record")
    return record


APPROVAL_STATES = ("pending", "approved", "denied")
BUILTIN_TOOLS = {
    "wallet.pay": 'pay out of the box\'s wallet: {"to": str, "cents": number >= 0.01, '
                  '"memo"?: str}',
    "ask": 'ask a person and wait for the answer: {"question": str}',
}


@dataclass
class Approval:
    """A question to a person: a spending above a task's budget (budget) or an ask."""

    id: str
    task: str
    kind: str
    tool: str
    args: Any
    cents: float
    question: str | None
    state: str
    createdAt: str
    reason: str | None = None
    answer: str | None = None
    answeredBy: str | None = None
    answeredAt: str | None = None
    # decisions: what a person changed, the policy involved, whether always is offered
    approvedArgs: Any = None            # approved with these arguments instead of args
    budgetCents: float | None = None    # approved by raising the task's budget to this
    policy: str | None = None           # the policy that approved it, or that always made
    canAlwaysApprove: bool = False      # kept current by Broker.render
    alwaysBlockedReason: str | None = None

    def to_api(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Approval":
        return record_from(cls, data,
                           lambda a: a.state in APPROVAL_STATES and ID_RE.fullmatch(a.task))


def new_approval_id() -> str:
    return new_task_id("a")


def new_call_id() -> str:
    """A broker call's id, c + 9 characters: on its log line and on its ledger line, so that
    a payment can always be matched with its task's log."""
    return new_task_id("c")


def is_cents(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        value == value and value not in (float("inf"), float("-inf"))


MIN_PAYMENT_CENTS = 0.01     # a budget bounds how many payments a task makes (and ledger lines)


def check_tool_args(tool: str, args: Any) -> float:
    """Check a built-in tool's arguments; the cents the call would spend.  ValueError says why."""
    if not isinstance(args, dict):
        raise ValueError("args must be a JSON object")
    if tool == "wallet.pay":
        extra = set(args) - {"to", "cents", "memo"}
        if extra:
            raise ValueError(f"unknown argument: {sorted(extra)[0]}")
        if not isinstance(args.get("to"), str) or not args["to"].strip() or len(args["to"]) > 200:
            raise ValueError("to must be a non-empty string (at most 200 characters)")
        if not is_cents(args.get("cents")) or args["cents"] < MIN_PAYMENT_CENTS:
            raise ValueError(f"cents must be a number of at least {MIN_PAYMENT_CENTS}")
        if "memo" in args and (not isinstance(args["memo"], str) or len(args["memo"]) > 1000):
            raise ValueError("memo must be a string (at most 1000 characters)")
        return args["cents"]
    if tool == "ask":
        if set(args) != {"question"} or not isinstance(args["question"], str) \
                or not args["question"].strip() or len(args["question"]) > 4000:
            raise ValueError('args must be {"question": "..."} (at most 4000 characters)')
        return 0.0
    return 0.0


TIMED_OUT = "timed out"               # the error of a task past taskTimeoutSeconds (a stop)


def call_not_run(tool: str, approval: Approval) -> str:
    """What a tool call whose approval ended without a yes tells the task: who or what ended
    it (answeredBy), in words true for each; only a person's no is a rejection."""
    reason, by = approval.reason or "denied", approval.answeredBy
    if by == "api":
        return f'Tool call "{tool}" was rejected by the owner: {reason}'
    if by == "task":
        return f'Tool call "{tool}" was withdrawn: the task cancelled the call'
    why = ("the task was undone" if by == "undo" else
           "gurtd stopped" if by == "restart" else
           "the task timed out (taskTimeoutSeconds)" if by == "stop" and reason == TIMED_OUT
           else "the task was stopped" if by == "stop" and reason == "stopped"
           else f"the task ended ({reason})")
    return f'Tool call "{tool}" was not run: {why} while it waited for approval'


MAX_JSON_DEPTH = 64                  # task-controlled JSON nested deeper is refused
MAX_TOKENS = 10 ** 12                # a usage count above this is not believed


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_bounded(data: str | bytes, depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for text a task controls: any input gives a value or ValueError (never
    RecursionError), and the value is nested at most depth deep and holds only finite numbers,
    so that it can be logged, rendered and summed safely."""
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    stack = [(value, 1)]
    while stack:                     # iterative: a deep value cannot overflow the C stack
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > depth:
                raise ValueError(f"nested deeper than {depth}")
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return value


class KeyTwice(ValueError):
    """A JSON object holds a key twice (unique_keys)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook for text gurtd checks and then passes on as it is: a key
    twice in one object, at any depth, is KeyTwice.  json.loads would keep the last one, and
    another parser (the upstream's) may keep the first: a model, a stream or a tool that
    gurtd never checked or priced."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise KeyTwice(f"the key {json.dumps(printable(key)[:100])} is in one object "
                               "twice; each key may be there once")
            seen.add(key)
    return value


def last_line(text: Any, limit: int = 1000) -> str:
    """The last non-blank line of a message (an error event's), or "" when it is blank."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def droid_step(event: Any) -> str | None:
    """A short human form of a Droid stream event for `step`, e.g. "Execute: npm test"."""
    if not isinstance(event, dict):
        return None
    kind = event.get("type")
    if kind == "tool_call":
        name = str(event.get("toolName") or event.get("toolId") or event.get("name") or "tool")
        params = event.get("parameters") or event.get("input") or event.get("arguments") or {}
        detail = ""
        if isinstance(params, dict):
            for key in ("command", "file_path", "path", "pattern", "url", "query", "name"):
                if isinstance(params.get(key), str):
                    detail = params[key]
                    break
        return f"{name}: {detail}".strip().rstrip(":")[:200] if detail else name[:200]
    if kind == "message" and event.get("role") == "assistant":
        text = str(event.get("text") or "").strip()
        return text.splitlines()[0][:200] if text else None
    return None


TOKEN_KEYS = {"input": ("input_tokens", "inputTokens"),
              "output": ("output_tokens", "outputTokens"),
              "cacheRead": ("cache_read_input_tokens", "cacheReadTokens", "cacheReadInputTokens"),
              "cacheWrite": ("cache_creation_input_tokens", "cacheWriteTokens",
                             "cacheCreationInputTokens"),
              # the parts of cacheWrite by their time to live (the Messages API's
              # usage.cache_creation, flattened by anthropic_usage)
              "cacheWrite5m": ("ephemeral_5m_input_tokens",),
              "cacheWrite1h": ("ephemeral_1h_input_tokens",)}


def _price(prices: dict[str, Any], kind: str) -> float | None:
    """A kind's price in cents per million tokens, None without one: a 1-hour cache write at
    cacheWrite1h (else CACHE_WRITE_1H_RATIO times input), never below cacheWrite."""
    price = prices.get(kind)
    price = float(price) if is_cents(price) and price >= 0 else None
    if kind == "cacheWrite1h":
        write, given = _price(prices, "cacheWrite"), _price(prices, "input")
        ratio = given * CACHE_WRITE_1H_RATIO if given is not None else None
        found = [p for p in (price if price is not None else ratio, write) if p is not None]
        return max(found) if found else None
    return price


def usage_cents(usage: Any, prices: Any) -> float:
    """What a usage record costs at these prices (cents per million tokens); 0 without.

    A count that is not a number from 0 to MAX_TOKENS is ignored, and the sum is always a
    finite number: a task's stream cannot make costCents Infinity or NaN.  Cache writes are
    the most of cacheWrite and its parts: the 1-hour ones at their price, the rest at
    cacheWrite's (never less than all of them at cacheWrite).
    """
    if not isinstance(usage, dict) or not isinstance(prices, dict):
        return 0.0
    counts: dict[str, float] = {}
    for kind, keys in TOKEN_KEYS.items():
        counts[kind] = next((float(t) for key in keys if is_cents(t := usage.get(key)) and
                             0 <= t <= MAX_TOKENS), 0.0)
    hour = counts.pop("cacheWrite1h")
    counts["cacheWrite"] = max(counts["cacheWrite"], hour + counts.pop("cacheWrite5m")) - hour
    counts["cacheWrite1h"] = hour
    total = 0.0
    for kind, tokens in counts.items():
        if tokens and (price := _price(prices, kind)) is not None:
            total += tokens * price / 1_000_000
    return total if is_cents(total) else 0.0


def counted(n: int, noun: str) -> str:
    """n and noun, in the plural unless n is 1: "1 conflict", "3 conflicts"."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


_UNPRINTABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e"
                          "\u2066-\u2069]")


def printable(text: Any) -> str:
    """Text a task controls, made safe for a terminal: control characters (ESC, BEL, CR, NL,
    C1, bidi overrides) shown escaped as \\x1b or \\u202e; tabs stay."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 256
                            else f"\\u{ord(m[0]):04x}", str(text))


# A thread's long C call (a list's sort, json.dumps) holds the GIL the whole time, and so
# holds the loop thread: sorting and encoding a task's million changed paths was seconds in
# one call (GET /api/tasks answered in 2.65 s meanwhile).  Lists a task can make that long go
# in slices instead, each a few ms, with Python code between them, which gives the GIL up.
GIL_SLICE = 20_000                   # items sorted or encoded in one C call


def sorted_in_slices(items: list[Any], key: Callable[[Any], Any] | None) -> list[Any]:
    """sorted(items, key=key), the same list: slices sorted alone, then merged (heapq.merge
    is Python code), so that no C call holds the GIL past a slice."""
    if len(items) <= GIL_SLICE:
        return sorted(items, key=key)
    runs = [sorted(items[i:i + GIL_SLICE], key=key) for i in range(0, len(items), GIL_SLICE)]
    return list(heapq.merge(*runs, key=key))


def drop_in_slices(items: list[Any]) -> None:
    """items emptied a slice at a time from the end: a list of a million entries let go at
    once is one C call that frees them all (150 ms, a listing refused with a 413)."""
    while items:
        del items[-GIL_SLICE:]


def json_dumps_in_slices(obj: Any, encode: Callable[[Any], bytes] =
                         lambda part: json.dumps(part).encode()) -> bytes:
    """encode(obj): json.dumps(obj) as UTF-8, the same bytes; a long list encoded a slice at
    a time into a bytearray that grows with each (joined at the end, the text of 500,000
    changes was a fresh 35 MB written in one C call: 120-190 ms of page faults)."""
    if not isinstance(obj, list) or len(obj) <= GIL_SLICE:
        return encode(obj)
    out = bytearray(b"[")
    for i in range(0, len(obj), GIL_SLICE):
        out += (b", " if i else b"") + encode(obj[i:i + GIL_SLICE])[1:-1]
    out += b"]"
    return out                       # a bytes-like, taken as it is by a socket's write


def json_record_in_slices(obj: Any, depth: int = 3, out: bytearray | None = None) -> bytes:
    """json.dumps(obj, separators=(",", ":")) as UTF-8, the same bytes, appended to out (a new
    bytearray if None): a long list in it (in a dict or a list, depth levels down) encoded a
    slice at a time.  For a keep's journal and kept.json: 200,000 ops were 170 ms of one C
    call."""
    out = bytearray() if out is None else out
    if isinstance(obj, (list, tuple)) and len(obj) > GIL_SLICE:
        out += b"["
        for i in range(0, len(obj), GIL_SLICE):
            out += (b"," if i else b"") + json.dumps(list(obj[i:i + GIL_SLICE]),
                                                     separators=(",", ":")).encode()[1:-1]
        out += b"]"
    elif depth and isinstance(obj, dict) and all(isinstance(key, str) for key in obj):
        out += b"{"
        for n, (key, value) in enumerate(obj.items()):
            out += (b"," if n else b"") + json.dumps(key).encode() + b":"
            json_record_in_slices(value, depth - 1, out)
        out += b"}"
    elif depth and isinstance(obj, (list, tuple)):
        out += b"["
        for n, item in enumerate(obj):
            out += b"," if n else b""
            json_record_in_slices(item, depth - 1, out)
        out += b"]"
    else:
        out += json.dumps(obj, separators=(",", ":")).encode()
    return out


def lower_layer_paths(layers: list[str]) -> list[str]:
    """The lower layers of a view, newest first, as paths relative to BOX_HOME (base last)."""
    return [f"layers/{layer}/upper" for layer in layers]


OVERLAY_OPTIONS = (("index", "off"), ("metacopy", "off"), ("redirect_dir", "off"))


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def clean_relpath(raw: str) -> str:
    """A path inside a workspace from a URL: percent-decoded, no .., no NUL, no leading /."""
    path = urllib.parse.unquote(raw)
    if "\x00" in path or "\\" in path:
        raise ApiError(400, "bad path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ApiError(400, "bad path: .. is not allowed")
    return "/".join(parts)


# Persistence ###################################################################################
###############################################################################################

def write_all(fd: int, data: bytes) -> None:
    """Write every byte or raise: os.write may write less than asked (a nearly full disk),
    and a file renamed into place or a line appended must never be cut short silently."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


TORN_LINES: dict[tuple[int, int], tuple[int, tuple[int, int], OSError]] = {}
"""Logs (device, inode) whose half-written line could not be cut off: the size to cut back
to, the size and mtime the half line left, and the write's error.  append_line refuses them
until the cut succeeds: the next line would glue onto the half one and damage both."""


def append_line(fd: int, data: bytes, sync: bool = False) -> None:
    """Append one whole line to a log opened with O_RDWR | O_APPEND (synced if sync), or
    raise and leave the file as it was: a half-written line would glue itself to the next one
    and damage both, and a line whose sync failed was answered as not written.  If even the
    cut fails, the file is torn (TORN_LINES): each next line first cuts again, or raises the
    write's error again and writes nothing.  A file that ends in no newline (a half line of a
    crash, or of a cut that failed before a restart) gets one first: that line stands alone,
    damaged, and this one whole."""
    st = os.fstat(fd)
    key, size = (st.st_dev, st.st_ino), torn_cut(fd, st)
    if size and os.pread(fd, 1, size - 1) != b"\n":
        data = b"\n" + data
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    except OSError as exc:
        after = os.fstat(fd)
        if after.st_size == size:
            raise                              # nothing of it reached the file
        try:
            os.ftruncate(fd, size)
        except OSError as err:
            log(3, f"could not cut a half-written line off fd {fd}: {err}; no line is "
                   "appended to it until it can be")
            TORN_LINES[key] = (size, (after.st_size, after.st_mtime_ns), exc)
        raise


def torn_cut(fd: int, st: os.stat_result) -> int:
    """The size a line is appended at: a torn file (TORN_LINES) cut back first, or the
    write's error raised again if the cut still fails."""
    key = (st.st_dev, st.st_ino)
    torn = TORN_LINES.pop(key, None)
    if torn is None or torn[1] != (st.st_size, st.st_mtime_ns):   # else a reused inode
        return st.st_size
    try:
        os.ftruncate(fd, torn[0])
    except OSError as exc:
        TORN_LINES[key] = torn
        raise OSError(torn[2].errno, f"{torn[2].strerror} (a half-written line is still "
                                     f"there: {exc.strerror})") from exc
    log(5, f"fd {fd}: a half-written line is cut off now")
    return torn[0]


@dataclass
class FileWrite:
    """One file of atomic_write_all: its new bytes, exact mode, owner, temp name."""

    path: str
    data: bytes
    mode: int = 0o600
    owner: tuple[int, int] | None = None
    tmp: str | None = None


class PartlyRenamed(OSError):
    """atomic_write_all's error after some renames: the first `renamed` files hold their new
    bytes (their folders synced), the others their old."""

    def __init__(self, exc: OSError, renamed: int) -> None:
        super().__init__(exc.errno, exc.strerror, exc.filename)
        self.renamed = renamed


def atomic_write(path: str, data: bytes, mode: int = 0o600, sync: bool = True,
                 owner: tuple[int, int] | None = None, tmp: str | None = None) -> None:
    """Write a file so that a crash leaves the old or the new version: temp, every byte,
    fsync, size checked, rename.  On any error the temp file is removed and the old version
    stays; the error is raised.  Temp names end in .tmp-PID-THREAD (or tmp):
    remove_temp_leftovers finds a crashed run's."""
    atomic_write_all([FileWrite(path, data, mode, owner, tmp)], sync)


def atomic_write_all(writes: list[FileWrite], sync: bool = True) -> None:
    """atomic_write of several files as one group commit: every temp written, then each
    synced (the first sync commits the file system's journal for all of them), then renamed
    in order, then each folder synced once.  A crash leaves each file old or new.  An error
    before the renames changes nothing (every temp removed); a rename that fails leaves the
    earlier ones done and raises PartlyRenamed (the caller restores if the files must
    agree)."""
    temps: list[str] = []
    renamed = 0
    try:
        fds: list[int] = []
        try:
            for w in writes:
                temps.append(w.tmp or f"{w.path}.tmp-{os.getpid()}-{threading.get_ident()}")
                fds.append(os.open(temps[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                                   os.O_CLOEXEC, w.mode))
                os.fchmod(fds[-1], w.mode)    # exactly mode, whatever gurtd's umask (0077 as
                if w.owner is not None:       # a service would make /etc/passwd unreadable)
                    os.fchown(fds[-1], *w.owner)
                write_all(fds[-1], w.data)
            for fd, w, tmp in zip(fds, writes, temps):
                if sync:
                    os.fsync(fd)
                if os.fstat(fd).st_size != len(w.data):
                    raise OSError(errno.EIO, f"{tmp} holds {os.fstat(fd).st_size} bytes, "
                                             f"not {len(w.data)}")
        finally:
            for fd in fds:
                os.close(fd)
        for w, tmp in zip(writes, temps):
            os.rename(tmp, w.path)
            renamed += 1
    except BaseException as exc:
        for tmp in temps[renamed:]:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not renamed or not isinstance(exc, OSError):
            raise
        try:                  # the renamed files count as saved only once their folders are
            folders_sync(writes[:renamed], sync)
        except OSError as err:
            log(3, f"renamed {renamed} of {len(writes)} files, their folders not synced: {err}")
            raise exc from None
        raise PartlyRenamed(exc, renamed) from exc
    folders_sync(writes, sync)


def folders_sync(writes: list[FileWrite], sync: bool = True) -> None:
    """The folders of writes synced once each (if sync): their renames durable."""
    if sync:
        for folder in dict.fromkeys(os.path.dirname(w.path) or "." for w in writes):
            fsync_dir(folder)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


TEMP_RE = re.compile(r"\.(?:tmp|gurtd)-(\d+)(?:-\d+)?$")


def remove_temp_leftovers(directories: list[str], only_dead: bool = False,
                          prefixes: tuple[str, ...] = ("",)) -> list[str]:
    """Remove temp files of writes cut short by a crash (NAME.tmp-PID-THREAD, or
    NAME.gurtd-PID for the account files) whose NAME starts with one of prefixes; the removed
    paths.  With only_dead, a temp file whose pid is alive is kept: another gurtd (on another
    BOX_HOME) may be writing it right now."""
    removed = []
    for directory in directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            m = TEMP_RE.search(name)
            if not m or not name.startswith(prefixes):
                continue
            pid = int(m.group(1))
            if only_dead and pid != os.getpid() and pid_alive(pid):
                continue
            path = os.path.join(directory, name)
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
                    removed.append(path)
            except OSError as exc:
                log(3, f"could not remove the leftover temp file {path}: {exc}")
    return removed


def crash_point(name: str) -> None:
    """Test-only: with GURT_TEST_CRASH_AT=name in the environment, gurtd dies here at once, as
    kill -9 would (exit 137), so that tests can crash it between two writes.  No effect
    otherwise; never set it on a real box."""
    if os.environ.get("GURT_TEST_CRASH_AT") == name:
        log(3, f"GURT_TEST_CRASH_AT={name}: dying here (a test's crash point)")
        os._exit(137)


STOPPED_AT: set[str] = set()


def stop_point(name: str) -> None:
    """Test-only: with GURT_TEST_STOP_AT=name in the environment, gurtd stops itself here
    the first time it passes (SIGSTOP, every thread), so that a test can change the disk
    (fill it) between two writes, then SIGCONT.  No effect otherwise; never set it on a
    real box."""
    if os.environ.get("GURT_TEST_STOP_AT") == name and name not in STOPPED_AT:
        STOPPED_AT.add(name)
        log(3, f"GURT_TEST_STOP_AT={name}: stopping here (a test's pause point)")
        os.kill(os.getpid(), signal.SIGSTOP)


def fault_point(text: Any) -> None:
    """Test-only: with GURT_TEST_RAISE_ON_OUTPUT=TEXT, a fake worker's output line TEXT makes
    its handler raise, as a bug would, to show that the loop guard fails that task only.  No
    effect otherwise; never set it on a real box."""
    if text and text == os.environ.get("GURT_TEST_RAISE_ON_OUTPUT"):
        raise RuntimeError(f"GURT_TEST_RAISE_ON_OUTPUT: a test's fault on {text!r}")


def folder_ensure(path: str, mode: int) -> None:
    """The folder (and any missing above it), with exactly mode whatever gurtd's umask: the
    unit's UMask=0077 made a tools folder meant for another user 0700."""
    os.makedirs(path, mode=mode, exist_ok=True)
    os.chmod(path, mode)


def secret_write(path: str, text: str) -> None:
    """A secret (the model key, the Jira token) as a whole file, 0600, in its folder
    (BOX_HOME/secrets) kept 0700 even if it was made looser."""
    folder_ensure(os.path.dirname(path), 0o700)
    atomic_write(path, text.encode(), mode=0o600)


def is_disk_error(exc: BaseException) -> bool:
    """A write that failed because of the disk (full, quota, read-only, broken), not a bug."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                                      errno.EIO, errno.EFBIG)


def cannot_save(exc: BaseException, what: str = "task") -> str:
    """A failed save as a person reads it: a task's error, the message of a 507."""
    return f"cannot save the {what}: {getattr(exc, 'strerror', None) or exc}"


@contextlib.contextmanager
def saved_or_507(what: str) -> Iterator[None]:
    """A disk's refusal (full, read-only...) answers 507 (cannot_save); any other error passes."""
    try:
        yield
    except OSError as exc:
        if is_disk_error(exc):
            raise ApiError(507, cannot_save(exc, what), "insufficient_storage") from None
        raise


def save_or_restore(save: Callable[[], None], what: str, items: dict[str, Any], key: str,
                    before: Any) -> None:
    """save() after a change of items[key], its disk errors answering 507 (saved_or_507); when
    it fails, items[key] is what it was before (None: absent), as on disk."""
    try:
        with saved_or_507(what):
            save()
    except BaseException:
        if before is None:
            items.pop(key, None)
        else:
            items[key] = before
        raise


def fsync_dir(directory: str) -> None:
    """Make a rename or a new file in directory durable."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def load_ledger(path: str) -> dict[str, Any]:
    """The wallet from its append-only ledger (JSON lines): the balance is the last line's.
    A torn last line (a crash in the middle of a write) was never acknowledged: it is cut off."""
    ledger: list[dict[str, Any]] = []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {"balanceCents": 0, "ledger": []}
    whole, _, torn = data.rpartition(b"\n")
    for number, raw in enumerate(whole.split(b"\n") if whole else [], 1):
        try:
            entry = json.loads(raw)
            if not isinstance(entry, dict) or not is_cents(entry.get("balanceAfterCents")):
                raise ValueError("not a ledger entry")
        except ValueError as exc:
            log(3, f"{path}: line {number} is damaged and left out: {exc}")
            continue
        ledger.append(entry)
    if torn:
        log(3, f"{path}: a torn last line ({len(torn)} bytes) was cut off")
        with open(path, "r+b") as f:
            f.truncate(len(whole) + 1 if whole else 0)
            os.fsync(f.fileno())
    return {"balanceCents": ledger[-1]["balanceAfterCents"] if ledger else 0, "ledger": ledger}


def write_json(path: str, obj: Any, sync: bool = True) -> None:
    atomic_write_all([json_write(path, obj)], sync=sync)


def write_record(path: str, obj: Any) -> None:
    """write_json of a record that may hold long lists (a keep's journal, kept.json), encoded
    a slice at a time (json_record_in_slices): the same bytes."""
    data = json_record_in_slices(obj)
    data += b"\n"
    atomic_write_all([FileWrite(path, data)])


def json_write(path: str, obj: Any) -> FileWrite:
    """obj as a JSON file's write, for atomic_write_all."""
    return FileWrite(path, json.dumps(obj, separators=(",", ":")).encode() + b"\n")


def load_json(path: str, parse: Callable[[Any], Any] | None = None,
              hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """The JSON in path (what parse makes of it, if given; hook: json.loads' object_hook), or
    None if it is missing.  A damaged file (not JSON, or JSON that parse refuses with
    TypeError or ValueError) is set aside and logged."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(), object_hook=hook)
        return data if parse is None else parse(data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, UnicodeDecodeError, OSError) as exc:
        aside = f"{path}.damaged-{int(time.time())}"
        try:
            os.replace(path, aside)
        except OSError as err:
            log(3, f"damaged state file {path} ({exc}) could not be set aside: {err}")
            return None
        log(3, f"damaged state file {path} set aside as {aside}: {exc}")
        return None


# System layer ##################################################################################
###############################################################################################
# Thin and honest: each verb is idempotent, logs what it does, raises SysError, and has its
# inverse beside it.  Decisions are made above, in the Tasks section.

_LIBC: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _LIBC.syscall.restype = ctypes.c_long
    return _LIBC


def syscall(name: str, nr: int, *args: Any) -> int:
    return libc_call(name, ctypes.c_long(nr), *args, fn="syscall")


def libc_call(name: str, *args: Any, fn: str = "") -> int:
    """libc's name(*args), or its fn (syscall) under that name: below 0, a SysError."""
    result = getattr(libc(), fn or name)(*args)
    if result < 0:
        err = ctypes.get_errno()
        raise SysError(name, err, os.strerror(err))
    return result


def run(argv: list[str], stdin: bytes | None = None) -> str:
    """Run a command without a shell; its stdout, or SysError with its code and stderr."""
    log(7, "run: " + " ".join(argv))
    proc = subprocess.run(argv, input=stdin, capture_output=True, check=False)
    if proc.returncode != 0:
        raise SysError(" ".join(argv), proc.returncode, proc.stderr.decode(errors="replace"))
    return proc.stdout.decode(errors="replace")


# Users: task users are written into the account files directly (under lckpwdf, atomic
# rename), ~1 ms instead of ~11 ms for useradd.  A uid without a passwd entry breaks whoami,
# git and ssh, so every task uid gets one.

ACCOUNT_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow")
_ACCOUNTS_LOCK = threading.Lock()


def _account_lines(name: str, uid: int, comment: str) -> dict[str, str]:
    days = int(time.time() // 86400)
    comment = re.sub(r"[:,\n]", "_", comment)
    return {"/etc/passwd": f"{name}:x:{uid}:{uid}:{comment}:/home/{name}:/usr/sbin/nologin",
            "/etc/group": f"{name}:x:{uid}:",
            "/etc/shadow": f"{name}:!*:{days}::::::",
            "/etc/gshadow": f"{name}:!::"}


class AccountEdit:
    """One edit of the account files, held open: under the account lock from the first uid
    it gives to its write, so that two gurtd instances never share a uid.  uid(name) chooses
    a free uid of the task range (the first from hint on, wrapping, after the one before it,
    that no account or group has) and plans the entries; forget(name) drops a plan; write
    removes the entries of gone and writes the planned ones, in one edit (its syncs cost the
    same however many).  A schedule holds one open across its starts, so that the workers'
    own setup runs while their users are written (StepGroup.users_making)."""

    def __init__(self, hint: int, comment: str) -> None:
        self.hint, self.comment = hint, comment
        self.taken: set[int] | None = None
        self.planned: dict[str, int] = {}
        self.gone: list[str] = []
        self.locked = False

    def __enter__(self) -> "AccountEdit":
        _ACCOUNTS_LOCK.acquire()
        try:
            libc_call("lckpwdf")
        except BaseException:
            _ACCOUNTS_LOCK.release()
            raise
        self.locked = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.locked:
            self.locked = False
            libc().ulckpwdf()
            _ACCOUNTS_LOCK.release()

    def uid(self, name: str) -> int:
        if self.taken is None:
            self.taken = _uids_taken()
        uid = self.planned[name] = _uid_free(self.taken, self.hint)
        self.taken.add(uid)
        self.hint = uid + 1
        return uid

    def forget(self, name: str) -> None:
        """name not made, and its entries removed (a start that failed inside)."""
        self.planned.pop(name, None)
        self.gone.append(name)

    def write(self, gone: list[str]) -> None:
        lines: dict[str, list[str]] = {path: [] for path in ACCOUNT_FILES}
        for name, uid in self.planned.items():
            for path, line in _account_lines(name, uid, self.comment).items():
                lines[path].append(line)
        _accounts_replace(set(gone) | set(self.gone) | set(self.planned), lines)
        log(7, f"users_edit: removed {' '.join(gone + self.gone) or '-'}, added "
               f"{' '.join(f'{n} ({u})' for n, u in self.planned.items()) or '-'}")


def _edit_accounts(names: list[str], add: list[str] | None = None, hint: int = 0,
                   comment: str = "") -> list[int]:
    """Remove the entries of names and make users add (their entries replace any of the
    same name) in one AccountEdit; the uids of add, in its order."""
    with AccountEdit(hint, comment) as edit:
        uids = [edit.uid(name) for name in add or []]
        edit.write(names)
    return uids


def _uids_taken() -> set[int]:
    """Every uid and gid the account files hold."""
    taken = set()
    for path in ("/etc/passwd", "/etc/group"):
        with open(path) as f:
            for line in f:
                parts = line.split(":")
                if len(parts) > 2 and is_digits(parts[2]):
                    taken.add(int(parts[2]))
    return taken


def _uid_free(taken: set[int], hint: int) -> int:
    """The first uid of the task range from hint on (wrapping) that is not taken."""
    for i in range(UID_COUNT):
        uid = UID_FIRST + (hint - UID_FIRST + i) % UID_COUNT
        if uid not in taken:
            return uid
    raise SysError("allocate uid", errno.ENOSPC, "no free uid in the range")


def _accounts_replace(names: set[str], lines: dict[str, list[str]]) -> None:
    """The account files without the entries of names and with lines, as one group commit:
    the four temps written, then synced (the first sync commits the journal for all), then
    renamed, then /etc synced once: five syncs where there were eight.  If a rename fails
    after others, those are put back: the four files agree, or none changed."""
    old: dict[str, bytes] = {}
    writes = []
    for path in ACCOUNT_FILES:
        if not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            old[path] = f.read()
        before = old[path].decode("utf-8", "surrogateescape").splitlines()
        after = [line for line in before if line.partition(":")[0] not in names]
        after += lines.get(path, [])
        if after != before:
            writes.append(_account_write(path, ("\n".join(after) + "\n").encode(
                "utf-8", "surrogateescape")))
    try:
        atomic_write_all(writes)
    except BaseException:
        for w in writes:
            try:
                with open(w.path, "rb") as f:
                    if f.read() == old[w.path]:
                        continue
                atomic_write_all([_account_write(w.path, old[w.path])])
            except OSError as exc:
                log(3, f"could not put {w.path} back after a failed edit: {exc}")
        raise


def _account_write(path: str, data: bytes) -> FileWrite:
    """An account file's new bytes as a write: a temp beside it (PATH.gurtd-PID) with the
    file's own mode and owner."""
    st = os.stat(path)
    return FileWrite(path, data, st.st_mode & 0o7777, (st.st_uid, st.st_gid),
                     f"{path}.gurtd-{os.getpid()}")


def _replace_account_file(path: str, data: bytes) -> None:
    """Replace an account file with data: a temp beside it (PATH.gurtd-PID, same mode and
    owner), every byte written, fsync, size checked, rename.  On any error the temp is
    removed and the original stays untouched: /etc/passwd is never truncated."""
    atomic_write_all([_account_write(path, data)])


def account_temp_leftovers() -> list[str]:
    """Remove /etc/{passwd,group,shadow,gshadow}.gurtd-PID left by a gurtd that died in the
    middle of an edit (its pid is gone); a live gurtd's temp file is its own business."""
    names = tuple(os.path.basename(p) + "." for p in ACCOUNT_FILES)
    return remove_temp_leftovers(["/etc"], only_dead=True, prefixes=names)


def users_edit(gone: list[str], add: list[str], hint: int, comment: str) -> list[int]:
    """Remove users and groups gone and create those of add with free uids (= gids) of the
    task range, the first from hint on, in one edit (its syncs cost the same however many);
    an entry of a name in add is replaced.  The uids of add, in its order."""
    return _edit_accounts(gone, add, hint, comment)


def user_add(name: str, hint: int, comment: str) -> int:
    """users_edit of one user to create; its uid."""
    return users_edit([], [name], hint, comment)[0]


def user_del(*names: str) -> None:
    """Remove users and groups `names` in one edit (its syncs cost the same however many);
    nothing happens for a name there is none of."""
    users_edit(list(names), [], 0, "")


def task_users() -> dict[str, int]:
    """Every box-* account in /etc/passwd with its uid."""
    out = {}
    with open("/etc/passwd") as f:
        for line in f:
            parts = line.split(":")
            if len(parts) > 2 and parts[0].startswith(TASK_USER_PREFIX) and is_digits(parts[2]):
                out[parts[0]] = int(parts[2])
    return out


def system_user_ensure(name: str) -> tuple[int, int]:
    """A system user's uid and gid (the store user, the tools user), made on first use with
    no home and no shell.  Kept: files on disk belong to them."""
    import pwd
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir",
             "/nonexistent", "--shell", "/usr/sbin/nologin", name])
        entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


# Processes: a task's processes are exactly those of its uid (no_new_privs, no capabilities:
# they cannot change it), so "every process of the task" is found by uid (and by its cgroup,
# see Limits and tracking).

def _live_thread(pid: str) -> bool:
    """Whether a process whose main thread is a zombie still has a running thread."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            return True
    return False


def processes_by_uid(uids: set[int] | None = None) -> dict[int, list[int]]:
    """Live processes by real uid, for uids in the set (or the task range).  A zombie counts
    while one of its threads runs (its main thread exited, another did not)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not is_digits(entry):
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        uid = state = None
        for line in status.split(b"\n"):
            if line.startswith(b"State:"):
                state = line.split()[1]
            elif line.startswith(b"Uid:"):
                uid = int(line.split()[1])
                break
        if uid is None or (state == b"Z" and not _live_thread(entry)):
            continue
        if (uids is not None and uid in uids) or \
                (uids is None and UID_FIRST <= uid < UID_FIRST + UID_COUNT):
            out.setdefault(uid, []).append(int(entry))
    return out


def signal_uid(uid: int, sig: int) -> None:
    """Send sig to every process of uid (SIGSTOP to pause a task, SIGCONT to resume it)."""
    for pid in processes_by_uid({uid}).get(uid, []):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


_DROID_MODELS: dict[str, list[str]] = {}


def droid_models(path: str) -> list[str]:
    """The model ids the Droid CLI knows, from its own answer to an unknown one (cached)."""
    if path not in _DROID_MODELS:
        import tempfile
        with tempfile.TemporaryDirectory() as home:
            try:
                proc = subprocess.run([path, "exec", "-m", "gurtd-probe-no-such-model", "x"],
                                      capture_output=True, timeout=30, cwd=home,
                                      env={"HOME": home, "PATH": TASK_PATH})
                text = (proc.stderr + proc.stdout).decode(errors="replace")
            except (OSError, subprocess.TimeoutExpired) as exc:
                log(4, f"cannot ask {path} for its models: {exc}")
                return []
        m = re.search(r"Available built-in models:\s*\n\s*([^\n]+)", text)
        _DROID_MODELS[path] = [x.strip() for x in m.group(1).split(",")] if m else []
    return _DROID_MODELS[path]


def kill_uid(uid: int, timeout: float = 5.0) -> None:
    """SIGKILL every process of uid until none is left.  Idempotent."""
    deadline = time.monotonic() + timeout
    while True:
        pids = processes_by_uid({uid}).get(uid, [])
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise SysError(f"kill_uid {uid}", errno.EBUSY, f"processes left: {pids}")
        time.sleep(0.002)


# Mounts: workers' views live in their own mount namespaces and vanish with them; people's
# views of a workspace are detached mounts held as file descriptors.  Neither shows in the
# host's mount table, so a crash of gurtd leaves no mount behind.

class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


# Overlay, two ways; overlay_way() says which, decided once at start by overlay_probe (a small
# overlay in a temp dir) and logged.  Kernel facts, from the kernel's source where it says so:
#   fd way: each layer an fd through fsconfig(FSCONFIG_SET_FD, "lowerdir+"), upper and work
#     the same, beneath a detached idmapped clone of BOX_HOME.  It needs `lowerdir+` (6.8, a
#     path then), layers as files (6.13: fsparam_file_or_string) and layers on detached mounts
#     (6.15: clone_private_mount() took only mounts of the caller's namespace before).
#     Debian 12's 6.1 answers `fsconfig lowerdir+: 95` (EOPNOTSUPP).
#   legacy way, for older kernels: mount(2) with one option string.  Overlay before 6.5 has no
#     fsconfig of its own: the legacy adapter takes strings only, each at most 256 bytes
#     (strndup_user in fs/fsopen.c), so `lowerdir=a:b:c` of real paths does not fit; mount(2)
#     takes one page of options (4095 bytes and a NUL), and overlay silently cuts what is
#     past it (DESIGN section 3: one probe mounted the wrong layer), so the string is
#     refused well before (MOUNT_DATA_MAX).  To stay short, the layers are named by fd
#     from /proc/self/fd: `lowerdir=17:18:19`, at most 6 bytes a layer, about 3,000 for
#     500.  Each layer must be a mount of the mounting thread's namespace (before 6.15), so
#     a thread of its own does it (_overlay_legacy): it unshares its mount namespace (with
#     it its cwd), moves the detached clones in, mounts there, returns a detached clone of
#     the overlay and ends; its namespace, and every mount in it, goes with it.
# Measured on 6.18 (a view of a plan, the fastest of 7, on a loaded 2-core VM), fd / legacy:
# 2 layers 0.08 / 0.6 ms; 500 layers 8 / 15 ms; 999 (an inner overlay) 20 / 16 ms; the probe
# 20-30 ms (it forks for its user namespace).  Both ways show the same views of the same
# plans (tests/test_layers.py); GURT_OVERLAY_API=legacy runs the suite the legacy way.

OVERLAY_API_ENV = "GURT_OVERLAY_API"  # for tests: "legacy" takes the legacy way on any kernel
MOUNT_DATA_MAX = 4000                 # bytes of mount(2) options; the kernel's page is 4095
LEGACY_SCRATCH = "/tmp"               # the legacy builder's tmpfs, in its own namespace only
_OVERLAY_WAY = ""                     # "fd" or "legacy", once overlay_way() has decided

Layer = tuple[int, str]               # a layer directory: (dir fd, path beneath it, "" itself)


def overlay_way() -> str:
    """The way this process mounts overlays: the one start decided, else probed now."""
    if not _OVERLAY_WAY:
        overlay_way_set(overlay_probe(None)[0])
    return _OVERLAY_WAY


def overlay_way_set(way: str) -> None:
    global _OVERLAY_WAY
    _OVERLAY_WAY = way


def overlay_probe(where: str | None) -> tuple[str, float, list[str]]:
    """The way overlay mounts work here: (way, milliseconds it took, why others failed).

    Tried on a small overlay in a temp dir under where, as a task's view has it: two lowers,
    an upper and a work dir beneath a detached idmapped clone; the fd way first, unless
    GURT_OVERLAY_API=legacy.  SysError naming the kernel if no way works."""
    import tempfile
    ways = ["legacy"] if os.environ.get(OVERLAY_API_ENV) == "legacy" else ["fd", "legacy"]
    errors: list[str] = []
    top = tempfile.mkdtemp(prefix=".overlay-probe-", dir=where)
    try:
        for name in ("a", "b", "u", "w"):
            os.mkdir(os.path.join(top, name), 0o700)
        with open(os.path.join(top, "b", "probe"), "w") as f:
            f.write("b")
        for way in ways:
            start = time.monotonic()
            try:
                _overlay_probe_one(way, top)
                return way, (time.monotonic() - start) * 1000, errors
            except (OSError, SysError) as exc:
                errors.append(f"{way}: {exc}")
    finally:
        shutil.rmtree(top, ignore_errors=True)
    raise SysError("overlay", errno.EOPNOTSUPP, f"kernel {os.uname().release} mounts no "
                   f"task view ({'; '.join(errors)}): gurtd needs Linux 5.19 or later with "
                   "overlay and idmapped mounts (Debian: apt install linux-image-amd64)")


def _overlay_probe_one(way: str, top: str) -> None:
    userns = _idmap_userns("0 0 1\n", "0 0 1\n")
    tree = syscall("open_tree", SYS_OPEN_TREE, -100, top.encode(), OPEN_TREE_CLONE | os.O_CLOEXEC)
    try:
        _idmap_set(tree, userns)
        overlay_way_set(way)
        view = overlay_open_at([(tree, "a"), (tree, "b")], (tree, "u"), (tree, "w"))
        try:
            fd = os.open("probe", os.O_RDONLY | os.O_CLOEXEC, dir_fd=view)
            with os.fdopen(fd) as f:
                if f.read() != "b":
                    raise SysError("overlay probe", errno.EIO, "the view shows the wrong layer")
        finally:
            os.close(view)
    finally:
        overlay_way_set("")
        os.close(tree)
        os.close(userns)


def overlay_open_at(lowers: list[Any], upper: Layer | None = None,
                    work: Layer | None = None) -> int:
    """A detached overlay mount (an fd) of these layers, newest first, each a Layer or, for an
    inner overlay, a list of them; read-only without upper.  Close the fd to free.

    The legacy way moves a detached dir fd (an idmapped clone) into its own namespace: after
    the call such a dir fd is of no further use but to be closed."""
    if overlay_way() == "legacy":
        return _overlay_legacy(lowers, upper, work)
    fds: list[int] = []
    try:
        for item in lowers:
            fds.append(overlay_open_at(item) if isinstance(item, list) else _layer_open(item))
        if upper is None or work is None:
            return overlay_open(fds)
        fds += [_layer_open(upper), _layer_open(work)]
        return overlay_open(fds[:-2], fds[-2], fds[-1])
    finally:
        for fd in fds:
            os.close(fd)


def _layer_open(layer: Layer) -> int:
    return os.open(layer[1] or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=layer[0])


def overlay_open(lower_fds: list[int], upper_fd: int | None = None,
                 work_fd: int | None = None) -> int:
    """The fd way: a detached overlay mount (an fd) of these layers, newest first; read-only
    without upper.  Layers go in as file descriptors through fsconfig, so there is no option
    string to overflow and no path to race.  Close the fd to free.
    """
    fs = syscall("fsopen", SYS_FSOPEN, b"overlay", 1)
    try:
        raw, nr = libc().syscall, ctypes.c_long(SYS_FSCONFIG)   # hot with 500 layers
        for fd in lower_fds:
            if raw(nr, fs, FSCONFIG_SET_FD, b"lowerdir+", None, fd) < 0:
                err = ctypes.get_errno()
                raise SysError("fsconfig lowerdir+", err, os.strerror(err))
        if upper_fd is not None and work_fd is not None:
            syscall("fsconfig upperdir", SYS_FSCONFIG, fs, FSCONFIG_SET_FD, b"upperdir", None,
                    upper_fd)
            syscall("fsconfig workdir", SYS_FSCONFIG, fs, FSCONFIG_SET_FD, b"workdir", None,
                    work_fd)
        for key, value in OVERLAY_OPTIONS:
            syscall("fsconfig " + key, SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key.encode(),
                    value.encode(), 0)
        syscall("fsconfig create", SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0)
        return syscall("fsmount", SYS_FSMOUNT, fs, 1, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    finally:
        os.close(fs)


def overlay_mount_data(lowers: list[str], upper: str | None = None,
                       work: str | None = None) -> str:
    """The option string of a legacy overlay mount; SysError (E2BIG) past MOUNT_DATA_MAX,
    where the kernel would cut it short and mount other layers than these."""
    parts = ["lowerdir=" + ":".join(lowers)]
    if upper is not None and work is not None:
        parts += [f"upperdir={upper}", f"workdir={work}"]
    data = ",".join(parts + [f"{key}={value}" for key, value in OVERLAY_OPTIONS])
    if len(data) > MOUNT_DATA_MAX:
        raise SysError("overlay options", errno.E2BIG, f"{len(data)} bytes, past the "
                       f"{MOUNT_DATA_MAX} that mount(2) takes whole")
    return data


def _overlay_legacy(lowers: list[Any], upper: Layer | None, work: Layer | None) -> int:
    """The legacy way (see above), in a thread of its own (in_thread): gurtd's threads share
    one cwd and one mount namespace, and this changes both."""
    return int(in_thread(lambda: _overlay_legacy_build(lowers, upper, work)))


def _attached_places(fds: set[int]) -> dict[int, str | None]:
    """Each dir fd's path if its mount is in this namespace; None for a detached one."""
    with open("/proc/thread-self/mountinfo") as f:
        ours = {line.split()[0] for line in f}
    places: dict[int, str | None] = {}
    for fd in sorted(fds):
        with open(f"/proc/thread-self/fdinfo/{fd}") as f:
            mnt = re.search(r"^mnt_id:\s*(\d+)", f.read(), re.M)
        places[fd] = os.readlink(f"/proc/self/fd/{fd}") if mnt and mnt[1] in ours else None
    return places


def _overlay_legacy_build(lowers: list[Any], upper: Layer | None, work: Layer | None) -> int:
    layers = [x for item in lowers for x in (item if isinstance(item, list) else [item])]
    places = _attached_places({fd for fd, _ in layers + [x for x in (upper, work) if x]})
    libc_call("unshare", CLONE_NEWNS)         # this thread's own mounts and cwd, from here on
    _mount("none", "/", None, MS_REC | MS_SLAVE, None)   # and none of them goes back out
    held: list[int] = []

    def hold(path: str, dir_fd: int | None = None) -> int:
        held.append(os.open(path or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC,
                            dir_fd=dir_fd))
        return held[-1]

    try:
        here = {fd: hold(place) for fd, place in places.items() if place is not None}
        # the scratch tmpfs only now: an attached layer may be below LEGACY_SCRATCH (held)
        _mount("gurt-overlay", LEGACY_SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "mode=0700,size=64k")
        for fd in (fd for fd, place in places.items() if place is None):
            point = f"{LEGACY_SCRATCH}/a{fd}"
            os.mkdir(point, 0o700)
            syscall("move_mount", SYS_MOVE_MOUNT, fd, b"", -100, point.encode(),
                    MOVE_MOUNT_F_EMPTY_PATH)
            here[fd] = hold(point)

        def names(items: list[Layer]) -> list[str]:
            return [str(hold(path, here[fd])) for fd, path in items]

        os.chdir("/proc/self/fd")             # where the names are
        lower_names: list[str] = []
        for k, item in enumerate(lowers):
            if not isinstance(item, list):
                lower_names += names([item])
                continue
            point = f"{LEGACY_SCRATCH}/i{k}"
            os.mkdir(point, 0o700)
            _mount("overlay", point, "overlay", MS_NOSUID | MS_NODEV,
                   overlay_mount_data(names(item)))
            lower_names.append(str(hold(point)))
        up = wk = None
        if upper is not None and work is not None:
            up, wk = names([upper, work])
        point = f"{LEGACY_SCRATCH}/o"
        os.mkdir(point, 0o700)
        _mount("overlay", point, "overlay", MS_NOSUID | MS_NODEV,
               overlay_mount_data(lower_names, up, wk))
        return syscall("open_tree", SYS_OPEN_TREE, -100, point.encode(),
                       OPEN_TREE_CLONE | os.O_CLOEXEC)
    finally:
        for fd in held:
            os.close(fd)


def open_beneath(dirfd: int, path: str, flags: int) -> int:
    """openat2 with RESOLVE_BENEATH: no .., absolute symlink or magic link leaves dirfd."""
    how = OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    return syscall("openat2", SYS_OPENAT2, dirfd, os.fsencode(path or "."), ctypes.byref(how),
                   ctypes.c_size_t(ctypes.sizeof(how)))


def overlays_below(prefix: str, mountinfo: str | None = None) -> list[str]:
    """Overlay mount points strictly below prefix in gurtd's mount namespace (or in the text
    of a mountinfo), deepest first: what an earlier gurtd may have left of its views.

    Never prefix itself or a mount of another kind: under systemd BOX_HOME is the bind mount
    StateDirectory= makes (ProtectSystem=strict leaves only it writable), and a person may
    mount a disk of their own below it."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    points = []
    below = prefix.rstrip("/") + "/"
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        point = fields.split()[4].encode().decode("unicode_escape")
        if point.startswith(below) and tail.split()[:1] == ["overlay"]:
            points.append(point)
    return sorted(points, key=len, reverse=True)


def umount(point: str) -> None:
    """Detach a mount point; nothing happens if it is not mounted."""
    log(7, f"umount {point}")
    try:
        libc_call("umount2", point.encode(), MNT_DETACH)
    except SysError as exc:
        if exc.code not in (errno.EINVAL, errno.ENOENT):
            raise


# Network: a namespace per task (made from a short-lived thread, so gurtd itself never
# leaves the host's), a veth pair to it for a task with hosts, and one nftables table.

NET_INDEX_FILE = "/run/gurtd-net-index"      # machine-wide, so two gurtds never share a name
TASK_NET = 0x64400000                        # 100.64.0.0/10: a /31 per task
TASK_NET_SIZE = 1 << 21                      # /31 pairs in it
DNS_ADDR = "127.0.0.53"                      # where a task's resolver is, on its own lo


class Nft:
    """libnftables in-process (0.1-0.5 ms a command, against 3-20 ms for `nft -f`)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libnftables.so.1")
        lib.nft_ctx_new.restype = ctypes.c_void_p
        for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        for fn in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_char_p
        self.lib = lib
        self.ctx = lib.nft_ctx_new(0)
        lib.nft_ctx_buffer_output(self.ctx)
        lib.nft_ctx_buffer_error(self.ctx)
        self.lock = threading.Lock()

    def run(self, commands: str) -> str:
        """Run nft commands as one transaction; their output, or SysError with nft's message."""
        with self.lock:
            rc = self.lib.nft_run_cmd_from_buffer(self.ctx, commands.encode())
            out = (self.lib.nft_ctx_get_output_buffer(self.ctx) or b"").decode()
            err = (self.lib.nft_ctx_get_error_buffer(self.ctx) or b"").decode()
        if rc != 0:
            raise SysError("nft " + commands.strip().splitlines()[0][:80], rc, err.strip())
        return out

    def table_add(self, table: str) -> None:
        """(Re)create gurtd's table from scratch; idempotent."""
        self.table_del(table)
        self.run(nft_ruleset(table))

    def table_del(self, table: str) -> None:
        """Delete gurtd's table; nothing happens if there is none."""
        if f"table inet {table}\n" in self.run("list tables") + "\n":
            self.run(f"delete table inet {table}")


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run fn in a short-lived thread (whose namespaces it may change) and return its result."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, name="netns")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def netns_new(setup: Callable[[], Any]) -> tuple[int, Any]:
    """A new network namespace (an fd: it lives while the fd or a process holds it) and what
    setup() returned, run inside it.  No bind mount under /run/netns: nothing to leak."""
    def inside() -> tuple[int, Any]:
        libc_call("unshare", CLONE_NEWNET)
        fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return fd, setup()
        except BaseException:
            os.close(fd)
            raise
    return in_thread(inside)


def in_netns(nsfd: int, fn: Callable[[], Any]) -> Any:
    """Run fn inside the network namespace nsfd (from a thread that enters it)."""
    def inside() -> Any:
        libc_call("setns", nsfd, CLONE_NEWNET)
        return fn()
    return in_thread(inside)


def sysctl_write(name: str, value: str) -> str:
    """Set a sysctl (of the calling thread's network namespace); return the old value."""
    path = "/proc/sys/" + name.replace(".", "/")
    with open(path) as f:
        old = f.read().strip()
    if old != value:
        with open(path, "w") as f:
            f.write(value)
    return old


def net_index_next() -> int:
    """The next task network index, machine-wide (flock on a file in /run)."""
    fd = os.open(NET_INDEX_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, 32, 0).strip()
        index = (int(raw) + 1 if is_digits(raw) else 1) % TASK_NET_SIZE or 1
        os.pwrite(fd, f"{index}\n".encode().ljust(16), 0)
        return index
    finally:
        os.close(fd)


def net_addresses(index: int) -> tuple[str, str]:
    """The /31 of a task network: (host end, task end)."""
    base = TASK_NET + 2 * index
    return str(ipaddress.IPv4Address(base)), str(ipaddress.IPv4Address(base + 1))


# Layer walks ###################################################################################
###############################################################################################
# Every walk of a tree a task or a person may write (a layer or an upper, an owner's real
# folder, a view) is one walk(), so that a task's files cannot steer gurtd: each folder is
# opened by its name from its parent's fd without following a symlink (a path beneath a root
# with openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), each entry is looked at with fstatat on
# a directory fd, the walk is an explicit stack of folders as (parent, name), never whole
# paths, without recursion, and it keeps WALK_FDS fds open beyond its roots.  A step up to a
# folder whose fds were let go is checked against the folder the walk came down from (dev,
# ino): a folder moved meanwhile is an error, never a walk (or a removal) outside the tree.
# Walks for people run in the HTTP thread that asked, never on the loop.

RESOLVE_NO_SYMLINKS = 0x04
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


WALK_FDS = 256                       # directory fds one walk keeps open along its path
CHANGES_MAX_BYTES = 64 << 20         # paths a layer's entries list holds (layer_entries)
CHANGES_MAX_MEMORY = 256 << 20       # memory one changes list holds: 800,000 changes
                                     # of 60-character paths (64 MiB of such paths were 1.1M)
                                     # (a task's chain of long names 6,000 deep, or millions of
                                     # empty files, would hold gigabytes)
# What one change costs beside its path's own str: its dict, its slot in the list, in the
# sorted list and the sort's keys (tracemalloc, a layer of 100,000 empty files: 247 bytes
# held an entry, 263 at the peak of the sort, of which 6 are the path's characters)
CHANGE_ENTRY_BYTES = sys.getsizeof({"path": "", "change": ""}) + 32
CHANGE_NAME_BYTES = 24               # a name listed beside its str: its slots in the lists
# A personal task's upper entry (upper_changes' row) beside its path's str: the tuple, its
# slots in the lists of the sort, its mode and size ints
CHANGE_RECORD_BYTES = sys.getsizeof(tuple(range(7))) + 3 * 8 + 2 * 32


def open_dir_beneath(root_fd: int, rel: str) -> int | None:
    """A directory fd for rel beneath root_fd, no symlink followed; None if it is not there or
    not a directory (a task may have replaced it meanwhile)."""
    how = OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, 0,
                  RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    chunks, rest = [], os.fsencode(rel)   # a deep path goes in pieces: openat2 takes 4,095
    while len(rest) > 2048:
        cut = rest.rfind(b"/", 0, 2048)    # a name is at most 255 bytes: there is one
        chunks.append(rest[:cut])
        rest = rest[cut + 1:]
    chunks.append(rest)
    fd = root_fd
    try:
        for chunk in chunks:
            fd_next = syscall("openat2", SYS_OPENAT2, fd, chunk or b".",
                              ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
            if fd != root_fd:
                os.close(fd)
            fd = fd_next
        return fd
    except SysError:
        if fd != root_fd:
            os.close(fd)
        return None


def _entry(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _xattr(dir_fd: int, name: str, key: str) -> bytes | None:
    """An xattr of the entry name of dir_fd (never of what a symlink names), or None."""
    try:
        return os.getxattr(f"/proc/self/fd/{dir_fd}/{name}", key, follow_symlinks=False)
    except OSError:
        return None


def _opaque_child(dir_fd: int, name: str) -> bool:
    """Is the directory name in dir_fd an opaque one (it hides the layers below)?"""
    return _xattr(dir_fd, name, "trusted.overlay.opaque") == b"y"


def _dir_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


@dataclass
class WalkDir:
    """A folder of a walk: its parent and its name (whole paths of a chain of long names 6,000
    deep would be gigabytes), its (dev, ino) and its fd (while kept) in each of its layers."""

    up: WalkDir | None
    name: str
    ids: dict[int, tuple[int, int]] = field(default_factory=dict)
    fds: dict[int, int] = field(default_factory=dict)
    todo: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        """The names from the top of the walk down to this folder."""
        out, folder = [], self
        while folder.up is not None:
            out.append(folder.name)
            folder = folder.up
        return out[::-1]

    def path(self, name: str = "") -> str:
        return "/".join([*self.names(), name]).rstrip("/")     # a name holds no "/"

    def close(self) -> int:
        """Let its fds go; how many."""
        for fd in self.fds.values():
            os.close(fd)
        count, self.fds = len(self.fds), {}
        return count


def _names(fds: list[int]) -> list[str]:
    """The names in these directories, sorted, each once (one that cannot be read has none),
    in slices: a task's folder of 600,000 names held the GIL 194 ms in one set and one sort
    (the removal of its upper in the review thread, its size counted)."""
    if len(fds) == 1:
        try:
            return sorted_in_slices(os.listdir(fds[0]), key=None)
        except OSError:
            return []
    found: set[str] = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            found.update(os.listdir(fd))
    return sorted_in_slices(list(found), key=None)


class ListingCap:
    """The memory a listing of changes for a person holds, counted as it grows: past
    CHANGES_MAX_MEMORY a 413 naming what (and where the rest is, if anywhere).  Each entry is
    charged as it is listed, and each name of a folder on the walk's way as it is read (names,
    walk's names: a task's folder of millions of empty files is refused before its names are
    all held) until the walk leaves the folder (leave)."""

    def __init__(self, what: str, rest: str) -> None:
        self.what, self.rest = what, rest
        self.size = 0
        self.listed: dict[int, int] = {}     # bytes of each folder's names, by id(WalkDir)

    def charge(self, cost: int) -> None:
        self.size += cost
        if self.size > CHANGES_MAX_MEMORY:
            raise ApiError(413, f"{self.what} are more than {CHANGES_MAX_MEMORY >> 20} MiB in "
                                "memory (folders thousands deep, or millions of files); "
                                f"{self.rest}", "too_large")

    def names(self, folder: WalkDir) -> list[str]:
        found: list[str] = []
        self.listed[id(folder)] = 0
        with contextlib.suppress(OSError), os.scandir(folder.fds[0]) as entries:
            for item in entries:          # one that cannot be read has none, as _names
                found.append(item.name)
                cost = sys.getsizeof(item.name) + CHANGE_NAME_BYTES
                self.listed[id(folder)] += cost
                try:
                    self.charge(cost)
                except ApiError:
                    drop_in_slices(found)
                    raise
        return sorted_in_slices(found, key=None)    # a folder of 1,000,000: 275 ms at once

    def leave(self, folder: WalkDir) -> None:
        self.size -= self.listed.pop(id(folder), 0)


def walk(roots: list[str | int], entry: Callable[[WalkDir, str], list[int] | None],
         leave: Callable[[WalkDir], None] | None = None,
         names: Callable[[WalkDir], list[str]] = lambda f: _names(list(f.fds.values())[:1])
         ) -> None:
    """Walk the trees of roots (layers: a path, no symlink followed; a directory fd; -1: not
    there) together, depth first.  entry(folder, name) handles each of names(folder) (default:
    the first layer's, sorted) through folder.fds, and answers the layers to walk it in as a
    folder (a budget is the caller's: past it, none), or None; a folder not in its first layer
    is left out.  leave(folder) once all below it is walked.  Past WALK_FDS fds the shallowest
    folders let theirs go; back at one, each layer is opened by ".." from the folder just left
    (or by path beneath its root) and must be the one the walk came down from, else EXDEV."""
    top = folder = WalkDir(None, "")
    stack, first, kept = [top], 1, 0
    try:
        for layer, root in enumerate(roots):
            if root != -1:
                top.fds[layer] = os.open(root, DIR_FLAGS) if isinstance(root, str) else \
                    os.open(".", DIR_FLAGS, dir_fd=root)
                top.ids[layer] = _dir_id(top.fds[layer])
        top.todo = names(top)[::-1] if 0 in top.fds else []
        while stack:
            folder = stack[-1]
            if folder.todo:
                name = folder.todo.pop()
                layers = entry(folder, name)
                child = _walk_down(folder, name, layers) if layers else None
                if child is not None:
                    stack.append(child)
                    kept += len(child.fds)
                    while kept > WALK_FDS and first < len(stack) - 1:
                        kept -= stack[first].close()
                        first += 1
                    child.todo = names(child)[::-1]
                continue
            stack.pop()
            if stack and not stack[-1].fds:
                kept += _walk_up(top, stack[-1], folder)
                first = len(stack) - 1
            if leave is not None:
                leave(folder)
            kept -= folder.close()
    finally:
        for open_folder in stack + [folder]:
            open_folder.close()
            drop_in_slices(open_folder.todo)     # a folder's million names, cut short


def _walk_down(parent: WalkDir, name: str, layers: list[int]) -> WalkDir | None:
    child = WalkDir(parent, name)
    for layer in layers:
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent.fds[layer])
        except (OSError, KeyError):
            if layer == layers[0]:
                return None                 # removed (or replaced) meanwhile
            continue
        child.fds[layer], child.ids[layer] = fd, _dir_id(fd)
    return child


def _walk_up(top: WalkDir, folder: WalkDir, child: WalkDir) -> int:
    """The fds of folder again (child: the folder just left), each checked; how many."""
    for layer, dir_id in folder.ids.items():
        if layer in child.fds:
            folder.fds[layer] = os.open("..", DIR_FLAGS, dir_fd=child.fds[layer])
        elif (fd := open_dir_beneath(top.fds[layer], folder.path())) is not None:
            folder.fds[layer] = fd
        else:
            raise OSError(errno.ENOENT, "a folder vanished while it was walked", folder.path())
        if _dir_id(folder.fds[layer]) != dir_id:
            raise OSError(errno.EXDEV, "a folder was moved while it was walked", folder.path())
    return len(folder.fds)


@contextlib.contextmanager
def dropped_on_error(items: list[Any]) -> Iterator[None]:
    """A listing cut short (a 413, a 409): what it held let go a slice at a time."""
    try:
        yield
    except BaseException:
        drop_in_slices(items)
        raise


@contextlib.contextmanager
def moved_is_409() -> Iterator[None]:
    """A walk for a person: a folder the task or the owner moved meanwhile is a 409."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        raise ApiError(409, f"{exc.filename}: a folder was moved while it was read; ask again",
                       "conflict") from None


Visit = Callable[[int, str, os.stat_result, list[str]], bool | None]


def tree_visit(top: str | int, visit: Visit, leave: Callable[[int, str], None] | None = None,
               folders: bool = False, cap: ListingCap | None = None) -> None:
    """Every entry below top (a path, or a directory fd), depth first, by name: visit(dir_fd,
    name, st, parents) for each one that is not a folder, and if folders for each folder too
    (before what it holds: one it answers False for is not walked into); parents: the names
    from top down to its folder.  leave(parent_fd, name) once a folder's entries are done.
    One walk: any depth, paths far past PATH_MAX; a folder moved during it (an owner's real
    folder under a keep) raises instead of leading the walk, and a removal, out of the tree.
    cap: each folder's names charged to it while the walk is below the folder."""
    here: list[Any] = [None, []]           # the folder of the last visit and its names

    def entry(folder: WalkDir, name: str) -> list[int] | None:
        st, walk_in = _entry(folder.fds[0], name), True
        if st is not None and (folders or not stat.S_ISDIR(st.st_mode)):
            if here[0] is not folder:
                here[:] = [folder, folder.names()]
            walk_in = visit(folder.fds[0], name, st, here[1]) is not False
        return [0] if st is not None and stat.S_ISDIR(st.st_mode) and walk_in else None

    def left(folder: WalkDir) -> None:
        if leave is not None and folder.up is not None:
            leave(folder.up.fds[0], folder.name)
        if cap is not None:
            cap.leave(folder)

    if cap is None:
        walk([top], entry, left)
    else:
        walk([top], entry, left, cap.names)


def tree_remove(top: str) -> None:
    """Delete a directory tree, however deep (shutil.rmtree recurses and stops near 1,000
    levels, which would make a layer impossible to delete); a file or a link at top, itself
    (the link not followed); nothing if top is missing."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            os.unlink(top)
            return
        tree_visit(top, lambda fd, name, st, parents: os.unlink(name, dir_fd=fd),
                   lambda fd, name: os.rmdir(name, dir_fd=fd))
        os.rmdir(top)


def trash_remove(path: str) -> None:
    """tree_remove for a thread's job (a tree renamed out of use): a failure logged."""
    try:
        tree_remove(path)
    except OSError as exc:
        log(3, f"could not delete {path}: {exc}")


def tree_usage(path: str, seen: set[tuple[int, int]] | None = None) -> tuple[int, int]:
    """(bytes, entries) a directory tree takes below path (st_blocks; with seen, each inode
    once across calls), no symlink followed; what vanishes (or moves) during the walk is
    skipped."""
    total = [0, 0]

    def count(dir_fd: int, name: str, st: os.stat_result, parents: list[str]) -> None:
        if seen is not None:
            if (st.st_dev, st.st_ino) in seen:
                return
            seen.add((st.st_dev, st.st_ino))
        total[0] += st.st_blocks * 512
        total[1] += 1

    with contextlib.suppress(OSError):
        tree_visit(path, count, folders=True)
    return total[0], total[1]


def _entry_copy(src_dir: int, src: str, dst_dir: int, dst: str, exact: bool = False) -> None:
    """Copy one entry (a file, a symlink, a whole folder in one walk) with its owner, mode and
    times, no symlink followed.  exact (a merged layer): xattrs too, and a device node (a
    whiteout); else a fifo, socket or device is left out (keep never writes one)."""
    st = os.stat(src, dir_fd=src_dir, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        _copy_one(src_dir, src, dst_dir, dst, st, exact)
        return
    os.mkdir(dst, 0o700, dir_fd=dst_dir)

    def copy(folder: WalkDir, name: str) -> list[int] | None:
        st = _entry(folder.fds[0], name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o700, dir_fd=folder.fds[1])
            return [0, 1]
        if st is not None:
            _copy_one(folder.fds[0], name, folder.fds[1], name, st, exact)
        return None

    walk([f"/proc/self/fd/{src_dir}/{src}", f"/proc/self/fd/{dst_dir}/{dst}"], copy,
         lambda folder: _dir_meta(folder.fds[0], folder.fds[1], exact))


def _copy_one(src_dir: int, name: str, dst_dir: int, dst: str, st: os.stat_result,
              exact: bool) -> None:
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=src_dir), dst, dir_fd=dst_dir)
    elif stat.S_ISREG(st.st_mode):
        with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                          dir_fd=src_dir), "rb") as src, \
                open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o600, dir_fd=dst_dir), "wb") as out:
            while os.sendfile(out.fileno(), src.fileno(), None, 1 << 30):
                pass
            os.fchown(out.fileno(), st.st_uid, st.st_gid)   # before the mode: chown clears set-id
            os.fchmod(out.fileno(), stat.S_IMODE(st.st_mode))
            for key in os.listxattr(src.fileno()) if exact else ():
                os.setxattr(out.fileno(), key, os.getxattr(src.fileno(), key))
    elif exact:
        os.mknod(dst, st.st_mode, st.st_rdev, dir_fd=dst_dir)
    else:
        return
    if not stat.S_ISREG(st.st_mode):
        os.chown(dst, st.st_uid, st.st_gid, dir_fd=dst_dir, follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst_dir, follow_symlinks=False)


def _dir_meta(src: int, dst: int, xattrs: bool) -> None:
    """A copied folder takes its source's owner, mode and times, and with xattrs its xattrs
    (overlay's own trusted.overlay.* left out: a merge decides opaque itself)."""
    st = os.fstat(src)
    os.fchown(dst, st.st_uid, st.st_gid)
    os.fchmod(dst, stat.S_IMODE(st.st_mode))
    for key in os.listxattr(src) if xattrs else ():
        if not key.startswith("trusted.overlay."):
            with contextlib.suppress(OSError):
                os.setxattr(dst, key, os.getxattr(src, key))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def layers_down(fds: dict[int, int], layers: list[int], name: str
                ) -> tuple[tuple[int, os.stat_result] | None, list[int], bool]:
    """One name of a folder seen down its layers (those of fds in which the folder is visible,
    top first): the layer and lstat of the non-folder (file, symlink, whiteout) that shows, or
    None and the layers where it is a folder, and whether that folder is opaque stacked (the
    layers end on an opaque folder, or on a non-folder beneath it)."""
    dirs: list[int] = []
    for layer in layers:
        st = _entry(fds[layer], name)
        if st is None:
            continue
        if not stat.S_ISDIR(st.st_mode):
            return (None, dirs, True) if dirs else ((layer, st), [], False)
        dirs.append(layer)
        if _opaque_child(fds[layer], name):
            return None, dirs, True
    return None, dirs, False


def changed_paths(upper: str, lowers: list[str | int]) -> list[dict[str, str]]:
    """A layer's changes against the lowers it was made on (paths, or directory fds such as
    a detached view's, whose /proc/self/fd path would not do: walk follows no symlink, and
    a detached mount's realpath is "/"): [{path, change}], sorted by path.

    added: not in the lowers; modified: a file that was there; deleted: a whiteout.  A
    directory only shows when it is new (or replaced an earlier one, opaque).  One walk of
    the upper with, beside each of its folders, the lowers in which that folder is visible.
    A layer deleted meanwhile gives what was read so far, a folder moved meanwhile is a 409,
    more than CHANGES_MAX_MEMORY held a 413 (ListingCap: the memory of a request is
    bounded): each change counted at what it costs in memory (its path's str and
    CHANGE_ENTRY_BYTES).
    """
    out: list[dict[str, str]] = []
    cap = ListingCap("the changes", "the task's archive has them all")

    def change(folder: WalkDir, name: str) -> list[int] | None:
        fds, st = folder.fds, _entry(folder.fds[0], name)
        if st is None:
            return None
        winner, dirs, _ = layers_down(fds, list(fds)[1:], name)
        found = bool(dirs) or (winner is not None and not is_whiteout(winner[1]))
        subdir, what = None, "modified" if found else "added"
        if is_whiteout(st):
            what = "deleted" if found else ""
        elif stat.S_ISDIR(st.st_mode):
            opaque = _opaque_child(fds[0], name)
            subdir, what = [0] + ([] if opaque else dirs), what if opaque or not found else ""
        if what:
            path = folder.path(name) + ("/" if subdir is not None else "")
            out.append({"path": path, "change": what})
            cap.charge(sys.getsizeof(path) + CHANGE_ENTRY_BYTES)
        return subdir

    with moved_is_409(), contextlib.suppress(FileNotFoundError), dropped_on_error(out):
        walk([p if isinstance(p, int) else os.path.realpath(p) if os.path.isdir(p) else -1
              for p in [upper, *lowers]],
             change, cap.leave, cap.names)   # realpath: a workspace may be an admin's symlink
    return sorted_in_slices(out, key=lambda c: c["path"])


# Limits and tracking ###########################################################################
###############################################################################################
# A task's processes are tracked by a cgroup they cannot leave (no capabilities, no write access
# to cgroupfs): a v2 group whose cgroup.kill, with kill(2) of each thread it lists, ends every
# thread of it (a main thread that exited while another runs, a double-forked daemon), whose
# cgroup.freeze pauses it, and whose cgroup.events says when it is empty.  The groups are named
# per BOX_HOME, below gurtd's own group (gurt-<hash of BOX_HOME>/<task id>), so a restart finds
# what any earlier task left, its user deleted or not, and never touches another gurtd's tasks.
# Limits go where the controllers are: on a host with v1 hierarchies (pids, memory, cpu; the v2
# one has no controllers) in child groups of gurtd's own group in each; on a pure v2 host in the
# v2 group itself.  The tasks' parent group weighs half of gurtd on the CPU, so that gurtd keeps
# answering.  Where neither has pids and memory for the tasks (a pure v2 host whose group for
# gurtd is not delegated: a login's session scope, another service's group) no task starts:
# each fails at its start saying why and what to do, rather than run unbounded.  At a task's
# end its group alone finds its processes (cgroup.kill; no /proc scan by uid): every one of
# them is born in it or put there while still root, and cannot leave.

TASK_LIMITS = {       # a task body's `limits` key: (its setting, the smallest value accepted)
    "processes": ("taskMaxProcesses", 8),
    "memoryBytes": ("taskMemoryBytes", 16 << 20),
    "tmpBytes": ("taskTmpBytes", 1 << 20),
    "logBytes": ("taskLogBytes", 64 << 10),
}
LIMIT_SETTINGS = {    # setting: (smallest value, whether 0 means "computed on this machine")
    "taskMaxProcesses": (8, False), "taskMemoryBytes": (16 << 20, True),
    "taskTmpBytes": (1 << 20, False), "taskLogBytes": (64 << 10, False),
    "diskReserveBytes": (0, True),
}
LIMIT_MAX = 1 << 50
CGROUP_CONTROLLERS = ("pids", "memory", "cpu")
TASKS_CPU_SHARE = 0.5           # the tasks' parent group against gurtd's own weight
DISK_CHECK_INTERVAL = 0.2       # seconds between statvfs(BOX_HOME) while tasks run
DISK_STEP = 1 << 20             # free space must fall this much more before a second pause


def check_limit(name: str, value: Any, low: int, zero_ok: bool = False) -> None:
    """ApiError(400) unless value is a whole number from low to LIMIT_MAX (or 0 if zero_ok)."""
    if isinstance(value, bool) or not isinstance(value, int) or \
            not (low <= value <= LIMIT_MAX or (zero_ok and value == 0)):
        raise ApiError(400, f"{name} must be a whole number from {low} to {LIMIT_MAX}"
                       + (", or 0 for the default" if zero_ok else ""))


def validate_limits(body: Any) -> dict[str, int]:
    """A task body's `limits`: any of processes, memoryBytes, tmpBytes, logBytes."""
    if not isinstance(body, dict):
        raise ApiError(400, "limits must be an object")
    for key, value in body.items():
        if key not in TASK_LIMITS:
            raise ApiError(400, f"limits: unknown limit: {key} (known: "
                                f"{', '.join(TASK_LIMITS)})")
        check_limit(f"limits.{key}", value, TASK_LIMITS[key][1])
    return dict(body)


def effective_limits(overrides: dict[str, int], settings: dict[str, Any],
                     mem_total: int) -> dict[str, int]:
    """A task's limits: its overrides, else the settings; memory 0 is half of the RAM."""
    out = {key: int(overrides.get(key, settings[setting]))
           for key, (setting, _) in TASK_LIMITS.items()}
    if not out["memoryBytes"]:
        out["memoryBytes"] = max(mem_total // 2, TASK_LIMITS["memoryBytes"][1])
    return out


def disk_reserve(setting: int, fs_bytes: int) -> int:
    """The bytes of BOX_HOME's file system that tasks cannot eat: the setting, or by default
    the smaller of 1 GiB and 5% of the file system."""
    return setting if setting else min(1 << 30, fs_bytes // 20)


def inode_reserve(fs_inodes: int) -> int:
    """The inodes of BOX_HOME's file system that tasks cannot eat: the smaller of 65,536 and
    5% of them (0 where the file system reports none, as btrfs does)."""
    return min(1 << 16, fs_inodes // 20)


# Project quotas: where BOX_HOME's file system enforces them (ext4 with the project and quota
# features mounted with prjquota, xfs mounted with pquota), each running task's layer is a
# project of its own whose hard limits (blocks and inodes) are its share of what the reserve
# leaves (the room divided among the running tasks, so that together they cannot pass it): the
# kernel refuses the write (EDQUOT) that would eat into it, however fast it comes (one
# fallocate, a dd, empty files, many tasks at once), where the poll of free space only sees it
# afterwards.  The poll goes on beside them, a second line of defence.  The
# project id is the task's uid (they go round a range of 100,000, so an id comes back late);
# the layer's folders are marked inheriting before the task starts, so all it writes carries
# the id.  Limits are kept relative to the id's usage, so files an earlier layer left under
# the same id only count as already used.  At the end the limit and the marks go.
SYS_QUOTACTL_FD = 443
PRJQUOTA = 2
Q_GETQUOTA, Q_SETQUOTA, Q_XGETQSTAT = 0x800007, 0x800008, 0x5805
QIF_LIMITS = 5                        # QIF_BLIMITS | QIF_ILIMITS
FS_QUOTA_PDQ_ENFD = 0x20              # project limits enforced (Q_XGETQSTAT's qs_flags)
FS_IOC_FSGETXATTR, FS_IOC_FSSETXATTR = 0x801C581F, 0x401C5820
FS_XFLAG_PROJINHERIT = 0x200
QUOTA_INODE_STEP = 64                 # inodes short of its limit a task counts as at it


class Dqblk(ctypes.Structure):
    """struct if_dqblk: limits in 1 KiB blocks and inodes; usage in bytes and inodes."""
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "bhardlimit", "bsoftlimit", "curspace", "ihardlimit", "isoftlimit", "curinodes",
        "btime", "itime")] + [("valid", ctypes.c_uint32)]


def quotactl(path: str, cmd: int, project: int, buf: Any) -> None:
    """quotactl_fd(2) on the file system of path, for project quotas (SysError)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        syscall("quotactl_fd", SYS_QUOTACTL_FD, ctypes.c_uint(fd),
                ctypes.c_uint((cmd << 8) | PRJQUOTA), ctypes.c_int(project), buf)
    finally:
        os.close(fd)


def project_quotas_missing(path: str) -> str:
    """Why the file system of path does not enforce project quotas; "" if it does."""
    state = ctypes.create_string_buffer(256)        # struct fs_quota_stat: qs_flags at 2
    try:
        quotactl(path, Q_XGETQSTAT, 0, state)
    except SysError as exc:
        return f"quotactl: {exc.stderr}"
    if not int.from_bytes(state.raw[2:4], sys.byteorder) & FS_QUOTA_PDQ_ENFD:
        return "project quotas are not enforced (not mounted with prjquota or pquota)"
    return ""


def project_usage(path: str, project: int) -> tuple[int, int]:
    """The bytes and inodes of files with this project id on path's file system."""
    q = Dqblk()
    quotactl(path, Q_GETQUOTA, project, ctypes.byref(q))
    return q.curspace, q.curinodes


def project_limit(path: str, project: int, limit: tuple[int, int] | None) -> None:
    """Set the project's hard limits (bytes, inodes), or clear them (None).  Idempotent."""
    q = Dqblk(valid=QIF_LIMITS)
    if limit is not None:       # 0 would mean no limit at all: one block and one inode at least
        q.bhardlimit, q.ihardlimit = max(1, limit[0] >> 10), max(1, limit[1])
    quotactl(path, Q_SETQUOTA, project, ctypes.byref(q))


def project_mark(folders: list[str], project: int) -> None:
    """Give each folder the project id, inherited by all made in it (0: neither).
    Idempotent."""
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            attr = bytearray(fcntl.ioctl(fd, FS_IOC_FSGETXATTR, bytes(28)))
            flags = int.from_bytes(attr[0:4], sys.byteorder) & ~FS_XFLAG_PROJINHERIT
            attr[0:4] = (flags | (FS_XFLAG_PROJINHERIT if project else 0)).to_bytes(
                4, sys.byteorder)
            attr[12:16] = project.to_bytes(4, sys.byteorder)
            fcntl.ioctl(fd, FS_IOC_FSSETXATTR, bytes(attr))
        finally:
            os.close(fd)


def mem_total() -> int:
    """The machine's RAM in bytes (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise SysError("read /proc/meminfo", errno.EIO, "no MemTotal")


def cgroup_own_groups(cgroups: str | None = None,
                      mountinfo: str | None = None) -> tuple[str | None, dict[str, str]]:
    """This process's own group: in the v2 hierarchy (a path under its mount, or None) and in
    each v1 hierarchy that carries one of CGROUP_CONTROLLERS (controller -> path).  From
    /proc/self/cgroup and /proc/self/mountinfo, or from their texts."""
    if cgroups is None:
        with open("/proc/self/cgroup") as f:
            cgroups = f.read()
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    own_v2, own_v1 = None, {}
    for line in cgroups.splitlines():
        hier, ctrls, path = line.split(":", 2)
        if hier == "0" and not ctrls:
            own_v2 = path
        for ctrl in ctrls.split(","):
            own_v1[ctrl] = path
    v2, v1 = None, {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, (fstype, _, options) = left.split(), right.split()[:3]
        root, point = fields[3], fields[4].replace("\\040", " ")
        if fstype == "cgroup2" and own_v2 is not None and v2 is None:
            v2 = point + _cgroup_rel(own_v2, root)
        elif fstype == "cgroup":
            for ctrl in CGROUP_CONTROLLERS:
                if ctrl in options.split(",") and ctrl in own_v1 and ctrl not in v1:
                    v1[ctrl] = point + _cgroup_rel(own_v1[ctrl], root)
    return v2, v1


def _cgroup_rel(path: str, root: str) -> str:
    """A group path from /proc/self/cgroup as seen below a mount whose root is `root`."""
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return path.rstrip("/")


def cgroup_write(group: str, name: str, value: str) -> None:
    """Write one control file of a group; SysError says which and why."""
    try:
        with open(os.path.join(group, name), "w") as f:
            f.write(value)
    except OSError as exc:
        raise SysError(f"write {value} to {group}/{name}", exc.errno or errno.EIO,
                       exc.strerror or "") from None


def cgroup_read(group: str, name: str) -> str:
    """A control file's text, or "" when the group or the file is gone."""
    try:
        with open(os.path.join(group, name)) as f:
            return f.read()
    except OSError:
        return ""


def cgroup_count(text: str, key: str) -> int:
    """A `key N` line of a flat-keyed file (memory.events, memory.oom_control, cgroup.events)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and is_digits(parts[1]):
            return int(parts[1])
    return 0


class Cgroups:
    """The tasks' groups of one BOX_HOME.  Verbs beside their inverses, each idempotent:
    start/stop (the parent groups), create/remove (a task's groups), freeze/thaw; then kill,
    oom_kills and leftovers.  Loop thread."""

    def __init__(self, home: str) -> None:
        self.name = "gurt-" + hashlib.sha1(home.encode()).hexdigest()[:12]
        self.v2: str | None = None            # the tasks' parent group in the v2 hierarchy
        self.v1: dict[str, str] = {}          # controller -> the tasks' parent group in v1
        self.v2_limits: set[str] = set()      # controllers its task groups have (pure v2)
        self.unbounded = ""                   # why tasks cannot be bounded here, if so

    def start(self) -> None:
        """Find gurtd's own groups and make the tasks' parent groups below them.  What cannot
        be made (a read-only cgroupfs) is logged and left out: tasks then run untracked there
        and are still ended by uid."""
        own_v2, own_v1 = cgroup_own_groups()
        if own_v2 is not None and os.path.isdir(own_v2):
            try:
                self.v2 = os.path.join(own_v2, self.name)
                os.makedirs(self.v2, exist_ok=True)
                self.v2_limits = self._v2_delegate(own_v2)
                if "cpu" in self.v2_limits:
                    cgroup_write(self.v2, "cpu.weight", str(int(100 * TASKS_CPU_SHARE)))
            except (OSError, SysError) as exc:
                log(3, f"cgroups: no v2 group for tasks: {exc}")
                self.v2, self.v2_limits = None, set()
        for ctrl in CGROUP_CONTROLLERS:
            if ctrl in own_v1 and ctrl not in self.v2_limits and os.path.isdir(own_v1[ctrl]):
                try:
                    os.makedirs(os.path.join(own_v1[ctrl], self.name), exist_ok=True)
                    self.v1[ctrl] = os.path.join(own_v1[ctrl], self.name)
                except OSError as exc:
                    log(3, f"cgroups: no {ctrl} group for tasks: {exc}")
        try:
            if "cpu" in self.v1:
                own = int(cgroup_read(os.path.dirname(self.v1["cpu"]), "cpu.shares") or 1024)
                cgroup_write(self.v1["cpu"], "cpu.shares",
                             str(max(2, int(own * TASKS_CPU_SHARE))))
            if "memory" in self.v1:           # children count in their parent (default on)
                cgroup_write(self.v1["memory"], "memory.use_hierarchy", "1")
        except SysError as exc:
            log(4, f"cgroups: {exc}")
        limits = [f"{c} (v2)" for c in sorted(self.v2_limits)] + [f"{c} (v1)" for c in self.v1]
        log(6, f"cgroups: tasks tracked in {self.tracking_parent() or 'no group (by uid only)'}; "
               f"limits: {', '.join(limits) or 'none'}")
        missing = [c for c in ("pids", "memory") if c not in self.v2_limits and c not in self.v1]
        if missing:
            self.unbounded = (
                f"no {' and '.join(missing)} controller for tasks in gurtd's cgroup "
                f"{own_v2 or '(none)'}: it is not delegated; run gurtd as gurtd.service "
                f"(Delegate=yes) or under `systemd-run --scope -p Delegate=yes`")
            log(3, f"cgroups: {self.unbounded}; no task will start rather than run unbounded")

    def _v2_delegate(self, own: str) -> set[str]:
        """Enable pids, memory and cpu for gurtd's children on a pure v2 host.  A group with
        controllers for its children may hold no process itself, so gurtd moves itself and the
        spawner into a leaf of its own group first (the processes of a systemd service with
        Delegate=yes are all gurtd's)."""
        wanted = set(CGROUP_CONTROLLERS) & set(cgroup_read(own, "cgroup.controllers").split())
        if not wanted:
            return set()
        enable = " ".join("+" + c for c in sorted(wanted))
        try:
            if not set(cgroup_read(own, "cgroup.subtree_control").split()) >= wanted:
                try:
                    cgroup_write(own, "cgroup.subtree_control", enable)
                except SysError as exc:
                    if exc.code != errno.EBUSY:
                        raise
                    leaf = os.path.join(own, "gurtd")
                    os.makedirs(leaf, exist_ok=True)
                    for pid in [os.getpid()] + self._children(os.getpid()):
                        cgroup_write(leaf, "cgroup.procs", str(pid))
                    cgroup_write(own, "cgroup.subtree_control", enable)
            cgroup_write(self.v2 or "", "cgroup.subtree_control", enable)
        except (SysError, OSError) as exc:
            log(4, f"cgroups: no v2 limits ({exc}); tasks are tracked, not bounded, there")
            return set()
        return wanted

    @staticmethod
    def _children(pid: int) -> list[int]:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def stop(self) -> None:
        """Remove the parent groups when no task group is left in them."""
        for group in [self.v2] + list(self.v1.values()):
            if group:
                try:
                    os.rmdir(group)
                except OSError as exc:
                    log(4, f"cgroups: {group} kept: {exc.strerror}")

    def tracking_parent(self) -> str | None:
        """Where a task's processes are tracked: the v2 group, else the v1 pids group."""
        return self.v2 or self.v1.get("pids")

    def groups(self, task_id: str) -> list[str]:
        return [os.path.join(p, task_id) for p in [self.v2] + list(self.v1.values()) if p]

    def create(self, task_id: str, limits: dict[str, int]) -> list[str]:
        """Make the task's groups with its limits; the files its sandbox writes itself into
        (the v1 ones: the spawner starts it in its v2 group, Spawner).  The v1 `tasks` file,
        not cgroup.procs: the sandbox writes "0" while it is one thread (a child of the
        single-threaded spawner that has started none), so its thread is the whole process,
        and the kernel (6.0+) moves the writer's own thread without cgroup_threadgroup_rwsem,
        whose write lock waits for an RCU grace period (the first cgroup.procs write of a
        start took ~10 ms here, the `tasks` write ~0.15 ms; older kernels lock as before)."""
        values = {"pids": [("pids.max", str(limits["processes"]))],
                  "memory": [("memory.limit_in_bytes", str(limits["memoryBytes"])),
                             ("memory.memsw.limit_in_bytes", str(limits["memoryBytes"]))],
                  "cpu": []}
        v2_values = {"pids": [("pids.max", str(limits["processes"]))],
                     "memory": [("memory.max", str(limits["memoryBytes"])),
                                ("memory.swap.max", "0"), ("memory.oom.group", "1")],
                     "cpu": []}
        if self.unbounded:
            raise SysError("limits", errno.EOPNOTSUPP, self.unbounded)
        made = []
        try:
            if self.v2:
                made.append(self._make(os.path.join(self.v2, task_id),
                                       [v for c in sorted(self.v2_limits) for v in v2_values[c]]))
            for ctrl, parent in self.v1.items():
                made.append(self._make(os.path.join(parent, task_id), values[ctrl]))
        except (SysError, OSError):
            self.remove(task_id)
            raise
        log(7, f"cgroups: {task_id} in {', '.join(made)}")
        return [os.path.join(g, "tasks") for g in made[bool(self.v2):]]

    def v2_group(self, task_id: str) -> str | None:
        """The task's v2 group, where the spawner starts its worker (None without one)."""
        return os.path.join(self.v2, task_id) if self.v2 else None

    @staticmethod
    def _make(group: str, values: list[tuple[str, str]]) -> str:
        os.makedirs(group, exist_ok=True)
        for name, value in values:
            if os.path.exists(os.path.join(group, name)):   # memsw, swap: only if present
                cgroup_write(group, name, value)
        return group

    def remove(self, task_id: str, timeout: float = 2.0) -> None:
        """Remove the task's (emptied) groups; SysError if one still holds a process.

        An emptied group may refuse rmdir (EBUSY) for a moment while its last tasks finish
        dying (measured on 6.18 under load), and a sandbox that was still joining may have
        come in: kill what is listed and try again, for at most timeout seconds."""
        deadline = time.monotonic() + timeout
        for group in self.groups(task_id):
            while True:
                try:
                    os.rmdir(group)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise SysError(f"rmdir {group}", exc.errno or errno.EIO,
                                       exc.strerror or "") from None
                for name in ("cgroup.threads", "tasks"):
                    for tid in cgroup_read(group, name).split():
                        try:
                            os.kill(int(tid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                time.sleep(0.005)

    def freeze(self, task_id: str) -> bool:
        """Pause every process of the task (cgroup.freeze); False without a v2 group."""
        return self._freeze(task_id, "1")

    def thaw(self, task_id: str) -> bool:
        return self._freeze(task_id, "0")

    def _freeze(self, task_id: str, value: str) -> bool:
        if not self.v2 or not os.path.exists(os.path.join(self.v2, task_id, "cgroup.freeze")):
            return False
        try:
            cgroup_write(os.path.join(self.v2, task_id), "cgroup.freeze", value)
        except SysError as exc:
            log(3, f"cgroups: {exc}; signals instead")
            return False
        return True

    def kill(self, task_id: str, timeout: float = 5.0) -> bool:
        """SIGKILL every thread of the task and wait until its group is empty; False if it
        has no group (then only its uid finds its processes).  Idempotent.

        v2: cgroup.kill (no fork can race it) until cgroup.events says `populated 0`, and
        kill(2) of each thread listed: cgroup.kill misses a process whose main thread exited
        while another runs (measured on 6.18), kill(2) of any of its threads does not.
        v1 only: kill(2) of each thread in the pids group's `tasks` until none is left."""
        parent = self.tracking_parent()
        group = os.path.join(parent, task_id) if parent else ""
        if not parent or not os.path.isdir(group):
            return False
        deadline = time.monotonic() + timeout
        v2 = parent == self.v2 and os.path.exists(os.path.join(group, "cgroup.kill"))
        while True:
            if v2:
                if not cgroup_count(cgroup_read(group, "cgroup.events"), "populated"):
                    return True
                cgroup_write(group, "cgroup.kill", "1")
            left = cgroup_read(group, "cgroup.threads" if v2 else "tasks").split()
            if not v2 and not left:
                return True
            for tid in left:
                try:
                    os.kill(int(tid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise SysError(f"kill cgroup {group}", errno.EBUSY, f"processes left: {left}")
            time.sleep(0.002)

    def oom_kills(self, task_id: str) -> int:
        """How many processes of the task the kernel killed for want of memory."""
        if "memory" in self.v2_limits and self.v2:
            return cgroup_count(cgroup_read(os.path.join(self.v2, task_id), "memory.events"),
                                "oom_kill")
        if "memory" in self.v1:
            return cgroup_count(cgroup_read(os.path.join(self.v1["memory"], task_id),
                                            "memory.oom_control"), "oom_kill")
        return 0

    def leftovers(self) -> list[str]:
        """Task groups under the parents: what earlier tasks of this BOX_HOME left."""
        out: set[str] = set()
        for parent in [self.v2] + list(self.v1.values()):
            if parent and os.path.isdir(parent):
                out.update(n for n in os.listdir(parent)
                           if ID_RE.fullmatch(n) and os.path.isdir(os.path.join(parent, n)))
        return sorted(out)


@dataclass
class LogCap:
    """A running task's log up to its logBytes; past it lines are counted, not stored (state
    changes and approvals always are), and one line at the end says how many."""

    limit: int
    size: int = 0
    dropped_lines: int = 0
    dropped_bytes: int = 0

    def admit(self, kind: Any, size: int) -> bool:
        if kind not in ("state", "approval") and \
                (self.dropped_lines or self.size + size > self.limit):
            self.dropped_lines += 1
            self.dropped_bytes += size
            return False
        self.size += size
        return True

    def note(self) -> dict[str, Any] | None:
        """The final log line, or None when nothing was dropped."""
        if not self.dropped_lines:
            return None
        return {"type": "log", "droppedLines": self.dropped_lines,
                "droppedBytes": self.dropped_bytes,
                "text": f"{self.dropped_lines} lines ({self.dropped_bytes} bytes) not stored: "
                        f"the log reached its limit of {self.limit} bytes"}


@dataclass
class LayerQuota:
    """A running task's layer as a project: its id, its folders, the hard limits set (bytes,
    inodes), its usage when they were set, and the free space (bytes, inodes) below which it
    may not write (the reserve; half the free space once a person let it write on)."""

    project: int
    folders: list[str]
    limit: tuple[int, int] = (0, 0)
    used: tuple[int, int] = (0, 0)
    floor: tuple[int, int] | None = None


class DiskReserve:
    """BOX_HOME's free space against diskReserveBytes.  Below the reserve the running task that
    wrote most (its layer's upper, measured off the loop thread) is frozen with an approval of
    kind `disk`: approved, it goes on and is not paused again until free space has halved;
    denied, it fails with `disk full: <reason>`.  With project quotas (above) each task's
    layer has hard limits too, moved at each check, and a task at its limit is asked about
    the same way; the poll covers those tasks as well (should a limit not hold).  Loop
    thread, but for the walk."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.next_check = 0.0
        self.walking = False
        self.paused_free: int | None = None      # free bytes when the last task was paused
        self.quotas = False                      # BOX_HOME enforces project quotas
        self.layers: dict[str, LayerQuota] = {}  # task id -> its layer's project

    def start(self) -> None:
        """Find out whether BOX_HOME's file system enforces project quotas, and say so."""
        missing = project_quotas_missing(self.box.path())
        self.quotas = not missing
        log(6, "disk: each task's layer has a project quota on BOX_HOME (hard limits: its "
               "share of what the reserve leaves)" if self.quotas else
               f"disk: no project quotas on BOX_HOME ({missing}): free space is polled every "
               f"{DISK_CHECK_INTERVAL} s, and a task can pass the reserve between two polls")

    def limit_layer(self, task: Task, folders: list[str]) -> None:
        """Before the task starts: its layer's folders (fresh and empty) become its project,
        limited to its share of what the reserve leaves; the others' shares shrink first."""
        if not self.quotas:
            return
        self.layers[task.id] = layer = LayerQuota(task.uid, folders)
        try:
            project_mark(folders, task.uid)
            for other in [x for x in self.layers.values() if x is not layer] + [layer]:
                used, room = self.room(other)
                self.limit(other, used, self.share(room))
        except BaseException:
            self.unlimit(task)
            raise

    def unlimit(self, task: Task) -> None:
        """The task ended: no limit and no inheriting mark on its layer.  Idempotent."""
        layer = self.layers.pop(task.id, None)
        if layer is None:
            return
        try:
            project_limit(self.box.path(), layer.project, None)
            project_mark([f for f in layer.folders if os.path.isdir(f)], 0)
        except (OSError, SysError) as exc:
            log(3, f"task {task.id}: cannot clear the project quota {layer.project}: {exc}")

    def share(self, room: tuple[int, int]) -> tuple[int, int]:
        """One layer's part of the room: each running task with a layer gets as much (an idle
        one's part waits for it; a writer's limit moves up at each check by what it wrote
        less its part of that)."""
        return room[0] // len(self.layers), room[1] // len(self.layers)

    def room(self, layer: LayerQuota) -> tuple[tuple[int, int], tuple[int, int]]:
        """The layer's usage and the free space above its floor (bytes, inodes)."""
        st = os.statvfs(self.box.path())
        floor = layer.floor or (
            disk_reserve(self.box.setting("diskReserveBytes"), st.f_blocks * st.f_frsize),
            inode_reserve(st.f_files))
        return project_usage(self.box.path(), layer.project), \
            (st.f_bavail * st.f_frsize - floor[0], st.f_favail - floor[1])

    def limit(self, layer: LayerQuota, used: tuple[int, int], room: tuple[int, int]) -> None:
        """Limits of usage plus the room, or plus a step where there is less (a task may
        write a step into the reserve before the next check pauses it: its overlay needs a
        few blocks to mount at all); set when they shrink or grow by a step."""
        new = (used[0] + max(room[0], DISK_STEP), used[1] + max(room[1], QUOTA_INODE_STEP))
        old = layer.limit
        if new[0] < old[0] or new[1] < old[1] or new[0] >= old[0] + DISK_STEP or \
                new[1] >= old[1] + QUOTA_INODE_STEP:
            project_limit(self.box.path(), layer.project, new)
            layer.used, layer.limit = used, new

    def check_layers(self) -> None:
        """Each running task's limits follow the free space (its usage and its share of the
        room); a task that wrote since its limits were set, up to a step of them, while less
        than a step is left above the floor is paused and asked about.  At its limit only:
        free space dips while a refused fallocate is in the kernel (ext4 takes a whole
        extent's 32,767 blocks, its delayed_allocation_blocks, before it trims the request to
        the quota: 32 MiB on 1 KiB blocks, measured on 6.1 and 6.12), and a task that merely
        wrote then is no cause."""
        box = self.box
        for task_id, layer in list(self.layers.items()):
            task, worker = box.task(task_id), box.worker(task_id)
            if task is None or worker is None or task.state not in ("running", "waiting") or \
                    "disk" in worker.holds:
                continue
            try:
                used, room = self.room(layer)
                if not any(u > was and u + step > lim and r < step
                           for u, was, lim, r, step in zip(used, layer.used, layer.limit, room,
                                                           (DISK_STEP, QUOTA_INODE_STEP))):
                    self.limit(layer, used, self.share(room))
                    continue
            except (OSError, SysError) as exc:     # polled from now on, as without quotas
                log(3, f"task {task_id}: cannot set its project quota: {exc}")
                self.unlimit(task)
                continue
            self.pause(task, worker, used[0], *self.free_and_reserve())

    def tick(self) -> float:
        """Check the free space while tasks run; seconds until the next check."""
        box = self.box
        if next(box.all_workers(), None) is None:
            return 1.0
        now = time.monotonic()
        if now < self.next_check:
            return self.next_check - now
        self.next_check = now + DISK_CHECK_INTERVAL
        if self.layers:
            self.check_layers()
        free, reserve = self.free_and_reserve()
        if free >= reserve:
            self.paused_free = None
            return DISK_CHECK_INTERVAL
        held = any("disk" in w.holds for w in box.all_workers())
        if held and self.paused_free is not None and free > self.paused_free - DISK_STEP:
            return DISK_CHECK_INTERVAL         # nothing else is eating the disk
        candidates = [(w.task_id, box.layer_dir(w.task_id)) for w in box.all_workers()
                      if box.get(w.task_id).state in ("running", "waiting") and
                      "disk" not in w.holds and free < w.disk_floor]
        if candidates and not self.walking:
            self.walking = True
            threading.Thread(target=self._measure, args=(candidates,), name="disk",
                             daemon=True).start()
        return DISK_CHECK_INTERVAL

    def free_and_reserve(self) -> tuple[int, int]:
        """Free bytes and the reserve.  Inodes count too (a task making empty files runs out
        of inodes long before bytes): each free inode is worth reserve / inode reserve bytes,
        and free space is the smaller of the two."""
        st = os.statvfs(self.box.path())
        reserve = disk_reserve(self.box.setting("diskReserveBytes"), st.f_blocks * st.f_frsize)
        free = st.f_bavail * st.f_frsize
        inodes = inode_reserve(st.f_files)
        if inodes:
            free = min(free, st.f_favail * (reserve // inodes))
        return free, reserve

    def inode_room(self) -> int:
        """Free inodes above the inode reserve (LIMIT_MAX on a file system without inodes)."""
        st = os.statvfs(self.box.path())
        return st.f_favail - inode_reserve(st.f_files) if st.f_files else LIMIT_MAX

    def inode_bytes(self) -> int:
        """What one inode is worth against the reserve (0 on a file system without inodes)."""
        st = os.statvfs(self.box.path())
        inodes = inode_reserve(st.f_files)
        return disk_reserve(self.box.setting("diskReserveBytes"),
                            st.f_blocks * st.f_frsize) // inodes if inodes else 0

    def _measure(self, candidates: list[tuple[str, str]]) -> None:
        sizes = {task_id: tree_usage(os.path.join(path, "upper"))
                 for task_id, path in candidates}
        self.box.loop.post(self.on_sizes, sizes)

    def on_sizes(self, sizes: dict[str, tuple[int, int]]) -> None:
        """Back on the loop thread: pause the biggest writer (bytes, and each inode at its
        worth against the reserve) still running, if still short.  A task with a layer quota
        only if its upper holds more bytes or more inodes than its limits (files its project
        does not count), each against its own: else the kernel holds it, and another's
        approved writes, or a refused fallocate's dip, are no cause."""
        self.walking = False
        box = self.box
        free, reserve = self.free_and_reserve()
        if free >= reserve:
            return
        per_inode = self.inode_bytes()
        weights = {task_id: used + inodes * per_inode for task_id, (used, inodes) in sizes.items()}
        for task_id, weight in sorted(weights.items(), key=lambda kv: -kv[1]):
            task, worker = box.task(task_id), box.worker(task_id)
            layer = self.layers.get(task_id)
            if task is None or worker is None or task.state not in ("running", "waiting") or \
                    "disk" in worker.holds or free >= worker.disk_floor or (
                        layer and all(u <= lim for u, lim in zip(sizes[task_id], layer.limit))):
                continue
            self.pause(task, worker, weight, free, reserve)
            return

    def pause(self, task: Task, worker: "Worker", size: int, free: int, reserve: int) -> None:
        log(4, f"task {task.id} paused: {free} bytes free in {self.box.path()}, reserve {reserve}")
        self.paused_free = free
        worker.disk_wait = self.box.pause_and_ask(
            task, worker, "disk", "disk full", "disk", "disk",
            {"bytes": size, "freeBytes": free, "reserveBytes": reserve,
             "freeInodes": os.statvfs(self.box.path()).f_favail},
            0, f"The task has written {size} bytes and the disk of BOX_HOME has {free} bytes "
               f"free, at the reserve of {reserve} bytes. Let it write on?")

    def on_approval(self, approval: Approval) -> None:
        """Approved: thaw, and no new pause until free space halves; denied: the task fails."""
        box = self.box
        task, worker = box.task(approval.task), box.worker(approval.task)
        if task is None or worker is None or worker.disk_wait != approval.id:
            return
        worker.disk_wait = None
        if approval.state == "approved":
            worker.disk_floor = self.free_and_reserve()[0] // 2
            if task.id in self.layers:
                st = os.statvfs(box.path())
                self.layers[task.id].floor = (st.f_bavail * st.f_frsize // 2, st.f_favail // 2)
            box.unhold(task, worker, "disk")
            return
        if approval.answeredBy == "api":
            box.fail_task(task, f"disk full: {approval.reason or 'denied'}")


# Spawner #######################################################################################
###############################################################################################
# HTTP threads make fork unsafe in gurtd itself (locks held by other threads stay held in the
# child).  So gurtd forks this spawner before any thread starts; it stays single-threaded,
# forks each worker on request and reports each exit.  It dies with gurtd (pdeathsig), is a
# subreaper (orphans of tasks are reaped here), and workers die with it.  It lives in a mount
# namespace of its own, where the tmpfs of the tasks' broker socket is attached (Broker.mount).
# It holds the tool client's read-only tmpfs, detached, for the workers (_tool_mount_make).
# A worker is born in its task's v2 group: clone3(CLONE_INTO_CGROUP) (Linux 5.7) as a fork, so
# that no process of a task ever runs outside its group and the start writes no cgroup.procs.
# Where clone3 is refused (systemd's RestrictNamespaces= filter answers it ENOSYS: it cannot
# read clone3's flags, so gurtd.service sets none), the worker is forked and writes itself into
# cgroup.procs first thing; the start probes once and says which way it takes.
# GURT_CLONE_INTO_CGROUP=no forces the fork.

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_CAP_AMBIENT = 1, 36, 47
SYS_CLONE3, CLONE_INTO_CGROUP = 435, 0x200000000
CLONE3_ENV = "GURT_CLONE_INTO_CGROUP"


class _CloneArgs(ctypes.Structure):
    """struct clone_args up to its cgroup field (CLONE_ARGS_SIZE_VER2, 88 bytes)."""
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size",
        "tls", "set_tid", "set_tid_size", "cgroup")]


_PYAPI: ctypes.PyDLL | None = None


def fork_into(cgroup_fd: int, hooks: bool = True) -> int:
    """os.fork, the child born in the v2 group of cgroup_fd; OSError as clone3 says.

    As os.fork does: PyOS_BeforeFork, the call with the GIL held (a PyDLL keeps it), then
    PyOS_AfterFork_Child or _Parent (locks, threading state, os.register_at_fork hooks).  Safe
    only in a single-threaded process, as a fork is: the spawner.  stack 0 is fork's way (the
    child goes on on a copy of this stack).

    hooks=False, the spawner's way for a worker: none of that bookkeeping, which in a process
    of one thread that is not importing has nothing to mend (no lock is held by another
    thread, the import lock is free, the one thread keeps its ident) and whose hooks
    (threading's, random's reseed, logging's and concurrent.futures' locks) touched ~220
    pages of the child's copy of the spawner, each a copy-on-write fault (~0.9 ms of a
    worker's CPU here).  A worker uses none of those modules; it execs or exits."""
    global _PYAPI
    if _PYAPI is None:
        _PYAPI = ctypes.PyDLL(None, use_errno=True)
        _PYAPI.syscall.restype = ctypes.c_long
    args = _CloneArgs(flags=CLONE_INTO_CGROUP, exit_signal=signal.SIGCHLD, cgroup=cgroup_fd)
    if hooks:
        _PYAPI.PyOS_BeforeFork()
    pid = _PYAPI.syscall(ctypes.c_long(SYS_CLONE3), ctypes.byref(args),
                         ctypes.c_size_t(ctypes.sizeof(args)))
    err = ctypes.get_errno()
    if pid == 0:
        if hooks:
            _PYAPI.PyOS_AfterFork_Child()
        return 0
    if hooks:
        _PYAPI.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone3: {os.strerror(err)}")
    return int(pid)


class Spawner:
    """The parent side.  Methods for the loop thread: start, spawn, exits, stop."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.pid = 0
        self._exits: list[tuple[int, int]] = []

    def start(self, close: tuple[int, ...] = (), broker: tuple[int, str] | None = None) -> None:
        """Fork the spawner; it closes the fds in close (the BOX_HOME lock: a task must
        never hold it, or the next start would wait for the task), and attaches the mount fd
        of broker at its path in a mount namespace of its own (Broker.mount)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            parent.close()
            for fd in close:
                os.close(fd)
            code = 0
            try:
                if broker is not None:
                    _spawner_namespace(*broker)
                _tool_mount_make(os.path.abspath(__file__))
                _spawner_main(child)
            except BaseException:
                code = 1
            os._exit(code)
        child.close()
        self.sock, self.pid = parent, pid

    def spawn(self, spec: dict[str, Any], fds: list[int], group: str | None = None) -> int:
        """Fork a worker, in the v2 group `group` if given; spec travels in a memfd (it holds
        the prompt), fds follow it."""
        return int(self._ask([b"spawn"], spec, fds, group)["pid"])

    def probe(self, group: str) -> dict[str, Any]:
        """Start a child in `group` that exits at once, the way workers will start: the way
        taken ("clone3" or "fork"), why not clone3, and the microseconds it took."""
        return self._ask([b"probe"], {}, [], group)

    def _ask(self, kind: list[bytes], spec: dict[str, Any], fds: list[int],
             group: str | None) -> dict[str, Any]:
        assert self.sock is not None
        memfd = os.memfd_create("gurt-spec", os.MFD_CLOEXEC)
        cgroup_fd = -1
        try:
            os.write(memfd, json.dumps(spec).encode())
            if group is not None:
                cgroup_fd = os.open(group, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                kind = [kind[0] + b" into"]
            socket.send_fds(self.sock, kind, [memfd] + fds + [cgroup_fd] * (cgroup_fd >= 0))
        finally:
            os.close(memfd)
            if cgroup_fd >= 0:
                os.close(cgroup_fd)
        while True:
            msg = self._recv(block=True)
            if "pid" in msg:
                return msg
            if "error" in msg:
                raise SysError("spawn", errno.EIO, msg["error"])

    def exits(self) -> list[tuple[int, int]]:
        """(pid, exit code) of every child that ended since the last call; never blocks."""
        while self._recv(block=False):
            pass
        out, self._exits = self._exits, []
        return out

    def _recv(self, block: bool) -> dict[str, Any]:
        assert self.sock is not None
        try:
            data = self.sock.recv(65536, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return {}
        if not data:
            raise SysError("spawner", errno.EPIPE, "the spawner is gone")
        msg = json.loads(data)
        if "exit" in msg:
            self._exits.append((int(msg["exit"]), int(msg["code"])))
        return msg

    def stop(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = 0


# The spawner's, where gurtd's root is private: the detached tmpfs of the broker socket, which
# each worker clones the socket from (_broker_open)
_BROKER_MOUNT = -1


def root_shared() -> bool:
    """Whether this mount namespace's root propagates (shared: systemd makes it so)."""
    shared = False
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:                    # the last mount on / is the root seen
            fields = line.split(b" - ")[0].split()
            if fields[4] == b"/":
                shared = any(tag.startswith(b"shared:") for tag in fields[6:])
    return shared


def _spawner_namespace(mount_fd: int, point: str) -> None:
    """Where gurtd's root is shared (systemd's hosts): a mount namespace of the spawner's own,
    a slave of gurtd's (what the host mounts later still comes in), with the detached mount_fd
    attached at point: every worker's namespace is a copy of this one, so a worker binds the
    socket from that mount on any kernel, and neither gurtd's namespace nor the host's shows
    it.  On a private root (a host without systemd) such a copy would miss a disk mounted
    after the start, so the spawner only keeps mount_fd for the workers (_broker_open)."""
    global _BROKER_MOUNT
    if not root_shared():
        _BROKER_MOUNT = mount_fd
        return
    libc_call("unshare", CLONE_NEWNS)
    _mount("none", "/", None, MS_REC | MS_SLAVE, None)
    syscall("move_mount", SYS_MOVE_MOUNT, mount_fd, b"", -100, point.encode(),
            MOVE_MOUNT_F_EMPTY_PATH)
    os.close(mount_fd)


# The spawner's: the detached read-only tmpfs of the tool client (_tool_mount_make), or -1
_TOOL_MOUNT = -1


def _tool_mount_make(module: str) -> None:
    """The tool client once for every worker: a detached tmpfs holding module as gurtd.py,
    made read-only (its superblock and its mount), which each worker binds at /run/gurt/lib
    where the kernel clones a detached mount into a fresh namespace (Linux 6.15+), where a
    copy of the 0.9 MB module per task was most of what its root wrote.  Anything refused
    leaves none (-1): the workers copy the module, as they do where the clone is refused."""
    global _TOOL_MOUNT
    if os.environ.get(NO_DETACHED_CLONE_ENV):
        return
    fs = mount_fd = source = -1
    try:
        source = os.open(module, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(source).st_size + (64 << 10)
        fs = syscall("fsopen", SYS_FSOPEN, b"tmpfs", 1)
        for key, value in ((b"source", b"gurt-tool"), (b"mode", b"0755"),
                           (b"size", str(size).encode()), (b"nr_inodes", b"8")):
            syscall("fsconfig tmpfs", SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key, value, 0)
        syscall("fsconfig create", SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0)
        mount_fd = syscall("fsmount", SYS_FSMOUNT, fs, 1, MOUNT_ATTR_NOSUID |
                           MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
        source, module_fd = -1, source                   # _file_copy closes it
        _file_copy(module_fd, f"/proc/self/fd/{mount_fd}/gurtd.py")
        os.close(fs)
        fs = -1                                          # a refused fspick: not closed twice
        fs = syscall("fspick", SYS_FSPICK, mount_fd, b"", FSPICK_CLOEXEC | FSPICK_EMPTY_PATH)
        syscall("fsconfig ro", SYS_FSCONFIG, fs, FSCONFIG_SET_FLAG, b"ro", None, 0)
        syscall("fsconfig reconfigure", SYS_FSCONFIG, fs, FSCONFIG_CMD_RECONFIGURE, None,
                None, 0)
        _mount_attrs(mount_fd, "", MOUNT_ATTR_RDONLY, False)
        _TOOL_MOUNT, mount_fd = mount_fd, -1
    except (OSError, SysError):
        pass
    finally:
        for fd in (fs, mount_fd, source):
            if fd >= 0:
                os.close(fd)


def _spawner_main(sock: socket.socket) -> None:
    libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if os.getppid() == 1:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    way = _SpawnWay()
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, 1024, 17)
            if not msg:
                return
            cgroup_fd = fds.pop() if msg.endswith(b" into") else -1
            started = time.monotonic()
            try:
                pid, joined = way.fork(cgroup_fd)
            except OSError as exc:
                sock.send(json.dumps({"error": f"fork: {exc}"}).encode())
                pid, joined = -1, True
            if pid == 0:
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                if not joined:
                    _worker_join(cgroup_fd, fds)
                if msg.startswith(b"probe"):
                    os._exit(0)
                sandbox_main(fds)
            for fd in fds + [cgroup_fd] * (cgroup_fd >= 0):
                os.close(fd)
            if pid > 0:
                if msg.startswith(b"probe"):
                    os.waitpid(pid, 0)
                born = "clone3" if joined and cgroup_fd >= 0 else "fork"
                sock.send(json.dumps({"pid": pid, "way": born, "why": way.why,
                                      "us": int((time.monotonic() - started) * 1e6)}).encode())
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                      .encode())


class _SpawnWay:
    """How the spawner starts a worker in its group: clone3(CLONE_INTO_CGROUP) until it is
    refused (ENOSYS, EPERM, EINVAL, E2BIG: the kernel's or the unit's answer, so for good),
    else os.fork and the worker's own cgroup.procs write; another error (ENOMEM, a group
    being removed) forks that one worker only."""

    def __init__(self) -> None:
        self.clone3 = os.environ.get(CLONE3_ENV, "yes") != "no"
        self.why = "" if self.clone3 else f"{CLONE3_ENV}=no"

    def fork(self, cgroup_fd: int) -> tuple[int, bool]:
        """(pid, whether the child is in its group already)."""
        if cgroup_fd >= 0 and self.clone3:
            try:
                return fork_into(cgroup_fd, hooks=False), True
            except OSError as exc:
                if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG):
                    self.clone3, self.why = False, str(exc)
        return os.fork(), cgroup_fd < 0


def _procs_join(procs: str, dir_fd: int | None = None) -> None:
    """This process into the group of the cgroup.procs file procs (relative to dir_fd); or
    this thread, given a v1 `tasks` file (the sandbox's, while it is its process's only
    thread: Cgroups.create)."""
    fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def _worker_join(cgroup_fd: int, fds: list[int]) -> None:
    """The fork way: the worker writes itself into its group before anything else; a worker
    that cannot join ends with the sandbox's error (its output pipe is fds[1])."""
    try:
        _procs_join("cgroup.procs", cgroup_fd)
        os.close(cgroup_fd)
    except OSError as exc:
        if len(fds) > 1:
            os.write(fds[1], (json.dumps({"t": "error", "text": f"sandbox: join its cgroup: "
                                                                f"{exc}"}) + "\n").encode())
        os._exit(125)


# Sandbox #######################################################################################
###############################################################################################
# Runs in a child of the spawner, as root, single-threaded, and never returns.  It builds the
# task's box from nothing and becomes the box user:
#   own mount, network and IPC namespaces (a task with hosts gets gurtd's network namespace
#   at its gate); / made rslave first (rprivate would pin gurtd's
#   unmounts, and nothing the box mounts may reach the host);
#   the view: an overlay of the layers over the base, on an idmapped clone of BOX_HOME that maps
#   the store user to the task user and 0 to 0 (without 0, overlay cannot make its work dir);
#   a new root, a small tmpfs that holds only what the box is given:
#     /usr read-only; /bin, /lib, /lib64, /sbin as on the host (symlinks into usr, or
#     read-only binds where the host has real directories);
#     /etc read-only: an overlay of the host's /etc under a layer that removes its secrets
#     (ETC_HIDDEN: they do not exist inside) and puts gurtd's resolver in resolv.conf;
#     a minimal /dev (null, zero, full, random, urandom, tty, a pts instance of its own, shm);
#     a fresh /proc with hidepid=invisible; no /sys (nothing a worker runs needs it);
#     /run/gurt: the view, the broker socket, the `gurtd` tool client, droid, prompt files;
#     /tmp, /var/tmp, /dev/shm and HOME: four folders of one tmpfs of spec["tmpBytes"];
#   pivot_root into it and detach the host's root: /srv, /var, /opt, /home, /root, /mnt,
#   BOX_HOME and every other host path do not exist inside;
#   the gate: gurtd's word that the task may begin, while it built all of the above (a task
#   with hosts enters its namespace there); lo up; no capabilities, no new privileges; the
#   kernel filter (next section); the worker.
# Every mount of the box is nosuid and nodev (the device binds excepted from nodev).
# What the sandbox uses after pivot_root must be imported before the spawner forks: the host's
# file system, and with it a checkout's virtual environment, is gone by then (sandbox_preload).

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)
CLONE_NEWIPC = 0x08000000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOEXEC = 0x1, 0x8
MS_BIND = 0x1000
CLONE_VM, CLONE_VFORK, WALL = 0x100, 0x4000, 0x40000000
SYS_CLOSE_RANGE, CLOSE_RANGE_CLOEXEC = 436, 0x4
CHILD_STACK = 4096                   # _idmap_userns's child: libc's _exit, a few words of it

NEW_ROOT = "/tmp"                    # where the new root is built: a mount in the worker's own
                                     # namespace only, over the host's /tmp, then pivoted into
DEFAULT_TMP_BYTES = 1 << 30          # /tmp, /var/tmp, /dev/shm and HOME together
USRMERGE = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")   # as on the host, if there
# Removed from the box's /etc (globs, relative to it): password hashes, host and TLS private
# keys, sudo rules, VPN and Wi-Fi secrets, Kerberos keys, systemd credentials.  Most are already
# unreadable to a box user; removing them also hides that they exist.
ETC_HIDDEN = (
    "shadow", "shadow-", "gshadow", "gshadow-", "security/opasswd", "sudoers", "sudoers.d",
    "ssh/ssh_host_*_key", "ssl/private", "*.key", "krb5.keytab", "ipsec.secrets",
    "ppp/*-secrets", "wireguard", "NetworkManager/system-connections", "letsencrypt",
    "credstore", "credstore.encrypted",
)
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")   # bound from the host's /dev
DEV_LINKS = {"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
             "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"}
BOX_RO = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
# the task's resolver is gurtd, on the task's own lo (nothing listens there without hosts)
BOX_RESOLV_CONF = f"nameserver {DNS_ADDR}\noptions timeout:2 attempts:1\n"


def sandbox_preload() -> None:
    """Import what the sandbox uses after pivot_root, and build the kernel filter once.

    Called by serve() before the spawner forks.  Without libseccomp's binding gurtd does not
    start: a box without its kernel filter is not one.
    """
    global _KERNEL_BPF, _NAMESPACE_BPF
    importlib.import_module("prctl")
    try:
        _KERNEL_BPF, _NAMESPACE_BPF = filter_bpf(), filter_bpf(NAMESPACE_REFUSALS)
    except ImportError as exc:
        raise SysError("import seccomp", errno.ENOENT, f"{exc}: install python3-seccomp and "
                       "link it into gurtd's virtual environment (make deps does both)")
    global _ETC_HIDDEN_PLAN
    _ETC_HIDDEN_PLAN = etc_hidden_plan(ETC_HIDDEN)


# ETC_HIDDEN as the workers match it: (folder under /etc, its literal names, one pattern of its
# wildcard names or None), compiled once by sandbox_preload
_ETC_HIDDEN_PLAN: list[tuple[str, tuple[str, ...], re.Pattern[str] | None]] = []


def etc_hidden_plan(patterns: tuple[str, ...]) -> list[tuple[str, tuple[str, ...],
                                                           re.Pattern[str] | None]]:
    """patterns (globs relative to /etc, wildcards in the last part only) by folder: what
    etc_hidden reads, so that a worker lists each folder once where glob.glob ran its Python
    per pattern (~0.8 ms and ~70 page faults of a worker's first touches here)."""
    folders: dict[str, tuple[list[str], list[str]]] = {}
    for pattern in patterns:
        folder, name = os.path.split(pattern)
        if glob.has_magic(folder) or name.startswith("."):
            raise ValueError(f"ETC_HIDDEN: {pattern}: a wildcard folder or a dot name")
        literal, wild = folders.setdefault(folder, ([], []))
        (wild if glob.has_magic(name) else literal).append(name)
    return [(folder, tuple(literal), re.compile("|".join(fnmatch.translate(w) for w in wild))
             if wild else None) for folder, (literal, wild) in folders.items()]


def etc_hidden(plan: list[tuple[str, tuple[str, ...], re.Pattern[str] | None]],
               etc: str = "/etc") -> list[str]:
    """The paths under etc (relative to it) that plan names, as glob.glob finds them: a
    literal name if it exists (a dangling symlink too), a wildcard one among the folder's
    names that do not start with a dot."""
    found = []
    for folder, literal, wild in plan:
        base = os.path.join(etc, folder)
        found += [os.path.join(folder, n) for n in literal
                  if os.path.lexists(os.path.join(base, n))]
        if wild is not None:
            try:
                names = os.listdir(base)
            except OSError:           # no such folder, not a folder: nothing to hide there
                continue
            found += [os.path.join(folder, n) for n in names
                      if not n.startswith(".") and wild.match(n)]
    return found


def sandbox_main(fds: list[int]) -> None:
    out_fd = fds[1] if len(fds) > 1 else 2
    try:
        keep = sorted(set(fds) | {0, 1, 2} | {_BROKER_MOUNT, _TOOL_MOUNT} - {-1})
        for low, high in zip(keep, keep[1:] + [65536]):
            os.closerange(low + 1, high)      # nothing of gurtd's leaks into the box
        for fd in fds[1:]:
            os.set_inheritable(fd, False)
        spec = json.loads(os.pread(fds[0], os.fstat(fds[0]).st_size, 0))
        os.close(fds[0])
        _sandbox_enter(spec, fds)
    except BaseException as exc:  # report and end: this process must never return
        try:
            _emit(out_fd, t="error", text=f"sandbox: {exc}")
        finally:
            os._exit(125)
    try:
        if spec["mode"] == "fake":
            os._exit(_run_fake(spec, out_fd))
        for rel, text in spec.get("homeFiles", {}).items():   # written as the box user
            path = os.path.join(spec["home"], rel)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        code = _run_line(spec["argv"], spec["env"], out_fd)
        _emit(out_fd, t="exit", code=code)
        os._exit(code)
    except BaseException as exc:
        _emit(out_fd, t="error", text=f"worker: {exc}")
    os._exit(126)


def _idmap_userns(uid_map: str, gid_map: str) -> int:
    """A user namespace fd with these maps, without a fork of this process.

    The namespace's child is clone(CLONE_NEWUSER | CLONE_VM | CLONE_VFORK) running libc's
    _exit on a small stack of its own: no Python code in it and no copy of this process's
    memory (a fork of a worker cost ~9 ms of CPU here, this ~0.2 ms).  A zombie keeps its
    credentials, and with them its namespace, until it is reaped: the maps are written to it
    and its ns/user opened, then it is reaped.  Exit signal 0, so that no waitpid(-1) can
    reap it first (__WALL does); all signals blocked meanwhile, so that no handler of this
    process runs in the child on the shared memory."""
    stack = ctypes.create_string_buffer(CHILD_STACK)
    top = (ctypes.addressof(stack) + CHILD_STACK - 64) & ~15
    every, before = ctypes.create_string_buffer(b"\xff" * 128), ctypes.create_string_buffer(128)
    libc().pthread_sigmask(signal.SIG_BLOCK, every, before)     # a sigset_t: 128 bytes
    try:
        pid = libc().clone(ctypes.cast(libc()._exit, ctypes.c_void_p), ctypes.c_void_p(top),
                           CLONE_NEWUSER | CLONE_VM | CLONE_VFORK, None)
        err = ctypes.get_errno()
    finally:
        libc().pthread_sigmask(signal.SIG_SETMASK, before, None)
    if pid < 0:
        raise SysError("clone user namespace", err, os.strerror(err))
    try:
        for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
            fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, text.encode())          # a map is one write
            finally:
                os.close(fd)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.waitpid(pid, WALL)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    libc_call("mount", source.encode(), target.encode(), fstype.encode() if fstype else None,
              ctypes.c_ulong(flags), data.encode() if data else None)


def _mount_attrs(fd: int, path: str, attrs: int, recursive: bool) -> None:
    """Set mount attributes (MOUNT_ATTR_*) on the mount at fd/path, or on its whole tree."""
    attr = MountAttr(attrs, 0, 0, 0)
    flags = (AT_EMPTY_PATH if not path else 0) | (AT_RECURSIVE if recursive else 0)
    syscall("mount_setattr", SYS_MOUNT_SETATTR, fd, path.encode(), flags, ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)))


def _bind(fd: int, path: str, target: str, attrs: int, recursive: bool = False) -> None:
    """Bind what fd/path names (a directory tree or one file) at target, with attrs.

    A clone through open_tree: attributes are set before the mount is visible, so there is
    no moment when a read-only bind is writable.
    """
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0) | \
        (AT_EMPTY_PATH if not path else 0)
    tree = syscall("open_tree", SYS_OPEN_TREE, fd, path.encode(), flags)
    try:
        if attrs:
            _mount_attrs(tree, "", attrs, recursive)
        syscall("move_mount", SYS_MOVE_MOUNT, tree, b"", -100, target.encode(),
                MOVE_MOUNT_F_EMPTY_PATH)
    finally:
        os.close(tree)


def _sandbox_enter(spec: dict[str, Any], fds: list[int]) -> None:
    uid, gid = spec["uid"], spec["gid"]
    for procs in spec.get("cgroups", []):     # tracked and bounded before anything else: v1
        _procs_join(procs)                    # `tasks`, while this is its only thread
    if spec.get("nproc"):                     # per uid, threads too: the cgroup's backup
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    os.setsid()
    if spec.get("netnsAtGate"):   # a task with hosts: gurtd's namespace comes at the gate
        libc_call("unshare", CLONE_NEWNS | CLONE_NEWIPC)
    else:
        libc_call("unshare", CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC)
    _mount("none", "/", None, MS_REC | MS_SLAVE, None)
    view = _view_open(spec)
    folders = folder_overlays_open(spec)      # personal mode: before the host's root goes
    held = {"broker": _broker_open(spec),                   # before the host's root goes
            "module": os.open(spec["module"], os.O_RDONLY | os.O_CLOEXEC)}
    if spec.get("droid") and not _droid_in_usr(spec):
        held["droid"] = os.open(spec["droid"], os.O_PATH | os.O_CLOEXEC)
    _root_build(NEW_ROOT, spec)
    _run_build(NEW_ROOT, spec, view, held)
    folder_overlays_place(NEW_ROOT, folders)
    _mount_attrs(-100, NEW_ROOT, MOUNT_ATTR_RDONLY, False)  # the root's own folders, read-only
    _root_pivot(NEW_ROOT)
    if "gateFd" in spec:                      # the task's user exists; its network is made
        _gate_pass(fds[spec["gateFd"]], spec.get("netnsAtGate", False))
    _lo_up()
    _drop_privileges(uid, gid)
    # a personal task works in its first folder, as the owner would
    os.chdir(spec["folders"][0]["path"] if spec.get("folders") else VIEW_DIR)
    _kernel_filter_load()


def _view_open(spec: dict[str, Any]) -> int:
    """The task's view: a detached overlay (an fd) on an idmapped clone of BOX_HOME."""
    userns = _store_userns(spec)
    tree = syscall("open_tree", SYS_OPEN_TREE, -100, spec["boxHome"].encode(),
                   OPEN_TREE_CLONE | os.O_CLOEXEC)
    _idmap_set(tree, userns)
    try:
        return overlay_open_plan(tree, spec["lowers"], spec["upper"], spec["work"])
    finally:
        for fd in (tree, userns):
            os.close(fd)


def _root_build(root: str, spec: dict[str, Any]) -> None:
    """The new root at root: the system's programs, /etc, /dev, /proc, /tmp, HOME.

    /tmp, /var/tmp, /dev/shm and HOME are folders of one tmpfs (its size is what a task may
    keep in memory files); it is mounted at a scratch point, its folders bound to their
    places, and the scratch point detached again, so the task never sees the tmpfs whole.
    """
    nosuid_nodev = MS_NOSUID | MS_NODEV
    os.umask(0o022)                      # the box's folders as their modes say; the worker too
    _mount("tmpfs", root, "tmpfs", nosuid_nodev | MS_NOEXEC, "mode=0755,size=1m")
    scratch = os.path.join(root, ".scratch")
    os.mkdir(scratch, 0o700)
    size = int(spec.get("tmpBytes") or DEFAULT_TMP_BYTES)
    _mount("tmpfs", scratch, "tmpfs", nosuid_nodev, f"mode=0755,size={size}")
    for name, mode in (("tmp", 0o1777), ("var-tmp", 0o1777), ("shm", 0o1777), ("home", 0o700),
                       ("etc", 0o755)):
        os.mkdir(os.path.join(scratch, name))
        os.chmod(os.path.join(scratch, name), mode)
    os.chown(os.path.join(scratch, "home"), spec["uid"], spec["gid"])
    _system_binds(root, os.path.join(scratch, "etc"))
    _dev_build(root, os.path.join(scratch, "shm"))
    os.mkdir(os.path.join(root, "proc"), 0o555)
    _mount("proc", os.path.join(root, "proc"), "proc", nosuid_nodev | MS_NOEXEC,
           "hidepid=invisible")
    for place, folder in (("/tmp", "tmp"), ("/var/tmp", "var-tmp"), (spec["home"], "home")):
        os.makedirs(root + place, 0o755)
        _mount(os.path.join(scratch, folder), root + place, None, MS_BIND, None)
    libc_call("umount2", scratch.encode(), MNT_DETACH)
    os.rmdir(scratch)


def _system_binds(root: str, mask: str) -> None:
    """/usr and the usrmerge links as on the host, read-only; /etc without its secrets.

    /etc is a read-only overlay: mask (a folder of the box's tmpfs, with a whiteout for each
    host file that ETC_HIDDEN names, and gurtd's resolv.conf) over the host's /etc.  Binding
    empty files over the secrets would not hold: gurtd replaces /etc/shadow by rename at every
    task start, and a rename over a mount point in another namespace detaches that mount.
    """
    os.mkdir(os.path.join(root, "usr"), 0o755)
    _bind(-100, "/usr", os.path.join(root, "usr"), BOX_RO, recursive=True)
    for name in USRMERGE:
        host = os.path.join("/", name)
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            os.mkdir(os.path.join(root, name), 0o755)
            _bind(-100, host, os.path.join(root, name), BOX_RO, recursive=True)
    for rel in etc_hidden(_ETC_HIDDEN_PLAN or etc_hidden_plan(ETC_HIDDEN)):
        os.makedirs(os.path.join(mask, os.path.dirname(rel)), 0o755, exist_ok=True)
        os.mknod(os.path.join(mask, rel), stat.S_IFCHR | 0o000, 0)       # an overlay whiteout
    _box_file(os.path.join(mask, "resolv.conf"), BOX_RESOLV_CONF)
    layers = [os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in (mask, "/etc")]
    try:
        etc = overlay_open_at([(fd, "") for fd in layers])
    finally:
        for fd in layers:
            os.close(fd)
    try:
        os.mkdir(os.path.join(root, "etc"), 0o755)
        _mount_attrs(etc, "", MOUNT_ATTR_RDONLY, False)
        syscall("move_mount", SYS_MOVE_MOUNT, etc, b"", -100, os.path.join(root, "etc").encode(),
                MOVE_MOUNT_F_EMPTY_PATH)
    finally:
        os.close(etc)


def _dev_build(root: str, shm: str) -> None:
    """A minimal /dev: a few host devices, a devpts instance of the box's own, /dev/shm."""
    dev = os.path.join(root, "dev")
    os.mkdir(dev, 0o755)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEV_NODES:
        if not os.path.exists(os.path.join("/dev", name)):
            continue
        _box_file(os.path.join(dev, name))
        _bind(-100, os.path.join("/dev", name), os.path.join(dev, name),
              MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC)
    os.mkdir(os.path.join(dev, "pts"), 0o755)
    _mount("devpts", os.path.join(dev, "pts"), "devpts", MS_NOSUID | MS_NOEXEC,
           "newinstance,ptmxmode=0666,mode=0620")
    for name, target in DEV_LINKS.items():
        os.symlink(target, os.path.join(dev, name))
    os.mkdir(os.path.join(dev, "shm"), 0o755)
    _mount(shm, os.path.join(dev, "shm"), None, MS_BIND, None)
    _mount_attrs(-100, dev, MOUNT_ATTR_RDONLY, False)   # its own entries, not the devices


def _run_build(root: str, spec: dict[str, Any], view: int, held: dict[str, int]) -> None:
    """/run/gurt: the view, the broker socket, the tool client, droid, the prompt files."""
    run_dir = os.path.join(root, "run")
    os.mkdir(run_dir, 0o755)
    module = held.pop("module")
    _mount("tmpfs", run_dir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=0755,size={(1 << 20) + os.fstat(module).st_size}")
    for sub in ("gurt/view", "gurt/bin", "gurt/lib"):
        os.makedirs(os.path.join(run_dir, sub), 0o755)
    try:
        syscall("move_mount", SYS_MOVE_MOUNT, view, b"", -100, (root + VIEW_DIR).encode(),
                MOVE_MOUNT_F_EMPTY_PATH)
    finally:
        os.close(view)
    _tool_client_place(root, module)
    # the broker socket (a bind: a socket cannot be copied) and droid
    places = {"broker": BROKER_IN_BOX, "droid": "/run/gurt/bin/droid"}
    for name, fd in held.items():
        _box_file(root + places[name])
        _bind(fd, "", root + places[name], MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
        os.close(fd)
    if _droid_in_usr(spec):           # installed: the box's /usr has it, a bind would name it
        os.symlink(_droid_in_usr(spec), root + places["droid"])
    files = dict(spec.get("files", {}))   # the prompt, the system prompt
    files["/run/gurt/bin/gurtd"] = \
        '#!/bin/sh\nexec /usr/bin/python3 -I /run/gurt/lib/gurtd.py "$@"\n'
    files["/run/gurt/resolv.conf"] = BOX_RESOLV_CONF
    for path, text in files.items():
        if not path.startswith("/run/gurt/"):
            raise SysError("sandbox", errno.EINVAL, f"a box file outside /run/gurt: {path}")
        _box_file(root + path, text, 0o755 if path.startswith("/run/gurt/bin/") else 0o644)


def _tool_client_place(root: str, module: int) -> None:
    """The `gurtd` command's module at /run/gurt/lib: the spawner's read-only tmpfs bound
    there, else (none, or the kernel refuses to clone it into this fresh namespace: EINVAL
    before 6.15) a copy of this very module, never a bind of it, whose source
    /proc/self/mountinfo would show (the checkout's path).  module closed either way, and the
    tmpfs's fd too: nothing of it stays open in the box."""
    global _TOOL_MOUNT
    try:
        if _TOOL_MOUNT >= 0:
            with contextlib.suppress(OSError, SysError):
                _bind(_TOOL_MOUNT, "", root + "/run/gurt/lib", BOX_RO | MOUNT_ATTR_NOEXEC)
                os.close(module)
                return
        _file_copy(module, root + "/run/gurt/lib/gurtd.py")
    finally:
        if _TOOL_MOUNT >= 0:
            os.close(_TOOL_MOUNT)
            _TOOL_MOUNT = -1


def _file_copy(source: int, path: str) -> None:
    """A new file at path, mode 0644 whatever gurtd's umask, with what source holds; source
    closed.  sendfile: the kernel copies from the page cache (a read and write through a
    buffer cost the worker ~0.3 ms and ~40 page faults for the 0.9 MB module)."""
    try:
        copy = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(copy, 0o644)
            offset, size = 0, os.fstat(source).st_size
            while offset < size:
                sent = os.sendfile(copy, source, offset, size - offset)
                if not sent:          # the file got shorter meanwhile: what it holds now
                    break
                offset += sent
        finally:
            os.close(copy)
    finally:
        os.close(source)


def _box_file(path: str, text: str = "", mode: int = 0o644) -> None:
    """A file of the box's own tmpfs at path holding text, with mode whatever the umask.
    os calls, not open(): a text file object's layers cost a worker's fresh copy of the
    spawner page faults and ~20 us a file, and the root build makes a dozen."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        write_all(fd, text.encode())
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _broker_open(spec: dict[str, Any]) -> int:
    """The broker socket to bind in the box, always on the tmpfs of Broker.mount: a clone of it
    from the spawner's detached tmpfs (a private root, Linux 6.15+), else the socket at its
    path (spec's broker), which the spawner's namespace has on the tmpfs, or gurtd's
    attached one where a kernel before 6.15 refuses that clone.  The worker's fd of that
    tmpfs closed either way: none stays open in the box."""
    global _BROKER_MOUNT
    if _BROKER_MOUNT >= 0:
        try:
            return syscall("open_tree", SYS_OPEN_TREE, _BROKER_MOUNT, b"broker.sock",
                           OPEN_TREE_CLONE | os.O_CLOEXEC)
        finally:
            os.close(_BROKER_MOUNT)
            _BROKER_MOUNT = -1
    return os.open(spec["broker"], os.O_PATH | os.O_CLOEXEC)


def _droid_in_usr(spec: dict[str, Any]) -> str:
    """Where droid is if that is under /usr (make install's place), which the box has as is."""
    real = os.path.realpath(spec["droid"]) if spec.get("droid") else ""
    return real if real.startswith("/usr/") else ""


def _root_pivot(root: str) -> None:
    """Make root the worker's / and detach the host's root from its namespace."""
    os.chdir(root)
    syscall("pivot_root", SYS_PIVOT_ROOT, b".", b".")
    libc_call("umount2", b".", MNT_DETACH)      # the old root, stacked on the new one
    os.chdir("/")


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))


def _drop_privileges(uid: int, gid: int) -> None:
    """No capabilities, no groups, the box user, no new privileges, die with the parent."""
    import prctl
    prctl.capbset.limit()
    prctl.cap_inheritable.limit()
    libc().prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    prctl.set_no_new_privs(True)
    prctl.set_pdeathsig(signal.SIGKILL)
    if os.getuid() != uid or os.geteuid() != uid or prctl.cap_permitted.sys_admin:
        raise SysError("drop privileges", errno.EPERM, "still privileged")


# A worker's gate: a socket pair, its worker's end passed at the spawn.  The worker builds its
# box, then waits there for gurtd's word that the task may begin (Box.gates_open: its user is
# written and its running state on disk), with the fd of the task's network namespace where it
# has one (made meanwhile): nothing of the task runs before it (a crash never finds a task that
# ran queued, to run again), and the end of the socket (gurtd could not make the user or save
# the state, or ended) ends the worker.

def gate_pair() -> tuple[int, int]:
    """The worker's end and gurtd's."""
    worker, gurtd = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    return worker.detach(), gurtd.detach()


def gate_open(fd: int, fds: list[int]) -> None:
    """gurtd's word at the gate fd, with fds (the task's network namespace, if it has one)."""
    sock = socket.socket(fileno=fd)
    try:
        socket.send_fds(sock, [b"1"], fds)
    finally:
        sock.detach()


def _gate_pass(fd: int, netns: bool) -> None:
    """The worker at its gate: on once gurtd's word comes, in the namespace sent with it if
    netns (never in the host's: without one the worker ends)."""
    sock = socket.socket(fileno=fd)
    try:
        word, fds, _, _ = socket.recv_fds(sock, 1, 1)
    finally:
        sock.close()
    if word != b"1" or len(fds) != int(netns):
        for got in fds:
            os.close(got)
        raise SysError("begin", errno.ECANCELED, "gurtd did not let the task begin")
    if netns:
        libc_call("setns", fds[0], CLONE_NEWNET)
        os.close(fds[0])


def _emit(fd: int, **msg: Any) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _run_fake(spec: dict[str, Any], out_fd: int) -> int:
    """The fake worker: each prompt line with /bin/sh; stop at the first that fails."""
    env = spec["env"]
    for line in spec["prompt"].splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        _emit(out_fd, t="step", text=line, at=time.time())
        code = _run_line(["/bin/sh", "-c", line], env, out_fd)
        if code != 0:
            _emit(out_fd, t="exit", code=code)
            return code
    _emit(out_fd, t="exit", code=0)
    return 0


def _spawn_line(argv: list[str], env: dict[str, str], out_w: int, err_w: int) -> int:
    """Start one command with /dev/null, out_w and err_w as its 0, 1 and 2 and no other fd of
    the worker's; its pid, or minus the errno if it could not be run (127, as a shell says).

    posix_spawn, not fork: glibc starts it with clone(CLONE_VM | CLONE_VFORK) (clone3 first,
    which the kernel filter answers ENOSYS), so the worker's memory is not copied (a fork of
    it cost ~5 ms of CPU here).  Python's posix_spawn has no closefrom, so every fd above 2
    is made close-on-exec first, whatever opened it.  The command inherits the worker's
    confinement as a forked one did: namespaces, root, uid, no capabilities, no_new_privs,
    the filter; caught signals are reset to their default, ignored ones stay ignored."""
    syscall("close_range", SYS_CLOSE_RANGE, 3, ctypes.c_uint(0xFFFFFFFF), CLOSE_RANGE_CLOEXEC)
    reaped = _children_usage()
    try:
        return os.posix_spawn(argv[0], argv, env, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
    except OSError as exc:
        # EAGAIN and ENOMEM come from the clone (no process: the worker's error) or from the
        # exec (the command's, 127 as the forked child's was): glibc reaps a child whose exec
        # failed, and a reaped child leaves its CPU time (the kernel's exact runtime, never 0)
        # in RUSAGE_CHILDREN; one never born leaves nothing
        if exc.errno in (errno.EAGAIN, errno.ENOMEM) and _children_usage() == reaped:
            raise
        return -(exc.errno or errno.ENOEXEC)              # the command's: not found, ...


def _children_usage() -> tuple[float, ...]:
    """What the reaped children of this process used (getrusage RUSAGE_CHILDREN)."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (use.ru_minflt, use.ru_majflt, use.ru_nvcsw, use.ru_nivcsw, use.ru_utime,
            use.ru_stime)


def _run_line(argv: list[str], env: dict[str, str], out_fd: int) -> int:
    """Run one command, forwarding its output lines; its exit code (128+N for signal N)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = _spawn_line(argv, env, out_w, err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    if pid < 0:
        for fd in (out_r, err_r):
            os.close(fd)
        _emit(out_fd, t="err", text=f"{argv[0]}: {os.strerror(-pid)}")
        return 127
    pidfd = os.pidfd_open(pid)
    pending = {out_r: b"", err_r: b""}
    kinds = {out_r: "out", err_r: "err"}
    code: int | None = None

    def forward(fd: int, data: bytes, final: bool) -> None:
        buf = pending[fd] + data
        *lines, rest = buf.split(b"\n")
        if final and rest:
            lines, rest = lines + [rest], b""
        while len(rest) > 65536:
            lines.append(rest[:65536])
            rest = rest[65536:]
        pending[fd] = rest
        for chunk in lines:
            _emit(out_fd, t=kinds[fd], text=chunk.decode(errors="replace"))

    open_fds = [out_r, err_r]
    while code is None:
        ready, _, _ = select.select(open_fds + [pidfd], [], [])
        for fd in ready:
            if fd == pidfd:
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                continue
            data = os.read(fd, 65536)
            if data:
                forward(fd, data, False)
            else:
                open_fds.remove(fd)
    for fd in (out_r, err_r):  # what the line left in its pipes (background children may
        os.set_blocking(fd, False)  # hold them open: take what is there, do not wait)
        while fd in open_fds:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            forward(fd, data, False)
        forward(fd, b"", True)
        os.close(fd)
    os.close(pidfd)
    return 128 - code if code < 0 else code


# Kernel filter #################################################################################
###############################################################################################
# A seccomp filter every worker runs under, loaded last (after no_new_privs, right before the
# worker), built by libseccomp's own Python binding (Debian's python3-seccomp) once, before the
# spawner forks, and loaded as the BPF program it exports (one prctl a worker).  It reads like
# a policy, as Docker's default profile and bubblewrap's --seccomp do: everything is allowed
# but the syscalls below, each refused with EPERM (clone3 with ENOSYS, so that libc falls back
# to clone, whose flags a filter can read), each with what the refusal closes.  Only x86_64
# (the native ABI) is described: a 32-bit (int 0x80) or x32 syscall kills the process, so no
# second syscall table can walk around the list.  ptrace stays allowed, as in Docker on kernels
# since 4.8: a task may debug its own processes (strace, gdb), and hidepid plus a uid of its
# own keep it from any other.

CLONE_NEW_FLAGS = 0x7E020000         # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NEWTIME = 0x80                 # unshare only: in clone's flags these bits are a signal
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
PERSONA_QUERY = 0x80000000           # personality(0xffffffff) asks; no persona has this bit
PERSONA_FLAGS = 0x0FFC0000           # ADDR_NO_RANDOMIZE ... ADDR_LIMIT_3GB (UNAME26 stays)
AF_VSOCK = 40
FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS = 0x40086602, 0x40046602
SYS_FILE_SETATTR = 469               # 6.17's file_setattr: libseccomp 2.5 knows no name for it
ArgTest = tuple[int, int, int]       # (argument, mask, value): refused if arg & mask == value


def any_bit(arg: int, bits: int, unless: int = 0) -> tuple[ArgTest, ...]:
    """Tests that match when argument arg has any of bits set (and none of unless)."""
    return tuple((arg, 1 << n | unless, 1 << n) for n in range(64) if bits >> n & 1)


# (syscall, by name or number; argument tests: any one refuses, none given: always; errno;
# what it closes)
Refusal = tuple[str | int, tuple[ArgTest, ...], int, str]
# Namespaces: in a user namespace of its own a task is root of a world where far more of the
# kernel is reachable (netfilter, most file systems): the usual first step of an exploit.  The
# tools gurtd runs (not workers) have these too (no_namespaces).
NAMESPACE_REFUSALS: tuple[Refusal, ...] = (
    ("unshare", any_bit(0, CLONE_NEW_FLAGS | CLONE_NEWTIME), errno.EPERM,
     "new namespaces, a user namespace first"),
    ("clone", any_bit(0, CLONE_NEW_FLAGS), errno.EPERM, "the same through clone"),
    ("clone3", (), errno.ENOSYS, "flags in memory that a filter cannot read: libc uses clone"),
    ("setns", (), errno.EPERM, "joining a namespace through an fd passed in"),
)
KERNEL_REFUSALS: tuple[Refusal, ...] = NAMESPACE_REFUSALS + (
    # io_uring: a second way to make syscalls, around this filter, and a rich source of bugs
    ("io_uring_setup", (), errno.EPERM, "io_uring rings"),
    ("io_uring_enter", (), errno.EPERM, "io_uring rings"),
    ("io_uring_register", (), errno.EPERM, "io_uring rings"),
    # Keyrings: per uid, so keys would outlive the task; a frequent source of kernel bugs
    ("keyctl", (), errno.EPERM, "the kernel's keyrings"),
    ("add_key", (), errno.EPERM, "the kernel's keyrings"),
    ("request_key", (), errno.EPERM, "the kernel's keyrings (and upcalls to the host)"),
    # Kernel programs and tracing: verifier bugs, side channels, the kernel's addresses
    ("bpf", (), errno.EPERM, "eBPF programs and maps"),
    ("perf_event_open", (), errno.EPERM, "performance counters: side channels, kernel bugs"),
    ("lookup_dcookie", (), errno.EPERM, "profiler cookies"),
    ("userfaultfd", (), errno.EPERM, "pausing the kernel at a page fault: widens races"),
    # Terminals
    ("ioctl", ((1, 0xFFFFFFFF, TIOCSTI),), errno.EPERM,
     "TIOCSTI: typing into a terminal, a person's included"),
    ("ioctl", ((1, 0xFFFFFFFF, TIOCLINUX),), errno.EPERM, "TIOCLINUX: the console's selection"),
    # Sockets that no network namespace or nftables rule confines
    ("socket", ((0, 0xFFFFFFFF, AF_VSOCK),), errno.EPERM,
     "AF_VSOCK: the hypervisor's and other VMs' services, whatever the task's hosts say"),
    ("socketpair", ((0, 0xFFFFFFFF, AF_VSOCK),), errno.EPERM, "AF_VSOCK, the same"),
    # Mounts (they need CAP_SYS_ADMIN; refused here as well should a capability ever leak)
    ("mount", (), errno.EPERM, "mounts"),
    ("umount2", (), errno.EPERM, "unmounting what hides the host"),
    ("pivot_root", (), errno.EPERM, "a new root"),
    ("chroot", (), errno.EPERM, "a new root"),
    ("move_mount", (), errno.EPERM, "the new mount API"),
    ("open_tree", (), errno.EPERM, "the new mount API: clones of mounts"),
    ("fsopen", (), errno.EPERM, "the new mount API"),
    ("fsconfig", (), errno.EPERM, "the new mount API"),
    ("fsmount", (), errno.EPERM, "the new mount API"),
    ("fspick", (), errno.EPERM, "the new mount API"),
    ("mount_setattr", (), errno.EPERM, "the new mount API: idmaps, read-only flags"),
    ("name_to_handle_at", (), errno.EPERM, "file handles"),
    ("open_by_handle_at", (), errno.EPERM, "opening any file of a file system by handle"),
    ("quotactl", (), errno.EPERM, "disk quotas"),
    ("quotactl_fd", (), errno.EPERM, "disk quotas"),
    # A layer's files carry its project id (project quotas, in Limits and tracking), and the
    # kernel lets a file's owner change the id and the project-inherit flag, through overlay
    # with the mounter's rights: a file out of the project escapes the layer's limit.  Reading
    # them stays allowed (FS_IOC_GETFLAGS, FS_IOC_FSGETXATTR, file_getattr: lsattr).
    ("ioctl", ((1, 0xFFFFFFFF, FS_IOC_FSSETXATTR),), errno.EPERM,
     "FS_IOC_FSSETXATTR: a file's project id and project-inherit flag (chattr -p, -P)"),
    ("ioctl", ((1, 0xFFFFFFFF, FS_IOC_SETFLAGS), (1, 0xFFFFFFFF, FS_IOC32_SETFLAGS)),
     errno.EPERM, "FS_IOC_SETFLAGS (and its 32-bit number): the project-inherit flag, "
                  "the other file flags (chattr +P, -P, +d)"),
    (SYS_FILE_SETATTR, (), errno.EPERM, "file_setattr: FS_IOC_FSSETXATTR by path"),
    # The kernel and the machine
    ("kexec_load", (), errno.EPERM, "booting another kernel"),
    ("kexec_file_load", (), errno.EPERM, "booting another kernel"),
    ("init_module", (), errno.EPERM, "kernel modules"),
    ("finit_module", (), errno.EPERM, "kernel modules"),
    ("delete_module", (), errno.EPERM, "kernel modules"),
    ("reboot", (), errno.EPERM, "rebooting the box"),
    ("swapon", (), errno.EPERM, "swap"),
    ("swapoff", (), errno.EPERM, "swap"),
    ("acct", (), errno.EPERM, "process accounting"),
    ("syslog", (), errno.EPERM, "the kernel's log: addresses, other tasks' traces"),
    ("iopl", (), errno.EPERM, "I/O ports"),
    ("ioperm", (), errno.EPERM, "I/O ports"),
    ("sethostname", (), errno.EPERM, "the host's name"),
    ("setdomainname", (), errno.EPERM, "the host's domain name"),
    ("vhangup", (), errno.EPERM, "hanging up a terminal"),
    # Time
    ("settimeofday", (), errno.EPERM, "the clock"),
    ("clock_settime", (), errno.EPERM, "the clock"),
    ("clock_adjtime", (), errno.EPERM, "the clock"),
    # Memory layout: personality may turn ASLR off or make reads executable (the harmless
    # values stay: the query, PER_LINUX32, UNAME26, as Docker allows)
    ("personality", any_bit(0, PERSONA_FLAGS, unless=PERSONA_QUERY), errno.EPERM,
     "ASLR off, executable reads, address space limits"),
    # Obsolete interfaces nothing current needs
    ("uselib", (), errno.EPERM, "a.out libraries"),
    ("ustat", (), errno.EPERM, "obsolete"),
    ("sysfs", (), errno.EPERM, "obsolete"),
    ("_sysctl", (), errno.EPERM, "obsolete"),
    ("nfsservctl", (), errno.EPERM, "obsolete"),
)

_KERNEL_BPF = b""                    # built once by sandbox_preload, before the spawner forks
_NAMESPACE_BPF = b""                 # the same, of NAMESPACE_REFUSALS
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_NO_NEW_PRIVS = 22, 2, 38


def kernel_filter(refusals: tuple[Refusal, ...] = KERNEL_REFUSALS) -> Any:
    """The filter (a seccomp.SyscallFilter) of refusals; ImportError without libseccomp."""
    seccomp = importlib.import_module("seccomp")
    filt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    filt.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name, tests, err, _closes in refusals:
        if not tests:
            filt.add_rule(seccomp.ERRNO(err), name)
        for arg, mask, value in tests:
            filt.add_rule(seccomp.ERRNO(err), name,
                          seccomp.Arg(arg, seccomp.MASKED_EQ, mask, value))
    return filt


class _SockFprog(ctypes.Structure):
    """struct sock_fprog: a BPF program as prctl(PR_SET_SECCOMP) takes it."""
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def filter_bpf(refusals: tuple[Refusal, ...] = KERNEL_REFUSALS) -> bytes:
    """The filter of refusals as the kernel takes it (libseccomp's export): loading that is
    one prctl, where libseccomp's own load builds the program anew (a worker's load took
    ~0.7 ms of CPU here, this ~0.3 ms)."""
    fd = os.memfd_create("gurt-filter", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as f:
        kernel_filter(refusals).export_bpf(f)
        f.seek(0)
        return f.read()


def filter_load(bpf: bytes) -> None:
    """Load bpf into this process, no_new_privs first (as libseccomp's load: without it the
    kernel wants CAP_SYS_ADMIN); its children inherit both."""
    prog = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = _SockFprog(len(bpf) // 8, ctypes.addressof(prog))   # 8 bytes an instruction
    ulong = ctypes.c_ulong
    libc_call("prctl", PR_SET_NO_NEW_PRIVS, ulong(1), ulong(0), ulong(0), ulong(0))
    libc_call("prctl", PR_SET_SECCOMP, ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog),
              ulong(0), ulong(0))


def _kernel_filter_load() -> None:
    """Load the filter into this process (a worker to be); its children inherit it."""
    filter_load(_KERNEL_BPF or filter_bpf())


def no_namespaces() -> None:
    """preexec_fn of the unprivileged processes gurtd starts that are not workers (the tools,
    as the tools user): without systemd's RestrictNamespaces a tool could make a user
    namespace (unprivileged ones are on in Debian) and be root of it.  The filter sets
    no_new_privs too; its children inherit it.  The processes gurtd runs as root (git
    merge-file, diff, droid's model list) have no use for it: root reaches all of the kernel
    without a namespace; and a preexec_fn costs a fork of gurtd instead of a vfork."""
    filter_load(_NAMESPACE_BPF or filter_bpf(NAMESPACE_REFUSALS))


# Task leftovers ################################################################################
###############################################################################################
# What a task could leave behind once its processes are gone: set-id files in its layer (on
# disk they belong to the store user; anyone who can reach BOX_HOME on a mount without nosuid
# could become that user), and keys in the kernel's per-uid keyrings, which outlive processes.

KEY_USERS = "/proc/key-users"
SETID_BITS = stat.S_ISUID | stat.S_ISGID
_KEYS_CLEAR = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
with open("/proc/keys") as f:
    for line in f:
        fields = line.split()
        if len(fields) > 5 and fields[5] == str(os.getuid()):
            libc.syscall(250, 21, ctypes.c_long(int(fields[0], 16)))   # KEYCTL_INVALIDATE
"""


def setid_strip(top: str) -> list[str]:
    """Clear the set-uid and set-gid bits of every regular file under top; the names cleared.

    Walks with directory fds (tree_visit: any depth) and never follows a symlink: a task's
    symlink may name any host file.  Each file is opened with O_NOFOLLOW and checked again
    through its fd before fchmod.
    """
    cleared: list[str] = []

    def strip(dir_fd: int, name: str, st: os.stat_result, parents: list[str]) -> None:
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & SETID_BITS:
            return
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~SETID_BITS)
                    cleared.append(os.path.join(top, *parents, name))
            finally:
                os.close(fd)
        except OSError as exc:
            log(3, f"set-id bits of {name} in {top}: {exc}")

    try:
        tree_visit(top, strip)
    except FileNotFoundError:             # a task that never started has no layer
        pass
    return cleared


def uid_has_keys(uid: int) -> bool:
    """Whether the kernel holds keys charged to uid (a line of /proc/key-users)."""
    with open(KEY_USERS) as f:
        return any(line.split(":", 1)[0].strip() == str(uid) for line in f)


def keys_clear(uid: int) -> None:
    """Invalidate every key of uid, as that uid (root may not invalidate a user's keys).

    The kernel keeps a uid's user keyrings after its last process; invalidated, they and their
    keys are collected at once.  Idempotent; costs nothing for a uid without keys.
    """
    if uid_has_keys(uid):
        log(5, f"uid {uid} holds kernel keys: invalidating them")
        run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
             "--no-new-privs", sys.executable, "-I", "-c", _KEYS_CLEAR])


# Review ########################################################################################
###############################################################################################
# Personal mode: a task works on copies of the owner's real folders, and nothing of it reaches
# them until the owner keeps it.  Inside the task each folder is an overlay at its own real
# path: its lower is the real folder, idmapped folder owner -> task uid (every other id shows
# as itself, so root's files stay root's); its upper and work dir are under
# BOX_HOME/review/<id>/f<N>, on the idmapped store clone, as the view's are.  Nothing writes the
# real folder while the task runs.
#
# Conflicts: "was the real path created, changed or deleted after the task started?" must be
# exact and cheap.  A start snapshot of a 100,000-file folder would cost the start its speed,
# so the answer comes from what the kernel already records:
#   - ctime: every change to a path (content, mode, owner, link count, a rename onto it, its
#     creation) sets its ctime, and nobody can set it back (utimensat does not touch it).  The
#     task's start is recorded as folderStartNs (the wall clock minus CLOCK_SLACK_NS: a ctime
#     comes from the coarse clock, at most one tick behind).  A real path whose ctime is at or
#     after it changed after the start; a change in the last 20 ms before the start counts as
#     one too (the safe side).  A folder's ctime says an entry of it was added or removed.
#   - overlay's origin xattr (trusted.overlay.origin): an upper entry that has it was copied up
#     from the real folder, so the real path existed after the start; if it is gone now, the
#     owner deleted it, unless the task gave the file that path (`mv`, `ln`: the copy-up is
#     under the new name): the xattr is a handle of the real file, and one that still has a
#     name and an older ctime was neither renamed nor deleted by the owner.  A whiteout
#     likewise exists only over a path that was there.
# What this does not see: a path that existed at the start, was deleted by the owner before the
# task touched it, and was then created anew by the task (no origin): the task's file is kept.
# A clock set back by the owner would hide changes; gurtd runs on the box's own clock.
#
# Keep: a journal first (BOX_HOME/review/<id>/journal.json: every write, and where each
# original goes), then the writes: each original first saved under BOX_HOME (saved/<n>: a hard
# link when it is a file with no other name on the same file system, else a copy), then the
# new version through a temporary name in the same folder and a rename, every path resolved
# beneath the folder's fd with openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, never into a
# folder its owner may not write.  What keep writes belongs to the folder's owner (a regular
# file the owner may write keeps its owner): never root because it lands in a folder of root's.
# The sticky bit is honoured as the kernel would for the owner: another user's entry in a
# sticky folder that is not the owner's is neither replaced nor deleted (a conflict that
# force does not override).  A gurtd killed before the journal is written has written
# nothing; one killed after it finishes the keep at its next start (every step is repeatable
# from the upper).  Undo of a keep is journaled the same way and puts the saved originals back.
# Keep and undo of a keep run in the review thread, one after another, never on the loop: a
# keep of 100,000 new files is seconds of writes (16-21 s held the loop, near the unit's 30 s
# watchdog).  The loop only sets what they change of a Task, in short calls (Review.settle).
# Off the loop is not enough for their JSON: the journal, kept.json and the undo's journal were
# written and read whole, each one C call with the GIL held (1,000,000 paths: 0.9 s to write,
# 1.7 s to read, the loop waiting).  They are written a slice at a time (write_record) and
# read with kept_op (Python between the objects; each op's after a tuple, which the collector
# stops walking), still whole, so a task's keeps write at most KEEP_MAX_CHANGES paths in all;
# the listings they read (upper_changes) are capped in memory as a workspace's changes.

MAX_FOLDERS = 16
REVIEW_STATES = ("pending", "kept", "conflict", "undone")
PSEUDO_FS = ("/proc", "/sys", "/dev", "/run")
NOT_FOLDER_ROOTS = ("/", "/proc", "/sys", "/dev", "/run", "/usr", "/etc", "/tmp", "/var/tmp",
                    "/bin", "/sbin", "/lib", "/lib64", "/boot")   # the box's own places
CLOCK_SLACK_NS = 20_000_000
ID_END = 4294967295                  # (uid_t)-1 is no id
ORIGIN_XATTR = "trusted.overlay.origin"
OVL_FB_HEADER = 21                   # bytes of an origin xattr before the kernel's file handle
KEEP_TEMP = ".gurt-keep-"            # temp names in the real folders: .gurt-keep-<task>-<n>
REVIEW_TRASH = ".trash-"             # BOX_HOME/review/.trash-<task>-<n>: being deleted
SAVE_DEPTH_MAX = 500                 # levels of a real folder keep saves (a copy made on the
                                     # loop: a task must not make it copy without end)
TOO_DEEP = "\0too deep"              # _tree_conflict's answer for a folder deeper than that
STICKY_HELD = "\0sticky"             # and for one holding what the owner may not remove
KEEP_PATH_MAX = 4096                 # bytes: a task's folder deeper than this is listed (as
                                     # kind "deep"), never walked into, and never kept
KEEP_MAX_CHANGES = 200_000           # paths a task's keeps write in all: its journal, kept.json
                                     # and the undo's are JSON read and written whole (a keep
                                     # of 1,000,000 held gurtd 1.38 GB), see the banner (tests:
                                     # fewer, with GURT_KEEP_MAX_CHANGES)


def folders_of(body: dict[str, Any]) -> list[str] | None:
    """The task's folders from folder and folders (shape only; folder_check looks at disk)."""
    folder, folders = body.get("folder"), body.get("folders")
    if folder is None and folders is None:
        return None
    if folders is None:
        folders = [folder]
    if not folders:
        raise ApiError(400, "folders must name at least one folder")
    if len(folders) > MAX_FOLDERS:
        raise ApiError(400, f"folders: at most {MAX_FOLDERS} folders, not {len(folders)}")
    for path in folders:
        if not isinstance(path, str) or not path or "\0" in path or len(path) > 4000:
            raise ApiError(400, f"folders: not a path: {json.dumps(path)}")
    if folder is not None and folder != folders[0]:
        raise ApiError(400, f"folder {folder} must be folders[0] ({folders[0]})")
    return list(folders)


def valid_folder_roots(value: Any) -> list[str]:
    """The folderRoots setting: absolute, normal paths, none of the box's own places."""
    if not isinstance(value, list) or len(value) > 64 or \
            not all(isinstance(p, str) and p for p in value):
        raise ApiError(400, "folderRoots must be an array of absolute paths")
    for path in value:
        if not path.startswith("/") or os.path.normpath(path) != path or "\0" in path:
            raise ApiError(400, f"folderRoots: {json.dumps(path)} is not an absolute, normal "
                                "path")
        if path == "/" or any(_under(path, p) for p in NOT_FOLDER_ROOTS if p != "/"):
            raise ApiError(400, f"folderRoots: {path} is a system place, not one for people's "
                                "folders")
    return list(value)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def folder_check(path: str, roots: list[str], home: str) -> os.stat_result:
    """The folder's stat if it may be a task's folder; else ApiError(400) naming it."""
    def no(why: str) -> ApiError:
        return ApiError(400, f"folder {path}: {why}")
    if not path.startswith("/"):
        raise no("must be an absolute path")
    if ".." in path.split("/") or "." in path.split("/") or os.path.normpath(path) != path:
        raise no("must be a normal absolute path (no .., no ., no double or trailing /)")
    if path == "/":
        raise no("the root of the file system is not a folder of a person")
    if any(_under(path, p) for p in PSEUDO_FS):
        raise no("is on a pseudo file system")
    if not os.path.lexists(path):
        raise no("does not exist")
    real = os.path.realpath(path)
    if real != path:
        raise no(f"goes through a symlink: it resolves to {real}")
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise no("is not a directory")
    home = os.path.realpath(home)
    if _under(path, home) or _under(home, path):
        raise no(f"{'is inside' if _under(path, home) else 'holds'} BOX_HOME ({home})")
    own = os.path.dirname(os.path.realpath(__file__))
    if _under(path, own) or _under(own, path):
        raise no(f"{'is inside' if _under(path, own) else 'holds'} gurtd's own files ({own})")
    if not any(_under(path, root) for root in roots):
        raise no(f"is outside folderRoots ({', '.join(roots) or 'none'})")
    if st.st_uid == 0:
        raise no("is owned by root; personal mode works on a person's own folders")
    if UID_FIRST <= st.st_uid < UID_FIRST + UID_COUNT:
        raise no("is owned by a task user")
    return st


def folders_check(paths: list[str], roots: list[str], home: str) -> list[dict[str, Any]]:
    """Every folder checked, and no folder inside another; [{path, uid, gid, dev, ino}]."""
    out = []
    for path in paths:
        st = folder_check(path, roots, home)
        out.append({"path": path, "uid": st.st_uid, "gid": st.st_gid, "dev": st.st_dev,
                    "ino": st.st_ino})
    for a in paths:
        for b in paths:
            if a is not b and _under(b, a):
                raise ApiError(400, f"folder {a} holds folder {b}" if a != b else
                               f"folder {a} is named twice")
    return out


def idmap_swap(src: int, dst: int) -> str:
    """A uid_map (or gid_map) that shows src as dst and every other id as itself (dst, then
    shown by nothing, stays unmapped: no file on disk belongs to a task uid)."""
    lines, start = [], 0
    for low, high in sorted([(src, dst), (dst, None)], key=lambda p: p[0]) if src != dst \
            else [(src, None)]:
        if low > start:
            lines.append(f"{start} {start} {low - start}")
        if high is not None:
            lines.append(f"{src} {dst} 1")
        start = low + 1
    lines.append(f"{start} {start} {ID_END - start}")
    return "\n".join(lines) + "\n"


def folder_open(path: str, dev: int, ino: int) -> int:
    """An O_PATH fd of a task's folder, reached from / without following any symlink, and
    still the very folder checked when the task was made (an owner who swapped a part of the
    path for a symlink since gets an error, not /etc)."""
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = OpenHow(os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, 0,
                      RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        fd = syscall("openat2", SYS_OPENAT2, root, os.fsencode(path.lstrip("/")),
                     ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    finally:
        os.close(root)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino):
        os.close(fd)
        raise SysError(f"folder {path}", errno.ESTALE, "it is not the folder the task was "
                       "given (replaced since)")
    return fd


def folder_read(info: dict[str, Any]) -> int:
    """A readable fd of a task's real folder (info: its folderInfo), the very one it was
    given (folder_open)."""
    path_fd = folder_open(info["path"], info["dev"], info["ino"])
    try:
        return os.open(f"/proc/self/fd/{path_fd}/.", DIR_FLAGS)
    finally:
        os.close(path_fd)


def folder_overlays_open(spec: dict[str, Any]) -> list[tuple[str, int]]:
    """In the sandbox, as root: each folder's overlay (a detached mount fd) and its path.

    lower: the real folder, idmapped owner -> task (others as themselves); upper and work: on
    an idmapped clone of BOX_HOME, store -> task and 0 -> 0, as the view's."""
    out: list[tuple[str, int]] = []
    uid, gid = spec["uid"], spec["gid"]
    if not spec.get("folders"):
        return out
    store_ns = _store_userns(spec)
    try:
        for folder in spec["folders"]:
            ns = _idmap_userns(idmap_swap(folder["uid"], uid), idmap_swap(folder["gid"], gid))
            fd = folder_open(folder["path"], folder["dev"], folder["ino"])
            try:
                tree = syscall("open_tree", SYS_OPEN_TREE, fd, b"",
                               OPEN_TREE_CLONE | os.O_CLOEXEC | AT_EMPTY_PATH)
            finally:
                os.close(fd)
            held = [ns, tree]
            try:
                _idmap_set(tree, ns)
                # a clone of BOX_HOME per folder: the legacy way takes in the clones it gets
                held.append(syscall("open_tree", SYS_OPEN_TREE, -100, spec["boxHome"].encode(),
                                    OPEN_TREE_CLONE | os.O_CLOEXEC))
                _idmap_set(held[2], store_ns)
                out.append((folder["path"], overlay_open_at(
                    [(tree, "")], (held[2], folder["upper"]), (held[2], folder["work"]))))
            finally:
                for fd in held:
                    os.close(fd)
    finally:
        os.close(store_ns)
    return out


def _store_userns(spec: dict[str, Any]) -> int:
    """The user namespace of a task's clones of BOX_HOME: store -> task and 0 -> 0."""
    return _idmap_userns(f"0 0 1\n{spec['storeUid']} {spec['uid']} 1\n",
                         f"0 0 1\n{spec['storeGid']} {spec['gid']} 1\n")


def _idmap_set(tree: int, userns: int) -> None:
    attr = MountAttr(MOUNT_ATTR_IDMAP, 0, 0, userns)
    syscall("mount_setattr", SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)))


def folder_overlays_place(root: str, overlays: list[tuple[str, int]]) -> None:
    """Each folder's overlay at its real path inside the new root (its parents made there)."""
    for path, fd in overlays:
        try:
            os.makedirs(root + path, 0o755, exist_ok=True)
            syscall("move_mount", SYS_MOVE_MOUNT, fd, b"", -100, (root + path).encode(),
                    MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(fd)


# Reading an upper and the real folder: both beneath their roots, no symlink followed.

def _lstat_at(dir_fd: int | None, name: str) -> os.stat_result | None:
    return None if dir_fd is None else _entry(dir_fd, name)


def _parent_fd(root_fd: int, rel: str) -> int | None:
    """The directory holding rel, beneath root_fd, no symlink on the way; or None."""
    parent = os.path.dirname(rel)
    return open_dir_beneath(root_fd, parent) if parent else os.dup(root_fd)


def _at_parent(root_fd: int, rel: str, read: Callable[[int | None, str], Any]) -> Any:
    """read(fd of rel's folder or None, rel's name), beneath root_fd."""
    fd = _parent_fd(root_fd, rel)
    try:
        return read(fd, os.path.basename(rel))
    finally:
        if fd is not None:
            os.close(fd)


def real_lstat(root_fd: int, rel: str) -> os.stat_result | None:
    return _at_parent(root_fd, rel, _lstat_at)


class Change(NamedTuple):
    """One entry of a folder's upper: what the task left at path (relative to the folder).
    upper_changes holds them as plain tuples, which the garbage collector stops tracking (a
    subclass it tracks always), and makes each Change as it is read: a task's million entries
    held as objects made each full collection walk them all (150-290 ms, the GIL held: the
    loop's longest wait while a 1M-file folder was listed)."""

    path: str
    kind: str          # file, dir, symlink, delete, other (a fifo, socket or device), deep
    mode: int
    origin: bool       # copied up from the real folder (it was there after the start)
    opaque: bool       # a directory that hides the real one (the task replaced it)
    size: int = 0
    handle: bytes | None = None   # a file's origin xattr: overlay's handle of the real file


def upper_changes(upper: str, cap: ListingCap | None = None) -> Iterator[Change]:
    """Every entry of an upper, parents before children, sorted by path.  A directory that
    is only there because something below it changed is listed too (kind dir, not opaque,
    with origin): keep makes sure it still exists.  A folder whose path passes KEEP_PATH_MAX
    bytes is listed (kind deep), never walked into: a chain of long names thousands deep would
    cost gurtd gigabytes of paths (each entry's whole path) and can be read by no tool anyway.
    Each entry and each folder's names charged to cap (its own if None): a task's millions of
    files are a 413, not gigabytes (1,000,000 empty files held 680 MB in one request)."""
    out: list[tuple[Any, ...]] = []
    cap = cap or folders_cap()

    def change(fd: int, name: str, st: os.stat_result, parents: list[str]) -> bool:
        path = "/".join([*parents, name])
        if stat.S_ISDIR(st.st_mode):
            kind = "deep" if len(path.encode(errors="surrogateescape")) > KEEP_PATH_MAX else "dir"
        else:
            kind = "delete" if is_whiteout(st) else "file" if stat.S_ISREG(st.st_mode) else \
                "symlink" if stat.S_ISLNK(st.st_mode) else "other"
        origin = None if kind in ("delete", "deep") else _xattr(fd, name, ORIGIN_XATTR)
        out.append((path, kind, 0 if kind == "delete" else stat.S_IMODE(st.st_mode),
                    origin is not None, kind == "dir" and _opaque_child(fd, name),
                    0 if kind in ("delete", "deep", "dir") else st.st_size,
                    None if kind == "dir" else origin))
        cap.charge(sys.getsizeof(path) + CHANGE_RECORD_BYTES +
                   (0 if origin is None else sys.getsizeof(origin)))
        return kind == "dir"

    with moved_is_409(), contextlib.suppress(FileNotFoundError), dropped_on_error(out):
        tree_visit(upper, change, folders=True, cap=cap)
    return _changes_of(sorted_in_slices(out, key=lambda c: c[0].split("/")))


def _changes_of(rows: list[tuple[Any, ...]]) -> Iterator[Change]:
    """Each row as a Change, in order, let go as it is read (and the rest a slice at a time
    when the reader stops: a 413 while a million were read let go of them in one call)."""
    rows.reverse()
    try:
        while rows:
            yield Change._make(rows.pop())
    finally:
        drop_in_slices(rows)


def folders_cap() -> ListingCap:
    """The cap of one listing of a personal task's folder changes (for the changes, the diff
    or a keep): nowhere else has them (the task's archive is its workspace layer)."""
    return ListingCap("the changes to the task's folders", "they can be neither listed, "
                      "diffed nor kept here, and nothing was changed (undo drops them)")


def change_name(change: Change, real: os.stat_result | None) -> str | None:
    """added, modified or deleted against the real path now; None: nothing would change."""
    if change.kind == "delete":
        return "deleted" if real is not None else None
    if change.kind == "dir" and not change.opaque and real is not None and \
            stat.S_ISDIR(real.st_mode):
        return None                    # a folder the task only wrote into
    return "modified" if real is not None else "added"


def _tree_conflict(root_fd: int, rel: str, start: int, uid: int) -> str | None:
    """The first path under the real folder rel changed since start, or None; TOO_DEEP if
    the folder is deeper than a keep can save it (walked whole to know: keep copies it);
    STICKY_HELD if it holds another user's entry in a sticky folder not the owner's (uid),
    which the owner could not remove."""
    fd = open_dir_beneath(root_fd, rel)
    if fd is None:
        return None
    changed: str | None = None
    deep = held = False

    def check(dir_fd: int, name: str, st: os.stat_result, parents: list[str]) -> bool:
        nonlocal changed, deep, held
        if changed is None and st.st_ctime_ns >= start:
            changed = "/".join([rel, *parents, name])
        deep = deep or stat.S_ISDIR(st.st_mode) and len(parents) + 1 >= SAVE_DEPTH_MAX
        if st.st_uid != uid and not held:
            folder = os.fstat(dir_fd)
            held = bool(folder.st_mode & stat.S_ISVTX) and folder.st_uid != uid
        return not deep

    try:
        tree_visit(fd, check, folders=True)
    except OSError:                  # a folder moved meanwhile: the owner is at work in it
        return rel
    finally:
        os.close(fd)
    return TOO_DEEP if deep else STICKY_HELD if held else changed


def change_conflict(lookup: RealLookup, change: Change, start: int,
                    owner: tuple[int, list[int]]) -> str | None:
    """Why keeping this change would clobber the owner's work or is not allowed; or None."""
    if change.kind == "other":
        return "a fifo, socket or device file is never kept"
    if change.kind == "deep":
        return f"a folder whose path is longer than {KEEP_PATH_MAX} bytes is never kept"
    if change.kind in ("file", "dir") and change.mode & (stat.S_ISUID | stat.S_ISGID):
        return "set-uid or set-gid bits are never kept"
    real = lookup.lstat(change.path)
    parent = os.path.dirname(change.path)
    soft = None              # the owner's edit: force overrides it, never what follows it
    if real is None:
        on_way = _on_the_way(lookup, parent)
        if on_way:
            return on_way
        if change.kind == "delete" or change.origin and \
                not _origin_untouched(lookup.root_fd, change.handle, start):
            soft = "deleted by the owner after the task started"
    elif change.kind == "dir" and not change.opaque and stat.S_ISDIR(real.st_mode):
        return None            # a folder the task wrote into: its entries are checked alone
    elif real.st_ctime_ns >= start:
        soft = "changed by the owner after the task started" if change.origin or \
            change.kind == "delete" else "created by the owner after the task started"
    if real is not None and stat.S_ISDIR(real.st_mode) and \
            (change.kind != "dir" or change.opaque):
        changed = _tree_conflict(lookup.root_fd, change.path, start, owner[0])
        if changed == TOO_DEEP:
            return f"a folder more than {SAVE_DEPTH_MAX} levels deep is never replaced or " \
                   "deleted (keep could not save it for undo)"
        if changed == STICKY_HELD:
            return "the folder holds another user's file in a sticky folder: its owner may " \
                   "not delete it"
        if changed and soft is None:
            soft = f"{changed} changed by the owner after the task started"
    if change_name(change, real) is not None and not _owner_may_write(lookup, parent, owner):
        return "the folder's owner may not write in this folder"
    if real is not None and change_name(change, real) is not None and \
            _sticky_refuses(lookup.folder(parent), real, owner[0]):
        return "the folder is sticky and the file is another user's: its owner may not " \
               "replace or delete it"
    return soft


def _origin_untouched(root_fd: int, handle: bytes | None, start: int) -> bool:
    """Whether the real file that a task's file at a new path was copied up from (handle: its
    origin xattr, overlay's struct ovl_fb: version, magic 0xfb, length, flags, handle type,
    the file system's uuid, then the kernel's file handle) still has a name and has not been
    changed since start: then the path is a name the task gave it (`mv`, `ln`), not one the
    owner deleted.  A rename or unlink by the owner sets the file's ctime, so a name the
    owner took away fails the test.  Any doubt (no handle, another shape, gone): False."""
    if handle is None or len(handle) <= OVL_FB_HEADER or handle[1] != 0xFB or \
            handle[2] != len(handle):
        return False
    fid = handle[OVL_FB_HEADER:]
    found = ctypes.create_string_buffer(struct.pack("Ii", len(fid), handle[4]) + fid)
    fd = libc().open_by_handle_at(root_fd, found, os.O_PATH | os.O_CLOEXEC)
    if fd < 0:
        return False
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_nlink > 0 and st.st_ctime_ns < start


def _sticky_refuses(st: os.stat_result | None, real: os.stat_result, uid: int) -> bool:
    """Whether the kernel would refuse the owner replacing or removing real in the folder of
    lstat st: a sticky folder lets only the entry's owner or the folder's owner do that."""
    return st is not None and bool(st.st_mode & stat.S_ISVTX) and uid not in (st.st_uid,
                                                                               real.st_uid)


class RealLookup:
    """The real folder as one check sees it: each folder above the changed paths looked up
    once.  The check of a new path asks about the nearest folder above it that exists; asked
    level by level from the path up, a new folder 2,000 deep cost 2,000 x 2,000 lookups, each
    a walk from the top (a 1,200-deep one took ~30 s on the loop)."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.folders: dict[str, os.stat_result | None] = {"": os.fstat(root_fd)}
        self.nearest_of: dict[str, str] = {}     # a missing folder -> the nearest one above

    def lstat(self, rel: str) -> os.stat_result | None:
        return real_lstat(self.root_fd, rel) if rel else self.folders[""]

    def folder(self, rel: str) -> os.stat_result | None:
        """lstat of a path that holds changes (a parent), looked up once."""
        if rel not in self.folders:
            self.folders[rel] = real_lstat(self.root_fd, rel)
        return self.folders[rel]

    def nearest(self, parent: str) -> tuple[str, os.stat_result | None]:
        """The nearest path at or above parent that exists ("": the folder itself), its lstat."""
        walked = []
        while parent and parent not in self.nearest_of and self.folder(parent) is None:
            walked.append(parent)
            parent = os.path.dirname(parent)
        found = self.nearest_of.get(parent, parent)
        for path in walked:
            self.nearest_of[path] = found
        return found, self.folders[found]


def _on_the_way(real: RealLookup, parent: str) -> str | None:
    """A symlink or a file where the path needs a folder (the nearest that exists)."""
    near, st = real.nearest(parent)
    if not near or st is None or stat.S_ISDIR(st.st_mode):
        return None
    return f"{near} is a symlink in the real folder" if stat.S_ISLNK(st.st_mode) else \
        f"{near} is not a folder"


def _owner_may_write(real: RealLookup, parent: str, owner: tuple[int, list[int]]) -> bool:
    """Whether the owner could add and remove entries in the nearest existing real folder of
    parent (its mode bits for the owner's uid and groups; a folder keep makes is the owner's)."""
    st = real.nearest(parent)[1]
    if st is None or not stat.S_ISDIR(st.st_mode):
        return False
    return _owner_bits(st, owner) & 0o3 == 0o3


def _owner_bits(st: os.stat_result, owner: tuple[int, list[int]]) -> int:
    """The rwx bits of st's mode that apply to the owner (uid, groups), as the kernel picks."""
    uid, gids = owner
    if st.st_uid == uid:
        return (st.st_mode >> 6) & 0o7
    return (st.st_mode >> 3) & 0o7 if st.st_gid in gids else st.st_mode & 0o7


KeptOwner = tuple[int, list[int], int]   # a folder's owner: uid, groups, primary gid


def kept_owner(owner: KeptOwner, real: os.stat_result | None,
               pst: os.stat_result) -> tuple[int, int]:
    """Who a kept file, symlink or folder belongs to: never root (or anyone) because of where
    it lands.  One that replaces a regular file the owner may write keeps that file's owner
    and group (the owner could have written it in place); any other is the owner's, as one
    the owner made there would be (the folder's group where the folder is set-gid, as the
    kernel does).  So a root-owned file the owner could only replace comes back the owner's,
    never root's with the task's content."""
    if real is not None and stat.S_ISREG(real.st_mode) and \
            (real.st_uid == owner[0] or _owner_bits(real, owner[:2]) & 0o2):
        return real.st_uid, real.st_gid
    return owner[0], pst.st_gid if pst.st_mode & stat.S_ISGID else owner[2]


# Copies beneath directory fds: the originals a keep overwrites go under BOX_HOME, and back.

def _entry_keep(src_dir: int, src: str, dst_dir: int, dst: str) -> None:
    """An original saved (or put back): a file that has no other name is hard-linked, as
    keep and undo never write into an inode, only rename a new one over its name, so the
    saved name holds the very original (content, times, xattrs) at the cost of one link; a
    folder, a file with other names and another file system get a copy."""
    st = os.stat(src, dir_fd=src_dir, follow_symlinks=False)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        try:
            os.link(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
    _entry_copy(src_dir, src, dst_dir, dst)


def _entry_remove(dir_fd: int, name: str, aside: str) -> None:
    """Remove an entry (a folder with all it holds): first renamed aside, so that a crash
    leaves the name either whole or gone; nothing if it is not there."""
    st = _lstat_at(dir_fd, name)
    if st is None:
        return
    if name != aside:
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    if stat.S_ISDIR(st.st_mode):
        tree_remove(f"/proc/self/fd/{dir_fd}/{aside}")
    else:
        os.unlink(aside, dir_fd=dir_fd)


def _rename_over(parent: int, tmp: str, name: str, aside: str, folder: bool) -> None:
    """tmp renamed over name in parent; a folder there (folder) is first renamed aside (a
    rename over a folder is refused), and what went aside is removed."""
    if folder:
        os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)
    os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
    _entry_remove(parent, aside, aside)


def _syncfs(fd: int) -> None:
    libc_call("syncfs", fd)


class Under:
    """Which paths lie below one of some folders ((folder number, path) pairs), for paths
    asked parents first (as upper_changes lists them), a folder added before anything in it
    is asked: each answer is its parent's, worked out once.  A task's 50,000 new folders
    must not cost 50,000 x 50,000 comparisons, nor a chain 2,000 deep 2,000 parents for each
    of its 2,000 levels (os.path.dirname of every one of them took 29 s)."""

    def __init__(self, folders: set[tuple[int, str]] | None = None) -> None:
        self.known: dict[tuple[int, str], bool] = dict.fromkeys(folders or (), True)

    def add(self, n: int, path: str) -> None:
        self.known[(n, path)] = True

    def below(self, n: int, path: str) -> bool:
        """Whether a folder above path (in folder n) is one of them."""
        walked, parent = [], os.path.dirname(path)
        while parent and (n, parent) not in self.known:
            walked.append(parent)
            parent = os.path.dirname(parent)
        answer = bool(parent) and self.known[(n, parent)]
        for folder in walked:
            self.known[(n, folder)] = answer
        return answer


def _folders_above(paths: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Every folder that holds one of paths, each found once (not paths x earlier keeps)."""
    out: set[tuple[int, str]] = set()
    for n, path in paths:
        parent = os.path.dirname(path)
        while parent and (n, parent) not in out:
            out.add((n, parent))
            parent = os.path.dirname(parent)
    return out


def kept_op(obj: dict[str, Any]) -> dict[str, Any]:
    """json.loads' object_hook for kept.json and the journals: an op's after as a tuple.  The
    hook is Python code between the objects (the GIL let go there), and a tuple of ints, then
    its op, the garbage collector stops walking: kept.json of 200,000 ops was read in one C
    call of 430-560 ms, most of it collections walking its lists and the dicts holding them."""
    after = obj.get("after")
    if type(after) is list:
        obj["after"] = tuple(after)
    return obj


class Review:
    """The folders of personal tasks: their uppers, the review (keep, conflicts, undo of a
    keep), the diff and the changes.  Box only wires it.  Keep and undo of a keep are jobs of
    the review thread, one at a time (the one writer of the real folders), which the HTTP
    thread that asked waits for; what they change of a Task is set on the loop (settle).  The
    diff and the changes are read in the HTTP thread."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.upper_fds: dict[int, int] = {}     # the uppers of the task being kept
        self.jobs: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = \
            queue.Queue()
        self.thread: threading.Thread | None = None
        self.thread_lock = threading.Lock()
        self.cut_short: list[tuple[Task, str]] = []   # journals found at start (recover)
        self.keep_max = env_count("GURT_KEEP_MAX_CHANGES", KEEP_MAX_CHANGES)

    # the review thread
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Any thread: fn(*args) runs in the review thread after the jobs before it (the
        thread starts with the first job); its future."""
        future: Future[Any] = Future()
        self.jobs.put((fn, args, future))
        with self.thread_lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run_jobs, name="review",
                                               daemon=True)
                self.thread.start()
        return future

    def run_jobs(self) -> None:
        """The review thread: each job in turn, its answer or error handed to who waits.  A
        job that gurtd's exit cuts short is a crash as far as the disk is concerned: its
        journal is finished at the next start."""
        while True:
            fn, args, future = self.jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def settle(self, task: Task, review: str, action: str, text: str,
               extra: dict[str, Any] | None = None) -> None:
        """Loop: a keep's or an undo's end in the Task (its review saved), announced."""
        task.review = review
        self.box.save(task)
        self.announce(task, action, text, extra)

    def dir(self, task_id: str, *parts: str) -> str:
        return self.box.path("review", task_id, *parts)

    def upper(self, task_id: str, n: int) -> str:
        return self.dir(task_id, f"f{n}", "upper")

    # a task's start and end
    def prepare(self, task: Task, spec: dict[str, Any]) -> None:
        """The task's uppers and work dirs (store-owned), and the folders in its spec."""
        base = self.dir(task.id)
        tree_remove(base)                       # a start cut short by a crash
        os.makedirs(base, 0o700)
        spec["folders"] = []
        for n, info in enumerate(task.folderInfo or []):
            for sub in (f"f{n}", f"f{n}/upper", f"f{n}/work"):
                folder_ensure(os.path.join(base, sub), 0o755)
                os.chown(os.path.join(base, sub), self.box.store_uid, self.box.store_gid)
            spec["folders"].append(dict(info, upper=f"review/{task.id}/f{n}/upper",
                                        work=f"review/{task.id}/f{n}/work"))
        task.folderStartNs = time.time_ns() - CLOCK_SLACK_NS

    def forget(self, task: Task) -> None:
        """A task whose folder changes will never be kept (failed, undone): its uppers and
        saved originals go, renamed to a trash name at once and deleted in the review thread
        (100,000 files take seconds); the next start deletes a trash name a crash left."""
        if not os.path.lexists(self.dir(task.id)):
            return
        trash = self.box.path("review", f"{REVIEW_TRASH}{task.id}-{secrets.token_hex(4)}")
        try:
            os.rename(self.dir(task.id), trash)
        except OSError as exc:
            log(3, f"task {task.id}: could not remove its review files: {exc}")
            return
        self.submit(trash_remove, trash)

    def announce(self, task: Task, action: str, text: str,
                 extra: dict[str, Any] | None = None) -> None:
        """Loop: a keep, conflict or undo: a log line of the task's, one of gurtd's, an event."""
        entry = {"type": "review", "review": task.review, "action": action, "text": text}
        entry.update(extra or {})
        try:
            self.box.append_log(task.id, entry)
        except OSError as exc:
            log(3, f"task {task.id}: review log line lost: {exc}")
        log(6, f"task {task.id} review {action}: {text}")
        self.box.loop.emit("review", {"task": task.id, "review": task.review, "action": action,
                                      "text": text, **(extra or {})})
        self.box.loop.emit("task", task.to_api())

    # reading
    def owner(self, info: dict[str, Any]) -> tuple[int, list[int]]:
        import pwd
        try:
            name = pwd.getpwuid(info["uid"]).pw_name
            return info["uid"], os.getgrouplist(name, info["gid"])
        except KeyError:
            return info["uid"], [info["gid"]]

    def open_folder(self, info: dict[str, Any]) -> int:
        """folder_read's fd; 409 if the folder is not the one the task was given."""
        try:
            return folder_read(info)
        except SysError as exc:
            raise ApiError(409, f"folder {info['path']}: {exc.stderr or exc}",
                           "conflict") from None

    def pending(self, task: Task) -> Generator[tuple[int, Change, str], None, None]:
        """What keep would still apply: (folder number, change, added|modified|deleted), one
        at a time (a keep past its size stops reading; close() lets the folder go)."""
        applied = set(self.kept(task)["applied"])
        for n, info in enumerate(task.folderInfo or []):
            root = self.open_folder(info)
            try:
                for change in upper_changes(self.upper(task.id, n)):
                    if f"{n}:{change.path}" in applied:
                        continue
                    name = change_name(change, real_lstat(root, change.path))
                    if name is not None or change.kind == "delete" or change.origin:
                        yield n, change, name or "none"
            finally:
                os.close(root)

    def kept(self, task: Task) -> dict[str, Any]:
        try:
            data = load_json(self.dir(task.id, "kept.json"), hook=kept_op)
        except (OSError, ValueError):
            data = None
        return data if isinstance(data, dict) else {"applied": [], "keeps": []}

    # for the HTTP handlers (each in its own thread)
    def keep_request(self, task_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /api/tasks/{id}/keep: the keep done in the review thread; the Task after it."""
        task = self.box.loop.call(self.box.get, task_id)
        self.submit(self.keep, task, body).result()
        return self.box.loop.call(task.to_api)

    def undo_request(self, task_id: str, force: bool) -> None:
        """POST /api/tasks/{id}/undo, before the loop's part (Box.undo): a personal task's
        keeps undone in the review thread (409 if they cannot be).  The published JSON says
        whether it has folders (fixed at creation): a workspace task costs no loop round trip."""
        data = self.box.loop.task_json(task_id)
        if data is not None and json.loads(data).get("folders") is None:
            return
        task = self.box.loop.call(self.box.get, task_id)
        if task.folders:
            self.submit(self.undo, task, force).result()

    def sources(self, task_id: str) -> dict[str, Any]:
        """What the diff and the changes read, off the loop: a personal task's folders with
        their uppers, and its layer with the layers below (None once deleted)."""
        task = self.box.get(task_id)
        out: dict[str, Any] = {"folders": [], "layer": self.box.views.changes(task_id)}
        if task.folderInfo and task.review != "undone" and os.path.isdir(self.dir(task.id)):
            out["folders"] = [(info["path"], self.upper(task.id, n), info)
                              for n, info in enumerate(task.folderInfo)]
        return out

    # keep
    def keep(self, task: Task, body: dict[str, Any]) -> None:
        """Review thread: every pending change (or those under paths) applied to the real
        folders, or nothing and 409 with the conflicts."""
        if task.folders is None:
            raise ApiError(400, "not a personal task: it has no folders to keep")
        unknown = set(body) - {"force", "paths"}
        if unknown:
            raise ApiError(400, f"unknown field: {sorted(unknown)[0]}")
        force = body.get("force", False)
        paths = body.get("paths")
        if not isinstance(force, bool):
            raise ApiError(400, "force must be true or false")
        if paths is not None and (not isinstance(paths, list) or not paths or
                                  not all(isinstance(p, str) and p for p in paths)):
            raise ApiError(400, "paths must be a non-empty array of paths")
        if task.review not in ("pending", "conflict"):
            raise ApiError(409, f"the task's review is {task.review or 'not open'}: only a "
                                "pending or conflict review can be kept", "conflict")
        cut_short = load_json(self.dir(task.id, "journal.json"), hook=kept_op)
        if isinstance(cut_short, dict) and cut_short.get("action") == "keep":
            self.keep_guarded(task, cut_short)       # a keep a full disk cut short goes on
            return
        todo = self.todo(task, paths)
        if paths is not None:
            self.check_paths(task, todo, paths)
        conflicts = self.conflicts(task, todo)
        hard = [c for c in conflicts if "by the owner after" not in c["why"]]
        if conflicts and (hard or not force):
            self.box.loop.report(self.settle, task, "conflict", "conflict",
                                 f"{counted(len(conflicts), 'conflict')}, nothing kept",
                                 {"conflicts": conflicts[:1000]})     # the event, on the loop
            what = "; ".join(f"{c['folder']}/{c['path']}: {c['why']}" for c in conflicts[:3])
            raise ApiError(409, f"nothing was kept: {counted(len(conflicts), 'conflict')} ({what})"
                           + (" (force does not override these)" if force and hard else ""),
                           "conflict", extra={"conflicts": conflicts})
        ops = self.plan(task, todo)
        journal = {"id": secrets.token_hex(6), "action": "keep", "phase": "applying",
                   "ops": ops, "applied": [f"{n}:{c.path}" for n, c, _ in todo],
                   "partial": paths is not None}
        self.keep_guarded(task, journal)

    def keep_guarded(self, task: Task, journal: dict[str, Any]) -> None:
        """keep_run, its failures as answers: the journal stays, and the next keep (or the
        next start) goes on from it."""
        try:
            with saved_or_507("kept files (the keep goes on with the next keep)"):
                self.keep_run(task, journal)
        except SysError as exc:
            raise ApiError(409, f"the keep stopped: {exc.stderr or exc}; it goes on with the "
                                "next keep or at the next start", "conflict") from None

    @staticmethod
    def rel_in(folder: str, path: str) -> str | None:
        """path relative to folder: path is absolute (in it, or the folder itself: "") or
        relative to it; None if it is an absolute path elsewhere."""
        if path == folder:
            return ""
        if path.startswith(folder + "/"):
            return path[len(folder) + 1:].strip("/")
        return None if path.startswith("/") else path.strip("/")

    def selected(self, task: Task, item: tuple[int, Change, str], paths: list[str]) -> bool:
        """Whether a pending change is at or under one of paths, or a folder on the way to
        one (a new folder must be made before what is kept in it)."""
        n, change, _ = item
        for path in paths:
            rel = self.rel_in((task.folders or [])[n], path)
            if rel is None:
                continue
            if not rel or change.path == rel or change.path.startswith(rel + "/") or \
                    (change.kind == "dir" and rel.startswith(change.path + "/")):
                return True
        return False

    def check_paths(self, task: Task, todo: list[tuple[int, Change, str]],
                    paths: list[str]) -> None:
        """Each of paths names a pending change, or a folder with some under it: 400 if not."""
        for path in paths:
            if not any((rel := self.rel_in((task.folders or [])[n], path)) is not None and
                       (not rel or change.path == rel or change.path.startswith(rel + "/"))
                       for n, change, _ in todo):
                raise ApiError(400, f"paths: {path} is no pending change of the task")

    def todo(self, task: Task, paths: list[str] | None) -> list[tuple[int, Change, str]]:
        """The pending changes a keep applies (those under paths, if given); 413, nothing
        kept, as soon as the task's keeps would write more than keep_max paths in all."""
        out: list[tuple[int, Change, str]] = []
        more = max(self.keep_max - len(self.kept(task)["applied"]), 0)
        with contextlib.closing(self.pending(task)) as pending:
            for item in pending:
                if paths is None or self.selected(task, item, paths):
                    out.append(item)
                if len(out) > more:
                    raise ApiError(413, f"nothing was kept: more than {more} changes to keep, "
                                        f"and a task keeps at most {self.keep_max} paths in "
                                        "all (its keeps and their undo are read whole)" +
                                        ("; keep a part of them with paths" if more else ""),
                                   "too_large")
        return out

    def conflicts(self, task: Task, todo: list[tuple[int, Change, str]]) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        roots: dict[int, RealLookup] = {}
        owners = {}
        try:
            for n, change, _ in todo:
                info = (task.folderInfo or [])[n]
                if n not in roots:
                    roots[n], owners[n] = RealLookup(self.open_folder(info)), self.owner(info)
                why = change_conflict(roots[n], change, task.folderStartNs, owners[n])
                if why:
                    out.append({"folder": info["path"], "path": change.path, "why": why})
        finally:
            for lookup in roots.values():
                os.close(lookup.root_fd)
        return out

    def plan(self, task: Task, todo: list[tuple[int, Change, str]]) -> list[dict[str, Any]]:
        """The writes of a keep, parents first; each real entry a write replaces or deletes
        gets a place for its original (saved), unless a folder above it goes whole."""
        ops: list[dict[str, Any]] = []
        replaced = Under()
        keeps = len(self.kept(task)["keeps"])
        roots: dict[int, int] = {}
        try:
            for n, change, name in todo:
                if name == "none":
                    continue
                if n not in roots:
                    roots[n] = self.open_folder((task.folderInfo or [])[n])
                op: dict[str, Any] = {"folder": n, "path": change.path, "kind": change.kind,
                                      "mode": change.mode, "saved": None,
                                      "replace": change.opaque}
                under = replaced.below(n, change.path)
                real = real_lstat(roots[n], change.path)
                if real is not None and not under:
                    op["saved"] = f"{keeps}-{len(ops)}"
                    if change.kind != "dir" or change.opaque or not stat.S_ISDIR(real.st_mode):
                        op["replace"] = True
                        if stat.S_ISDIR(real.st_mode):
                            replaced.add(n, change.path)
                ops.append(op)
        finally:
            for fd in roots.values():
                os.close(fd)
        return ops

    def keep_run(self, task: Task, journal: dict[str, Any]) -> None:
        """The keep itself: the journal, then each write after its original is saved, then
        the record.  Run again by recover() on a journal a crash left behind: every step is
        repeatable, and an original is saved (under a temporary name, then renamed) before
        its path is written, so a saved original is always the one from before the keep."""
        path = self.dir(task.id, "journal.json")
        ops = journal["ops"]
        roots = {n: self.open_folder(info) for n, info in enumerate(task.folderInfo or [])}
        self.upper_fds = {n: os.open(self.upper(task.id, n), DIR_FLAGS) for n in roots}
        owners = {n: self.owner(info) + (info["gid"],)
                  for n, info in enumerate(task.folderInfo or [])}
        saved = -1
        try:
            crash_point("keep-planned")
            write_record(path, journal)
            os.makedirs(self.dir(task.id, "saved"), 0o700, exist_ok=True)
            saved = os.open(self.dir(task.id, "saved"), DIR_FLAGS)
            # every new file first, under its temporary name, and flushed in one go: the
            # renames then find no data to write (ext4 flushes a file renamed over another)
            ready = self.write_temps(task, roots, owners, ops)
            for fd in roots.values():
                _syncfs(fd)
            for i, op in enumerate(ops):
                if op["saved"] is not None:
                    self.save_original(roots[op["folder"]], saved, op)
                self.apply(task, roots[op["folder"]], owners[op["folder"]], op, i, i in ready)
                crash_point(f"keep-op-{i}")
            for fd in list(roots.values()) + [saved]:
                _syncfs(fd)
            self.keep_record(task, journal, roots)
        finally:
            for fd in list(roots.values()) + list(self.upper_fds.values()) + \
                    ([saved] if saved >= 0 else []):
                os.close(fd)
            self.upper_fds = {}
        left = [t for t in self.pending(task) if t[2] != "none"] \
            if journal.get("partial", True) else []
        self.box.loop.report(self.settle, task, "pending" if left else "kept", "kept",
                             f"kept {len(ops)} changes" +
                             (f"; {len(left)} still pending" if left else ""),
                             {"paths": [f"{(task.folders or [])[op['folder']]}/{op['path']}"
                                      for op in ops[:1000]]})
        os.unlink(path)
        fsync_dir(self.dir(task.id))

    def keep_record(self, task: Task, journal: dict[str, Any], roots: dict[int, int]) -> None:
        """kept.json gets this keep: its writes and what each path looked like right after
        (inode and ctime), for undo to see the owner's later changes.  Folders of earlier
        keeps that this one wrote into are looked at again."""
        record = self.kept(task)
        if record["keeps"] and record["keeps"][-1].get("id") == journal["id"]:
            return                                    # recorded before a crash
        for op in journal["ops"]:
            st = real_lstat(roots[op["folder"]], op["path"])
            op["after"] = None if st is None else (st.st_ino, st.st_ctime_ns)
        holding = _folders_above({(op["folder"], op["path"]) for op in journal["ops"]})
        for keep in record["keeps"]:
            for op in keep["ops"]:
                if op["kind"] == "dir" and (op["folder"], op["path"]) in holding:
                    st = real_lstat(roots[op["folder"]], op["path"])
                    op["after"] = None if st is None else (st.st_ino, st.st_ctime_ns)
        record["keeps"].append({"id": journal["id"], "at": now_iso(), "ops": journal["ops"]})
        record["applied"] = record["applied"] + journal["applied"]
        write_record(self.dir(task.id, "kept.json"), record)

    @staticmethod
    def save_original(root: int, saved: int, op: dict[str, Any]) -> None:
        """The real entry at op's path into saved/<op's name>, once: a saved name that exists
        is whole (it is renamed into place) and older than any write of this keep."""
        if _lstat_at(saved, op["saved"]) is not None:
            return
        parent = _parent_fd(root, op["path"])
        if parent is None:
            raise SysError("keep", errno.ENOENT, f"{op['path']}: its folder is gone")
        part = op["saved"] + ".part"
        try:
            _entry_remove(saved, part, part)
            _entry_keep(parent, os.path.basename(op["path"]), saved, part)
            if not stat.S_ISREG(os.stat(part, dir_fd=saved, follow_symlinks=False).st_mode) \
                    or os.stat(part, dir_fd=saved, follow_symlinks=False).st_nlink == 1:
                _syncfs(saved)                         # a copy: its data before the write
            os.rename(part, op["saved"], src_dir_fd=saved, dst_dir_fd=saved)
        finally:
            os.close(parent)

    def write_temps(self, task: Task, roots: dict[int, int], owners: dict[int, KeptOwner],
                    ops: list[dict[str, Any]]) -> set[int]:
        """The temporary files and symlinks of ops whose folder is there already (not one a
        folder op of this keep makes or replaces); their numbers."""
        ready, made = set(), Under({(op["folder"], op["path"]) for op in ops
                                    if op["kind"] in ("dir", "delete")})
        for i, op in enumerate(ops):
            if op["kind"] not in ("file", "symlink") or \
                    made.below(op["folder"], op["path"]):
                continue
            parent = _parent_fd(roots[op["folder"]], op["path"])
            if parent is None:
                continue
            try:
                tmp = f"{KEEP_TEMP}{task.id}-{i}"
                _entry_remove(parent, tmp, tmp)
                real, pst = _lstat_at(parent, os.path.basename(op["path"])), os.fstat(parent)
                self.write_temp(task, op, parent, tmp, kept_owner(owners[op["folder"]],
                                                                      real, pst))
                ready.add(i)
            finally:
                os.close(parent)
        return ready

    def apply(self, task: Task, root: int, owner: KeptOwner, op: dict[str, Any], i: int,
              ready: bool = False) -> None:
        """One write of a keep, repeatable: what the upper holds at op's path ends up at the
        real path, through a temporary name (ready: written already) and a rename, beneath
        the folder's fd."""
        rel, name = op["path"], os.path.basename(op["path"])
        parent = _parent_fd(root, rel)
        if parent is None:
            raise SysError("keep", errno.ENOENT, f"{rel}: its folder is gone or a symlink")
        tmp = f"{KEEP_TEMP}{task.id}-{i}"
        aside = tmp + "-old"
        try:
            for leftover in (aside,) if ready else (tmp, aside):
                _entry_remove(parent, leftover, leftover)
            real, pst = _lstat_at(parent, name), os.fstat(parent)
            if op["kind"] == "delete":
                _entry_remove(parent, name, aside)
                return
            if op["kind"] == "dir":
                if real is not None and stat.S_ISDIR(real.st_mode) and not op["replace"]:
                    return
                _entry_remove(parent, name, aside)
                os.mkdir(name, 0o700, dir_fd=parent)
                fd = os.open(name, DIR_FLAGS, dir_fd=parent)
                try:
                    os.fchown(fd, *kept_owner(owner, None, pst))
                    os.fchmod(fd, op["mode"] & 0o1777)
                finally:
                    os.close(fd)
                return
            if not ready:
                self.write_temp(task, op, parent, tmp, kept_owner(owner, real, pst))
            _rename_over(parent, tmp, name, aside,
                         real is not None and stat.S_ISDIR(real.st_mode))
        finally:
            os.close(parent)

    def write_temp(self, task: Task, op: dict[str, Any], parent: int, tmp: str,
                   owner: tuple[int, int]) -> None:
        """The upper's file or symlink at op's path, copied to tmp in the real folder."""
        upper = self.upper_fds.get(op["folder"], -1)
        src_dir = _parent_fd(upper, op["path"]) if upper >= 0 else None
        if src_dir is None:
            raise SysError("keep", errno.ENOENT, f"{op['path']}: not in the task's copy")
        name = os.path.basename(op["path"])
        try:
            if op["kind"] == "symlink":
                os.symlink(os.readlink(name, dir_fd=src_dir), tmp, dir_fd=parent)
                os.chown(tmp, *owner, dir_fd=parent, follow_symlinks=False)
                return
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                          dir_fd=src_dir)
            try:
                if not stat.S_ISREG(os.fstat(src).st_mode):
                    raise SysError("keep", errno.EINVAL, f"{op['path']}: not a regular file")
                dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                              os.O_CLOEXEC, 0o600, dir_fd=parent)
                try:
                    while os.sendfile(dst, src, None, 1 << 30):
                        pass
                    os.fchown(dst, *owner)
                    os.fchmod(dst, op["mode"] & 0o1777)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        finally:
            os.close(src_dir)

    # undo of a keep
    def undo(self, task: Task, force: bool) -> None:
        """Review thread: the real folders put back as they were before the keeps: 409
        (nothing changed) if the owner changed a kept path since, unless force.  A task with
        nothing kept only has its folder changes dropped (drop)."""
        if task.review not in ("kept", "pending", "conflict"):
            return
        cut_short = load_json(self.dir(task.id, "journal.json"), hook=kept_op)
        if isinstance(cut_short, dict) and cut_short.get("action") == "undo":
            with saved_or_507("restored files (the undo goes on with the next undo)"):
                self.undo_run(task, cut_short)
            return
        if isinstance(cut_short, dict) and cut_short.get("action") == "keep":
            self.keep_guarded(task, cut_short)   # finished, so that all of it is undone
        record = self.kept(task)
        if task.review != "kept" and not record["keeps"]:
            self.box.loop.report(self.drop, task)
            return
        if not force:
            conflicts = self.undo_conflicts(task, record)
            if conflicts:
                self.box.loop.report(self.announce, task, "conflict", "undo refused: "
                                     f"{counted(len(conflicts), 'kept path')} changed since "
                                     "the keep", {"conflicts": conflicts[:1000]})
                raise ApiError(409, f"nothing was undone: {counted(len(conflicts), 'kept path')} "
                                    "changed by the owner after the keep (undo with force "
                                    "puts the versions from before the keep back anyway)",
                               "conflict", extra={"conflicts": conflicts})
        ops = [op for keep in reversed(record["keeps"]) for op in reversed(keep["ops"])]
        with saved_or_507("restored files (the undo goes on with the next undo)"):
            self.undo_run(task, {"id": secrets.token_hex(6), "action": "undo", "ops": ops})

    def undo_conflicts(self, task: Task, record: dict[str, Any]) -> list[dict[str, str]]:
        out, roots = [], {}
        try:
            for keep in record["keeps"]:
                for op in keep["ops"]:
                    info = (task.folderInfo or [])[op["folder"]]
                    if op["folder"] not in roots:
                        roots[op["folder"]] = self.open_folder(info)
                    st = real_lstat(roots[op["folder"]], op["path"])
                    now = None if st is None else (st.st_ino, st.st_ctime_ns)
                    if now != op.get("after"):
                        why = ("deleted" if now is None else "created" if op.get("after") is
                               None else "changed") + " by the owner after the keep"
                        out.append({"folder": info["path"], "path": op["path"], "why": why})
        finally:
            for fd in roots.values():
                os.close(fd)
        return out

    def undo_run(self, task: Task, journal: dict[str, Any]) -> None:
        """The undo's writes, each path on its own: a path that cannot be put back (its
        folder a symlink or a file now, say) is named, the others are put back, and the
        journal stays: the task stays kept, the answer is 409 with the paths (notUndone), and
        the next undo (or start) runs the journal again, every step being repeatable."""
        path = self.dir(task.id, "journal.json")
        write_record(path, journal)
        roots = {n: self.open_folder(info) for n, info in enumerate(task.folderInfo or [])}
        saved = os.open(self.dir(task.id, "saved"), DIR_FLAGS) \
            if os.path.isdir(self.dir(task.id, "saved")) else -1
        failed: list[dict[str, str]] = []
        try:
            for i, op in enumerate(journal["ops"]):
                why = self.restore(task, roots[op["folder"]], saved, op, i)
                if why:
                    failed.append({"folder": (task.folders or [])[op["folder"]],
                                   "path": op["path"], "why": why})
                crash_point(f"undo-op-{i}")
            for fd in roots.values():
                _syncfs(fd)
        finally:
            for fd in list(roots.values()) + ([saved] if saved >= 0 else []):
                os.close(fd)
        if failed:
            self.undo_partial(task, failed)
        self.box.loop.report(self.settle, task, "undone", "undone", "the real folders are back "
                             f"as before the keep ({len(journal['ops'])} paths)")
        os.unlink(path)

    def drop(self, task: Task) -> None:
        """Loop, in undo: the folder changes of a task that has nothing kept are dropped (its
        keeps, if any, were undone first in the review thread: undo_request)."""
        if task.review not in ("kept", "pending", "conflict"):
            return
        if any(os.path.exists(self.dir(task.id, name)) for name in ("journal.json",
                                                                    "kept.json")):
            raise ApiError(409, "the task's changes were kept meanwhile: undo again to undo "
                                "that keep too", "conflict")
        task.review = "undone"
        self.announce(task, "undone", "the task's folder changes were dropped; the real "
                                      "folders were not touched")

    def undo_partial(self, task: Task, failed: list[dict[str, str]]) -> None:
        """An undo that could not put every path back: said in the log, an event and a 409."""
        what = "; ".join(f"{c['folder']}/{c['path']}: {c['why']}" for c in failed[:3])
        self.box.loop.report(self.announce, task, "undo-partial", f"{len(failed)} paths could "
                             f"not be put back ({what}); undo again to finish",
                             {"notUndone": failed[:1000]})
        raise ApiError(409, f"the undo could not put back {len(failed)} paths ({what}); the "
                            "others are back, the task stays kept, and the next undo tries "
                            "these again", "conflict", extra={"notUndone": failed[:1000]})

    def restore(self, task: Task, root: int, saved: int, op: dict[str, Any],
                i: int) -> str | None:
        """One path back as before the keep (its saved original, or nothing); repeatable.
        None when done; else why it could not be (what the disk refuses is raised)."""
        try:
            self.restore_path(task, root, saved, op, i)
        except SysError as exc:
            return str(exc.stderr or exc)
        except OSError as exc:
            if is_disk_error(exc):
                raise
            return f"{exc.strerror or exc}"
        return None

    def restore_path(self, task: Task, root: int, saved: int, op: dict[str, Any],
                     i: int) -> None:
        rel, name = op["path"], os.path.basename(op["path"])
        parent = _parent_fd(root, rel)
        if parent is None:
            on_way = _on_the_way(RealLookup(root), os.path.dirname(rel))
            if on_way is None and op["saved"] is None:
                return                     # its folder is gone, and the kept entry with it
            raise SysError("undo", errno.ENOTDIR, on_way or "its folder is gone: the original "
                           "has no place to go back to")
        tmp = f"{KEEP_TEMP}{task.id}-u{i}"
        aside = tmp + "-old"
        try:
            for leftover in (tmp, aside):
                _entry_remove(parent, leftover, leftover)
            if op["saved"] is None or saved < 0:
                _entry_remove(parent, name, aside)
                return
            _entry_keep(saved, op["saved"], parent, tmp)
            real = _lstat_at(parent, name)
            _rename_over(parent, tmp, name, aside, real is not None and (
                stat.S_ISDIR(real.st_mode) or stat.S_ISDIR(_lstat_at(parent, tmp).st_mode)))
        finally:
            os.close(parent)

    def recover(self) -> None:
        """At start (reconcile): the keeps and undos a crash cut short, for start; the review
        files of tasks failed by the restart and trash a crash left, deleted."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.box.path("review")):
                if name.startswith(REVIEW_TRASH):
                    self.submit(trash_remove, self.box.path("review", name))
        for task in self.box.tasks.values():
            path = self.dir(task.id, "journal.json")
            if not task.folderInfo:
                continue
            if os.path.exists(path):
                self.cut_short.append((task, path))
            elif task.state == "failed" and os.path.isdir(self.dir(task.id)):
                self.forget(task)          # failed by a restart: never kept

    def start(self) -> None:
        """Once the loop can take calls: the keeps and undos a crash cut short are finished in
        the review thread (a keep or an undo asked meanwhile waits for them)."""
        for task, path in self.cut_short:
            self.submit(self.finish_cut_short, task, path)
        self.cut_short = []

    def finish_cut_short(self, task: Task, path: str) -> None:
        """Review thread: a keep or an undo a crash cut short, finished from its journal."""
        try:
            journal = load_json(path, hook=kept_op)
            undo = journal["action"] == "undo"
            (self.undo_run if undo else self.keep_run)(task, journal)
            self.box.loop.report(self.announce, task, "recovered",
                                 f"{'an undo' if undo else 'a keep'} cut short by a restart "
                                 "was finished")
        except Exception as exc:
            log(3, f"task {task.id}: could not finish its keep or undo: "
                   f"{type(exc).__name__}: {exc}")


# The diff: unified, as git prints it (a/ and b/ paths), binary files and modes named.
# Bounded: difflib is quadratic (two orderings of a 600 KB file of 200,000 lines never ended),
# so a file's lines are diffed by GNU diff (linear in practice, its heuristics on), fed from
# memfds holding the copies read beneath the layer's or folder's fd (diff opens no path of the
# task's); small ones together, as numbered files of two 0700 folders under DIFF_TMP and one
# diff -r (a diff(1) a file was 2 ms each: 2.3 s for 1,000 files).  One answer has
# DIFF_SECONDS of work and DIFF_MAX_BYTES of text, spent in the files' order (the small files
# held back are diffed before a larger file after them); a file past its DIFF_FILE_SECONDS,
# or once those are spent, is named as changed with its sizes.  The work stops (diff killed)
# as soon as the client is gone.

DIFF_TEXT_MAX = 8 << 20              # a larger file is named, not shown line by line
DIFF_SECONDS = 30.0                  # one diff answer's work
DIFF_FILE_SECONDS = 10.0             # one file's diff(1)
DIFF_MAX_BYTES = 64 << 20            # the text of one diff answer
DIFF_PY_MAX = 64 << 10               # without diff(1): the bytes difflib may take (quadratic)
DIFF_BATCH_FILE = 64 << 10           # a pair of files up to this long is diffed with others
DIFF_BATCH_MAX = 8 << 20             # the bytes of pairs one diff -r takes,
DIFF_BATCH_FILES = 1000              # and the pairs (the budget is asked between batches)
DIFF_TMP = "/dev/shm"                # where its folders are (gurt-diff-PID-*), else the temp dir


class DiffStopped(ConnectionError):
    """The client of a diff is gone: its work ends (the handler takes it as a gone client)."""


@dataclass
class DiffBudget:
    """What one diff answer may still spend, and how to know its client left; and the small
    pairs of its files that are diffed together (later, flush, final)."""

    deadline: float = dataclasses.field(default_factory=lambda: time.monotonic() + DIFF_SECONDS)
    gone: Callable[[], bool] = lambda: False
    left: int = DIFF_MAX_BYTES
    pending: list[tuple[list[str], str, str, str, str, int, int]] = \
        dataclasses.field(default_factory=list)   # file_diff's small pairs, in order
    pending_bytes: int = 0
    parts: list[str] = dataclasses.field(default_factory=list)   # their texts, by marker

    def check(self) -> None:
        """DiffStopped once the client left (asked between files, and while diff runs)."""
        if self.gone():
            raise DiffStopped("the client of the diff is gone")

    def spent(self) -> bool:
        """Whether a further file gets its lines diffed (the client asked after first)."""
        self.check()
        return self.left <= 0 or time.monotonic() >= self.deadline

    def took(self, text: str) -> str:
        self.left -= len(text)
        return text

    def later(self, head: list[str], a: str, b: str, a_label: str, b_label: str,
              sizes: tuple[int, int]) -> str:
        """file_diff of a small pair of texts: a marker (\\0N\\0: no diff text has NUL) that
        final() replaces with its text, diffed with the others in one diff -r."""
        self.pending.append((head, a, b, a_label, b_label, *sizes))
        self.pending_bytes += sizes[0] + sizes[1]
        marker = f"\0{len(self.parts) + len(self.pending) - 1}\0"
        if self.pending_bytes >= DIFF_BATCH_MAX or len(self.pending) >= DIFF_BATCH_FILES:
            self.flush()
        return marker

    def flush(self) -> None:
        """The pending pairs diffed, in one diff -r if it can (those it did not finish each on
        its own), and their texts taken from the budget in order: spent, a pair is named as
        too costly."""
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        bodies = batch_diff([(p[1], p[2]) for p in pending], self) \
            if pending and not self.spent() else None
        for i, (head, a, b, a_label, b_label, *sizes) in enumerate(pending):
            body = bodies[i] if bodies is not None and self.left > 0 else None   # made in time
            if body is not None:
                body = f"--- {a_label}\n+++ {b_label}\n{body}"
            else:
                body = text_diff(a, b, a_label, b_label, self)
            self.parts.append(self.took(diff_part(head, body, a_label, b_label, sizes)))

    def final(self, text: str) -> str:
        """text with each marker replaced by its pair's diff."""
        self.flush()
        return self.filled(text)

    def final_bytes(self, parts: list[str]) -> bytes:
        """The answer: parts in UTF-8, each marker replaced, appended one part at a time to
        one bytearray (joined, then encoded, a task's 500,000 files were three fresh texts
        of 27 MB, each written in one C call that held the GIL 50-80 ms)."""
        self.flush()
        out = bytearray()
        for part in parts:
            out += self.filled(part).encode()
        return out                       # a bytes-like, taken as it is by a socket's write

    def filled(self, text: str) -> str:
        return re.sub("\0([0-9]+)\0", lambda m: self.parts[int(m[1])], text) \
            if self.parts and "\0" in text else text


def batch_diff(pairs: list[tuple[str, str]], budget: DiffBudget) -> list[str | None] | None:
    """The hunks of each pair (a, b), without their ---/+++ lines, from one diff -r -u of two
    folders of numbered files in a fresh 0700 folder under DIFF_TMP (removed after): None
    for a pair it did not show (or had not finished when its time ran out), None for all if
    it failed or printed what it should not."""
    tmp = DIFF_TMP if os.path.isdir(DIFF_TMP) else None
    try:
        root = tempfile.mkdtemp(prefix=f"gurt-diff-{os.getpid()}-", dir=tmp)
    except OSError as exc:
        log(4, f"diff: no folder for the small files ({exc}): each diffed on its own")
        return None
    try:
        for side in (0, 1):
            folder = os.path.join(root, "ab"[side])
            os.mkdir(folder, 0o700)
            for i, pair in enumerate(pairs):
                fd = os.open(os.path.join(folder, str(i)), os.O_WRONLY | os.O_CREAT |
                             os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    write_all(fd, pair[side].encode())
                finally:
                    os.close(fd)
        out, whole = _diff_run(["diff", "-u", "-r", os.path.join(root, "a"),
                                os.path.join(root, "b")], [], budget)
    except DiffStopped:                    # an OSError too, but no fault of /dev/shm
        raise
    except OSError as exc:                 # a full /dev/shm
        log(4, f"diff: the small files could not be written ({exc}): each diffed on its own")
        return None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if out is None:
        return None
    bodies: list[str | None] = [None] * len(pairs)
    head = re.compile(rf"--- {re.escape(root)}/a/([0-9]+)\t[^\n]*\n\+\+\+ [^\n]*\n")
    chunks = re.split(r"^diff -u -r [^\n]*\n", out, flags=re.M)[1:]
    for chunk in chunks if whole else chunks[:-1]:    # cut short: the last may be cut too
        m = head.match(chunk)
        if m is None or int(m[1]) >= len(pairs):
            return None
        bodies[int(m[1])] = chunk[m.end():]
    return bodies


def diff_temp_leftovers(own: bool = False) -> None:
    """At start: the folders of batch_diff that a gurtd killed in the middle left; at the
    stop (own): this gurtd's, of answers the stop cut short (HTTP threads are daemons)."""
    for path in glob.glob(os.path.join(DIFF_TMP, "gurt-diff-*-*")):
        pid = os.path.basename(path).split("-")[2]
        if is_digits(pid) and (int(pid) == os.getpid() if own else not pid_alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)


def text_diff(a: str, b: str, a_label: str, b_label: str, budget: DiffBudget) -> str | None:
    """The unified hunks (with --- and +++) of a against b; None if too costly to make."""
    if budget.spent():
        return None
    if shutil.which("diff") is None:
        if len(a) + len(b) > DIFF_PY_MAX:
            return None
        import difflib
        lines = difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True),
                                     a_label, b_label)
        return "".join(line if line.endswith("\n") else
                       line + "\n\\ No newline at end of file\n" for line in lines)
    fds = [os.memfd_create("gurt-diff", os.MFD_CLOEXEC) for _ in (a, b)]
    try:
        for fd, text in zip(fds, (a, b)):
            os.write(fd, text.encode())
        out, whole = _diff_run(["diff", "-u", "--label", a_label, "--label", b_label,
                                *(f"/dev/fd/{fd}" for fd in fds)], fds, budget)
        return out if whole else None
    finally:
        for fd in fds:
            os.close(fd)


def _diff_run(argv: list[str], fds: list[int], budget: DiffBudget) -> tuple[str | None, bool]:
    """diff(1)'s output (None if it failed) and whether it is whole: past its file's time or
    the answer's it is killed, and the output is what it printed until then (diff -r: the
    files it finished, and maybe part of one more).  DiffStopped if the client goes."""
    end = min(budget.deadline, time.monotonic() + DIFF_FILE_SECONDS)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, pass_fds=fds, env={"LC_ALL": "C"})
    try:
        while True:
            try:
                out, _ = proc.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if budget.spent() or time.monotonic() >= end:
                    proc.kill()
                    return proc.communicate()[0].decode(errors="replace"), False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return (out.decode(errors="replace") if proc.returncode in (0, 1) else None), True


def _read_entry(dir_fd: int | None, name: str, budget: DiffBudget | None = None
                ) -> tuple[str, int, bytes] | None:
    """(kind, mode, content) of an entry, no symlink followed: a symlink's content is its
    target; a fifo or device has none; a file once budget is spent is kind "unread", its
    content its size (a file of holes read whole was 8 MiB of zeros, ~10 ms, after the
    answer's time).  None if it is not there."""
    st = _lstat_at(dir_fd, name)
    if st is None or dir_fd is None or is_whiteout(st):
        return None
    if stat.S_ISLNK(st.st_mode):
        return "symlink", 0o120000, os.readlink(name, dir_fd=dir_fd).encode(errors="replace")
    if stat.S_ISDIR(st.st_mode):
        return "dir", 0o040000 | stat.S_IMODE(st.st_mode), b""
    if not stat.S_ISREG(st.st_mode):
        return "other", st.st_mode, b""
    if st.st_size > DIFF_TEXT_MAX:
        return "file", 0o100000 | stat.S_IMODE(st.st_mode), b"\0large"
    if budget is not None and budget.spent():
        return "unread", 0o100000 | stat.S_IMODE(st.st_mode), b"%d" % st.st_size
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        return "file", 0o100000 | stat.S_IMODE(st.st_mode), f.read(DIFF_TEXT_MAX + 1)


def _entry_at(root_fd: int, rel: str, budget: DiffBudget | None = None
              ) -> tuple[str, int, bytes] | None:
    return _at_parent(root_fd, rel, lambda fd, name: _read_entry(fd, name, budget))


_DIFF_ESCAPES = {7: "\\a", 8: "\\b", 9: "\\t", 10: "\\n", 11: "\\v", 12: "\\f", 13: "\\r",
                 34: '\\"', 92: "\\\\"}


def diff_name(name: str) -> str:
    """A path as git prints it in a diff: as it is, or C-quoted when it holds a control byte,
    a quote, a backslash or bytes that are not UTF-8 (a task's file name must not end a diff
    line early, forge a header, or make the diff unprintable)."""
    raw = os.fsencode(name)
    try:
        raw.decode()
        if not any(b < 32 or b == 127 or b in (34, 92) for b in raw):
            return name
    except UnicodeDecodeError:
        pass
    return '"' + "".join(_DIFF_ESCAPES.get(b) or (chr(b) if 32 <= b < 127 else f"\\{b:03o}")
                         for b in raw) + '"'


def file_diff(rel: str, old: tuple[str, int, bytes] | None,
              new: tuple[str, int, bytes] | None, budget: DiffBudget) -> str:
    """One path's part of a unified diff (empty if nothing differs); folders have none.  A
    small text's part is a marker until budget.final()."""
    old, new = (None if e is None or e[0] == "dir" else e for e in (old, new))
    unread = any(e is not None and e[0] == "unread" for e in (old, new))
    if old == new and not unread:
        return ""
    a_name, b_name = diff_name(f"a/{rel}"), diff_name(f"b/{rel}")
    head = [f"diff --git {a_name} {b_name}"]
    if old is None and new is not None:
        head.append(f"new file mode {new[1]:06o}")
    elif new is None and old is not None:
        head.append(f"deleted file mode {old[1]:06o}")
    elif old is not None and new is not None and old[1] != new[1]:
        head += [f"old mode {old[1]:06o}", f"new mode {new[1]:06o}"]
    a, b = (old or ("", 0, b""))[2], (new or ("", 0, b""))[2]
    a_label, b_label = a_name if old else "/dev/null", b_name if new else "/dev/null"
    if unread:                         # the budget is spent: named from the sizes alone
        sizes = [0 if e is None else int(e[2]) if e[0] == "unread" else len(e[2])
                 for e in (old, new)]
        return budget.took(diff_part(head, None, a_label, b_label, sizes))
    if a == b:
        return "\n".join(head) + "\n"
    try:
        if b"\0" in a or b"\0" in b:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "binary")
        a_text, b_text = a.decode(), b.decode()
    except UnicodeDecodeError:
        head.append(f"Binary files {a_label} and {b_label} differ")
        return "\n".join(head) + "\n"
    if len(a) + len(b) <= DIFF_BATCH_FILE and shutil.which("diff") is not None:
        return budget.later(head, a_text, b_text, a_label, b_label, (len(a), len(b)))
    budget.flush()        # the small files before this one spend the budget before it does
    body = text_diff(a_text, b_text, a_label, b_label, budget)
    return budget.took(diff_part(head, body, a_label, b_label, (len(a), len(b))))


def diff_part(head: list[str], body: str | None, a_label: str, b_label: str,
              sizes: list[int] | tuple[int, int]) -> str:
    """A file's part of a diff: its head and hunks, or (body None) a line saying it was too
    costly to diff."""
    if body is None:
        head = head + [f"Files {a_label} and {b_label} differ ({sizes[0]} -> {sizes[1]} "
                       "bytes: too costly to diff here)"]
    return "\n".join(head) + "\n" + (body or "")


def _wanted(rel: str, only: str | None) -> bool:
    return only is None or rel == only or rel.startswith(only.rstrip("/") + "/")


def folder_diff(folder: str, upper: str, info: dict[str, Any], only: str | None,
                budget: DiffBudget) -> list[str]:
    """A personal task's changes to one folder against the real folder as it is now: the
    parts of its text (for DiffBudget.final_bytes)."""
    try:
        real = folder_read(info)
    except (SysError, OSError) as exc:
        return [f"# folder {folder}: cannot be read: {exc}\n"]
    try:
        up = os.open(upper, DIR_FLAGS)
    except OSError:
        os.close(real)
        return []
    parts: list[str] = []
    replaced = Under()                       # folders the task replaced: their old entries
    try:
        for change in upper_changes(upper):
            budget.check()
            full = f"{folder}/{change.path}"
            under = replaced.below(0, change.path)
            if change.kind == "dir" and change.opaque:
                replaced.add(0, change.path)
            if not (_wanted(change.path, only) or _wanted(full, only)):
                continue
            if change.kind == "delete":
                parts.append("" if under else _tree_diff(real, change.path, budget))
            elif change.kind == "dir":
                if change.opaque and not under:
                    parts.append(_tree_diff(real, change.path, budget))
            else:
                old = None if under else _entry_at(real, change.path, budget)
                if old is not None and old[0] == "dir":
                    parts.append(_tree_diff(real, change.path, budget))
                parts.append(file_diff(change.path, old, _entry_at(up, change.path, budget),
                                       budget))
    finally:
        os.close(real)
        os.close(up)
    return [f"# folder {folder}\n", *parts] if any(parts) else []


def _tree_diff(root: int, rel: str, budget: DiffBudget) -> str:
    """Deletions of everything at and under rel in the real folder (a folder the task removed
    or replaced), in one walk: the folder may be thousands deep."""
    entry = _entry_at(root, rel, budget)
    if entry is None or entry[0] != "dir":
        return "" if entry is None else file_diff(rel, entry, None, budget)
    fd = open_dir_beneath(root, rel)
    if fd is None:
        return ""
    parts: list[str] = []
    try:
        with moved_is_409():
            tree_visit(fd, lambda dir_fd, name, st, parents: parts.append(file_diff(
                "/".join([rel, *parents, name]), _read_entry(dir_fd, name, budget), None,
                budget)))
    finally:
        os.close(fd)
    return "".join(parts)


def layer_diff(upper: str, lowers: list[str], only: str | None,
               budget: DiffBudget) -> list[str]:
    """A workspace task's layer against the layers below it (the first that has a path): the
    parts of its text."""
    parts: list[str] = []
    up = os.open(upper, DIR_FLAGS) if os.path.isdir(upper) else -1
    if up < 0:
        return parts
    lower_fds = [os.open(p, DIR_FLAGS) for p in lowers if os.path.isdir(p)]
    try:
        for change in changed_paths(upper, lowers):
            budget.check()
            rel = change["path"].rstrip("/")
            if change["path"].endswith("/") or not _wanted(rel, only):
                continue
            old = next((e for fd in lower_fds if (e := _entry_at(fd, rel, budget)) is not None),
                       None)
            new = None if change["change"] == "deleted" else _entry_at(up, rel, budget)
            parts.append(file_diff(rel, old, new, budget))
    finally:
        for fd in [up] + lower_fds:
            os.close(fd)
    return parts


def folder_change_list(task_folders: list[str], uppers: list[str],
                       infos: list[dict[str, Any]]) -> list[dict[str, str]]:
    """GET /api/tasks/{id}/changes for a task's folders: [{folder, path, change}].  One
    folders_cap for all of it: each folder's entries and each change listed charged to it."""
    out: list[dict[str, str]] = []
    cap = folders_cap()
    with dropped_on_error(out):
        for folder, upper, info in zip(task_folders, uppers, infos):
            try:
                root = folder_open(info["path"], info["dev"], info["ino"])
            except (SysError, OSError):
                continue
            try:
                for change in upper_changes(upper, cap):
                    name = change_name(change, real_lstat(root, change.path))
                    if name is not None:
                        path = change.path + ("/" if change.kind in ("dir", "deep") else "")
                        out.append({"folder": folder, "path": path, "change": name})
                        cap.charge(sys.getsizeof(path) + CHANGE_ENTRY_BYTES)
            finally:
                os.close(root)
    return out


# Layer stack ###################################################################################
###############################################################################################
# A workspace's view is its base under the layers of its done tasks, newest on top; overlay
# takes at most 500 lower layers, and a busy box passes 500 done tasks in a few weeks.  Why
# this design (issue 10), measured on kernel 6.18:
#   - Per-task nested overlays alone would cost ~4.6 ms per 500 layers at every start (an
#     idmapped mount OF an overlay is refused, so each inner overlay must be rebuilt per task
#     from idmapped layers).  Merged layers cost nothing at start and no data on disk.
#   - Groups: a workspace's tasks that ever became done, in finish order (doneSeq), are cut
#     into groups of `group` consecutive positions (LAYER_GROUP); the newest `keep` positions
#     (LAYER_KEEP) are never grouped, so undoing a recent task touches no merged layer.  An
#     undone task keeps its position: a group's range never moves.
#   - A merged layer stands for a group: a directory in layer format (hard links to the files,
#     symlinks and whiteouts of the group's layers; directories made anew with the top one's
#     owner, mode, xattrs and times; opaque where nothing below the group may show through)
#     that is exactly the group's layers stacked (with metacopy, redirect_dir and index off a
#     layer means its files, whiteouts and opaque directories, nothing else).  Layers are never
#     written after their task is done (its set-id bits are stripped before it is done), so
#     hard links are safe.  It is built once, off the loop (Merger), and never written again:
#     other members make a new generation under a new name, so running tasks keep theirs.
#   - A view's plan: a group whose merged layer has exactly its done layers as members takes
#     one lower; a group without one (not built yet, or one of its tasks was undone since: it
#     is dirty until the new generation is built) shows its remaining layers one by one, so an
#     undo answers at once.  Past the kernel's limit the oldest lowers and the base become an
#     inner overlay (depth 2), which is exact because the inner overlay holds everything below
#     it: its whiteouts and opaque directories have nothing left to hide.  Task start, the
#     files API and changes all use the same plan (view_plan).
#   - Registry: BOX_HOME/merged/<name>.json beside each merged layer's directory, written
#     atomically by the loop after the directory was renamed into place from its temp name
#     (one small file per merged layer: recording or deleting one costs the same at 10,000
#     layers).  At start, temp names, trash and merged directories without a record are
#     thrown away; no done layer is ever touched.
#   - A merged layer is deleted once it no longer matches its group and no running task and
#     no cached view uses it (Box.gc_layers).

LAYER_GROUP = 128                    # layers per merged layer
LAYER_KEEP = 64                      # the newest done layers are never merged
MERGED_DIR = "merged"                # under BOX_HOME: merged layers and their registry
MERGE_TEMP = ".tmp-"                 # a merged layer being built; thrown away at start
LAYER_BYTES_AGE = 30.0               # seconds a workspace's counted layer bytes are reused
GC_AFTER = 0.05                      # seconds a collection waits: one pass for a burst of undos
GC_RETRY = 1.0                       # seconds before a collection cut short is run again


def env_count(name: str, default: int) -> int:
    """A positive whole number from the environment (tests make groups small), else default."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


@dataclass
class MergedLayer:
    """One generation of a group's merged layer, as the registry records it."""

    name: str                        # BOX_HOME/merged/<name>
    workspace: str
    group: int
    members: list[str]               # the task ids it stands for, newest first

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def layer_groups(ever: list[str], group: int, keep: int) -> list[list[str]]:
    """The groups due for a merged layer: full runs of `group` positions of ever (the ids of
    a workspace's tasks that ever became done, oldest first) below the newest `keep`."""
    full = max(0, len(ever) - keep) // group
    return [ever[g * group:(g + 1) * group] for g in range(full)]


def view_plan(stack: list[str], group_of: dict[str, int],
              merged: dict[int, list[MergedLayer]]) -> list[str]:
    """The lowers of a view of stack (layer ids, newest first), newest first, as paths
    relative to BOX_HOME, base left out.  A group's merged layer stands in for its layers only
    when its members are exactly the group's layers in stack (they are consecutive there:
    both go by finish order); otherwise they come one by one.  A merged layer is matched by
    comparing its members with the stack where the group's run starts (its members are all of
    its group: a group's range never moves), so a plan of 10,000 layers in merged groups
    steps over each group at once instead of looking up every layer's group."""
    out: list[str] = []
    i = 0
    while i < len(stack):
        g = group_of.get(stack[i])
        found = [m for m in merged.get(g, []) if stack[i:i + len(m.members)] == m.members and
                 (i + len(m.members) == len(stack) or
                  group_of.get(stack[i + len(m.members)]) != g)] if g is not None else []
        if found:
            out.append(f"{MERGED_DIR}/{found[0].name}")
            i += len(found[0].members)
            continue
        j = i + 1
        while g is not None and j < len(stack) and group_of.get(stack[j]) == g:
            j += 1
        out.extend(lower_layer_paths(stack[i:j]))
        i = j
    return out


def fit_lowers(lowers: list[str], base: str, limit: int = MAX_LOWER_LAYERS) -> list[Any]:
    """lowers and then the base, as one overlay takes them: past the limit the oldest lowers
    and the base become an inner overlay (the last item, a list); 409 past twice the limit."""
    if len(lowers) + 1 <= limit:
        return lowers + [base]
    inner = lowers[limit - 1:] + [base]
    if len(inner) > limit:
        raise ApiError(409, f"the workspace's view needs {len(lowers) + 1} layers while its "
                            "merged layers are rebuilt; try again in a moment", "conflict")
    return lowers[:limit - 1] + [inner]


def flat_lowers(lowers: list[Any]) -> list[str]:
    """A fitted list of lowers, the inner overlay's layers in line (for walks and counts)."""
    return [p for item in lowers for p in (item if isinstance(item, list) else [item])]


def overlay_open_plan(dir_fd: int, lowers: list[Any], upper: str | None = None,
                      work: str | None = None) -> int:
    """A detached overlay of fitted lowers (fit_lowers), their paths relative to dir_fd (an
    idmapped clone of BOX_HOME for a task, BOX_HOME itself for people); an inner overlay is
    built from the same dir_fd, so it shows the same owners (overlay_open_at)."""
    def at(path: str | None) -> Layer | None:
        return (dir_fd, path) if path is not None else None

    return overlay_open_at([[(dir_fd, p) for p in item] if isinstance(item, list)
                            else (dir_fd, item) for item in lowers], at(upper), at(work))


def merge_layers(sources: list[str], dest: str, crash_at: str | None = None) -> None:
    """Make dest a layer exactly equal to sources (layer directories, newest first) stacked.

    dest must not exist; it is made here.  One walk of the sources and dest together (any
    depth, folders as (parent, name): whole paths of a chain of long names 6,000 deep would be
    gigabytes), each folder in the sources where it is visible; a merged folder takes its top
    layer's owner, mode, xattrs and times once nothing more is made inside it.
    """
    os.mkdir(dest, 0o700)
    out = len(sources)

    def merged(folder: WalkDir) -> None:
        _dir_meta(next(iter(folder.fds.values())), folder.fds[out], True)
        if crash_at:
            crash_point(crash_at)          # a test's kill -9 in the middle of a merge

    walk([*sources, dest], lambda folder, name: _merge_entry(folder.fds, out, name), merged,
         lambda folder: _names(list(folder.fds.values())))    # dest's folder is empty when listed


def _merge_entry(fds: dict[int, int], out: int, name: str) -> list[int] | None:
    """One name of a folder merged into fds[out]: the non-folder that shows hard-linked (a
    copy if its inode takes no more links: ext4 allows 65,000, overlay links a layer's
    whiteouts to one inode, and a task may link a file of its own 64,999 times), a folder
    made (opaque where nothing below the group may show through) and its layers answered."""
    winner, dirs, opaque = layers_down(fds, [layer for layer in fds if layer != out], name)
    if winner is not None:
        try:
            os.link(name, name, src_dir_fd=fds[winner[0]], dst_dir_fd=fds[out],
                    follow_symlinks=False)
        except OSError as exc:
            if exc.errno != errno.EMLINK:
                raise
            _entry_copy(fds[winner[0]], name, fds[out], name, exact=True)
        if is_whiteout(winner[1]):
            # Overlay hides whiteouts from a listing only in a directory it merges from
            # several layers or that carries an origin xattr (copied up); once merged, a
            # directory may come from one layer alone, so it gets the empty origin ("origin
            # unknown") that overlay's own copy-up gives.
            os.setxattr(fds[out], "trusted.overlay.origin", b"")
        return None
    if not dirs:
        return None
    os.mkdir(name, 0o700, dir_fd=fds[out])
    if opaque:
        os.setxattr(f"/proc/self/fd/{fds[out]}/{name}", "trusted.overlay.opaque", b"y")
    return dirs + [out]


def layer_bytes(tops: list[str]) -> int:
    """Bytes of disk under these layer directories, each inode counted once (a merged
    layer's hard links cost nothing but its directories).  No symlink followed."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top in tops:
        with contextlib.suppress(OSError):                # deleted meanwhile
            st = os.lstat(top)
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512 + tree_usage(top, seen)[0]
    return total


class LayerStack:
    """The merged layers of every workspace and the plans of views.  Loop thread only.

    Methods for Box: load() at start (throws away what a crash left half made), plan() the
    lowers of a view, due() the merges to build, record() a built one, unused() / forget()
    the generations nothing needs any more.
    """

    def __init__(self, home: str) -> None:
        self.home = home
        self.dir = os.path.join(home, MERGED_DIR)
        self.group = env_count("GURT_LAYER_GROUP", LAYER_GROUP)
        self.keep = env_count("GURT_LAYER_KEEP", LAYER_KEEP)
        self.merged: dict[str, MergedLayer] = {}
        self.gen = 0
        self.groups: dict[str, dict[str, int]] = {}   # workspace -> task id -> group
        self.ever: dict[str, list[str]] = {}     # workspace -> its ever-done ids, in order
        self.wanted_at: dict[str, tuple[list[str], dict[str, int], dict[int, list[str]]]] = {}

    def record_path(self, name: str) -> str:
        return os.path.join(self.dir, name + ".json")

    def load(self) -> None:
        """Read the registry (one record file per merged layer: a small write per merge or
        delete, whatever the number of layers); throw away temp builds, trash, merged
        directories without a record (a crash between the rename and the record) and records
        without a directory (a crash in the middle of a delete)."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        names = os.listdir(self.dir)            # temp files of records went at load
        for name in names:
            if not name.endswith(".json"):
                continue
            raw = load_json(os.path.join(self.dir, name))
            try:
                m = record_from(MergedLayer, raw, lambda m: isinstance(m.members, list) and
                                m.name + ".json" == name)
            except (TypeError, ValueError):
                continue
            if os.path.isdir(os.path.join(self.dir, m.name)):
                self.merged[m.name] = m
                self.gen = max(self.gen, int(m.name.split("-")[1]))
        for name in os.listdir(self.dir):
            if name.removesuffix(".json") not in self.merged:
                log(4, f"reconcile: throwing away the unfinished merged layer {name}")
                tree_remove(os.path.join(self.dir, name))

    def regroup(self, workspace: str, ever: list[str]) -> None:
        """The workspace's positions changed (a task became done): its groups again."""
        self.ever[workspace] = ever
        self.groups[workspace] = {t: g for g, ids in
                                  enumerate(layer_groups(ever, self.group, self.keep))
                                  for t in ids}

    def share_ids(self, workspace: str) -> None:
        """At start: the members of the workspace's merged layers made the very strings of its
        ever-done ids (read from other files: equal, not the same objects), so that a plan or
        a merge due compares them by identity, not 10,000 strings by their characters."""
        ids = {i: i for i in self.ever.get(workspace, [])}
        for m in self.merged.values():
            if m.workspace == workspace:
                m.members = [ids.get(i, i) for i in m.members]

    def by_group(self, workspace: str) -> dict[int, list[MergedLayer]]:
        out: dict[int, list[MergedLayer]] = {}
        for m in self.merged.values():
            if m.workspace == workspace:
                out.setdefault(m.group, []).append(m)
        return out

    def plan(self, workspace: str, stack: list[str]) -> list[str]:
        return view_plan(stack, self.groups.get(workspace, {}), self.by_group(workspace))

    def wanted(self, workspace: str, stack: list[str]) -> dict[int, list[str]]:
        """Each group's members as they should be merged now: its layers in the stack (in
        finish order, newest first, as every stack is).  There the group numbers never rise
        (the ungrouped newest lead), so each group's run is found by binary search: a few
        steps per group (a run is at most a group long), not a look-up per layer.  Kept for
        the same stack and groups (an undo's merges and collection both ask)."""
        group_of = self.groups.get(workspace, {})
        cached = self.wanted_at.get(workspace)
        if cached is not None and cached[0] is stack and cached[1] is group_of:
            return cached[2]
        top = len(group_of)                    # above every group's number: the ungrouped

        def key(task_id: str) -> int:
            return -group_of.get(task_id, top)

        out: dict[int, list[str]] = {}
        ungrouped = len(self.ever.get(workspace, [])) - len(group_of)     # they lead
        i = bisect.bisect_right(stack, -top, 0, max(0, min(len(stack), ungrouped)), key=key)
        while i < len(stack):
            g = group_of[stack[i]]
            j = bisect.bisect_right(stack, -g, i, min(len(stack), i + self.group), key=key)
            out[g] = stack[i:j]
            i = j
        self.wanted_at[workspace] = (stack, group_of, out)
        return out

    def unstacked(self, workspace: str, old: list[str], new: list[str], task_id: str) -> None:
        """An undo took task_id out of old, giving new: the groups wanted of new from those
        kept of old (one group's members less one), not a search of every group again."""
        group_of = self.groups.get(workspace, {})
        cached = self.wanted_at.get(workspace)
        if cached is None or cached[0] is not old or cached[1] is not group_of:
            return
        out, g = cached[2], group_of.get(task_id)
        if g in out:
            out = dict(out)
            out[g] = [i for i in out[g] if i != task_id]
            if not out[g]:
                del out[g]
        self.wanted_at[workspace] = (new, group_of, out)

    def due(self, workspace: str, stack: list[str]) -> list[tuple[int, list[str]]]:
        """The groups whose merged layer is missing or stale: (group, members newest first)."""
        have = self.by_group(workspace)
        return [(g, members) for g, members in sorted(self.wanted(workspace, stack).items())
                if not any(m.members == members for m in have.get(g, []))]

    def new_name(self, workspace: str, group: int) -> str:
        self.gen += 1
        return f"{group}-{self.gen}-{workspace}"

    def record(self, merged: MergedLayer) -> None:
        """A merged layer built and renamed into place: in the registry, durably."""
        write_json(self.record_path(merged.name), merged.to_json())
        self.merged[merged.name] = merged

    def unused(self, workspace: str, stack: list[str], pinned: set[str]) -> list[str]:
        """The workspace's merged layers that match no group now and that no view in pinned
        (paths relative to BOX_HOME) uses."""
        wanted = self.wanted(workspace, stack)
        return [m.name for m in self.merged.values() if m.workspace == workspace and
                wanted.get(m.group) != m.members and f"{MERGED_DIR}/{m.name}" not in pinned]

    def forget(self, names: list[str], remove: Callable[[str], None] = tree_remove) -> None:
        """Delete merged layers: out of the registry first, then their files by remove()
        under a trash name (a crash between leaves an unrecorded directory or a trash name,
        both thrown away at the next start)."""
        for name in names:
            self.merged.pop(name, None)
            os.unlink(self.record_path(name))
        fsync_dir(self.dir)
        for name in names:
            remove(trash_name(os.path.join(self.dir, name)))


def trash_name(path: str) -> str:
    """Rename path (a layer or merged layer nothing reads) to its trash name beside it, at
    once; the trash name, for Merger.remove."""
    trash = os.path.join(os.path.dirname(path), MERGE_TEMP + "trash-" + os.path.basename(path))
    os.rename(path, trash)
    return trash


def trash_sweep(directory: str) -> None:
    """At start: delete what a crash left under trash or temp names in directory (folders,
    or the finish-time merge's files: upper_put)."""
    for name in os.listdir(directory):
        if name.startswith(MERGE_TEMP):
            log(4, f"reconcile: deleting the leftover {name} in {directory}")
            tree_remove(os.path.join(directory, name))


STACK_INLINE = 32                    # a task's layers up to this many stay in its own file
STACK_REF_RE = re.compile(r"[0-9a-f]{32}")          # a stack file's name: stacks/<ref>.json


class StackStore:
    """Tasks' `layers` on disk, shared: BOX_HOME/stacks/<ref>.json, each written once, holds
    {"ids": [...], "parent": ref or null}: the stack is ids (newest first) and then the
    parent's stack.  A task that starts on the previous stack of its workspace with new
    layers on top stores only those; after an undo a stack is stored whole once.  So a task
    file stays small however many layers its task saw, and a year of tasks does not write
    their 10,000 ids at every save.  A stack is written before the task file that names
    it: one a crash left unnamed is deleted at the next start (orphans, Box.stacks_collect).
    Loop thread only."""

    def __init__(self, home: str) -> None:
        self.dir = os.path.join(home, "stacks")
        self.lists: dict[str, list[str]] = {}            # ref -> the stack, shared
        self.parents: dict[str, str | None] = {}         # ref -> its parent's, once read
        self.last: dict[str, tuple[str, list[str]]] = {}  # workspace -> latest (ref, stack)

    def ref(self, workspace: str, layers: list[str]) -> str:
        """The ref of this stack, stored durably if new."""
        last = self.last.get(workspace)
        if last is not None and last[1] is layers:
            return last[0]
        node: dict[str, Any] = {"ids": layers, "parent": None}
        if last is not None and 0 < len(last[1]) <= len(layers) and \
                layers[len(layers) - len(last[1]):] == last[1]:
            node = {"ids": layers[:len(layers) - len(last[1])], "parent": last[0]}
        text = json.dumps(node, separators=(",", ":")).encode()
        ref = hashlib.sha256(text).hexdigest()[:32]
        if ref not in self.lists:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            if not os.path.exists(os.path.join(self.dir, ref + ".json")):
                atomic_write(os.path.join(self.dir, ref + ".json"), text + b"\n")
                crash_point("stack-written")   # a test's kill -9: no task file names it yet
            self.lists[ref] = layers
            self.parents[ref] = node["parent"]
        self.last[workspace] = (ref, layers)
        return ref

    def stack(self, ref: str) -> list[str]:
        """The stack a ref names (ValueError if a file of its chain is missing or damaged);
        the same list object for every task of that ref."""
        chain: list[tuple[str, list[str]]] = []
        at: str | None = ref
        while at is not None and at not in self.lists:
            node = load_json(os.path.join(self.dir, at + ".json")) \
                if STACK_REF_RE.fullmatch(at) else None
            if not isinstance(node, dict) or not isinstance(node.get("ids"), list):
                raise ValueError(f"stack {at} is missing or damaged")
            chain.append((at, node["ids"]))
            self.parents[at] = node.get("parent")
            at = node.get("parent")
        below = self.lists[at] if at is not None else []
        for name, ids in reversed(chain):
            below = self.lists[name] = ids + below
        return self.lists[ref]

    def orphans(self, named: set[str]) -> list[str]:
        """The stack files (refs) that neither a ref of named nor one of their parents is:
        written for a task whose file a crash cut short (Box.stacks_collect).  Only the
        parents are read of a chain not loaded yet (a task's mergedOn): no stack is built.
        A parent that cannot be read ends its chain (stack() says it is lost when asked)."""
        reached: set[str] = set()
        todo = [ref for ref in named if STACK_REF_RE.fullmatch(ref)]
        while todo:
            ref = todo.pop()
            if ref in reached:
                continue
            reached.add(ref)
            if ref not in self.parents:
                with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
                    with open(os.path.join(self.dir, ref + ".json"), "rb") as f:
                        node = json.loads(f.read())
                    parent = node.get("parent") if isinstance(node, dict) else None
                    self.parents[ref] = parent if isinstance(parent, str) else None
            parent = self.parents.get(ref)
            if parent is not None and STACK_REF_RE.fullmatch(parent):
                todo.append(parent)
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(name[:-5] for name in names if name.endswith(".json") and
                      STACK_REF_RE.fullmatch(name[:-5]) and name[:-5] not in reached)


MERGE_SUPERSEDED = "superseded"      # a build dropped before it began (Merger.drop)
MERGE_QUIET = 0.1                    # seconds a build waits to begin (undos of a burst drop it)
MERGE_RETRY = 2.0                    # seconds before a failed build is tried again, doubled at
MERGE_RETRY_MAX = 300.0              # each failure of the same members up to this


class Merger:
    """The thread that builds merged layers, one at a time, never on the loop.  A job is
    (merged layer, source paths); done(merged, error) is called on the thread when it ends
    (Box hands it to the loop).  The build goes to a temp name and is renamed into place.
    A build the loop dropped before it began ends with MERGE_SUPERSEDED: a burst of undos
    in one group asks for a generation at each, and only the last is still wanted (each
    build of 128 layers takes ~60 ms of the interpreter from every other thread): a build
    begins MERGE_QUIET after it was asked for, so that a burst's undos drop all but the
    last before it begins, instead of each racing the next undo's answer."""

    def __init__(self, home: str, done: Callable[[MergedLayer, str | None], None]) -> None:
        self.dir = os.path.join(home, MERGED_DIR)
        self.done = done
        self.jobs: queue.Queue[tuple[MergedLayer, list[str], float] | str | None] = \
            queue.Queue()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.dropped: set[str] = set()           # names the loop dropped (set, add: atomic)

    def start(self) -> None:
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="merger", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Ends after the build in progress (a build cut short by exit is thrown away at the
        next start anyway)."""
        if self.thread is not None:
            self.stopping = True
            self.jobs.put(None)
            self.thread.join(timeout=5)
            self.thread = None

    def submit(self, merged: MergedLayer, sources: list[str]) -> None:
        self.jobs.put((merged, sources, time.monotonic() + MERGE_QUIET))

    def drop(self, name: str) -> None:
        """Loop: a build not wanted any more is not begun (it may have begun already)."""
        self.dropped.add(name)

    def remove(self, path: str) -> None:
        """Delete a tree that nothing reads any more, off the loop (undo must answer at once
        however big the layer).  The caller renamed it to a trash name first (trash_name):
        a crash leaves a trash name, which the next start deletes."""
        if self.thread is None:
            tree_remove(path)
        else:
            self.jobs.put(path)

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if isinstance(job, str):
                trash_remove(job)
                continue
            merged, sources, begin = job
            time.sleep(max(0.0, begin - time.monotonic()) if not self.stopping else 0.0)
            if self.stopping:
                continue                         # the jobs left are planned again at start
            temp = os.path.join(self.dir, MERGE_TEMP + merged.name)
            error = MERGE_SUPERSEDED if merged.name in self.dropped else None
            self.dropped.discard(merged.name)
            try:
                if error is None:
                    tree_remove(temp)
                    merge_layers(sources, temp, "merge-half-built")
                    os.rename(temp, os.path.join(self.dir, merged.name))
                    fsync_dir(self.dir)
                    crash_point("merge-renamed")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                with contextlib.suppress(OSError):
                    tree_remove(temp)
            try:
                self.done(merged, error)
            except Exception as exc:            # the loop is gone (stopping)
                log(4, f"merged layer {merged.name}: not handed over: {exc}")


class Views:
    """Views and the layer stack of every workspace, for the Box (loop thread unless said).

    Methods for callers: workspace_exists, workspace_create_dir; stack_ids (done tasks, newest
    first), ever_done; view_lowers (a task's or a person's plan), view_fd (a view
    for people), changes (what to walk for a task's changes); layers_changed (a task became
    done or undone), gc_layers (delete what no view uses; gc_soon: GC_AFTER later, once for
    a burst of undos, the loop's select waking for it: collect_wait; step_end runs it and an
    undo's merges due, plan_soon: GC_AFTER later too);
    plan_merges, merge_done (merger thread), merge_built, tick (failed builds again);
    layer_usage (any thread); load, start, stop, pin, close.
    """

    def __init__(self, box: Box) -> None:
        self.box = box
        self.open_views: dict[str, tuple[tuple[str, ...], int]] = {}   # workspace -> (stack, fd)
        self.lock = threading.Lock()
        self.layerstack = LayerStack(box.path())
        self.merger = Merger(box.path(), self.merge_done)
        self.merging: dict[str, MergedLayer] = {}         # being built, by name
        # a build that failed (a full disk): its failures and when it is tried again (inf:
        # being tried); members that changed since are another build
        self.merge_failed: dict[tuple[str, int, tuple[str, ...]], tuple[int, float]] = {}
        self.task_lowers: dict[str, list[str]] = {}      # a running task's view, flat
        # per workspace, published by the loop for GET /api/workspaces/{name}: (version,
        # merged layers, layer directories); and the bytes an HTTP thread counted for it
        self.layer_dirs: dict[str, tuple[int, int, list[str]]] = {}
        self.layer_bytes: dict[str, tuple[int, float, int]] = {}
        self.stack_now: dict[str, list[str]] = {}    # workspace -> stack_ids, until it changes
        self.undone_layers: set[str] = set()   # undone tasks whose layer gc_layers may delete
        self.collect_at = float("inf")         # monotonic time of the collection asked
        self.merges_due: set[str] = set()      # workspaces whose merges step_end plans
        self.plan_at = float("inf")            # monotonic time it plans them (plan_soon)

    def load(self) -> None:
        """At start, once the tasks are read: the merged layers' records, undone layers a
        crash left half deleted, each workspace's groups."""
        self.layerstack.load()
        trash_sweep(self.box.path("layers"))
        for name in {t.workspace for t in self.box.all_tasks()}:
            self.layerstack.regroup(name, self.ever_done(name))
            self.layerstack.share_ids(name)
            self.publish_layers(name)
        self.stack_now.clear()
        self.undone_layers = {t.id for t in self.box.all_tasks()
                              if t.state == "undone" and not t.layerDeleted}

    def start(self) -> None:
        """The merger thread, and the merges due since the last run, off the loop; the path
        sets of each view's layers read off the loop too, for the first undo."""
        self.merger.start()
        for name in sorted(self.layerstack.groups):
            self.plan_merges(name)
            plan = self.layerstack.plan(name, self.stack_ids(name))
            if len(plan) < MAX_LOWER_LAYERS:   # else merges are due: each warms its own
                self.box.finish_merge.warm(plan)

    def stop(self) -> None:
        self.merger.stop()

    def pin(self, task_id: str, lowers: list[Any]) -> None:
        """A task started on these lowers: gc_layers keeps them while it runs."""
        self.task_lowers[task_id] = flat_lowers(lowers)

    def close(self) -> None:
        """At stop: the cached views' fds closed."""
        with self.lock:
            for _, fd in self.open_views.values():
                os.close(fd)
            self.open_views.clear()

    def workspace_create_dir(self, name: str) -> None:
        path = self.box.path("workspaces", name)
        os.mkdir(path)
        folder_ensure(path, 0o755)
        os.chown(path, *self.box.store_owner())

    def workspace_exists(self, name: str) -> bool:
        return valid_workspace_name(name) and os.path.isdir(self.box.path("workspaces", name))

    def view_fd(self, workspace: str) -> int:
        """A new fd (the caller closes it) on the workspace's current view for people.

        Loop thread (it reads the tasks).  The base alone is the base directory; with layers
        it is a read-only detached overlay of the same plan a task would start on (the Layer
        stack), rebuilt when the plan changes.
        """
        stack = self.stack_ids(workspace)
        lowers = self.view_lowers(workspace, stack) if stack else []
        key = tuple(flat_lowers(lowers))
        with self.lock:
            cached = self.open_views.get(workspace)
            if cached and cached[0] == key:
                return os.dup(cached[1])
            if cached:
                os.close(cached[1])
                del self.open_views[workspace]
            if not stack:
                fd = os.open(self.box.path("workspaces", workspace),
                             os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            else:
                home = os.open(self.box.path(), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    fd = overlay_open_plan(home, lowers)
                finally:
                    os.close(home)
            self.open_views[workspace] = (key, fd)
            return os.dup(fd)

    def drop_view(self, workspace: str) -> None:
        with self.lock:
            cached = self.open_views.pop(workspace, None)
            if cached:
                os.close(cached[1])

    def ever_done(self, workspace: str) -> list[str]:
        """The workspace's tasks that ever became done (undone ones too), oldest first: the
        positions that make its groups."""
        done = [t for t in self.box.all_tasks() if t.workspace == workspace and t.doneSeq > 0]
        return [t.id for t in sorted(done, key=lambda t: t.doneSeq)]

    def stack_ids(self, workspace: str) -> list[str]:
        """The ids of the workspace's done tasks, newest first, from the finish order the
        Layer stack keeps (no sort of every task at each start, undo and collection).  One
        list until the layers change (layers_changed), which callers never change: the
        finish-time merge compares a task's stack with it at each end, at no cost while it
        is the same list."""
        stack = self.stack_now.get(workspace)
        if stack is None:
            ever = self.layerstack.ever.get(workspace, [])
            stack = self.stack_now[workspace] = [i for i in reversed(ever)
                                                 if self.box.get(i).state == "done"]
        return stack

    def view_lowers(self, workspace: str, layers: list[str]) -> list[Any]:
        """The lowers of a view of these layers (newest first) and the base, fitted to the
        kernel's limit; 409 while too many merged layers are being rebuilt at once."""
        return fit_lowers(self.layerstack.plan(workspace, layers), f"workspaces/{workspace}")

    def layers_changed(self, workspace: str, done: str | None = None,
                       undone: str | None = None) -> None:
        """A task of the workspace became done (its id in done: the groups again, it is the
        newest) or undone (its id in undone: the groups stay, an undone task keeps its
        position; the stack loses it, no rebuild from every task); its cached view dropped,
        the merges now due queued."""
        stack = old = self.stack_now.pop(workspace, None)
        if undone is not None:
            self.undone_layers.add(undone)
            k = self.position(stack, undone) if stack is not None else None
            if stack is not None and k is not None:
                stack = stack[:k] + stack[k + 1:]        # a new list: tasks keep theirs
                self.layerstack.unstacked(workspace, old, stack, undone)
            if stack is not None:
                self.stack_now[workspace] = stack
        if done is not None:
            ever = self.layerstack.ever.get(workspace)
            grows = ever is not None and done not in ever[-1:]
            self.layerstack.regroup(workspace, ever + [done] if ever is not None and grows
                                    else self.ever_done(workspace))
            if grows and stack is not None and self.box.get(done).state == "done":
                self.stack_now[workspace] = [done] + stack   # a new list: tasks keep theirs
        self.drop_view(workspace)
        if done is None:                  # an undo answers first: the merges a little later
            self.merges_due.add(workspace)
            self.plan_soon()
        else:
            self.plan_merges(workspace)
        self.publish_layers(workspace)

    def position(self, stack: list[str], task_id: str) -> int | None:
        """Where task_id is in stack (newest first, so by falling doneSeq), by binary search:
        a few look-ups, not a scan of 10,000 ids at each undo; None if it is not there."""
        seq = self.box.get(task_id).doneSeq
        k = bisect.bisect_left(stack, -seq, key=lambda i: -self.box.get(i).doneSeq)
        return k if seq > 0 and k < len(stack) and stack[k] == task_id else None

    def publish_layers(self, workspace: str) -> None:
        """For GET /api/workspaces/{name}: the workspace's merged layers, and a new version
        of what its layers hold (any thread reads it, one assignment)."""
        merged = [m.name for m in self.layerstack.merged.values() if m.workspace == workspace]
        old = self.layer_dirs.get(workspace, (0, 0, []))
        self.layer_dirs[workspace] = (old[0] + 1, len(merged), merged)

    def layer_usage(self, workspace: str) -> dict[str, int]:
        """mergedLayers and layerBytes of a workspace: its tasks' layer directories and its
        merged layers, counted in the calling HTTP thread (never the loop), again once the
        layers changed or LAYER_BYTES_AGE passed.  A layer deleted meanwhile counts 0."""
        version, count, merged = self.layer_dirs.get(workspace, (0, 0, []))
        cached = self.layer_bytes.get(workspace)
        if cached is None or cached[0] != version or \
                time.monotonic() - cached[1] > LAYER_BYTES_AGE:
            ids = [e[0] for e in self.box.loop.listed_in(workspace)]
            dirs = [os.path.join(self.box.path(), "layers", i) for i in ids] + \
                [os.path.join(self.box.path(), MERGED_DIR, name) for name in merged]
            cached = (version, time.monotonic(), layer_bytes(dirs))
            self.layer_bytes[workspace] = cached
        return {"mergedLayers": count, "layerBytes": cached[2]}

    def plan_merges(self, workspace: str) -> None:
        """Hand the merges due in workspace to the merger thread (once it runs)."""
        if self.merger.thread is None:
            return
        stack = self.stack_ids(workspace)
        busy = {(m.workspace, m.group, tuple(m.members)) for m in self.merging.values()}
        now = time.monotonic()
        for group, members in self.layerstack.due(workspace, stack):
            key = (workspace, group, tuple(members))
            failed = self.merge_failed.get(key)
            if key in busy or failed is not None and failed[1] > now:
                continue
            if failed is not None:
                self.merge_failed[key] = (failed[0], float("inf"))    # tried again now
            for old in self.merging.values():     # for members the group no longer has
                if (old.workspace, old.group) == (workspace, group):
                    self.merger.drop(old.name)
            merged = MergedLayer(self.layerstack.new_name(workspace, group), workspace, group,
                                 members)
            self.merging[merged.name] = merged
            self.merger.submit(merged, [self.box.path(p) for p in lower_layer_paths(members)])

    def merge_done(self, merged: MergedLayer, error: str | None) -> None:
        """Merger thread: a build ended; the loop takes it from here (merge_built)."""
        self.box.loop.post(self.merge_built, merged, error)

    def merge_built(self, merged: MergedLayer, error: str | None) -> None:
        """Loop: record a merged layer that was built (then views use it), or log why not."""
        self.merging.pop(merged.name, None)
        self.gc_soon()                   # its members (undone ones too) are no longer held
        key = (merged.workspace, merged.group, tuple(merged.members))
        if error == MERGE_SUPERSEDED:
            self.merge_failed.pop(key, None)     # a try again dropped: members changed
            return
        if error is None:
            try:
                self.layerstack.record(merged)
                crash_point("merge-recorded")
            except OSError as exc:
                error = f"cannot save its record: {exc}"
                self.layerstack.merged.pop(merged.name, None)
        if error is not None:
            return self.merge_failure(merged, key, error)
        self.merge_failed.pop(key, None)
        log(6, f"merged layer {merged.name}: {len(merged.members)} layers of "
               f"{merged.workspace} in one")
        self.box.finish_merge.warm([f"{MERGED_DIR}/{merged.name}"])
        self.publish_layers(merged.workspace)
        self.drop_view(merged.workspace)
        self.gc_soon()
        if self.box.view_waits:                  # a start that waited for room under the limit
            self.box.schedule()

    def merge_failure(self, merged: MergedLayer, key: tuple[str, int, tuple[str, ...]],
                      error: str) -> None:
        """A build failed: its files go, and the same members are tried again after a wait
        that doubles at each failure (tick), so a full disk that is freed gets the merged
        layer a queued task may wait for, and a lasting failure costs a build in minutes."""
        failures = self.merge_failed.get(key, (0, 0.0))[0] + 1
        wait = min(MERGE_RETRY_MAX, MERGE_RETRY * 2 ** (failures - 1))
        self.merge_failed[key] = (failures, time.monotonic() + wait)
        with contextlib.suppress(OSError):
            tree_remove(os.path.join(self.layerstack.dir, merged.name))
        log(3, f"merged layer {merged.name} of {merged.workspace}: {error}; tried again in "
               f"{wait:.0f} s")

    def tick(self) -> float:
        """Loop timer (Box.tick): the failed builds whose wait is over are planned again
        (those whose members changed meanwhile are forgotten).  Seconds until the next."""
        now = time.monotonic()
        for name in sorted({k[0] for k, (_, at) in self.merge_failed.items() if at <= now}):
            self.plan_merges(name)
        self.merge_failed = {k: v for k, v in self.merge_failed.items() if v[1] > now}
        return min([at - now for _, at in self.merge_failed.values()] + [MERGE_RETRY_MAX])

    def gc_soon(self, after: float = GC_AFTER) -> None:
        """gc_layers after a step's answers, `after` seconds from now (or sooner if asked
        before), once however many asked meanwhile: an undo does not wait for the collection
        its change allows, and a burst of undos (each its own step) pays for one."""
        self.collect_at = min(self.collect_at, time.monotonic() + after)

    def plan_soon(self, after: float = GC_AFTER) -> None:
        """plan_due after a step's answers, `after` seconds from now (or sooner if asked
        before): the HTTP and merge threads an undo's answer waits for run first (not behind
        0.2 ms of plans at 10,000 layers, the loop holding the interpreter), and a burst of
        undos plans once (its builds begin MERGE_QUIET later anyway)."""
        self.plan_at = min(self.plan_at, time.monotonic() + after)

    def collect_wait(self) -> float:
        """Seconds until the collection or the plans asked are due (inf if none): the loop's
        select waits no longer."""
        return max(0.0, min(self.collect_at, self.plan_at) - time.monotonic())

    @property
    def gc_due(self) -> bool:
        """step_end has work: merges an undo left for later, or a collection, due now."""
        return min(self.collect_at, self.plan_at) <= time.monotonic()

    def step_end(self) -> None:
        """The loop, after a step's answers, when gc_due: the collection gc_soon asked for,
        or the merges an undo made due (an undo's answer does not depend on them)."""
        if self.collect_at <= time.monotonic():
            self.gc_layers()
        else:
            self.plan_due()

    def plan_due(self) -> None:
        """The merges of the workspaces layers_changed left for later: planned before any
        collection, which holds the members of the merges in progress.  One that raises is
        planned again GC_RETRY later (the loop never spins on it)."""
        self.plan_at = float("inf")
        while self.merges_due:
            workspace = self.merges_due.pop()
            try:
                self.plan_merges(workspace)
            except Exception:
                self.merges_due.add(workspace)
                self.plan_soon(GC_RETRY)
                raise

    def gc_layers(self) -> None:
        """Delete the files of undone tasks' layers that no running task's view uses, and
        the merged layers that match no group any more and that no running task's view and
        no cached view uses (a merge in progress keeps its sources).  A deleted layer's
        layerDeleted is saved without a sync: a crash that loses it finds the layer gone and
        marks it again at the next start (load, then reconcile collects).  An error never
        ends the loop nor loses a layer: the pass is asked again GC_RETRY later."""
        self.collect_at = float("inf")
        try:
            self.plan_due()
            in_use, pinned, asked = self.collect_pins()
            for name in sorted({m.workspace for m in self.layerstack.merged.values()}):
                unused = self.layerstack.unused(name, self.stack_ids(name), pinned)
                if unused:
                    try:
                        self.layerstack.forget(unused, self.merger.remove)
                    except OSError as exc:
                        log(3, f"merged layers {unused}: {exc}")
                    self.publish_layers(name)
            self.collect_undone(in_use)
        except Exception as exc:
            log(3, f"layer collection: {type(exc).__name__}: {exc}; again in {GC_RETRY:.0f} s")
            self.gc_soon(GC_RETRY)

    def collect_pins(self) -> tuple[set[str], set[str], set[str]]:
        """What the collection must keep: the undone layers still read (by running tasks,
        merges in progress, finish-time jobs), the lowers of views in use (relative to
        BOX_HOME), and the undone layers asked about."""
        asked = set(self.undone_layers)       # in use is asked of these alone: 10,000 ids
        in_use: set[str] = set()              # of each running task's stack are not copied
        pinned: set[str] = set()              # lowers of views in use, relative to BOX_HOME
        for task_id in list(self.task_lowers):  # every task that ran was pinned before it did
            t = self.box.task(task_id)
            if t is not None and t.state in ("running", "waiting"):
                in_use.update(asked.intersection(t.layers))
                in_use.add(t.id)
                pinned.update(self.task_lowers[t.id])
            else:
                self.task_lowers.pop(task_id)
        with self.lock:
            for key, _ in self.open_views.values():
                pinned.update(key)
        self.box.finish_merge.pin(in_use, pinned, asked)
        for merged in self.merging.values():
            in_use.update(asked.intersection(merged.members))
        return in_use, pinned, asked

    def collect_undone(self, in_use: set[str]) -> None:
        """The undone layers nothing reads: out of their names (files off the loop), each
        marked layerDeleted.  A mark that cannot be saved (a full disk, a file that cannot
        be replaced) is saved again with the states only in memory (Box.save_again); the
        rest go on."""
        for task_id in sorted(self.undone_layers):    # not every task: those undone only
            t = self.box.task(task_id)
            if t is None or t.state != "undone" or t.layerDeleted:
                self.undone_layers.discard(task_id)
            elif t.id not in in_use and t.id not in self.box.unsaved:   # undone on disk
                try:      # gone from its name at once; its files off the loop
                    if os.path.lexists(self.box.layer_dir(t.id)):
                        self.merger.remove(trash_name(self.box.layer_dir(t.id)))
                except OSError as exc:
                    log(3, f"layer {t.id}: {exc}")
                if os.path.lexists(self.box.layer_dir(t.id)):
                    log(3, f"could not delete layer {t.id}")
                    continue
                t.layerDeleted = True                # what is so: its files are gone
                crash_point("layer-trashed")
                try:
                    self.box.save(t, sync=False)
                except OSError as exc:
                    log(3, f"layer {t.id}: deleted, its mark not saved: {exc}; saved again "
                           "with the unsaved states")
                    self.box.loop.render(t)
                    self.box.save_again(t)
                self.undone_layers.discard(t.id)
                with contextlib.suppress(OSError):   # a full disk: the record says it
                    self.box.append_log(t.id, {"type": "layer", "text": "layer files deleted"})
                self.publish_layers(t.workspace)

    def changes(self, task_id: str) -> tuple[str, list[str]] | None:
        """What to walk for a task's changes: its upper and its lowers (newest first, base
        last), or None once its layer is deleted.  The lowers are the stack its layer is based
        on: the one it saw, or the one its finish-time merge joined it with (`mergedOn`), so a
        merged file shows the task's own change, not the other tasks' lines as its own.  The
        walk itself (changed_paths) runs in the HTTP thread, off the loop."""
        task = self.box.get(task_id)
        if task.layerDeleted:
            return None
        stack = task.layers
        if task.mergedOn is not None:
            try:
                stack = self.box.stacks.stack(task.mergedOn)
            except ValueError as exc:         # its stack file lost: the stack it saw
                log(3, f"task {task.id}: the stack it merged with is lost: {exc}")
        lowers = [self.box.path(p) for p in self.layerstack.plan(task.workspace, stack)]
        return (self.box.path("layers", task.id, "upper"),
                lowers + [self.box.path("workspaces", task.workspace)])


# Finish-time merge #############################################################################
###############################################################################################
# A layer is a set of whole files, and the layer on top wins every file it holds: two tasks
# that ran side by side and changed one file would leave only the later one's copy (issue 21).
# So a task that ends well is checked before it becomes done: the paths its layer changed
# against the paths changed by the layers the view gained or lost since the stack it saw (its
# `layers`: layers that became done while it ran, or an undo of one it saw).  For each path
# both changed (the same path, or one a folder above the other), three versions are read:
# base (the view it saw), theirs (the view now) and ours (its own view):
#   - ours equals theirs, or theirs equals base: nothing (its layer on top gives ours);
#   - ours equals base (a copy-up without a change): its copy is dropped, the view's shows;
#     unless its layer hides the view's version there (upper_hides: a folder above it
#     renamed away, deleted or made opaque, or a folder of its own where the view put a
#     file): a conflict, as a delete against an edit or a folder against a file;
#   - files on all three sides (or added on both): `git merge-file` (Debian's git, well kept)
#     joins them; a clean merge is written into the task's layer.  Before git, merge_text
#     settles what git calls a conflict but a person would not: two appends to one file
#     (both kept, the view's first) and deletions nested in one another (the larger); and
#     it joins alone what git joins the same way at two process starts' cost: one run of
#     changed lines on each side, MERGE_APART unchanged lines apart (runs_apart);
#   - anything else (overlapping hunks, binary, a delete against an edit, a folder against a
#     file, mode or symlink target changed both ways, a file above MERGE_MAX_BYTES): a
#     conflict, asked of a person as an approval of kind `conflict` (never by a policy).
# Why this shape:
#   - The three versions are read through read-only overlays of the same plans views use
#     (view_plan, merged layers included), so the check is exact past 128 tasks and past the
#     kernel's 500 lowers; the sets of paths come from the layers themselves (changed_paths
#     against the view the task saw, one lower), so only paths both sides touched are read.
#   - All of it runs in one thread of its own (FinishMerge), never on the loop: git is run
#     under prlimit (address space) with a timeout, files past MERGE_MAX_BYTES are not read
#     whole, and the merged texts one check holds are capped.  The thread answers the loop
#     through Box.commands, like the Merger.
#   - The result is trusted only for the stack it was computed on: if another task became
#     done (or undone) meanwhile, the check runs again.  A clean merge is written into the
#     layer only when the whole check is settled (no conflict left, or the person answered);
#     from then on the layer is the task's work rebased on that stack, so the next check (if
#     the view moved again) uses that stack as its base.  The task's diff and changes are
#     taken against that stack too (`mergedOn`, a StackStore ref, set when it becomes done):
#     against the stack it started on, a merged file would show the lines of the tasks it
#     merged with as its own, and undo (which takes out exactly its change) would disagree
#     with what the diff said it changed.
#   - A check looks first by paths (issue 23: a burst of 300 tasks went through at 1 a
#     second, each held for a check whose stack had moved, the checks in turn, each opening
#     three views): a task whose layer holds nothing is done at once; else its path set
#     (layer_paths: each entry of its upper, a folder's mode; read off the loop, no view)
#     meets those of the layers that became done since the stack its layer is based on
#     (each read once, the thread keeps PATHS_HELD_MAX paths at most).  Where no path meets,
#     the check could find nothing: its layer is based on the stack now, no view opened.
#     Views open only where paths meet, past LAYER_PATHS_MAX entries, or after an undo of a
#     layer it saw; a check again looks only at the layers done since the last one.
#   - Nothing joins the stack before the task is done, and a task is done only after every
#     write of its merge is synced: a kill -9 in the middle leaves a running or waiting task,
#     which the next start fails (reconcile); its half-written layer never shows in a view.
#   - A held task (checked, or waiting on a conflict) has no processes, user or network
#     left (released when its worker ended), so it takes no place among maxRunningTasks
#     (Box.schedule): a person asleep on a conflict never stops the queue.  It keeps only
#     its layer on disk; a restart fails it and denies its approval.

MERGE_MAX_BYTES = 8 << 20            # a file larger than this is a conflict, never merged
MERGE_HELD_BYTES = 64 << 20          # merged texts one check holds in memory at most
DIGEST_MAX_BYTES = 256 << 20         # data of one version hashed at most (~0.5 s of sha256)
MERGE_TIMEOUT = 10.0                 # seconds git merge-file may run for one file
MERGE_CHECK_SECONDS = 30.0           # and for all files of one check or revert: the merge
#                                      thread is every task's (two tasks' 7 files of random
#                                      lines held a third task's check 70 s); past it, a
#                                      conflict
INF = float("inf")                   # no deadline
MERGE_MEMORY = 1 << 30               # its address space (prlimit --as): 1,000,000 lines
                                     # of a file changed both ways take ~400 MB
MERGE_SHOWN_BYTES = 64 << 10         # a version's text shown in a conflict approval, at most
MERGE_SHOWN_TOTAL = 1 << 20          # all texts of one conflict approval, at most
MERGE_CONFLICTS_SHOWN = 1000         # conflicts (and merged paths) one approval and its log
#                                      line name; the rest counted (morePaths, moreMerged): the
#                                      loop saves, renders and emits it (~70 us a conflict), an
#                                      answer decides all.  So do a merge's log line and a
#                                      task's record (merged, moreMerged), an undo's record
#                                      (reverted, kept: moreReverted, moreKept) and its layer's
#                                      summary: each save, listing and event carries them
CONFLICT_KEEP = ("task", "view")


@dataclass
class Version:
    """What one view holds at a path: absent, file, symlink, folder or other (a fifo)."""

    kind: str
    mode: int = 0
    size: int = 0
    data: str = ""                   # a file's sha256, a symlink's target
    body: bytes | None = field(default=None, compare=False)   # a file's bytes, when kept

    def same(self, other: "Version") -> bool:
        return self == other


def view_version(root_fd: int, path: str, keep: int = 0) -> Version:
    """The version at path beneath a view's root fd, no symlink followed on the way; a file
    of at most keep bytes keeps its bytes too (read once: through a deep stack each open
    and read is a lookup in every lower, the bulk of an undo's or a check's time)."""
    parent, _, name = path.rpartition("/")
    fd = open_dir_beneath(root_fd, parent)
    if fd is None:
        return Version("absent")
    try:
        st = _entry(fd, name)
        if st is None:
            return Version("absent")
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            return Version("folder", mode)
        if stat.S_ISLNK(st.st_mode):
            return Version("symlink", data=os.readlink(name, dir_fd=fd))
        if not stat.S_ISREG(st.st_mode):
            return Version("other", mode)
        with _open_file(fd, name) as f:
            data, body = file_digest(f, st, keep)
        return Version("file", mode, st.st_size, data, body)
    finally:
        os.close(fd)


def file_digest(f: io.BufferedReader, st: os.stat_result, keep: int) -> tuple[str, bytes | None]:
    """A file's sha256 (and its bytes if it has at most keep), reading only its data extents:
    a task's 1 TiB file of holes is hashed in microseconds, not hours of zeros (the merge
    thread is every task's).  The extents' places are hashed with their bytes, so the same
    bytes laid out with other holes count as another version: a conflict, never a loss.  A
    file past ARCHIVE_EXTENTS extents or DIGEST_MAX_BYTES of data is a version of its own
    (equal to nothing: cannot say, so a conflict), not minutes of the thread per dense GB."""
    digest, chunks = hashlib.sha256(), []
    try:
        extents = data_extents(f.fileno(), st) if st.st_size > keep else None
    except TooFragmented:
        return "unique:" + secrets.token_hex(16), None
    if (st.st_size if extents is None else sum(extents[1::2])) > DIGEST_MAX_BYTES:
        return "unique:" + secrets.token_hex(16), None
    if extents is None:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            if st.st_size <= keep:
                chunks.append(chunk)
    else:
        for i in range(0, len(extents), 2):
            digest.update(struct.pack("<qq", extents[i], extents[i + 1]))
            for _, chunk in extent_pieces(f.fileno(), extents[i], extents[i + 1]):
                digest.update(chunk)
    body = b"".join(chunks) if st.st_size <= keep else None
    return digest.hexdigest(), body if body is not None and len(body) <= keep else None


def _open_file(dir_fd: int, name: str) -> io.BufferedReader:
    return os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=dir_fd), "rb")


def extent_pieces(fd: int, offset: int, length: int) -> Iterator[tuple[int, bytes]]:
    """An extent of fd's file as (offset, bytes) pieces of at most 1 MiB, up to its end."""
    while length > 0 and (chunk := os.pread(fd, min(length, 1 << 20), offset)):
        yield offset, chunk
        offset, length = offset + len(chunk), length - len(chunk)


def view_copy(root_fd: int, path: str, out: int) -> None:
    """A view's regular file copied into out piece by piece, its holes kept: never whole in
    memory (a task's 1 TiB file of holes is copied in no time); EIO if it is not one."""
    parent, _, name = path.rpartition("/")
    fd = open_dir_beneath(root_fd, parent)
    if fd is None:
        raise OSError(errno.EIO, f"cannot copy the view's file at {path}: gone")
    try:
        with _open_file(fd, name) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EIO, f"cannot copy the view's file at {path}: not a file")
            try:
                extents = data_extents(f.fileno(), st)       # [] for a file of holes only
                if extents is None:
                    extents = array.array("q", [0, st.st_size])
            except TooFragmented as exc:
                raise OSError(errno.EIO, f"cannot copy the view's file at {path}: {exc}") \
                    from None
            for i in range(0, len(extents), 2):
                for offset, chunk in extent_pieces(f.fileno(), extents[i], extents[i + 1]):
                    if os.pwrite(out, chunk, offset) != len(chunk):   # a disk nearly full
                        raise OSError(errno.ENOSPC, f"a short write copying {path}")
            os.ftruncate(out, st.st_size)
    finally:
        os.close(fd)


def view_bytes(root_fd: int, path: str, cap: int) -> bytes | None:
    """A file's bytes in a view, or None if it is not a file of at most cap bytes."""
    parent, _, name = path.rpartition("/")
    fd = open_dir_beneath(root_fd, parent)
    if fd is None:
        return None
    try:
        with _open_file(fd, name) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            data = f.read(cap + 1)
        return data if len(data) <= cap else None
    except OSError:
        return None
    finally:
        os.close(fd)


def is_binary(data: bytes) -> bool:
    """git's own rule: a NUL in the first 8,000 bytes."""
    return b"\0" in data[:8000]


def git_merge(ours: bytes, base: bytes, theirs: bytes, tmp: str, deadline: float = INF
              ) -> tuple[bool, bytes]:
    """A three-way merge by `git merge-file` (diff3 markers where it does not join): (clean,
    text).  Bounded: prlimit's address space, a timeout (the child killed) that ends at the
    check's deadline at the latest; OSError else."""
    timeout = min(MERGE_TIMEOUT, deadline - time.monotonic())
    late = f"the check's {MERGE_CHECK_SECONDS:g} s of merging are spent"
    if timeout <= 0:
        raise OSError(errno.ETIME, late)
    names = []
    for label, data in (("task", ours), ("before", base), ("view", theirs)):
        names.append(os.path.join(tmp, label))
        with open(names[-1], "wb") as f:
            f.write(data)
    argv = ["prlimit", f"--as={MERGE_MEMORY}", "--", "git", "merge-file", "-p", "--diff3",
            "-L", "task", "-L", "before", "-L", "view"] + names
    env = {"PATH": TASK_PATH, "HOME": tmp, "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"}
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, env=env, cwd=tmp)
    except subprocess.TimeoutExpired:
        raise OSError(errno.ETIME, f"git merge-file took more than {MERGE_TIMEOUT:g} s" if
                      timeout == MERGE_TIMEOUT else late) from None
    if not 0 <= done.returncode < 128:
        raise OSError(errno.EIO, "git merge-file: " + done.stderr.decode(errors="replace")
                      .strip()[:200])
    return done.returncode == 0, done.stdout


def merge_text(ours: bytes, base: bytes, theirs: bytes, tmp: str, deadline: float = INF
               ) -> tuple[bool, bytes]:
    """Three-way merge of texts.  Two appends to one file (a log, a changelog: what tasks
    side by side do most) keep both, the view's first (it ended first); an append on one
    side and the base's tail cut on the other (the undo of an append under a later one)
    give both; lines deleted on one side and more of them on the other give the larger
    deletion (an undo of a task whose later copy an earlier undo reverted).  git
    merge-file would call two changes at one place a conflict.  Anything else, and any
    text of more than MERGE_FAST_LINES lines: git merge-file (a child, bounded by prlimit and
    by the deadline of the check or revert it is part of)."""
    if base and ours.startswith(base) and theirs.startswith(base):
        return True, theirs + ours[len(base):]
    if ours.startswith(base) and base.startswith(theirs):
        return True, theirs + ours[len(base):]
    if theirs.startswith(base) and base.startswith(ours):
        return True, ours + theirs[len(base):]
    if max(text.count(b"\n") for text in (ours, base, theirs)) > MERGE_FAST_LINES:
        return git_merge(ours, base, theirs, tmp, deadline)
    lines = [text.splitlines(keepends=True) for text in (ours, base, theirs)]
    apart = runs_apart(*lines)
    if apart is not None:
        return True, apart
    if is_subsequence(lines[2], lines[0]) and is_subsequence(lines[0], lines[1]):
        return True, theirs
    if is_subsequence(lines[0], lines[2]) and is_subsequence(lines[2], lines[1]):
        return True, ours
    return git_merge(ours, base, theirs, tmp, deadline)


MERGE_APART = 3      # unchanged lines between two sides' changes that merge_text joins alone
MERGE_FAST_LINES = 100_000   # lines past which merge_text leaves a text to git: its own
#                              line lists of 8 MiB of short lines would take ~500 MB of
#                              gurtd's memory and hold the interpreter lock for seconds


def changed_run(base: list[bytes], side: list[bytes]) -> tuple[int, int]:
    """The run of base lines a side changed, as one: (start, end) in base, from the longest
    common head and tail (an insertion is start == end)."""
    head = 0
    for a, b in zip(base, side):
        if a != b:
            break
        head += 1
    tail, most = 0, min(len(base), len(side)) - head
    while tail < most and base[-1 - tail] == side[-1 - tail]:
        tail += 1
    return head, len(base) - tail


def runs_apart(ours: list[bytes], base: list[bytes], theirs: list[bytes]) -> bytes | None:
    """Each side changed one run of lines, MERGE_APART unchanged lines apart or more (a
    task's edit near the top of a file, another's near the end: what tasks side by side do
    most): base with both runs replaced, which is the text git merge-file gives (its hunks
    lie inside those runs), without its two processes (prlimit, git) per file.  None
    otherwise (git merge-file decides)."""
    (o_start, o_end), (t_start, t_end) = changed_run(base, ours), changed_run(base, theirs)
    if o_end + MERGE_APART <= t_start:
        first, second = (ours, o_start, o_end), (theirs, t_start, t_end)
    elif t_end + MERGE_APART <= o_start:
        first, second = (theirs, t_start, t_end), (ours, o_start, o_end)
    else:
        return None
    (a, a_start, a_end), (b, b_start, b_end) = first, second
    return b"".join(base[:a_start] + a[a_start:len(a) - (len(base) - a_end)] +
                    base[a_end:b_start] + b[b_start:len(b) - (len(base) - b_end)] +
                    base[b_end:])


def is_subsequence(small: list[bytes], big: list[bytes]) -> bool:
    """Is small what is left of big once some of its lines are deleted?"""
    it = iter(big)
    return len(small) <= len(big) and all(line in it for line in small)


def conflict_why(base: Version, theirs: Version, ours: Version) -> str | None:
    """Why a path both sides changed cannot be merged as text, or None if it can be."""
    kinds = {ours.kind, theirs.kind}
    if "absent" in kinds:
        return "deleted by the task, changed in the view" if ours.kind == "absent" else \
            "changed by the task, deleted in the view"
    if "folder" in kinds and kinds != {"folder"}:
        return "a folder on one side, a file on the other"
    if kinds == {"symlink"}:
        return "symlink target changed both ways"
    if kinds != {"file"} or base.kind not in ("file", "absent"):
        return f"changed both ways ({ours.kind} by the task, {theirs.kind} in the view)"
    if len({base.mode, ours.mode, theirs.mode}) == 3:
        return "mode changed both ways"
    big = max(base.size, ours.size, theirs.size)
    if big > MERGE_MAX_BYTES:
        return f"too large to merge ({big} bytes; at most {MERGE_MAX_BYTES})"
    return None


def version_info(v: Version, root_fd: int, path: str, budget: list[int]) -> dict[str, Any]:
    """A version as a conflict approval shows it; text while budget[0] (bytes) lasts."""
    out: dict[str, Any] = {"kind": v.kind}
    if v.kind in ("file", "folder", "other"):
        out["mode"] = f"{v.mode:04o}"
    if v.kind == "symlink":
        out["target"] = v.data
    if v.kind == "file":
        out["size"] = v.size
        data = view_bytes(root_fd, path, min(MERGE_SHOWN_BYTES, budget[0]))
        if data is not None and not is_binary(data):
            budget[0] -= len(data)
            out["text"] = data.decode(errors="replace")
        else:
            out["shown"] = "binary" if data is not None else "too large to show"
    return out


@dataclass
class MergeCheck:
    """One finish-time check of a task, as the loop hands it to the thread."""

    task_id: str
    token: int
    upper: str                       # its layer, relative to BOX_HOME
    base: list[str]                  # the plan of the view it saw (base dir left out)
    now: list[str]                   # the plan of the view now
    workspace_dir: str
    others: list[str]                # uppers of the layers the view gained or lost
    stack: list[str]                 # the ids of the view now


@dataclass
class MergeResult:
    """What a check found: writes for its layer, the paths merged, conflicts for a person."""

    writes: dict[str, tuple[Any, ...]] = field(default_factory=dict)   # path -> write
    merged: list[str] = field(default_factory=list)
    conflicts: list[dict[str, Any]] = field(default_factory=list)


def _parents(path: str) -> Iterator[str]:
    """The folders above a path of a view, nearest first ("a/b/c": "a/b", "a")."""
    while "/" in path:
        path = path.rpartition("/")[0]
        yield path


def touched(mine: list[str], theirs: list[str]) -> list[str]:
    """Paths of mine and theirs that touch one in the other set (the same path, or one a
    folder above the other), sorted: the only ones whose versions need reading."""
    above = _parents
    sets = [set(mine), set(theirs)]
    prefixes = [{a for p in s for a in above(p)} for s in sets]
    out = set()
    for side in (0, 1):
        other, under = sets[1 - side], prefixes[1 - side]
        for path in sets[side]:
            if path in other or path in under or any(a in other for a in above(path)):
                out.add(path)
    return sorted(out)


def check_paths(job: MergeCheck, base_fd: int, home: str, upper_fd: int
                ) -> tuple[set[str], list[str]]:
    """The paths the task changed, and the candidates of a check: those paths and the
    other layers' paths that touch one another (each layer listed against the view the
    task saw, as one lower), and the folders the task's layer holds (a mode changed, a
    file added in it: not changes of their own) where another layer put something else."""
    upper = os.path.join(home, job.upper)
    mine = [c["path"].rstrip("/") for c in changed_paths(upper, [base_fd])]
    theirs: list[str] = []
    for other in job.others if mine or not layer_empty(upper) else []:
        theirs += [c["path"].rstrip("/") for c in changed_paths(other, [base_fd])]
    held = set(mine)
    for path in theirs:
        fd = None if path in held else open_dir_beneath(upper_fd, path)
        if fd is not None:
            os.close(fd)
            mine.append(path)
    return held, touched(mine, theirs)


def view_open(home_fd: int, plan: list[str], workspace_dir: str) -> int:
    """A read-only view of a plan (paths relative to BOX_HOME): the base itself when there
    is no layer (an overlay needs two layers at least)."""
    if not plan:
        return os.open(workspace_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=home_fd)
    return overlay_open_plan(home_fd, fit_lowers(plan, workspace_dir))


def upper_hides(upper_fd: int, path: str, theirs: Version) -> bool:
    """Does a task's layer hide the view's version at path: a whiteout, a file or an opaque
    folder above it (a folder the task renamed away, deleted, or deleted and made again),
    or a folder of its own at path where the view has something else?  Then a path only
    the view changed would not show once the layer joins: a conflict, not the view's
    change to keep."""
    fd = os.dup(upper_fd)
    try:
        for name in path.split("/")[:-1]:
            st = _entry(fd, name)
            if st is None or not stat.S_ISDIR(st.st_mode) or _opaque_child(fd, name):
                return st is not None
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        st = _entry(fd, path.rpartition("/")[2])
        return st is not None and (not stat.S_ISDIR(st.st_mode) or theirs.kind != "folder")
    finally:
        os.close(fd)


def run_check(job: MergeCheck, home: str, tmp: str) -> MergeResult:
    """The check itself (the merge thread): three read-only views mounted, each candidate
    decided, merged texts held in memory (at most MERGE_HELD_BYTES)."""
    result, deadline = MergeResult(), time.monotonic() + MERGE_CHECK_SECONDS
    home_fd = os.open(home, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fds: dict[str, int] = {}
    try:
        for key, plan in (("base", job.base), ("now", job.now), ("ours", [job.upper] + job.base)):
            fds[key] = view_open(home_fd, plan, job.workspace_dir)
        fds["upper"] = os.open(job.upper, DIR_FLAGS, dir_fd=home_fd)
        mine, candidates = check_paths(job, fds["base"], home, fds["upper"])
        held, shown = 0, [MERGE_SHOWN_TOTAL]
        for path in candidates:
            base, theirs, ours = (view_version(fds[k], path, MERGE_MAX_BYTES)
                                  for k in ("base", "now", "ours"))
            if ours.same(theirs) or theirs.same(base):
                continue
            if ours.same(base) and path in mine and ours.kind != "folder":
                result.writes[path] = ("view",)   # only the view changed it: a copy dropped
                continue
            if ours.same(base) and not upper_hides(fds["upper"], path, theirs):
                continue
            why = conflict_why(base, theirs, ours)
            texts = [b"" if v.kind == "absent" else v.body for v in (ours, base, theirs)] \
                if why is None else []
            if why is None and any(t is None or is_binary(t) for t in texts):
                why = "binary file changed both ways"
            diff3 = None
            if why is None:
                try:
                    clean, merged = merge_text(texts[0] or b"", texts[1] or b"",
                                               texts[2] or b"", tmp, deadline)
                except OSError as exc:          # past its time or memory: said so
                    clean, merged = False, b""
                    why = f"could not be merged: {exc.strerror or exc}"
                mode = ours.mode if ours.mode != base.mode else theirs.mode
                if clean and held + len(merged) <= MERGE_HELD_BYTES:
                    held += len(merged)
                    result.writes[path] = ("text", merged, mode)
                    result.merged.append(path)
                    continue
                why = why or ("overlapping changes" if not clean else
                              "too much merged text at once")
                diff3 = merged[:min(MERGE_SHOWN_BYTES, shown[0])].decode(errors="replace") \
                    or None
                shown[0] -= len(diff3 or "")
            result.conflicts.append({
                "path": path, "why": why, "diff3": diff3,
                "before": version_info(base, fds["base"], path, shown),
                "view": version_info(theirs, fds["now"], path, shown),
                "task": version_info(ours, fds["ours"], path, shown)})
        return result
    finally:
        for fd in list(fds.values()) + [home_fd]:
            os.close(fd)


def upper_parent(upper_fd: int, path: str, view_fd: int, store: tuple[int, int]
                 ) -> tuple[int, bool]:
    """The folder of path in a task's layer, made if missing (a folder the task deleted or
    replaced by a file becomes an opaque folder: only what is written in it shows); and
    whether a folder above is opaque (then nothing below shows through)."""
    fd, opaque, done = os.dup(upper_fd), False, ""
    try:
        for name in path.split("/")[:-1]:
            done = f"{done}/{name}" if done else name
            st = _entry(fd, name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=fd)
                st = None
                made_opaque = True
            else:
                made_opaque = False
            if st is None:
                seen = view_version(view_fd, done)
                os.mkdir(name, seen.mode if seen.kind == "folder" else 0o755, dir_fd=fd)
                os.chown(name, *store, dir_fd=fd, follow_symlinks=False)
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            if made_opaque:
                os.setxattr(fd, "trusted.overlay.opaque", b"y")
            with contextlib.suppress(OSError):
                opaque = opaque or os.getxattr(fd, "trusted.overlay.opaque") == b"y"
        return fd, opaque
    except BaseException:
        os.close(fd)
        raise


def upper_put(upper_fd: int, path: str, write: tuple[Any, ...], view_fd: int,
              store: tuple[int, int]) -> None:
    """One write of a merge into a task's layer: ("text", bytes, mode) a file; ("symlink",
    target); ("absent",) a whiteout; ("view",) the view's version (the layer's entry dropped,
    or the view's file copied where a folder above is opaque).  Not synced: its caller
    syncs the layer's file system once after all its writes (one syncfs, not two fsyncs a
    file: 100 reverted files took 1.4 s so), before anything takes the layer as written.
    A file is written under a temp name in BOX_HOME/layers (upper_fd is layers/<id>/upper:
    the same file system), then renamed into place: a kill -9 between leaves the temp
    where the start throws temps away (trash_sweep), never a file in a layer."""
    fd, opaque = upper_parent(upper_fd, path, view_fd, store)
    name = path.rpartition("/")[2]
    try:
        if write[0] == "view":                 # decided before the layer's entry goes
            seen = view_version(view_fd, path)
            if opaque and seen.kind not in ("absent", "symlink", "file"):
                raise OSError(errno.EIO, f"cannot copy the view's {seen.kind} at {path}")
            write = ("drop",) if not opaque or seen.kind == "absent" else \
                ("symlink", seen.data) if seen.kind == "symlink" else ("copy", seen.mode)
        st = _entry(fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            tree_remove(f"/proc/self/fd/{fd}/{name}")
        elif st is not None:
            os.unlink(name, dir_fd=fd)
        if write[0] == "drop":
            return
        if write[0] in ("symlink", "absent"):
            if write[0] == "symlink":
                os.symlink(write[1], name, dir_fd=fd)
            else:
                os.mknod(name, stat.S_IFCHR, os.makedev(0, 0), dir_fd=fd)   # a whiteout
            os.chown(name, *store, dir_fd=fd, follow_symlinks=False)
            return
        temps = os.open("../..", DIR_FLAGS, dir_fd=upper_fd)
        temp = f"{MERGE_TEMP}merge-{secrets.token_hex(8)}"
        try:
            out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                          os.O_CLOEXEC, 0o600, dir_fd=temps)
            try:
                if write[0] == "copy":
                    view_copy(view_fd, path, out)
                else:
                    with os.fdopen(os.dup(out), "wb") as f:
                        f.write(write[1])
                os.fchown(out, *store)
                os.fchmod(out, write[-1] & ~SETID_BITS)   # as every finished layer
                crash_point("merge-temp-written")         # a test's kill -9 before the rename
                os.rename(temp, name, src_dir_fd=temps, dst_dir_fd=fd)
            except BaseException:
                os.unlink(temp, dir_fd=temps)             # no temp left behind
                raise
            finally:
                os.close(out)
        finally:
            os.close(temps)
    finally:
        os.close(fd)


def apply_writes(home: str, upper: str, writes: dict[str, tuple[Any, ...]],
                 now: list[str], workspace_dir: str, store: tuple[int, int]) -> None:
    """A settled merge into the task's layer (the merge thread), every file synced."""
    if not writes:
        return
    home_fd = os.open(home, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    view_fd = upper_fd = -1
    try:
        view_fd = view_open(home_fd, now, workspace_dir)
        upper_fd = os.open(os.path.join(home, upper), DIR_FLAGS)
        for n, (path, write) in enumerate(sorted(writes.items())):
            upper_put(upper_fd, path, write, view_fd, store)
            if n == 0:
                crash_point("finish-merge-half-written")   # a test's kill -9 in the middle
        _syncfs(upper_fd)                     # every write on disk before the task is done
    finally:
        for fd in (upper_fd, view_fd, home_fd):
            if fd >= 0:
                os.close(fd)


def conflict_answer(approval: Approval, args: Any, conflicts: list[dict[str, Any]] | None = None
                    ) -> dict[str, tuple[Any, ...]]:
    """The writes an answer to a conflict makes (ApiError 400 for args that are not one):
    approve alone keeps the task's version; args {"keep": "task"|"view", "texts"?: {path:
    text}} keep one side for every path (conflicts: all of them, those the approval names
    if not given) and take the person's merged text for some."""
    paths = {c["path"]: c for c in (conflicts if conflicts is not None else
                                    (approval.args or {}).get("paths", []))}
    args = args or {}
    if not isinstance(args, dict) or set(args) - {"keep", "texts"} or \
            args.get("keep", "task") not in CONFLICT_KEEP or \
            not isinstance(args.get("texts", {}), dict):
        raise ApiError(400, 'args of a conflict: {"keep"?: "task"|"view", "texts"?: '
                            '{"<path>": "<merged text>"}}')
    texts = args.get("texts", {})
    unknown = [p for p in texts if p not in paths or not isinstance(texts[p], str)]
    if unknown:
        raise ApiError(400, f"texts: {unknown[0]!r} is not a conflicting path with a text")
    writes: dict[str, tuple[Any, ...]] = {}
    for path, conflict in paths.items():
        if path in texts:
            mode = next((int(conflict[k]["mode"], 8) for k in ("task", "view") if
                         conflict[k]["kind"] == "file"), 0o644)
            writes[path] = ("text", texts[path].encode(), mode)
        elif args.get("keep") == "view":
            writes[path] = ("view",)
    return writes


LAYER_PATHS_MAX = 10_000     # entries of a layer's path set; past it, its checks open views
PATHS_HELD_MAX = 100_000     # entries of all the path sets the merge thread keeps at once


def layer_empty(upper: str) -> bool:
    """Did a task's layer change nothing (no entry in its upper)?  One read of a folder."""
    try:
        with os.scandir(upper) as entries:
            return next(entries, None) is None
    except OSError:
        return False


PATH_HIDES, PATH_WHITEOUT, PATH_OPAQUE = -1, -2, -3   # a path set's tags, beside a
#                                                      plain folder's mode (>= 0)


def layer_entries(root: str | int, within: Callable[[str], bool] | None = None,
                  most: int | None = None) -> dict[str, int]:
    """A layer's entries by path: the mode of a folder that is not opaque, PATH_OPAQUE,
    PATH_WHITEOUT or PATH_HIDES (any other entry); all, or those within takes (a folder it
    does not take is not listed: a walk for a few paths opens only the folders on their
    way).  An upper holds the folders above its entries.  One walk, no symlink followed;
    OSError if a folder cannot be read or went meanwhile, EFBIG past `most` entries or
    CHANGES_MAX_BYTES of paths, found while a folder is read, before all its names are
    held (a task's folder of millions of names costs the merge thread nothing)."""
    out: dict[str, int] = {}
    room = [most if most is not None else sys.maxsize, CHANGES_MAX_BYTES]
    counts = [0, 0]                           # folders listed, folders entered

    def names(folder: WalkDir) -> list[str]:
        counts[0] += 1
        prefix, found = folder.path() + "/" if folder.up is not None else "", []
        with os.scandir(folder.fds[0]) as entries:
            for item in entries:
                if within is None or within(prefix + item.name):
                    room[0], room[1] = room[0] - 1, room[1] - len(prefix) - len(item.name)
                    if room[0] < 0 or room[1] < 0:
                        raise OSError(errno.EFBIG, "too many entries in one layer")
                    found.append(item.name)
        return sorted(found)

    def entry(folder: WalkDir, name: str) -> list[int] | None:
        st = _entry(folder.fds[0], name)
        if st is None:
            raise OSError(errno.ENOENT, f"{folder.path(name)} went while listed")
        if stat.S_ISDIR(st.st_mode):
            counts[1] += 1
            opaque = _opaque_child(folder.fds[0], name)
            out[folder.path(name)] = PATH_OPAQUE if opaque else stat.S_IMODE(st.st_mode)
            return [0]
        out[folder.path(name)] = PATH_WHITEOUT if is_whiteout(st) else PATH_HIDES
        return None

    walk([root], entry, names=names)
    if counts[0] != counts[1] + 1:            # + 1: the root; one not entered went
        raise OSError(errno.ENOENT, "a folder of the layer went while listed")
    return out


def layer_paths(upper: str) -> dict[str, int] | None:
    """A layer's path set, for a check's first look and an undo's reads (no view opened):
    its entries (layer_entries: two layers whose changes touch, one path or one a folder
    above the other, both hold a path).  None (unknown: views or a walk decide) past
    LAYER_PATHS_MAX entries, or if a folder could not be read (a set that lacks a path
    would hide a conflict)."""
    try:
        return layer_entries(upper, most=LAYER_PATHS_MAX)
    except OSError:
        return None


def paths_meet(mine: dict[str, int] | None, theirs: dict[str, int] | None) -> bool:
    """Could a check of a layer against one that became done meanwhile find anything?  Only
    at a path both hold that is not a folder of one mode in both: a path a layer neither
    holds nor hides (below a file, whiteout or opaque folder of its own) shows in the view
    as it was, and a folder both keep alike compares the same.  Unknown sets meet."""
    if mine is None or theirs is None:
        return True
    small, big = (mine, theirs) if len(mine) <= len(theirs) else (theirs, mine)
    return any(tag < 0 or big[path] != tag for path, tag in small.items() if path in big)


class LayerPaths:
    """The merge thread's path sets (layer_paths) by task id.  A done layer is never written
    again, so each is read once; past PATHS_HELD_MAX entries in all the oldest go (read
    again if a later check needs one).  Merge thread only."""

    def __init__(self) -> None:
        self.sets: dict[str, dict[str, int] | None] = {}
        self.size = 0

    def of(self, task_id: str, upper: str) -> dict[str, int] | None:
        if task_id not in self.sets:
            self.sets[task_id] = layer_paths(upper)
            self.size += len(self.sets[task_id] or ()) + 1
            while self.size > PATHS_HELD_MAX and len(self.sets) > 1:
                self.forget(next(iter(self.sets)))
        return self.sets.get(task_id)

    def forget(self, task_id: str) -> None:
        if task_id in self.sets:
            self.size -= len(self.sets.pop(task_id) or ()) + 1


@dataclass
class FirstLook:
    """A check's first look, as the loop hands it to the thread: the task's layer against
    the layers that became done since the stack its layer is based on, by path sets."""

    task_id: str
    token: int
    upper: str                       # its layer (absolute)
    gained: list[tuple[str, str]]    # (id, absolute upper) of those layers
    stack: list[str]                 # the ids of the view now


def first_look(job: FirstLook, paths: LayerPaths) -> bool:
    """The thread: True if no layer gained meets the task's (nothing to merge)."""
    mine = paths.of(job.task_id, job.upper)
    return mine == {} or not any(paths_meet(mine, paths.of(i, upper))
                                 for i, upper in job.gained)


def done_since(box: Box, workspace: str, seen: list[str], stack: list[str]
               ) -> list[str] | None:
    """The layers of stack that became done after those of seen (a stack of the same
    workspace, seen before), newest first; None if one of seen left (an undo).  Walks the
    finish order back to seen's newest: as many steps as tasks became done since."""
    if not seen:
        return stack
    ever, gained = box.views.layerstack.ever.get(workspace, []), []
    for task_id in reversed(ever):
        if task_id == seen[0]:
            return gained if len(stack) == len(seen) + len(gained) else None
        if box.get(task_id).state == "done":
            gained.append(task_id)
    return None


# The disk's errors that pass without the task: a full disk or quota (room comes back), a
# file system remounted read-only or a device's I/O errors (an admin remounts or repairs it).
# A revert that meets one waits and is built again; EFBIG would come back at every try.
DISK_WAIT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


class DiskFull(str):
    """The error of a merge thread's job that the disk caused (DISK_WAIT_ERRNOS): a revert
    that met it is built again later (FinishMerge.tick), never recorded failed for good."""


def no_room(exc: BaseException) -> bool:
    """An error of the disk that passes: an OSError of DISK_WAIT_ERRNOS, or the 507 of a
    save that met one (saved_or_507 raises it from None: the OSError is its context)."""
    if isinstance(exc, ApiError):
        exc = exc.__context__ if exc.status == 507 else None
    return isinstance(exc, OSError) and exc.errno in DISK_WAIT_ERRNOS


@dataclass
class HeldTask:
    """A task the finish-time merge holds between its worker's end and done."""

    worker: Worker
    token: int = 0
    seen: tuple[list[str], list[str] | None] | None = None   # (stack, plan) its layer is
    #                                                 based on (the plan made when needed)
    merged: dict[str, None] = field(default_factory=dict)   # its merged paths, once each
    pending: MergeResult | None = None                # a check waiting for a person
    pending_check: MergeCheck | None = None
    approval: str | None = None


class FinishMerge:
    """The finish-time merge of a box (design above).  Loop thread, except run().

    Methods for Box: holds(task, worker) when a worker ended well (True: the task is held
    until its check is settled, then maybe_finish runs again), on_answer(approval) when a
    conflict approval is answered."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.held: dict[str, HeldTask] = {}
        self.cleared: set[str] = set()
        # by job: the layers (ids) and merged layers (paths) it reads
        self.reading: dict[str, tuple[set[str] | list[str], list[str]]] = {}
        self.undoing: dict[str, UndoJob] = {}          # undone task -> its job in flight
        self.jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.tokens = 0
        self.paths = LayerPaths()                      # the thread's, for first looks
        self.retries: dict[str, float] = {}            # undone task -> when its revert
        #                                                begins again (retry_later)
        self.litter: set[str] = set()                  # staged reverts the disk kept
        self.litter_at = 0.0                           # (staged_close): removed again then,
        self.litter_wait = MERGE_RETRY                 # the wait doubling at each failure

    def holds(self, task: Task, worker: Worker) -> bool:
        if task.id in self.cleared:
            self.cleared.discard(task.id)
            return False
        stack = self.box.views.stack_ids(task.workspace)
        if stack is task.layers or stack == task.layers or \
                layer_empty(os.path.join(self.box.layer_dir(task.id), "upper")):
            return False      # nothing became done or undone while it ran, or nothing changed
        self.held[task.id] = HeldTask(worker)
        self.check(task)
        return True

    def pin(self, in_use: set[str], pinned: set[str], asked: set[str]) -> None:
        """gc_layers: the layers (those of asked: ids) and merged layers (paths) jobs still
        read, and the layer of a held task undone while its job runs (the thread may be
        writing its merge into it: deleted once the job is back, current)."""
        for key, (ids, paths) in self.reading.items():
            in_use.update(asked.intersection(ids))
            if key in asked:
                in_use.add(key)
            pinned.update(paths)

    def drop(self, task_id: str) -> None:
        self.held.pop(task_id, None)
        self.reading.pop(task_id, None)

    def check(self, task: Task, views: bool = False) -> None:
        """Compare the task's layer with the view now (off the loop), or let it become done
        at once if the view is still the one its layer is based on.  Against the layers
        that became done since that one, the first look (by path sets, no view) comes first;
        the views are opened only where it finds their paths meet, or after an undo."""
        held, box = self.held[task.id], self.box
        stack = box.views.stack_ids(task.workspace)
        seen_stack = held.seen[0] if held.seen is not None else task.layers
        if stack is seen_stack or stack == seen_stack:
            return self.finish(task)
        gained = None if views else done_since(box, task.workspace, seen_stack, stack)
        if gained is None:
            return self.check_views(task, held, stack)
        self.tokens += 1
        held.token = self.tokens
        self.reading[task.id] = (set(gained), [])       # kept by gc_layers
        job = FirstLook(task.id, held.token, os.path.join(box.layer_dir(task.id), "upper"),
                        [(i, os.path.join(box.layer_dir(i), "upper")) for i in gained], stack)
        self.submit(job, self.looked, lambda tmp: first_look(job, self.paths))

    def looked(self, job: FirstLook, clear: bool | None, error: str | None) -> None:
        """Loop: the first look came back: nothing to merge on the job's stack (the layer
        is based on it now), or the views decide."""
        found = self.current(job, error, "cannot compare")
        if found is None:
            return
        task, held = found
        if clear:
            held.seen = (job.stack, None)          # its plan made if the views are needed
            return self.check(task)
        self.check(task, views=True)

    def check_views(self, task: Task, held: HeldTask, stack: list[str]) -> None:
        """The check by views (the thread): the task's layer against the view now, from
        the stack its layer is based on (the layers gained and lost since)."""
        box = self.box
        seen_stack, seen_plan = held.seen or (task.layers, None)
        if seen_plan is None:
            start = box.views.task_lowers.get(task.id) if seen_stack is task.layers else None
            seen_plan = start[:-1] if start else box.views.layerstack.plan(task.workspace,
                                                                          seen_stack)
            held.seen = (seen_stack, seen_plan)
        now = box.views.layerstack.plan(task.workspace, stack)
        seen, current = set(seen_stack), set(stack)
        self.reading[task.id] = (seen | current, seen_plan + now)   # kept by gc_layers
        others = [i for i in stack if i not in seen] + [i for i in seen_stack
                                                         if i not in current]
        self.tokens += 1
        held.token = self.tokens
        log(7, f"task {task.id}: finish-time check by views, {len(others)} layer(s) since")
        job = MergeCheck(task.id, held.token, f"layers/{task.id}/upper", seen_plan, now,
                         f"workspaces/{task.workspace}",
                         [p for i in others if os.path.isdir(p := os.path.join(
                             box.layer_dir(i), "upper"))], stack)
        self.submit(job, self.checked, lambda tmp: run_check(job, box.path(), tmp))

    def submit(self, job: Any, then: Callable[..., None],
               work: Callable[[str], Any]) -> None:
        """Run work(tmp dir) on the merge thread; then(job, result, error) on the loop."""
        box = self.box

        def run() -> None:
            result, error = None, None
            tmp = box.path("run", f"merge-{secrets.token_hex(6)}")
            try:
                os.mkdir(tmp, 0o700)
                result = work(tmp)
            except Exception as exc:
                error = exc.message if isinstance(exc, ApiError) else \
                    (DiskFull if no_room(exc) else str)(f"{type(exc).__name__}: {exc}")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):        # the loop is gone (stopping)
                box.loop.post(box.loop.guard, job.task_id, then, job, result, error)

        self.put(run)

    def put(self, run: Callable[[], None]) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self.run, name="finish-merge", daemon=True)
            self.thread.start()
        self.jobs.put(run)

    def warm(self, layers: list[str]) -> None:
        """Layers of a plan (paths relative to BOX_HOME: a merged layer recorded, a view's at
        start): the thread reads their path sets now, not the next undo (which reads every
        layer above the undone task: the first one after a start ~270 at 10,000 layers)."""
        def run() -> None:
            for layer in layers:
                try:
                    self.paths.of(paths_key(layer), self.box.path(layer))
                except Exception as exc:        # the thread is every task's: never its end
                    log(3, f"layer {layer}: its path set: {exc}")
        self.put(run)

    def run(self) -> None:
        while True:
            self.jobs.get()()

    def current(self, job: MergeCheck | FirstLook, error: str | None, what: str
                ) -> tuple[Task, HeldTask] | None:
        """The task of a job that came back, if it still waits for exactly that job and the
        job did not fail (else the task fails: `what` could not be done)."""
        task, held = self.box.task(job.task_id), self.held.get(job.task_id)
        if task is None or held is None or held.token != job.token or \
                task.state not in ("running", "waiting"):
            if task is None or task.state not in ACTIVE_STATES:
                self.drop(job.task_id)
                self.box.views.gc_soon()          # an undone one's layer is free now
            return None
        if error is not None:
            self.drop(task.id)             # no job comes back for it: nothing left to pin
            self.box.fail_task(task, f"finish-time merge: {what}: {error}")
            return None
        return task, held

    def checked(self, job: MergeCheck, result: MergeResult | None, error: str | None) -> None:
        """Loop: a check came back: settled (its writes applied), or a conflict asked."""
        found = self.current(job, error, "cannot compare")
        if found is None or result is None:
            return
        task, held = found
        if not result.conflicts:
            self.settle(task, held, job, result)
            return
        held.pending, held.pending_check = result, job
        shown = result.conflicts[:MERGE_CONFLICTS_SHOWN]
        paths = [c["path"] for c in shown]
        question = (f"{counted(len(result.conflicts), 'path')} changed both by this task and "
                    "by tasks that ended while it ran: " + ", ".join(paths[:20]) +
                    (" ..." if len(result.conflicts) > 20 else ""))
        more = {key: len(every) - MERGE_CONFLICTS_SHOWN for key, every in (
            ("morePaths", result.conflicts), ("moreMerged", result.merged))
            if len(every) > MERGE_CONFLICTS_SHOWN}
        try:
            made = self.box.broker.create(task, "conflict", "merge", {
                "paths": shown, "merged": result.merged[:MERGE_CONFLICTS_SHOWN], **more}, 0,
                question)
        except (ApiError, OSError) as exc:
            self.drop(task.id)
            self.box.fail_task(task, "conflict: cannot ask: " +
                               (exc.message if isinstance(exc, ApiError) else str(exc)))
            return
        held.approval = made["wait"]
        self.box.append_log(task.id, {"type": "conflict", "approval": held.approval,
                                      "paths": paths, "text": question})

    def settle(self, task: Task, held: HeldTask, job: MergeCheck, result: MergeResult) -> None:
        """Write a settled check into the layer (off the loop), then check again."""
        box = self.box
        held.token = self.tokens = self.tokens + 1
        job = dataclasses.replace(job, token=held.token)

        def work(tmp: str) -> MergeResult:
            apply_writes(box.path(), job.upper, result.writes, job.now, job.workspace_dir,
                         box.store_owner())
            if result.writes:
                self.paths.forget(job.task_id)       # its layer holds other paths now
            return result
        self.submit(job, self.applied, work)

    def applied(self, job: MergeCheck, result: MergeResult | None, error: str | None) -> None:
        """Loop: the layer holds the merge: it is based on the job's stack now."""
        found = self.current(job, error, "cannot write it")
        if found is None or result is None:
            return
        task, held = found
        held.seen = (job.stack, job.now)
        if result.merged:
            held.merged.update(dict.fromkeys(result.merged))
            self.box.append_log(task.id, {"type": "merge", **capped("merged", result.merged),
                                          "text": "merged with tasks that ended meanwhile: " +
                                          names_shown(result.merged)})
        self.check(task)

    def finish(self, task: Task) -> None:
        """The check is settled on the view now: the task becomes done (maybe_finish again,
        in this same loop step, so no other task can become done in between)."""
        held = self.held[task.id]
        self.drop(task.id)
        if held.merged:
            every = capped("merged", sorted(held.merged))
            task.merged, task.moreMerged = every["merged"], every.get("moreMerged")
        if held.seen is not None and held.seen[0] != task.layers:   # its diff's base
            task.mergedOn = self.box.stacks.ref(task.workspace, held.seen[0])
        self.cleared.add(task.id)
        self.box.maybe_finish(held.worker)

    def on_answer(self, approval: Approval) -> None:
        """A conflict answered: by a person (approve: the answer's writes with the merge's
        own, then checked again; deny: the task fails, nothing applied); by anything else
        (undo, stop, a restart) it ends with the task, which its caller ends."""
        held = self.held.get(approval.task)
        task = self.box.task(approval.task)
        if held is None or task is None or held.approval != approval.id or \
                held.pending is None or held.pending_check is None:
            return
        result, job = held.pending, held.pending_check
        held.pending = held.pending_check = held.approval = None
        if approval.answeredBy != "api":
            self.drop(task.id)
            return
        if approval.state != "approved":
            self.drop(task.id)
            self.box.fail_task(task, f"conflict: {approval.reason or 'denied'}")
            return
        result.writes.update(conflict_answer(approval, approval.approvedArgs,
                                             result.conflicts))
        result.conflicts = []
        self.settle(task, held, job, result)

    def undone(self, task: Task) -> None:
        """Box.undo: a done task was undone; the revert of its change in later layers'
        copies goes to the thread (design above).  Nothing if no layer is above it.  The
        undo's answer waits for the job's `named` (undo_answer), the loop never."""
        box, ws = self.box, task.workspace
        stack = box.views.stack_ids(ws)         # newest first: those above it lead
        count = bisect.bisect_left(stack, -task.doneSeq, key=lambda i: -box.get(i).doneSeq)
        upper = os.path.join(box.layer_dir(task.id), "upper")
        if task.doneSeq <= 0 or not count or not os.path.isdir(upper):
            return
        above, below = stack[:count], stack[count:]
        layerstack = box.views.layerstack
        plan = layerstack.plan
        self.tokens += 1
        on_top, under = plan(ws, above), plan(ws, below)   # the view now: on_top + under
        job = self.undoing[task.id] = UndoJob(
            task.id, self.tokens, upper, plan(ws, [task.id] + below), under, on_top + under,
            f"workspaces/{ws}", len(on_top),
            {p: layerstack.merged[p.partition("/")[2]].members for p in on_top
             if p.startswith(MERGED_DIR + "/")}, stack)
        self.reading["undo " + task.id] = (stack + [task.id], job.top + job.below + job.now)
        self.submit(job, self.reverted, lambda tmp: run_undo(job, box, self.paths, tmp))

    def resume(self) -> None:
        """reconcile, before gc_layers: an undo a restart cut short (undone, its revert not
        recorded, its layer still on disk) is taken up again, on the stack now."""
        for task in sorted(self.box.tasks.values(), key=lambda t: t.doneSeq):
            self.resume_one(task)

    def resume_one(self, task: Task) -> None:
        """An undone task whose revert was not begun or not recorded (or waits: a record a
        save took along, say): begun now."""
        if task.state == "undone" and (task.undoMerge is None or task.undoMerge.get(
                "state") == "waiting") and not task.layerDeleted and task.id not in self.undoing:
            task.undoMerge = None                  # as unwritten: nothing above it, none
            self.undone(task)

    def withdraw(self, task: Task) -> None:
        """Box.undo: the undone state could not be saved: the revert begun is dropped (its
        result, when it comes, is not the job's any more: reverted cleans it up)."""
        if task.id in self.undoing:
            self.job_ended(task.id)

    def named(self, task: Task) -> "Future[dict[str, Any]] | None":
        """Box.undo: what its answer waits for (undo_answer), if a revert is in flight."""
        job = self.undoing.get(task.id)
        return job.named if job is not None else None

    def reverted(self, job: UndoJob, result: UndoResult | None, error: str | None) -> None:
        """Loop: the revert layer joins the stack if the stack is still the one it read
        (else recheck), and the undone task's record and log say what was reverted and
        what was kept."""
        task = self.box.task(job.task_id)
        stack = self.box.views.stack_ids(task.workspace)
        if self.undoing.get(task.id) is job and error is None and result is not None and \
                stack != job.stack:
            return self.recheck(job, result, stack)
        try:
            if self.undoing.get(task.id) is job and isinstance(error, DiskFull):
                self.retry_later(task, job, error)
            elif self.undoing.get(task.id) is job:
                self.revert_joins(task, job, result, error)
        finally:
            if self.undoing.get(task.id) is job and task.id not in self.retries:
                self.job_ended(task.id)
            if result is not None:
                self.staged_close(result)         # the staged layer, unless it joined

    def retry_later(self, task: Task, job: UndoJob, error: str) -> None:
        """A revert met a disk error that passes (no room, read-only, I/O): its job stays
        (the undone layer kept) and is begun again on the stack then, after a wait that
        doubles at each failure (tick).  The record says `waiting`, why and when it is tried
        again, in memory only (the API, an event): on disk it stays unwritten, so a restart
        takes the revert up as one cut short.  What it had decided is not written: a next
        undo answers the waiting record, an undo waiting on `named` gets it too."""
        job.failures += 1
        wait = min(MERGE_RETRY_MAX, MERGE_RETRY * 2 ** (job.failures - 1))
        self.retries[task.id] = time.monotonic() + wait
        task.undoMerge = undo_waiting(error, wait)
        if not job.named.done():
            job.named.set_result(task.undoMerge)
        job.named = Future()
        log(3, f"task {task.id}: its revert in later copies: {error}; tried again in "
               f"{wait:.0f} s")
        self.box.loop.render(task)
        self.box.loop.emit("task", task.to_api())

    def tick(self) -> float:
        """Loop timer (Box.tick): the reverts whose wait is over begin again.  Seconds until
        the next."""
        now = time.monotonic()
        for task_id in [i for i, at in self.retries.items() if at <= now]:
            del self.retries[task_id]
            task, job = self.box.get(task_id), self.undoing.get(task_id)
            if job is None:                            # ended meanwhile (withdraw)
                continue
            self.job_ended(task_id)
            task.undoMerge = None                      # its record unwritten again: trying
            self.undone(task)                          # on the stack now
            if task_id in self.undoing:
                self.undoing[task_id].failures = job.failures
            else:                                      # nothing above it any more
                self.revert_joins(task, job, UndoResult(), None)
        if self.litter and self.litter_at <= now:
            self.litter_remove()
        return min([at - now for at in self.retries.values()] + [MERGE_RETRY_MAX] +
                   ([self.litter_at - now] if self.litter else []))

    def staged_close(self, result: UndoResult) -> None:
        """A revert's staged layer removed, unless it joined (renamed away).  One the disk
        refuses to remove now (read-only, I/O errors) is removed later (litter_remove), not
        left for the next start."""
        if result.cleanup is None:
            return
        try:
            result.cleanup.close()
        except OSError as exc:
            log(3, f"the staged revert {result.staging} is removed later: {exc}")
            self.litter_later({result.staging} if result.staging else set())

    def litter_later(self, paths: set[str], again: bool = False) -> None:
        """Loop: staged reverts to remove after MERGE_RETRY (tick); again (a removal that
        failed): after twice the last wait, up to MERGE_RETRY_MAX."""
        if paths:
            self.litter_wait = min(MERGE_RETRY_MAX, self.litter_wait * 2) if again else \
                MERGE_RETRY
            self.litter |= paths
            self.litter_at = time.monotonic() + self.litter_wait

    def litter_remove(self) -> None:
        """tick: the staged reverts the disk kept are removed on the merge thread (trees:
        never on the loop); those it still refuses come back for the next try."""
        paths, self.litter = self.litter, set()
        box = self.box

        def run() -> None:
            left = set()
            for path in sorted(paths):
                try:
                    tree_remove(path)
                except OSError as exc:
                    log(7, f"the staged revert {path} is not removed yet: {exc}")
                    left.add(path)
            with contextlib.suppress(OSError):        # the loop is gone (stopping)
                box.loop.post(box.loop.guard, None, self.litter_later, left, True)

        self.put(run)

    def job_ended(self, task_id: str) -> None:
        """A revert's job is over: the layers it read are free, the undone one may go."""
        self.undoing.pop(task_id, None)
        self.retries.pop(task_id, None)
        self.reading.pop("undo " + task_id, None)
        self.box.views.gc_soon()

    def recheck(self, job: UndoJob, result: UndoResult, stack: list[str]) -> None:
        """The stack changed while a revert was decided (the next undo of a burst does):
        the thread looks only at the layers that came or went since, by their path sets
        (LayerPaths); the revert joins if none of them could change it, else it is built
        again on the stack now (rechecked).  Never built again from the start at each."""
        moved = set(job.stack).symmetric_difference(stack)    # a few of 10,000: one set
        uppers = [(i, os.path.join(self.box.layer_dir(i), "upper")) for i in sorted(moved)]
        region, read, written = result.region, result.read, result.staging is not None

        def work(tmp: str) -> bool:
            return region is None or any(region.meets(self.paths.of(i, upper), read, written)
                                         for i, upper in uppers)

        self.submit(job, lambda job, met, error: self.rechecked(job, result, stack,
                                                                 met is not False or
                                                                 error is not None), work)

    def rechecked(self, job: UndoJob, result: UndoResult, stack: list[str], met: bool
                  ) -> None:
        """Loop: a recheck came back: the revert holds on stack (joins, or is checked again
        if the stack moved on), or it is built again."""
        task = self.box.get(job.task_id)
        if self.undoing.get(task.id) is not job or met:
            self.staged_close(result)
            if self.undoing.get(task.id) is job:
                self.job_ended(task.id)
                self.undone(task)                    # built again on the stack now
                if task.id not in self.undoing:      # nothing above it any more
                    self.revert_joins(task, job, UndoResult(), None)
            return
        job.stack = stack
        self.reading["undo " + task.id] = (stack + [task.id], self.reading.get(
            "undo " + task.id, ([], []))[1])       # the layers a next recheck reads
        self.reverted(job, result, None)

    def revert_joins(self, task: Task, job: UndoJob, result: UndoResult | None,
                     error: str | None) -> None:
        """The revert's layer joins (upload_commit); the record, the log and an event.  A
        layer whose own task cannot be saved for a disk error that passes (a 507 of a full,
        read-only or failing disk) waits as a revert that met one while built does
        (retry_later): built again later, its record `waiting` meanwhile (not on disk); any
        other error is recorded failed."""
        box = self.box
        layer = None
        if result is not None and result.staging is not None and error is None:
            crash_point("undo-revert-written")   # a test's kill -9: written, state saved
            stop_point("undo-revert-written")    # a test fills the disk here
            try:
                layer = upload_commit(
                    box, task.workspace, result.staging, f"undo of {task.id}",
                    f"the exact undo of task {task.id}: its change taken out of the later "
                    "tasks' copies", "reverted: " + names_shown(result.reverted,
                                                                 shown=MERGE_CONFLICTS_SHOWN)
                )["id"]
            except (OSError, ApiError) as exc:       # recorded failed, never lost unsaid
                error = exc.message if isinstance(exc, ApiError) else str(exc)
                if no_room(exc) and self.undoing.get(task.id) is job:
                    return self.retry_later(task, job, f"its layer not saved: {error}")
        task.undoMerge = undo_record(result, error, layer)
        if not job.named.done():
            job.named.set_result(task.undoMerge)
        try:
            box.save(task, sync=not record_empty(task.undoMerge))
        except OSError as exc:
            log(3, f"task {task.id}: its undo record is not saved yet: {exc}")
            box.save_again(task)
            box.loop.render(task)
        with contextlib.suppress(OSError):            # a full disk: the event says it still
            box.append_log(task.id, {"type": "undo", **task.undoMerge, "text": (
                f"later copies not reverted: {error}" if error is not None else
                "reverted in later copies: " + (names_shown(
                    result.reverted if result else [], shown=MERGE_CONFLICTS_SHOWN) or "none") +
                "; kept whole: " + (names_shown([f"{k['path']} (in {k['task']})" for k in
                                                 (result.kept if result else [])],
                                                shown=MERGE_CONFLICTS_SHOWN) or "none"))})
        box.loop.emit("task", task.to_api())


# Exact undo: a later task's copy of a file holds the undone task's change too (a layer is
# whole files), so undo takes that change out of the copy.  Where it lives, and why:
#   - The reverted versions go into a layer of the undo's own, a done task of worker upload
#     on top of the stack (upload_commit): every view, plan, merged group and later check
#     takes it in as any layer, the undone task's and the later tasks' layers stay as they
#     were written (never changed once done, so merged layers and running views stay
#     exact), and a later undo of the later task sees the reverted copy as a copy above it
#     and reverts that one in turn (identical changes on both sides merge cleanly).
#   - For each path the undone task changed that a layer above it holds: base = the undone
#     task's version (the view it made), ours = the version on top now, theirs = the version
#     below it.  ours equal to base: theirs, whole; else a three-way merge; not clean (the
#     later task changed the same lines again, deleted the file, or a folder stands there):
#     the later version stays whole, and the undone task's record (`undoMerge.kept`) and log
#     name each such path and the task that holds it.
#   - Undo answers at once and names the paths: the loop only marks the task undone and
#     hands the revert to the merge thread (views of plans kept by gc_layers until it is
#     done: FinishMerge.pin); the thread decides every path first (reads and merges only,
#     each bounded as the finish-time check's), resolves the job's `named` future with
#     what it decided, then writes the layer.  The HTTP handler (its own thread) waits on
#     that future, at most UNDO_ANSWER_WAIT: the answer's undoMerge names the reverted
#     paths and each kept one with the task that holds it (state `writing`: the layer
#     joins a moment later, then the record says `done` with its id).  Only a revert that
#     takes longer (huge files, a slow disk) answers `checking`: then the record, the log
#     and a task event name them when it ends.  The loop never waits on either.
#   - If the stack changed meanwhile (the next undo of a burst changes it), the layers that
#     came or went are looked at by their path sets (FinishMerge.recheck, Region.meets):
#     the revert joins unless one of them holds, hides or changes below a path it decided
#     or a folder it wrote in; then it is built again.  It joins in one step (renamed,
#     then saved), so a crash leaves no half layer (a crash between the two leaves a
#     folder no task names: the next start collects it, Box.orphans_collect).  A second
#     undo changes
#     nothing: it answers what the record holds, or waits on the same job.  A job that
#     fails says so (state `failed`, its error) in the record, the log and an event, but for
#     one that met a disk error that passes (DISK_WAIT_ERRNOS: no room, a read-only
#     remount, I/O errors; to build its layer, or to save the layer's own task: a 507): it
#     waits, job and undone layer kept, its record `waiting` in memory only (why, retryAt),
#     and is begun again on the stack then (FinishMerge.retry_later, tick).  A
#     restart before the layer joined takes the undo up again (FinishMerge.resume: an
#     undone task without undoMerge, or one waiting, whose layer is still on disk), on the
#     stack then: what had joined already is seen as reverted, so it is never reverted twice.
#   - The versions are read from the layer directories, not through mounted views
#     (PlanReads): the undone layer is listed whole, every lower of the plans only along
#     the way to its paths and below them (Region), from its path set (LayerPaths, read
#     once: at 10,000 layers an undo walked every layer above it at each undo, ~200 ms),
#     and a path's version is the one of the topmost lower that holds it, absent under a
#     whiteout, a non-folder or an opaque folder above.  That is all overlay does with
#     index, metacopy and redirect_dir off (merged layers stand on the same fact), and a
#     fresh overlay of 100 lowers costs a lookup in each of them per path: the answer for
#     100 copies took 81 ms so, 25 now.
#     Only the writes mount the view now (upper_put reads folders' modes through it).

UNDO_ANSWER_WAIT = 2.0      # seconds an undo's answer waits for its revert to name paths


@dataclass
class UndoJob:
    """The revert of an undone task's change in later copies, as the thread gets it."""

    task_id: str
    token: int
    upper: str                       # the undone task's layer (absolute)
    top: list[str]                   # the plan of the view it made: it and what is below
    below: list[str]                 # the plan of the view below it
    now: list[str]                   # the plan of the view now: the lowers above it first
    workspace_dir: str
    above: int                       # how many of now's lowers are above it
    merged: dict[str, list[str]]     # those that are merged layers: their ids, newest first
    stack: list[str]
    named: "Future[dict[str, Any]]" = field(default_factory=Future)   # undo_record's, once
    #                                  the paths are decided (before the layer is written)
    failures: int = 0                # tries that found no room (FinishMerge.retry_later)


@dataclass
class UndoResult:
    """The reverted versions (in a staged layer) and the paths later versions keep whole."""

    reverted: list[str] = field(default_factory=list)
    kept: list[dict[str, str]] = field(default_factory=list)   # {path, task, why}
    staging: str | None = None
    cleanup: contextlib.ExitStack | None = None
    region: Region | None = None     # what it read: the paths and the folders on their way,
    read: set[str] = field(default_factory=set)   # those whose versions it compared


def undo_record(result: UndoResult | None, error: str | None, layer: str | None
                ) -> dict[str, Any]:
    """A task's undoMerge: what its undo reverted in later copies and what it kept whole
    (state writing: decided, its layer not joined yet; done; failed, with the error)."""
    if error is not None or result is None:
        return {"reverted": [], "kept": [], "layer": None, "state": "failed",
                "error": error or "no result"}
    return {**capped("reverted", result.reverted), **capped("kept", result.kept),
            "layer": layer,
            "state": "done" if layer is not None or not result.reverted else "writing"}


def undo_waiting(error: str, wait: float) -> dict[str, Any]:
    """The undoMerge of a revert that met a disk error that passes: nothing reverted yet,
    why, and when it is tried again (FinishMerge.retry_later)."""
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=wait)
    return {"reverted": [], "kept": [], "layer": None, "state": "waiting", "error": error,
            "retryAt": at.isoformat(timespec="milliseconds").replace("+00:00", "Z")}


def capped(key: str, every: list[Any]) -> dict[str, Any]:
    """{key: the first MERGE_CONFLICTS_SHOWN of every}, and {moreKey: the rest's count} if
    any: a record, log line or event that names them stays bounded."""
    out: dict[str, Any] = {key: every[:MERGE_CONFLICTS_SHOWN]}
    if len(every) > MERGE_CONFLICTS_SHOWN:
        out["more" + key[0].upper() + key[1:]] = len(every) - MERGE_CONFLICTS_SHOWN
    return out


def names_shown(names: list[str], shown: int = 20) -> str:
    """The first `shown` names, for a log line's text, and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def record_empty(record: dict[str, Any]) -> bool:
    """An undoMerge that names nothing (done: nothing reverted, nothing kept).  Its save
    needs no sync of its own: a crash that loses it takes the revert up again at the next
    start (FinishMerge.resume), on the stack then, or finds the layer deleted and leaves the
    record out.  The loop then does not stop for a sync the next undo of a burst would wait
    behind."""
    return record["state"] == "done" and not record["reverted"] and not record["kept"]


def undo_answer(answer: dict[str, Any], named: "Future[dict[str, Any]] | None"
                ) -> dict[str, Any]:
    """An undo's answer (the HTTP thread, never the loop): the task with the paths its
    revert decided, once decided (at most UNDO_ANSWER_WAIT; else state checking)."""
    if named is None or "undoMerge" in answer:
        return answer
    try:
        found = named.result(timeout=UNDO_ANSWER_WAIT)
    except TimeoutError:
        found = {"reverted": [], "kept": [], "layer": None, "state": "checking"}
    return {**answer, "undoMerge": found}


def revert_write(base: Version, ours: Version, theirs: Version, tmp: str,
                 deadline: float = INF) -> tuple[tuple[Any, ...] | None, str | None]:
    """What takes the undone task's change out of the version on top at a path (base: in
    the view it made, ours: now, theirs: below it): (a write for upper_put, None) or (None,
    why the later version stays whole); (None, None) when nothing of its change is left."""
    if ours.same(theirs) or theirs.same(base) or base.kind == "folder":
        return None, None
    if ours.same(base) and theirs.kind in ("absent", "symlink"):
        return (("absent",) if theirs.kind == "absent" else ("symlink", theirs.data)), None
    if ours.same(base) and theirs.kind == "file" and theirs.size <= MERGE_MAX_BYTES:
        return (("text", theirs.body, theirs.mode), None) if theirs.body is not None else \
            (None, "its version below cannot be read")
    if {base.kind, ours.kind, theirs.kind} != {"file"}:
        return None, f"a later task built on it (there is a {ours.kind} there now)"
    if max(base.size, ours.size, theirs.size) > MERGE_MAX_BYTES:
        return None, f"too large to merge (at most {MERGE_MAX_BYTES} bytes)"
    texts = [v.body for v in (ours, base, theirs)]
    if any(t is None or is_binary(t) for t in texts):
        return None, "a binary file a later task changed again"
    try:
        clean, merged = merge_text(texts[0] or b"", texts[1] or b"", texts[2] or b"", tmp,
                                   deadline)
    except OSError as exc:
        return None, f"could not be merged: {exc.strerror or exc}"
    if not clean:
        return None, "a later task changed the same lines again"
    return ("text", merged, ours.mode if ours.mode != base.mode else theirs.mode), None


@dataclass
class PlanShown:
    """A view of a plan as PlanReads knows it: each path's first lower that holds it, and
    that hides what is below it (a non-folder or an opaque folder)."""

    plan: list[str]
    held: dict[str, int] = field(default_factory=dict)
    hiding: dict[str, int] = field(default_factory=dict)


@dataclass
class Region:
    """The paths a revert of mine reads: mine (marked), the folders on their way, all below
    them."""

    marked: set[str]
    way: set[str]
    near: set[str]                   # marked and way

    @classmethod
    def of(cls, mine: list[str]) -> "Region":
        marked = set(mine)
        way = {a for p in marked for a in _parents(p)}
        return cls(marked, way, marked | way)

    def within(self, path: str) -> bool:
        return path in self.near or any(a in self.marked for a in _parents(path))

    def entries(self, paths: dict[str, int]) -> dict[str, int]:
        """A layer's path set within the region (what layer_entries lists with within),
        by look-ups of the region's paths or a pass over the set, whichever is shorter;
        below a marked path only where the layer has a folder there."""
        if len(paths) <= len(self.near):
            return {p: tag for p, tag in paths.items() if self.within(p)}
        out = {p: paths[p] for p in self.near if p in paths}
        if any(out.get(p, PATH_HIDES) >= 0 or out.get(p) == PATH_OPAQUE for p in self.marked):
            out.update((p, tag) for p, tag in paths.items() if p not in out and
                       any(a in self.marked for a in _parents(p)))
        return out

    def meets(self, paths: dict[str, int] | None, read: set[str], written: bool) -> bool:
        """Could a layer of this path set (None: unknown), gained or lost by the stack,
        change what a revert decided (read: the paths whose versions it compared) or wrote
        (written: its folders take the modes the view shows)?  Only by an entry within the
        region that is marked, read, hides what is below it, or a folder it wrote in."""
        return paths is None or any(p in self.marked or p in read or tag < 0 or written
                                    for p, tag in self.entries(paths).items())


class PlanReads:
    """The versions of paths in views of plans, read straight from the layer directory
    that shows each one, not through mounted views (exact undo, below).  Each layer is
    listed once, only within the region of the paths asked about: from its path set
    (LayerPaths, kept across jobs: a done layer is never written again) when it has one,
    else by a walk of the region.  The merge thread's, for one job."""

    def __init__(self, home: str, workspace_dir: str, region: Region, paths: LayerPaths
                 ) -> None:
        self.home, self.region, self.paths = home, region, paths
        self.listings: dict[str, dict[str, int]] = {}    # by plan entry (BOX_HOME-relative)
        self.fds: dict[str, int] = {}
        self.base = os.open(os.path.join(home, workspace_dir),
                            os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def fd(self, layer: str) -> int:
        if layer not in self.fds:
            self.fds[layer] = os.open(os.path.join(self.home, layer), DIR_FLAGS)
        return self.fds[layer]

    def listed(self, layer: str) -> dict[str, int]:
        if layer not in self.listings:
            known = self.paths.of(paths_key(layer), os.path.join(self.home, layer))
            self.listings[layer] = self.region.entries(known) if known is not None else \
                layer_entries(self.fd(layer), self.region.within)
        return self.listings[layer]

    def shown(self, plan: list[str]) -> PlanShown:
        """What the view of plan (newest first) shows, for version()."""
        shown = PlanShown(plan)
        for n, layer in enumerate(plan):
            for path, tag in self.listed(layer).items():
                shown.held.setdefault(path, n)
                if tag < 0:                          # a non-folder or an opaque one
                    shown.hiding.setdefault(path, n)
        return shown

    def version(self, shown: PlanShown, path: str) -> Version:
        """The version at path (within the region) in a view."""
        n = shown.held.get(path, len(shown.plan))
        if any(shown.hiding.get(p, n) < n for p in _parents(path)):
            return Version("absent")                 # a folder on its way is hidden above
        if n == len(shown.plan):
            return view_version(self.base, path, MERGE_MAX_BYTES)
        if self.listed(shown.plan[n])[path] == PATH_WHITEOUT:
            return Version("absent")
        return view_version(self.fd(shown.plan[n]), path, MERGE_MAX_BYTES)

    def close(self) -> None:
        for fd in [*self.fds.values(), self.base]:
            os.close(fd)


def paths_key(layer: str) -> str:
    """A plan entry's key in LayerPaths: a task's id for its layer, else the entry."""
    parts = layer.split("/")
    return parts[1] if parts[0] == "layers" else layer


def undo_holder(job: UndoJob, reads: PlanReads, holders: dict[str, str], path: str) -> str:
    """The task whose layer holds path (or a folder above it) on top: the newest above the
    undone task; in a merged layer, the newest of its members that holds it."""
    found = next(((p, holders[p]) for p in [path, *_parents(path)] if p in holders), None)
    if found is None:
        return ""
    held, layer = found
    for task_id in job.merged.get(layer, []):
        with contextlib.suppress(OSError):
            if reads.listed(lower_layer_paths([task_id])[0]).get(held, 0) < 0:
                return task_id
    return job.merged[layer][0] if layer in job.merged else layer.split("/")[1]


def run_undo(job: UndoJob, box: "Box", paths: LayerPaths, tmp: str) -> UndoResult:
    """The thread: the undone task's paths that layers above it touch, each reverted in a
    staged layer of its own, or named as kept whole.  The paths are decided from the
    layers themselves (PlanReads); only the revert's writes mount the view now."""
    result = UndoResult()
    home_fd = os.open(box.path(), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    reads: PlanReads | None = None
    view_fd = -1
    try:
        own = paths.of(job.task_id, job.upper)
        own = own if own is not None else layer_entries(job.upper)
        mine = [path for path, tag in own.items() if tag < 0]
        reads = PlanReads(box.path(), job.workspace_dir, Region.of(mine), paths)
        reads.listings[lower_layer_paths([job.task_id])[0]] = own
        holders: dict[str, str] = {}                 # path -> the lower above that holds it
        for layer in job.now[:job.above] if mine else []:      # newest first: the holder
            for path, tag in reads.listed(layer).items():
                if tag < 0:
                    holders.setdefault(path, layer)
        writes: dict[str, tuple[Any, ...]] = {}
        paths_read = touched(mine, list(holders))      # mostly none: no views to show
        views = [reads.shown(plan) for plan in (job.top, job.now, job.below) if paths_read]
        deadline = time.monotonic() + MERGE_CHECK_SECONDS
        for path in paths_read:
            result.read.add(path)
            write, why = revert_write(*(reads.version(view, path) for view in views), tmp,
                                      deadline)
            if write is not None:
                writes[path] = write
            elif why is not None:
                result.kept.append({"path": path, "task": undo_holder(job, reads, holders,
                                                                      path), "why": why})
        result.reverted, result.region = sorted(writes), reads.region
        job.named.set_result(undo_record(result, None, None))   # the answer names them now
        if writes:
            result.cleanup = contextlib.ExitStack()
            result.staging = result.cleanup.enter_context(upload_staging(box))
            view_fd = view_open(home_fd, job.now, job.workspace_dir)
            upper_fd = os.open(os.path.join(result.staging, "upper"), DIR_FLAGS)
            try:
                for path, write in sorted(writes.items()):
                    upper_put(upper_fd, path, write, view_fd, box.store_owner())
                _syncfs(upper_fd)                   # on disk before the layer joins
            finally:
                os.close(upper_fd)
        return result
    except BaseException:
        if result.cleanup is not None:
            try:
                result.cleanup.close()
            except OSError:                         # the loop removes it later
                with contextlib.suppress(OSError):
                    box.loop.post(box.loop.guard, None, box.finish_merge.litter_later,
                                  {result.staging} if result.staging else set())
        raise
    finally:
        if reads is not None:
            reads.close()
        for fd in (view_fd, home_fd):
            if fd >= 0:
                os.close(fd)


# Tasks #########################################################################################
###############################################################################################

@dataclass
class Worker:
    """A running task's worker process as the loop sees it."""

    task_id: str
    pid: int
    fd: int                          # the worker's report pipe (JSON lines)
    buf: bytes = b""
    exit_code: int | None = None
    eof: bool = False
    last_out: str = ""
    last_err: str = ""               # since the latest step
    error: str | None = None         # the sandbox could not be built
    log_fd: int = -1
    gate: int = -1                   # its gate's end, until gates_open lets it on
    gate_fds: list[int] = field(default_factory=list)   # sent at the gate (the Network's)
    logged_at: float = 0.0           # the time of its task's latest log line
    started: float = field(default_factory=time.monotonic)
    droid_error: str = ""            # the latest error event of a droid worker
    model_cents: float = 0.0         # model cost counted so far (usage is cumulative)
    stream_usage: bool = False       # droid's stream usage is its spending (droidFactoryKey)
    budget_limit: float = 0.0        # costCents above this pauses a droid worker
    paused: str | None = None        # the approval a paused (SIGSTOP) worker waits for
    holds: set[str] = field(default_factory=set)   # why it is frozen: budget, disk
    disk_wait: str | None = None     # the disk approval it waits for
    disk_floor: int = LIMIT_MAX      # free bytes below which it may be paused for disk
    log_cap: LogCap = field(default_factory=lambda: LogCap(LIMIT_MAX))

    def began(self, msg: dict[str, Any]) -> float:
        """When a reported step began: the worker's own clock (its `at`, taken as it began,
        before the loop read it), held between the worker's spawn and now."""
        now = time.time()
        at = msg.get("at")
        if not isinstance(at, (int, float)) or not math.isfinite(at):
            return now
        return min(max(float(at), now - (time.monotonic() - self.started)), now)


class StepGroup:
    """One loop step's saves, ends, starts and account edits, each kind made together: one
    group commit, one edit of the account files (a burst starts and ends tens of tasks).

    grouped() (a loop step's events: Loop.on_ready, Box.on_exits) collects the terminal
    states set_state gives (end_later), the users of ended tasks (user_gone), the unsynced
    saves put off (save_later: a step's text, a droid's summary and cost) and a schedule
    (schedule_later); at its end the put-off saves go in one unsynced commit, the ends in one
    synced commit, then each is logged and announced, and the users gone are removed in the
    edit that makes those of the tasks starting in their place (users_making).  starting() (one
    schedule's starts) collects their running states (start_later).

    Crashes: an end is synced before it is logged or announced.  A put-off save is made at
    the step's end, before its answers: a kill -9 before then loses it (power loss, any
    unsynced save), and the task file lacks a running task's latest step, summary or cost
    (its log has the lines); the next start fails that task anyway.  A cost past the budget
    is saved at once, synced, before a person is asked.
    """

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.gone: list[str] | None = None       # users grouped() removes together
        self.ends: list[Task] | None = None      # terminal saves grouped() makes
        self.due: list[Task] | None = None       # unsynced saves grouped() makes
        self.starts: list[Task] | None = None    # running saves starting() makes together
        self.schedule_due = False                # grouped() schedules once, at its end
        self.editing: AccountEdit | None = None  # the edit users_making holds open

    def schedule_later(self) -> bool:
        """Inside grouped() or starting(): the schedule runs again at their end (an inner
        run would start the outer's tasks twice and drop its saves)."""
        self.schedule_due = self.gone is not None or self.starts is not None
        return self.schedule_due

    def end_later(self, task: Task) -> bool:
        """Inside grouped(): a terminal state saved, then logged, with the others."""
        if self.ends is not None:
            self.ends += [] if any(t is task for t in self.ends) else [task]
        return self.ends is not None

    def start_later(self, task: Task) -> bool:
        """Inside starting(): a running state saved and announced with the others."""
        if self.starts is not None:
            self.starts.append(task)
        return self.starts is not None

    def user_gone(self, name: str) -> None:
        """A task's user removed: with the others inside grouped(), else at once."""
        if self.editing is not None:             # not made yet: never written
            self.editing.forget(name)
        elif self.gone is not None:
            self.gone.append(name)
        else:
            user_del(name)

    def save_later(self, task: Task) -> None:
        """An unsynced save made at the end of grouped() with the others, or not at all if
        the task is saved meanwhile (a short task reports its step and ends in one loop
        step): a task file less to write and rename."""
        if self.due is None:
            self.box.save(task, sync=False)
        elif all(t is not task for t in self.due):
            self.due.append(task)

    def saved(self, tasks: list[Task]) -> None:
        """Box.save_all: these tasks are saved; a put-off save of theirs is not due."""
        if self.due:
            self.due[:] = [t for t in self.due if all(t is not s for s in tasks)]

    def save_due(self) -> None:
        """grouped(): the put-off saves, of tasks not ending in this group, in one unsynced
        group commit; if it cannot be made, each on its own, and those that still cannot be
        saved fail (as a save would)."""
        due, self.due = self.due or [], None
        due = [t for t in due if t.state in ACTIVE_STATES and
               all(t is not e for e in self.ends or ())]
        try:
            self.box.save_all(due, sync=False)
        except OSError:
            for task in due:              # each on its own: only those that cannot be fail
                try:
                    self.box.save_all([task], sync=False)
                except OSError as exc:
                    self.box.fail_task(task, cannot_save(exc))

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """One schedule's starts: their running states saved in one group commit at the end
        (set_state logged them), then announced; those that cannot be saved fail."""
        self.starts = []
        try:
            yield
        finally:
            started, self.starts = self.starts, None
            if started:
                stop_point("running-save")      # a test's pause: the workers at their gates
            self.commit(started, ended=False)

    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """The tasks that end inside (a loop step's events: an exit, or the end of a report
        pipe read after it) saved in one group commit at its end, then each logged and
        announced; the users of those that ended go, and those of the tasks that start in
        their place come, in one edit of the account files (users_making).  A crash before that
        leaves users the next start removes.  Nested, the outer one does this."""
        if self.gone is not None:
            yield
            return
        self.gone, self.ends, self.due = [], [], []
        try:
            yield
        finally:
            try:
                self.save_due()
            finally:
                names, self.gone = self.gone or [], None
                ended, self.ends = self.ends or [], None
                try:
                    self.commit(ended, ended=True)
                finally:                 # whatever that raised, the users gone still go
                    due, self.schedule_due = self.schedule_due, False
                    if due:
                        self.box.schedule(names)   # removed in the edit of the new users
                    else:
                        self.users_remove(names)

    def commit(self, tasks: list[Task], ended: bool) -> None:
        """tasks saved in one synced group commit, then (ended) each logged and announced in
        set_state's order, or (started) announced.  If they cannot be saved: an end is failed
        in memory (not_saved), a done one out of the stack again; a start fails.  Those whose
        file was renamed before the error (PartlyRenamed) are saved, as their files say."""
        box = self.box
        if not tasks:
            return
        renamed, error = len(tasks), None
        try:
            box.save_all(tasks)
        except OSError as exc:
            renamed, error = (exc.renamed if isinstance(exc, PartlyRenamed) else 0), exc
            log(3, f"a group save failed after {renamed} of {len(tasks)} tasks: {exc}")
            box.saved_rendered(tasks[:renamed])     # as their files say
        for task in tasks[:renamed]:
            if ended:
                crash_point(f"after-saving-{task.state}")
                box.state_logged(task)
            else:
                box.loop.emit("task", task.to_api())
        for task in tasks[renamed:]:
            assert error is not None
            if not ended:
                box.fail_task(task, cannot_save(error))
                continue
            done = task.state == "done"
            box.not_saved(task, error)
            if done:
                box.views.layers_changed(task.workspace, undone=task.id)

    def user_for(self, task: Task) -> int:
        """A starting task's uid: planned in the edit users_making holds (written at its
        end), or made at once in an edit of its own (none held: its lock could not be had)."""
        box = self.box
        if self.editing is not None:
            uid = self.editing.uid(task.user)
        else:
            uid = user_add(task.user, box.state["nextUid"], f"gurt task in {box.home}")
        box.state["nextUid"], box.state_unsaved = uid + 1, True
        return uid

    @contextlib.contextmanager
    def users_making(self, gone: list[str], tasks: list[Task]) -> Iterator[None]:
        """One schedule's starts of tasks (inside, each asking user_for): the users of those
        that started made and the users gone removed in one edit of the account files at the
        end, after the workers were spawned, so that a worker builds its box while its user
        is written; then they begin (Box.tasks_begin: running; past their gates once that
        is saved, Box.gates_open: a task's code never runs before its user exists or while
        its file says queued).  The account lock is held from the first uid to the edit:
        two gurtd instances never share a uid.  uids go round the range, so that one is not
        reused soon after its task ended; the next one is saved with the tasks' running
        state, after the edit: a crash between the two finds them queued and their users
        leftovers, ended and removed.  If the lock cannot be had, each task makes its own
        user; if the edit fails, the tasks that started fail, and the users gone stay until
        the next start."""
        box, edit = self.box, None
        try:
            if tasks:                 # else no lock, no reads: a schedule that starts nothing
                edit = AccountEdit(box.state["nextUid"], f"gurt task in {box.home}").__enter__()
        except (SysError, OSError) as exc:
            log(3, f"the account files cannot be locked: {exc}; each task makes its own user")
        self.editing = edit
        try:
            yield
        finally:
            self.editing = None
            if edit is not None:
                self.users_write(edit, gone)
            else:
                self.users_remove(gone)
            box.tasks_begin(tasks)

    def users_write(self, edit: AccountEdit, gone: list[str]) -> None:
        """users_making's end: the edit written and its lock let go; if it fails, the tasks
        whose users it planned fail (their workers, at their gates, never ran)."""
        try:
            try:
                if edit.planned:
                    stop_point("users-write")   # a test's pause: the workers at their gates
                edit.write(gone)
            finally:
                edit.__exit__()
        except (SysError, OSError) as exc:
            log(3, f"users {' '.join(gone + list(edit.planned))}: {exc}")
            for name in edit.planned:
                task = self.box.tasks.get(name.removeprefix(TASK_USER_PREFIX))
                if task is not None and task.state in ACTIVE_STATES:
                    self.box.fail_task(task, f"could not start: its user: {exc}")
            if edit.planned and gone:            # a failed write of new users must not keep
                self.users_remove(gone)          # the gone
            return
        if edit.planned:
            crash_point("after-making-users")

    def users_remove(self, gone: list[str]) -> None:
        """The users gone removed in one edit of the account files (its syncs cost the same
        however many); if it fails, they stay until the next start."""
        if gone:
            try:
                user_del(*gone)
            except (SysError, OSError) as exc:
                log(3, f"users {' '.join(gone)}: {exc}; they stay until the next start")


class Box:
    """The box: its tasks, workspaces and settings, and every change to them.

    Its parts: loop (Loop: call from other threads, what the loop published), views (Views:
    the layer stack and views), droid (DroidWorker), network, broker, review, disk, cgroups,
    schedules, jira, hooks.  workspace_snapshot reads what the loop published (any thread);
    everything else runs on the loop thread.
    """

    def __init__(self, home: str, listen: str, dns_upstream: str | None = None) -> None:
        self.home = os.path.abspath(home)
        self.listen = listen
        self.loop = Loop(self)
        self.network = Network(self, dns_upstream)
        self.gateway = Gateway(self)
        self.broker = Broker(self)
        self.cgroups = Cgroups(self.home)
        self.disk = DiskReserve(self)
        self.review = Review(self)
        self.droid = DroidWorker(self)
        self.steps = StepGroup(self)
        self.tasks: dict[str, Task] = {}
        self.active: dict[str, Task] = {}   # tasks in ACTIVE_STATES: what schedule scans
        self.workers: dict[str, Worker] = {}
        self.settings: dict[str, Any] = dict(DEFAULT_SETTINGS)
        self.state: dict[str, int] = {"nextUid": UID_FIRST}
        self.state_unsaved = False          # state.json goes with the next synced task save
        self.token = ""
        self.store_uid = self.store_gid = 0
        self.spawner = Spawner()
        self.log_followers = LogFollowers()
        self.followers = Counter(MAX_LOG_FOLLOWERS)       # log followers per task
        self.seq = 0
        self.done_seq = 0
        self.unsaved: set[str] = set()      # tasks whose (terminal) state is not on disk yet
        self.unsaved_why: dict[str, str] = {}   # save_unsaved's error a task, logged once a change
        self.view_waits = False             # a queued task waits for merges (merge_built)
        self.schedules = Schedules(self)
        self.jira = Jira(self)
        self.hooks = Hooks(self)
        self.views = Views(self)
        self.finish_merge = FinishMerge(self)
        self.stacks = StackStore(self.home)
        self.stack_refs: dict[str, tuple[list[str], str]] = {}   # task -> (its layers, ref)

    # paths
    def path(self, *parts: str) -> str:
        return os.path.join(self.home, *parts)

    def task_file(self, task_id: str) -> str:
        return self.path("tasks", task_id + ".json")

    def log_file(self, task_id: str) -> str:
        return self.path("logs", task_id + ".jsonl")

    def layer_dir(self, task_id: str) -> str:
        return self.path("layers", task_id)

    # what the parts read of the box (loop thread; settings are replaced whole: any thread)
    def task(self, task_id: str | None) -> Task | None:
        return self.tasks.get(task_id) if isinstance(task_id, str) else None

    def all_tasks(self) -> Iterator[Task]:
        return iter(self.tasks.values())

    def worker(self, task_id: str) -> Worker | None:
        return self.workers.get(task_id)

    def all_workers(self) -> Iterator[Worker]:
        return iter(self.workers.values())

    def setting(self, key: str | None = None) -> Any:
        """One setting, or all of them (a dict the box replaces whole, never edits)."""
        return self.settings if key is None else self.settings.get(key)

    def track(self, task: Task) -> None:
        """Keep self.active in step with task.state (load, add_task, set_state)."""
        if task.state in ACTIVE_STATES:
            self.active[task.id] = task
        else:
            self.active.pop(task.id, None)

    def has_unsaved(self) -> bool:
        return bool(self.unsaved)

    def store_owner(self) -> tuple[int, int]:
        """The uid and gid that own layers and workspaces (gurt-store)."""
        return self.store_uid, self.store_gid

    # calls from HTTP threads
    # state on disk
    def load(self) -> None:
        """Create BOX_HOME's layout if missing, then read settings, counters, token and tasks."""
        folder_ensure(self.home, 0o711)
        for sub in ("tasks", "logs", "layers"):
            os.makedirs(self.path(sub), mode=0o700, exist_ok=True)
        folder_ensure(self.path("workspaces"), 0o711)
        self.remove_temp_leftovers()
        self.store_uid, self.store_gid = system_user_ensure(STORE_USER)
        if not os.path.isdir(self.path("workspaces", "home")):
            self.views.workspace_create_dir("home")
        settings = load_json(self.path("settings.json"))
        if isinstance(settings, dict):
            try:
                self.settings = validate_settings(
                    {k: v for k, v in settings.items() if k in DEFAULT_SETTINGS},
                    DEFAULT_SETTINGS)
            except ApiError as exc:
                log(3, f"settings.json ignored: {exc.message}")
        state = load_json(self.path("state.json"))
        if isinstance(state, dict) and isinstance(state.get("nextUid"), int):
            self.state["nextUid"] = state["nextUid"]
        self.token = os.environ.get("GURT_TOKEN", "")
        if not self.token:
            try:
                with open(self.path("token")) as f:
                    self.token = f.read().strip()
            except FileNotFoundError:
                pass
            if not self.token:
                self.token = secrets.token_urlsafe(32)
                try:
                    atomic_write(self.path("token"), self.token.encode() + b"\n", mode=0o600)
                except OSError as exc:   # the API still answers: GURT_TOKEN can be set
                    log(3, f"could not save the new token in {self.path('token')}: {exc}")
        for name in sorted(os.listdir(self.path("tasks"))):
            if not name.endswith(".json"):
                continue
            loaded = load_json(self.path("tasks", name), self._task_parse)
            if loaded is None:
                continue
            task, data = loaded
            self.tasks[task.id] = task
            self.track(task)
            if isinstance(data.get("layersRef"), str):
                self.stack_refs[task.id] = (task.layers, data["layersRef"])
            self.loop.render(task)
            self.seq = max(self.seq, task.seq)
            self.done_seq = max(self.done_seq, task.doneSeq)
        self.views.load()
        self.broker.load()
        self.schedules.load()
        self.jira.load()
        self.hooks.load()

    def _task_parse(self, data: Any) -> tuple[Task, dict[str, Any]]:
        """A task file's task (TypeError or ValueError if it is damaged) and its JSON; a stack
        it names that is lost is logged, the task kept."""
        if isinstance(data, dict) and isinstance(data.get("layersRef"), str):
            try:
                data["layers"] = self.stacks.stack(data["layersRef"])
            except (TypeError, ValueError) as exc:
                log(3, f"task file of {data.get('id')}: its layers are lost: {exc}")
        return Task.from_dict(data), data

    def stored(self, task: Task) -> dict[str, Any]:
        """A task as its file holds it: a long `layers` by reference to a shared stack file
        (StackStore), written before the task file that names it."""
        data = {f.name: getattr(task, f.name) for f in dataclasses.fields(Task)}
        if len(task.layers) > STACK_INLINE:
            cached = self.stack_refs.get(task.id)
            if cached is None or cached[0] is not task.layers:
                cached = (task.layers, self.stacks.ref(task.workspace, task.layers))
                self.stack_refs[task.id] = cached
            data["layers"], data["layersRef"] = [], cached[1]
        return data

    def save(self, task: Task, sync: bool = True) -> None:
        """Persist and re-render a task after a change; every change moves updatedAt."""
        self.save_all([task], sync)

    def save_all(self, tasks: list[Task], sync: bool = True) -> None:
        """save of several tasks as one group commit (the syncs of one); a synced save takes
        state.json along when it changed."""
        writes = []
        for task in tasks:
            task.updatedAt = now_iso()
            writes.append(json_write(self.task_file(task.id), self.stored(task)))
        with_state = sync and self.state_unsaved
        if with_state:
            writes.append(json_write(self.path("state.json"), self.state))
        atomic_write_all(writes, sync=sync)
        self.steps.saved(tasks)
        self.state_unsaved = self.state_unsaved and not with_state
        self.saved_rendered(tasks, sync)

    def saved_rendered(self, tasks: list[Task], sync: bool = True) -> None:
        """Tasks whose files hold their state now: published; off the retry list if synced
        (unsynced, a state is not yet one a crash keeps)."""
        for task in tasks:
            self.loop.render(task)
            if sync:
                self.unsaved.discard(task.id)

    def append_log(self, task_id: str, entry: dict[str, Any], at: float | None = None
                   ) -> None:
        """A line of the task's log, timed now (or at: seconds since the epoch, never before
        the running task's line before it: a log is in time order)."""
        worker = self.workers.get(task_id)
        if worker is not None:
            at = worker.logged_at = max(worker.logged_at, time.time() if at is None else at)
        entry = {"time": now_iso(at), **entry}
        line = json_text(entry) + b"\n"      # a name that is not UTF-8 as \xNN
        if worker is not None and not worker.log_cap.admit(entry.get("type"), len(line)):
            return                              # past logBytes: counted, not stored
        if worker is not None and worker.log_fd >= 0:
            append_line(worker.log_fd, line)
        else:
            fd = os.open(self.log_file(task_id), os.O_RDWR | os.O_APPEND | os.O_CREAT |
                         os.O_CLOEXEC, 0o600)
            try:
                append_line(fd, line)
            finally:
                os.close(fd)
        self.log_followers.notify(task_id)

    def set_state(self, task: Task, state: str, **fields: Any) -> None:
        """Change state.  Never raises for the disk: a task whose state cannot be saved fails.

        A terminal state (done, failed, undone) is saved and synced FIRST; only once it is
        durable is it logged and announced, so that a crash can never revise a state someone
        saw.  If it cannot be saved the task is failed in memory with the reason, and the save
        is tried again later (save_unsaved).  Other states log first, so a follower never
        misses the last line (a start's running is saved with the others of its schedule,
        in one group commit: steps.starting; the ends of one loop step likewise: steps.grouped)."""
        task.state = state
        for key, value in fields.items():
            setattr(task, key, value)
        self.track(task)
        if state in TERMINAL_STATES:
            if self.steps.end_later(task):
                return
            try:
                self.save(task)
            except OSError as exc:
                self.not_saved(task, exc)
                return
            crash_point(f"after-saving-{state}")
        self.state_logged(task)

    def state_logged(self, task: Task) -> None:
        """set_state: the new state logged (a state other than a terminal one then saved)
        and announced."""
        state = task.state
        entry: dict[str, Any] = {"type": "state", "state": state}
        if task.error and state == "failed":
            entry["error"] = task.error
        try:
            self.append_log(task.id, entry)
            if state not in TERMINAL_STATES and self.steps.start_later(task):
                return
            if state not in TERMINAL_STATES:
                self.save(task)
        except OSError as exc:
            if state not in TERMINAL_STATES:
                self.fail_task(task, cannot_save(exc))
                return
            log(3, f"task {task.id} is {state} (saved) but its log line was lost: {exc}")
        self.loop.emit("task", task.to_api())
        if state in ("done", "failed"):            # gurtd's journal: once it is durable
            log(6, f"task {task.id} {state}" + (f": {task.error}" if task.error else ""))

    def not_saved(self, task: Task, exc: OSError) -> None:
        """A terminal state could not be saved: the task is failed in memory with the reason,
        announced as such, and saved again by save_unsaved once the disk allows."""
        error = cannot_save(exc)
        log(3, f"task {task.id}: {error} (it was to be {task.state}); "
               f"{'undone' if task.state == 'undone' else 'failed'} in memory")
        if task.state == "done":        # a failure or an undo keeps its own reason
            task.state, task.error = "failed", error
            if task.folders:             # a failed task's folder changes never apply
                task.review = None
                self.review.forget(task)
        task.updatedAt = now_iso()
        self.loop.render(task)
        self.unsaved.add(task.id)
        try:
            self.append_log(task.id, {"type": "state", "state": task.state,
                                      "error": task.error or error})
        except OSError:
            pass
        self.loop.emit("task", task.to_api())

    def revert_saved(self, task: Task) -> None:
        """save_unsaved: an undone state on disk now; its revert begins (Box.undo waited for
        this; at a stop the next start's resume begins it), then its layer may go."""
        try:
            self.finish_merge.resume_one(task)
        except Exception as exc:                      # its record says failed
            log(3, f"task {task.id}: its revert could not begin: {type(exc).__name__}: {exc}")
            task.undoMerge = undo_record(None, f"could not begin: {exc}", None)
            with contextlib.suppress(OSError):
                self.save(task)
        self.views.gc_soon()

    def save_again(self, task: Task) -> None:
        """A save of task failed: save_unsaved tries it again (its layer kept until then)."""
        self.unsaved.add(task.id)

    def save_unsaved(self) -> None:
        """Try again to save tasks whose terminal state is only in memory (tick, shutdown)."""
        self.unsaved_why = {k: v for k, v in self.unsaved_why.items() if k in self.unsaved}
        for task_id in sorted(self.unsaved):
            task = self.tasks.get(task_id)
            if task is None:
                self.unsaved.discard(task_id)
                continue
            try:
                self.save(task)
                log(6, f"task {task_id}: its state ({task.state}) is saved now")
                self.unsaved_why.pop(task_id, None)
            except OSError as exc:        # tried every 5 s: a line for a new error, not a try
                why = exc.strerror or str(exc)
                if why != self.unsaved_why.get(task_id):
                    log(4, f"task {task_id}: still cannot save its state: {exc}")
                self.unsaved_why[task_id] = why
                return
            if task.state == "undone" and not self.loop.stopping:
                self.revert_saved(task)

    def fail_task(self, task: Task, error: str, by: str = "gurtd") -> None:
        """Fail a task, whatever happens: its approvals denied (answeredBy `by`), its
        processes and user gone, state failed with error.  Each step in its own try; never
        raises (stop, shutdown and the loop guard use it)."""
        for what, step in (("deny its approvals",
                            lambda: self.broker.deny_pending(task.id, by, error)),
                           ("release its worker", lambda: self.release_worker(task))):
            try:
                step()
            except Exception as exc:
                log(3, f"task {task.id}: could not {what}: {type(exc).__name__}: {exc}")
        self.broker.drop_waiters(task.id, error)
        if task.state in ACTIVE_STATES:
            try:
                self.set_state(task, "failed", error=error)
            except Exception as exc:
                log(3, f"task {task.id}: failed in memory only: {type(exc).__name__}: {exc}")
                task.state, task.error = "failed", error
                self.loop.render(task)
                self.unsaved.add(task.id)
        if task.folders and task.state == "failed":   # its folder changes are never kept
            self.review.forget(task)
        for what, step in (("collect layers", self.views.gc_layers), ("schedule", self.schedule)):
            try:
                step()
            except Exception as exc:
                log(3, f"could not {what} after task {task.id} failed: {exc}")

    # task lifecycle (loop thread)
    def create_task(self, body: Any, origin: dict[str, Any] | None = None) -> dict[str, Any]:
        """A new task, started if there is room; origin: fields of gurtd's own a body cannot
        set (schedule)."""
        task = self.new_task(body, origin)
        self.schedule()
        return task.to_api()

    def create_task_later(self, body: Any) -> "Later":
        """POST /api/tasks: create_task, its start and its answer at the end of the step's
        commands (Loop.run_commands): the creates of a step start in one schedule (one edit
        of the account files, one group save), and each 201 still holds its started task."""
        task = self.new_task(body, sync=False)
        return Later(task.to_api, task)

    create_task_later.batched = True      # type: ignore[attr-defined]  # Loop.run_commands

    def new_task(self, body: Any, origin: dict[str, Any] | None = None, sync: bool = True
                 ) -> Task:
        """create_task's task, queued (sync: as add_task)."""
        fields = validate_task_body(body, self.settings)
        fields.update(origin or {})
        fields["limits"] = effective_limits(fields["limits"], self.settings, mem_total())
        if not self.views.workspace_exists(fields["workspace"]):
            raise ApiError(400, f"workspace {fields['workspace']} does not exist")
        if fields["worker"] == "droid" and not self.droid.path():
            raise ApiError(400, "the droid worker needs the Droid CLI: run make (it installs "
                                f"droid {DROID_VERSION}) or set droidPath")
        if fields.get("folders"):
            fields["folderInfo"] = folders_check(fields["folders"],
                                                 self.settings["folderRoots"], self.home)
            fields["folder"] = fields["folders"][0]
        return self.add_task(fields, sync=sync)

    def add_task(self, fields: dict[str, Any], staged: str | None = None, sync: bool = True
                 ) -> Task:
        """Every way of making a task ends here (the API, schedules, Jira, hooks, uploads): a
        fresh id, the next seq, the task saved whole or nothing of it anywhere (507 `cannot
        save the task`, or `the upload`, on a full disk), then the box's and announced.
        staged: an upload's layer folder; the task is done at once on top of its workspace's
        stack, the folder renamed into place before the task is saved (a crash between the
        two leaves an unused folder, never a task without its layer).  Not sync: its file
        written but not synced, for a POST whose answer comes after the step's starts, which
        sync it (Box.created_synced): its worker is spawned meanwhile."""
        task_id = new_task_id()
        while task_id in self.tasks or os.path.lexists(self.layer_dir(task_id)):
            task_id = new_task_id()
        done, moved, stamp = staged is not None, False, now_iso()
        task = Task(id=task_id, state="done" if done else "queued",
                    user=TASK_USER_PREFIX + task_id,
                    layers=self.views.stack_ids(fields["workspace"]) if done else [],
                    costCents=0, createdAt=stamp, updatedAt=stamp, seq=self.seq + 1,
                    doneSeq=self.done_seq + 1 if done else 0, **fields)
        with saved_or_507("upload" if done else "task"):
            try:
                if staged is not None:
                    os.rename(staged, self.layer_dir(task_id))
                    moved = True
                    crash_point("upload-renamed")    # a test's kill -9: no record names it
                self.save(task, sync=sync or done)
                if not done:
                    self.append_log(task_id, {"type": "state", "state": "queued"})
            except OSError as exc:
                if staged is not None and moved:
                    os.rename(self.layer_dir(task_id), staged)     # the caller removes it
                for path in (self.task_file(task_id), self.log_file(task_id)):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
                    except OSError as err:
                        log(3, f"could not remove {path} of a task that was not created: {err}")
                self.loop.forget(task_id)
                log(3, f"a task could not be created: {exc}")
                raise
        self.seq, self.done_seq = task.seq, max(self.done_seq, task.doneSeq)
        self.tasks[task_id] = task
        self.track(task)
        if done:
            with contextlib.suppress(OSError):   # the task is saved done; its log is a courtesy
                self.append_log(task_id, {"type": "upload", "text": task.summary or ""})
                self.append_log(task_id, {"type": "state", "state": "done"})
            self.views.layers_changed(task.workspace, task_id)
        self.loop.emit("task", task.to_api())
        return task

    def created_synced(self, tasks: list[Task]) -> None:
        """A step's creates, saved unsynced (add_task), durable before they are answered:
        those still queued saved in one synced group commit (a start's running save or a
        failure's synced the others); if that cannot be made, they fail."""
        queued = [task for task in tasks if task.state == "queued"]
        if not queued:
            return
        try:
            self.save_all(queued)
        except OSError as exc:
            for task in queued:
                self.fail_task(task, cannot_save(exc))

    def schedule(self, gone: list[str] | None = None) -> None:
        """Start queued tasks, first in first out, while there is room; their users made in
        one edit of the account files, which removes the users gone too (steps.grouped).  Called
        inside steps.grouped, or inside itself (a start that failed), it only marks that it runs
        again at the end: an inner run would start the outer's tasks twice and drop its saves.
        A task whose view cannot be had yet stays queued, no user made for it."""
        if self.steps.schedule_later():
            return
        self.view_waits = False
        starting: list[tuple[Task, list[str], list[Any]]] = []
        try:
            self.startable(starting)
        except BaseException:     # whatever that raised, the users gone still go
            self.steps.users_remove(gone or [])
            raise
        tasks = [task for task, _, _ in starting]
        try:
            with self.steps.starting(), self.steps.users_making(gone or [], tasks):
                for task, layers, lowers in starting:
                    self.start_task(task, layers, lowers)
        finally:
            self.gates_open(tasks)
        if self.steps.schedule_due:
            self.schedule()

    def startable(self, starting: list[tuple[Task, list[str], list[Any]]]) -> None:
        """schedule: the queued tasks that start now, first in first out, while there is
        room, each with its layers and view (into starting)."""
        if not self.loop.stopping:
            for t in [t for t in self.active.values() if t.state not in ACTIVE_STATES]:
                self.track(t)             # failed in memory only (fail_task): no longer active
            active = sum(1 for t in self.active.values() if t.state in ("running", "waiting")
                         and t.id not in self.finish_merge.held)   # held: no processes left
            queued = sorted((t for t in self.active.values() if t.state == "queued"),
                            key=lambda t: t.seq)
            for task in queued[:max(0, self.settings["maxRunningTasks"] - active)]:
                layers = self.views.stack_ids(task.workspace)
                try:          # stays queued: a merge that ends schedules again
                    starting.append((task, layers,
                                     self.views.view_lowers(task.workspace, layers)))
                except ApiError as exc:
                    log(4, f"task {task.id} waits: {exc.message}")
                    self.view_waits = True

    def start_task(self, task: Task, layers: list[str], lowers: list[Any]) -> None:
        """A queued task started on the view schedule planned (lowers of the layers)."""
        if task.state != "queued":           # failed meanwhile (a stop, a full disk)
            return
        task.layers = layers
        out_r = out_w = log_fd = gate_r = gate_w = -1
        try:
            if not task.uid:
                task.uid = self.steps.user_for(task)
            uid = task.uid
            layer = self.layer_dir(task.id)
            tree_remove(layer)                        # a start cut short by a crash
            for sub in ("", "upper", "work"):
                os.makedirs(os.path.join(layer, sub), 0o755, exist_ok=True)
                os.chown(os.path.join(layer, sub), self.store_uid, self.store_gid)
            spec: dict[str, Any] = {
                "id": task.id, "uid": uid, "gid": uid, "home": f"/home/{task.user}",
                "storeUid": self.store_uid, "storeGid": self.store_gid, "boxHome": self.home,
                "lowers": lowers,
                "upper": f"layers/{task.id}/upper", "work": f"layers/{task.id}/work",
                "mode": task.worker, "prompt": task.prompt,
                "broker": self.broker.box_socket, "module": os.path.abspath(__file__),
                "env": {"HOME": f"/home/{task.user}", "USER": task.user, "LOGNAME": task.user,
                        "PATH": "/run/gurt/bin:" + TASK_PATH, "SHELL": "/bin/sh",
                        "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PWD": VIEW_DIR,
                        "GURT_TASK": task.id, "GURT_BROKER": BROKER_IN_BOX},
            }
            if task.folderInfo:
                self.review.prepare(task, spec)
            self.disk.limit_layer(task, [os.path.join(layer, sub) for sub in ("", "upper", "work")]
                                  + [top for top, _, _ in os.walk(self.review.dir(task.id))])
            limits = task.limits or effective_limits({}, self.settings, mem_total())
            spec["cgroups"] = self.cgroups.create(task.id, limits)
            spec["nproc"], spec["tmpBytes"] = limits["processes"], limits["tmpBytes"]
            hosts = list(task.hosts)
            if task.worker == "droid":
                hosts += [h for h in self.settings["droidHosts"] if h not in hosts]
                self.droid.spec(task, spec, hosts)
            net = bool(hosts or task.askHosts or self.broker.policies.has_hosts(task) or
                       spec.get("gateway"))
            spec["gateFd"], spec["netnsAtGate"] = 2, net   # after the spec's memfd and out_w
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            gate_r, gate_w = gate_pair()
            log_fd = os.open(self.log_file(task.id), os.O_RDWR | os.O_APPEND | os.O_CREAT |
                             os.O_CLOEXEC, 0o600)    # before the spawn: no worker unrecorded
            pid = self.spawner.spawn(spec, [out_w, gate_r], self.cgroups.v2_group(task.id))
            self.views.pin(task.id, lowers)
            gate_fds = []
            if net:           # made while the worker builds its box: it enters at its gate
                gate_fds.append(self.network.prepare(task, hosts).nsfd)
                self.gateway.open(task.id, gate_fds[-1])
        except Exception as exc:     # pyroute2's NetlinkError too: no worker left at its gate
            for fd in (out_r, out_w, log_fd, gate_r, gate_w):
                if fd >= 0:
                    os.close(fd)
            log(3, f"task {task.id} could not start: {exc}")
            self.cleanup_user(task)
            self.network.release(task.id)
            self.disk.unlimit(task)
            self.set_state(task, "failed", error=f"could not start: {exc}")
            return
        os.close(out_w)
        os.close(gate_r)
        os.set_blocking(out_r, False)
        worker = Worker(task.id, pid, out_r, log_fd=log_fd, gate=gate_w, gate_fds=gate_fds,
                        budget_limit=task.budgetCents,
                        log_cap=LogCap(limits["logBytes"], os.fstat(log_fd).st_size),
                        stream_usage=bool(spec.get("streamUsage")))
        self.workers[task.id] = worker
        self.loop.watch(out_r, task.id)

    def tasks_begin(self, tasks: list[Task]) -> None:
        """A schedule's spawned tasks begin once their users exist: running (logged; saved
        with the others of the schedule: steps.starting, then gates_open)."""
        for task in tasks:
            worker = self.workers.get(task.id)
            if worker is None or task.state != "queued":
                continue
            self.set_state(task, "running")
            log(6, f"task {task.id} running as {task.user} ({task.uid}), pid {worker.pid}, "
                   f"{len(task.layers)} layers")

    def gates_open(self, tasks: list[Task]) -> None:
        """A schedule's running tasks, their state saved, go on past their gates: a crash
        before finds them queued, none of their code run.  A task failed meanwhile (its user
        or its state not saved, a stop) has its gate closed with it: its worker ends without
        running anything."""
        for task in tasks:
            worker = self.workers.get(task.id)
            if worker is not None and task.state == "running" and worker.gate >= 0:
                with contextlib.suppress(OSError):      # a worker gone already: its end comes
                    gate_open(worker.gate, worker.gate_fds)
                os.close(worker.gate)
                worker.gate, worker.gate_fds = -1, []

    def on_worker_output(self, task_id: str) -> None:
        worker = self.workers.get(task_id)
        if worker is None:
            return
        try:
            data = os.read(worker.fd, 65536)
        except BlockingIOError:
            return
        if not data:
            worker.eof = True
            self.loop.unwatch(worker.fd)
            if worker.buf:
                self.on_worker_line(worker, worker.buf)
                worker.buf = b""
            self.maybe_finish(worker)
            return
        *lines, worker.buf = (worker.buf + data).split(b"\n")
        if len(worker.buf) > MAX_WORKER_LINE:     # no newline in sight: a line of its own
            lines.append(worker.buf)
            worker.buf = b""
        for line in lines:
            self.on_worker_line(worker, line)

    def on_worker_line(self, worker: Worker, line: bytes) -> None:
        """One line of the worker's report pipe; the task can write anything there, so a line
        that is not a report is logged as stdout (cut to MAX_WORKER_LINE), never raised."""
        task = self.tasks[worker.task_id]
        try:
            msg = loads_bounded(line, 2)
            kind, text = msg["t"], msg.get("text", "")
            if not isinstance(kind, str) or not isinstance(text, str):
                raise TypeError("not a report")
        except (ValueError, KeyError, TypeError, AttributeError):
            self.append_log(task.id, {"type": "stdout", "text": line[:MAX_WORKER_LINE]
                                      .decode(errors="replace")})
            return
        if kind == "step":
            worker.last_err = ""
            task.step = text
            self.steps.save_later(task)
            self.append_log(task.id, {"type": "step", "text": text}, at=worker.began(msg))
        elif kind == "out" and task.worker == "droid":
            self.droid.on_event(task, worker, text)
        elif kind == "out":
            fault_point(text)
            worker.last_out = text
            self.append_log(task.id, {"type": "stdout", "text": text})
        elif kind == "err":
            if text.strip():
                worker.last_err = text
            self.append_log(task.id, {"type": "stderr", "text": text})
        elif kind == "error":
            worker.error = text
            self.append_log(task.id, {"type": "error", "text": text})
        elif kind == "exit":
            self.append_log(task.id, {"type": "exit", "code": msg.get("code")})

    def on_exits(self) -> None:
        """Workers that exited: each task ends (grouped with the other ends of the step)."""
        by_pid = {w.pid: w for w in self.workers.values()}
        with self.steps.grouped():
            for pid, code in self.spawner.exits():
                worker = by_pid.get(pid)
                if worker is not None:
                    worker.exit_code = code
                    self.loop.guard(worker.task_id, self.maybe_finish, worker)

    def maybe_finish(self, worker: Worker) -> None:
        """A worker ended once its process exited and its report pipe is drained."""
        if worker.exit_code is None:
            return
        if not worker.eof:
            self.on_worker_output(worker.task_id)  # the writer is gone: read to the end
            return
        task = self.tasks[worker.task_id]
        oom = self.cgroups.oom_kills(task.id) > 0     # read before its groups go
        self.release_worker(task)
        code = worker.exit_code
        if code < 0:
            code = 128 - code                    # killed by signal N: 128+N, as a shell says
        if worker.error:
            self.set_state(task, "failed", error=worker.error)
        elif oom:
            self.set_state(task, "failed", error="out of memory")
        elif code == 0 and self.finish_merge.holds(task, worker):
            self.schedule()                # its place is free: its processes are gone
            return                         # checked off the loop first (Finish-time merge)
        elif code == 0:
            self.done_seq += 1
            summary = (task.summary if task.worker == "droid" else worker.last_out) or None
            self.set_state(task, "done", doneSeq=self.done_seq, summary=summary,
                           review="pending" if task.folders else None)
            self.views.layers_changed(task.workspace, task.id)
        else:
            error = f"worker exited with {code}"
            last = worker.droid_error or worker.last_err
            if last:
                error += f": {last}"
            self.set_state(task, "failed", error=error)
        if task.folders and task.state != "done":
            self.review.forget(task)            # a failed task's folder changes never apply
        self.views.gc_soon()
        self.schedule()

    def release_worker(self, task: Task) -> None:
        """End every process of the task, remove its groups, user and network, clear
        set-id bits of its layer.  Idempotent."""
        worker = self.workers.pop(task.id, None)
        if worker is not None:
            if not worker.eof:
                self.loop.unwatch(worker.fd)
            os.close(worker.fd)
            for fd in (worker.log_fd, worker.gate):
                if fd >= 0:
                    os.close(fd)
        self.cleanup_user(task)
        self.network.release(task.id)
        self.disk.unlimit(task)
        setid_strip(os.path.join(self.layer_dir(task.id), "upper"))   # its processes are gone
        note = worker.log_cap.note() if worker is not None else None
        if note:                                 # the last line before its end state
            self.append_log(task.id, note)

    def cleanup_user(self, task: Task) -> None:
        """End the task's processes (its cgroup: every thread, wherever it went; its uid only
        without one: no process of a task is outside its group, it is born or put there as
        root, and cannot leave), remove its groups, then its user (kept while one lives)."""
        try:
            if not self.cgroups.kill(task.id) and task.uid:
                kill_uid(task.uid)
            self.cgroups.remove(task.id)
        except SysError as exc:
            log(3, f"task {task.id}: {exc}; its user and groups stay until the next start")
            return
        if task.uid:
            keys_clear(task.uid)
            self.steps.user_gone(task.user)
            task.uid = 0

    def hold(self, task: Task, worker: Worker, why: str) -> None:
        """Pause every process of the task (its cgroup frozen, else SIGSTOP) for a reason."""
        if not worker.holds and not self.cgroups.freeze(task.id):
            signal_uid(task.uid, signal.SIGSTOP)
        worker.holds.add(why)

    def unhold(self, task: Task, worker: Worker, why: str) -> None:
        """Drop one reason; the task goes on once no reason is left."""
        worker.holds.discard(why)
        if not worker.holds and not self.cgroups.thaw(task.id):
            signal_uid(task.uid, signal.SIGCONT)

    def stop(self, task_id: str, reason: str = "stopped") -> dict[str, Any]:
        task = self.get(task_id)
        if task.state not in ACTIVE_STATES:
            raise ApiError(409, f"the task is {task.state}; only a queued, running or waiting "
                                "task can be stopped", "conflict")
        self.fail_task(task, reason, by="stop")
        return task.to_api()

    def undo(self, task_id: str) -> tuple[dict[str, Any], "Future[dict[str, Any]] | None"]:
        """The seed page's undo: stop, deny approvals, leave the view, delete when unused.
        A personal task's keep was undone first, off the loop (Review.undo_request; 409 if
        the owner changed a kept path since, unless force); its folder changes are dropped.
        The task, and what its answer waits for (undo_answer)."""
        task = self.get(task_id)
        if task.folders and task.review in ("kept", "pending", "conflict"):
            self.review.drop(task)
            if task.state == "undone":
                self.save(task)
        if task.state == "undone":
            if task.folders:
                self.review.forget(task)
            return task.to_api(), self.finish_merge.named(task)
        was_active = task.state in ACTIVE_STATES
        self.broker.deny_pending(task.id, "undo", "answered by undo")
        if was_active or task.uid:      # a finished task was released (and its layer's
            self.release_worker(task)   # set-id bits cleared) when it ended: no walk again
        from_done = task.state == "done"
        try:
            self.undo_begun(task, from_done)
        finally:                           # saved even if the beginning raised (a 500 then)
            self.set_state(task, "undone")
            if task.id in self.unsaved:        # its revert waits for the state on disk
                self.finish_merge.withdraw(task)   # (save_unsaved begins it again)
        if task.folders:
            self.review.forget(task)
        named = self.finish_merge.named(task)
        if named is None:                  # else when its revert ends, not beside it
            self.views.gc_soon()
        if was_active:
            self.schedule()
        return task.to_api(), named

    def undo_begun(self, task: Task, from_done: bool) -> None:
        """undo, before its state is saved: undone in memory, out of the stack, and its
        change out of later copies begun (off the loop: the merge thread decides the paths,
        while the loop syncs the state; it joins only in a later step, once the state is on
        disk, and is withdrawn if it could not be saved: undo saves the state even if this
        raises).  Only a task undone from done has a change in later copies: one whose done
        state a full disk refused (failed, its doneSeq kept) was out of the stack before any
        later task began, so its record says nothing reverted, now and after any restart."""
        if not from_done and task.doneSeq > 0:      # set first: saved whatever follows raises
            task.undoMerge = undo_record(UndoResult(), None, None)
        task.state = "undone"
        self.track(task)
        self.views.layers_changed(task.workspace, undone=task.id)
        if from_done:
            self.finish_merge.undone(task)

    def get(self, task_id: str) -> Task:
        task = self.task(task_id)
        if task is None:
            raise ApiError(400, "No task with this id")
        return task

    # snapshots (any thread: they read what render published, never the loop's objects)
    def workspace_snapshot(self, name: str, full: bool = False) -> dict[str, Any]:
        """A workspace and its done tasks, newest first, from the snapshots (any thread)."""
        if not self.views.workspace_exists(name):
            raise ApiError(404, f"no workspace named {name}", "not_found")
        stack = sorted(((e[2], e[3]) for e in self.loop.listed_in(name) if e[1] == "done"),
                       reverse=True)
        info: dict[str, Any] = {"name": name, "layers": len(stack)}
        if full:
            info.update(self.views.layer_usage(name))
            info["stack"] = [json.loads(data) for _, data in stack]
        return info

    def pause_and_ask(self, task: Task, worker: Worker, why: str, failed: str,
                      *approval: Any) -> str | None:
        """Pause every process of the task and make an approval (Broker.create's arguments);
        its id.  An approval that cannot be saved (a full disk) would leave the task paused
        with no one to ask: the task fails instead, with error `<failed>: <why not>`."""
        self.hold(task, worker, why)
        try:
            return self.broker.create(task, *approval)["wait"]
        except (ApiError, OSError) as exc:
            message = exc.message if isinstance(exc, ApiError) else str(exc)
            log(3, f"task {task.id}: could not ask for a {why} approval: {message}")
            self.fail_task(task, f"{failed}: {message}")   # it collects and schedules too
            return None

    def tick(self) -> float:
        """Timers of the loop: a worker past taskTimeoutSeconds is stopped; BOX_HOME's free
        space is checked.  Seconds until the next timer."""
        limit = self.settings["taskTimeoutSeconds"]
        now = time.monotonic()
        for task_id, worker in list(self.workers.items()):
            task = self.tasks[task_id]
            if now - worker.started > limit and task.state in ("running", "waiting"):
                log(4, f"task {task_id} timed out after {limit} s")
                self.stop(task_id, TIMED_OUT)
        return min(self.disk.tick(), self.views.tick(), self.finish_merge.tick())

    def put_settings(self, body: Any) -> dict[str, Any]:
        new = validate_settings(body, self.settings)
        if isinstance(body, dict) and "droidModel" in body:
            path = self.droid.path() if "droidPath" not in body else \
                (body["droidPath"] or self.droid.path())
            if not path:
                raise ApiError(400, "cannot check droidModel: the Droid CLI is not installed")
            models = droid_models(path)
            if models and body["droidModel"] not in models:
                raise ApiError(400, f"droidModel {body['droidModel']} is not one the Droid CLI "
                                    f"knows; it knows: {', '.join(models)}")
        token = new["jira"].get("token") if new["jira"] is not self.settings["jira"] else None
        new["jira"] = {k: v for k, v in new["jira"].items() if k != "token"}
        # saved first: settings that are not on disk are not in force either
        with saved_or_507("settings"):
            if token is not None:
                self.jira.save_token(token)       # BOX_HOME/secrets/jira-token, never answered
            write_json(self.path("settings.json"), new)
        self.settings = new
        for approval in self.broker.approvals.values():   # canAlwaysApprove may change
            if approval.state == "pending":
                self.broker.render(approval)
        self.jira.wake.set()
        self.schedule()
        return dict(self.settings)

    def create_workspace(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or set(body) != {"name"}:
            raise ApiError(400, 'the body must be {"name": "..."}')
        name = body["name"]
        if not valid_workspace_name(name):
            raise ApiError(400, "name must match ^[\\w.-]+$ (at most 64) and not be . or ..")
        if os.path.exists(self.path("workspaces", name)):
            raise ApiError(409, f"workspace {name} exists", "conflict")
        self.views.workspace_create_dir(name)
        return {"name": name, "layers": len(self.views.stack_ids(name))}

    # start and stop
    def remove_temp_leftovers(self) -> None:
        """At start (under the BOX_HOME lock): temp files of writes a crash cut short."""
        dirs = [self.home] + [self.path(d) for d in ("tasks", "approvals", "logs", "stacks",
                                                     MERGED_DIR)]
        for path in remove_temp_leftovers(dirs) + account_temp_leftovers():
            log(4, f"removed the leftover temp file {path}")
        diff_temp_leftovers()
        for name in upload_leftovers_remove(self.path("layers")):
            log(4, f"removed layers/{name}, an upload that a crash cut short")
        with contextlib.suppress(FileNotFoundError):    # FinishMerge.submit's, cut short
            for name in os.listdir(self.path("run")):
                if name.startswith("merge-"):
                    tree_remove(self.path("run", name))
                    log(4, f"removed run/{name}, a finish-time merge's folder")

    def reconcile(self) -> None:
        """Before answering: fail orphaned tasks, end their processes, remove leftovers.
        Each step in its own try: a start on a full disk cleans what it can and says what
        it could not.  Only what is provably this box's is ended: its task groups (of any
        earlier task, its user deleted or not) and the uids of its users."""
        problems: list[str] = []

        def attempt(what: str, fn: Callable[..., Any], *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                problems.append(f"{what}: {type(exc).__name__}: {exc}")

        attempt("find the task groups", self.cgroups.start)
        for name in self.cgroups.leftovers():
            log(4, f"reconcile: ending leftover task group {name} and its processes")
            attempt(f"end the task group {name}", self.cgroups.kill, name)
            attempt(f"remove the task group {name}", self.cgroups.remove, name)
        attempt("recover payments from the ledger", self.broker.recover_ledger)
        mine = {t.user for t in self.tasks.values()}
        marker = f"gurt task in {self.home}"
        leftovers, taken = {}, set()
        crashed: list[str] = []
        with open("/etc/passwd") as f:
            for line in f:
                parts = line.rstrip("\n").split(":")
                if len(parts) > 2 and is_digits(parts[2]):
                    taken.add(int(parts[2]))
                if len(parts) > 4 and parts[0].startswith(TASK_USER_PREFIX) and \
                        (parts[0] in mine or parts[4] == marker) and is_digits(parts[2]):
                    leftovers[parts[0]] = int(parts[2])
        for task in sorted(self.tasks.values(), key=lambda t: t.seq):
            if task.uid and task.uid not in taken:   # never a uid someone else has now
                leftovers.setdefault(task.user, task.uid)
            if task.state in ("running", "waiting"):
                task.uid = 0
                attempt(f"fail task {task.id}", lambda t=task: self.set_state(
                    t, "failed", error="gurtd restarted while the task was running"))
                crashed.append(task.id)
        for approval in list(self.broker.approvals.values()):
            if approval.state == "pending":
                attempt(f"deny approval {approval.id}", self.broker.answer, approval.id,
                        "denied", "gurtd restarted", None, "restart")
        for name, uid in leftovers.items():
            log(4, f"reconcile: removing leftover user {name} ({uid}) and its processes")
            attempt(f"end the processes of {name}", kill_uid, uid)
            attempt(f"clear the keys of {name}", keys_clear, uid)
            attempt(f"remove the user {name}", user_del, name)
        for task_id in crashed:                  # their processes are gone now
            attempt(f"strip set-id bits of {task_id}", setid_strip,
                    os.path.join(self.layer_dir(task_id), "upper"))
        for point in overlays_below(self.home):
            log(4, f"reconcile: unmounting the leftover overlay {point}")
            attempt(f"unmount {point}", umount, point)
        attempt("collect what no record names", self.orphans_collect)
        attempt("collect stack files no task names", self.stacks_collect)
        attempt("take up exact undos cut short", self.finish_merge.resume)
        attempt("delete undone layers", self.views.gc_layers)
        attempt("finish keeps and undos cut short", self.review.recover)
        for task_id in sorted(self.unsaved):
            problems.append(f"save task {task_id}: its state ({self.tasks[task_id].state}) is "
                            "only in memory until the disk has room")
        for problem in problems:
            log(3, f"reconcile: could not {problem}")

    def orphans_collect(self) -> None:
        """reconcile: what a crash left made under BOX_HOME before the record that names it
        was saved (a layer an upload or an undo's revert renamed into place, a review folder)
        goes to the trash the layer collection uses; never what a task file names, even a
        damaged one set aside (tasks/<id>.json.damaged-...).  Temp names, uploads' staging,
        merged layers and the finish-time merge's folders are thrown away at load; stack
        files no task names, by stacks_collect."""
        recorded = {name.partition(".json")[0] for name in os.listdir(self.path("tasks"))}
        for where in ("layers", "review"):
            with contextlib.suppress(FileNotFoundError):
                for name in sorted(os.listdir(self.path(where))):
                    if not ID_RE.fullmatch(name) or name in self.tasks or name in recorded:
                        continue
                    log(4, f"reconcile: {where}/{name} is named by no task (a crash before "
                           "its task was saved): to the trash")
                    try:                       # each on its own: one failure skips none
                        if where == "layers":
                            self.views.merger.remove(trash_name(self.layer_dir(name)))
                        else:
                            trash = self.path("review", REVIEW_TRASH + name + "-" +
                                              secrets.token_hex(4))
                            os.rename(self.path("review", name), trash)
                            self.review.submit(trash_remove, trash)
                    except OSError as exc:
                        log(3, f"reconcile: could not move {where}/{name} to the trash: {exc}")

    def stacks_collect(self) -> None:
        """reconcile: stack files no task names, itself or as a parent (StackStore.orphans),
        are deleted: a save writes its task's stack before the task file that names it, and
        a crash in between (or a new task's file that never reached the disk) leaves it.
        Never one a task file names, even a damaged one set aside: its text is searched."""
        named = {ref for _, ref in self.stack_refs.values()} | set(self.stacks.lists) | \
            {t.mergedOn for t in self.tasks.values() if t.mergedOn is not None}
        for name in os.listdir(self.path("tasks")):
            if name.partition(".json")[0] not in self.tasks:       # damaged, set aside
                try:
                    with open(self.path("tasks", name), "rb") as f:
                        named.update(m.decode() for m in re.findall(rb"[0-9a-f]{32}",
                                                                    f.read()))
                except OSError as exc:                 # what it names is unknown: keep all
                    log(3, f"reconcile: stack files kept, {name} cannot be read: {exc}")
                    return
        for ref in self.stacks.orphans(named):
            log(4, f"reconcile: stacks/{ref}.json is named by no task (a crash before its "
                   "task was saved): deleted")
            try:                                       # each on its own: one failure skips none
                os.unlink(os.path.join(self.stacks.dir, ref + ".json"))
            except OSError as exc:
                log(3, f"reconcile: could not delete stacks/{ref}.json: {exc}")

    def shutdown_tasks(self) -> None:
        """End every running task (each on its own: one failure skips none), those the
        finish-time merge holds too (their workers are gone), save what only memory holds,
        close the views."""
        for task in list(self.tasks.values()):
            if task.id in self.workers or task.id in self.finish_merge.held:
                self.fail_task(task, "gurtd stopped while the task was running", by="restart")
                self.finish_merge.drop(task.id)
        self.save_unsaved()
        self.views.close()
        self.cgroups.stop()


# Droid worker ##################################################################################
###############################################################################################

class DroidWorker:
    """The droid worker of a box's tasks: the Droid CLI and its key, how the sandbox runs it
    (spec), its stream-json lines (on_event: steps, summary, cost), and the pause once its
    model spending passes the task's budget (pause_for_budget, on_model_approval).

    Methods for the Box (loop thread): path, key, spec, on_event, on_model_approval.
    """

    def __init__(self, box: Box) -> None:
        self.box = box

    def path(self) -> str | None:
        """The Droid CLI: the droidPath setting, else the one make installed beside gurtd."""
        here = os.path.dirname(os.path.abspath(__file__))
        candidates = [self.box.setting("droidPath")] if self.box.setting("droidPath") else [
            os.path.join(here, ".venv", "droid", "node_modules", "droid", "bin", "droid"),
            os.path.join(here, "droid", "node_modules", "droid", "bin", "droid"),
            shutil.which("droid") or ""]
        for path in candidates:
            if path and os.path.isfile(path) and os.access(path, os.X_OK):
                return path
        return None

    def key(self) -> str:
        """FACTORY_API_KEY: BOX_HOME/secrets/factory-api-key, else gurtd's environment."""
        try:
            with open(self.box.path("secrets", "factory-api-key")) as f:
                key = f.read().strip()
            if key:
                return key
        except OSError:
            pass
        return os.environ.get("FACTORY_API_KEY", "")

    def spec(self, task: Task, spec: dict[str, Any], hosts: list[str]) -> None:
        """How the sandbox runs Droid: the command, its files, its MCP server, its key; hosts
        are the grants it gets (the task's and droidHosts)."""
        path = self.path()
        if not path:
            raise SysError("droid", errno.ENOENT, "the Droid CLI is not installed")
        settings = self.box.setting()
        tools = ", ".join(task.tools) or "none"
        system = (
            "You work inside a gurtd box: an isolated Linux sandbox where you may act freely.\n"
            f"- The current directory ({VIEW_DIR}) is your own copy-on-write view of the "
            f"workspace {task.workspace}; a person may undo your changes.\n"
            f"- Network: you can reach only {', '.join(task.hosts) or 'no hosts of your own'} "
            "(everything else is refused).\n" + (
                "- Other hosts: looking up a name outside that list asks a person. The lookup "
                "waits while they decide; if it fails with a temporary DNS error, wait a minute "
                "and try again (the question stays open). A name that is approved then "
                "resolves and is reachable; a denied one answers NXDOMAIN from then on: do "
                "without it.\n" if task.askHosts else "") +
            f"- Tools: {tools}. Call one with the shell command "
            "`gurtd tool NAME '{\"json\": \"args\"}'`, or as the gurtd MCP server's tool "
            "gurtd___NAME (a dot in NAME as _), which ToolSearch loads.\n"
            f"- Budget: {task.budgetCents} US cents; spending above it pauses you until a "
            "person approves.\n")
        if task.folders:
            system += ("- Folders: " + ", ".join(task.folders) + " are your own copy-on-write "
                       "copies of the owner's real folders, at their real paths; the owner "
                       "reviews your changes there and keeps them or not.\n")
        spec["mode"] = "droid"
        spec["droid"] = path
        spec["files"] = {"/run/gurt/prompt.md": task.prompt,
                         "/run/gurt/system-prompt.md": system}
        # blockOnMcpLoad: droid exec's first model call waits for `gurtd mcp` to list the
        # task's tools (else it goes at once, and they are not among its deferred tools)
        spec["homeFiles"] = {".factory/mcp.json": json.dumps({"mcpServers": {"gurtd": {
            "type": "stdio", "command": "/run/gurt/bin/gurtd", "args": ["mcp"]}}}, indent=1),
            ".factory/settings.json": json.dumps({"blockOnMcpLoad": True}, indent=1)}
        spec["argv"] = ["/run/gurt/bin/droid", "exec", "--output-format", "stream-json",
                        "--cwd", task.folders[0] if task.folders else VIEW_DIR,
                        "-m", settings["droidModel"],
                        "--auto", settings["droidAutonomy"], "-f", "/run/gurt/prompt.md",
                        "--append-system-prompt-file", "/run/gurt/system-prompt.md"]
        if not self.box.gateway.droid_spec(task, spec) and settings["droidFactoryKey"]:
            spec["streamUsage"] = True   # the old way: what droid spends is its stream's word
            key = self.key()
            if key:
                spec["env"]["FACTORY_API_KEY"] = key
        self.box.append_log(task.id, {"type": "net", "text": "droid hosts added to the grants: " +
                                  ", ".join(settings["droidHosts"]), "hosts": hosts})

    def on_event(self, task: Task, worker: Worker, text: str) -> None:
        """One stream-json line: logged as it is; step, summary, cost and errors from it."""
        try:
            event = loads_bounded(text)
            if not isinstance(event, dict):
                raise ValueError("not an object")
        except ValueError:       # any other line, deep nesting and NaN included: plain output
            self.box.append_log(task.id, {"type": "stdout", "text": text})
            return
        self.box.append_log(task.id, {"type": "event", "event": event})
        kind = event.get("type")
        if kind == "system" and event.get("session_id"):
            self.box.append_log(task.id, {"type": "session", "text": str(event["session_id"])})
        if kind == "error" and last_line(event.get("message") or ""):
            worker.droid_error = last_line(event["message"])
        step = droid_step(event)
        changed = False
        if step:
            task.step, changed = step, True
        if kind == "completion" and isinstance(event.get("finalText"), str):
            task.summary, changed = event["finalText"], True
        # the stream is droid's stdout, which any process of the task can write to (its
        # /proc/PID/fd/1): its usage is spending only under droidFactoryKey, where droid
        # calls Factory itself and nothing else says what it spent; through the gateway
        # the gateway meters, and with no key droid spends nothing
        usage, own_word = event.get("usage"), worker.stream_usage
        if usage is not None and own_word:
            model = self.box.setting("droidModel")
            total = usage_cents(usage, self.box.setting("droidPrices").get(model))
            if total > worker.model_cents and is_cents(task.costCents + total):
                task.costCents += total - worker.model_cents
                worker.model_cents, changed = total, True
        if task.costCents > worker.budget_limit and worker.paused is None and \
                task.state == "running" and own_word:
            self.box.save(task)          # at once, synced, before a person is asked
            self.pause_for_budget(task, worker)
        elif changed:
            self.box.steps.save_later(task)     # one write a step, however many events

    def pause_for_budget(self, task: Task, worker: Worker) -> None:
        """Model spending passed the budget: pause every process and ask."""
        worker.paused = self.box.pause_and_ask(
            task, worker, "budget", "budget exceeded", "budget", "model",
            {"model": self.box.setting("droidModel"), "costCents": task.costCents},
            task.costCents, None)

    def on_model_approval(self, approval: Approval) -> None:
        """Approved: continue (SIGCONT) up to one more budget; denied: the task fails."""
        task = self.box.task(approval.task)
        worker = self.box.worker(approval.task)
        if task is None or worker is None or worker.paused != approval.id:
            return
        worker.paused = None
        if approval.state == "approved" or approval.answeredBy == "api":
            self.box.gateway.answered(task.id, approval)     # a person's word to its calls
        # else the task is ending (stop, timeout, undo): its held calls hear that from the
        # gateway's close ("the task has ended"), never that a person denied more
        if approval.state == "approved":
            worker.budget_limit = approval.budgetCents if approval.budgetCents is not None \
                else task.costCents + task.budgetCents    # raised to, or one more budget
            self.box.unhold(task, worker, "budget")
            return
        if approval.answeredBy == "api":
            self.box.fail_task(task, f"budget exceeded: {approval.reason or 'denied'}")


# Hosts #########################################################################################
###############################################################################################
# A task with hosts gets a veth pair out of its network namespace, NAT, and nftables grants
# (interface . address . port) that gurtd adds as it answers the task's DNS: a granted name is
# resolved upstream and its addresses granted before the answer goes back; any other name is
# NXDOMAIN, unless a host policy grants it or the task has askHosts: then the query is held
# and a host approval asks a person.  A task without hosts (nor askHosts nor a host policy in
# its scope) has lo only.  Everything here runs on the loop thread.

@dataclass
class TaskNet:
    """One task's network: its namespace, veth end, DNS sockets and the grants added so far."""

    task_id: str
    nsfd: int
    ifname: str
    grants: list[Grant]
    udp: socket.socket
    tcp: socket.socket
    elements: list[str] = field(default_factory=list)
    conns: dict[int, tuple[socket.socket, bytearray, list[int]]] = \
        field(default_factory=dict)  # fd -> (connection, what came, [queries asked])
    granted: dict[str, set[int] | None] = field(default_factory=dict)  # target -> ports
    upstreams: int = 0               # queries of this task waiting for the upstream server
    capped: bool = False             # went over MAX_DNS_CONNS (logged once)
    # askHosts: names a person is asked about (name -> approval), queries held meanwhile
    # (name -> [(query, reply, until)]), and names denied (name -> reason)
    ask: bool = False
    asked: dict[str, str] = field(default_factory=dict)
    held: dict[str, list[tuple[bytes, Callable[[bytes], None], float]]] = \
        field(default_factory=dict)
    denied: dict[str, str] = field(default_factory=dict)

    def answer_nets(self) -> list[ipaddress.IPv4Network]:
        """The networks that this task's ip and cidr entries grant explicitly."""
        return [ipaddress.IPv4Network(g.value) for g in self.grants if g.kind in ("ip", "cidr")]


@dataclass
class Upstream:
    """A query gurtd forwarded upstream for a task, waiting for its answer."""

    sock: socket.socket
    net: TaskNet
    query: Any
    name: str
    ports: list[int | None]
    reply: Callable[[bytes], None]
    deadline: float
    forward_id: int


# Caps per task: going over one fails or throttles that task's own requests, nobody else's.
MAX_DNS_PENDING = 32                 # queries waiting upstream; beyond: SERVFAIL, no socket
MAX_DNS_CONNS = 16                   # DNS TCP connections; beyond: the new one is closed
MAX_DNS_TCP_QUERIES = 8              # queries one of them asks (a resolver: one or two); the
#                                      rest closes it (a read of 2,000 pipelined ones held the
#                                      loop ~0.3 s, 16 connections' reads one after another)
MAX_ANSWER_ADDRESSES = 8             # addresses of one answer taken (and granted); the rest cut
MAX_TASK_GRANTS = 256                # addresses granted to one task by DNS; beyond: SERVFAIL
MAX_HOST_ASKS = 64                   # names an askHosts task may ask about; beyond: NXDOMAIN
MAX_HELD_QUERIES = 64                # queries held for a person's answer; beyond: NXDOMAIN
HELD_SECONDS = 60.0                  # a held query older than this gets no answer (its
                                     # resolver gave up long before)


class Network:
    """Task networks, their DNS and the nftables table.  Loop thread only."""

    def __init__(self, box: "Box", upstream_override: str | None) -> None:
        self.box = box
        self.upstream_override = upstream_override
        self.table = "gurt" if box.path() == DEFAULT_BOX_HOME else \
            "gurt_" + hashlib.sha1(box.path().encode()).hexdigest()[:8]
        self.nft: Nft | None = None
        self.ipr: Any = None
        self.host_ns = -1
        self.nets: dict[str, TaskNet] = {}
        self.pending: dict[int, Upstream] = {}
        self.forwarding: dict[str, str] = {}      # interface -> forwarding value before us
        self._own: tuple[float, set[str]] = (0.0, set())

    # start and stop
    def start(self) -> None:
        """Restore what a previous run changed on the host, then (re)create the table."""
        from pyroute2 import IPRoute
        self.ipr = IPRoute()
        self.host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.nft = Nft()
        self.restore_host()
        self.nft.table_add(self.table)

    def stop(self) -> None:
        """Release every task network, delete the table, put the host back: each step on its
        own, so that one failure skips none (this is also a failed start's undo)."""
        for net in list(self.nets.values()):
            try:
                self.release(net.task_id)
            except Exception as exc:
                log(3, f"could not release the network of task {net.task_id}: {exc}")
        if self.nft is not None:
            try:
                self.nft.table_del(self.table)
            except SysError as exc:
                log(3, f"could not delete nftables table {self.table}: {exc}")
        self.restore_host()
        if self.ipr is not None:
            self.ipr.close()

    def restore_host(self) -> None:
        """Put back every per-interface forwarding value gurtd changed (also after a crash)."""
        saved = load_json(self.box.path("host.json"))
        saved = dict(saved) if isinstance(saved, dict) else {}
        saved.update(self.forwarding)
        for ifname, value in saved.items():
            if not re.fullmatch(r"[\w.-]{1,15}", str(ifname)) or value not in ("0", "1"):
                continue
            try:
                sysctl_write(f"net.ipv4.conf.{ifname}.forwarding", value)
                log(6, f"restored net.ipv4.conf.{ifname}.forwarding={value}")
            except OSError:
                pass                               # the interface is gone
        self.forwarding = {}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.box.path("host.json"))

    def upstream(self) -> tuple[str, int]:
        text = self.upstream_override or self.box.setting("upstreamDns") or ""
        if not text:
            try:
                with open("/etc/resolv.conf") as f:
                    for line in f:
                        parts = line.split()
                        if len(parts) >= 2 and parts[0] == "nameserver" and "." in parts[1]:
                            text = parts[1]
                            break
            except OSError:
                pass
        return parse_upstream(text or "127.0.0.1")

    # a task's network
    def prepare(self, task: Task, hosts: list[str]) -> TaskNet:
        """Namespace, veth, addresses, DNS sockets and the grants of address entries."""
        from pyroute2 import IPRoute
        assert self.nft is not None
        grants = grants_of(hosts)
        index = net_index_next()
        ifname = f"g{index}"
        host_addr, task_addr = net_addresses(index)

        host_ns = self.host_ns

        def setup() -> tuple[socket.socket, socket.socket]:
            # inside the new namespace: IPv6 off, lo up, the veth (its host end goes out to
            # gurtd's namespace), eth0's address and route, the DNS sockets; one netlink socket
            sysctl_write("net.ipv6.conf.all.disable_ipv6", "1")
            sysctl_write("net.ipv6.conf.default.disable_ipv6", "1")
            # port 53 below without CAP_NET_BIND_SERVICE (the unit keeps none): from 53 up,
            # ports are anyone's in this namespace, the task's alone, where gurtd's DNS
            # sockets are bound before the worker starts
            sysctl_write("net.ipv4.ip_unprivileged_port_start", "53")
            with IPRoute() as ipr:
                ipr.link("set", index=1, state="up")
                ipr.link("add", ifname="eth0", kind="veth",
                         peer={"ifname": ifname, "net_ns_fd": host_ns})
                eth0 = ipr.link_lookup(ifname="eth0")[0]
                ipr.addr("add", index=eth0, address=task_addr, prefixlen=31)
                ipr.link("set", index=eth0, state="up")
                ipr.route("add", dst="0.0.0.0/0", gateway=host_addr)
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            udp.bind((DNS_ADDR, 53))
            tcp.bind((DNS_ADDR, 53))
            tcp.listen(16)
            return udp, tcp

        nsfd, (udp, tcp) = netns_new(setup)
        net = TaskNet(task.id, nsfd, ifname, grants, udp, tcp, ask=task.askHosts)
        self.nets[task.id] = net
        try:
            link = self.ipr.link_lookup(ifname=ifname)[0]
            sysctl_write(f"net.ipv6.conf.{ifname}.disable_ipv6", "1")
            sysctl_write(f"net.ipv4.conf.{ifname}.rp_filter", "1")
            sysctl_write(f"net.ipv4.conf.{ifname}.forwarding", "1")
            self.ipr.addr("add", index=link, address=host_addr, prefixlen=31)
            self.ipr.link("set", index=link, state="up")
            q = nft_quote(ifname)
            commands = [f"add element inet {self.table} tasks {{ {q} }}",
                        f"add counter inet {self.table} r_{ifname}",
                        f"add element inet {self.table} refused {{ {q} : \"r_{ifname}\" }}"]
            # widest first, every port before one port: what a wider entry covers is skipped
            for grant in sorted((g for g in grants if g.kind in ("ip", "cidr")), key=lambda g: (
                    ipaddress.IPv4Network(g.value).prefixlen, g.port is not None)):
                commands += self.grant_commands(net, grant.value, [grant.port])
                self.ensure_forwarding(grant.value.split("/")[0])
            self.nft.run("\n".join(commands))
        except BaseException:
            self.release(task.id)
            raise
        self.box.loop.watch(udp, ("dns-udp", task.id))
        self.box.loop.watch(tcp, ("dns-tcp", task.id))
        return net

    def release(self, task_id: str) -> None:
        """End a task's grants and delete its veth at once, log its refusals, and let its
        namespace go."""
        self.box.gateway.close(task_id)
        net = self.nets.pop(task_id, None)
        if net is None:
            return
        assert self.nft is not None
        refused = 0
        try:
            out = self.nft.run(f"list counter inet {self.table} r_{net.ifname}")
            m = re.search(r"packets (\d+)", out)
            refused = int(m.group(1)) if m else 0
        except SysError:
            pass
        try:                      # its veth now (~20 ms), not once its namespace is free:
            links = self.ipr.link_lookup(ifname=net.ifname)   # a survivor must reach nothing;
            if links:             # and before the interface leaves the tasks set, outside
                self.ipr.link("del", index=links[0])        # which the host accepts it
        except Exception as exc:  # pyroute2's NetlinkError; the namespace takes it anyway
            log(3, f"could not delete {net.ifname} of task {task_id}: {exc}")
        q = nft_quote(net.ifname)
        commands = [f"delete element inet {self.table} allow {{ {e} }}" for e in net.elements]
        commands += [f"delete element inet {self.table} refused {{ {q} }}",
                     f"delete counter inet {self.table} r_{net.ifname}",
                     f"delete element inet {self.table} tasks {{ {q} }}"]
        try:                      # one transaction (all or nothing); after an error each
            self.nft.run("\n".join(commands))       # on its own: one failure skips none
        except SysError:
            for command in commands:
                with contextlib.suppress(SysError):
                    self.nft.run(command)
        for key, up in list(self.pending.items()):
            if up.net is net:
                self.selector_drop(up.sock)
                del self.pending[key]
        for conn, *_ in list(net.conns.values()):
            self.selector_drop(conn)
        self.selector_drop(net.udp)
        self.selector_drop(net.tcp)
        os.close(net.nsfd)           # the namespace and its veth go once no process is left
        self.box.append_log(task_id, {"type": "net", "refused": refused,
                                      "text": f"refused connection attempts: {refused}"})

    def grant_commands(self, net: TaskNet, target: str, ports: list[int | None]) -> list[str]:
        """The nft commands that grant target these ports (nothing already covered, so never
        "File exists"), with net's bookkeeping updated as if they ran."""
        add, delete = grant_change(net.granted, target, ports)
        commands = []
        if delete:
            gone = nft_allow_elements(net.ifname, target, list(delete))
            commands.append(f"delete element inet {self.table} allow {{ {gone} }}")
            net.elements = [e for e in net.elements
                            if e not in {nft_allow_elements(net.ifname, target, [p])
                                         for p in delete}]
        if add:
            elements = [nft_allow_elements(net.ifname, target, [p]) for p in add]
            commands.append(f"add element inet {self.table} allow {{ {', '.join(elements)} }}")
            net.elements.extend(elements)
            have = net.granted.get(target, set())
            net.granted[target] = None if None in add or have is None else \
                have | {p for p in add if p is not None}
        return commands

    def selector_drop(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.box.loop.unwatch(sock)
        sock.close()

    def ensure_forwarding(self, address: str) -> None:
        """Forwarding on the interface toward address (per interface, never ip_forward)."""
        try:
            route = self.ipr.route("get", dst=address)[0]
            oif = route.get_attr("RTA_OIF")
            ifname = self.ipr.get_links(oif)[0].get_attr("IFLA_IFNAME")
        except Exception as exc:  # no route: the connection fails by itself
            log(7, f"no route to {address}: {exc}")
            return
        if ifname == "lo" or (ifname.startswith("g") and is_digits(ifname[1:])):
            return
        old = sysctl_write(f"net.ipv4.conf.{ifname}.forwarding", "1")
        if old != "1" and ifname not in self.forwarding:
            self.forwarding[ifname] = old
            write_json(self.box.path("host.json"), self.forwarding)
            log(6, f"set net.ipv4.conf.{ifname}.forwarding=1 (was {old})")

    def own_addresses(self) -> set[str]:
        stamp, addrs = self._own
        if time.monotonic() - stamp > 2:
            addrs = {a.get_attr("IFA_ADDRESS") for a in self.ipr.get_addr(family=socket.AF_INET)}
            self._own = (time.monotonic(), addrs)
        return addrs

    # DNS
    def on_event(self, kind: str, key: Any) -> None:
        """A DNS socket of a task is ready.  An error here is that task's: it fails (with the
        error in its log), gurtd and the other tasks go on."""
        up = self.pending.get(key) if kind == "upstream" else None
        task_id = up.net.task_id if up is not None else key[0] if isinstance(key, tuple) \
            else key if isinstance(key, str) else None
        try:
            self.on_dns_event(kind, key)
        except Exception as exc:
            log(3, f"DNS of task {task_id}: {type(exc).__name__}: {exc}")
            if task_id is None or task_id not in self.nets:
                return
            self.box.append_log(task_id, {"type": "error", "text": f"gurtd could not handle "
                                          f"the task's DNS: {type(exc).__name__}: {exc}"})
            try:
                self.release(task_id)
                task = self.box.task(task_id)
                if task is not None and task.state in ACTIVE_STATES:
                    self.box.stop(task_id, f"gurtd could not handle the task's DNS: {exc}")
            except Exception as again:        # the task is as good as stopped: its net is gone
                log(3, f"stopping task {task_id}: {type(again).__name__}: {again}")

    def on_dns_event(self, kind: str, key: Any) -> None:
        if kind == "upstream":
            self.on_upstream(key)
            return
        net = self.nets.get(key[0] if isinstance(key, tuple) else key)
        if net is None:
            return
        if kind == "dns-udp":
            try:
                data, addr = net.udp.recvfrom(4096)
            except OSError:
                return

            def udp_reply(answer: bytes) -> None:
                # OSError: a full buffer or a gone client, the task asks again
                with contextlib.suppress(OSError):
                    net.udp.sendto(answer, socket.MSG_DONTWAIT, addr)
            self.on_query(net, data, udp_reply)
        elif kind == "dns-tcp":
            try:
                conn, _ = net.tcp.accept()
            except OSError:
                return
            if len(net.conns) >= MAX_DNS_CONNS:
                if not net.capped:              # said once: a task may retry in a loop
                    net.capped = True
                    log(4, f"task {net.task_id}: more than {MAX_DNS_CONNS} DNS TCP "
                           "connections at once; the new ones are closed")
                conn.close()
                return
            conn.setblocking(False)
            net.conns[conn.fileno()] = (conn, bytearray(), [0])
            self.box.loop.watch(conn, ("dns-conn", (net.task_id, conn.fileno())))
        elif kind == "dns-conn":
            if key[1] not in net.conns:      # closed earlier in the same round of events
                return
            conn, buf, asked = net.conns[key[1]]
            try:
                data = conn.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data or len(buf) + len(data) > 65538:
                del net.conns[key[1]]
                self.selector_drop(conn)
                return
            buf += data
            while len(buf) >= 2 and len(buf) >= 2 + int.from_bytes(buf[:2], "big"):
                if asked[0] >= MAX_DNS_TCP_QUERIES:      # a flood: no more of it on the loop
                    del net.conns[key[1]]
                    self.selector_drop(conn)
                    return
                asked[0] += 1
                size = int.from_bytes(buf[:2], "big")
                message, buf[:] = bytes(buf[2:2 + size]), buf[2 + size:]

                def reply(answer: bytes, conn: socket.socket = conn) -> None:
                    with contextlib.suppress(OSError):
                        conn.sendall(len(answer).to_bytes(2, "big") + answer)
                self.on_query(net, message, reply)

    def on_query(self, net: TaskNet, data: bytes, reply: Callable[[bytes], None]) -> None:
        import dns.flags
        import dns.message
        import dns.opcode
        import dns.rcode
        import dns.rdatatype
        try:
            query = dns.message.from_wire(data)
            answer = dns.message.make_response(query)
        except Exception:          # not DNS (or nothing to answer): no answer at all
            return
        answer.flags |= dns.flags.RA
        if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
            answer.set_rcode(dns.rcode.REFUSED)
            reply(answer.to_wire())
            return
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        qtype = dns.rdatatype.to_text(question.rdtype)
        ports = ports_for_name(net.grants, name)
        verdict, why = self.unlisted_name(net, name, data, reply) if not ports else ("", None)
        if verdict == "held":                            # a person decides; the answer waits
            return
        ports = ports_for_name(net.grants, name)         # a host policy may have granted it
        if not ports:
            entry = {"type": "dns", "name": name, "qtype": qtype, "allowed": False}
            if why:
                entry["reason"] = why
            self.box.append_log(net.task_id, entry)
            answer.set_rcode(dns.rcode.NXDOMAIN)
            reply(answer.to_wire())
            return
        if question.rdtype != dns.rdatatype.A:
            # AAAA and the rest: an empty answer (IPv6 is off; nothing else is needed)
            self.box.append_log(net.task_id, {"type": "dns", "name": name, "qtype": qtype,
                                              "allowed": True, "addresses": []})
            reply(answer.to_wire())
            return
        if net.upstreams >= MAX_DNS_PENDING:       # a flood: this task waits, no socket
            self.box.append_log(net.task_id, {"type": "dns", "name": name, "qtype": qtype,
                                              "allowed": True, "error": "too many queries "
                                              f"waiting upstream (at most {MAX_DNS_PENDING})"})
            answer.set_rcode(dns.rcode.SERVFAIL)
            reply(answer.to_wire())
            return
        forward = dns.message.make_query(question.name, dns.rdatatype.A)
        sock: socket.socket | None = None
        try:              # EMFILE/ENFILE too: a SERVFAIL for this query, nothing more
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC |
                                 socket.SOCK_NONBLOCK)
            sock.connect(self.upstream())
            sock.send(forward.to_wire())
        except OSError as exc:
            if sock is not None:
                sock.close()
            log(4, f"DNS upstream {self.upstream()}: {exc}")
            answer.set_rcode(dns.rcode.SERVFAIL)
            reply(answer.to_wire())
            return
        self.pending[sock.fileno()] = Upstream(sock, net, query, name, ports, reply,
                                               time.monotonic() + 3.0, forward.id)
        net.upstreams += 1
        self.box.loop.watch(sock, ("upstream", sock.fileno()))

    def on_upstream(self, fileno: int) -> None:
        import dns.message
        import dns.rcode
        import dns.rdatatype
        up = self.pending.get(fileno)
        if up is None:
            return
        try:
            data = up.sock.recv(65535)
            response = dns.message.from_wire(data)
        except BlockingIOError:
            return
        except Exception as exc:
            log(4, f"DNS upstream answer for {up.name}: {exc}")
            self.finish_upstream(up, None)
            return
        if response.id != up.forward_id:
            return
        self.finish_upstream(up, response)

    def finish_upstream(self, up: Upstream, response: Any) -> None:
        import dns.message
        import dns.rcode
        import dns.rdatatype
        if self.pending.pop(up.sock.fileno(), None) is not None:
            up.net.upstreams -= 1
        self.selector_drop(up.sock)
        answer = dns.message.make_response(up.query)
        if response is None:
            answer.set_rcode(dns.rcode.SERVFAIL)
            up.reply(answer.to_wire())
            return
        names = {up.query.question[0].name}
        for _ in range(16):           # follow the CNAME chain in the answer
            more = {rr.target for rrset in response.answer if rrset.name in names
                    and rrset.rdtype == dns.rdatatype.CNAME for rr in rrset}
            if more <= names:
                break
            names |= more
        kept = [rrset for rrset in response.answer if rrset.name in names
                and rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.CNAME)]
        addresses = sorted({rr.address for rrset in kept if rrset.rdtype == dns.rdatatype.A
                            for rr in rrset}, key=ipaddress.IPv4Address)
        if len(addresses) > MAX_ANSWER_ADDRESSES:    # an upstream answering thousands would
            addresses = addresses[:MAX_ANSWER_ADDRESSES]   # stall the loop and grow the table
            kept = answer_only(kept, set(addresses))
        own = self.own_addresses()
        nets = up.net.answer_nets() + [ipaddress.IPv4Network(n)
                                       for n in (self.box.setting("dnsAllowedNets") or [])]
        bad = [reason for a in addresses if (reason := refused_address(a, own, nets))]
        entry: dict[str, Any] = {"type": "dns", "name": up.name, "qtype": "A",
                                 "addresses": addresses}
        if bad:
            entry.update(allowed=False, refused=bad)
            self.box.append_log(up.net.task_id, entry)
            answer.set_rcode(dns.rcode.REFUSED)
            up.reply(answer.to_wire())
            return
        if up.net.task_id in self.nets and not self.grant_addresses(up.net, addresses,
                                                                     up.ports, entry):
            answer.set_rcode(dns.rcode.SERVFAIL)
            up.reply(answer.to_wire())
            return
        entry["allowed"] = True
        self.box.append_log(up.net.task_id, entry)
        answer.answer = kept
        answer.set_rcode(response.rcode())
        up.reply(answer.to_wire())

    def grant_addresses(self, net: TaskNet, addresses: list[str], ports: list[int | None],
                        entry: dict[str, Any]) -> bool:
        """Grant a name's addresses in one nft step; False (and the error logged in entry,
        nothing granted) when nftables refuses."""
        assert self.nft is not None
        new = [a for a in addresses if a not in net.granted]
        if len(net.granted) + len(new) > MAX_TASK_GRANTS:
            entry.update(allowed=False, error=f"the task has {len(net.granted)} granted "
                                              f"addresses, at most {MAX_TASK_GRANTS}")
            self.box.append_log(net.task_id, entry)
            return False
        saved = (dict(net.granted), list(net.elements))
        commands, fresh = [], []
        for address in addresses:
            more = self.grant_commands(net, address, ports)
            commands += more
            fresh += [address] if more else []
        if not commands:
            return True
        try:
            self.nft.run("\n".join(commands))
        except SysError as exc:
            net.granted, net.elements = saved
            log(3, f"task {net.task_id}: granting {addresses}: {exc}")
            entry.update(allowed=False, error=f"nftables refused the grant: {exc.stderr}"[:500])
            self.box.append_log(net.task_id, entry)
            return False
        for address in fresh:
            self.ensure_forwarding(address)
        return True

    # askHosts: a name outside the grants asks a person
    def unlisted_name(self, net: TaskNet, name: str, data: bytes,
                      reply: Callable[[bytes], None]) -> tuple[str, str | None]:
        """A query for a name outside the task's grants, and why not when refused:
        "granted" (a host policy in the task's scope allows it: now a grant of the task),
        "held" (an askHosts task: a host approval decides, the query waits for it, and so do
        the resolver's retries) or "refused" (NXDOMAIN: no askHosts, denied, over a cap).
        Only answers of a person are remembered (denied), so a flood of names grows nothing
        past the caps."""
        task = self.box.task(net.task_id)
        try:
            entry = host_policy_entry(name)
        except ApiError:             # not a name a grant could hold (an address, junk)
            return "refused", None
        if name in net.denied:
            return "refused", net.denied[name]
        if task is None or entry.startswith("*."):
            return "refused", None
        policies = self.box.broker.policies
        policy = policies.find(task, "host", 0, host=name)
        if policy is not None:
            if len(net.grants) >= MAX_TASK_GRANTS:        # a *.domain policy, many names
                return "refused", f"not granted by policy {policy.id}: the task has " \
                                  f"{len(net.grants)} host grants (at most {MAX_TASK_GRANTS})"
            policies.use(policy, 0)
            net.grants.append(Grant("name", name, None))
            self.box.append_log(net.task_id, {"type": "net", "name": name, "policy": policy.id,
                                              "text": f"{name} granted by policy {policy.id}"})
            return "granted", None
        if not net.ask or task.state not in ("running", "waiting"):
            return "refused", None
        now = time.monotonic()
        for other in list(net.held):             # what no resolver waits for any more
            net.held[other] = [h for h in net.held[other] if h[2] > now]
        if sum(len(h) for h in net.held.values()) >= MAX_HELD_QUERIES:
            return "refused", f"not held: {MAX_HELD_QUERIES} queries wait for a person already"
        if name not in net.asked:
            why = self.ask_host(net, task, name)
            if why is not None:
                return "refused", why
        net.held.setdefault(name, []).append((data, reply, now + HELD_SECONDS))
        return "held", None

    def ask_host(self, net: TaskNet, task: Task, name: str) -> str | None:
        """Make the host approval for name; why not (a cap, a full disk), or None."""
        broker = self.box.broker
        pending = sum(1 for a in broker.approvals.values()
                      if a.task == task.id and a.state == "pending")
        if len(net.asked) >= MAX_HOST_ASKS or pending >= MAX_PENDING_APPROVALS:
            return f"not asked: the task asked about {len(net.asked)} names (at most " \
                   f"{MAX_HOST_ASKS}) and has {pending} approvals pending (at most " \
                   f"{MAX_PENDING_APPROVALS})"
        try:
            net.asked[name] = broker.create(task, "host", "host", {"name": name}, 0,
                                            None)["wait"]
        except (ApiError, OSError) as exc:
            return f"not asked: {exc.message if isinstance(exc, ApiError) else exc}"
        self.box.append_log(task.id, {
            "type": "dns", "name": name, "approval": net.asked[name],
            "text": f"{name} is not in the task's hosts: its lookup waits for a person "
                    f"(approval {net.asked[name]})"})
        return None

    def on_host_approval(self, approval: Approval) -> None:
        """A person answered a host approval: approved, the name becomes a grant of the
        task and its held queries are answered (resolved upstream); denied, NXDOMAIN to them
        and to every later query of the name, the reason in the task's log."""
        net = self.nets.get(approval.task)
        name = approval.args.get("name") if isinstance(approval.args, dict) else None
        if net is None or not isinstance(name, str):
            return
        if approval.state == "approved":
            net.grants.append(Grant("name", name, None))
            self.box.append_log(net.task_id, {
                "type": "net", "name": name, "approval": approval.id,
                "text": f"{name} granted by approval {approval.id}"})
        else:
            net.denied[name] = approval.reason or "denied"
        now = time.monotonic()
        for data, reply, until in net.held.pop(name, []):
            if until > now:
                self.on_query(net, data, reply)

    def tick(self) -> float:
        """Answer SERVFAIL to queries whose upstream is silent; seconds until the next."""
        now, nearest = time.monotonic(), 1.0
        for up in list(self.pending.values()):
            if up.deadline <= now:
                self.finish_upstream(up, None)
            else:
                nearest = min(nearest, up.deadline - now)
        return nearest


def answer_only(rrsets: list[Any], addresses: set[str]) -> list[Any]:
    """The answer's CNAME and A records, with only these addresses left in its A records."""
    import dns.rdatatype
    import dns.rrset
    out = []
    for rrset in rrsets:
        if rrset.rdtype == dns.rdatatype.A:
            rrset = dns.rrset.from_rdata_list(rrset.name, rrset.ttl,
                                              [rr for rr in rrset if rr.address in addresses])
        out.append(rrset)
    return out


def parse_upstream(text: str) -> tuple[str, int]:
    """An upstream DNS server, IPv4 HOST or HOST:PORT (port 53 by default)."""
    host, _, port = text.partition(":")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"upstream DNS must be an IPv4 address with an optional :port, "
                         f"not {text!r}") from None
    if port and (not is_digits(port) or not 1 <= int(port) <= 65535):
        raise ValueError(f"bad port in upstream DNS {text!r}")
    return host, int(port or 53)


# Policies ######################################################################################
###############################################################################################
# "Always approve": a person answering an approval may record a policy, so that matching calls
# later run without asking.  A policy names a tool (or `host`, a name a task may look up), a
# scope (one task, one workspace, or the whole box) and optional limits: cents per call, cents
# over its life, an expiry.  An `ask` is never automatic, nor a call above the owner's
# neverAutoApproveCents.  Policies live in BOX_HOME/policies.json, written whole and
# atomically; a deleted policy is gone from memory and disk in the same loop step, so the
# next call asks again.  Loop thread only.

POLICY_SCOPES = ("task", "workspace", "box")
MAX_POLICIES = 500                    # beyond: 409, delete some first
POLICY_FIELDS = {"tool", "scope", "task", "workspace", "host", "maxCents", "totalCents",
                 "expiresAt", "reason"}
POLICY_ID_RE = re.compile(r"^p[a-z0-9]{9}$")


@dataclass
class Policy:
    """A standing yes: calls of `tool` in `scope` run without asking, within its limits."""

    id: str
    tool: str                        # a tool name, or "host"
    scope: str                       # task | workspace | box
    createdAt: str
    createdBy: str                   # "api", or the approval it was made from
    task: str | None = None          # scope task: the task
    workspace: str | None = None     # scope workspace: the workspace
    host: str | None = None          # tool host: a name or *.domain entry
    maxCents: float | None = None    # at most this per call
    totalCents: float | None = None  # at most this over its life
    expiresAt: str | None = None     # not after this time (ISO 8601, UTC)
    reason: str | None = None
    spentCents: float = 0
    uses: int = 0

    def ended(self, now: datetime.datetime | None = None) -> str | None:
        """Why the policy no longer allows anything (expired, used up), or None."""
        now = now or datetime.datetime.now(datetime.timezone.utc)
        if self.expiresAt is not None and parse_time(self.expiresAt) <= now:
            return f"expired at {self.expiresAt}"
        if self.totalCents is not None and self.spentCents >= self.totalCents:
            return f"its totalCents ({self.totalCents}) are spent"
        return None

    def to_api(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        ended = self.ended()
        out["active"] = ended is None
        if ended:
            out["endedBecause"] = ended
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Policy":
        return record_from(cls, data, valid_policy)


def valid_policy(policy: Policy) -> bool:
    """A stored policy that matching can rely on (a hand-edited file may hold anything)."""
    try:
        if policy.expiresAt is not None:
            parse_time(policy.expiresAt)
        if policy.host is not None:
            host_policy_entry(policy.host)
    except (ValueError, TypeError, ApiError):
        return False
    return bool(POLICY_ID_RE.fullmatch(policy.id)) and policy.scope in POLICY_SCOPES and \
        isinstance(policy.tool, str) and (policy.tool == "host") == (policy.host is not None) \
        and all(v is None or (is_cents(v) and v >= 0)
                for v in (policy.maxCents, policy.totalCents)) and is_cents(policy.spentCents)


def parse_time(text: str) -> datetime.datetime:
    """An ISO 8601 time with its zone (Z allowed); ValueError otherwise."""
    when = datetime.datetime.fromisoformat(text)
    if when.tzinfo is None:
        raise ValueError("a time needs its zone, e.g. 2026-12-01T00:00:00Z")
    try:
        when.astimezone(datetime.timezone.utc)   # year 1 at +01:00 is no time in UTC
    except OverflowError:
        raise ValueError("the time is out of range") from None
    return when


def in_scope(policy: Policy, task: Task) -> bool:
    return policy.scope == "box" or (policy.scope == "task" and policy.task == task.id) or \
        (policy.scope == "workspace" and policy.workspace == task.workspace)


def policy_allows(policy: Policy, cents: float, never_auto: float | None) -> str | None:
    """Why this policy does not allow a call of `cents` now, or None when it does."""
    ended = policy.ended()
    if ended:
        return ended
    if never_auto is not None and cents > never_auto:
        return f"{cents} cents is above neverAutoApproveCents ({never_auto})"
    if policy.maxCents is not None and cents > policy.maxCents:
        return f"{cents} cents is above its maxCents ({policy.maxCents})"
    if policy.totalCents is not None and policy.spentCents + cents > policy.totalCents:
        return f"{cents} cents would pass its totalCents ({policy.totalCents})"
    return None


def always_blocked(approval: Approval, never_auto: float | None) -> str | None:
    """Why this approval cannot be answered with a policy (the canAlwaysApprove false), or
    None."""
    if approval.state != "pending":
        return f"the approval is {approval.state} already"
    if approval.kind == "ask":
        return "an ask is a question for a person: each one needs its own answer"
    if approval.kind == "disk":
        return "a disk approval is about the box's free space, not a call: answer it each time"
    if approval.kind == "conflict":
        return "a conflict is answered for its own paths by a person, never by a policy"
    if approval.tool == "model":
        return "model spending has no call to repeat: approve it with a higher budgetCents"
    if never_auto is not None and approval.cents > never_auto:
        return (f"{approval.cents} cents is above neverAutoApproveCents ({never_auto}): the "
                "owner wants a person to look at each call this large")
    return None


def check_limits(body: dict[str, Any]) -> dict[str, Any]:
    """maxCents, totalCents, expiresAt of a policy body (each optional); ApiError(400)."""
    out: dict[str, Any] = {}
    for key in ("maxCents", "totalCents"):
        if body.get(key) is not None:
            if not is_cents(body[key]) or body[key] < 0:
                raise ApiError(400, f"{key} must be a number of at least 0")
            out[key] = body[key]
    if body.get("expiresAt") is not None:
        try:
            when = parse_time(body["expiresAt"]) if isinstance(body["expiresAt"], str) else None
        except ValueError:
            when = None
        if when is None:
            raise ApiError(400, "expiresAt must be a time such as 2026-12-01T00:00:00Z")
        out["expiresAt"] = when.astimezone(datetime.timezone.utc).isoformat(
            timespec="seconds").replace("+00:00", "Z")
    out["reason"] = check_reason(body.get("reason"))
    return out


def check_reason(reason: Any) -> str | None:
    """A reason given with a decision: None, or a string of at most 2000 characters."""
    if reason is not None and (not isinstance(reason, str) or len(reason) > 2000):
        raise ApiError(400, "reason must be a string of at most 2000 characters")
    return reason


def validate_policy_body(body: Any) -> dict[str, Any]:
    """A POST /api/policies body: the new policy's fields (the caller checks that its task or
    workspace exists).  Pure; ApiError(400) names what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    extra = set(body) - POLICY_FIELDS
    if extra:
        raise ApiError(400, f"unknown field: {sorted(extra)[0]}")
    tool, scope = body.get("tool"), body.get("scope")
    if not isinstance(tool, str) or len(tool) > 64 or not TOOL_RE.fullmatch(tool):
        raise ApiError(400, "tool must be a tool name, or host")
    if tool == "ask":
        raise ApiError(400, "an ask is never automatic: each one needs a person's answer")
    if scope not in POLICY_SCOPES:
        raise ApiError(400, "scope must be one of: task, workspace, box")
    out: dict[str, Any] = {"tool": tool, "scope": scope, **check_limits(body)}
    for key in ("task", "workspace"):
        if (scope == key) != (body.get(key) is not None):
            raise ApiError(400, f"{key} is required with scope {key}, and only then")
    if scope != "box":
        valid, what = (ID_RE.fullmatch, "a task id") if scope == "task" else \
            (valid_workspace_name, "a workspace name")
        if not isinstance(body[scope], str) or not valid(body[scope]):
            raise ApiError(400, f"{scope} must be {what}")
        out[scope] = body[scope]
    if (tool == "host") != (body.get("host") is not None):
        raise ApiError(400, "host (a name or *.domain) is required with tool host, and only then")
    if tool == "host":
        out["host"] = host_policy_entry(body["host"])
    return out


def host_policy_entry(entry: Any) -> str:
    """A host policy's name: example.com or *.example.com, no port, no address (an address is
    granted with the task's hosts, where its owner sees it)."""
    try:
        kind, value, port = parse_host(entry)
    except ValueError as exc:
        raise ApiError(400, f"host: {json.dumps(entry)}: {exc}") from None
    if kind not in ("name", "wildcard") or port is not None:
        raise ApiError(400, "host must be a name or *.domain, without a port")
    return ("*." if kind == "wildcard" else "") + value


class Policies:
    """The box's policies: stored, matched, used, deleted.  Methods run on the loop thread."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.items: dict[str, Policy] = {}

    @property
    def file(self) -> str:
        return self.box.path("policies.json")

    def load(self) -> None:
        def parse(data: Any) -> list[Policy]:
            if not isinstance(data, dict) or not isinstance(data.get("policies"), list):
                raise ValueError("not a policies file")
            return [Policy.from_dict(p) for p in data["policies"]]
        self.items = {p.id: p for p in load_json(self.file, parse) or []}

    def write(self, items: dict[str, Policy], action: str, policy: Policy) -> None:
        """Saved first, then in force (a policy that is not on disk is not in memory), then
        told: a policy event of action."""
        with saved_or_507("policies"):
            write_json(self.file, {"policies": [dataclasses.asdict(p) for p in items.values()]})
        self.items = items
        self.box.loop.emit("policy", {"action": action, "policy": policy.to_api()})

    def listing(self) -> list[dict[str, Any]]:
        return [p.to_api() for p in sorted(self.items.values(), key=lambda p: p.createdAt,
                                           reverse=True)]

    def add(self, fields: dict[str, Any], by: str) -> Policy:
        if len(self.items) >= MAX_POLICIES:
            raise ApiError(409, f"the box has {len(self.items)} policies (at most "
                                f"{MAX_POLICIES}); delete some first", "conflict")
        if fields.get("task") is not None and self.box.task(fields["task"]) is None:
            raise ApiError(400, "No task with this id")
        if fields.get("workspace") is not None and \
                not self.box.views.workspace_exists(fields["workspace"]):
            raise ApiError(400, f"no workspace named {fields['workspace']}")
        policy = Policy(id=new_task_id("p"), createdAt=now_iso(), createdBy=by, **fields)
        self.write({**self.items, policy.id: policy}, "created", policy)
        log(6, f"policy {policy.id} created by {by}: {policy.tool} in {policy.scope}")
        return policy

    def delete(self, policy_id: str) -> dict[str, Any]:
        policy = self.items.get(policy_id) if isinstance(policy_id, str) else None
        if policy is None:
            raise ApiError(404, "No policy with this id", "not_found")
        self.write({k: v for k, v in self.items.items() if k != policy_id}, "deleted", policy)
        return policy.to_api()

    def find(self, task: Task, tool: str, cents: float, host: str | None = None) -> Policy | None:
        """The policy that allows this call (or this name) now, narrowest scope first."""
        never = self.box.setting("neverAutoApproveCents")
        order = {"task": 0, "workspace": 1, "box": 2}
        for policy in sorted(self.items.values(), key=lambda p: (order[p.scope], p.createdAt)):
            if policy.tool != tool or not in_scope(policy, task):
                continue
            if host is not None and not Grant(*parse_host(policy.host or "")).matches_name(host):
                continue
            if policy_allows(policy, cents, never) is None:
                return policy
        return None

    def has_hosts(self, task: Task) -> bool:
        """Whether a host policy may grant this task a name (then it needs a network)."""
        return any(p.tool == "host" and in_scope(p, task) and p.ended() is None
                   for p in self.items.values())

    def use(self, policy: Policy, cents: float) -> None:
        """Count one automatic approval (saved before the call runs)."""
        used = dataclasses.replace(policy, spentCents=policy.spentCents + cents,
                                   uses=policy.uses + 1)
        self.write({**self.items, policy.id: used}, "used", used)


# Model gateway #################################################################################
###############################################################################################
# A droid task reaches its model through gurtd, never directly: a listener that gurtd binds
# inside the task's own network namespace (GATEWAY_ADDR:GATEWAY_PORT, beside its DNS, made from
# a thread that setns-ed there), served by gurtd's gateway threads.  Each call is forwarded by
# the thread that accepted it (at most GATEWAY_THREADS at once, GATEWAY_TASK_CALLS per task;
# threads kept for the next call) to the upstream the owner set (modelGateway), over a
# kept-alive connection, with the owner's key added: BOX_HOME/secrets/model-key, which no
# task ever sees.  A task holds only its own random credential, dead when it ends.  What a
# call costs is the usage in the upstream's answer (the final events of a stream, or the
# response), never the task's own stream; the loop adds it to costCents and holds a call that
# arrives at or past the budget until a person answers the budget approval.

GATEWAY_ADDR = DNS_ADDR              # on the task's own lo, where its resolver is too
GATEWAY_PORT = 80                    # below 1024: no process of the task can bind it
GATEWAY_MODEL_NAME = "gurtd"         # droid's customModels displayName: -m custom:gurtd-0
GATEWAY_APIS = {                     # api: (the path a task calls, droid's provider)
    "anthropic": ("/v1/messages", "anthropic"),
    "chat-completions": ("/v1/chat/completions", "generic-chat-completion-api"),
}
GATEWAY_MAX_HEADERS = 32 << 10       # a call's request line and headers
GATEWAY_MAX_BODY = 16 << 20          # a call's body (a long conversation is a few MB)
GATEWAY_MAX_VALUES = 1 << 20         # JSON values of a body at most (json_values_most): parsed
#                                      whole, 16 MB of `{}` were 430 MB of objects in gurtd
GATEWAY_MAX_ANSWER = 64 << 20        # bytes of one answer passed on; the rest is cut
GATEWAY_MAX_PARSED = 16 << 20        # a whole (not streamed) answer is read for usage up to this
GATEWAY_MAX_LINE = 1 << 20           # a longer stream line is passed on but not read for usage
GATEWAY_THREADS = 64                 # calls forwarded at once, all tasks together
GATEWAY_SPARE = 2                    # threads kept waiting for calls; a burst's others end
GATEWAY_TASK_CALLS = 4               # calls of one task in flight at once
GATEWAY_REQUEST_SECONDS = 30.0       # for a task to send a whole request (slow drips)
GATEWAY_CONNECT_SECONDS = 10.0       # to connect to the upstream (TLS included)
GATEWAY_READ_SECONDS = 300.0         # the upstream's (or the task's) silence between two reads
GATEWAY_CALL_SECONDS = 1800.0        # a whole answer; an endless one is cut here
GATEWAY_IDLE = 16                    # kept-alive upstream connections waiting for a call
GATEWAY_IDLE_SECONDS = 15.0          # an idle one older than this is closed, not reused
MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$")
DEFAULT_MODEL_GATEWAY: dict[str, Any] = DEFAULT_SETTINGS["modelGateway"]


def upstream_url(text: Any) -> tuple[str, str, int, str]:
    """modelGateway.baseUrl as (scheme, host, port, path prefix): https, or plain http to a
    literal loopback address only (a local model, a test); ValueError says what is wrong."""
    wrong = ValueError("baseUrl must be https://HOST[:PORT][/PATH], or http:// to a loopback "
                       "address (127.0.0.1, ::1) for a local model")
    if not isinstance(text, str) or len(text) > 2000:
        raise wrong
    parts = urllib.parse.urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise wrong from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or \
            parts.fragment or parts.username or parts.password or \
            not re.fullmatch(r"[\w.:/%~-]*", parts.path, re.ASCII):
        raise wrong
    if parts.scheme == "http":
        try:
            loopback = ipaddress.ip_address(parts.hostname).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise wrong
    return (parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80),
            parts.path.rstrip("/"))


def validate_model_gateway(value: Any) -> dict[str, Any]:
    """The modelGateway setting: where droid's model calls go and which models they may ask."""
    if not isinstance(value, dict) or set(value) - set(DEFAULT_MODEL_GATEWAY):
        raise ApiError(400, "modelGateway must be an object with any of: " +
                       ", ".join(DEFAULT_MODEL_GATEWAY))
    out = {**DEFAULT_MODEL_GATEWAY, **value}
    if not isinstance(out["api"], str) or out["api"] not in GATEWAY_APIS:
        raise ApiError(400, f"modelGateway.api must be one of: {', '.join(GATEWAY_APIS)}")
    try:
        upstream_url(out["baseUrl"])
    except ValueError as exc:
        raise ApiError(400, f"modelGateway.{exc}") from None
    if not isinstance(out["model"], str) or (out["model"] and
                                             not MODEL_ID_RE.fullmatch(out["model"])):
        raise ApiError(400, "modelGateway.model must be a model id, or empty for droidModel")
    if not isinstance(out["models"], list) or len(out["models"]) > 50 or not all(
            isinstance(m, str) and MODEL_ID_RE.fullmatch(m) for m in out["models"]):
        raise ApiError(400, "modelGateway.models must be an array of model ids (at most 50)")
    tokens = out["maxOutputTokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1 << 20:
        raise ApiError(400, "modelGateway.maxOutputTokens must be a whole number from 1 to "
                            f"{1 << 20}")
    return out


def gateway_models(settings: dict[str, Any]) -> list[str]:
    """The models a task's calls may ask for: the gateway's model (droidModel unless set) and
    modelGateway.models."""
    config = settings["modelGateway"]
    first = config["model"] or settings["droidModel"]
    return [first] + [m for m in config["models"] if m != first]


def _token_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


def anthropic_usage(raw: Any) -> dict[str, int]:
    """The token counts of a Messages API usage object (the rest of it is left out), its
    cache_creation's by time to live among them (ephemeral_5m_input_tokens and
    ephemeral_1h_input_tokens: a 1-hour write costs more)."""
    if not isinstance(raw, dict):
        return {}
    parts = raw.get("cache_creation") if isinstance(raw.get("cache_creation"), dict) else {}
    keys = [keys[0] for keys in TOKEN_KEYS.values()]
    return {k: where[k] for k in keys for where in (raw, parts) if _token_count(where.get(k))}


def chat_usage(raw: Any) -> dict[str, int]:
    """A chat completions usage object in the Messages API's terms: its prompt_tokens count
    the cached ones too, which cost the cacheRead price instead."""
    if not isinstance(raw, dict) or not _token_count(raw.get("prompt_tokens")) or \
            not _token_count(raw.get("completion_tokens")):
        return {}
    details = raw.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    cached = cached if _token_count(cached) and cached <= raw["prompt_tokens"] else 0
    return {"input_tokens": raw["prompt_tokens"] - cached,
            "output_tokens": raw["completion_tokens"], "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def event_usage(api: str, event: Any) -> dict[str, int]:
    """The usage one parsed answer or stream event carries (counts of a Messages API stream
    are totals so far: message_start has the input, each message_delta the output)."""
    if not isinstance(event, dict):
        return {}
    if api == "chat-completions":
        return chat_usage(event.get("usage"))
    kind = event.get("type")
    if kind == "message_start" and isinstance(event.get("message"), dict):
        return anthropic_usage(event["message"].get("usage"))
    if kind in ("message_delta", "message"):
        return anthropic_usage(event.get("usage"))
    return {}


class UsageMeter:
    """The usage in an upstream's answer, read as it passes on to the task: the data lines of
    an event stream, or a whole JSON answer (up to GATEWAY_MAX_PARSED)."""

    def __init__(self, api: str, stream: bool) -> None:
        self.api, self.stream = api, stream
        self.buf = bytearray()
        self.usage: dict[str, int] = {}
        self.skipping = False            # in a line too long to read, or an answer too large

    def feed(self, data: bytes) -> None:
        if not self.stream:
            if len(self.buf) + len(data) > GATEWAY_MAX_PARSED:
                self.skipping = True
            elif not self.skipping:
                self.buf += data
            return
        self.buf += data
        while (end := self.buf.find(b"\n")) >= 0:
            line = bytes(self.buf[:end]).rstrip(b"\r")
            del self.buf[:end + 1]
            if self.skipping:
                self.skipping = False
            elif line.startswith(b"data:") and (b"usage" in line or b"\\u" in line):
                self.take(line[5:].strip())      # "usage" as a key is spelt so, or escaped
        if len(self.buf) > GATEWAY_MAX_LINE:
            self.buf.clear()
            self.skipping = True

    def take(self, data: bytes) -> None:
        with contextlib.suppress(ValueError):    # [DONE], or anything else that is not JSON
            self.usage.update(event_usage(self.api, loads_bounded(data)))

    def result(self) -> dict[str, int] | None:
        """The usage found, None if the answer carried none."""
        if not self.stream and not self.skipping and self.buf:
            self.take(bytes(self.buf))
            self.buf.clear()
        return dict(self.usage) if self.usage else None


class GatewayRefusal(Exception):
    """A call the gateway answers itself: an HTTP status, an error type of the API, and a
    message the agent sees."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def refusal_answer(api: str, refusal: GatewayRefusal) -> bytes:
    """A whole HTTP answer for a refusal, in the error shape of the task's API."""
    message = "gurtd: " + refusal.message
    body = {"type": "error", "error": {"type": refusal.kind, "message": message}} \
        if api == "anthropic" else \
        {"error": {"message": message, "type": refusal.kind, "code": refusal.status}}
    data = json.dumps(body).encode()
    reason = http.HTTPStatus(refusal.status).phrase if refusal.status in \
        http.HTTPStatus._value2member_map_ else "Error"
    return (f"HTTP/1.1 {refusal.status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


@dataclass
class GatewayRequest:
    """A call as a task sent it."""

    method: str
    path: str
    headers: dict[str, str]          # names in lower case
    body: bytes


def recv_before(conn: socket.socket, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise GatewayRefusal(408, "timeout_error", "the request took longer than "
                             f"{GATEWAY_REQUEST_SECONDS:.0f} s to arrive")
    conn.settimeout(left)
    try:
        data = conn.recv(65536)
    except TimeoutError:
        return recv_before(conn, deadline)          # the deadline passed: refused there
    if not data:
        raise ConnectionError("the task hung up before its request was whole")
    return data


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """An HTTP/1.1 head (its blank line off) as its first line and its headers (names in lower
    case, the last of a repeated one); ValueError for a malformed header line."""
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError("a header line is malformed")
        headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def read_request(conn: socket.socket, deadline: float) -> GatewayRequest:
    """One HTTP/1.1 request from a task: its headers, then a body of Content-Length bytes,
    all within the deadline and the caps."""
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        if len(buf) > GATEWAY_MAX_HEADERS:
            raise GatewayRefusal(431, "invalid_request_error", "the request's headers are "
                                 f"over {GATEWAY_MAX_HEADERS} bytes")
        buf += recv_before(conn, deadline)
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    try:
        first, headers = parse_head(head)
    except ValueError as exc:
        raise GatewayRefusal(400, "invalid_request_error", str(exc)) from None
    parts = first.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise GatewayRefusal(400, "invalid_request_error", "not an HTTP/1.1 request")
    if "transfer-encoding" in headers:
        raise GatewayRefusal(411, "invalid_request_error", "send the body with Content-Length")
    length = headers.get("content-length", "0")
    if not is_digits(length):
        raise GatewayRefusal(400, "invalid_request_error", "Content-Length is not a number")
    if int(length) > GATEWAY_MAX_BODY:
        raise GatewayRefusal(413, "request_too_large", f"the request body is over "
                             f"{GATEWAY_MAX_BODY} bytes")
    body = bytearray(rest)
    while len(body) < int(length):
        body += recv_before(conn, deadline)
    return GatewayRequest(parts[0], parts[1], headers, bytes(body[:int(length)]))


def drain(conn: socket.socket) -> None:
    """After a refusal of a request not read to its end: the rest is read and dropped for a
    moment, so that the sender gets to read the refusal instead of a reset connection."""
    conn.shutdown(socket.SHUT_WR)
    deadline, left = time.monotonic() + 2.0, 4 * GATEWAY_MAX_BODY
    while left > 0 and time.monotonic() < deadline:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = conn.recv(1 << 16)
        except TimeoutError:
            return
        if not data:
            return
        left -= len(data)


def json_values_most(body: bytes) -> int:
    """How many values a JSON text holds at most: each but the first follows a `[`, `,` or
    `:` (those in strings counted too).  Counted in C, before json.loads makes each one an
    object of ~70 bytes (a body's memory bounded by its values, not its bytes)."""
    return 1 + body.count(b"[") + body.count(b",") + body.count(b":")


# What a call's body may not hold: what the model's own servers would do for the task (fetch
# or search the web, run code, call an MCP server at a URL) reaches hosts outside its grants,
# and costs what the answer's usage does not meter (a search is billed by the search).  A
# tool is the task's own (run by the agent inside the box): no type, or one of these.
GATEWAY_NOT_IN_BODY = {"anthropic": ("mcp_servers", "container"),
                       "chat-completions": ("web_search_options",)}
GATEWAY_OWN_TOOLS = {"anthropic": re.compile(r"custom|(bash|text_editor|computer|memory)_\d+"),
                     "chat-completions": re.compile(r"function|custom")}


def server_side(api: str, data: dict[str, Any]) -> str | None:
    """What of a call's body the upstream's servers would run for the task, or None."""
    for key in GATEWAY_NOT_IN_BODY[api]:
        if key in data:
            return key
    tools = data.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is not None and not (isinstance(kind, str) and
                                     GATEWAY_OWN_TOOLS[api].fullmatch(kind)):
            return f"a tool of type {printable(kind)[:60]}"
    return None


def header_text(value: Any, default: str) -> str:
    """An upstream's header value or reason phrase, safe to pass on in a header line."""
    text = str(value or "")
    return text if re.fullmatch(r"[\x20-\x7e]{1,200}", text) else default


def quick_ack(sock: socket.socket | None) -> None:
    """Acknowledge what arrives at once: on a kept-alive connection the kernel delays ACKs
    (up to 40 ms), and an upstream that writes an answer in pieces with Nagle on (a plain
    http.server) holds each piece until the last one is acknowledged.  Not sticky: again
    before each read."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


def upstream_head(api: str, base_url: str, key: str) -> bytes:
    """What each call of a task to its upstream begins with (made once per task): the request
    line, Host, the owner's key and the headers that are the same for every call."""
    scheme, host, port, prefix = upstream_url(base_url)
    path = prefix + ("/v1/messages" if api == "anthropic" else "/chat/completions")
    name = f"[{host}]" if ":" in host else host
    if port != (443 if scheme == "https" else 80):
        name += f":{port}"
    auth = f"x-api-key: {key}" if api == "anthropic" else f"Authorization: Bearer {key}"
    return (f"POST {path} HTTP/1.1\r\nHost: {name}\r\n{auth}\r\nContent-Type: application/json"
            f"\r\nAccept-Encoding: identity\r\nUser-Agent: gurtd/{VERSION}\r\n").encode()


class KeptReader(io.BufferedReader):
    """An upstream connection's one reader, kept from one answer to the next: http.client
    closes an answer's reader at the answer's end, and what this one holds past an answer
    must stay in sight (UpstreamConn.alive).  The socket's close ends it."""

    def close(self) -> None:
        pass


@dataclass(eq=False)
class UpstreamConn:
    """A connection to the upstream (TLS or plain): a request goes out in one write, and
    http.client reads its answer (HTTPResponse over the connection's kept reader: the head,
    the framing)."""

    sock: socket.socket
    since: float = 0.0               # when it was put back idle
    reader: KeptReader = field(init=False)

    def __post_init__(self) -> None:
        self.reader = KeptReader(socket.SocketIO(self.sock, "rb"))

    def makefile(self, mode: str) -> KeptReader:
        """What http.client.HTTPResponse reads the answer through."""
        return self.reader

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def alive(self) -> bool:
        """An idle connection may carry a call if nothing can be read on it: a close, a reset
        or a stray byte means the upstream is done with it (a call sent on it would be lost,
        or get another's answer)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return not poller.poll(0) and not self.held()

    def held(self) -> bool:
        """Whether a byte can be read without waiting: one the reader holds (or TLS has
        decrypted), else one the socket has."""
        try:
            self.sock.settimeout(0)
            try:
                return bool(self.reader.peek(1))
            finally:
                self.sock.settimeout(GATEWAY_READ_SECONDS)
        except ssl.SSLWantReadError:
            return False
        except OSError:                      # an error at hand: the next read says it
            return True

    def send(self, head: bytes, body: bytes) -> None:
        """A request in one write (a large body in a second one, not copied)."""
        if len(body) <= 1 << 16:
            self.sock.sendall(head + body)
        else:
            self.sock.sendall(head)
            self.sock.sendall(body)

    def answer(self) -> http.client.HTTPResponse:
        """The head of the answer to the request sent (a 100 Continue before it skipped)."""
        quick_ack(self.sock)
        answer = http.client.HTTPResponse(self, method="POST")   # type: ignore[arg-type]
        answer.begin()
        return answer

    def piece(self, answer: http.client.HTTPResponse) -> tuple[bytes, bool]:
        """The next part of the answer's body, its framing off (at most one read of the
        socket), and whether the body ended with it."""
        data = answer.read1(1 << 16)
        if not data and answer.length:
            raise http.client.IncompleteRead(b"", answer.length)   # cut short of its length
        return data, answer.isclosed() or answer.length == 0


class UpstreamPool:
    """Connections to the upstream kept alive from one call to the next, so that a call pays
    no TCP (or TLS) handshake; one TLS context (the system's CAs, verified) for them all.
    One idle past GATEWAY_IDLE_SECONDS is closed (sweep: at each take and put, and on the
    accept thread's timer), all of them when gurtd stops (close).  Any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: dict[tuple[str, str, int], list[UpstreamConn]] = {}
        self.context: ssl.SSLContext | None = None
        self.closed = False

    def take(self, where: tuple[str, str, int]) -> UpstreamConn | None:
        """An idle connection found alive, the latest put back first; None if there is none."""
        while True:
            with self.lock:
                idle = self.sweep(where)
                conn = idle.pop() if idle else None
            if conn is None or conn.alive():
                return conn
            conn.close()

    def connect(self, scheme: str, host: str, port: int) -> UpstreamConn:
        """A new connection, its handshake done; OSError if the upstream cannot be reached."""
        sock = socket.create_connection((host, port), timeout=GATEWAY_CONNECT_SECONDS)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # each write at once
            if scheme == "https":
                with self.lock:
                    self.context = self.context or ssl.create_default_context()
                sock = self.context.wrap_socket(sock, server_hostname=host)
            sock.settimeout(GATEWAY_READ_SECONDS)
        except BaseException:
            sock.close()
            raise
        return UpstreamConn(sock)

    def put(self, where: tuple[str, str, int], conn: UpstreamConn) -> None:
        """A connection whose answer was read to its end, for the next call."""
        conn.since = time.monotonic()
        with self.lock:
            if not self.closed:
                idle = self.idle.setdefault(where, [])
                self.sweep(where)
                if len(idle) < GATEWAY_IDLE:
                    idle.append(conn)
                    return
        conn.close()

    def sweep(self, where: tuple[str, str, int]) -> list[UpstreamConn]:
        """Under the lock: where's idle connections, those older than GATEWAY_IDLE_SECONDS
        closed (they are first: each is put back at the end)."""
        idle = self.idle.get(where, [])
        old = time.monotonic() - GATEWAY_IDLE_SECONDS
        while idle and idle[0].since < old:
            idle.pop(0).close()
        return idle

    def sweep_all(self) -> None:
        with self.lock:
            for where in list(self.idle):
                if not self.sweep(where):
                    del self.idle[where]

    def close(self) -> None:
        """gurtd stops: each idle connection closed, none kept from now on."""
        with self.lock:
            self.closed = True
            conns = [conn for idle in self.idle.values() for conn in idle]
            self.idle.clear()
        for conn in conns:
            conn.close()


@dataclass
class Hold:
    """A call held at the budget: the loop sets it once a person answers, or the task ends
    (reason: the whole refusal the call is answered with)."""

    event: threading.Event = field(default_factory=threading.Event)
    approved: bool = False
    reason: str = ""

    def answer(self, approved: bool, reason: str) -> None:
        self.approved, self.reason = approved, reason
        self.event.set()


@dataclass(eq=False)
class GatewayCall:
    """One call of a task through the gateway, from its accept to its log line."""

    conn: socket.socket
    started: float = field(default_factory=time.monotonic)
    upstream: socket.socket | None = None
    whole: bool = False              # its answer was read to the end: its connection is reusable
    model: str = ""
    status: int = 0
    usage: dict[str, int] | None = None
    note: str = ""
    cents: float | None = None       # what it cost, once its answer ended (reserve)
    posted: bool = False             # its record is on its way to the loop


@dataclass
class TaskGateway:
    """One task's way to its model: its credential, its listener, its calls in flight."""

    task_id: str
    token: str
    api: str                         # modelGateway's api and baseUrl when the task started
    base_url: str
    listener: socket.socket | None = None
    calls: set[GatewayCall] = field(default_factory=set)
    holds: list[Hold] = field(default_factory=list)
    dead: bool = False
    refused: int = 0                 # calls refused as too many at once (said once, counted)
    unsettled: float = 0.0           # cents of ended calls on their way to costCents
    where: tuple[str, str, int] = field(init=False)      # the upstream: scheme, host, port
    head: tuple[str, bytes] = ("", b"")   # the key and upstream_head made with it

    def __post_init__(self) -> None:
        self.where = upstream_url(self.base_url)[:3]


class Gateway:
    """The model gateway.  Loop thread: droid_spec, open, close, admit, answered, record.
    Gateway threads (the first started with the first task) take turns at accepting, one at
    a time (the leader); the leader that accepts a call hands the turn on and serves the call
    itself: reads it, asks the loop (admit) if need be, forwards it and tells the loop
    (record).  So no call waits for another thread to wake up."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.tasks: dict[str, TaskGateway] = {}
        self.lock = threading.Lock()     # running, idle, each TaskGateway's calls and refused
        self.running = 0                 # calls being served
        self.idle = 0                    # threads not serving: the leader and those waiting
        self.leader = threading.Lock()   # held by the thread whose turn it is to accept
        self.changes: list[tuple[bool, TaskGateway]] = []   # listeners to add (True) or drop
        self.selector: selectors.BaseSelector | None = None
        self.wake_r = self.wake_w = -1
        self.swept = 0.0                 # when the accept thread last swept the pool
        self.pool = UpstreamPool()
        self.key_text: str | None = None     # the owner's key once read (set_key changes it)

    # the owner's key
    @property
    def key_file(self) -> str:
        return self.box.path("secrets", "model-key")

    def key(self) -> str:
        """The owner's key: its file read once, then what set_key and delete_key leave (a call
        reads no file).  Any thread."""
        if self.key_text is None:
            try:
                with open(self.key_file) as f:
                    self.key_text = f.read().strip()
            except FileNotFoundError:
                self.key_text = ""
            except OSError:
                return ""
        return self.key_text

    def set_key(self, body: dict[str, Any]) -> dict[str, Any]:
        """PUT /api/secrets/model: the key, 0600 in BOX_HOME/secrets (0700); never answered."""
        key = body.get("key")
        if set(body) != {"key"} or not isinstance(key, str) or \
                not re.fullmatch(r"[\x21-\x7e]{1,4096}", key):
            raise ApiError(400, "the body must be {\"key\": \"...\"}: 1 to 4096 printable "
                                "characters, no spaces")
        with saved_or_507("model key"):
            secret_write(self.key_file, key)
        self.key_text = key
        log(6, "the model key was set (tasks started from now on use the gateway)")
        return self.secrets()

    def delete_key(self) -> dict[str, Any]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.key_file)
            log(6, "the model key was removed")
        self.key_text = ""
        return self.secrets()

    def stop(self) -> None:
        """gurtd stops (after its tasks ended): the upstream connections kept idle close."""
        self.pool.close()

    def secrets(self) -> dict[str, Any]:
        """What GET /api/secrets says: whether each secret is set, never the secret."""
        return {"model": {"set": bool(self.key())}}

    # loop thread: a task's start and end
    def droid_spec(self, task: Task, spec: dict[str, Any]) -> bool:
        """Point droid at the gateway, if the owner set a model key and not droidFactoryKey:
        its own credential in ~/.factory/settings.json, -m custom:gurtd-0.  Whether it did."""
        settings = self.box.setting()
        if settings["droidFactoryKey"] or not self.key():
            return False
        config = settings["modelGateway"]
        token = "gurtd-" + secrets.token_urlsafe(32)
        self.tasks[task.id] = TaskGateway(task.id, token, config["api"], config["baseUrl"])
        # droid adds /v1/messages to an anthropic baseUrl, /chat/completions to the other
        droid_settings = json.loads(spec["homeFiles"][".factory/settings.json"])
        spec["homeFiles"][".factory/settings.json"] = json.dumps({**droid_settings,
            "customModels": [{
                "model": gateway_models(settings)[0], "displayName": GATEWAY_MODEL_NAME,
                "baseUrl": f"http://{GATEWAY_ADDR}" + ("" if config["api"] == "anthropic" else
                                                       "/v1"),
                "apiKey": token, "provider": GATEWAY_APIS[config["api"]][1],
                "maxOutputTokens": config["maxOutputTokens"]}]}, indent=1)
        argv = spec["argv"]
        argv[argv.index("-m") + 1] = f"custom:{GATEWAY_MODEL_NAME}-0"
        spec["gateway"] = True
        return True

    def open(self, task_id: str, nsfd: int) -> None:
        """The task's listener, bound inside its network namespace."""
        tg = self.tasks.get(task_id)
        if tg is None:
            return

        def bind() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((GATEWAY_ADDR, GATEWAY_PORT))
            sock.listen(64)
            sock.setblocking(False)
            return sock
        tg.listener = in_netns(nsfd, bind)
        self.change(True, tg)

    def close(self, task_id: str) -> None:
        """The task ended: its credential is dead, held calls are refused, calls in flight
        are cut, its listener goes.  Idempotent."""
        tg = self.tasks.pop(task_id, None)
        if tg is None:
            return
        tg.dead = True
        for hold in tg.holds:
            hold.answer(False, "the task has ended")
        tg.holds.clear()
        with self.lock:       # a call's sockets leave it under the lock before they close
            refused = tg.refused
            for call in tg.calls:
                for sock in (call.conn, call.upstream):
                    if sock is not None:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
        if tg.listener is not None:
            self.change(False, tg)
        if refused:
            self.box.append_log(task_id, {"type": "model", "text": f"model calls refused as "
                                          f"too many at once: {refused}"})

    # loop thread: a call's budget and its cost
    def admit(self, task_id: str) -> Hold | None:
        """A call may go on (None), or waits for a person (a Hold): spending is at or past
        the budget, so the task pauses with a budget approval."""
        tg, task = self.tasks.get(task_id), self.box.task(task_id)
        worker = self.box.worker(task_id)
        if tg is None or task is None or worker is None or \
                task.state not in ("running", "waiting"):
            raise GatewayRefusal(403, "permission_error", "the task has ended")
        if task.costCents + tg.unsettled < worker.budget_limit:
            return None
        if worker.paused is None:
            self.box.droid.pause_for_budget(task, worker)
            if worker.paused is None:        # the approval could not be made: it failed
                raise GatewayRefusal(403, "permission_error", task.error or "budget exceeded")
        hold = Hold()
        tg.holds.append(hold)
        return hold

    def answered(self, task_id: str, approval: Approval) -> None:
        """The budget approval was answered: the held calls go on, or are refused with the
        person's reason."""
        tg = self.tasks.get(task_id)
        if tg is None:
            return
        for hold in tg.holds:
            hold.answer(approval.state == "approved", "the task's budget is spent and a "
                        f"person denied more: {approval.reason or 'denied'}")
        tg.holds.clear()

    def record(self, tg: TaskGateway, call: GatewayCall) -> None:
        """A call ended: its cost (the upstream's usage at droidPrices) into costCents, and
        its log line."""
        cents = self.reserve(tg, call)
        with self.lock:
            tg.unsettled -= cents
        task_id = tg.task_id
        task = self.box.task(task_id)
        usage = call.usage or {}
        if task is not None and cents > 0 and is_cents(task.costCents + cents):
            task.costCents += cents
            self.box.save(task, sync=False)
        ms = round((time.monotonic() - call.started) * 1000)
        tokens_in = sum(usage.get(k, 0) for k in ("input_tokens", "cache_read_input_tokens",
                                                  "cache_creation_input_tokens"))
        text = f"model call {call.model or '-'}: {tokens_in} tokens in, " \
               f"{usage.get('output_tokens', 0)} out, {cents:.4f} cents, {ms} ms, status " \
               f"{call.status}" + (f": {call.note}" if call.note else "") + \
               ("" if call.usage is not None or call.status != 200 else " (no usage)")
        log(6 if call.status == 200 else 4, f"task {task_id}: {text}")
        if task is not None:
            self.box.append_log(task_id, {"type": "model", "text": text, "model": call.model,
                                          "status": call.status, "ms": ms, "cents": cents,
                                          "usage": call.usage})

    def settle(self, tg: TaskGateway, call: GatewayCall) -> None:
        """The call's record to the loop, once."""
        if not call.posted:
            call.posted = True
            self.reserve(tg, call)
            self.post(self.record, tg, call)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop, no one waiting for it (its errors are logged there)."""
        def guarded(*args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                log(3, f"the model gateway's {fn.__name__}: {type(exc).__name__}: {exc}")
        with contextlib.suppress(OSError):
            self.box.loop.post(guarded, *args)

    def reserve(self, tg: TaskGateway, call: GatewayCall) -> float:
        """What the call cost, counted among the task's unsettled cents until the loop adds
        it to costCents (record): done before the answer's end goes to the task, so that
        the task's next call is weighed against it.  Once per call; any thread."""
        if call.cents is None:
            call.cents = usage_cents(call.usage or {},
                                     self.box.setting("droidPrices").get(call.model))
            with self.lock:
                tg.unsettled += call.cents
        return call.cents

    # the gateway threads
    def change(self, add: bool, tg: TaskGateway) -> None:
        with self.lock:
            self.changes.append((add, tg))
            if self.selector is None:
                self.selector = selectors.DefaultSelector()
                self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                self.selector.register(self.wake_r, selectors.EVENT_READ, None)
                self.idle += 1
                threading.Thread(target=self.calling, name="gateway", daemon=True).start()
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"c")

    def calling(self) -> None:
        """A gateway thread: its turn at accepting, then the call it accepted; it ends when
        more than GATEWAY_SPARE others are idle (a burst's threads go with it)."""
        while True:
            with self.leader:
                tg, call = self.accept_next()
            try:
                self.serve(tg, call)
            except Exception as exc:             # counted idle already: it must go on
                log(3, f"the model gateway's call thread: {type(exc).__name__}: {exc}")
            with self.lock:
                if self.idle > GATEWAY_SPARE:    # the others: a leader among them
                    self.idle -= 1
                    return

    def accept_next(self) -> tuple[TaskGateway, GatewayCall]:
        """The leader's rounds until it accepts a call: an error is logged, and it goes on."""
        while True:
            try:
                got = self.accept_round()
            except Exception as exc:
                log(3, f"the model gateway's accept thread: {type(exc).__name__}: {exc}")
                time.sleep(0.1)
                continue
            if got is not None:
                return got

    def accept_round(self) -> tuple[TaskGateway, GatewayCall] | None:
        """One wait for calls: the first accepted (the next leader finds the others still
        there), refusals said at once."""
        selector = self.selector
        assert selector is not None
        with self.lock:
            changes, self.changes = self.changes, []
        for add, tg in changes:
            assert tg.listener is not None
            if add and not tg.dead:
                selector.register(tg.listener, selectors.EVENT_READ, tg)
            elif not add:
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(tg.listener)
                tg.listener.close()
        for key, _ in selector.select(5.0):
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            elif key.data.listener is not None and not key.data.dead and \
                    (got := self.accept(key.data)):
                return got
        if time.monotonic() > self.swept + 1.0:     # idle upstream connections past their time
            self.swept = time.monotonic()
            self.pool.sweep_all()
        return None

    def accept(self, tg: TaskGateway) -> tuple[TaskGateway, GatewayCall] | None:
        """A call arrives: this thread's to serve (a new thread to accept if none is left
        waiting), or at once a refusal (too many at once)."""
        assert tg.listener is not None
        try:
            conn, _ = tg.listener.accept()
        except OSError:
            return None
        refusal = None
        with self.lock:
            if len(tg.calls) >= GATEWAY_TASK_CALLS:
                refusal = GatewayRefusal(429, "rate_limit_error", f"this task has "
                                         f"{GATEWAY_TASK_CALLS} model calls in flight already; "
                                         "wait for one to end")
            elif self.running >= GATEWAY_THREADS:
                refusal = GatewayRefusal(429, "rate_limit_error", "gurtd forwards "
                                         f"{GATEWAY_THREADS} model calls at once already")
            else:
                call = GatewayCall(conn)
                tg.calls.add(call)
                self.running += 1
                new = self.idle == 1         # this one: no other left to accept
                if not new:                  # threads: running + idle <= GATEWAY_THREADS + 1
                    self.idle -= 1
            if refusal is not None:
                tg.refused += 1
        if refusal is None:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # each chunk at once
                if new:
                    threading.Thread(target=self.calling, name="gateway", daemon=True).start()
                return tg, call
            except (OSError, RuntimeError) as exc:     # no thread to be had: the call's slot back
                with self.lock:
                    tg.calls.discard(call)
                    self.running -= 1
                    if not new:
                        self.idle += 1
                refusal = GatewayRefusal(503, "api_error", f"gurtd cannot take the call: {exc}")
        with contextlib.suppress(OSError):
            conn.send(refusal_answer(tg.api, refusal), socket.MSG_DONTWAIT)
        conn.close()
        return None

    # a gateway thread, serving the call it accepted

    def serve(self, tg: TaskGateway, call: GatewayCall) -> None:
        try:
            try:
                request = read_request(call.conn, time.monotonic() + GATEWAY_REQUEST_SECONDS)
                body = self.check(tg, request, call)
                self.wait_budget(tg)
                self.forward(tg, request, body, call)
            except GatewayRefusal as refusal:
                call.status, call.note = refusal.status, refusal.message
                call.conn.settimeout(5.0)
                call.conn.sendall(refusal_answer(tg.api, refusal))
                if refusal.status in (413, 431):
                    drain(call.conn)
        except OSError as exc:                   # the task hung up or stopped reading
            call.note = call.note or f"the task's connection: {exc}"
        except Exception as exc:
            call.status, call.note = call.status or 500, f"{type(exc).__name__}: {exc}"
            log(3, f"task {tg.task_id}: the model gateway failed: {call.note}")
        finally:
            self.reserve(tg, call)     # counted before the task hears the call ended
            with self.lock:
                tg.calls.discard(call)
                self.running -= 1
                self.idle += 1
            call.conn.close()
            self.settle(tg, call)

    def wait_budget(self, tg: TaskGateway) -> None:
        """Ask the loop whether the call may go on (unless the task is plainly under its
        budget, its unsettled cents counted: numbers read, which the loop alone writes but
        the cents); a held one waits for the person."""
        task, worker = self.box.task(tg.task_id), self.box.worker(tg.task_id)
        if task is not None and worker is not None and worker.paused is None and \
                task.costCents + tg.unsettled < worker.budget_limit and not tg.dead:
            return
        try:
            hold = self.box.loop.call(self.admit, tg.task_id)
        except ApiError as exc:                  # the loop is busy
            raise GatewayRefusal(429, "rate_limit_error", exc.message) from None
        while hold is not None and not hold.event.wait(1.0):
            if tg.dead:
                raise GatewayRefusal(403, "permission_error", "the task has ended")
        if hold is not None and not hold.approved:
            raise GatewayRefusal(403, "permission_error", hold.reason)

    def check(self, tg: TaskGateway, request: GatewayRequest, call: GatewayCall) -> bytes:
        """The call's own refusals (path, credential, body, model); the body to send on."""
        path = GATEWAY_APIS[tg.api][0]
        if request.method != "POST" or request.path.split("?")[0] != path:
            raise GatewayRefusal(404, "not_found_error", f"the model gateway answers POST "
                                 f"{path} only")
        given = request.headers.get("x-api-key") or \
            request.headers.get("authorization", "").removeprefix("Bearer ")
        if tg.dead or not hmac.compare_digest(given.encode(), tg.token.encode()):
            raise GatewayRefusal(401, "authentication_error", "not this task's credential")
        if json_values_most(request.body) > GATEWAY_MAX_VALUES:
            raise GatewayRefusal(413, "request_too_large", "the request body holds over "
                                 f"{GATEWAY_MAX_VALUES} JSON values")
        try:          # json.loads alone: only model and stream are read, never rendered
            data = json.loads(request.body, object_pairs_hook=unique_keys)
        except KeyTwice as exc:
            raise GatewayRefusal(400, "invalid_request_error", f"the body is refused: {exc} "
                                 "(the model's server might read another one than gurtd "
                                 "checked)") from None
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            raise GatewayRefusal(400, "invalid_request_error", "the body is not a JSON object")
        settings = self.box.setting()
        call.model = model = data.get("model") if isinstance(data.get("model"), str) else ""
        allowed = gateway_models(settings)
        if model not in allowed:
            call.model = ""
            raise GatewayRefusal(400, "invalid_request_error", f"model {printable(model)[:100]}"
                                 f" is not one the owner allows; allowed: {', '.join(allowed)}")
        if model not in settings["droidPrices"]:
            raise GatewayRefusal(400, "invalid_request_error", f"model {model} has no "
                                 "droidPrices entry: gurtd would not know what it costs")
        if not isinstance(data.get("stream", False), bool):   # a lax server's true, unmetered
            raise GatewayRefusal(400, "invalid_request_error", "stream must be true or false")
        if (served := server_side(tg.api, data)) is not None:
            raise GatewayRefusal(400, "invalid_request_error", f"{served}: the model's "
                                 "servers would run it, outside the task's grants and meter")
        if tg.api == "chat-completions" and data.get("stream") is True and \
                data.get("stream_options") != {"include_usage": True}:
            data["stream_options"] = {"include_usage": True}   # else a stream has no usage
            return json.dumps(data).encode()
        return request.body

    def forward(self, tg: TaskGateway, request: GatewayRequest, body: bytes,
                call: GatewayCall) -> None:
        """Send the call on with the owner's key; pass the answer back as it arrives (chunked),
        reading its usage on the way."""
        upstream, answer = self.request(tg, self.call_head(tg, request, len(body)), body, call)
        try:
            call.status = answer.status
            if 300 <= answer.status < 400:
                raise GatewayRefusal(502, "api_error", f"the model's server answered "
                                     f"{answer.status}, a redirect, which gurtd does not follow")
            self.pass_on(tg, upstream, answer, call)
        finally:
            self.upstream_done(tg, call, upstream, call.whole and not answer.will_close)

    def upstream_is(self, call: GatewayCall, upstream: UpstreamConn | None) -> None:
        """The upstream connection close may cut, set under the lock (close cuts under it)."""
        with self.lock:
            call.upstream = upstream.sock if upstream is not None else None

    def upstream_done(self, tg: TaskGateway, call: GatewayCall, upstream: UpstreamConn,
                      keep: bool) -> None:
        """The call is done with its upstream connection: kept for the next call, or closed;
        out of close's reach first, so close never cuts one kept or closed (its fd another's)."""
        self.upstream_is(call, None)
        if keep and not tg.dead:
            self.pool.put(tg.where, upstream)
        else:
            upstream.close()

    def call_head(self, tg: TaskGateway, request: GatewayRequest, length: int) -> bytes:
        """The head of the call to the upstream: the task's fixed part (made again only when
        the owner's key changed), then this call's own headers."""
        key = self.key()
        if not key:
            raise GatewayRefusal(503, "api_error", "the owner's model key is not set")
        made = tg.head
        if made[0] != key:
            made = tg.head = (key, upstream_head(tg.api, tg.base_url, key))
        headers = request.headers
        own = f"Accept: {header_text(headers.get('accept'), 'application/json')}\r\n"
        if tg.api == "anthropic":
            beta = header_text(headers.get("anthropic-beta"), "")
            own += "anthropic-version: " + header_text(headers.get("anthropic-version"),
                                                       "2023-06-01") + "\r\n" + \
                (f"anthropic-beta: {beta}\r\n" if beta else "")
        return made[1] + f"{own}Content-Length: {length}\r\n\r\n".encode()

    def request(self, tg: TaskGateway, head: bytes, body: bytes, call: GatewayCall
                ) -> tuple[UpstreamConn, http.client.HTTPResponse]:
        """The call sent on a kept-alive connection (one found alive), or a new one; and its
        answer's head.  Sent again, on a new one, only when the kept one broke while the
        request was being written: the upstream cannot act on a request it did not get
        whole.  Never once it went out whole: the upstream may have carried it out (and
        billed it), and a resend would spend twice, once unmetered."""
        upstream = self.pool.take(tg.where)
        try:
            if upstream is not None:
                try:
                    self.upstream_is(call, upstream)
                    upstream.send(head, body)
                except OSError:
                    self.upstream_done(tg, call, upstream, False)
                    if tg.dead:                      # cut by the task's end: not again
                        raise
                    upstream = None
            if upstream is None:
                upstream = self.pool.connect(*tg.where)
                self.upstream_is(call, upstream)
                upstream.send(head, body)
            return upstream, upstream.answer()
        except (OSError, http.client.HTTPException) as exc:
            if upstream is not None:
                self.upstream_done(tg, call, upstream, False)
            raise GatewayRefusal(504 if isinstance(exc, TimeoutError) else 502, "api_error",
                                 f"the model's server ({tg.where[1]}) could not be reached: "
                                 f"{type(exc).__name__}: {exc}") from None

    def pass_on(self, tg: TaskGateway, upstream: UpstreamConn,
                answer: http.client.HTTPResponse, call: GatewayCall) -> None:
        kind = header_text(answer.getheader("Content-Type"), "application/octet-stream")
        meter = UsageMeter(tg.api, "text/event-stream" in kind)
        retry = answer.getheader("Retry-After") or ""    # an upstream's 429 or 529 says when
        call.conn.settimeout(GATEWAY_READ_SECONDS)   # a task that stops reading
        head = f"HTTP/1.1 {answer.status} {header_text(answer.reason, 'Answer')}\r\n" \
               f"Content-Type: {kind}\r\nTransfer-Encoding: chunked\r\n" + \
               (f"Retry-After: {retry}\r\n" if is_digits(retry) else "") + \
               "Connection: close\r\n\r\n"
        try:
            self.pass_chunks(tg, upstream, answer, meter, call, head.encode())
        finally:                          # what a cut answer used was spent all the same
            call.usage = meter.result()

    def pass_chunks(self, tg: TaskGateway, upstream: UpstreamConn,
                    answer: http.client.HTTPResponse, meter: UsageMeter, call: GatewayCall,
                    head: bytes) -> None:
        """The body to the task as it arrives, one write for what came at once: the head
        goes with the first, the end with the last."""
        deadline, total, out = time.monotonic() + GATEWAY_CALL_SECONDS, 0, [head]
        quick_ack(upstream.sock)
        while True:
            try:
                data, ended = upstream.piece(answer)
            except (OSError, http.client.HTTPException) as exc:
                call.note = f"the model's answer broke off: {type(exc).__name__}: {exc}"
                break
            total += len(data)
            if total > GATEWAY_MAX_ANSWER or time.monotonic() > deadline:
                call.note = f"the answer was cut: over {GATEWAY_MAX_ANSWER} bytes or " \
                            f"{GATEWAY_CALL_SECONDS:.0f} s"
                break
            meter.feed(data)
            if data:
                out += [b"%x\r\n" % len(data), data, b"\r\n"]
            if ended:
                call.usage, call.whole = meter.result(), True
                self.reserve(tg, call)            # the task's next call weighs this cost
                call.conn.sendall(b"".join(out + [b"0\r\n\r\n"]))
                self.settle(tg, call)             # at once: before the task's next event
                return
            if not upstream.held():               # nothing more at hand: on to the task now
                call.conn.sendall(b"".join(out))
                out = []
                quick_ack(upstream.sock)          # the next read waits for the upstream
        if out:
            call.conn.sendall(b"".join(out))      # what came before the cut: the task sees it


# the owner's key: where secrets are kept, its HTTP handlers, and `gurtd secret` (the CLI
# section adds it to cli)

SECRETS_SCHEMA = {"type": "object", "required": ["model"], "properties": {"model": {
    "type": "object", "required": ["set"], "properties": {"set": {"type": "boolean"}},
    "description": "The owner's model key, which the gateway adds to droid's calls"}}}

def h_secrets_get(req: "Handler", params: dict[str, str]) -> Any:
    return 200, req.box.gateway.secrets()


h_secret_model_put = loop_handler(200, "gateway.set_key", body=True)
h_secret_model_delete = loop_handler(200, "gateway.delete_key")


@click.command("secret")          # the CLI section adds client_options and the command
@click.argument("name", type=click.Choice(["model"]))
@click.option("--delete", is_flag=True, help="remove it: droid tasks get no model key")
@click.option("--stdin", "from_stdin", is_flag=True, help="read it from standard input")
def cmd_secret(name: str, delete: bool, from_stdin: bool, box_home: str, listen: str) -> None:
    """Set the owner's model key (asked for, never shown): droid tasks then call their model
    through gurtd's gateway, which adds the key; no task ever sees it."""
    client = Client(listen, box_home)
    if delete:
        client.request("DELETE", f"/secrets/{name}")
        click.echo(f"the {name} key is removed")
        return
    key = sys.stdin.readline().strip() if from_stdin else \
        click.prompt(f"{name} key", hide_input=True).strip()
    client.request("PUT", f"/secrets/{name}", {"key": key})
    click.echo(f"the {name} key is set")


# Broker and approvals #########################################################################
###############################################################################################
# Tasks call tools through gurtd, never directly: an HTTP/JSON unix socket that each task sees
# at /run/gurt/broker.sock, where the caller is known by its uid (SO_PEERCRED), so no secret
# enters the box.  Spending above a task's budget, and every `ask`, become approvals: the task
# is `waiting` and the call waits until a person answers.  State changes run on the loop
# thread; the socket's handler threads wait for answers (and run executable tools) outside it.

BROKER_IN_BOX = "/run/gurt/broker.sock"
TOOLS_USER = "gurt-tools"                 # runs BOX_HOME/tools/<name>: not root, not a task
TOOL_TIMEOUT = 60.0
MAX_BROKER_BODY = 64 * 1024
# Caps: a task (one uid) holds at most MAX_BROKER_CONNS broker connections at once (beyond:
# 429 at once, no thread), of which at most MAX_PENDING_APPROVALS wait for a person; all tasks
# together at most MAX_BROKER_THREADS handler threads.
MAX_BROKER_CONNS = 32
MAX_PENDING_APPROVALS = 16
MAX_BROKER_THREADS = 256
# test-only: take the way of a kernel that cannot clone a detached mount (before 6.15)
NO_DETACHED_CLONE_ENV = "GURT_TEST_NO_DETACHED_CLONE"


class Broker:
    """Approvals, the wallet and the broker socket.  Methods named like the API's verbs run on
    the loop thread (through Box.call)."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.approvals: dict[str, Approval] = {}
        self.rendered: dict[str, tuple[str, str, str, bytes]] = {}
        self.staged: dict[str, Approval] = {}
        self.waiters: dict[str, Future[Approval]] = {}
        # The wallet: the ledger's lines, only ever appended to, and (balance, how many
        # lines) replaced whole after each, so that another thread reads a consistent
        # snapshot (wallet) and a payment costs no copy of the whole ledger.
        self.ledger: list[dict[str, Any]] = []
        self.book: tuple[float, int] = (0, 0)
        self.ledger_fd = -1       # wallet.jsonl, open for appends from the first one on
        self.servers: list[BrokerServer] = []
        self.mount_fd = -1        # the tmpfs of the socket tasks see (mount)
        self.attached = False     # that tmpfs is at attach_point in gurtd's namespace
        self.tools_ids = (0, 0)
        self.policies = Policies(box)

    @property
    def socket_path(self) -> str:
        return self.box.path("run", "broker.sock")

    @property
    def wallet(self) -> dict[str, Any]:
        """The balance and the ledger up to it, as one payment left them (any thread)."""
        balance, lines = self.book
        return {"balanceCents": balance, "ledger": self.ledger[:lines]}

    @property
    def attach_point(self) -> str:
        return self.box.path("run", "tasks")

    @property
    def box_socket(self) -> str:
        """The socket the workers bind (_broker_open), as the spawner's namespace has it."""
        return os.path.join(self.attach_point, "broker.sock") if self.attached \
            else self.socket_path

    def load(self) -> None:
        os.makedirs(self.box.path("approvals"), mode=0o700, exist_ok=True)
        folder_ensure(self.box.path("tools"), 0o755)
        folder_ensure(self.box.path("run"), 0o711)
        wallet = load_ledger(self.box.path("wallet.jsonl"))
        self.ledger, self.book = wallet["ledger"], (wallet["balanceCents"], len(wallet["ledger"]))
        self.policies.load()
        for name in sorted(os.listdir(self.box.path("approvals"))):
            if not name.endswith(".json"):
                continue
            approval = load_json(self.box.path("approvals", name), Approval.from_dict)
            if approval is None:
                continue
            self.approvals[approval.id] = approval
            self.render(approval)

    def mount(self) -> None:
        """The tmpfs of the socket tasks see: made detached (fsmount) before the spawner
        forks, which attaches it over BOX_HOME/run in a mount namespace of its own (Spawner),
        so that each worker, whose namespace is a copy of that one, binds the socket from it at
        BROKER_IN_BOX.  A socket cannot be copied and a bind's mountinfo line shows its path in
        its file system: there `/broker.sock` on a tmpfs, nothing of the host.  (A clone of the
        detached mount itself would do from 6.15 on; before, open_tree refuses a mount outside
        the caller's namespace, EINVAL.)  No other namespace has it: it ends with gurtd.
        Where the spawner has no namespace of its own (a private root) and the kernel refuses
        that clone, the tmpfs is attached in gurtd's namespace at attach_point, which every
        worker's namespace copies: the bind's line is still `/broker.sock` on the tmpfs.  It
        is unmounted at stop (unmount), a crash's at the next start."""
        folder_ensure(self.box.path("run"), 0o711)
        self.unmount()
        fs = syscall("fsopen", SYS_FSOPEN, b"tmpfs", 1)
        try:
            for key, value in ((b"source", b"gurt"), (b"mode", b"0755"), (b"size", b"64k")):
                syscall("fsconfig tmpfs", SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key, value, 0)
            syscall("fsconfig create", SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0)
            self.mount_fd = syscall("fsmount", SYS_FSMOUNT, fs, 1, MOUNT_ATTR_NOSUID |
                                    MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
        finally:
            os.close(fs)
        if not root_shared() and not self.clone_allowed():
            folder_ensure(self.attach_point, 0o755)
            syscall("move_mount", SYS_MOVE_MOUNT, self.mount_fd, b"", -100,
                    self.attach_point.encode(), MOVE_MOUNT_F_EMPTY_PATH)
            os.close(self.mount_fd)
            self.mount_fd, self.attached = -1, True

    def clone_allowed(self) -> bool:
        """Whether the kernel clones a mount of the detached tmpfs (Linux 6.15 and later)."""
        if os.environ.get(NO_DETACHED_CLONE_ENV):
            return False
        try:
            os.close(syscall("open_tree", SYS_OPEN_TREE, self.mount_fd, b"",
                             OPEN_TREE_CLONE | os.O_CLOEXEC | AT_EMPTY_PATH))
        except SysError as exc:
            if exc.code != errno.EINVAL:
                raise
            return False
        return True

    def unmount(self) -> None:
        """The tmpfs attached at attach_point, this start's or a crash's (mount)."""
        while os.path.ismount(self.attach_point):
            libc_call("umount2", self.attach_point.encode(), MNT_DETACH)
        self.attached = False

    def start(self) -> None:
        """Bind the broker socket twice (any local user may connect; only task uids are
        answered): in BOX_HOME/run for callers on the host, and on the tmpfs of mount, which
        gurtd reaches through its fd, for the tasks."""
        self.tools_ids = system_user_ensure(TOOLS_USER)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        callers = Counter(MAX_BROKER_CONNS, MAX_BROKER_THREADS)      # both sockets together
        for path in (self.socket_path, self.box_socket if self.attached
                     else f"/proc/self/fd/{self.mount_fd}/broker.sock"):
            self.servers.append(BrokerServer(path, self.box, callers))
            os.chmod(path, 0o666)
            threading.Thread(target=self.servers[-1].serve_forever, name="broker",
                             daemon=True).start()

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        self.servers = []
        for fd in (self.mount_fd, self.ledger_fd):
            if fd >= 0:
                os.close(fd)
        self.mount_fd = self.ledger_fd = -1
        for future in self.waiters.values():
            if not future.done():
                future.cancel()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def save(self, approval: Approval) -> None:
        write_json(self.box.path("approvals", approval.id + ".json"),
                   dataclasses.asdict(approval))
        self.render(approval)

    def render(self, approval: Approval) -> None:
        """The approval changed: published with the step's tasks (Box.publish)."""
        blocked = always_blocked(approval, self.box.setting("neverAutoApproveCents"))
        approval.canAlwaysApprove, approval.alwaysBlockedReason = blocked is None, blocked
        self.staged[approval.id] = approval

    def publish(self) -> None:
        """(createdAt, state, task, JSON) of each changed approval, for HTTP threads."""
        for approval in self.staged.values():
            self.rendered[approval.id] = (approval.createdAt, approval.state, approval.task,
                                          json.dumps(approval.to_api()).encode())
        self.staged.clear()

    def list_snapshot(self, state: str | None, task: str | None) -> bytes:
        """list() from the published snapshots, for HTTP threads."""
        rows = sorted(list(self.rendered.values()), key=lambda r: r[0], reverse=True)
        return b"[" + b", ".join(r[3] for r in rows if (state is None or r[1] == state) and
                                 (task is None or r[2] == task)) + b"]"

    # loop thread
    def get(self, approval_id: str) -> Approval:
        approval = self.approvals.get(approval_id) if isinstance(approval_id, str) else None
        if approval is None:
            raise ApiError(404, "No approval with this id", "not_found")
        return approval

    def task_of_uid(self, uid: int) -> Task | None:
        """The running or waiting task of a uid: one with a worker (no look at every task
        the box ever had, on each call)."""
        for worker in self.box.all_workers():
            task = self.box.task(worker.task_id)
            if task is not None and task.uid == uid and task.state in ("running", "waiting"):
                return task
        return None

    def begin_call(self, uid: int, tool: str, args: Any) -> dict[str, Any]:
        """Decide a call: run it now, or wait for a person (an approval); or refuse it."""
        task = self.task_of_uid(uid)
        if task is None:
            raise ApiError(403, "only a running task may call tools", "forbidden")
        call = new_call_id()
        entry: dict[str, Any] = {"type": "tool", "tool": tool, "args": args, "caller": uid,
                                 "call": call}
        if not isinstance(tool, str) or tool not in task.tools:
            self.box.append_log(task.id, {**entry, "error": "not granted to this task"})
            raise ApiError(403, f"the tool {tool} is not granted to this task",
                           "tool_not_allowed")
        if tool not in BUILTIN_TOOLS and not os.access(self.box.path("tools", tool), os.X_OK):
            self.box.append_log(task.id, {**entry, "error": "no such tool"})
            raise ApiError(404, f"no tool named {tool}", "not_found")
        try:
            cents = check_tool_args(tool, args)
        except ValueError as exc:
            self.box.append_log(task.id, {**entry, "error": str(exc)})
            raise ApiError(400, f"{tool}: {exc}") from None
        if tool == "ask" or (cents > 0 and task.costCents + cents > task.budgetCents
                             and self.policies.find(task, tool, cents) is None):
            waiting = sum(1 for a in self.approvals.values()
                          if a.task == task.id and a.state == "pending")
            if waiting >= MAX_PENDING_APPROVALS:
                self.box.append_log(task.id, {**entry, "error": "too many pending approvals"})
                raise ApiError(429, f"this task has {waiting} calls waiting for a person "
                                    f"already (at most {MAX_PENDING_APPROVALS}); wait for an "
                                    "answer first", "too_many_requests")
        if tool == "ask":
            return {**self.create(task, "ask", tool, args, 0, args["question"]), "call": call}
        if cents > 0 and task.costCents + cents > task.budgetCents:
            policy = self.policies.find(task, tool, cents)
            if policy is None:
                return {**self.create(task, "budget", tool, args, cents, None), "call": call}
            self.auto_approve(task, tool, args, cents, policy)
        if tool == "wallet.pay":   # paid here (and logged), in the same step as the budget check
            try:
                result = self.pay(task.id, args, call)
            except ApiError as exc:   # refused (a short balance, a full disk): logged too
                with contextlib.suppress(OSError):
                    self.box.append_log(task.id, {**entry, "error": exc.message})
                raise
            return {"task": task.id, "cents": cents, "result": result, "logged": True,
                    "call": call}
        return {"task": task.id, "cents": cents, "call": call}

    def create(self, task: Task, kind: str, tool: str, args: Any, cents: float,
               question: str | None) -> dict[str, Any]:
        approval = Approval(id=new_approval_id(), task=task.id, kind=kind, tool=tool, args=args,
                            cents=cents, question=question, state="pending",
                            createdAt=now_iso())
        # saved first: an approval that is not on disk is not in memory either
        with saved_or_507("approval"):
            self.save(approval)
        self.approvals[approval.id] = approval
        future: Future[Approval] = Future()
        self.waiters[approval.id] = future
        self.box.append_log(task.id, {"type": "approval", "approval": approval.id,
                                      "kind": kind, "tool": tool, "cents": cents})
        self.box.loop.emit("approval", approval.to_api())
        if task.state == "running":
            self.box.set_state(task, "waiting")
        return {"task": task.id, "cents": cents, "wait": approval.id, "future": future}

    def answer(self, approval_id: str, state: str, reason: str | None, answer: str | None,
               by: str = "api", extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Approve or deny (an ask is approved by its answer); 409 once answered.  extra: the
        record's decision fields (approvedArgs, budgetCents, policy), saved with the answer."""
        approval = self.get(approval_id)
        if approval.state != "pending":
            raise ApiError(409, f"the approval is {approval.state} already", "conflict")
        if approval.kind == "ask" and state == "approved" and answer is None:
            raise ApiError(409, 'an ask is answered with POST /api/approvals/{id}/answer',
                           "conflict")
        extra = extra or {}
        answered = dataclasses.replace(approval, state=state, reason=reason, answer=answer,
                                       answeredBy=by, answeredAt=now_iso(), **extra)
        # saved first: an answer that is not on disk is not given
        with saved_or_507("approval"):
            self.save(answered)
        approval.state, approval.reason, approval.answer = state, reason, answer
        approval.answeredBy, approval.answeredAt = by, answered.answeredAt
        for key, value in extra.items():
            setattr(approval, key, value)
        self.render(approval)
        self.box.loop.emit("approval", approval.to_api())
        task = self.box.task(approval.task)
        if task is not None:
            try:
                entry = {"type": "approval", "approval": approval.id, "state": state,
                         "reason": reason, "by": by}
                if approval.approvedArgs is not None:     # the log keeps both
                    entry.update(args=approval.approvedArgs, originalArgs=approval.args)
                for key in ("budgetCents", "policy"):
                    if getattr(approval, key) is not None:
                        entry[key] = getattr(approval, key)
                self.box.append_log(task.id, entry)
            except OSError as exc:   # the answer stands (it is saved); the waiter must hear it
                log(3, f"task {task.id}: the answer to {approval.id} is not in its log: {exc}")
        future = self.waiters.pop(approval.id, None)
        if future is not None and not future.done():
            future.set_result(approval)
        if approval.tool == "model":
            self.box.droid.on_model_approval(approval)
            if state == "denied":
                return approval.to_api()
        if approval.kind == "disk":
            self.box.disk.on_approval(approval)
        if approval.kind == "host":
            self.box.network.on_host_approval(approval)
        if approval.kind == "conflict":
            self.box.finish_merge.on_answer(approval)
        if by in ("api", "task") and task is not None and task.state == "waiting" and not any(
                a.task == task.id and a.state == "pending" for a in self.approvals.values()):
            self.box.set_state(task, "running")
        return approval.to_api()

    def withdraw(self, approval_id: str) -> None:
        """The task hung up the call that waits for this approval: denied by the task."""
        if self.approvals[approval_id].state == "pending":
            self.answer(approval_id, "denied", "withdrawn: the task cancelled the call", None,
                        "task")

    def approve_all(self, task: str | None) -> dict[str, Any]:
        """Approve every pending spending and host (of one task); skip, and count, what needs
        a person's own look: asks, disk approvals, calls above neverAutoApproveCents."""
        never = self.box.setting("neverAutoApproveCents")
        pending = [a for a in self.approvals.values() if a.state == "pending"
                   and (task is None or a.task == task)]
        approved, skipped = 0, 0
        for approval in sorted(pending, key=lambda a: a.createdAt):
            why = "an ask needs an answer" if approval.kind == "ask" else \
                "a conflict needs a person's own answer" if approval.kind == "conflict" else \
                "a disk approval is answered one by one" if approval.kind == "disk" else \
                f"above neverAutoApproveCents ({never})" if never is not None and \
                approval.cents > never and approval.tool != "model" else None
            if why is not None:
                skipped += 1
                log(6, f"approve-all skipped {approval.id}: {why}")
                continue
            self.answer(approval.id, "approved", None, None)
            approved += 1
        return {"approved": approved, "skipped": skipped}

    # decisions (policies live in their own section; this only wires them)
    def approve(self, approval_id: str, reason: str | None, args: Any = None,
                budget: float | None = None) -> dict[str, Any]:
        """Approve, as it is, with other arguments (checked like the originals), or by
        raising the task's budget to `budget` (a budget approval only)."""
        approval = self.get(approval_id)
        if approval.state != "pending":
            raise ApiError(409, f"the approval is {approval.state} already", "conflict")
        extra: dict[str, Any] = {}
        if args is not None and approval.kind == "conflict":
            conflict_answer(approval, args)          # 400 unless an answer to a conflict
            extra["approvedArgs"] = args
        elif args is not None:
            if approval.kind != "budget" or approval.tool == "model":
                raise ApiError(409, "only a pending tool call is approved with other args",
                               "conflict")
            try:
                check_tool_args(approval.tool, args)
            except ValueError as exc:
                raise ApiError(400, f"args: {approval.tool}: {exc}") from None
            extra["approvedArgs"] = args
        if budget is not None:
            self.raise_budget(approval, budget)
            extra["budgetCents"] = budget
        return self.answer(approval_id, "approved", reason, None, extra=extra)

    def raise_budget(self, approval: Approval, budget: float) -> None:
        """The task's budget becomes `budget`, enough for the call that asked (saved)."""
        task = self.box.task(approval.task)
        if approval.kind != "budget" or task is None:
            raise ApiError(409, "budgetCents answers a budget approval only", "conflict")
        need = task.costCents + (approval.cents if approval.tool != "model" else 0)
        if not is_cents(budget) or budget <= need or budget < task.budgetCents:
            raise ApiError(400, f"budgetCents must be a number above {need} (the task's cost "
                                "with this call) and not below its budget "
                                f"({task.budgetCents})")
        old, task.budgetCents = task.budgetCents, budget
        with saved_or_507("task"):
            self.box.save(task)
        worker = self.box.worker(task.id)
        if worker is not None:
            worker.budget_limit = max(worker.budget_limit, budget)
        self.box.append_log(task.id, {"type": "budget", "budgetCents": budget, "was": old,
                                      "approval": approval.id,
                                      "text": f"budget raised from {old} to {budget} cents"})
        self.box.loop.render(task)
        self.box.loop.emit("task", task.to_api())

    def always(self, approval_id: str, body: Any) -> dict[str, Any]:
        """Approve and record a policy {scope, maxCents?, totalCents?, expiresAt?, reason?}
        for calls like this one (the same tool, or the same host name)."""
        approval = self.get(approval_id)
        blocked = always_blocked(approval, self.box.setting("neverAutoApproveCents"))
        if blocked is not None:
            raise ApiError(409, f"cannot always-approve: {blocked}", "conflict")
        task = self.box.task(approval.task)
        if not isinstance(body, dict) or set(body) - {"scope", "reason", "maxCents",
                                                      "totalCents", "expiresAt"}:
            raise ApiError(400, 'the body must be {"scope": "task"|"workspace"|"box", '
                                '"reason"?, "maxCents"?, "totalCents"?, "expiresAt"?}')
        if task is None:
            raise ApiError(409, "the approval's task is gone", "conflict")
        scope = body.get("scope")
        fields = validate_policy_body({
            **body, "tool": approval.tool,
            **({"task": task.id} if scope == "task" else {}),
            **({"workspace": task.workspace} if scope == "workspace" else {}),
            **({"host": approval.args["name"]} if approval.kind == "host" else {})})
        trial = Policy(id="p000000000", createdAt=now_iso(), createdBy="check", **fields)
        why = policy_allows(trial, approval.cents, None)
        if why is not None:
            raise ApiError(400, f"the limits given would not allow this very call: {why}")
        policy = self.policies.add(fields, f"approval {approval.id}")
        if approval.cents:
            self.policies.use(policy, approval.cents)
        return self.answer(approval_id, "approved", body.get("reason"), None,
                           extra={"policy": policy.id})

    def auto_approve(self, task: Task, tool: str, args: Any, cents: float,
                     policy: Policy) -> None:
        """A call a policy allows: counted on the policy (saved first), then kept as an
        approved approval and logged with the policy's id."""
        self.policies.use(policy, cents)
        stamp = now_iso()
        approval = Approval(id=new_approval_id(), task=task.id, kind="budget", tool=tool,
                            args=args, cents=cents, question=None, state="approved",
                            createdAt=stamp, answeredBy="policy", answeredAt=stamp,
                            policy=policy.id)
        with saved_or_507("approval"):
            self.save(approval)
        self.approvals[approval.id] = approval
        self.box.append_log(task.id, {"type": "approval", "approval": approval.id,
                                      "kind": "budget", "tool": tool, "cents": cents,
                                      "state": "approved", "by": "policy",
                                      "policy": policy.id})
        self.box.loop.emit("approval", approval.to_api())

    def deny_pending(self, task_id: str, by: str, reason: str) -> None:
        for approval in list(self.approvals.values()):
            if approval.task == task_id and approval.state == "pending":
                self.answer(approval.id, "denied", reason, None, by)

    def drop_waiters(self, task_id: str, reason: str) -> None:
        """A task failed: no broker call of it may go on waiting.  Pending approvals that
        deny_pending could not answer are denied in memory; other waits are cancelled."""
        for approval_id, future in list(self.waiters.items()):
            approval = self.approvals.get(approval_id)
            if approval is None or approval.task != task_id:
                continue
            del self.waiters[approval_id]
            if approval.state == "pending":
                approval.state, approval.reason = "denied", reason
                approval.answeredBy, approval.answeredAt = "gurtd", now_iso()
                if not future.done():
                    future.set_result(approval)
            elif not future.done():
                future.cancel()

    def ledger_append(self, entry: dict[str, Any]) -> None:
        """One synced line holds a payment and the balance after it: all of it or none (a
        line cut short by a full disk is cut off again, and the error raised).  The file
        stays open: a payment costs its write and its fsync, no open and close."""
        if self.ledger_fd < 0:
            path = self.box.path("wallet.jsonl")
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fsync_dir(os.path.dirname(path))      # the file's name as durable as its lines
            except OSError:
                os.close(fd)
                raise
            self.ledger_fd = fd
        append_line(self.ledger_fd, (json.dumps(entry) + "\n").encode(), sync=True)
        self.ledger.append(entry)
        self.book = (entry["balanceAfterCents"], len(self.ledger))

    def pay(self, task_id: str, args: dict[str, Any], call: str) -> dict[str, Any]:
        """wallet.pay: the ledger line first (synced), then its cost, then the task's log
        line.  Both lines carry the call id: what a crash left out after the ledger line is
        repaired at the next start (recover_ledger)."""
        task = self.box.get(task_id)
        cents = args["cents"]
        balance = self.book[0]
        if balance < cents:
            raise ApiError(409, f"insufficient balance: the wallet has {balance} cents",
                           "insufficient_balance")
        entry = {"time": now_iso(), "task": task_id, "call": call, "to": args["to"],
                 "cents": args["cents"], "memo": args.get("memo"),
                 "balanceAfterCents": balance - cents}
        with saved_or_507("payment"):
            self.ledger_append(entry)
        crash_point("after-ledger")
        result = {"paid": True, "to": args["to"], "cents": args["cents"],
                  "balanceCents": entry["balanceAfterCents"]}
        try:
            self.add_paid(task, cents, call)
            self.box.append_log(task_id, {"type": "tool", "tool": "wallet.pay", "args": args,
                                          "caller": task.uid, "call": call, "result": result,
                                          "cents": cents})
            crash_point("after-payment-log")
        except OSError as exc:   # paid all the same: the next start logs it from the ledger
            log(3, f"payment {call} of task {task_id} is in the ledger, not in its log: {exc}")
            self.box.fail_task(task, cannot_save(exc))
        return result

    def add_paid(self, task: Task, cents: float, call: str) -> None:
        """A payment's cost, and its call as the last one costCents holds: the task's stored
        costCents holds its ledger's payments up to the stored paidCall, and recover_ledger
        adds the later ones.  So a payment needs no save of its own (a rename costs more
        than the ledger's fsync), but for the task's first: a file without paidCall is judged
        by its log lines, as gurtd did before it had the field, so it is saved before the
        payment's log line is written."""
        first = task.paidCall is None
        task.costCents += cents
        task.paidCall = call
        if first:
            self.box.save(task, sync=False)
        else:                  # on disk with the task's next save
            task.updatedAt = now_iso()
            self.box.loop.render(task)

    def recover_ledger(self) -> None:
        """At start: a payment whose ledger line has no log line of the same call (gurtd
        died between the two) gets its log line, marked recovered; one that the stored
        costCents does not hold (past paidCall; without it, one without a log line) is
        added to it."""
        by_task: dict[str, list[dict[str, Any]]] = {}
        for entry in self.ledger:
            if isinstance(entry.get("task"), str) and isinstance(entry.get("call"), str) \
                    and is_cents(entry.get("cents")):
                by_task.setdefault(entry["task"], []).append(entry)
        for task_id, entries in by_task.items():
            task = self.box.task(task_id)
            if task is None:
                continue
            try:
                with open(self.box.log_file(task_id), "rb") as f:
                    text = f.read()
            except FileNotFoundError:
                text = b""
            calls = [entry["call"] for entry in entries]
            held = calls.index(task.paidCall) + 1 if task.paidCall in calls else None
            logged = {c for c in calls if f'"call": "{c}"'.encode() in text}
            added = sum(e["cents"] for i, e in enumerate(entries)
                        if (i >= held if held is not None else e["call"] not in logged))
            if added:           # saved before the log lines, which without paidCall judge
                task.costCents, task.paidCall = task.costCents + added, calls[-1]
                self.box.save(task)
                log(4, f"task {task_id}: {added} cents of payments added to its cost")
            for entry in (e for e in entries if e["call"] not in logged):
                args = {"to": entry.get("to"), "cents": entry["cents"]}
                if entry.get("memo") is not None:
                    args["memo"] = entry["memo"]
                self.box.append_log(task_id, {
                    "type": "tool", "tool": "wallet.pay", "args": args, "call": entry["call"],
                    "result": {"paid": True, "to": entry.get("to"), "cents": entry["cents"],
                               "balanceCents": entry.get("balanceAfterCents")},
                    "cents": entry["cents"], "recovered": "from the ledger",
                    "text": "recovered from the ledger"})
                log(4, f"task {task_id}: payment {entry['call']} recovered from the ledger")

    def add_cost(self, task: Task, cents: float) -> None:
        if cents:   # the ledger, written first and synced, is what money is judged by
            task.costCents += cents
            self.box.save(task, sync=False)

    def record(self, task_id: str, entry: dict[str, Any], cost: float = 0) -> None:
        """Log a finished call (and add what an executable tool says it cost)."""
        task = self.box.task(task_id)
        if task is None:
            return
        try:
            if cost:
                self.add_cost(task, cost)
            self.box.append_log(task_id, entry)
        except OSError as exc:   # the task's own state: it fails, the caller hears of it
            self.box.fail_task(task, cannot_save(exc))
            raise

    def set_balance(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or set(body) != {"balanceCents"} or \
                not is_cents(body["balanceCents"]) or body["balanceCents"] < 0:
            raise ApiError(400, 'the body must be {"balanceCents": a number of at least 0}')
        entry = {"time": now_iso(), "set": body["balanceCents"],
                 "balanceAfterCents": body["balanceCents"]}
        with saved_or_507("wallet"):
            self.ledger_append(entry)
        return self.wallet

    def tools(self) -> list[dict[str, Any]]:
        out = [{"name": name, "kind": "builtin", "description": text}
               for name, text in BUILTIN_TOOLS.items()]
        for name in sorted(os.listdir(self.box.path("tools"))):
            path = self.box.path("tools", name)
            if TOOL_RE.fullmatch(name) and name not in BUILTIN_TOOLS and os.path.isfile(path) \
                    and os.access(path, os.X_OK):
                out.append({"name": name, "kind": "executable"})
        return out


def run_tool(box: "Box", name: str, args: Any, task_id: str) -> tuple[Any, float]:
    """An executable tool as the tools user: args on stdin, a JSON result on stdout."""
    uid, gid = box.broker.tools_ids
    try:
        proc = subprocess.run([box.path("tools", name)], input=json.dumps(args).encode(),
                              capture_output=True, timeout=TOOL_TIMEOUT, cwd="/", user=uid,
                              group=gid, extra_groups=[], start_new_session=True,
                              env={"PATH": TASK_PATH, "LANG": "C.UTF-8", "GURT_TASK": task_id,
                                   "GURT_TOOL": name}, preexec_fn=no_namespaces)
    except subprocess.TimeoutExpired:
        raise ApiError(504, f"the tool {name} took longer than {TOOL_TIMEOUT:.0f} s",
                       "tool_failed") from None
    except OSError as exc:
        raise ApiError(502, f"the tool {name} could not run: {exc}", "tool_failed") from None
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        raise ApiError(502, f"the tool {name} exited with {proc.returncode}" +
                       (f": {lines[-1]}" if lines else ""), "tool_failed")
    try:
        result = loads_bounded(proc.stdout)
    except ValueError:
        raise ApiError(502, f"the tool {name} did not print JSON", "tool_failed") from None
    cost = result.get("costCents", 0) if isinstance(result, dict) else 0
    if not is_cents(cost) or cost < 0:
        cost = 0
    return result, cost


class Counter:
    """Per-key counts under a lock, refusing past a cap per key and in all: how many handler
    threads a task holds (broker connections, log followers)."""

    def __init__(self, per_key: int, total: int = 1 << 30) -> None:
        self.per_key, self.total = per_key, total
        self.counts: dict[Any, int] = {}
        self.lock = threading.Lock()

    def enter(self, key: Any) -> bool:
        """Count one more for key; False (nothing counted) when over a cap."""
        with self.lock:
            if self.counts.get(key, 0) >= self.per_key or \
                    sum(self.counts.values()) >= self.total:
                return False
            self.counts[key] = self.counts.get(key, 0) + 1
            return True

    def leave(self, key: Any) -> None:
        with self.lock:
            self.counts[key] -= 1
            if not self.counts[key]:
                del self.counts[key]


def peer_uid(sock: socket.socket) -> int:
    """The uid of a unix socket's peer (SO_PEERCRED): who calls, with no secret needed."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class BrokerServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The broker socket: a thread per connection, at most MAX_BROKER_CONNS per task uid and
    MAX_BROKER_THREADS in all; a connection over a cap gets 429 at once, without a thread."""

    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        log_uncaught(*sys.exc_info(), thread="broker")    # type: ignore[arg-type]

    def __init__(self, path: str, box: "Box", callers: Counter) -> None:
        self.box = box
        self.callers = callers
        super().__init__(path, BrokerHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            uid = peer_uid(request)
        except OSError:
            self.shutdown_request(request)
            return
        if not self.callers.enter(uid):
            self.refuse(request, uid)
            return
        try:
            super().process_request(request, (uid, client_address))
        except BaseException:            # no thread to be had: this caller only
            self.callers.leave(uid)
            self.shutdown_request(request)
            log(4, f"broker: no thread for a call of uid {uid}")

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """client_address: (uid, address), as the handler gets it (the uid read once)."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.callers.leave(client_address[0])

    def refuse(self, request: socket.socket, uid: int) -> None:
        body = json.dumps({"error": f"too many broker connections of this task at once (at "
                           f"most {MAX_BROKER_CONNS})", "code": "too_many_requests"}).encode()
        try:
            request.settimeout(0.5)
            request.sendall(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json"
                            b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
                            + body)
        except OSError:
            pass
        self.shutdown_request(request)


class BrokerHandler(http.server.BaseHTTPRequestHandler):
    """POST /call {"tool", "args"} from inside a task; GET /tools lists the task's tools."""

    protocol_version = "HTTP/1.1"
    server_version = "gurtd-broker/" + VERSION
    sys_version = ""
    timeout = HANDLER_TIMEOUT
    server: BrokerServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def address_string(self) -> str:
        return "broker"

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        self.close_connection = True
        self.reply(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def reply(self, status: int, obj: Any) -> None:
        """The head and the body in one write (two would wake the caller twice)."""
        body = json.dumps(obj).encode()
        self.wfile.write((
            f"{self.protocol_version} {status} {self.responses.get(status, ('',))[0]}\r\n"
            f"Server: {self.version_string()}\r\nDate: {self.date_time_string()}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body)

    def peer_uid(self) -> int:
        """The caller's uid, as the server read it once for the connection."""
        return self.client_address[0]

    def do_GET(self) -> None:
        box = self.server.box
        try:
            if self.path.split("?")[0] != "/tools":
                raise ApiError(404, "no route; POST /call or GET /tools", "not_found")
            task = box.loop.call(box.broker.task_of_uid, self.peer_uid())
            if task is None:
                raise ApiError(403, "only a running task may call tools", "forbidden")
            self.reply(200, {"tools": task.tools})
        except ApiError as exc:
            self.reply(exc.status, {"error": exc.message, "code": exc.code})

    def wait_for_person(self, plan: dict[str, Any]) -> Approval | None:
        """The answer to the call's approval; None once the caller hangs up while it waits
        (an MCP client cancelled the call, `gurtd tool` got Ctrl-C): the approval is then
        withdrawn, denied by the task, so that nobody answers a call no one waits for."""
        future: Future[Approval] = plan["future"]
        while True:
            try:
                return future.result(timeout=0.5)
            except TimeoutError:
                pass
            if peer_gone(self.request):
                self.server.box.loop.call(self.server.box.broker.withdraw, plan["wait"])
                self.close_connection = True
                return None

    def do_POST(self) -> None:
        box = self.server.box
        uid = self.peer_uid()
        tool, args, task_id, call = None, None, None, None
        try:
            if self.path.split("?")[0] != "/call":
                raise ApiError(404, "no route; POST /call or GET /tools", "not_found")
            length = self.headers.get("Content-Length") or ""
            if not is_digits(length):
                raise ApiError(411, "send the body with Content-Length", "length_required")
            if int(length) > MAX_BROKER_BODY:
                self.close_connection = True
                self.reply(413, {"error": f"the call is larger than {MAX_BROKER_BODY} bytes",
                                 "code": "too_large"})
                Handler.linger(self)   # type: ignore[arg-type]  (the same socket dance)
                return
            try:
                body = loads_bounded(self.rfile.read(int(length)) or b"null")
            except ValueError as exc:
                raise ApiError(400, f"malformed JSON: {exc}") from None
            if not isinstance(body, dict) or not isinstance(body.get("tool"), str) or \
                    set(body) - {"tool", "args"}:
                raise ApiError(400, 'the body must be {"tool": "name", "args": {...}}')
            tool, args = body["tool"], body.get("args", {})
            plan = box.loop.call(box.broker.begin_call, uid, tool, args)
            task_id, call = plan["task"], plan["call"]
            if "wait" in plan:
                approval = self.wait_for_person(plan)
                if approval is None:        # the caller hung up: nobody to answer
                    return
                if approval.state != "approved":
                    raise ApiError(403, call_not_run(tool, approval), "rejected")
                if approval.approvedArgs is not None:     # approved with changes: these run
                    args = approval.approvedArgs
                    plan["cents"] = check_tool_args(tool, args)
                if tool == "ask":
                    result = {"answer": approval.answer}
                    box.loop.report(box.broker.record, task_id, {
                        "type": "tool", "tool": tool, "args": args, "caller": uid, "call": call,
                        "result": result, "cents": 0})
                    self.reply(200, {"result": result})
                    return
            if "result" in plan:
                result, cost = plan["result"], 0.0
            elif tool == "wallet.pay":   # pay logs its own line, with the call id
                result = box.loop.call(box.broker.pay, task_id, args, plan["call"])
                cost, plan["logged"] = 0.0, True
            else:
                result, cost = run_tool(box, tool, args, task_id)
            if not plan.get("logged"):
                box.loop.report(box.broker.record, task_id, {
                    "type": "tool", "tool": tool, "args": args, "caller": uid, "call": call,
                    "result": result, "cents": plan["cents"] or cost}, cost)
            self.reply(200, {"result": result})
        except ApiError as exc:
            if task_id is not None and exc.code != "tool_not_allowed":
                try:
                    box.loop.report(box.broker.record, task_id, {
                        "type": "tool", "tool": tool, "args": args, "caller": uid, "call": call,
                        "error": exc.message})
                except Exception:
                    pass
            self.reply(exc.status, {"error": exc.message, **({"code": exc.code} if exc.code
                                                              else {})})
        except CancelledError:
            self.reply(503, {"error": "gurtd is stopping", "code": "stopping"})


# Files in and out ##############################################################################
###############################################################################################
# A person puts files into a workspace through the API, and each upload lands as a layer of its
# own: a task with worker `upload` and source `api`, done at once, undone like any task.  The
# files are written into a staging folder under layers/ that nothing else reads or mounts,
# every tar member checked by us before tarfile (with its `data` filter, the second line) sees
# it: no name that climbs out or is absolute, no link that leaves the workspace, no device,
# FIFO or set-id bit, no member through a link or twice, sizes and counts capped.  Then the
# folder is owned by the store user (as a task's upper is), renamed into place and committed on
# the loop.  Archives go out as tar.gz streams, written from a walk by directory fds that
# follows no symlink, in the HTTP thread that asked.  A file with holes goes out as a sparse
# member (GNU tar's PAX 1.0 sparse format: a map of its data extents, found by SEEK_DATA and
# SEEK_HOLE, then their bytes; GNU tar, bsdtar and Python's tarfile read it; tarfile cannot
# write it): a 1 TiB file of holes was 1 TiB of zeros, three hours of a thread and a core.
# One with more than ARCHIVE_EXTENTS extents is left out, named in the archive's last member
# (SKIPPED_MEMBER) and gurtd's log.  An upload's sparse member counts at its full size, its
# map at most UPLOAD_MAX_EXTENTS entries (tarfile holds a map whole in memory).

UPLOAD_WORKER = "upload"              # the worker of an upload's task (never started)
UPLOAD_STAGING = ".upload-"           # layers/.upload-<random>: an upload being written
UPLOAD_MAX_MEMBERS = 100_000          # members of one archive
UPLOAD_MAX_PATH = 1024                # bytes of one member's name inside the workspace
UPLOAD_MAX_HEADER = 1 << 20           # a pax or GNU long-name header (tarfile reads it whole)
UPLOAD_CHUNK = 1 << 16
UPLOAD_MAX_EXTENTS = 1 << 16          # data extents of an uploaded sparse member
ARCHIVE_EXTENTS = 1 << 20             # ... of a file in an archive (16 MiB of offsets)
SKIPPED_MEMBER = ".gurt-skipped.txt"  # an archive's last member: the files left out, and why


class UploadRefused(Exception):
    """A tar member that is refused: the member's name and why."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.name, self.why = name, why


def upload_path(raw: str) -> str:
    """A member's name (or a PUT path) as a path inside the workspace; UploadRefused if it is
    absolute, climbs out with .., holds a NUL or is too long.  "" is the workspace's top."""
    if raw.startswith("/"):
        raise UploadRefused(raw, "an absolute name")
    if "\x00" in raw:
        raise UploadRefused(raw, "a NUL in the name")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UploadRefused(raw, "the name climbs out of the workspace (..)")
    rel = "/".join(parts)
    if len(rel.encode(errors="surrogateescape")) > UPLOAD_MAX_PATH or \
            any(len(p.encode(errors="surrogateescape")) > 255 for p in parts):
        raise UploadRefused(raw, f"the name is longer than {UPLOAD_MAX_PATH} bytes (or a part "
                                 "of it longer than 255)")
    return rel


def link_target_inside(rel: str, target: str) -> bool:
    """Whether a symlink at rel pointing at target stays inside the workspace, read as text:
    relative, and its .. never above the top."""
    if not target or target.startswith("/") or "\x00" in target:
        return False
    depth = rel.count("/")               # the folders rel is in
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in ("", "."):
            depth += 1
    return True


@dataclass
class UploadCheck:
    """What one archive's members have been so far: name -> kind, and the bytes and members
    admitted against the caps."""

    max_bytes: int
    room: int = LIMIT_MAX           # free bytes of BOX_HOME above its disk reserve
    inode_room: int = LIMIT_MAX     # free inodes of BOX_HOME above its inode reserve
    kinds: dict[str, str] = field(default_factory=dict)
    size: int = 0
    members: int = 0
    inodes: int = 0                 # what the members make (a hard link makes none)

    def admit(self, member: Any) -> str:
        """Check one tarfile.TarInfo before anything of it is written; its path, or
        UploadRefused naming it.  Pure: no file is looked at."""
        name = member.name
        rel = upload_path(name)
        self.members += 1
        if self.members > UPLOAD_MAX_MEMBERS:
            raise UploadRefused(name, f"more than {UPLOAD_MAX_MEMBERS} members")
        if member.ischr() or member.isblk():
            raise UploadRefused(name, "a device file")
        if member.isfifo():
            raise UploadRefused(name, "a FIFO")
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise UploadRefused(name, "not a file, folder or link")
        if member.mode & (stat.S_ISUID | stat.S_ISGID):
            raise UploadRefused(name, "a set-uid or set-gid bit")
        if member.sparse is not None and (len(member.sparse) > UPLOAD_MAX_EXTENTS or any(
                offset < 0 or length < 0 or offset + length > member.size
                for offset, length in member.sparse)):
            raise UploadRefused(name, "a sparse map of more than "
                                      f"{UPLOAD_MAX_EXTENTS} extents or outside its file")
        if not rel:
            if member.isdir():
                return rel                          # ./ itself: the top, nothing to write
            raise UploadRefused(name, "not a name of a file")
        parts = rel.split("/")
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            if self.kinds.get(above, "dir") != "dir":
                raise UploadRefused(name, f"goes through {above}, which is not a folder "
                                          "(a link or a file of the archive)")
        if rel in self.kinds:
            raise UploadRefused(name, "appears twice in the archive")
        if member.issym() and not link_target_inside(rel, member.linkname):
            raise UploadRefused(name, f"a link that leaves the workspace ({member.linkname})")
        if member.islnk():
            try:
                target = upload_path(member.linkname)
            except UploadRefused:
                target = ""
            if self.kinds.get(target) != "file":
                raise UploadRefused(name, "a hard link to something that is not a file "
                                          f"earlier in the archive ({member.linkname})")
            member.linkname = target
        if member.size < 0 or member.size > self.max_bytes - self.size:
            raise UploadRefused(name, f"the files are larger than {self.max_bytes} bytes "
                                      "(uploadMaxBytes)")
        self.size += member.size if member.isreg() else 0
        self.inodes += 0 if member.islnk() else 1
        if self.size > self.room or self.inodes > self.inode_room:
            raise ApiError(507, f"the files would eat into BOX_HOME's disk reserve (they reach "
                                f"{self.size} bytes and {self.inodes} inodes at {name})",
                           "insufficient_storage")
        self.kinds[rel] = "dir" if member.isdir() else "link" if member.issym() else "file"
        member.name = rel
        return rel


def bounded_tarinfo() -> Any:
    """tarfile.TarInfo that refuses a pax or GNU long-name header larger than
    UPLOAD_MAX_HEADER: tarfile reads such a header into memory whole, so a gzip of a few
    kilobytes could otherwise ask for gigabytes.  A sparse member's map (GNU tar's old
    format: header blocks; PAX 1.0: lines before the data), also read whole into a list, is
    refused past UPLOAD_MAX_EXTENTS entries: tarfile reads them the same way, unbounded."""
    import tarfile

    def too_many(name: str) -> UploadRefused:
        return UploadRefused(name, f"a sparse file of more than {UPLOAD_MAX_EXTENTS} extents")

    class BoundedTarInfo(tarfile.TarInfo):
        def _proc_member(self, tarfile_: Any) -> Any:
            if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK,
                             tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) \
                    and self.size > UPLOAD_MAX_HEADER:
                raise UploadRefused(self.name or "(a header)",
                                    f"a header larger than {UPLOAD_MAX_HEADER} bytes")
            return super()._proc_member(tarfile_)

        def _proc_sparse(self, tarfile_: Any) -> Any:
            """tarfile's own, bounded: the extension blocks of 21 entries each."""
            structs, more, size = self._sparse_structs
            while more:
                if len(structs) > UPLOAD_MAX_EXTENTS:
                    raise too_many(self.name)
                buf = tarfile_.fileobj.read(tarfile.BLOCKSIZE)
                if len(buf) < tarfile.BLOCKSIZE:
                    raise tarfile.ReadError("a sparse member's header cut short")
                for pos in range(0, 21 * 24, 24):
                    try:
                        entry = (tarfile.nti(buf[pos:pos + 12]),
                                 tarfile.nti(buf[pos + 12:pos + 24]))
                    except ValueError:
                        break
                    if entry[0] and entry[1]:
                        structs.append(entry)
                more = bool(buf[504])
            self.sparse = structs
            self.offset_data = tarfile_.fileobj.tell()
            tarfile_.offset = self.offset_data + self._block(self.size)
            self.size = size
            return self

        def _proc_gnusparse_10(self, next_: Any, pax: Any, tarfile_: Any) -> None:
            """tarfile's own, bounded: the count, then a line per number, in whole blocks."""
            try:
                count, buf = tarfile_.fileobj.read(tarfile.BLOCKSIZE).split(b"\n", 1)
                if int(count) > UPLOAD_MAX_EXTENTS:
                    raise too_many(next_.name)
                numbers: list[int] = []
                while len(numbers) < 2 * int(count):
                    if b"\n" not in buf:
                        more = tarfile_.fileobj.read(tarfile.BLOCKSIZE)
                        if not more or len(buf) > 64:
                            raise ValueError("a sparse map cut short or not numbers")
                        buf += more
                    number, buf = buf.split(b"\n", 1)
                    numbers.append(int(number))
            except ValueError as exc:
                raise tarfile.InvalidHeaderError(f"a sparse map that cannot be read: {exc}") \
                    from None
            next_.offset_data = tarfile_.fileobj.tell()
            next_.sparse = list(zip(numbers[::2], numbers[1::2]))
    return BoundedTarInfo


def extract_member(tar: Any, member: Any, upper: str) -> None:
    """Write one member that UploadCheck admitted, with tarfile's `data` filter as a second
    line.  Python 3.11 has that filter from 3.11.4 only (Debian 12 ships 3.11.2), so its core
    is also done here: the member, and a link's target, must resolve inside upper on disk,
    no set-id bit, no owner taken from the archive (the store user gets the tree after)."""
    import tarfile
    top = os.path.realpath(upper)
    where = os.path.realpath(os.path.join(upper, os.path.dirname(member.name)))
    inside = where == top or where.startswith(top + os.sep)
    if member.issym():
        target = os.path.realpath(os.path.join(where, member.linkname))
        inside = inside and (target == top or target.startswith(top + os.sep))
    if not inside:
        raise UploadRefused(member.name, "it would be written outside the upload")
    member.mode &= 0o777
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    if hasattr(tarfile, "data_filter"):
        tar.extract(member, upper, set_attrs=True, numeric_owner=True, filter="data")
    else:
        tar.extract(member, upper, set_attrs=True, numeric_owner=True)


class BodyStream(io.RawIOBase):
    """The request's body, read as it comes and never past its Content-Length; what is read
    is taken off the handler's body_left, so keep-alive stays in step.  Each read counts
    against a cap (the decompressed bytes of an archive are counted by another one)."""

    def __init__(self, req: "Handler") -> None:
        super().__init__()
        self.req = req

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.req.body_left
        if left <= 0:
            return 0
        self.req.body_left = -1             # a short read leaves it unknown
        data = self.req.rfile.read(min(len(buffer), left, UPLOAD_CHUNK))
        if not data:
            raise ApiError(400, "the body ended early")
        self.req.body_left = left - len(data)
        buffer[:len(data)] = data
        return len(data)


class CappedReader(io.RawIOBase):
    """A reader that gives at most cap bytes and then refuses (a gzip bomb stops here)."""

    def __init__(self, inner: Any, cap: int) -> None:
        super().__init__()
        self.inner, self.left, self.cap = inner, cap, cap

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.inner.read(min(len(buffer), UPLOAD_CHUNK))
        self.left -= len(data)
        if self.left < 0:
            raise ApiError(413, f"the archive unpacks to more than {self.cap} bytes "
                                "(uploadMaxBytes)", "too_large")
        buffer[:len(data)] = data
        return len(data)


def upload_length(req: "Handler") -> int:
    """The body's length, checked against uploadMaxBytes (413, and the connection closes
    without reading it) and BOX_HOME's disk reserve (507)."""
    box = req.box
    if req.body_left < 0:
        raise req.body_error()
    cap = box.setting("uploadMaxBytes")
    if req.body_left > cap:
        req.body_left = -1
        raise ApiError(413, f"the body is larger than {cap} bytes (uploadMaxBytes)",
                       "too_large")
    free, reserve = box.disk.free_and_reserve()
    if free - req.body_left < reserve:
        raise ApiError(507, f"BOX_HOME has {free} bytes free and keeps {reserve} in reserve "
                            "(diskReserveBytes)", "insufficient_storage")
    return req.body_left


@contextlib.contextmanager
def upload_staging(box: "Box") -> Iterator[str]:
    """A new layer folder (upper and work, owned by the store user) under layers/ that only
    this upload writes; removed unless committed (renamed away) by the end."""
    staging = box.path("layers", UPLOAD_STAGING + secrets.token_hex(8))
    for sub in ("", "upper", "work"):
        os.mkdir(os.path.join(staging, sub), 0o755)
        os.chown(os.path.join(staging, sub), *box.store_owner())
    try:
        yield staging
    finally:
        if os.path.lexists(staging):
            tree_remove(staging)


def upload_leftovers_remove(layers: str) -> list[str]:
    """At start: staging folders of uploads a crash cut short (never a committed layer)."""
    removed = []
    for name in os.listdir(layers):
        if name.startswith(UPLOAD_STAGING):
            tree_remove(os.path.join(layers, name))
            removed.append(name)
    return removed


def view_entry(view: int, rel: str) -> os.stat_result | None:
    """What the view has at rel (a link itself, not what it points at), or None: missing, or
    beneath a link (the link is met first, as the walk goes down)."""
    try:
        fd = open_beneath(view, rel, os.O_PATH | os.O_NOFOLLOW)
    except SysError:
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def upload_finish(box: "Box", workspace: str, upper: str, explicit: set[str]) -> None:
    """Check the written tree against the view and give it to the store user, as a task's
    upper is on disk.  A folder where the view has a file or a link (or the reverse) is a 409:
    the layer would hide it silently.  A folder the archive did not describe gets the mode of
    the folder it lies over (as a copy-up would), else 0755; set-id bits never survive."""
    def finish(dir_fd: int, name: str, st: os.stat_result, parents: list[str]) -> None:
        rel = "/".join([*parents, name])
        below = view_entry(view, rel)
        if below is not None and stat.S_ISDIR(below.st_mode) != stat.S_ISDIR(st.st_mode):
            there = "a folder" if stat.S_ISDIR(below.st_mode) else \
                "a link" if stat.S_ISLNK(below.st_mode) else "a file"
            raise ApiError(409, f"{rel}: the workspace has {there} there; the upload "
                                "would hide it (undo or change it with a task first)",
                           "conflict")
        os.chown(name, *box.store_owner(), dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            return
        mode = stat.S_IMODE(st.st_mode) & ~SETID_BITS
        if stat.S_ISDIR(st.st_mode) and rel not in explicit:
            mode = stat.S_IMODE(below.st_mode) & ~SETID_BITS if below else 0o755
        os.chmod(name, mode, dir_fd=dir_fd)    # not a link, and nothing else writes here

    view = box.loop.call(box.views.view_fd, workspace)
    try:
        tree_visit(upper, finish, folders=True)
    finally:
        os.close(view)


def workspace_named(box: "Box", name: str) -> str:
    """name, if a workspace has it; else 404."""
    if not box.views.workspace_exists(name):
        raise ApiError(404, f"no workspace named {name}", "not_found")
    return name


def upload_commit(box: "Box", workspace: str, staging: str, title: str, prompt: str,
                  summary: str) -> dict[str, Any]:
    """On the loop: the staged layer becomes a done task of worker upload on top of the
    workspace's stack (Box.add_task)."""
    task = box.add_task({"title": title, "prompt": prompt,
                         "workspace": workspace_named(box, workspace),
                         "worker": UPLOAD_WORKER, "tools": [], "hosts": [], "budgetCents": 0,
                         "source": "api", "summary": summary}, staging)
    log(6, f"task {task.id} done: an upload into {workspace}: {summary}")
    return task.to_api()


class ExactReader:
    """A file's first size bytes, padded with zeros if it shrank meanwhile: a tar member's
    length is written before its data."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.left = f, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n) or b""
        data += b"\0" * (n - len(data))
        self.left -= n
        return data


class TooFragmented(Exception):
    """A file with more data extents than an archive takes (ARCHIVE_EXTENTS)."""


def data_extents(fd: int, st: os.stat_result) -> array.array[int] | None:
    """A file's data extents (offset, length, offset, length...) when it has holes, by
    SEEK_DATA and SEEK_HOLE; None when it has none (or its file system cannot say)."""
    if st.st_blocks * 512 >= st.st_size:
        return None                          # a block for every byte: no hole
    out, pos = array.array("q"), 0
    try:
        while pos < st.st_size:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            pos = min(os.lseek(fd, start, os.SEEK_HOLE), st.st_size)
            if start >= pos:
                break
            out.extend((start, pos - start))
            if len(out) > 2 * ARCHIVE_EXTENTS:
                raise TooFragmented(f"more than {ARCHIVE_EXTENTS} data extents")
    except OSError as exc:
        if exc.errno != errno.ENXIO:         # ENXIO: only a hole from pos to the end
            return None
    return None if len(out) == 2 and out[0] == 0 and out[1] == st.st_size else out


class SparseReader:
    """A sparse member's data, as tarfile reads it (n bytes a read): the map, then each
    extent's bytes by pread, zeros where the file shrank since (its length is written first)."""

    def __init__(self, fd: int, head: bytes, extents: array.array[int]) -> None:
        self.fd, self.head, self.extents = fd, memoryview(head), extents
        self.at, self.i, self.pos = 0, 0, 0       # in the head; extent index, offset in it

    def read(self, n: int) -> bytes:
        parts = [bytes(self.head[self.at:self.at + n])]
        self.at += len(parts[0])
        left = n - len(parts[0])
        while left and self.i < len(self.extents):
            offset, length = self.extents[self.i], self.extents[self.i + 1]
            take = min(left, length - self.pos)
            data = os.pread(self.fd, take, offset + self.pos) if take else b""
            parts.append(data + b"\0" * (take - len(data)))
            left, self.pos = left - take, self.pos + take
            if self.pos >= length:
                self.i, self.pos = self.i + 2, 0
        return b"".join(parts)


def sparse_member(info: Any, fd: int, size: int, extents: array.array[int]) -> SparseReader:
    """info made GNU tar's PAX 1.0 sparse member of a file of size with these data extents
    (its stored name GNUSparseFile.0/..., as GNU tar writes it; the real name in the pax
    header, after path, so that a reader takes it); its data."""
    if not extents or extents[-2] + extents[-1] < size:
        extents.extend((size, 0))              # ends in a hole: the size, as GNU tar marks it
    count = len(extents) // 2
    text = f"{count}\n".encode() + b"".join(b"%d\n%d\n" % (extents[i], extents[i + 1])
                                           for i in range(0, len(extents), 2))
    head = text + b"\0" * (-len(text) % 512)
    real = info.name
    parent, name = os.path.split(real)
    info.name = os.path.join(parent, "GNUSparseFile.0", name)
    info.pax_headers = {"path": info.name, "GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                        "GNU.sparse.name": real, "GNU.sparse.realsize": str(size)}
    info.size = len(head) + sum(extents[1::2])
    return SparseReader(fd, head, extents)


def _archive_file(tar: Any, info: Any, f: Any, skipped: list[str]) -> os.stat_result | None:
    """A regular file into the archive (sparse when it has holes); its fstat, or None if it
    is not one after all or was left out (too fragmented: said in skipped)."""
    fst = os.fstat(f.fileno())
    if not stat.S_ISREG(fst.st_mode):
        return None
    try:
        extents = data_extents(f.fileno(), fst)
    except TooFragmented as exc:
        skipped.append(f"{info.name}: {exc} (left out)")
        return None
    if extents is None:
        info.size = fst.st_size
        tar.addfile(info, ExactReader(f, fst.st_size))
    else:
        tar.addfile(info, sparse_member(info, f.fileno(), fst.st_size, extents))
    return fst


def archive_write(out: Any, top: int) -> int:
    """A tar.gz of everything below the directory fd top, written to out; the members written.
    Devices and FIFOs never go in (nor a layer's whiteouts, which are devices), nor set-id
    bits; owners are left out (uid and gid 0); a file's data goes in once, its other names
    as hard links to the first; a file with holes as a sparse member."""
    import gzip
    import tarfile
    count = 0
    linked: dict[tuple[int, int], str] = {}   # a file of several names -> its first name
    skipped: list[str] = []                   # files left out, and why

    def add(dir_fd: int, name: str, st: os.stat_result, parents: list[str]) -> None:
        nonlocal count
        rel = "/".join([*parents, name])
        info = tarfile.TarInfo(rel)
        info.mode = stat.S_IMODE(st.st_mode) & ~SETID_BITS
        info.mtime = int(st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dir_fd)
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in linked:
            # a hard link goes out as one: a task's file of 10,000 names is not 10,000
            # copies of its data (the archive would be 10,000 times its size)
            info.type, info.linkname = tarfile.LNKTYPE, linked[(st.st_dev, st.st_ino)]
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                             os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                return
            with os.fdopen(fd, "rb") as f:
                fst = _archive_file(tar, info, f, skipped)
                if fst is None:
                    return
                if fst.st_nlink > 1 and (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                    linked[(st.st_dev, st.st_ino)] = rel
        else:
            return              # a whiteout of a layer, a FIFO, a device: not a file
        count += 1

    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tree_visit(top, add, folders=True)
        if skipped:
            text = "".join(f"{line}\n" for line in skipped).encode(errors="surrogateescape")
            note = tarfile.TarInfo(SKIPPED_MEMBER)
            note.size, note.mode = len(text), 0o644
            tar.addfile(note, io.BytesIO(text))
            log(4, f"archive: {len(skipped)} files left out ({skipped[0]})")
    return count


def send_archive(req: "Handler", top: int, filename: str) -> None:
    """200 and the tar.gz of the folder fd top (closed after), streamed (its length is not
    known: the connection closes after)."""
    try:
        send_stream_head(req, "application/gzip",
                         ("Content-Disposition", f'attachment; filename="{filename}"'))
        if req.command != "HEAD":
            archive_write(req.wfile, top)
    except OSError as exc:      # the answer has begun: all that is left is to cut it short
        if not isinstance(exc, (ConnectionError, BrokenPipeError)):
            log(3, f"archive {filename}: {exc}")
    finally:
        os.close(top)


def h_workspace_put_file(req: "Handler", params: dict[str, str]) -> Any:
    """PUT a file: the body is its content, a layer of its own (201: the upload's task)."""
    box, name = req.box, workspace_named(req.box, params["name"])
    try:
        rel = upload_path(clean_relpath(params.get("path", "")))
    except UploadRefused as exc:
        raise ApiError(400, f"{exc.name}: {exc.why}") from None
    if not rel:
        raise ApiError(400, "name the file: PUT /api/workspaces/{name}/files/PATH")
    length = upload_length(req)
    parts = rel.split("/")
    with upload_staging(box) as staging:
        upper = os.path.join(staging, "upper")
        with saved_or_507("upload"):
            os.makedirs(os.path.join(upper, *parts[:-1]), 0o755, exist_ok=True)
            fd = os.open(os.path.join(upper, *parts), os.O_WRONLY | os.O_CREAT | os.O_EXCL |
                         os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "wb") as f:
                shutil.copyfileobj(BodyStream(req), f, UPLOAD_CHUNK)
            upload_finish(box, name, upper, {rel})
        return 201, box.loop.call(upload_commit, box, name, staging, f"put {rel}",
                             f"PUT /api/workspaces/{name}/files/{rel}",
                             f"{rel}: {length} bytes")


def h_workspace_upload(req: "Handler", params: dict[str, str]) -> Any:
    """POST a tar archive (plain or gzip): its members land as one layer (201: the task)."""
    import gzip
    import tarfile
    import zlib
    box, name = req.box, workspace_named(req.box, params["name"])
    upload_length(req)
    free, reserve = box.disk.free_and_reserve()
    check = UploadCheck(box.setting("uploadMaxBytes"), free - reserve, box.disk.inode_room())
    body = io.BufferedReader(BodyStream(req), UPLOAD_CHUNK)
    source: Any = body
    if body.peek(2)[:2] == b"\x1f\x8b":
        source = gzip.GzipFile(fileobj=body, mode="rb")
    # the members' data within the cap, plus their headers (a bounded number, each bounded)
    capped = CappedReader(source, check.max_bytes + (64 << 20))
    with upload_staging(box) as staging:
        upper = os.path.join(staging, "upper")
        try:
            with saved_or_507("upload"), \
                    tarfile.open(fileobj=capped, mode="r|", tarinfo=bounded_tarinfo()) as tar:
                for member in tar:
                    check.admit(member)
                    if member.name:
                        extract_member(tar, member, upper)
        except UploadRefused as exc:
            raise ApiError(400, f"refused member {json.dumps(exc.name)}: {exc.why}") from None
        except getattr(tarfile, "FilterError", UploadRefused) as exc:   # the second line
            raise ApiError(400, f"refused member: {exc}") from None
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ApiError(400, f"not a tar archive (plain or gzip): {exc}") from None
        except OSError as exc:                       # not the disk's: saved_or_507 above
            raise ApiError(400, f"cannot unpack the archive: {exc}") from None
        if not check.kinds:
            raise ApiError(400, "the archive holds no files")
        with saved_or_507("upload"):
            upload_finish(box, name, upper, {r for r, k in check.kinds.items() if k == "dir"})
        files = sum(1 for k in check.kinds.values() if k == "file")
        return 201, box.loop.call(upload_commit, box, name, staging,
                             f"upload into {name}", f"POST /api/workspaces/{name}/upload",
                             f"{files} file{'' if files == 1 else 's'}, {check.size} bytes")


def h_workspace_archive(req: "Handler", params: dict[str, str]) -> Any:
    """The workspace's current view as a tar.gz, streamed."""
    box, name = req.box, workspace_named(req.box, params["name"])
    send_archive(req, box.loop.call(box.views.view_fd, name), f"{name}.tar.gz")
    return None


def h_task_archive(req: "Handler", params: dict[str, str]) -> Any:
    """A finished task's changes (its layer: what it added or changed) as a tar.gz."""
    box = req.box

    def layer() -> str:
        task = box.get(params["id"])
        if task.state in ACTIVE_STATES:
            raise ApiError(409, f"the task is {task.state}; its changes can be archived once "
                                "it has ended", "conflict")
        if task.layerDeleted:
            raise ApiError(409, "the task was undone and its layer deleted", "conflict")
        return os.path.join(box.layer_dir(task.id), "upper")

    path = box.loop.call(layer)
    try:
        top = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        raise ApiError(409, "the task has no layer (it never started)", "conflict") from None
    send_archive(req, top, f"{params['id']}.tar.gz")
    return None


# Portal sessions ###############################################################################
###############################################################################################
# The portal is one static page (portal.html beside this file) served at /.  A browser cannot
# put a bearer token on an EventSource, so the page signs in once, with a one-time code that
# `gurtd portal` prints or with the token pasted into its form, and then holds a session
# cookie: HttpOnly (the page's own code never sees it), SameSite=Strict, random, expiring,
# listed and revocable.  On disk (BOX_HOME/sessions.json) only a hash of each secret is kept,
# so a copy of the file signs nobody in; a restart keeps the sessions.  A request that changes
# something with the cookie must also carry X-Gurt-Portal: 1, a header no cross-site form can
# send (and fetch only with a CORS preflight that gurtd never grants); the request guard's
# Origin and Sec-Fetch-Site checks stand in front of it all.

PORTAL_PAGE = "portal.html"          # beside gurtd.py; `make install` puts it there
SESSION_COOKIE = "gurt_session"
PORTAL_HEADER = "X-Gurt-Portal"
SESSION_SECONDS = 7 * 86400          # a session's life (GURT_SESSION_SECONDS)
SIGN_IN_CODE_SECONDS = 120.0         # a one-time code's life (GURT_SIGN_IN_CODE_SECONDS)
MAX_SESSIONS = 64                    # past it, the oldest session ends
MAX_SIGN_IN_CODES = 16               # unused codes kept; past it, the oldest is dropped
SAFE_METHODS = ("GET", "HEAD")


def secret_hash(secret: str) -> str:
    """What is stored of a session secret or a code: they are long random strings, so a
    plain SHA-256 cannot be reversed by guessing."""
    return hashlib.sha256(secret.encode()).hexdigest()


def cookie_values(header: str, name: str) -> list[str]:
    """Every value of cookie name in a Cookie header (a browser may send more than one)."""
    pairs = (part.strip().partition("=") for part in header.split(";"))
    return [value.strip() for key, sep, value in pairs if sep and key == name]


@dataclass
class PortalSession:
    """A signed-in browser.  id names it in the API; only the hash of its secret is kept."""

    id: str
    hash: str
    createdAt: str
    expiresAt: float
    userAgent: str = ""
    via: str = "code"                 # code (a one-time URL) or token (pasted in the form)

    def to_api(self, current: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "createdAt": self.createdAt,
                "expiresAt": datetime.datetime.fromtimestamp(
                    self.expiresAt, datetime.timezone.utc).isoformat(
                        timespec="milliseconds").replace("+00:00", "Z"),
                "userAgent": self.userAgent, "via": self.via, "current": self.id == current}


class PortalSessions:
    """Sign-in codes (in memory: short lived, single use) and sessions (on disk, hashed).
    Any HTTP thread; one short lock, never held while waiting for the loop."""

    def __init__(self, path: str, token: str) -> None:
        self.path = path
        self.token = token
        self.lock = threading.Lock()
        self.codes: dict[str, float] = {}              # hash -> monotonic expiry
        self.sessions: dict[str, PortalSession] = {}   # hash -> session
        self.life = env_seconds("GURT_SESSION_SECONDS", SESSION_SECONDS)
        self.code_life = env_seconds("GURT_SIGN_IN_CODE_SECONDS", SIGN_IN_CODE_SECONDS)
        data = load_json(path)
        rows = data.get("sessions") if isinstance(data, dict) else None
        for row in rows if isinstance(rows, list) else []:
            try:
                s = record_from(PortalSession, row, lambda s: isinstance(s.hash, str) and
                                isinstance(s.expiresAt, (int, float)))
            except (ValueError, TypeError):
                continue
            if s.expiresAt > time.time():
                self.sessions[s.hash] = s

    def save(self) -> None:
        """Under the lock.  A disk that refuses the write is a 507 for the caller."""
        rows = [dataclasses.asdict(s) for s in self.sessions.values()]
        with saved_or_507("portal sessions"):
            write_json(self.path, {"sessions": rows})

    def new_code(self) -> tuple[str, float]:
        """A one-time sign-in code and its life in seconds."""
        code = secrets.token_urlsafe(24)
        with self.lock:
            now = time.monotonic()
            self.codes = {h: t for h, t in self.codes.items() if t > now}
            while len(self.codes) >= MAX_SIGN_IN_CODES:
                del self.codes[min(self.codes, key=self.codes.__getitem__)]
            self.codes[secret_hash(code)] = now + self.code_life
        return code, self.code_life

    def sign_in(self, code: str | None, token: str | None, agent: str) -> tuple[str, float]:
        """A new session for a valid code (used up now) or the token: its secret and life."""
        if code is not None:
            with self.lock:
                expiry = self.codes.pop(secret_hash(code), 0.0)
            if expiry <= time.monotonic():
                raise ApiError(401, "this sign-in code is wrong, used or expired; run "
                                    "`gurtd portal` for a new one", "unauthorized")
            via = "code"
        elif token is not None and hmac.compare_digest(token.encode(), self.token.encode()):
            via = "token"
        else:
            raise ApiError(401, "wrong token", "unauthorized")
        secret = secrets.token_urlsafe(32)
        session = PortalSession(new_task_id("s"), secret_hash(secret), now_iso(),
                                time.time() + self.life, printable(agent)[:200], via)
        with self.lock:
            now, before = time.time(), self.sessions
            self.sessions = {h: s for h, s in self.sessions.items() if s.expiresAt > now}
            self.sessions[session.hash] = session
            while len(self.sessions) > MAX_SESSIONS:
                oldest = min(self.sessions.values(), key=lambda s: s.expiresAt)
                del self.sessions[oldest.hash]
            try:
                self.save()
            except BaseException:          # 507: memory stays what the disk has
                self.sessions = before
                raise
        return secret, self.life

    def find(self, cookie_header: str) -> PortalSession | None:
        """The live session a Cookie header names, if any."""
        now = time.time()
        with self.lock:
            for value in cookie_values(cookie_header, SESSION_COOKIE):
                session = self.sessions.get(secret_hash(value))
                if session is not None and session.expiresAt > now:
                    return session
        return None

    def listing(self, current: str | None) -> list[dict[str, Any]]:
        now = time.time()
        with self.lock:
            live = sorted((s for s in self.sessions.values() if s.expiresAt > now),
                          key=lambda s: s.createdAt, reverse=True)
            return [s.to_api(current) for s in live]

    def alive(self, session: PortalSession) -> bool:
        """Still signed in: not revoked, not expired (a stream checks it as it goes)."""
        with self.lock:
            return self.sessions.get(session.hash) is session and session.expiresAt > time.time()

    def revoke(self, session_id: str) -> None:
        with self.lock:
            for key, session in list(self.sessions.items()):
                if session.id == session_id:      # a 507: still signed in, here and on disk
                    del self.sessions[key]
                    save_or_restore(self.save, "portal sessions", self.sessions, key, session)
                    return
        raise ApiError(404, "No session with this id", "not_found")


def session_cookie(secret: str, life: float) -> str:
    """The Set-Cookie value; an empty secret and no life clears it."""
    return (f"{SESSION_COOKIE}={secret}; Path=/; Max-Age={int(life)}; HttpOnly; "
            "SameSite=Strict")


def portal_authorize(req: "Handler") -> None:
    """The cookie where a bearer token is missing; a change also needs the portal's header
    and a same-origin fetch (the guard already refused other sites)."""
    session = req.server.sessions.find(req.headers.get("Cookie") or "")
    if session is None:
        raise ApiError(401, "missing or wrong bearer token, or no live portal session",
                       "unauthorized")
    if req.command not in SAFE_METHODS:
        site = (req.headers.get("Sec-Fetch-Site") or "same-origin").lower()
        if req.headers.get(PORTAL_HEADER) != "1" or site != "same-origin":
            raise ApiError(403, f"a change made with the portal's cookie needs the header "
                                f"{PORTAL_HEADER}: 1 from the portal's own page",
                           "cross_origin")
    req.session = session


def session_ended(req: "Handler") -> bool:
    """A stream opened with the cookie ends once its session is revoked or expires."""
    return req.session is not None and not req.server.sessions.alive(req.session)


def portal_csp(page: bytes) -> str:
    """A Content-Security-Policy that lets exactly the page's own inline script run."""
    scripts = re.findall(rb"<script>(.*?)</script>", page, re.S)
    hashes = " ".join("'sha256-%s'" % base64.b64encode(
        hashlib.sha256(s).digest()).decode() for s in scripts)
    return (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'")


def h_portal(req: "Handler", params: dict[str, str]) -> Any:
    """The page, always the same static file (no secret in it): a browser without a live
    session gets its sign-in form, never a task list."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), PORTAL_PAGE)
    try:
        with open(path, "rb") as f:
            page = f.read()
    except OSError as exc:
        raise ApiError(500, f"the portal page is missing: {exc.strerror}") from None
    req.send_json(200, (page, "text/html; charset=utf-8"), {
        "Content-Security-Policy": portal_csp(page), "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})
    return None


def h_sessions_create(req: "Handler", params: dict[str, str]) -> Any:
    """Sign in with {code} or {token}: the answer sets the session cookie."""
    body = req.json_body()
    if req.headers.get(PORTAL_HEADER) != "1":
        raise ApiError(403, f"sign in from the portal's page (header {PORTAL_HEADER}: 1)",
                       "cross_origin")
    if len(body) != 1 or not set(body) <= {"code", "token"} or \
            not isinstance(next(iter(body.values())), str) or \
            len(next(iter(body.values()))) > 1000:
        raise ApiError(400, 'the body must be {"code": "..."} or {"token": "..."}')
    secret, life = req.server.sessions.sign_in(body.get("code"), body.get("token"),
                                               req.headers.get("User-Agent") or "")
    return 201, {"signedIn": True}, {"Set-Cookie": session_cookie(secret, life)}


def h_session_current(req: "Handler", params: dict[str, str]) -> Any:
    """Whether this browser is signed in (no token needed: the page asks before anything)."""
    session = req.server.sessions.find(req.headers.get("Cookie") or "")
    if session is None:
        return 200, {"signedIn": False}
    return 200, {"signedIn": True, "session": session.to_api(session.id)}


def h_sessions_list(req: "Handler", params: dict[str, str]) -> Any:
    return 200, req.server.sessions.listing(req.session.id if req.session is not None else None)


def h_session_delete(req: "Handler", params: dict[str, str]) -> Any:
    """Revoke a session; revoking one's own also clears the cookie (signing out)."""
    req.server.sessions.revoke(params["id"])
    own = req.session is not None and req.session.id == params["id"]
    return 200, {"revoked": params["id"]}, {"Set-Cookie": session_cookie("", 0)} if own else {}


def h_sign_in_code(req: "Handler", params: dict[str, str]) -> Any:
    """A one-time sign-in code, for the token's holder only (`gurtd portal`)."""
    if req.json_body(optional=True):
        raise ApiError(400, "the body must be {} or empty")
    if req.session is not None:
        raise ApiError(403, "sign-in codes are made with the bearer token", "forbidden")
    code, life = req.server.sessions.new_code()
    return 201, {"code": code, "path": "/?code=" + code, "expiresInSeconds": life}


# Schedules #####################################################################################
###############################################################################################
# A schedule starts a task at the times of a standard five-field cron line in a time zone.
# Times are spent, not counted: `after` is the instant up to which a schedule's slots are used
# up; a run spends every slot up to now, so that a gurtd that was down (or a clock that jumped
# forward) runs once for everything it missed, and a clock that jumped back waits for the time
# it already spent (never a second run).  Daylight saving: a fixed-hour run in the repeated
# hour runs once; a run in the hour that does not exist runs when it ends (croniter's way).

MAX_SCHEDULES = 200
MISSED_COUNT_CAP = 1000              # missed slots are counted up to this many, for the message
SCHEDULE_ID_RE = re.compile(r"^s[a-z0-9]{9}$")
CRON_FIELD_RE = re.compile(r"^[0-9A-Za-z*,/-]{1,40}$")
OVERLAPS = ("skip", "queue")


def wall_now() -> float:
    """The wall clock for schedules, moved by GURT_TEST_CLOCK_OFFSET seconds (tests move time
    this way; the machine's clock is never touched)."""
    try:
        offset = float(os.environ.get("GURT_TEST_CLOCK_OFFSET", "0"))
    except ValueError:
        offset = 0.0
    return time.time() + offset


def cron_zone(name: Any) -> Any:
    """The zoneinfo time zone of this name, or ApiError(400) naming the field.  (zoneinfo
    is imported here: it pulls in sysconfig, which `gurtd tool` in a task need not load.)"""
    import zoneinfo
    if not isinstance(name, str) or not name or len(name) > 64 or ".." in name or \
            name.startswith("/"):
        raise ApiError(400, "timezone must be an IANA time zone name such as Europe/Berlin")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ApiError(400, f"timezone: no time zone named {json.dumps(name)}") from None


def cron_next(cron: str, zone: str, after: float, count: int) -> list[float]:
    """The next `count` run instants (UTC timestamps) strictly after `after`.

    croniter walks the wall clock: in a repeated hour (autumn) a fixed-hour line would match
    twice; that second match (fold=1) is left out.  A line whose hour is a wildcard (`*`,
    `*/2`) runs by elapsed time and keeps both.  A time that does not exist (spring) is moved
    to the end of the gap by croniter; a run that lands on an instant already given is one.
    croniter is imported here, not at the top: `gurtd tool` runs this module inside a task,
    where gurtd's virtual environment is not."""
    from croniter import croniter
    tz = cron_zone(zone)
    fixed_hour = "*" not in cron.split()[1]
    it = croniter(cron, datetime.datetime.fromtimestamp(after, tz))
    out: list[float] = []
    for _ in range(count * 4 + 8):
        if len(out) == count:
            break
        when = it.get_next(datetime.datetime)
        stamp = when.timestamp()
        if stamp <= (out[-1] if out else after):
            continue
        if fixed_hour and when.fold == 1 and \
                when.replace(fold=0).utcoffset() != when.utcoffset():
            continue
        out.append(stamp)
    return out


def cron_check(cron: Any, zone: str) -> str:
    """A cron line in the standard five-field form (minute hour day-of-month month
    day-of-week; ranges, steps, lists, names such as MON or JAN), or ApiError(400) naming the
    field.  A line that never matches (February 30) is refused too."""
    from croniter import CroniterError, croniter
    if not isinstance(cron, str):
        raise ApiError(400, "cron must be a string such as '0 3 * * MON-FRI'")
    fields = cron.split()
    names = ("minute", "hour", "day of month", "month", "day of week")
    if len(fields) != 5:
        raise ApiError(400, "cron must have five fields: minute hour day-of-month month "
                            f"day-of-week (got {len(fields)})")
    for name, text in zip(names, fields):
        if not CRON_FIELD_RE.match(text):
            raise ApiError(400, f"cron: the {name} field {json.dumps(text)} is not valid")
    line = " ".join(fields)
    try:
        croniter(line)
        if not cron_next(line, zone, wall_now(), 1):
            raise ValueError("it never matches")
    except (CroniterError, ValueError, KeyError, IndexError, OverflowError) as exc:
        raise ApiError(400, f"cron: {json.dumps(cron)} is not valid: {exc}") from None
    return line


def iso_local(stamp: float, zone: str) -> str:
    """An instant in the schedule's own zone, RFC 3339 with its offset."""
    return datetime.datetime.fromtimestamp(stamp, cron_zone(zone)).isoformat(timespec="seconds")


@dataclass
class Schedule:
    """A schedule as stored in BOX_HOME/schedules.json; `after` and `queued` are gurtd's own."""

    id: str
    name: str
    cron: str
    timezone: str
    task: dict[str, Any]
    enabled: bool
    overlap: str
    createdAt: str
    updatedAt: str
    after: float                      # slots up to this instant are spent
    lastRun: str | None = None
    lastTask: str | None = None
    lastState: str | None = None
    lastNote: str | None = None       # what happened at the latest slot (missed, skipped...)
    queued: bool = False              # overlap queue: a run waits for the active one

    def to_api(self, count: int = 5) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("after",)}
        out["nextRuns"] = [iso_local(t, self.timezone) for t in
                           cron_next(self.cron, self.timezone, max(self.after, wall_now()),
                                     count)] if self.enabled else []
        return out


SCHEDULE_FIELDS = {"name": str, "cron": str, "timezone": str, "task": dict, "enabled": bool,
                   "overlap": str}


def validate_schedule_body(body: dict[str, Any], current: dict[str, Any] | None,
                           settings: dict[str, Any]) -> dict[str, Any]:
    """A POST (current None) or PUT (a partial update of current) body of a schedule (an
    object: json_body), checked; the schedule's fields.  ApiError(400) naming the field."""
    check_field_types(body, SCHEDULE_FIELDS, "", lambda key, kind: f"{key} must be a" + {
        str: " string", dict: "n object", bool: " boolean"}[kind])
    out = dict(current or {"timezone": "UTC", "enabled": True, "overlap": "skip"})
    out.update(body)
    for key in ("name", "cron", "task"):
        if key not in out:
            raise ApiError(400, f"{key} is required")
    if not out["name"].strip() or len(out["name"]) > 100:
        raise ApiError(400, "name must be a non-empty string of at most 100 characters")
    cron_zone(out["timezone"])
    out["cron"] = cron_check(out["cron"], out["timezone"])
    if out["overlap"] not in OVERLAPS:
        raise ApiError(400, "overlap must be one of: skip, queue")
    if "source" in out["task"]:
        raise ApiError(400, "task: source is set by gurtd (schedule)")
    check_task_defaults({"title": out["name"][:200], **out["task"]}, settings, "task: ")
    return out


class Schedules:
    """The box's schedules: CRUD, timers and runs.  Loop thread only (HTTP goes through
    Box.call); a timer is the select loop's timeout (tick), never a thread."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.items: dict[str, Schedule] = {}
        self.next_at: dict[str, float] = {}       # cached first slot after `after`
        self.due: set[str] = set()                # queued runs whose turn came
        self.file = box.path("schedules.json")

    def load(self) -> None:
        """Read schedules.json; lastTask and lastState are repaired from the tasks (a crash
        between the run's start and the schedule's save)."""
        data = load_json(self.file)
        for raw in (data or {}).get("schedules", []) if isinstance(data, dict) else []:
            try:
                item = record_from(Schedule, raw, lambda s: SCHEDULE_ID_RE.fullmatch(s.id))
            except (TypeError, ValueError) as exc:
                log(3, f"schedules.json: a schedule is damaged and left out: {exc}")
                continue
            self.items[item.id] = item
        for task in sorted(self.box.all_tasks(), key=lambda t: t.seq):
            item = self.items.get(task.schedule or "")
            if item is not None:
                item.lastTask, item.lastState = task.id, task.state

    def save(self) -> None:
        write_json(self.file, {"schedules": [dataclasses.asdict(s) for s in
                                             sorted(self.items.values(),
                                                    key=lambda s: s.createdAt)]})

    def get(self, sched_id: str) -> Schedule:
        item = self.items.get(sched_id)
        if item is None:
            raise ApiError(404, f"no schedule {sched_id}", "not_found")
        return item

    def check_workspace(self, fields: dict[str, Any]) -> None:
        workspace = fields["task"].get("workspace", "home")
        if not self.box.views.workspace_exists(workspace):
            raise ApiError(400, f"task: workspace {workspace} does not exist")

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        fields = validate_schedule_body(body, None, self.box.setting())
        self.check_workspace(fields)
        if len(self.items) >= MAX_SCHEDULES:
            raise ApiError(409, f"at most {MAX_SCHEDULES} schedules", "conflict")
        sched_id, stamp = new_task_id("s"), now_iso()
        item = Schedule(id=sched_id, createdAt=stamp, updatedAt=stamp, after=wall_now(),
                        **fields)
        self.items[sched_id] = item
        save_or_restore(self.save, "schedule", self.items, sched_id, None)
        log(6, f"schedule {sched_id} ({item.name}) created: {item.cron} {item.timezone}")
        return item.to_api()

    def update(self, sched_id: str, body: dict[str, Any]) -> dict[str, Any]:
        item = self.get(sched_id)
        old = dataclasses.asdict(item)
        fields = validate_schedule_body(body, {k: old[k] for k in SCHEDULE_FIELDS},
                                        self.box.setting())
        self.check_workspace(fields)
        changed = dataclasses.replace(item, **fields, updatedAt=now_iso())
        # a new time line, or a schedule switched on, starts from now: no catch-up run
        if (fields["cron"], fields["timezone"]) != (item.cron, item.timezone) or \
                (fields["enabled"] and not item.enabled):
            changed.after = wall_now()
        self.items[sched_id] = changed
        save_or_restore(self.save, "schedule", self.items, sched_id, item)
        self.next_at.pop(sched_id, None)
        return changed.to_api()

    def delete(self, sched_id: str) -> dict[str, Any]:
        item = self.get(sched_id)
        del self.items[sched_id]
        save_or_restore(self.save, "schedules", self.items, sched_id, item)
        self.next_at.pop(sched_id, None)
        return {"deleted": sched_id}

    def active_run(self, item: Schedule) -> Task | None:
        task = self.box.task(item.lastTask or "")
        return task if task is not None and task.state in ACTIVE_STATES else None

    def run_now(self, sched_id: str) -> tuple[int, dict[str, Any]]:
        """POST /api/schedules/{id}/run: a run now, under the schedule's overlap rule; its
        slots are left as they are."""
        item = self.get(sched_id)
        active = self.active_run(item)
        if active is not None and item.overlap == "skip":
            raise ApiError(409, f"the previous run {active.id} is still {active.state} "
                                "(overlap: skip); nothing was started", "conflict")
        if active is not None:
            item.queued = True
            with saved_or_507("schedule"):
                self.save()
            return 202, {"schedule": item.to_api(), "queued": True}
        task = self.start(item, "run now")
        return 201, {"schedule": item.to_api(), "task": task}

    def start(self, item: Schedule, note: str) -> dict[str, Any]:
        """Create the run's task (source schedule); its id and state go to the schedule."""
        body = {"title": item.name[:200], **item.task, "source": "schedule"}
        item.lastRun, item.lastNote, item.queued = now_iso(), note, False
        try:
            task = self.box.create_task(body, {"schedule": item.id})
        except ApiError as exc:
            item.lastState, item.lastNote = "failed", f"{note}; not started: {exc.message}"
            log(4, f"schedule {item.id} ({item.name}): {item.lastNote}")
            self.save_quietly()
            raise
        item.lastTask, item.lastState = task["id"], task["state"]
        self.box.append_log(task["id"], {"type": "schedule", "schedule": item.id,
                                         "text": f"schedule {item.name}: {note}"})
        self.save_quietly()
        log(6, f"schedule {item.id} ({item.name}) started task {task['id']}: {note}")
        return task

    def save_quietly(self) -> None:
        """A save after the fact (a run's task id): a failure is logged, the next save
        writes it; load repairs lastTask from the tasks anyway."""
        try:
            self.save()
        except OSError as exc:
            log(3, f"could not save schedules.json: {exc}")

    def missed(self, item: Schedule, now: float) -> int:
        """How many slots in (after, now] (at most MISSED_COUNT_CAP)."""
        count, when = 0, item.after
        while count < MISSED_COUNT_CAP:
            step = cron_next(item.cron, item.timezone, when, 50)
            inside = [t for t in step if t <= now]
            count += len(inside)
            if len(inside) < len(step) or not step:
                break
            when = step[-1]
        return min(count, MISSED_COUNT_CAP)

    def fire(self, item: Schedule, now: float) -> None:
        """A slot came: spend every slot up to now (saved first: a crash after it loses one
        run, never doubles one), then run once, or skip or queue behind an active run."""
        count = self.missed(item, now)
        since = iso_local(item.after, item.timezone)
        item.after = now
        self.next_at.pop(item.id, None)
        note = f"slot {iso_local(now, item.timezone)}"
        if count > 1:
            note = f"missed {count}{'+' if count >= MISSED_COUNT_CAP else ''} runs since " \
                   f"{since} (gurtd was down or the clock moved): running once for them"
        active = self.active_run(item)
        if active is not None:
            if item.overlap == "skip":
                item.lastNote = f"skipped at {iso_local(now, item.timezone)}: the previous " \
                                f"run {active.id} is still {active.state}"
            else:
                item.queued, item.lastNote = True, f"queued behind {active.id} ({note})"
            log(6, f"schedule {item.id} ({item.name}): {item.lastNote}")
            self.save()
            return
        self.save()
        with contextlib.suppress(ApiError):
            self.start(item, note)

    def tick(self) -> float:
        """The loop's timer: run what is due; seconds until the next slot (at most 60, so
        that a clock that jumps is seen within a minute).  Never raises: a schedule whose run
        fails is logged and the others go on."""
        now = wall_now()
        wait = 60.0
        for sched_id in sorted(self.due):
            self.due.discard(sched_id)
            item = self.items.get(sched_id)
            if item is not None and item.queued and self.active_run(item) is None:
                try:
                    self.start(item, "queued run: the previous one ended")
                except ApiError:
                    pass                                 # start logged why
                except Exception as exc:
                    log(3, f"schedule {item.id}: {type(exc).__name__}: {exc}")
        for item in list(self.items.values()):
            if not item.enabled:
                continue
            try:
                if item.id not in self.next_at:
                    runs = cron_next(item.cron, item.timezone, item.after, 1)
                    self.next_at[item.id] = runs[0] if runs else float("inf")
                if self.next_at[item.id] <= now:
                    self.fire(item, now)
                    continue
                wait = min(wait, self.next_at[item.id] - now)
            except Exception as exc:
                log(3, f"schedule {item.id}: {type(exc).__name__}: {exc}")
        return max(0.0, wait)

    def on_task(self, task: dict[str, Any]) -> None:
        """A task changed state (Box.emit): the schedule that ran it keeps lastState; a
        queued run is due once the active one ended."""
        item = self.items.get(task.get("schedule") or "")
        if item is None or item.lastTask != task["id"]:
            return
        item.lastState = task["state"]
        if task["state"] in TERMINAL_STATES and item.queued:
            self.due.add(item.id)           # tick starts it, after this step
        self.save_quietly()

    def list(self) -> list[dict[str, Any]]:
        return [s.to_api() for s in sorted(self.items.values(), key=lambda s: s.createdAt)]


def h_schedule_get(req: "Handler", params: dict[str, str]) -> Any:
    return 200, req.box.loop.call(lambda: req.box.schedules.get(params["id"]).to_api())


h_schedules_list = loop_handler(200, "schedules.list")
h_schedules_create = loop_handler(201, "schedules.create", body=True)
h_schedule_put = loop_handler(200, "schedules.update", "id", body=True)
h_schedule_delete = loop_handler(200, "schedules.delete", "id")


def h_schedule_run(req: "Handler", params: dict[str, str]) -> Any:
    return req.box.loop.call(req.box.schedules.run_now, params["id"])


# Jira ##########################################################################################
###############################################################################################
# A Jira Cloud connection (REST API v3): one poll thread asks Jira for the issues of the `jql`
# setting and hands each new one to the loop (Box.call), which records the issue key in
# BOX_HOME/jira.json BEFORE it creates the task: an issue never gets two tasks, across
# restarts too (a crash between the two leaves an issue recorded without a task: no task
# rather than two).  When the task ends, the loop adds a notice to the same record; the thread
# comments on the issue and moves it (transitions), retrying 429/5xx/unreachable with backoff.
# The loop never waits for Jira; Jira being down only delays its own work.

JIRA_TIMEOUT = 20.0                  # seconds for one read or write of a request to Jira
JIRA_DEADLINE = 60.0                 # seconds for a whole answer (GURT_JIRA_DEADLINE)
JIRA_ANSWER_MAX = 8 << 20            # bytes of one answer, at most
JIRA_BACKOFF_MAX = 600.0             # seconds between retries, at most
JIRA_MAX_ISSUES = 50                 # issues taken per poll
JIRA_TEXT_MAX = 100_000              # characters of a description made into a prompt
JIRA_KEY_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,49}-[1-9][0-9]{0,9}$")
JIRA_FIELDS = {"baseUrl": str, "email": str, "token": str, "jql": str, "workspace": str,
               "worker": str, "hosts": list, "tools": list, "budgetCents": (int, float),
               "pollSeconds": int, "transitions": dict, "enabled": bool}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def validate_jira(value: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """The `jira` setting: {} (no connection) or a connection; ApiError(400) naming the field.
    The token may be given here; Box.put_settings moves it to BOX_HOME/secrets/jira-token."""
    if not isinstance(value, dict):
        raise ApiError(400, "jira must be an object (or {} for no Jira connection)")
    check_field_types(value, JIRA_FIELDS, "jira: ", lambda key, kind: f"jira.{key} has the "
                                                               "wrong type")
    if not value:
        return {}
    for key in ("baseUrl", "email", "jql"):
        if not value.get(key, "").strip():
            raise ApiError(400, f"jira.{key} is required")
    url = urllib.parse.urlsplit(value["baseUrl"])
    if url.scheme not in ("https", "http") or not url.hostname or url.query or url.fragment \
            or url.username or (url.scheme == "http" and url.hostname not in LOOPBACK_HOSTS):
        raise ApiError(400, "jira.baseUrl must be https://SITE.atlassian.net (http only on "
                            "loopback: the token would cross the network in clear)")
    if not 10 <= value.get("pollSeconds", 60) <= 86400:
        raise ApiError(400, "jira.pollSeconds must be a whole number from 10 to 86400")
    transitions = value.get("transitions", {})
    if set(transitions) - {"done", "failed"} or \
            not all(isinstance(v, str) and 0 < len(v) <= 100 for v in transitions.values()):
        raise ApiError(400, 'jira.transitions must be {"done"?: NAME, "failed"?: NAME}')
    check_task_defaults({"title": "t", "prompt": "p", **{
        k: value[k] for k in ("workspace", "worker", "hosts", "tools", "budgetCents")
        if k in value}}, settings, "jira.")
    return {"enabled": True, "pollSeconds": 60, **value,
            "baseUrl": value["baseUrl"].rstrip("/")}


def adf_text(node: Any, depth: int = 0) -> str:
    """Atlassian Document Format as plain text: paragraphs and headings as lines, lists as
    `- ` and `1. ` items, code blocks kept, mentions and links by their text.  Bounded: past
    depth 100 a subtree is left out (an issue's text is anyone's input)."""
    if depth > 100 or not isinstance(node, dict):
        return ""
    kind = node.get("type")
    attrs = node.get("attrs") if isinstance(node.get("attrs"), dict) else {}
    if kind == "text":
        return str(node.get("text", ""))
    if kind == "hardBreak":
        return "\n"
    if kind in ("mention", "emoji", "status", "date"):
        return str(attrs.get("text") or attrs.get("shortName") or attrs.get("timestamp") or "")
    if kind in ("inlineCard", "blockCard", "embedCard"):
        return str(attrs.get("url", ""))
    children = node.get("content") if isinstance(node.get("content"), list) else []
    if kind in ("bulletList", "orderedList"):
        items = []
        order = attrs.get("order")           # anyone's value: a whole number, else 1
        start = order if type(order) is int and 0 <= order < 10**9 else 1
        for number, child in enumerate(children, start):
            mark = "- " if kind == "bulletList" else f"{number}. "
            # cut before indenting: nested lists would otherwise grow each line at every level
            text = adf_text(child, depth + 1).strip("\n")[:JIRA_TEXT_MAX]
            items.append(mark + text.replace("\n", "\n  "))
        return "\n".join(items) + "\n\n"
    inner = "".join(adf_text(child, depth + 1) for child in children)
    if kind == "codeBlock":
        return "```\n" + inner + "\n```\n\n"
    if kind in ("paragraph", "heading", "blockquote", "panel", "rule", "table", "tableRow"):
        return inner.rstrip("\n") + "\n\n" if kind != "tableRow" else inner + "\n"
    if kind in ("tableCell", "tableHeader"):
        return inner.strip() + " | "
    return inner


def text_adf(text: str) -> dict[str, Any]:
    """Plain text as an ADF document: a paragraph per block, hard breaks inside."""
    paragraphs = []
    for block in text.strip().split("\n\n"):
        content: list[dict[str, Any]] = []
        for number, line in enumerate(block.split("\n")):
            if number:
                content.append({"type": "hardBreak"})
            if line:
                content.append({"type": "text", "text": line})
        if content:
            paragraphs.append({"type": "paragraph", "content": content})
    return {"type": "doc", "version": 1, "content": paragraphs}


class JiraError(Exception):
    """A Jira request that did not succeed: its status (0: unreachable) and when to retry."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after

    @property
    def transient(self) -> bool:
        return self.status in (0, 408, 429) or self.status >= 500


class JiraUnreadable(JiraError):
    """A 2xx answer that cannot be read: larger than JIRA_ANSWER_MAX, not JSON, nested too
    deep, or not the object asked for.  Of a search: Jira's fault, retried (502).  Of one
    issue: that issue's, which is skipped (Jira.poll)."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message)


class JiraLate(JiraError):
    """No whole answer within the deadline (a Jira trickling its answer, or one too slow)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message)


def jira_exchange(config: dict[str, Any], method: str, path: str, body: bytes | None,
                  headers: dict[str, str]) -> tuple[int, Any, bytes]:
    """(status, headers, body) of one request, the whole answer within the deadline: a read
    timeout alone lets a Jira that sends a byte every 19 s hold the thread for ever, so at the
    deadline a timer shuts the socket (a dup of it: whatever reads it, TLS too, wakes up).
    No proxy; a redirect is an answer like any other (never followed)."""
    url = urllib.parse.urlsplit(config["baseUrl"])
    secure = url.scheme == "https"
    host, port = url.hostname or "", url.port or (443 if secure else 80)
    deadline = env_seconds("GURT_JIRA_DEADLINE", JIRA_DEADLINE)
    late = threading.Event()
    keeper: list[socket.socket] = []       # a dup of the connection's socket, to shut it

    def cut() -> None:
        late.set()
        for sock in keeper:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    timer = threading.Timer(deadline, cut)
    timer.daemon = True
    timer.start()
    kind = http.client.HTTPSConnection if secure else http.client.HTTPConnection
    conn = kind(host, port, timeout=JIRA_TIMEOUT)
    try:
        conn.sock = raw = socket.create_connection((host, port), timeout=JIRA_TIMEOUT)
        keeper.append(raw.dup())
        if secure:
            conn.sock = ssl.create_default_context().wrap_socket(raw, server_hostname=host)
        conn.request(method, url.path + path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read(JIRA_ANSWER_MAX + 1)
    except (OSError, http.client.HTTPException) as exc:
        if late.is_set():
            raise JiraLate(f"{method} {path}: no whole answer within {deadline:.0f} s "
                           "(Jira is too slow, or trickles it)") from None
        raise JiraError(0, f"{method} {path}: {type(exc).__name__}: {exc}") from None
    finally:
        timer.cancel()
        conn.close()
        for sock in keeper:
            sock.close()


def jira_request(config: dict[str, Any], token: str, method: str, path: str,
                 body: Any = None) -> Any:
    """One request to Jira's REST API (basic auth: email and API token); its JSON or None.
    JiraError on anything but 2xx, JiraUnreadable on an answer that cannot be read, JiraLate
    past the deadline.  A redirect is refused: following it would send the Authorization
    header along to any host (and over http).  Any thread; never the loop's."""
    auth = base64.b64encode(f"{config['email']}:{token}".encode()).decode()
    status, headers, data = jira_exchange(
        config, method, path, json.dumps(body).encode() if body is not None else None,
        {"Authorization": f"Basic {auth}", "Accept": "application/json",
         "Content-Type": "application/json", "User-Agent": f"gurtd/{VERSION}"})
    if 300 <= status < 400:
        raise JiraError(status, f"{method} {path}: Jira redirected to "
                                f"{printable(headers.get('Location', ''))[:200]}; gurtd follows "
                                "no redirect (the token would go along): correct jira.baseUrl")
    if not 200 <= status < 300:
        retry = headers.get("Retry-After", "")
        detail = data[:2000].decode(errors="replace")
        raise JiraError(status, f"{method} {path}: {status} {printable(detail)[:300]}",
                        float(retry) if is_digits(retry) else None)
    if len(data) > JIRA_ANSWER_MAX:
        raise JiraUnreadable(f"{method} {path}: the answer is larger than "
                             f"{JIRA_ANSWER_MAX >> 20} MiB")
    if not data.strip():
        return None
    try:
        return loads_bounded(data)
    except ValueError as exc:
        raise JiraUnreadable(f"{method} {path}: not JSON: {exc}") from None


def jira_issue_fields(key: str, issue: Any) -> dict[str, Any]:
    """The fields of GET /rest/api/3/issue/KEY's answer; JiraUnreadable if it is not an issue
    object (anyone may shape what a Jira answers)."""
    fields = issue.get("fields") if isinstance(issue, dict) else None
    if not isinstance(fields, dict):
        raise JiraUnreadable(f"GET /rest/api/3/issue/{key}: the answer is not a JSON object "
                             "with fields")
    return fields


class Jira:
    """Jira intake and answers.  The records (BOX_HOME/jira.json: key -> {task, state,
    notice?, commented?, noticed?}) belong to the loop; the thread sees copies through Box.call."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.issues: dict[str, dict[str, Any]] = {}
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.backoff = 0.0

    @property
    def file(self) -> str:
        return self.box.path("jira.json")

    @property
    def token_file(self) -> str:
        return self.box.path("secrets", "jira-token")

    def load(self) -> None:
        data = load_json(self.file)
        issues = data.get("issues") if isinstance(data, dict) else None
        self.issues = {k: v for k, v in (issues or {}).items()
                       if JIRA_KEY_RE.fullmatch(k) and isinstance(v, dict)}
        for key, record in self.issues.items():
            if record.get("task") is None:
                log(4, f"jira: issue {key} was taken but its task was not created (gurtd "
                       "stopped in between); it is not started again")

    def save(self) -> None:
        write_json(self.file, {"issues": self.issues})

    def save_token(self, token: str) -> None:
        """The API token, 0600 in BOX_HOME/secrets (0700); never answered back."""
        secret_write(self.token_file, token)
        self.wake.set()

    def token(self) -> str:
        try:
            with open(self.token_file) as f:
                return f.read().strip()
        except OSError:
            return ""

    # loop thread
    def take(self, key: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        """A new issue from the thread: recorded (saved) first, then its task created.  None
        if it was taken before (or the connection changed)."""
        config = self.box.setting("jira") or {}
        if key in self.issues or not config.get("enabled") or not JIRA_KEY_RE.fullmatch(key):
            return None
        self.add_issue(key, {"task": None, "takenAt": now_iso()})
        summary = printable(fields.get("summary") or key)
        prompt = adf_text(fields.get("description")).strip()[:JIRA_TEXT_MAX] or summary
        body = {"title": f"{key}: {summary}"[:200], "prompt": prompt, "source": f"jira:{key}",
                **{k: config[k] for k in ("workspace", "worker", "hosts", "tools", "budgetCents")
                   if k in config}}
        try:
            task = self.box.create_task(body)
        except ApiError as exc:
            self.issues[key].update(state="failed", error=exc.message, notice={
                "state": "failed", "error": exc.message, "task": None})
            self.save()
            log(4, f"jira: issue {key}: no task: {exc.message}")
            self.wake.set()
            return None
        self.issues[key].update(task=task["id"], state=task["state"])
        with contextlib.suppress(OSError):     # the task's source names the issue anyway
            self.save()
        log(6, f"jira: issue {key} started task {task['id']}")
        return task

    def add_issue(self, key: str, entry: dict[str, Any]) -> None:
        """A new issue's record, saved first: none if it cannot be."""
        self.issues[key] = entry
        try:
            self.save()
        except OSError:
            del self.issues[key]
            raise

    def skip(self, key: str, reason: str) -> None:
        """An issue that cannot be read (its answer too large, not JSON, nested too deep):
        recorded as skipped for good (saved), so that no poll stops at it again; the thread
        comments on it with the reason (a notice, as for a task's end)."""
        if key in self.issues or not JIRA_KEY_RE.fullmatch(key):
            return
        self.add_issue(key, {"task": None, "takenAt": now_iso(), "state": "skipped",
                          "error": reason, "notice": {"state": "skipped", "error": reason,
                                                      "task": None}})
        log(4, f"jira: issue {key} skipped for good: {reason}")
        self.wake.set()

    def on_task(self, task: dict[str, Any]) -> None:
        """A task changed state (Box.emit): the end of a Jira task is noticed for the thread."""
        source = str(task.get("source", ""))
        key = source[5:] if source.startswith("jira:") else ""
        record = self.issues.get(key)
        if record is None or record.get("task") != task["id"] or \
                task["state"] not in ("done", "failed") or "notice" in record:
            return
        record["state"] = task["state"]
        record["notice"] = {k: task.get(k) for k in ("state", "summary", "error", "costCents",
                                                      "title", "folder", "folders")}
        record["notice"]["task"] = task["id"]
        try:
            self.save()
        except OSError as exc:
            log(3, f"jira: could not save the end of {task['id']} for issue {key}: {exc}")
        self.wake.set()

    def notices(self) -> list[tuple[str, dict[str, Any]]]:
        return [(k, dict(v["notice"], commented=bool(v.get("commented"))))
                for k, v in sorted(self.issues.items())
                if "notice" in v and not v.get("noticed")]

    def noticed(self, key: str, step: str = "noticed") -> None:
        """A step of a notice went through (`commented`, then `noticed`), saved before the
        next is tried: a retry or a restart does not comment a second time."""
        self.issues[key][step] = now_iso()
        self.save()

    def known(self, keys: list[str]) -> list[str]:
        return [k for k in keys if k in self.issues]

    # the thread
    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="jira", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=JIRA_TIMEOUT + 5)

    def run(self) -> None:
        """Poll, answer ended tasks, sleep pollSeconds (or the backoff); until gurtd stops."""
        next_poll = 0.0
        while not self.box.loop.stopped():
            config = dict(self.box.setting("jira") or {})
            wait = 3600.0
            if config.get("enabled"):
                try:
                    self.answer(config)
                    if time.monotonic() >= next_poll:
                        self.poll(config)
                        next_poll = time.monotonic() + config["pollSeconds"]
                    self.backoff = 0.0
                    wait = max(0.0, next_poll - time.monotonic())
                except JiraError as exc:
                    self.backoff = min(JIRA_BACKOFF_MAX, max(2.0, self.backoff * 2))
                    # Jira's Retry-After is obeyed up to the backoff's cap: a huge one would
                    # put the thread to sleep for years (or kill it: Event.wait overflows)
                    wait = min(JIRA_BACKOFF_MAX, max(self.backoff, exc.retry_after or 0.0))
                    log(4, f"jira: {exc}; trying again in {wait:.0f} s")
                except ApiError as exc:          # the loop was busy: try again soon
                    wait = 5.0
                    log(4, f"jira: {exc.message}")
                except Exception as exc:
                    wait = 60.0
                    log(3, f"jira: {type(exc).__name__}: {exc}")
            self.wake.wait(wait)
            self.wake.clear()

    def poll(self, config: dict[str, Any]) -> None:
        """Search with the JQL (POST /rest/api/3/search/jql), then read each issue gurtd has
        not taken (GET /rest/api/3/issue/KEY) and hand it to the loop."""
        token = self.token()
        if not token:
            raise JiraError(401, f"no API token in {self.token_file}: PUT /api/settings "
                                 '{"jira": {..., "token": "..."}}')
        found = jira_request(config, token, "POST", "/rest/api/3/search/jql",
                             {"jql": config["jql"], "fields": ["summary"],
                              "maxResults": JIRA_MAX_ISSUES})
        if not isinstance(found, dict):
            raise JiraUnreadable("POST /rest/api/3/search/jql: the answer is not a JSON object")
        keys = [i.get("key") for i in found.get("issues", []) if isinstance(i, dict)]
        # at most what was asked for: a Jira answering thousands of keys starts no more
        keys = list(dict.fromkeys(k for k in keys if isinstance(k, str) and
                                  JIRA_KEY_RE.fullmatch(k)))[:JIRA_MAX_ISSUES]
        taken = set(self.box.loop.call(self.known, keys))
        for key in keys:
            if key in taken or self.box.loop.stopped():
                continue
            try:
                fields = jira_issue_fields(key, jira_request(
                    config, token, "GET", f"/rest/api/3/issue/{key}?fields=summary,description"))
            except JiraUnreadable as exc:        # this issue's own: never read again
                self.box.loop.report(self.skip, key, str(exc))
                continue
            except JiraError as exc:
                if (exc.transient or exc.status == 401) and not isinstance(exc, JiraLate):
                    raise
                log(4, f"jira: issue {key} cannot be read, left for the next poll: {exc}")
                continue
            self.box.loop.report(self.take, key, fields)

    def answer(self, config: dict[str, Any]) -> None:
        """For each ended task not answered yet: a comment, then the transition if one is
        configured for its end.  A notice is marked done only after both went through."""
        pending = self.box.loop.call(self.notices)
        if not pending:
            return
        token = self.token()
        for key, notice in pending:
            try:
                if not notice["commented"]:
                    jira_request(config, token, "POST", f"/rest/api/3/issue/{key}/comment",
                                 {"body": text_adf(jira_comment(notice))})
                    self.box.loop.report(self.noticed, key, "commented")
                target = (config.get("transitions") or {}).get(notice["state"])
                if target:
                    self.transition(config, token, key, target)
            except JiraError as exc:
                if exc.transient or exc.status == 401:
                    raise                     # Jira or its token: tried again with backoff
                log(4, f"jira: issue {key}: gave up answering: {exc}")   # gone, forbidden
            self.box.loop.report(self.noticed, key)

    def transition(self, config: dict[str, Any], token: str, key: str, target: str) -> None:
        """Move the issue by the transition named target (or leading to a status so named)."""
        found = jira_request(config, token, "GET", f"/rest/api/3/issue/{key}/transitions")
        for item in (found or {}).get("transitions", []):
            to = item.get("to") if isinstance(item.get("to"), dict) else {}
            if target.lower() in (str(item.get("name", "")).lower(),
                                  str(to.get("name", "")).lower()):
                jira_request(config, token, "POST", f"/rest/api/3/issue/{key}/transitions",
                             {"transition": {"id": str(item.get("id"))}})
                return
        log(4, f"jira: issue {key} has no transition {target!r} now; left where it is")


def jira_comment(notice: dict[str, Any]) -> str:
    """The comment on an issue whose task ended: state, summary, error, cost; or on one that
    was skipped, why."""
    if notice["state"] == "skipped":
        return f"gurt skipped this issue for good: it could not be read ({notice.get('error')})." \
               "\nNo task was made. A new issue is taken as usual."
    lines = [f"gurt task {notice.get('task') or '(none)'} {notice['state']}."]
    if notice.get("summary"):
        lines.append(f"Summary: {notice['summary']}")
    if notice.get("error"):
        lines.append(f"Error: {notice['error']}")
    if notice.get("costCents") is not None:
        lines.append(f"Cost: {notice['costCents']:.2f} cents")
    if notice.get("folder") or notice.get("folders"):
        lines.append("The change waits for review before it reaches the personal folder.")
    return "\n".join(lines)


# Hooks #########################################################################################
###############################################################################################
# Signed webhooks: POST /api/hooks/{name} with X-Gurt-Delivery: <a unique id>,
# X-Gurt-Timestamp: <Unix seconds> and X-Gurt-Signature: sha256=<hex HMAC-SHA256 of
# "TIMESTAMP.DELIVERY.BODY", keyed with the hook's secret> (the Standard Webhooks scheme).
# The only routes without the bearer token: the signature is the credential.  The secret is
# made by gurtd per hook and answered once.  A delivery id is remembered for a day
# (BOX_HOME/hook-deliveries.jsonl, append-only): the same id again is refused; a new id
# breaks the signature; and past 5 minutes the timestamp is stale, so a signed delivery that
# someone kept is never taken twice.

MAX_HOOKS = 100
MAX_DELIVERIES = 10_000              # remembered at once; past it deliveries get 429
DELIVERY_KEPT = 86400.0              # seconds a delivery id is remembered
DELIVERY_MAX_AGE = 300.0             # seconds a signed timestamp is good for (< DELIVERY_KEPT)
DELIVERY_SKEW = 60.0                 # seconds a sender's clock may be ahead of ours
HOOK_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
DELIVERY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")
HOOK_PATH_RE = re.compile(r"^/api/hooks/[^/]+$")
HOOK_BODY_FIELDS = ("workspace", "worker", "hosts", "tools", "budgetCents")


def validate_hook_body(body: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """POST /api/hooks {name, source, task?, allow?} (an object: json_body): the hook's
    fields, or ApiError(400)."""
    for key in body:
        if key not in ("name", "source", "task", "allow"):
            raise ApiError(400, f"unknown field: {key}")
    name = body.get("name")
    if not isinstance(name, str) or not HOOK_NAME_RE.fullmatch(name):
        raise ApiError(400, "name must match ^[a-z0-9][a-z0-9_-]{0,63}$")
    source = body.get("source")
    if not isinstance(source, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,49}", source) \
            or source in ("api", "schedule") or source.startswith("jira"):
        raise ApiError(400, "source must be a name such as asi1 (not api, schedule or jira)")
    task = body.get("task", {})
    if not isinstance(task, dict) or "source" in task:
        raise ApiError(400, "task must be an object of task defaults (without source)")
    allow = body.get("allow", [])
    if not isinstance(allow, list) or not all(a in HOOK_BODY_FIELDS for a in allow):
        raise ApiError(400, f"allow must list fields of: {', '.join(HOOK_BODY_FIELDS)}")
    check_task_defaults({"title": "t", "prompt": "p", **task}, settings, "task: ")
    return {"name": name, "source": source, "task": task, "allow": sorted(set(allow))}


def hook_signature(secret: str, timestamp: str, delivery: str, body: bytes) -> str:
    """X-Gurt-Signature of a delivery: sha256=<hex HMAC-SHA256 of "TIMESTAMP.DELIVERY.BODY">
    (the raw body): the timestamp and the id are signed, so neither can be changed."""
    signed = f"{timestamp}.{delivery}.".encode() + body
    return "sha256=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def hook_signature_ok(secret: str, timestamp: str, delivery: str, body: bytes,
                      header: str) -> bool:
    """The delivery's signature is right (compared in constant time) and its timestamp is a
    number of seconds; whether it is fresh is asked after (delivery_staleness)."""
    if not (is_digits(timestamp) and len(timestamp) <= 12 and header):
        return False
    expected = hook_signature(secret, timestamp, delivery, body)
    return hmac.compare_digest(expected.encode(), header.strip().lower().encode())


def delivery_staleness(timestamp: str, now: float) -> str | None:
    """Why a rightly signed X-Gurt-Timestamp is not taken (too old, or ahead of our clock
    past the skew), or None."""
    age = now - int(timestamp)
    if age > DELIVERY_MAX_AGE:
        return f"X-Gurt-Timestamp {timestamp} is {age:.0f} s old: a delivery is taken " \
               f"within {DELIVERY_MAX_AGE:.0f} s of its signing"
    if age < -DELIVERY_SKEW:
        return f"X-Gurt-Timestamp {timestamp} is {-age:.0f} s ahead of gurtd's clock (at " \
               f"most {DELIVERY_SKEW:.0f} s)"
    return None


class Hooks:
    """The box's hooks (BOX_HOME/hooks.json, 0600: it holds the secrets) and the delivery ids
    of the last day.  Loop thread only."""

    def __init__(self, box: "Box") -> None:
        self.box = box
        self.items: dict[str, dict[str, Any]] = {}
        self.deliveries: dict[str, float] = {}     # "hook/delivery id" -> when (wall time)
        self.file = box.path("hooks.json")
        self.deliveries_file = box.path("hook-deliveries.jsonl")

    def load(self) -> None:
        """Read the hooks, and the delivery ids younger than a day (the file is rewritten
        with only those: it never grows past a day's deliveries)."""
        data = load_json(self.file)
        hooks = data.get("hooks") if isinstance(data, dict) else None
        self.items = {k: v for k, v in (hooks or {}).items() if isinstance(v, dict)
                      and isinstance(v.get("secret"), str) and HOOK_NAME_RE.fullmatch(k)}
        now = time.time()
        try:
            with open(self.deliveries_file, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            lines = []
        for raw in lines:
            try:
                entry = json.loads(raw)
                if now - float(entry["at"]) < DELIVERY_KEPT:
                    self.deliveries[str(entry["id"])] = float(entry["at"])
            except (ValueError, KeyError, TypeError):
                continue                      # a torn last line: that delivery was not taken
        kept = b"".join(json.dumps({"id": k, "at": v}).encode() + b"\n"
                        for k, v in self.deliveries.items())
        try:
            atomic_write(self.deliveries_file, kept)
        except OSError as exc:        # a full disk: the old file stays, with older ids too
            log(4, f"could not rewrite {self.deliveries_file}: {exc}")

    def save(self) -> None:
        write_json(self.file, {"hooks": self.items})

    def list(self) -> list[dict[str, Any]]:
        """The hooks by name, each without its secret."""
        return [{k: v for k, v in hook.items() if k != "secret"}
                for _, hook in sorted(self.items.items())]

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """A new hook; its secret is in this answer and never again."""
        fields = validate_hook_body(body, self.box.setting())
        if fields["name"] in self.items:
            raise ApiError(409, f"hook {fields['name']} exists", "conflict")
        if len(self.items) >= MAX_HOOKS:
            raise ApiError(409, f"at most {MAX_HOOKS} hooks", "conflict")
        hook = {**fields, "secret": secrets.token_hex(32), "createdAt": now_iso(),
                "url": f"/api/hooks/{fields['name']}"}
        self.items[hook["name"]] = hook
        save_or_restore(self.save, "hook", self.items, hook["name"], None)
        log(6, f"hook {hook['name']} created (source {hook['source']})")
        return dict(hook)

    def delete(self, name: str) -> dict[str, Any]:
        hook = self.items.pop(name, None)
        if hook is None:
            raise ApiError(404, f"no hook {name}", "not_found")
        save_or_restore(self.save, "hooks", self.items, name, hook)
        return {"deleted": name}

    def deliver(self, name: str, raw: bytes, signature: str, delivery: str,
                timestamp: str) -> dict[str, Any]:
        """A delivery: signature and its timestamp, then delivery id (remembered, synced,
        before the task is made: a crash between them loses the delivery, never runs it
        twice), then the task."""
        hook = self.items.get(name)
        if hook is None or not hook_signature_ok(hook["secret"], timestamp, delivery, raw,
                                                 signature):
            # one answer for all: an unknown hook name is not told apart from a bad signature
            raise ApiError(401, "missing or wrong X-Gurt-Signature (of X-Gurt-Timestamp, "
                                "X-Gurt-Delivery and the body)", "bad_signature")
        now = time.time()
        stale = delivery_staleness(timestamp, now)
        if stale:
            raise ApiError(401, stale, "stale_delivery")
        if not DELIVERY_RE.match(delivery):
            raise ApiError(400, "X-Gurt-Delivery must be a unique id (1-200 visible ASCII)")
        for key in [k for k, at in self.deliveries.items() if now - at >= DELIVERY_KEPT]:
            del self.deliveries[key]
        key = f"{name}/{delivery}"
        if key in self.deliveries:
            raise ApiError(409, f"delivery {delivery} was taken already", "replayed")
        if len(self.deliveries) >= MAX_DELIVERIES:
            raise ApiError(429, "too many deliveries within a day", "too_many",
                           {"Retry-After": "60"})
        try:
            body = loads_bounded(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        for field_name in body:
            if field_name not in ("title", "prompt", *hook["allow"]):
                raise ApiError(400, f"{field_name}: this hook does not let a delivery set it")
        task_body = {**hook["task"], **body, "source": hook["source"]}
        validate_task_body(task_body, self.box.setting())      # a 400 before the id is spent
        with saved_or_507("delivery"):
            fd = os.open(self.deliveries_file, os.O_RDWR | os.O_APPEND | os.O_CREAT |
                         os.O_CLOEXEC, 0o600)
            try:
                append_line(fd, json.dumps({"id": key, "at": now}).encode() + b"\n", sync=True)
            finally:
                os.close(fd)
        self.deliveries[key] = now
        task = self.box.create_task(task_body)
        log(6, f"hook {name}: delivery {printable(delivery)} started task {task['id']}")
        return task


h_hooks_list = loop_handler(200, "hooks.list")
h_hooks_create = loop_handler(201, "hooks.create", body=True)
h_hook_delete = loop_handler(200, "hooks.delete", "name")


def h_hook_deliver(req: "Handler", params: dict[str, str]) -> Any:
    """No bearer token here (Handler.dispatch): the signature is checked instead, over the
    body's bytes as sent (not over JSON)."""
    return 201, req.box.loop.call(req.box.hooks.deliver, params["name"], req.raw_body(),
                                  req.headers.get("X-Gurt-Signature") or "",
                                  req.headers.get("X-Gurt-Delivery") or "",
                                  req.headers.get("X-Gurt-Timestamp") or "")


# HTTP ##########################################################################################
###############################################################################################
# One table of Route records (ROUTES, after the handlers): each says its method, path, handler,
# whether it is open or streamed, and its OpenAPI operation.  Handlers parse, ask the Box,
# render.  Errors of every kind, http.server's own included, leave as JSON {"error": ...,
# "code"?: ...} from one place.
#
# File names are bytes (a task or an archive may name a file in Latin-1); gurtd holds them as
# str with surrogateescape, as os does.  JSON carries text only, so an answer shows a name that
# is not UTF-8 with each byte that is not as \xNN (caf\xe9.txt): readable and valid UTF-8, a
# name to look at, not one to send back (a diff names it C-quoted, as git does, and archives
# carry the very bytes).


def json_text(obj: Any) -> bytes:
    """obj as JSON that a strict client takes: a str holding surrogateescaped bytes (only a
    file name has them) shows each as \\xNN; every other answer is json.dumps as it is
    (a long list a slice at a time: json_dumps_in_slices)."""
    return json_dumps_in_slices(obj, _json_shown)


def _json_shown(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return json.dumps(_shown(obj)).encode() if b"\\ud" in body else body


def _shown(obj: Any) -> Any:
    """obj with each surrogateescaped byte of a str as \\xNN (another lone surrogate, which
    only a client's own JSON could hold, as U+FFFD)."""
    if isinstance(obj, str):
        return "".join(f"\\x{ord(c) - 0xdc00:02x}" if "\udc80" <= c <= "\udcff" else
                       "\ufffd" if "\ud800" <= c <= "\udfff" else c for c in obj) \
            if any("\ud800" <= c <= "\udfff" for c in obj) else obj
    if isinstance(obj, dict):
        return {_shown(k): _shown(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_shown(v) for v in obj]
    return obj


class LogWatch:
    """One task's followers: a condition and a count of the log lines written since."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.generation = 0
        self.followers = 0

    def wait(self, seen: int, timeout: float) -> None:
        """Until a line is written after generation seen was read (or timeout)."""
        with self.cond:
            if self.generation == seen:
                self.cond.wait(timeout)


class LogFollowers:
    """Who follows which task's log (GET .../log?follow=1): append_log wakes only the
    followers of the task it wrote to, not every follower of every task."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watches: dict[str, LogWatch] = {}

    def notify(self, task_id: str) -> None:
        """A line was appended to the task's log (the loop thread; cheap when nobody reads)."""
        watch = self.watches.get(task_id)
        if watch is not None:
            with watch.cond:
                watch.generation += 1
                watch.cond.notify_all()

    @contextlib.contextmanager
    def follow(self, task_id: str) -> Iterator[LogWatch]:
        with self.lock:
            watch = self.watches.setdefault(task_id, LogWatch())
            watch.followers += 1
        try:
            yield watch
        finally:
            with self.lock:
                watch.followers -= 1
                if not watch.followers:
                    del self.watches[task_id]


def h_health(req: "Handler", params: dict[str, str]) -> Any:
    return 200, {"ok": True, "version": VERSION}


# GET /api/tasks?limit=: h_tasks_list checks it, its route describes it
TASKS_LIMIT = {"type": "integer", "minimum": 1, "maximum": 1000, "default": 200}


def h_tasks_list(req: "Handler", params: dict[str, str]) -> Any:
    state = req.query_one("state")
    if state is not None and state not in STATES:
        raise ApiError(400, f"state must be one of: {', '.join(STATES)}")
    workspace = req.query_one("workspace")
    limit_text = req.query_one("limit") or str(TASKS_LIMIT["default"])
    low, high = TASKS_LIMIT["minimum"], TASKS_LIMIT["maximum"]
    if not is_digits(limit_text) or not low <= int(limit_text) <= high:
        raise ApiError(400, f"limit must be a whole number from {low} to {high}")
    fields = task_fields(req.query_one("fields"))
    return 200, req.box.loop.list_tasks(state, workspace, int(limit_text), fields)


def task_fields(text: str | None) -> tuple[str, ...] | None:
    """?fields=id,state: the Task fields a list keeps (a task of 10,000 layers is large),
    or None for all; 400 for a name that is no Task field."""
    if text is None:
        return None
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in PUBLIC_FIELDS]
    if not names or unknown:
        raise ApiError(400, f"unknown field {', '.join(unknown) or '(none given)'}; fields "
                            f"are: {', '.join(PUBLIC_FIELDS)}")
    return names


h_tasks_create = loop_handler(201, "create_task_later", body=True)


def h_task_get(req: "Handler", params: dict[str, str]) -> Any:
    rendered = req.box.loop.task_json(params["id"])
    if rendered is None:
        raise ApiError(400, "No task with this id")
    return 200, rendered


def h_task_undo(req: "Handler", params: dict[str, str]) -> Any:
    body = req.json_body(optional=True)
    if set(body) - {"force"} or not isinstance(body.get("force", False), bool):
        raise ApiError(400, 'the body must be empty or {"force": true|false}')
    req.box.review.undo_request(params["id"], body.get("force", False))   # off the loop
    answer, named = req.box.loop.call(req.box.undo, params["id"])
    return 200, undo_answer(answer, named)        # waits here, never on the loop


h_task_stop = loop_handler(200, "stop", "id")


def h_task_changes(req: "Handler", params: dict[str, str]) -> Any:
    box = req.box
    layers = box.loop.call(box.views.changes, params["id"])
    if layers is None:
        return 200, []
    found = changed_paths(*layers)
    # undone and deleted during the walk: what was read is no change of the workspace any more
    if box.loop.call(box.views.changes, params["id"]) is None:
        return 200, []
    folders = box.loop.call(box.review.sources, params["id"])["folders"]
    if folders:
        found += folder_change_list(*(list(x) for x in zip(*folders)))
    return 200, found


MAX_LOG_FOLLOWERS = 32              # GET /api/tasks/{id}/log?follow=1 at once, per task


def h_task_log(req: "Handler", params: dict[str, str]) -> Any:
    """The log, or its followers: at most MAX_LOG_FOLLOWERS of one task at once (each holds
    a thread); one more gets 429."""
    box, task_id = req.box, params["id"]
    follow = req.query_one("follow") in ("1", "true", "yes")
    if follow and not box.followers.enter(task_id):
        raise ApiError(429, f"this task's log has {MAX_LOG_FOLLOWERS} followers already",
                       "too_many_requests")
    try:
        if box.loop.task_json(task_id) is None:
            raise ApiError(400, "No task with this id")
        given = urllib.parse.parse_qs(req.path.partition("?")[2], keep_blank_values=True)
        if given.get("follow", ["true"])[-1] not in ("1", "true", "yes", "0", "false", "no"):
            raise ApiError(400, "follow must be true or false")
        path = box.log_file(task_id)
        return follow_log(req, task_id, path) if follow else send_log(req, path)
    finally:
        if follow:
            box.followers.leave(task_id)


def send_stream_head(req: "Handler", ctype: str, *headers: tuple[str, str]) -> None:
    """The status and headers of an answer of unknown length (events, an archive): the
    connection closes after it."""
    req.close_connection = True
    req.send_response(200)
    for key, value in (("Content-Type", ctype), *headers, ("Connection", "close")):
        req.send_header(key, value)
    req.end_headers()


def send_log(req: "Handler", path: str) -> None:
    """The log as it is now, streamed from the file in chunks (never read whole): its length
    is the file's size when we opened it; lines appended meanwhile wait for the next read."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        req.send_json(200, (b"", "application/jsonl"))
        return
    with f:
        left = os.fstat(f.fileno()).st_size
        req.send_response(200)
        req.send_header("Content-Type", "application/jsonl")
        req.send_header("Content-Length", str(left))
        req.end_headers()
        while left > 0:
            chunk = f.read(min(left, 65536))
            if not chunk:                 # shorter than its size said: the length is wrong
                req.close_connection = True
                break
            req.wfile.write(chunk)
            left -= len(chunk)


def follow_log(req: "Handler", task_id: str, path: str) -> None:
    """?follow=1: Server-Sent Events, one per log line, read on from a file offset in bounded
    chunks; woken only by lines of this task; `event: end` once the task has ended."""
    box = req.box
    send_stream_head(req, "text/event-stream")
    last_beat, partial, f = time.monotonic(), b"", None
    with box.log_followers.follow(task_id) as watch, contextlib.ExitStack() as stack:
        while not box.loop.stopped() and not session_ended(req):
            seen = watch.generation
            ended = box.loop.task_state(task_id) not in ACTIVE_STATES
            if f is None:
                with contextlib.suppress(FileNotFoundError):
                    f = stack.enter_context(open(path, "rb"))
            while f is not None and (chunk := f.read(65536)):
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                req.wfile.write(b"".join(b"data: " + line + b"\n\n" for line in lines))
            if ended:
                state = box.loop.task_state(task_id)
                req.wfile.write(b"event: end\ndata: " + json.dumps({"state": state}).encode() +
                                b"\n\n")
                req.wfile.flush()
                return None
            if time.monotonic() - last_beat > 15:
                req.wfile.write(b": keep-alive\n\n")
                last_beat = time.monotonic()
            req.wfile.flush()
            watch.wait(seen, 5.0)


def h_workspaces_list(req: "Handler", params: dict[str, str]) -> Any:
    box = req.box
    names = sorted(n for n in os.listdir(box.path("workspaces")) if box.views.workspace_exists(n))
    return 200, [box.workspace_snapshot(n) for n in names]


h_workspaces_create = loop_handler(201, "create_workspace", body=True)


def h_workspace_get(req: "Handler", params: dict[str, str]) -> Any:
    return 200, req.box.workspace_snapshot(params["name"], True)


def h_workspace_files(req: "Handler", params: dict[str, str]) -> Any:
    box, name = req.box, workspace_named(req.box, params["name"])
    rel = clean_relpath(params.get("path", ""))
    view = box.loop.call(box.views.view_fd, name)
    try:
        try:
            # a FIFO or device a task left opens at once (and is refused below), never blocks
            fd = open_beneath(view, rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except SysError as exc:
            if exc.code == errno.ENOENT or exc.code == errno.ENOTDIR:
                raise ApiError(404, f"no such file: {rel}", "not_found") from None
            if exc.code in (errno.EXDEV, errno.ELOOP):
                raise ApiError(400, f"the path leaves the workspace: {rel}") from None
            raise ApiError(400, f"cannot open {rel}: {exc.stderr}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                entries = []
                with os.scandir(fd) as it:
                    for entry in it:
                        est = entry.stat(follow_symlinks=False)
                        kind = ("directory" if stat.S_ISDIR(est.st_mode) else
                                "symlink" if stat.S_ISLNK(est.st_mode) else
                                "file" if stat.S_ISREG(est.st_mode) else "other")
                        entries.append({"name": entry.name, "type": kind, "size": est.st_size})
                entries.sort(key=lambda e: e["name"])
                return 200, {"workspace": name, "path": rel, "entries": entries}
            if not stat.S_ISREG(st.st_mode):
                raise ApiError(400, f"not a regular file: {rel}")
            req.send_response(200)
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(st.st_size))
            req.end_headers()
            with os.fdopen(os.dup(fd), "rb") as f:
                shutil.copyfileobj(f, req.wfile, 65536)
            return None
        finally:
            os.close(fd)
    finally:
        os.close(view)


def h_settings_get(req: "Handler", params: dict[str, str]) -> Any:
    return 200, dict(req.box.setting())


h_settings_put = loop_handler(200, "put_settings", body=True)


def h_approvals_list(req: "Handler", params: dict[str, str]) -> Any:
    state = req.query_one("state")
    if state is not None and state not in APPROVAL_STATES:
        raise ApiError(400, f"state must be one of: {', '.join(APPROVAL_STATES)}")
    return 200, req.box.broker.list_snapshot(state, req.query_one("task"))


def h_approval_get(req: "Handler", params: dict[str, str]) -> Any:
    row = req.box.broker.rendered.get(params["id"])
    if row is None:
        raise ApiError(404, "No approval with this id", "not_found")
    return 200, row[3]


def _reason(body: dict[str, Any]) -> str | None:
    if set(body) - {"reason"}:
        raise ApiError(400, f"unknown field: {sorted(set(body) - {'reason'})[0]}")
    return check_reason(body.get("reason"))


def h_approval_approve(req: "Handler", params: dict[str, str]) -> Any:
    body = req.json_body(optional=True)
    changes = {k: body.pop(k) for k in ("args", "budgetCents") if k in body}
    reason = _reason(body)
    if len(changes) > 1:
        raise ApiError(400, "give args or budgetCents, not both")
    if "args" in changes and not isinstance(changes["args"], dict):
        raise ApiError(400, "args must be a JSON object: the tool's arguments")
    if "budgetCents" in changes and not is_cents(changes["budgetCents"]):
        raise ApiError(400, "budgetCents must be a number")
    return 200, req.box.loop.call(req.box.broker.approve, params["id"], reason,
                             changes.get("args"), changes.get("budgetCents"))


def h_approval_deny(req: "Handler", params: dict[str, str]) -> Any:
    reason = _reason(req.json_body(optional=True)) or "denied by the owner"
    return 200, req.box.loop.call(req.box.broker.answer, params["id"], "denied", reason, None)


def h_approval_answer(req: "Handler", params: dict[str, str]) -> Any:
    body = req.json_body()
    if set(body) != {"answer"} or not isinstance(body["answer"], str) or \
            len(body["answer"]) > 10000:
        raise ApiError(400, 'the body must be {"answer": "..."} (at most 10000 characters)')

    def answer() -> Any:
        if req.box.broker.get(params["id"]).kind != "ask":
            raise ApiError(409, "only an ask is answered; approve or deny this one", "conflict")
        return req.box.broker.answer(params["id"], "approved", None, body["answer"])
    return 200, req.box.loop.call(answer)


def h_approvals_approve_all(req: "Handler", params: dict[str, str]) -> Any:
    body = req.json_body(optional=True)
    if set(body) - {"task"} or not isinstance(body.get("task", ""), str):
        raise ApiError(400, 'the body must be {} or {"task": "<id>"}')
    return 200, req.box.loop.call(req.box.broker.approve_all, body.get("task"))


# decisions: always-approve and policies
def h_policies_create(req: "Handler", params: dict[str, str]) -> Any:
    fields = validate_policy_body(req.json_body())
    return 201, req.box.loop.call(lambda: req.box.broker.policies.add(fields, "api").to_api())


def h_wallet_get(req: "Handler", params: dict[str, str]) -> Any:
    return 200, req.box.broker.wallet      # a snapshot (Broker.wallet): any thread may read


h_approval_always = loop_handler(200, "broker.always", "id", body=True)
h_policies_list = loop_handler(200, "broker.policies.listing")
h_policy_delete = loop_handler(200, "broker.policies.delete", "id")
h_wallet_put = loop_handler(200, "broker.set_balance", body=True)


def h_tools(req: "Handler", params: dict[str, str]) -> Any:
    return 200, req.box.broker.tools()     # constants and a folder listing: any thread


def h_events(req: "Handler", params: dict[str, str]) -> Any:
    """Server-Sent Events: every state a task takes and approvals made or answered, as they
    come.  ?since=ID or the Last-Event-ID header (a browser's EventSource sends it when it
    reconnects) replays what followed that id; past the kept window, `event: reset` first."""
    box = req.box
    since = req.query_one("since") or (req.headers.get("Last-Event-ID") or "").strip()
    if since and not is_digits(since):
        raise ApiError(400, "since (or Last-Event-ID) must be an event id")
    last = int(since) if since else box.loop.last_event()
    send_stream_head(req, "text/event-stream")
    req.wfile.write(b": gurtd events\n\n")
    missed, fresh = box.loop.events_after(last)
    if missed:
        req.wfile.write(b"event: reset\ndata: %s\n\n" % json.dumps(
            {"missed": True, "after": last, "next": fresh[0][0] if fresh else None}).encode())
        if not fresh:
            last = box.loop.last_event()
    req.wfile.flush()
    beat = time.monotonic()
    while not box.loop.stopped() and not session_ended(req):
        if not fresh:
            box.loop.wait_event(last, 1.0)
            missed, fresh = box.loop.events_after(last)
            if missed:      # a reader slower than EVENTS_KEPT events
                req.wfile.write(b"event: reset\ndata: %s\n\n" % json.dumps(
                    {"missed": True, "after": last}).encode())
        for seq, kind, data in fresh:
            req.wfile.write(b"id: %d\nevent: %s\ndata: %s\n\n" % (seq, kind.encode(), data))
            last = seq
        fresh = []
        if time.monotonic() - beat > 15:
            req.wfile.write(b": keep-alive\n\n")
            beat = time.monotonic()
        req.wfile.flush()
    return None


def h_task_keep(req: "Handler", params: dict[str, str]) -> Any:
    return 200, req.box.review.keep_request(params["id"], req.json_body(optional=True))


def peer_gone(sock: socket.socket) -> bool:
    """Whether the client at the other end of sock has closed it (read at once, no wait)."""
    readable, _, _ = select.select([sock], [], [], 0)
    try:
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def h_task_diff(req: "Handler", params: dict[str, str]) -> Any:
    """The task's changes as a unified diff, read in this thread (never on the loop), within a
    DiffBudget; a client that leaves ends the work (DiffStopped is a ConnectionError)."""
    box = req.box
    only = req.query_one("path")           # a filter only: never opened as it is
    if only is not None:
        only = only if only.startswith("/") else only.strip("/")
    source = box.loop.call(box.review.sources, params["id"])
    budget = DiffBudget(gone=lambda: peer_gone(req.request))
    if source["folders"]:
        parts = [part for folder, upper, info in source["folders"]
                 for part in folder_diff(folder, upper, info, only, budget)]
    elif source["layer"] is not None:
        parts = layer_diff(source["layer"][0], source["layer"][1], only, budget)
    else:
        parts = []
    return 200, (budget.final_bytes(parts), "text/x-diff; charset=utf-8")


def h_openapi(req: "Handler", params: dict[str, str]) -> Any:
    host = req.box.listen.rpartition(":")[0] or "127.0.0.1"
    host = f"[{host.strip('[]')}]" if ":" in host else host
    return 200, openapi(f"http://{host}:{req.server.server_address[1]}")


@dataclass
class Route:
    """One route, whole: what the router matches, what dispatch asks before the handler runs,
    and its OpenAPI operation (the OpenAPI section makes the description of them).

    path is a pattern: {name} matches one segment, {path} the rest.  open: no bearer token or
    session is asked (the handler checks what it needs: a sign-in, a signature; or nothing).
    streamed: the handler reads its own body, up to LIMIT_MAX (files in).  The operation:
    query and headers map a name to (schema, description[, True: required]); params gives a
    path parameter's schema where the id, name or path one does not fit; body is (schema,
    required[, content types]), JSON unless said; answers map a status to a description (an
    Error) or to (description, content[, headers]), where content is a JSON schema or a dict
    of content types, and headers map a name to (schema, description, required).  A route
    without answers still gets a minimal valid description (undocumented_routes lists them).
    """

    method: str
    path: str
    handler: Callable[..., Any]
    summary: str
    operation_id: str = ""                 # "" : auto_operation_id's
    tag: str = ""                          # "" : the path's second segment
    answers: dict[int, Any] = field(default_factory=dict)
    body: tuple[Any, ...] | None = None
    query: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    headers: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    open: bool = False
    streamed: bool = False
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = re.escape(self.path).replace(r"\{path\}", "(?P<path>.*)")
        self.regex = re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", regex) + "$")


# The schemas the routes' requests and answers name; the component schemas (Task, Settings...)
# are made from the validation tables in the OpenAPI section and named by _ref.

def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


NAME_SCHEMA = {"type": "string", "pattern": r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,64}$",
               "description": "A workspace: a folder in BOX_HOME/workspaces.",
               "examples": ["home"]}
BINARY = {"type": "string", "format": "binary"}
JSONL = "application/jsonl"
SSE = {"type": "object", "description": "One Server-Sent Event", "properties": {
    "event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"},
    "retry": {"type": "integer"}}}
REASON_BODY = {"type": "object", "additionalProperties": False, "properties": {
    "reason": {"type": "string", "maxLength": 2000, "description": "Handed back to the task."}}}
APPROVE_BODY = {"type": "object", "additionalProperties": False,
                "not": {"required": ["args", "budgetCents"]}, "properties": {
    **REASON_BODY["properties"],
    "args": {"type": "object", "description": "Run the call with these arguments instead "
                                              "(a tool call only; checked like the task's); "
                                              "of a conflict, ConflictAnswer"},
    "budgetCents": {"type": "number", "description": "Raise the task's budget to this (a "
                                                     "budget approval only; not with args)"}}}
CENTS_OR_NULL = {"type": ["number", "null"], "minimum": 0}
POLICY_LIMITS = {
    "maxCents": {**CENTS_OR_NULL, "description": "At most this per call"},
    "totalCents": {**CENTS_OR_NULL, "description": "At most this over the policy's life"},
    "expiresAt": {"type": ["string", "null"], "format": "date-time",
                  "description": "Not after this time (with its zone), e.g. "
                                 "2026-12-01T00:00:00Z"},
    "reason": {"type": ["string", "null"], "maxLength": 2000}}
SCHEDULE_ID = {"type": "string", "description": "A schedule id.", "examples": ["s3k9x2a1b2"]}
HOOK_NAME = {"type": "string", "pattern": HOOK_NAME_RE.pattern, "description": "A hook's name"}
PORTAL_ONLY = ({"type": "string", "enum": ["1"]},
               "Sent by the portal's own page; no cross-site form can send it", True)
UPLOAD_REFUSALS = {   # what both ways of putting files in answer besides their own 400
    404: "No workspace of this name",
    409: "A folder where the workspace has a file or a link (or the reverse), or too many "
         "layers",
    413: "Larger than uploadMaxBytes", 507: "The disk is full"}
UPLOAD_TASK = ("The upload's task: done, a layer of its own", _ref("Task"))
DELETED = ("Deleted", {"type": "object", "required": ["deleted"],
                       "properties": {"deleted": {"type": "string"}}})
NOT_ANSWERED = "The disk is full: nothing was answered"

ROUTES: list[Route] = [
    Route("GET", "/api/health", h_health, "Is gurtd up (no token needed)",
          "getHealth", "service", open=True, answers={200: ("gurtd is up", _ref("Health"))}),
    Route("GET", "/api/tasks", h_tasks_list,
          "List tasks, newest first (?state= ?workspace= ?limit= ?fields=id,state)",
          "listTasks",
          query={"state": ({"type": "string", "enum": list(STATES)}, "Only tasks in this state"),
                 "workspace": ({"type": "string"}, "Only tasks of this workspace"),
                 "limit": (TASKS_LIMIT, "At most this many")},
          answers={200: ("Tasks, newest first", _array(_ref("Task"))),
                   400: "A query parameter is wrong"}),
    Route("POST", "/api/tasks", h_tasks_create, "Create a task",
          "createTask", body=(_ref("TaskCreate"), True),
          answers={201: ("The task, queued", _ref("Task")),
                   400: "A field is wrong, the workspace does not exist, the droid worker has "
                        "no Droid CLI, or a folder is refused (personal: not a folder under "
                        "folderRoots, or inside another)",
                   507: "The disk is full: nothing was created"}),
    Route("GET", "/api/tasks/{id}", h_task_get, "Read a task", "getTask",
          answers={200: ("The task", _ref("Task")), 400: "No task with this id"}),
    Route("POST", "/api/tasks/{id}/undo", h_task_undo, "Undo a task", "undoTask",
          body=({"type": "object", "additionalProperties": False, "properties": {
              "force": {"type": "boolean", "default": False,
                        "description": "Personal: put the versions from before the keep back "
                                       "even over the owner's later edits"}}}, False),
          answers={200: ("The task, now undone; if later tasks copied its files, its "
                         "undoMerge names what was taken out of their copies and each copy "
                         "kept whole (with the task that holds it)", _ref("Task")),
                   400: "No task with this id, or the body is wrong",
                   409: ("Personal: kept paths the owner changed since the keep (each named "
                         "in conflicts): nothing was undone; or paths that could not be put "
                         "back (notUndone): the others were, the task stays kept, and the "
                         "next undo tries them again", _ref("Conflict")),
                   507: "The disk is full: the undo goes on with the next undo"}),
    Route("POST", "/api/tasks/{id}/stop", h_task_stop, "Stop a task: it fails with error stopped",
          "stopTask",
          answers={200: ("The task, failed with error stopped", _ref("Task")),
                   400: "No task with this id", 409: "The task has ended already"}),
    Route("GET", "/api/tasks/{id}/log", h_task_log, "A task's log as JSON lines (?follow=1: SSE)",
          "getTaskLog",
          query={"follow": ({"type": "boolean"},
                            "true: Server-Sent Events, one per log line as it comes, then "
                            "`event: end` once the task has ended")},
          answers={200: ("The log as JSON lines; with follow, an event stream",
                         {JSONL: {"type": "string"}, "text/event-stream": SSE}),
                   400: "No task with this id", 429: "The log has too many followers"}),
    Route("GET", "/api/tasks/{id}/changes", h_task_changes, "A task's layer: [{path, change}]",
          "getTaskChanges",
          answers={200: ("The task's layer against the view it was made on, or that its "
                         "finish-time merge joined it with (empty once the layer is deleted); "
                         "undo takes its change out of later copies too",
                         _array(_ref("Change"))),
                   400: "No task with this id"}),
    Route("GET", "/api/workspaces", h_workspaces_list, "List workspaces", "listWorkspaces",
          answers={200: ("Every workspace", _array(_ref("Workspace")))}),
    Route("POST", "/api/workspaces", h_workspaces_create, "Create an empty workspace",
          "createWorkspace",
          body=({"type": "object", "additionalProperties": False, "required": ["name"],
                 "properties": {"name": NAME_SCHEMA}}, True),
          answers={201: ("The new, empty workspace", _ref("Workspace")),
                   400: "The name is not a workspace name", 409: "It exists"}),
    Route("GET", "/api/workspaces/{name}", h_workspace_get, "A workspace and its stack",
          "getWorkspace",
          answers={200: ("The workspace and its stack, newest first", _ref("Workspace")),
                   404: "No workspace of this name"}),
    Route("GET", "/api/workspaces/{name}/files", h_workspace_files, "The view's top folder",
          "listWorkspaceTop", "files",
          answers={200: ("The top folder of the current view", _ref("FileList")),
                   404: "No workspace of this name"}),
    Route("GET", "/api/workspaces/{name}/files/{path}", h_workspace_files,
          "A file of the workspace's current view, or a folder's listing",
          "getWorkspaceFile", "files",
          answers={200: ("A folder's listing, or a file's content",
                         {"application/json": _ref("FileList"),
                          "application/octet-stream": BINARY}),
                   400: "The path leaves the workspace, or is not a file or folder",
                   404: "No such workspace or file"}),
    Route("GET", "/api/approvals", h_approvals_list,
          "List approvals, newest first (?state=pending|approved|denied ?task=)",
          "listApprovals",
          query={"state": ({"type": "string", "enum": list(APPROVAL_STATES)},
                           "Only approvals in this state"),
                 "task": ({"type": "string"}, "Only approvals of this task")},
          answers={200: ("Approvals, newest first", _array(_ref("Approval"))),
                   400: "A query parameter is wrong"}),
    Route("GET", "/api/approvals/{id}", h_approval_get, "Read an approval", "getApproval",
          answers={200: ("The approval", _ref("Approval")), 404: "No approval with this id"}),
    Route("POST", "/api/approvals/{id}/approve", h_approval_approve,
          "Approve a pending approval {reason?, args? | budgetCents?}: the call runs (with "
          "these args), or the task's budget is raised",
          "approveApproval", body=(APPROVE_BODY, False),
          answers={200: ("The approval, approved", _ref("Approval")),
                   400: "The body is wrong: both args and budgetCents, args the tool refuses, "
                        "or a budgetCents not above the task's cost with this call",
                   404: "No approval with this id",
                   409: "Answered already, an ask (answer it), args for what is not a tool "
                        "call, or budgetCents for what is not a budget approval",
                   507: NOT_ANSWERED}),
    Route("POST", "/api/approvals/{id}/deny", h_approval_deny,
          "Deny a pending approval {reason?}: the call returns a refusal carrying the reason",
          "denyApproval", body=(REASON_BODY, False),
          answers={200: ("The approval, denied", _ref("Approval")),
                   400: "The body is wrong", 404: "No approval with this id",
                   409: "Answered already", 507: NOT_ANSWERED}),
    Route("POST", "/api/approvals/{id}/answer", h_approval_answer, "Answer an ask {answer}",
          "answerApproval",
          body=({"type": "object", "additionalProperties": False, "required": ["answer"],
                 "properties": {"answer": {"type": "string", "maxLength": 10000}}}, True),
          answers={200: ("The ask, answered", _ref("Approval")),
                   400: "The body is wrong", 404: "No approval with this id",
                   409: "Not an ask, or answered already", 507: NOT_ANSWERED}),
    Route("POST", "/api/approvals/approve-all", h_approvals_approve_all,
          "Approve every pending spending and host {task?}: {approved: n, skipped: m}",
          "approveAllApprovals",
          body=({"type": "object", "additionalProperties": False,
                 "properties": {"task": {"type": "string"}}}, False),
          answers={200: ("How many were approved, and how many need a person's own look "
                         "(asks, disk approvals, calls above neverAutoApproveCents)", {
                             "type": "object", "required": ["approved", "skipped"],
                             "properties": {"approved": {"type": "integer", "minimum": 0},
                                            "skipped": {"type": "integer", "minimum": 0}}}),
                   400: "The body is wrong", 507: "The disk is full"}),
    Route("GET", "/api/wallet", h_wallet_get, "The wallet: balance and ledger", "getWallet",
          answers={200: ("The balance and the ledger", _ref("Wallet"))}),
    Route("PUT", "/api/wallet", h_wallet_put, "Set the wallet's balance {balanceCents}",
          "setWalletBalance",
          body=({"type": "object", "additionalProperties": False, "required": ["balanceCents"],
                 "properties": {"balanceCents": {"type": "number", "minimum": 0}}}, True),
          answers={200: ("The wallet", _ref("Wallet")), 400: "The body is wrong",
                   507: "The disk is full: the balance is unchanged"}),
    Route("GET", "/api/tools", h_tools, "The tools tasks can be granted", "listTools",
          answers={200: ("The tools a task can be granted", _array(_ref("Tool")))}),
    Route("GET", "/api/events", h_events,
          "Server-Sent Events: task state changes, approvals made and answered",
          "streamEvents", "service",
          query={"since": ({"type": "string", "pattern": "^[0-9]+$"},
                           "Replay what followed this event id (or send Last-Event-ID)")},
          headers={"Last-Event-ID": ({"type": "string", "pattern": "^[0-9]*$"},
                                     "What a browser's EventSource sends when it reconnects: "
                                     "the same as since")},
          answers={200: ("Server-Sent Events: task states, approvals made and answered",
                         {"text/event-stream": SSE}),
                   400: "since is not an event id"}),
    Route("GET", "/api/settings", h_settings_get, "Read settings", "getSettings",
          answers={200: ("Every setting", _ref("Settings"))}),
    Route("PUT", "/api/settings", h_settings_put, "Change settings", "putSettings",
          body=(_ref("SettingsUpdate"), True),
          answers={200: ("Every setting, after the change", _ref("Settings")),
                   400: "A setting is wrong (named); nothing changed",
                   507: "The disk is full: nothing changed"}),
    # personal mode: review
    Route("POST", "/api/tasks/{id}/keep", h_task_keep,
          "Keep a personal task's folder changes {force?, paths?}: 409 conflict names the paths",
          "keepTask",
          body=({"type": "object", "additionalProperties": False, "properties": {
              "force": {"type": "boolean", "default": False,
                        "description": "Keep over paths the owner changed after the start "
                                       "(never over other conflicts)"},
              "paths": {"type": "array", "minItems": 1,
                        "items": {"type": "string", "minLength": 1},
                        "description": "Keep only these (absolute, or relative to a folder) "
                                       "and what is under them; the rest stays pending"}}},
                False),
          answers={200: ("The task, its changes now in its real folders", _ref("Task")),
                   400: "No task with this id, not a personal task, or the body is wrong (a "
                        "path that is no pending change is named)",
                   409: ("Nothing was kept: conflicts (each named in conflicts); or the review "
                         "is not pending or conflict; or the keep stopped (it goes on with the "
                         "next keep or at the next start)", _ref("Conflict")),
                   507: "The disk is full: the keep goes on with the next keep"}),
    Route("GET", "/api/tasks/{id}/diff", h_task_diff,
          "A task's changes as a unified diff (?path=): its folders, or its layer",
          "getTaskDiff",
          query={"path": ({"type": "string"},
                          "Only this file or folder (absolute in a folder, or relative)")},
          answers={200: ("A unified diff of its folders' pending changes (personal), or of its "
                         "layer against the view it was made on or merged with; empty when "
                         "there is none; a file too costly to diff (10 s each, 30 s and 64 MiB "
                         "an answer) is named as changed with its sizes",
                         {"text/x-diff": {"type": "string"}}),
                   400: "No task with this id"}),
    # decisions
    Route("POST", "/api/approvals/{id}/always", h_approval_always,
          "Approve and record a policy {scope: task|workspace|box, maxCents?, totalCents?, "
          "expiresAt?, reason?}: later calls like it run without asking",
          "alwaysApproveApproval",
          params={"id": {"type": "string", "description": "An approval id."}},
          body=({"type": "object", "additionalProperties": False, "required": ["scope"],
                 "properties": {"scope": {"type": "string", "enum": list(POLICY_SCOPES)},
                                **POLICY_LIMITS}}, True),
          answers={200: ("The approval, approved; policy names the policy made",
                         _ref("Approval")),
                   400: "The body is wrong, or its limits would not allow this very call",
                   404: "No approval with this id",
                   409: "Not offered (alwaysBlockedReason says why: answered, an ask, a disk "
                        "approval, model spending, above neverAutoApproveCents), the task is "
                        "gone, or the box has too many policies",
                   507: NOT_ANSWERED}),
    Route("GET", "/api/policies", h_policies_list, "List policies (always-approve), newest first",
          "listPolicies", answers={200: ("Policies, newest first", _array(_ref("Policy")))}),
    Route("POST", "/api/policies", h_policies_create,
          "Create a policy {tool, scope, task?|workspace?, host?, maxCents?, totalCents?, "
          "expiresAt?, reason?}",
          "createPolicy", body=(_ref("PolicyCreate"), True),
          answers={201: ("The policy", _ref("Policy")),
                   400: "A field is wrong (named), task or workspace missing or not matching "
                        "scope, host missing or not matching tool host, an ask, or no such "
                        "task or workspace",
                   409: f"The box has {MAX_POLICIES} policies: delete some first",
                   507: "The disk is full: nothing was created"}),
    Route("DELETE", "/api/policies/{id}", h_policy_delete,
          "Delete a policy: matching calls ask again", "deletePolicy",
          params={"id": {"type": "string", "description": "A policy id."}},
          answers={200: ("The policy deleted: matching calls ask again", _ref("Policy")),
                   404: "No policy with this id", 507: "The disk is full: it stays"}),
    # files in and out
    Route("PUT", "/api/workspaces/{name}/files/{path}", h_workspace_put_file,
          "Put one file (the body is its content) as a layer of its own: the upload's task",
          "putWorkspaceFile", "files", streamed=True,
          body=(BINARY, False, ("application/octet-stream",)),   # none: an empty file
          answers={201: UPLOAD_TASK, 400: "A bad path", **UPLOAD_REFUSALS}),
    Route("POST", "/api/workspaces/{name}/upload", h_workspace_upload,
          "Upload a tar archive (plain or gzip) as a layer of its own: the upload's task",
          "uploadWorkspaceArchive", "files", streamed=True,
          body=(BINARY, True, ("application/x-tar", "application/gzip",
                               "application/octet-stream")),
          answers={201: UPLOAD_TASK, 400: "Not a tar archive, or a member is refused (named)",
                   **UPLOAD_REFUSALS}),
    Route("GET", "/api/workspaces/{name}/archive", h_workspace_archive,
          "The workspace's current view as a tar.gz, streamed",
          "getWorkspaceArchive", "files",
          answers={200: ("The current view as a tar.gz", {"application/gzip": BINARY}),
                   404: "No workspace of this name"}),
    Route("GET", "/api/tasks/{id}/archive", h_task_archive,
          "What a finished task added or changed, as a tar.gz",
          "getTaskArchive", "files",
          answers={200: ("What the task added or changed, as a tar.gz",
                         {"application/gzip": BINARY}),
                   400: "No task with this id",
                   409: "The task has not ended, or its layer is deleted"}),
    # portal
    Route("GET", "/", h_portal, "The portal: one page to watch tasks and answer decisions",
          "getPortal", "portal", open=True,
          query={"code": ({"type": "string"}, "A one-time sign-in code (gurtd portal): the "
                          "page signs in with it")},
          answers={200: ("The portal's page (the same static page for everyone)",
                         {"text/html": {"type": "string"}}),
                   403: "A Host header or an Origin gurtd does not answer",
                   500: "The page is missing (portal.html beside gurtd.py)"}),
    Route("POST", "/api/sessions", h_sessions_create,
          "Sign the portal in {code} or {token}: sets the session cookie",
          "signIn", "portal", open=True, headers={PORTAL_HEADER: PORTAL_ONLY},
          body=({"type": "object", "additionalProperties": False, "minProperties": 1,
                 "maxProperties": 1, "properties": {
                     "code": {"type": "string", "maxLength": 1000,
                              "description": "A one-time code (gurtd portal)"},
                     "token": {"type": "string", "maxLength": 1000,
                               "description": "The bearer token, pasted in the form"}}}, True),
          answers={201: ("Signed in", {
                       "type": "object", "required": ["signedIn"],
                       "properties": {"signedIn": {"type": "boolean", "const": True}}},
                       {"Set-Cookie": ({"type": "string"}, f"{SESSION_COOKIE}=...; "
                                       "HttpOnly; SameSite=Strict", True)}),
                   400: "The body is not {code} or {token}",
                   401: "The code is wrong, used or expired; or the token is wrong",
                   403: f"Without {PORTAL_HEADER}: 1, or from another site",
                   507: "The disk is full: nobody was signed in"}),
    Route("GET", "/api/sessions/current", h_session_current, "Is this browser signed in",
          "getCurrentSession", "portal", open=True,
          answers={200: ("Whether the session cookie sent is live, and its session", {
                       "type": "object", "required": ["signedIn"], "properties": {
                           "signedIn": {"type": "boolean"}, "session": _ref("Session")}}),
                   403: "A Host header or an Origin gurtd does not answer"}),
    Route("GET", "/api/sessions", h_sessions_list, "List the portal's live sessions",
          "listSessions", "portal",
          answers={200: ("The live sessions, newest first", _array(_ref("Session")))}),
    Route("DELETE", "/api/sessions/{id}", h_session_delete, "Revoke a session (sign out)",
          "revokeSession", "portal",
          params={"id": {"type": "string", "description": "A session id."}},
          answers={200: ("Revoked; one's own session also clears the cookie", {
                       "type": "object", "required": ["revoked"],
                       "properties": {"revoked": {"type": "string"}}},
                       {"Set-Cookie": ({"type": "string"}, "Clears the cookie (signing out) "
                                       "when the session was this browser's", False)}),
                   404: "No session with this id",
                   507: "The disk is full: the session stays"}),
    Route("POST", "/api/sessions/codes", h_sign_in_code,
          "A one-time sign-in code for the portal (bearer token only)",
          "createSignInCode", "portal", body=({"type": "object", "maxProperties": 0}, False),
          answers={201: ("A one-time code, for this long", {
                       "type": "object", "required": ["code", "path", "expiresInSeconds"],
                       "properties": {"code": {"type": "string"},
                                      "path": {"type": "string", "description": "/?code="},
                                      "expiresInSeconds": {"type": "number"}}}),
                   400: "The body is not {} or empty",
                   403: "Asked with the portal's cookie: codes are made with the bearer token "
                        "only (or a Host or Origin gurtd does not answer)"}),
    # sources: schedules and hooks
    Route("GET", "/api/schedules", h_schedules_list, "List schedules with their next runs",
          "listSchedules",
          answers={200: ("Schedules, oldest first, with their next runs",
                         _array(_ref("Schedule")))}),
    Route("POST", "/api/schedules", h_schedules_create,
          "Create a schedule {name, cron, timezone?, task, enabled?, overlap?}",
          "createSchedule", body=(_ref("ScheduleCreate"), True),
          answers={201: ("The schedule", _ref("Schedule")),
                   400: "A field is wrong (named): a cron line that is not five fields or "
                        "never matches, an unknown time zone, a task field, a workspace that "
                        "does not exist",
                   409: f"The box has {MAX_SCHEDULES} schedules",
                   507: "The disk is full: nothing was created"}),
    Route("GET", "/api/schedules/{id}", h_schedule_get, "Read a schedule and its nextRuns",
          "getSchedule", params={"id": SCHEDULE_ID},
          answers={200: ("The schedule", _ref("Schedule")), 404: "No schedule with this id"}),
    Route("PUT", "/api/schedules/{id}", h_schedule_put, "Change a schedule (any of its fields)",
          "updateSchedule", params={"id": SCHEDULE_ID},
          body=(_ref("ScheduleUpdate"), True),
          answers={200: ("The schedule; a new cron line or time zone, or switching it on, "
                         "starts from now", _ref("Schedule")),
                   400: "A field is wrong (named)", 404: "No schedule with this id",
                   507: "The disk is full: nothing changed"}),
    Route("DELETE", "/api/schedules/{id}", h_schedule_delete, "Delete a schedule",
          "deleteSchedule", params={"id": SCHEDULE_ID},
          answers={200: DELETED, 404: "No schedule with this id",
                   507: "The disk is full: it stays"}),
    Route("POST", "/api/schedules/{id}/run", h_schedule_run, "Run a schedule now",
          "runSchedule", params={"id": SCHEDULE_ID},
          answers={201: ("Started: the run's task", {
                       "type": "object", "required": ["schedule", "task"], "properties": {
                           "schedule": _ref("Schedule"), "task": _ref("Task")}}),
                   202: ("Queued behind the active run (overlap queue)", {
                       "type": "object", "required": ["schedule", "queued"], "properties": {
                           "schedule": _ref("Schedule"),
                           "queued": {"type": "boolean", "const": True}}}),
                   400: "The task could not be made (named: e.g. its workspace is gone)",
                   404: "No schedule with this id",
                   409: "The previous run is still active (overlap skip): nothing started",
                   507: "The disk is full: nothing was started"}),
    Route("GET", "/api/hooks", h_hooks_list, "List hooks (never their secrets)", "listHooks",
          answers={200: ("Hooks by name, never their secrets", _array(_ref("Hook")))}),
    Route("POST", "/api/hooks", h_hooks_create,
          "Create a hook {name, source, task?, allow?}: its secret is answered this once",
          "createHook", body=(_ref("HookCreate"), True),
          answers={201: ("The hook, with its secret: answered this once", {
                       "allOf": [_ref("Hook"), {"type": "object", "required": ["secret"],
                                                "properties": {"secret": {
                                                    "type": "string",
                                                    "pattern": "^[0-9a-f]{64}$"}}}]}),
                   400: "A field is wrong (named)",
                   409: f"A hook of this name exists, or the box has {MAX_HOOKS} hooks",
                   507: "The disk is full: nothing was created"}),
    Route("DELETE", "/api/hooks/{name}", h_hook_delete, "Delete a hook",
          "deleteHook", params={"name": HOOK_NAME},
          answers={200: DELETED, 404: "No hook of this name", 507: "The disk is full: it stays"}),
    Route("POST", "/api/hooks/{name}", h_hook_deliver,
          "Deliver to a hook (no token: X-Gurt-Signature, X-Gurt-Timestamp, X-Gurt-Delivery)",
          "deliverToHook", open=True, params={"name": HOOK_NAME},
          headers={
              "X-Gurt-Signature": ({"type": "string", "pattern": "^sha256=[0-9a-fA-F]{64}$"},
                                   "sha256=<hex HMAC-SHA256 of TIMESTAMP.DELIVERY.BODY (the "
                                   "X-Gurt-Timestamp and X-Gurt-Delivery values and the raw "
                                   "body, joined by dots), keyed with the hook's secret>: the "
                                   "credential (no bearer token)", True),
              "X-Gurt-Timestamp": ({"type": "string", "pattern": "^[0-9]{1,12}$"},
                                   "When the delivery was signed, in Unix seconds: taken "
                                   f"within {DELIVERY_MAX_AGE:.0f} s after (and at most "
                                   f"{DELIVERY_SKEW:.0f} s before, a clock's skew)", True),
              "X-Gurt-Delivery": ({"type": "string", "pattern": DELIVERY_RE.pattern},
                                  "A unique id of this delivery: the same id again within a "
                                  "day is refused", True)},
          body=(_ref("HookDelivery"), True),
          answers={201: ("The task it started", _ref("Task")),
                   400: "A bad delivery id, not a JSON object, a field the hook does not let "
                        "a delivery set, or a task field that is wrong",
                   401: "A missing or wrong signature or timestamp, or no hook of this name "
                        "(the same answer, bad_signature); or a timestamp too old or ahead "
                        "(stale_delivery)",
                   403: "A Host header (not in hookHosts) or an Origin gurtd does not answer",
                   409: "This delivery id was taken already (a replay)",
                   503: "gurtd is busy; try again (Retry-After)",
                   429: ("Too many deliveries within a day (Retry-After)", _ref("Error"),
                         {"Retry-After": ({"type": "string"}, "Seconds", True)}),
                   507: "The disk is full: nothing was started"}),
    Route("GET", "/api/openapi.json", h_openapi, "This description", "getOpenapi", "service",
          answers={200: ("This description", {"type": "object"})}),
    # the model gateway's secret
    Route("GET", "/api/secrets", h_secrets_get, "Which secrets are set (never a secret itself)",
          "getSecrets", "settings", answers={200: ("Whether each secret is set", SECRETS_SCHEMA)}),
    Route("PUT", "/api/secrets/model", h_secret_model_put,
          "Set the owner's model key {key}: droid tasks call their model through the gateway",
          "putModelKey", "settings",
          body=({"type": "object", "additionalProperties": False, "required": ["key"],
                 "properties": {"key": {"type": "string", "pattern": "^[\\x21-\\x7e]{1,4096}$",
                                        "description": "Kept 0600 in BOX_HOME/secrets; never "
                                                       "answered, never in a task"}}}, True),
          answers={200: ("Whether each secret is set", SECRETS_SCHEMA),
                   400: "The body is wrong", 507: "The disk is full: nothing changed"}),
    Route("DELETE", "/api/secrets/model", h_secret_model_delete, "Remove the owner's model key",
          "deleteModelKey", "settings",
          answers={200: ("Whether each secret is set", SECRETS_SCHEMA)}),
]


def _route_key(pattern_or_path: str) -> str:
    """Routes are looked up by their first three path segments (/api/tasks/...)."""
    parts = pattern_or_path.split("/", 4)
    return "/".join(p if not p.startswith("{") else "*" for p in parts[:3])


ROUTES_BY_KEY: dict[str, list[Route]] = {}
for _route in ROUTES:
    ROUTES_BY_KEY.setdefault(_route_key(_route.path), []).append(_route)


def match_route(method: str, path: str) -> tuple[Route, dict[str, str]]:
    """The route and its path parameters, or ApiError 404 / 405 with Allow."""
    allowed = []
    for route in ROUTES_BY_KEY.get(_route_key(path), ()):
        m = route.regex.match(path)
        if m:
            if route.method == method:
                params = {k: (urllib.parse.unquote(v) if k != "path" else v)
                          for k, v in m.groupdict().items()}
                return route, params
            allowed.append(route.method)
    if allowed:
        raise ApiError(405, f"method {method} is not allowed here", "method_not_allowed",
                       {"Allow": ", ".join(sorted(set(allowed)))})
    raise ApiError(404, f"no route {path}", "not_found")


ENV_SECONDS_MAX = 30 * 86400             # the longest time GURT_*_SECONDS and deadlines take
_ENV_SECONDS_SAID: set[tuple[str, str]] = set()     # refused values already logged


def env_seconds(name: str, default: float) -> float:
    """A number of seconds from the environment (tests shorten limits this way), else default:
    one that is not a number over 0 and at most ENV_SECONDS_MAX is said in the log, once
    (a Jira exchange reads its deadline at each call)."""
    text = os.environ.get(name, "")
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if 0 < value <= ENV_SECONDS_MAX:
        return value
    if text and (name, text) not in _ENV_SECONDS_SAID:
        _ENV_SECONDS_SAID.add((name, text))
        log(4, f"{name}={text[:40]!r} is not seconds over 0 and at most {ENV_SECONDS_MAX}: "
               f"{default:g} is used")
    return default


class DeadlineReader(io.RawIOBase):
    """The request side of a connection, where a whole request must arrive by a deadline.

    A socket timeout bounds one read only, so a client that drips a byte every few seconds
    would hold a thread forever; here each read gets what is left of the request's time.
    Between requests (keep-alive) a read waits HANDLER_TIMEOUT; the first byte of a request
    starts its clock: the headers within HEADER_DEADLINE, all of it within REQUEST_DEADLINE.
    """

    def __init__(self, sock: socket.socket, limits: tuple[float, float]) -> None:
        super().__init__()
        self.sock = sock
        self.header_limit, self.request_limit = limits
        self.started: float | None = None     # the first byte of the current request
        self.deadline: float | None = None
        self.timed_out = False

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        self.started = self.deadline = None
        self.timed_out = False

    def headers_read(self) -> None:
        if self.started is not None:
            self.deadline = self.started + self.request_limit

    def readinto(self, buffer: Any) -> int:
        timeout = HANDLER_TIMEOUT
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                self.timed_out = True
                raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(timeout)
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            self.timed_out = True
            raise
        finally:
            self.sock.settimeout(HANDLER_TIMEOUT)   # writes keep the plain timeout
        if n and self.started is None:
            self.started = time.monotonic()
            self.deadline = self.started + self.header_limit
        return n


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        log_uncaught(*sys.exc_info(), thread="http")      # type: ignore[arg-type]

    def __init__(self, box: Box, host: str, port: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.box = box
        super().__init__((host, port), Handler)
        port = self.server_address[1]
        listen_host = box.listen.rpartition(":")[0].lower()
        self.hosts = {f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]", listen_host)}
        self.origins = {"http://" + h for h in self.hosts}
        self.expected_auth = ("Bearer " + box.token).encode()
        self.sessions = PortalSessions(box.path("sessions.json"), box.token)
        self.debug = bool(os.environ.get("GURT_DEBUG"))
        request = env_seconds("GURT_REQUEST_DEADLINE", REQUEST_DEADLINE)
        self.limits = (min(HEADER_DEADLINE, request), request)


ONE_SEND = 1 << 16                   # an answer up to this long leaves with its headers


class Handler(http.server.BaseHTTPRequestHandler):
    """One request: guard, route, auth, body, handler, JSON.  Methods you may call from a
    route handler: query_one, json_body, and the BaseHTTPRequestHandler writers.

    Keep-alive stays in step: every answer goes through send_response, which first reads and
    drops a body nobody read (drain_body), or marks the connection to be closed when the body
    cannot be skipped (chunked, too large, bad length).  Any method reaches dispatch, so a
    method we do not serve gets 405 with Allow, not http.server's 501.
    """

    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # even a garbled request line gets a status line
    server_version = "gurtd/" + VERSION
    sys_version = ""
    disable_nagle_algorithm = True   # headers and body leave at once, no delayed-ACK stall
    timeout = HANDLER_TIMEOUT
    server: Server
    body_left = -1                   # body bytes not read yet; -1: unknown, close after answering
    answered = False                 # a status line went out for this request
    session: PortalSession | None = None   # the portal session that authorized it

    @property
    def box(self) -> Box:
        return self.server.box

    def setup(self) -> None:
        super().setup()
        self.reader = DeadlineReader(self.connection, self.server.limits)
        self.rfile = io.BufferedReader(self.reader, 65536)

    def handle_one_request(self) -> None:
        """http.server's, with a deadline on the whole request and every method dispatched."""
        self.reader.next_request()
        self.body_left, self.answered, self.command, self.requestline = -1, False, "", ""
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = ""
                self.send_error(414)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            self.reader.headers_read()
            self.dispatch()
            self.wfile.flush()
        except TimeoutError as exc:   # the request's deadline, or a stalled reader of ours
            self.close_connection = True
            if self.answered or self.reader.started is None:
                return
            with contextlib.suppress(OSError):
                if self.reader.timed_out:
                    self.send_error(408, "the request did not arrive in time")
                else:
                    log(3, f"{self.command} {self.path}: TimeoutError: {exc}")
                    self.send_error(500, f"internal error: TimeoutError: {exc}")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        if self.server.debug:
            log(7, "http: " + format % args)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """http.server's own errors (bad request line, 414, 408...) as JSON too."""
        self.close_connection = True
        if not hasattr(self, "request_version"):
            self.request_version = self.default_request_version
        self.send_json(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def send_response(self, code: int, message: str | None = None) -> None:
        """Every answer starts here: first the request's unread body is dropped.  No answer
        is for a cache to keep (tasks, logs, settings, sessions, archives): no-store."""
        if code >= 200:
            self.drain_body()
            self.answered = True
        super().send_response(code, message)
        if code >= 200:
            self.send_header("Cache-Control", "no-store")

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        if isinstance(obj, tuple):
            body, ctype = obj
        else:
            body = obj if isinstance(obj, (bytes, bytearray)) else json_text(obj)
            ctype = "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        if self.command != "HEAD" and len(body) <= ONE_SEND and \
                self.request_version != "HTTP/0.9":   # 0.9: no headers, nor their buffer
            self._headers_buffer.append(b"\r\n" + body)    # with the headers: a send and a
            self.flush_headers()                           # segment less (GET ~1.1x)
            return
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def guard(self) -> None:
        """The request guard: a Host we answer to, and no browser cross-site request."""
        host = (self.headers.get("Host") or "").lower()
        if host not in self.server.hosts:     # a tunnel's name is taken on hook deliveries only
            name = host.rpartition(":")[0] if re.search(r":\d+$", host) else host
            if not (name in self.box.settings["hookHosts"] and self.command == "POST" and
                    HOOK_PATH_RE.match(self.path.partition("?")[0])):
                raise ApiError(403, "Host header not allowed", "host_not_allowed")
        origin = self.headers.get("Origin")
        if origin is not None and origin.lower() not in self.server.origins:
            raise ApiError(403, "cross-origin requests are refused", "cross_origin")
        if (self.headers.get("Sec-Fetch-Site") or "").lower() in ("cross-site", "same-site"):
            raise ApiError(403, "cross-origin requests are refused", "cross_origin")

    def authorize(self) -> None:
        self.session = None
        if self.headers.get("Authorization") is None and self.headers.get("Cookie"):
            return portal_authorize(self)
        given = self.headers.get("Authorization") or ""
        if not hmac.compare_digest(given.encode(), self.server.expected_auth):
            raise ApiError(401, "missing or wrong bearer token", "unauthorized")

    def query_one(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None

    def body_length(self, cap: int = MAX_BODY) -> int:
        """The declared body length, checked before anything is read: -1 when the body
        cannot be skipped and the connection must close after the answer."""
        lengths = self.headers.get_all("Content-Length") or ["0"]
        if self.headers.get("Transfer-Encoding") or not self.one_length(lengths):
            return -1
        return int(lengths[0]) if int(lengths[0]) <= cap else -1

    @staticmethod
    def one_length(lengths: list[str]) -> bool:
        return len(lengths) == 1 and is_digits(lengths[0].strip())

    def body_error(self) -> ApiError:
        """Why a body cannot be read (body_length said -1)."""
        if self.headers.get("Transfer-Encoding"):
            return ApiError(411, "send the body with Content-Length", "length_required")
        if not self.one_length(self.headers.get_all("Content-Length") or ["0"]):
            return ApiError(400, "bad Content-Length")
        return ApiError(413, f"the body is larger than {MAX_BODY} bytes", "too_large")

    def raw_body(self) -> bytes:
        """The request's body (at most MAX_BODY bytes: body_length), read whole."""
        if self.body_left < 0:
            raise self.body_error()
        length, self.body_left = self.body_left, -1     # a short read leaves it unknown
        data = self.rfile.read(length) if length else b""
        if len(data) < length:
            raise ApiError(400, "the body ended early")
        self.body_left = 0
        return data

    def json_body(self, optional: bool = False) -> dict[str, Any]:
        """The request's JSON object; with optional, an empty body is {}.  Anything but an
        object is a 400 here, so no route handler ever indexes a list, a number or null."""
        data = self.raw_body()
        if not data.strip():
            if optional:
                return {}
            raise ApiError(400, "the body must be a JSON object")
        try:
            body = json.loads(data)
        except RecursionError:
            raise ApiError(400, "JSON nested too deeply") from None
        except ValueError as exc:
            raise ApiError(400, f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def dispatch(self) -> None:
        self.body_left = self.body_length()
        try:
            self.guard()
            raw_path, _, query = self.path.partition("?")
            self.query = urllib.parse.parse_qs(query)
            route, params = match_route(self.command, raw_path)
            if not route.open:
                self.authorize()
            if route.streamed:                # files in: they check the length themselves
                self.body_left = self.body_length(LIMIT_MAX)
            if self.body_left < 0:
                raise self.body_error()            # any route: 400, 411 or 413, then close
            result = route.handler(self, params)
            if result is not None:
                self.send_json(*result)
        except ApiError as exc:
            body = {"error": exc.message}
            if exc.code:
                body["code"] = exc.code
            body.update(exc.extra)
            self.send_json(exc.status, body, exc.headers)
            if exc.status == 413:
                self.linger()
        except TimeoutError:
            raise                 # handle_one_request answers 408 (or 500) if it still can
        except (ConnectionError, BrokenPipeError):
            self.close_connection = True
        except Exception as exc:  # the one place an unexpected error becomes a 500
            log(3, f"{self.command} {self.path}: {type(exc).__name__}: {exc}")
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.send_json(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})

    def linger(self) -> None:
        """After a 413: read (and drop) what the client still sends, for a little while, so
        that it reads our answer instead of a reset."""
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(2.0)
            budget = 64 * MAX_BODY
            while budget > 0:
                data = self.connection.recv(65536)
                if not data:
                    break
                budget -= len(data)

    def drain_body(self) -> None:
        """Read and drop what is left of the request's body, so that keep-alive stays in step
        (it is never taken for the next request); a body that cannot be skipped closes the
        connection after this answer."""
        left, self.body_left = self.body_left, -1
        if left < 0:
            self.close_connection = True
            return
        while left > 0:
            chunk = self.rfile.read(min(left, 65536))
            if not chunk:
                self.close_connection = True
                return
            left -= len(chunk)
        self.body_left = 0


# OpenAPI #######################################################################################
###############################################################################################
# The OpenAPI description is generated: each Route gives its path, method, summary and
# operation (operationId, tag, query parameters, request body, every status with its content);
# the component schemas come from the tables that validate requests (TASK_FIELDS, TASK_LIMITS,
# ID_RE and WORKSPACE_RE, DEFAULT_SETTINGS and LIMIT_SETTINGS, the Approval record, the
# states), so the description cannot drift from what gurtd does.

LIMIT_ABOUT = {     # what each of TASK_LIMITS bounds, said in the Task schema
    "processes": "Processes and threads", "memoryBytes": "Memory, tmpfs pages included",
    "tmpBytes": "/tmp, /var/tmp, /dev/shm and HOME together",
    "logBytes": "Stored log; past it lines are counted"}
DATE_TIME = {"type": "string", "format": "date-time"}
STRING, NUMBER = {"type": "string"}, {"type": "number"}
TASK_SCHEMA: dict[str, Any] = {     # which are required is to_api's: api_schemas says
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": ID_RE.pattern},
        "title": {"type": "string", "description": "A short name for people."},
        "prompt": {"type": "string", "description": "For the fake worker, one command a line."},
        "workspace": {"type": "string", "default": "home", "pattern": WORKSPACE_RE.pattern},
        "worker": {"type": "string", "enum": list(WORKERS), "default": "droid"},
        "tools": {"type": "array", "items": STRING, "default": []},
        "hosts": {"type": "array", "items": STRING, "default": []}, "budgetCents": NUMBER,
        "source": {"type": "string", "default": "api"},
        "state": {"type": "string", "enum": list(STATES)},
        "user": {"type": "string", "description": "box-<id>"},
        "layers": {"type": "array", "items": STRING,
                   "description": "Finished tasks whose changes it saw, newest first."},
        "costCents": NUMBER, "step": STRING, "createdAt": DATE_TIME, "updatedAt": DATE_TIME,
        "error": STRING, "summary": STRING,
        "folder": {"type": "string", "description": "Personal: the first real folder the task "
                                                     "works on a copy of."},
        "folders": {"type": "array", "items": STRING, "maxItems": MAX_FOLDERS,
                    "description": "Personal: every real folder the task works on."},
        "review": {"type": "string", "enum": list(REVIEW_STATES),
                   "description": "Personal: done and waiting for the owner, kept, stopped by "
                                  "a conflict, or undone."},
        "schedule": {"type": "string", "description": "The schedule that started it."},
        "limits": {"type": "object", "additionalProperties": False,
                   "description": "What the task may take; on create, any of these overrides "
                                  "its setting; the task shows the effective values.",
                   "properties": {key: {"type": "integer", "minimum": low,
                                        "description": f"{LIMIT_ABOUT[key]} ({setting})."}
                                  for key, (setting, low) in TASK_LIMITS.items()}},
        "askHosts": {"type": "boolean", "description": "A name outside hosts asks a person (an "
                     "approval of kind host) instead of failing; default the askHostsDefault "
                     "setting."},
        "merged": {"type": "array", "items": STRING,
                   "description": "Paths its finish-time merge joined with the changes of "
                                  "tasks that ended while it ran (its diff and changes are "
                                  "then taken against the view it merged with); at most "
                                  f"{MERGE_CONFLICTS_SHOWN}, the first by name."},
        "moreMerged": {"type": "integer", "description": "How many paths it merged past "
                                                           "those `merged` names."},
        "undoMerge": {"type": "object", "required": ["reverted", "kept", "layer"],
                      "description": "Once undone, if a later task's layer was above it: its "
                                     "change taken out of later tasks' copies (reverted), or "
                                     "not (kept whole, and why).  The undo's answer holds it "
                                     "as soon as the paths are decided.",
                      "properties": {
                          "state": {"type": "string",
                                    "enum": ["checking", "writing", "waiting", "done",
                                             "failed"],
                                    "description": "done: as below; writing (an undo's "
                                    "answer): decided, its layer joins a moment later; "
                                    f"checking (an answer after {UNDO_ANSWER_WAIT:g} s): the "
                                    "task's record, log and a task event name the paths when "
                                    "the revert ends; waiting: the disk was full, read-only "
                                    "or failed with an I/O error (error), nothing reverted "
                                    "yet, the undone layer kept, built again at retryAt; "
                                    "failed: nothing reverted (error)"},
                          "error": STRING,
                          "retryAt": {"type": "string", "format": "date-time",
                                      "description": "waiting: when the revert is tried "
                                                     "again (the wait doubles up to "
                                                     f"{MERGE_RETRY_MAX / 60:g} minutes)"},
                          "reverted": {"type": "array", "items": STRING},
                          "moreReverted": {"type": "integer", "description":
                                           "Reverted past those `reverted` names (at most "
                                           f"{MERGE_CONFLICTS_SHOWN})"},
                          "moreKept": {"type": "integer", "description":
                                       "Kept whole past those `kept` names"},
                          "kept": {"type": "array", "items": {
                              "type": "object", "required": ["path", "task", "why"],
                              "properties": {"path": STRING,
                                             "task": {"type": "string", "description":
                                                      "The later task whose copy stays"},
                                             "why": STRING}}},
                          "layer": {"type": ["string", "null"], "description":
                                    "The undo's own layer (a task of worker upload) holding "
                                    "the reverted versions; null if none was needed"}}},
    },
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "type": [schema["type"], "null"]}


_LABEL, _TOP = "[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", "[a-z]([a-z0-9-]{0,61}[a-z0-9])?"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_PORT = "(:([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?"
HOST_SCHEMA = {   # parse_host's forms; refused besides: a wildcard under a public suffix, and
                  # an address or network touching absolute special-use space (grant_refusal)
    "type": "string", "maxLength": 259, "examples": ["example.com", "*.example.com:443"],
    "pattern": f"^((\\*\\.)?({_LABEL}\\.)+{_TOP}|{_TOP}|({_OCTET}\\.){{3}}{_OCTET}){_PORT}$"}
NET_SCHEMA = {"type": "string", "pattern": f"^({_OCTET}\\.){{3}}{_OCTET}/(3[0-2]|[12]?[0-9])$",
              "description": "An IPv4 network (no host bits) outside the absolute special "
                             "ranges, e.g. 10.0.0.0/8"}
ID_SCHEMA = {"type": "string", "description": "A task id.", "examples": ["t3k9x2a1b2"]}
APPROVAL_DECISIONS = {      # the Approval's fields of decisions: what a person changed
    "approvedArgs": {"description": "Approved with these arguments instead of args"},
    "budgetCents": {"type": ["number", "null"],
                    "description": "Approved by raising the task's budget to this"},
    "policy": {"type": ["string", "null"],
               "description": "The policy that approved it, or that always-approve made"},
    "canAlwaysApprove": {"type": "boolean", "description": "Whether POST .../always is offered"},
    "alwaysBlockedReason": {"type": ["string", "null"], "description": "Why not, when not"}}
PATH_SCHEMA = {"type": "string", "pattern": "^(?!([^/]*/)*\\.\\.(/|$))[^\\\\\\u0000]*$",
               "description": "A path inside the workspace; / as %2F (no .. part, no "
                              "backslash, no NUL: clean_relpath)"}


# Constraints of settings beyond their default's type (validate_settings says the same).
SETTING_SCHEMAS: dict[str, dict[str, Any]] = {
    "modelGateway": {"type": "object", "additionalProperties": False, "properties": {
        "api": {"type": "string", "enum": list(GATEWAY_APIS)},
        "baseUrl": {"type": "string", "description": "https://HOST[:PORT][/PATH], or http:// "
                                                     "to a loopback address"},
        "model": {"type": "string", "description": "The model droid asks for; empty: "
                                                   "droidModel"},
        "models": {"type": "array", "maxItems": 50, "items": {"type": "string"}},
        "maxOutputTokens": {"type": "integer", "minimum": 1, "maximum": 1 << 20}}},
    "droidFactoryKey": {"type": "boolean", "description": "FACTORY_API_KEY inside the box "
                        "(spending is then the task's own word); off: the gateway"},
    "defaultBudgetCents": {"type": "number", "minimum": 0},
    "maxRunningTasks": {"type": "integer", "minimum": 1, "maximum": 1000},
    "taskTimeoutSeconds": {"type": "integer", "minimum": 1, "maximum": 7 * 86400},
    "droidPath": {"type": "string", "description": "An absolute path, or empty."},
    "droidModel": {"type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,99}$"},
    "droidAutonomy": {"type": "string", "enum": ["low", "medium", "high"]},
    "droidHosts": {"type": "array", "items": HOST_SCHEMA},
    "droidPrices": {"type": "object", "additionalProperties": {
        "type": "object", "additionalProperties": False,
        "required": ["input", "output", "cacheRead", "cacheWrite"],
        "properties": {k: {"type": "number", "minimum": 0}
                       for k in ("input", "output", "cacheRead", "cacheWrite",
                                 "cacheWrite1h")}}},
    "dnsAllowedNets": {"type": "array", "maxItems": 100, "items": NET_SCHEMA},
    "upstreamDns": {"type": "string", "description": "HOST[:PORT], or empty."},
    "uploadMaxBytes": {"type": "integer", "minimum": 1 << 10, "maximum": LIMIT_MAX},
    "folderRoots": {"type": "array", "maxItems": 64, "items": {"type": "string", "minLength": 1},
                    "description": "Absolute, normal paths where a personal task's folders "
                                   "may be; none of the box's own places (/, /usr, /etc...)"},
    "neverAutoApproveCents": {**CENTS_OR_NULL, "description": "No policy approves a call "
                              "above this; null: no call is too large for a policy"},
    "jira": {"type": "object", "description": "{} (no Jira connection) or {baseUrl, email, "
             "token?, jql, workspace?, worker?, hosts?, tools?, budgetCents?, pollSeconds?, "
             "transitions?, enabled?}; the token is kept apart and never shown"},
    "hookHosts": {"type": "array", "maxItems": 20, "items": {
        "type": "string", "pattern": "^(?=.*\\.)[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$"},
        "description": "Host names (no port) hook deliveries may arrive under (a tunnel's)"},
}


# What a setting whose schema says nothing more is for (the portal's settings form shows it).
SETTING_HELP: dict[str, str] = {
    "defaultBudgetCents": "The budget of a task created without budgetCents",
    "maxRunningTasks": "Tasks past it stay queued, first in first out",
    "taskTimeoutSeconds": "A task still running after this fails with timed out",
    "droidModel": "The model; it needs a droidPrices entry, so that no model runs for free",
    "droidAutonomy": "droid's --auto: the box, not the CLI, is the boundary",
    "droidHosts": "Hosts added to droid tasks' grants",
    "droidPrices": "US cents per million input, output, cacheRead, cacheWrite (5-minute) and "
                   "cacheWrite1h (1-hour cache write; at least cacheWrite, twice input if "
                   "left out) tokens, by model",
    "modelGateway": "Where droid's model calls go: api anthropic or chat-completions, baseUrl, "
                    "model (empty: droidModel), more models; each needs a droidPrices entry",
    "dnsAllowedNets": "IPv4 networks of private space (10.0.0.0/8) that tasks' granted names "
                      "may resolve into",
    "askHostsDefault": "askHosts of a task created without it: a host not granted is asked",
    "uploadMaxBytes": "The largest upload: its body and its unpacked files",
    "taskMaxProcesses": "Processes and threads a task may have at once",
    "taskMemoryBytes": "Memory of a task, tmpfs pages included; 0: half of the machine's RAM",
    "taskTmpBytes": "/tmp, /var/tmp, /dev/shm and HOME of a task together",
    "taskLogBytes": "A task's stored log; past it lines are counted, not stored",
    "diskReserveBytes": "Space of BOX_HOME's file system that tasks cannot eat unasked; 0: the "
                        "smaller of 1 GiB and 5% of it",
}


def type_schema(value: Any) -> dict[str, Any]:
    """The JSON schema type of a default value (for a setting without its own schema)."""
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (list, "array")):
        if isinstance(value, kind):          # bool first: True is an int too
            return {"type": name}
    return {"type": "object"}


def setting_schema(key: str) -> dict[str, Any]:
    schema = dict(SETTING_SCHEMAS.get(key) or type_schema(DEFAULT_SETTINGS[key]))
    if key in LIMIT_SETTINGS:
        low, zero_ok = LIMIT_SETTINGS[key]
        schema = {"type": "integer", "maximum": LIMIT_MAX}
        if zero_ok:
            schema["anyOf"] = [{"const": 0}, {"minimum": low}]
        else:
            schema["minimum"] = low
    if key in SETTING_HELP:
        schema.setdefault("description", SETTING_HELP[key])
    schema["default"] = DEFAULT_SETTINGS[key]
    return schema


def api_schemas() -> dict[str, Any]:
    """The component schemas, from the records and tables that validate requests."""
    task = {"type": "object", "required": [k for k in PUBLIC_FIELDS if k not in OPTIONAL_FIELDS],
            "properties": json.loads(json.dumps(TASK_SCHEMA["properties"]))}    # to_api's
    task["properties"]["worker"]["enum"] = list(WORKERS) + [UPLOAD_WORKER]
    for key in PUBLIC_FIELDS:                 # a field added later is described, if loosely
        task["properties"].setdefault(key, {})
    create_rules: dict[str, dict[str, Any]] = {
        "title": {"minLength": 1, "maxLength": 200, "pattern": r"\S"},
        "prompt": {"minLength": 1, "pattern": r"\S"},
        "workspace": {"pattern": NAME_SCHEMA["pattern"]},
        "tools": {"items": {"type": "string", "maxLength": 64, "pattern": TOOL_RE.pattern}},
        "hosts": {"items": HOST_SCHEMA},
        "budgetCents": {"minimum": 0},
        "source": {"minLength": 1, "maxLength": 100}}
    types = {str: "string", list: "array", dict: "object", (int, float): "number", bool: "boolean"}
    create = {"type": "object", "additionalProperties": False, "required": ["title", "prompt"],
              "properties": {k: {**TASK_SCHEMA["properties"].get(k, {"type": types[kind]}),
                                 **create_rules.get(k, {})}
                             for k, kind in TASK_FIELDS.items()}}
    settings = {k: setting_schema(k) for k in DEFAULT_SETTINGS}
    approval_required = [f.name for f in dataclasses.fields(Approval)]   # to_api: asdict
    return {
        "Task": task, "TaskCreate": create,
        "Approval": {"type": "object", "required": approval_required, "properties": {
            "id": STRING, "task": STRING,
            "kind": {"type": "string", "enum": ["budget", "ask", "disk", "host", "conflict"],
                     "description": "budget (a spending above the task's budget), ask (a "
                     "question), disk (BOX_HOME is below its reserve), host (a name outside "
                     "the task's hosts, with askHosts), conflict (paths its finish-time merge "
                     "could not join; never answered by a policy)"},
            "tool": STRING, "cents": NUMBER, "question": _nullable(STRING),
            "args": {"description": "The call's arguments; of a conflict, ConflictArgs (its "
                                    "answer's args: ConflictAnswer)"},
            "state": {"type": "string", "enum": list(APPROVAL_STATES)},
            "createdAt": DATE_TIME,
            "reason": _nullable(STRING), "answer": _nullable(STRING),
            "answeredBy": _nullable(STRING), "answeredAt": _nullable(DATE_TIME),
            **APPROVAL_DECISIONS}},
        "Workspace": {"type": "object", "required": ["name", "layers"], "properties": {
            "name": {"type": "string"},
            "layers": {"type": "integer", "minimum": 0,
                       "description": "How many done tasks' layers make its view"},
            "stack": {**_array(_ref("Task")), "description": "Its done tasks, newest first "
                                                             "(GET of one workspace)"}}},
        "Wallet": {"type": "object", "required": ["balanceCents", "ledger"], "properties": {
            "balanceCents": NUMBER, "ledger": _array(_ref("LedgerEntry"))}},
        "LedgerEntry": {"type": "object", "required": ["balanceAfterCents"], "properties": {
            "time": DATE_TIME, "balanceAfterCents": NUMBER,
            "set": {**NUMBER, "description": "The balance was set to this"},
            "task": STRING, "call": STRING, "to": STRING, "cents": NUMBER,
            "memo": _nullable(STRING)}},
        "Settings": {"type": "object", "required": list(DEFAULT_SETTINGS),
                     "properties": settings},
        "SettingsUpdate": {"type": "object", "additionalProperties": False,
                           "properties": settings},
        "Change": {"type": "object", "required": ["path", "change"], "properties": {
            "path": {"type": "string", "description": "A folder's ends with /"},
            "change": {"type": "string", "enum": ["added", "modified", "deleted"]}}},
        "FileEntry": {"type": "object", "required": ["name", "type", "size"], "properties": {
            "name": STRING, "size": {"type": "integer", "minimum": 0},
            "type": {"type": "string", "enum": ["file", "directory", "symlink", "other"]}}},
        "FileList": {"type": "object", "required": ["workspace", "path", "entries"],
                     "properties": {"workspace": STRING, "path": STRING,
                                    "entries": _array(_ref("FileEntry"))}},
        "Tool": {"type": "object", "required": ["name", "kind"], "properties": {
            "name": STRING, "kind": {"type": "string", "enum": ["builtin", "executable"]},
            "description": STRING}},
        "Health": {"type": "object", "required": ["ok", "version"], "properties": {
            "ok": {"type": "boolean"}, "version": STRING}},
        "Error": {"type": "object", "required": ["error"], "properties": {
            "error": {"type": "string", "description": "What went wrong"},
            "code": {"type": "string", "description": "A stable name for it, e.g. not_found"}}},
        **decision_schemas(), **source_schemas(create["properties"]), **conflict_schemas(),
    }


def conflict_schemas() -> dict[str, Any]:
    """A conflict approval's args (run_check's conflicts, version_info's versions) and the
    args of its answer (conflict_answer)."""
    version = {"type": "object", "required": ["kind"], "properties": {
        "kind": {"type": "string", "enum": ["absent", "file", "symlink", "folder", "other"]},
        "mode": {"type": "string", "pattern": "^[0-7]{4}$"},
        "size": {"type": "integer", "minimum": 0}, "target": STRING,
        "text": {"type": "string", "description": f"At most {MERGE_SHOWN_BYTES} bytes"},
        "shown": {"type": "string", "enum": ["binary", "too large to show"],
                  "description": "Why there is no text"}}}
    return {
        "ConflictArgs": {"type": "object", "required": ["paths", "merged"], "properties": {
            "paths": _array({"type": "object", "required": ["path", "why", "diff3", "before",
                                                            "view", "task"], "properties": {
                "path": STRING, "why": STRING,
                "diff3": {**_nullable(STRING), "description": "git merge-file --diff3's text "
                          "with markers (task, before, view), for text"},
                "before": {**version, "description": "What the task saw when it started"},
                "view": {**version, "description": "The workspace's view now"},
                "task": {**version, "description": "The task's own"}}}),
            "merged": {**_array(STRING), "description": "Paths joined cleanly meanwhile"}}},
        "ConflictAnswer": {
            "type": "object", "additionalProperties": False,
            "description": "Approve's args of a conflict; none: the task's version everywhere",
            "properties": {
                "keep": {"type": "string", "enum": list(CONFLICT_KEEP), "default": "task",
                         "description": "task: its version; view: the view's (its change "
                                        "to those paths dropped)"},
                "texts": {"type": "object", "additionalProperties": STRING,
                          "description": "A merged text for some paths (by path)"}}},
    }


def decision_schemas() -> dict[str, Any]:
    """Policy (and the body that makes one), the portal's Session, and the Conflict a keep
    answers."""
    return {
        "Policy": {"type": "object", "required": [f.name for f in dataclasses.fields(Policy)]
                   + ["active"], "properties": {
            "id": STRING, "tool": {"type": "string", "description": "A tool name, or host"},
            "scope": {"type": "string", "enum": list(POLICY_SCOPES)},
            "createdAt": DATE_TIME,
            "createdBy": {"type": "string", "description": "api, or approval <id>"},
            "task": _nullable(STRING), "workspace": _nullable(STRING),
            "host": _nullable(STRING), **POLICY_LIMITS,
            "spentCents": NUMBER, "uses": {"type": "integer", "minimum": 0},
            "active": {"type": "boolean"},
            "endedBecause": {"type": "string", "description": "Expired, or spent"}}},
        "PolicyCreate": {
            "type": "object", "additionalProperties": False, "required": ["tool", "scope"],
            "description": "task with scope task only, workspace with scope workspace only, "
                           "host with tool host only; never tool ask",
            "properties": {
                "tool": {"type": "string", "maxLength": 64, "pattern": TOOL_RE.pattern,
                         "description": "A tool name, or host (names a task may look up)"},
                "scope": {"type": "string", "enum": list(POLICY_SCOPES)},
                "task": {"type": ["string", "null"], "pattern": ID_RE.pattern},
                "workspace": {"type": ["string", "null"], "pattern": NAME_SCHEMA["pattern"]},
                "host": {"type": ["string", "null"], "examples": ["*.example.com"],
                         "description": "A name or *.domain, no port, no address"},
                **POLICY_LIMITS}},
        "Session": {"type": "object", "required": ["id", "createdAt", "expiresAt", "userAgent",
                                                   "via", "current"], "properties": {
            "id": STRING, "createdAt": DATE_TIME, "expiresAt": DATE_TIME, "userAgent": STRING,
            "via": {"type": "string", "enum": ["code", "token"]},
            "current": {"type": "boolean", "description": "This browser's"}}},
        "Conflict": {"type": "object", "required": ["error"], "properties": {
            "error": STRING, "code": STRING,
            **{key: _array({"type": "object", "required": ["folder", "path", "why"],
                            "properties": {"folder": STRING, "path": STRING, "why": STRING}})
               for key in ("conflicts", "notUndone")}}},
    }


def source_schemas(create: dict[str, Any]) -> dict[str, Any]:
    """Schedules and hooks; create: TaskCreate's properties (a schedule's or a hook's task
    takes them, but source)."""
    task_defaults = {k: v for k, v in create.items() if k != "source"}
    return {
        "Schedule": {"type": "object", "required": [
            f.name for f in dataclasses.fields(Schedule) if f.name != "after"] + ["nextRuns"],
            "properties": {
                "id": STRING, "name": STRING, "cron": STRING, "timezone": STRING,
                "task": {"type": "object", "description": "What each run creates"},
                "enabled": {"type": "boolean"}, "overlap": {"type": "string",
                                                            "enum": list(OVERLAPS)},
                "createdAt": DATE_TIME, "updatedAt": DATE_TIME,
                "lastRun": _nullable(DATE_TIME),
                "lastTask": _nullable(STRING), "lastState": _nullable(STRING),
                "lastNote": {**_nullable(STRING), "description": "What happened at the latest "
                                                                "slot (missed, skipped...)"},
                "queued": {"type": "boolean"},
                "nextRuns": {**_array(DATE_TIME),
                             "description": "The next five, in its own zone; none when off"}}},
        "ScheduleCreate": schedule_body(task_defaults, ["name", "cron", "task"]),
        "ScheduleUpdate": schedule_body(task_defaults, []),
        "Hook": {"type": "object", "required": ["name", "source", "task", "allow", "createdAt",
                                                "url"], "properties": {
            "name": HOOK_NAME, "source": STRING, "task": {"type": "object"},
            "allow": _array({"type": "string", "enum": list(HOOK_BODY_FIELDS)}),
            "createdAt": DATE_TIME,
            "url": {"type": "string", "description": "Where to deliver: /api/hooks/<name>"}}},
        "HookCreate": {
            "type": "object", "additionalProperties": False, "required": ["name", "source"],
            "properties": {
                "name": HOOK_NAME,
                "source": {"type": "string", "pattern":
                           "^(?!(api|schedule)$)(?!jira)[a-z0-9][a-z0-9_.-]{0,49}$",
                           "description": "The tasks' source (not api, schedule, jira...)"},
                "task": {"type": "object", "additionalProperties": False,
                         "properties": task_defaults,
                         "description": "Task defaults of every delivery"},
                "allow": {**_array({"type": "string", "enum": list(HOOK_BODY_FIELDS)}),
                          "description": "Fields a delivery may set besides title and prompt"}}},
        "HookDelivery": {
            "type": "object", "additionalProperties": False,
            "description": "title and prompt (unless the hook's task gives them), and the "
                           "fields its allow lists",
            "properties": {k: create[k] for k in ("title", "prompt", *HOOK_BODY_FIELDS)}},
    }


def schedule_body(task_defaults: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """A POST (name, cron, task required) or PUT (any of them) body of a schedule."""
    return {"type": "object", "additionalProperties": False, "required": required,
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 100, "pattern": r"\S",
                         "description": "Also the title of its tasks (unless task has one)"},
                "cron": {"type": "string", "examples": ["0 3 * * MON-FRI"],
                         "description": "Five fields: minute hour day-of-month month "
                                        "day-of-week (ranges, steps, lists, names)"},
                "timezone": {"type": "string", "maxLength": 64, "default": "UTC",
                             "examples": ["Europe/Berlin"]},
                "task": {"type": "object", "additionalProperties": False,
                         "required": ["prompt"], "properties": task_defaults,
                         "description": "What each run creates (source is schedule)"},
                "enabled": {"type": "boolean", "default": True},
                "overlap": {"type": "string", "enum": list(OVERLAPS), "default": "skip",
                            "description": "A slot while a run is active: skip it, or "
                                           "queue one run behind it"}}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema":
                                                                         _ref("Error")}}}


def api_response(answer: Any) -> dict[str, Any]:
    """One of a route's answers: a bare description is an Error; (description, content) or
    (description, content, headers): a schema is JSON, a dict of content types is each;
    headers: name -> (schema, description, required)."""
    if isinstance(answer, str):
        return _error(answer)
    text, content, *headers = answer
    if not any("/" in key for key in content):
        content = {"application/json": content}
    out = {"description": text, "content": {t: {"schema": s} for t, s in content.items()}}
    if headers:
        out["headers"] = {name: {"schema": schema, "description": about, "required": required}
                          for name, (schema, about, required) in headers[0].items()}
    return out


def auto_operation_id(method: str, pattern: str) -> str:
    """The operationId of a route without one of its own: post_api_tasks_id_frobnicate."""
    return re.sub(r"\W+", "_", f"{method.lower()}{pattern}").strip("_")


def api_parameters(route: Route) -> list[dict[str, Any]]:
    """The route's path parameters (an id, a name or a path unless it says), then its query
    parameters and headers."""
    params = [{"name": p, "in": "path", "required": True,
               "schema": route.params.get(p) or (ID_SCHEMA if p == "id" else NAME_SCHEMA
                                                 if p == "name" else PATH_SCHEMA)}
              for p in re.findall(r"\{(\w+)\}", route.path)]
    for where, given in (("query", route.query), ("header", route.headers)):
        for name, (schema, text, *required) in given.items():
            params.append({"name": name, "in": where, "required": bool(required),
                           "description": text, "schema": schema})
            if where == "query":     # parse_qs drops name= : an empty value is no value
                params[-1]["allowEmptyValue"] = True
    return params


def api_operation(route: Route) -> dict[str, Any]:
    """One operation, from the route; a route without answers gets a minimal valid one."""
    tag = route.tag or (route.path.split("/")[2] if route.path.count("/") > 1 else "api")
    op: dict[str, Any] = {"summary": route.summary, "operationId": route.operation_id or
                          auto_operation_id(route.method, route.path), "tags": [tag]}
    responses = {str(status): api_response(answer) for status, answer in route.answers.items()}
    if not route.answers:
        responses["200"] = {"description": "OK", "content": {"*/*": {"schema": {}}}}
        responses["default"] = _error("An error")
    if route.body is not None:
        schema, required, *types = route.body
        op["requestBody"] = {"required": required, "content": {
            t: {"schema": schema} for t in (types[0] if types else ("application/json",))}}
    if not route.open:
        op["security"] = [{"bearer": []}, {"portal": []}]
        responses.setdefault("401", _error("No or a wrong bearer token or session cookie"))
        responses.setdefault("403", _error("A Host header or an Origin gurtd does not answer"))
        responses.setdefault("503", _error("gurtd is busy; try again (Retry-After)"))
    if "requestBody" in op:
        responses.setdefault("411", _error("A body without Content-Length"))
        responses.setdefault("413", _error(f"A body larger than {MAX_BODY} bytes"))
    params = api_parameters(route)
    if params:
        op["parameters"] = params
    op["responses"] = responses
    return op


def openapi(server: str = "http://127.0.0.1:7700") -> dict[str, Any]:
    """An OpenAPI 3.1 description generated from ROUTES and the validation tables, so it
    cannot drift from them; server is where this gurtd listens."""
    paths: dict[str, Any] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = api_operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": "gurtd", "version": VERSION,
                 "description": "The daemon of a box: tasks on layered, undoable workspaces."},
        "servers": [{"url": server}],
        "tags": [{"name": t} for t in dict.fromkeys(
            op["tags"][0] for ops in paths.values() for op in ops.values())],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "portal": {"type": "apiKey", "in": "cookie",
                                           "name": SESSION_COOKIE}},
            "schemas": api_schemas()},
    }


def undocumented_routes() -> list[tuple[str, str]]:
    """Routes without answers yet (their description is minimal)."""
    return [(route.method, route.path) for route in ROUTES if not route.answers]


# Loop ##########################################################################################
###############################################################################################

def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op without NOTIFY_SOCKET."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(address)
        s.sendall(state.encode())


class Notifier:
    """What the loop tells systemd as it goes: WATCHDOG=1 at half of WatchdogSec (a loop that
    stalls stops saying it, and systemd restarts gurtd) and STATUS= with the task counts when
    they change, checked at most once a second.  Silent without NOTIFY_SOCKET."""

    def __init__(self) -> None:
        usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID", "")
        self.interval = int(usec) / 2e6 if is_digits(usec) and int(usec) > 0 and \
            pid in ("", str(os.getpid())) else None
        self.next_ping = self.next_status = 0.0
        self.status = ""
        self.failed = False

    def send(self, state: str) -> None:
        try:
            sd_notify(state)
        except OSError as exc:
            if not self.failed:      # once: a gone notify socket must not flood the log
                log(4, f"sd_notify: {exc}")
            self.failed = True

    def tick(self, box: Box) -> float:
        """Ping and report as due; how long the loop may sleep before the next ping."""
        now = time.monotonic()
        if now >= self.next_status:
            self.next_status = now + 1.0
            counts = {state: 0 for state in ACTIVE_STATES}
            for task in box.all_tasks():
                if task.state in counts:
                    counts[task.state] += 1
            status = f"STATUS={counts['running']} running, {counts['waiting']} waiting, " \
                     f"{counts['queued']} queued"
            if status != self.status:
                self.status = status
                self.send(status)
        if self.interval is None:
            return 3600.0
        if now >= self.next_ping:
            self.send("WATCHDOG=1")
            self.next_ping = now + self.interval
        return max(0.0, self.next_ping - now)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not is_digits(port) or not 0 <= int(port) <= 65535 or not host:
        raise ValueError(f"listen address must be HOST:PORT, not {listen!r}")
    return host.strip("[]"), int(port)


def raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: systemd gives a service 1,024 soft, and every
    task holds a few fds of gurtd's (pipes, DNS sockets, broker connections, all capped)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log(6, f"open files limit raised from {soft} to {hard}")


class StartError(Exception):
    """gurtd could not start; what the start made is undone.  The message says why."""


def lock_box_home(home: str) -> int:
    """One gurtd per BOX_HOME: an exclusive flock on BOX_HOME/gurtd.lock, taken before
    anything touches BOX_HOME, the accounts, nftables or the broker socket, and held (the fd,
    close-on-exec) until gurtd exits, even by kill -9.  The file holds the holder's pid.
    The fd held is read-only (the pid written through one of its own, closed at once): a
    file open for writing would make an admin's read-only remount of BOX_HOME's disk fail
    as busy.  StartError if another gurtd holds it."""
    os.makedirs(home, mode=0o711, exist_ok=True)
    path = os.path.join(home, "gurtd.lock")
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StartError(f"another gurtd (pid {holder}) runs on BOX_HOME {home}: not "
                         "starting a second one (nothing was changed)") from None
    try:
        pid = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.write(pid, f"{os.getpid()}\n".encode())
        finally:
            os.close(pid)
    except OSError as exc:
        log(4, f"could not write gurtd's pid into {path}: {exc}")
    return fd


Undo = list[tuple[str, Callable[[], Any]]]


def unwind(undo: Undo) -> None:
    """Run the undo steps, last first, each in its own try: one failure skips none."""
    while undo:
        what, fn = undo.pop()
        try:
            fn()
        except Exception as exc:
            log(3, f"could not {what}: {type(exc).__name__}: {exc}")


def overlay_way_start(home: str) -> None:
    """Decide how overlays are mounted (overlay_probe, on BOX_HOME's disk) and say so; a
    StartError naming the kernel if no way works, rather than tasks that fail one by one."""
    try:
        way, ms, failed = overlay_probe(home)
    except SysError as exc:
        raise StartError(str(exc)) from None
    except OSError as exc:
        if not is_disk_error(exc):
            raise
        # A full BOX_HOME has no room for the probe's files, and a full disk must not stop
        # the start (it says what it could not do): the way the kernel's version says.
        way, ms = overlay_way_by_version(), 0.0
        failed = [f"no probe: {exc.strerror}; the way of kernel {os.uname().release}"]
    overlay_way_set(way)
    why = f" ({'; '.join(failed)})" if failed else \
        f" ({OVERLAY_API_ENV}=legacy)" if way == "legacy" else ""
    log(6, f"overlays: the {way} way{why} on kernel {os.uname().release}, probed in "
           f"{ms:.1f} ms")


def overlay_way_by_version() -> str:
    """The way this kernel's version takes (see above: the fd way needs 6.15), for a start
    that cannot probe."""
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    newer = release is not None and (int(release[1]), int(release[2])) >= (6, 15)
    return "fd" if newer and os.environ.get(OVERLAY_API_ENV) != "legacy" else "legacy"


def spawn_way_start(box: Box) -> None:
    """Start a probe child in a group of its own the way workers will start (Spawner) and
    say which way that is: clone3(CLONE_INTO_CGROUP), or fork and cgroup.procs and why."""
    group = box.cgroups.v2_group("probe")
    if group is None:
        log(6, "workers: forked, then they join their v1 groups (no v2 group here)")
        return
    try:
        os.makedirs(group, exist_ok=True)
        way = box.spawner.probe(group)
    except (OSError, SysError) as exc:
        log(4, f"workers: no probe of their start ({exc}); they start as it turns out")
        return
    finally:
        with contextlib.suppress(OSError, SysError):
            box.cgroups.remove("probe")
    how = "started in their cgroup by clone3(CLONE_INTO_CGROUP)" if way["way"] == "clone3" \
        else f"forked, then they write themselves into cgroup.procs ({way['why']})"
    log(6, f"workers: {how}; the probe took {way['us']} us")


def start(box: Box, host: str, port: int, lock_fd: int, undo: Undo) -> None:
    """The start, as steps with their undo (sshuttle's way): each undo is registered before
    its step runs, so a step that fails half-way is undone too, and only what this start
    made is undone (the lock makes BOX_HOME's table and socket this instance's own)."""
    # python-prctl and the kernel filter are loaded now, before the spawner forks: a task's
    # sandbox leaves the host's file system, and with it a checkout's virtual environment.
    sandbox_preload()
    overlay_way_start(box.home)              # before the fork too: workers take the same way
    undo.append(("stop the spawner", box.spawner.stop))
    undo.append(("unmount the tasks' broker tmpfs", box.broker.unmount))
    box.broker.mount()                       # the tmpfs of the tasks' broker socket
    box.spawner.start(close=(lock_fd,), broker=(box.broker.mount_fd, box.path("run")))
    log(6, "tasks' broker socket: " + ("on a tmpfs in the spawner's namespace" if root_shared()
        else f"on a tmpfs at {box.broker.attach_point}" if box.broker.attached
        else "cloned from a detached tmpfs (the root is private, Linux 6.15+)"))
    raise_open_files_limit()                 # after the fork: workers keep the usual limit
    box.load()
    box.reconcile()
    spawn_way_start(box)
    box.disk.start()
    undo.append(("stop the network (its nftables table)", box.network.stop))
    box.network.start()
    undo.append(("stop the broker (its socket)", box.broker.stop))
    box.broker.start()
    undo.append(("close the model gateway's upstream connections", box.gateway.stop))
    undo.append(("end the tasks", box.shutdown_tasks))
    public_suffixes()                        # loaded now, not on the first wildcard host
    box.loop.open_wake()
    undo.append(("stop the merger", box.views.stop))
    box.views.start()                        # merges due since the last run, off the loop
    box.review.start()                       # keeps and undos a crash cut short, off the loop
    box.loop.catch_signals()
    box.loop.publish()                            # what load and reconcile found, for HTTP
    undo.append(("remove the diff copies of answers cut short",   # after the API's close
                 lambda: diff_temp_leftovers(own=True)))
    try:
        server = Server(box, host, port)
    except OSError as exc:
        raise StartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if port == 0:
        box.listen = f"{host}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    undo.append(("close the API", lambda: (server.shutdown(), server.server_close())))
    assert box.spawner.sock is not None
    box.loop.watch(box.spawner.sock, "spawner")
    undo.append(("stop the Jira thread", box.jira.stop))
    box.jira.start()
    box.schedule()


SCOPE_ENV = "GURT_SCOPE"       # "no": never re-run in a scope; "1": this is the re-run


def cgroup_delegable(cgroups: str | None = None, mountinfo: str | None = None) -> bool:
    """Whether gurtd's own group can give its tasks' groups limits (Cgroups._v2_delegate):
    v1 hierarchies with pids and memory, or a v2 group that has them enabled for its children
    already or holds no process but gurtd (gurtd.service with Delegate=yes).  Not a login's
    session scope, nor another service's group: they hold other processes (EBUSY)."""
    own_v2, own_v1 = cgroup_own_groups(cgroups, mountinfo)
    if {"pids", "memory"} <= set(own_v1) or own_v2 is None:
        return True
    wanted = {"pids", "memory"}
    if wanted <= set(cgroup_read(own_v2, "cgroup.subtree_control").split()):
        return True
    procs = set(cgroup_read(own_v2, "cgroup.procs").split())
    return wanted <= set(cgroup_read(own_v2, "cgroup.controllers").split()) and \
        procs <= {str(os.getpid())}


def scope_reexec(home: str) -> None:
    """Started by hand on a systemd machine (`make run` from a login shell), gurtd's group is
    a session scope whose controllers it cannot have: run again in a scope of its own with
    Delegate=yes (systemd-run --scope execs the same command in the same process), so that
    limits hold there as under gurtd.service.  Elsewhere, or if that is not possible, gurtd
    goes on where it is, and Cgroups says whether tasks can be bounded there."""
    tool = shutil.which("systemd-run")
    if os.environ.get(SCOPE_ENV) or not os.path.isdir("/run/systemd/system") or \
            tool is None or cgroup_delegable():
        return
    log(6, "cgroups: gurtd's own group is not delegated: running again in a scope of its "
           "own (systemd-run --scope -p Delegate=yes)")
    os.environ[SCOPE_ENV] = "1"
    try:
        os.execv(tool, [tool, "--scope", "--quiet", "--collect", "-p", "Delegate=yes",
                        "--description", f"gurtd by hand, BOX_HOME={home}", "--",
                        sys.executable] + sys.orig_argv[1:])
    except OSError as exc:
        log(4, f"cgroups: systemd-run: {exc}; going on in the group it has")


# Seconds a thread that holds the interpreter keeps it while another waits (CPython's default
# is 5 ms): an answer that the loop, the HTTP thread and the merge thread pass on in turn waits
# that long behind a merged layer's build (~60 ms of the interpreter) at each hand-off.
SWITCH_INTERVAL = 0.0005


def serve(box: Box) -> None:
    """Run gurtd: lock, start, READY=1, the loop, then a clean stop.  StartError if it could
    not start (another gurtd on BOX_HOME, a port in use...), after undoing what it made."""
    scope_reexec(box.path())
    sys.setswitchinterval(SWITCH_INTERVAL)
    host, port = parse_listen(box.listen)
    lock_fd = lock_box_home(box.path())
    undo: Undo = [("release the BOX_HOME lock", lambda: os.close(lock_fd))]
    try:
        start(box, host, port, lock_fd, undo)
    except BaseException as exc:
        log(3, f"gurtd could not start: {type(exc).__name__}: {exc}; undoing what it made")
        unwind(undo)
        if isinstance(exc, StartError):
            raise
        if isinstance(exc, Exception):
            raise StartError(f"gurtd could not start: {type(exc).__name__}: {exc}") from exc
        raise
    log(6, f"gurtd {VERSION} listening on http://{box.listen} with BOX_HOME={box.path()}; "
           f"token in {box.path('token')}")
    try:
        sd_notify("READY=1")
        box.loop.run()
    finally:
        log(6, "gurtd stopping")
        try:
            sd_notify("STOPPING=1")
        except OSError as exc:
            log(4, f"sd_notify: {exc}")
        unwind(undo)


def event_task(box: Box, kind: str, key: Any) -> str | None:
    """The task a network event belongs to (its DNS sockets, its upstream queries)."""
    if kind == "upstream":
        up = box.network.pending.get(key)
        return up.net.task_id if up is not None else None
    return str(key[0] if isinstance(key, tuple) else key)


def spawner_gone(box: Box) -> bool:
    """The spawner's socket is at its end: it died (and would wake the loop forever)."""
    assert box.spawner.sock is not None
    try:
        return box.spawner.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


LATER_MAX = 64                        # creates answered together at most (run_commands)


@dataclass
class Later:
    """A command's answer made at the end of the step's commands (Loop.run_commands), after
    one schedule for all of them; task: a task it made, saved unsynced (Box.created_synced)."""
    answer: Callable[[], Any]
    task: Task | None = None


class Loop:
    """The loop thread and its plumbing: it owns the box state, runs every event under guard,
    and publishes what a step changed for the HTTP and broker threads in one go.

    Methods for other threads: call(fn, *args) runs fn on the loop thread and returns its
    result (503 busy past a time limit); post(fn, *args) queues fn without waiting (merger and
    disk threads); task_json, list_tasks, listed_in, last_event and events_after read what the
    loop published, never the loop's objects.  Methods for the loop thread: guard(task_id, fn)
    runs one event handler; render(task) and emit(kind, obj) stage a task's JSON and an event;
    publish() ends the step; watch/unwatch add and drop fds; run() is the select loop until
    SIGTERM (catch_signals), stopped() says so to threads that loop too.
    """

    def __init__(self, box: Box) -> None:
        self.box = box
        self.commands: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = \
            queue.Queue()
        self.selector = selectors.DefaultSelector()
        self.wake_r = self.wake_w = -1
        self.stopping = False
        self.call_timeout = env_seconds("GURT_CALL_TIMEOUT", CALL_TIMEOUT)
        self.unsaved_retry = 0.0
        self.events: list[tuple[int, str, bytes]] = []   # (seq, kind, JSON) for /api/events
        # Event ids go on from a clock reading, so that an id from before a restart is older
        # than every id of this run (its stream gets a reset event, not silence).
        self.event_seq = int(time.time() * 1000)
        self.events_changed = threading.Condition()
        self.rendered: dict[str, bytes] = {}
        # Snapshots for HTTP threads (written in publish): (seq, id) in creation order, and
        # per task (state, workspace, doneSeq, JSON) replaced in one assignment.
        self.order: list[tuple[int, str]] = []
        self.listed: dict[str, tuple[str, str, int, bytes]] = {}
        self.listed_lock = threading.Lock()     # a list is read whole between two publishes
        # the same as rows of PUBLIC_FIELDS' values (ABSENT: left out), for ?fields=: a row
        # is a quarter of a dict's size (10,000 dicts were 8 MB of RSS)
        self.listed_api: dict[str, tuple[Any, ...]] = {}
        self.staged: dict[str, Task] = {}                 # changed in this loop step
        self.staged_events: list[tuple[str, bytes]] = []

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the loop thread and return its result (or raise its error).

        A loop that does not answer within call_timeout gives 503 busy, never a dropped
        connection: a command that had not started is withdrawn (nothing was done).
        """
        future = self.post(self._published, fn, *args)
        try:
            return future.result(timeout=self.call_timeout)
        except TimeoutError:
            if future.done():
                return future.result()        # ended just now (or fn's own error)
            if future.cancel():
                raise ApiError(503, "gurtd is busy; nothing was done, try again", "busy",
                               {"Retry-After": "1"}) from None
            raise ApiError(503, "gurtd is busy; the request is still being carried out",
                           "busy", {"Retry-After": "1"}) from None

    def report(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A thread that has already done something (real folders written, a tool run, a Jira
        issue read) hands the state its record: fn(*args) on the loop, waited for as long as
        it takes and never withdrawn, since a 503 here would leave the state without what is
        already true (a keep unsaid, a tool's cost unmetered).  Past SIGTERM it gives up:
        what it said is redone at the next start (review journals, the Jira poll)."""
        future = self.post(self._published, fn, *args)
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if future.done():
                    return future.result()    # ended just now (or fn's own error)
                if self.stopping and future.cancel():
                    raise ApiError(503, "gurtd is stopping", "busy") from None

    def _published(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            self.publish()          # the caller sees its own change in what it reads next

    def post(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Any thread: fn(*args) runs on the loop thread soon; its future."""
        future: Future[Any] = Future()
        self.commands.put((fn, args, future))
        os.write(self.wake_w, b"c")
        return future

    def stopped(self) -> bool:
        """SIGTERM came: threads that loop on their own (streams, Jira) end too."""
        return self.stopping

    def catch_signals(self) -> None:
        """SIGTERM and SIGINT only set a flag the loop reads (the wake pipe ends its wait)."""
        def on_signal(signum: int, frame: Any) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def watch(self, fd: Any, data: Any) -> None:
        self.selector.register(fd, selectors.EVENT_READ, data)

    def unwatch(self, fd: Any) -> None:
        self.selector.unregister(fd)

    def open_wake(self) -> None:
        """The wake pipe: commands and signals end the loop's select."""
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        self.watch(self.wake_r, "wake")

    def guard(self, task_id: str | None, fn: Callable[..., Any], *args: Any) -> bool:
        """Run one event handler of the loop.  An error in handling a task's event fails that
        task (the traceback to gurtd's log, the error to the task's log); an error with no
        task is logged.  Either way the loop goes on (asyncio's call_exception_handler).
        True if fn returned."""
        try:
            fn(*args)
            return True
        except Exception as exc:
            where = f"task {task_id}" if task_id else "the loop"
            log(3, f"error while handling an event of {where}: " +
                traceback.format_exc().rstrip().replace("\n", "\n    "))
            task = self.box.task(task_id) if task_id else None
            if task is not None and task.state in ACTIVE_STATES:
                self.box.fail_task(task, cannot_save(exc) if is_disk_error(exc) else
                                   f"internal error: {type(exc).__name__}: {exc}")
            return False

    def emit(self, kind: str, obj: Any) -> None:
        """An event for /api/events: every state a task takes (queued too), every approval
        made or answered; sent at the end of the step (publish), with ids counting up by one;
        the last EVENTS_KEPT are kept for replay."""
        self.staged_events.append((kind, json_text(obj)))
        if kind == "task":
            for source in (self.box.schedules, self.box.jira):
                try:
                    source.on_task(obj)
                except Exception as exc:   # their bookkeeping never fails the task
                    log(3, f"{type(source).__name__}: task {obj.get('id')}: {exc}")

    def events_after(self, last: int) -> tuple[bool, list[tuple[int, str, bytes]]]:
        """The kept events after id last, and whether some after it are no longer kept (or
        last is no id of this run): the caller then says reset.  Any thread."""
        with self.events_changed:
            if last > self.event_seq:
                return True, []
            first = self.events[0][0] if self.events else self.event_seq + 1
            return last < first - 1, [e for e in self.events if e[0] > last]

    def last_event(self) -> int:
        return self.event_seq

    def wait_event(self, last: int, timeout: float) -> None:
        """Any thread: wait up to timeout for an event after id last."""
        with self.events_changed:
            if self.event_seq == last:
                self.events_changed.wait(timeout)

    def render(self, task: Task) -> None:
        """The task changed: its JSON is published for HTTP threads at the end of this step."""
        self.staged[task.id] = task

    def task_json(self, task_id: str) -> bytes | None:
        """Any thread: a task's published JSON, None for no such task."""
        return self.rendered.get(task_id)

    def task_state(self, task_id: str) -> str | None:
        data = self.rendered.get(task_id)
        return json.loads(data)["state"] if data is not None else None

    def forget(self, task_id: str) -> None:
        """A task that could not be made after all: nothing of it is published."""
        self.rendered.pop(task_id, None)
        self.staged.pop(task_id, None)

    def publish(self) -> None:
        """The end of a loop step (and of load): what it changed becomes visible to HTTP
        threads together, tasks first, then approvals, then events, so that a reader never
        sees half a step (an approval pending while its task is not yet waiting, an event
        about a task that GET still shows as before)."""
        apis = [(task, task.to_api()) for task in self.staged.values()
                if self.box.task(task.id) is task]   # not a create that failed after saving
        fresh = [(task, api, json.dumps(api).encode()) for task, api in apis]
        with self.listed_lock:
            for task, api, data in fresh:     # api for ?fields= (few fields of many tasks)
                self.listed_api[task.id] = tuple(api.get(k, ABSENT) for k in PUBLIC_FIELDS)
                if task.id not in self.listed:
                    bisect.insort(self.order, (task.seq, task.id))
                self.listed[task.id] = (task.state, task.workspace, task.doneSeq, data)
                self.rendered[task.id] = data
        for task, _, _ in fresh:
            self.box.log_followers.notify(task.id)    # a follower ends when the task does
        self.staged.clear()
        self.box.broker.publish()
        if self.staged_events:
            with self.events_changed:
                for kind, data in self.staged_events:
                    self.event_seq += 1
                    self.events.append((self.event_seq, kind, data))
                del self.events[:-EVENTS_KEPT]
                self.events_changed.notify_all()
            self.staged_events.clear()

    def list_tasks(self, state: str | None, workspace: str | None, limit: int,
                   fields: tuple[str, ...] | None = None) -> bytes:
        """The task list as JSON, newest first, from the published snapshots; only the
        given fields of each task when fields is set (rendered from the published dicts)."""
        out: list[Any] = []
        with self.listed_lock:              # one step's changes, all of them or none
            for _, task_id in reversed(self.order):
                entry = self.listed.get(task_id)
                if entry is not None and (state is None or entry[0] == state) and \
                        (workspace is None or entry[1] == workspace):
                    out.append(entry[3] if fields is None else self.listed_api[task_id])
                    if len(out) >= limit:
                        break
        if fields is not None:
            at = [(k, PUBLIC_FIELDS.index(k)) for k in fields if k in PUBLIC_FIELDS]
            out = [json.dumps({k: row[i] for k, i in at if row[i] is not ABSENT}).encode()
                   for row in out]
        return b"[" + b", ".join(out) + b"]"

    def listed_in(self, workspace: str) -> list[tuple[str, str, int, bytes]]:
        """Any thread: the published (id, state, doneSeq, JSON) of a workspace's tasks."""
        with self.listed_lock:
            return [(i, e[0], e[2], e[3]) for i, e in self.listed.items() if e[1] == workspace]

    def run(self) -> None:
        """The select loop that owns the box state, until SIGTERM.  Every event handler runs
        under guard: an error while handling a task's event fails that task, any other error
        is logged, and the loop goes on.  Commands from call hand their errors to the caller."""
        box = self.box
        notifier = Notifier()
        while not self.stopping:
            self.guard(None, box.tick)
            if box.has_unsaved() and time.monotonic() > self.unsaved_retry:
                self.unsaved_retry = time.monotonic() + 5.0
                self.guard(None, box.save_unsaved)
            try:
                timeout = min(box.network.tick(), box.disk.tick())
            except Exception as exc:
                log(3, f"the network timers failed: {type(exc).__name__}: {exc}")
                timeout = 1.0
            timeout = min(timeout, box.schedules.tick())   # runs what is due; never raises
            timeout = min(timeout, notifier.tick(box), box.views.collect_wait(), 1.0)
            self.guard(None, self.on_ready, self.selector.select(timeout=timeout))
            self.run_commands()
            self.guard(None, self.publish)        # what this step changed, for HTTP threads
            if box.views.gc_due:                  # after the answers: none waits for it
                self.guard(None, box.views.step_end)
                self.guard(None, self.publish)

    def on_ready(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        """The fds one select found ready, each handled under guard; the tasks that end
        meanwhile are saved together at the end (Box.steps.grouped): an exit seen in one fd
        and its report pipe's end in another are one step's work."""
        box = self.box
        with box.steps.grouped():
            for key, _ in ready:
                if isinstance(key.data, tuple):
                    self.guard(event_task(box, *key.data), box.network.on_event, *key.data)
                elif key.data == "wake":
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif key.data == "spawner":
                    if not self.guard(None, box.on_exits) and spawner_gone(box):
                        log(2, "the spawner is gone: no task can start until gurtd restarts")
                        self.selector.unregister(key.fileobj)
                else:
                    self.guard(key.data, box.on_worker_output, key.data)

    def run_commands(self) -> None:
        """The commands other threads posted, in order; a run of those whose answer is Later
        (creates, `batched`) is answered once it ends, one schedule and a publish first: any
        other command, or LATER_MAX of them, ends it, so none waits behind a slow command."""
        later: list[tuple[Future[Any], Later]] = []
        while True:
            try:
                fn, args, future = self.commands.get_nowait()
            except queue.Empty:
                break
            if later and (len(later) >= LATER_MAX or
                          not getattr(args[0] if args else None, "batched", False)):
                self.answer_later(later)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the HTTP thread that asked
                future.set_exception(exc)
                continue
            if isinstance(result, Later):
                later.append((future, result))
            else:
                future.set_result(result)
        self.answer_later(later)

    def answer_later(self, later: list[tuple[Future[Any], Later]]) -> None:
        """run_commands: the Later answers of a run of creates, after one schedule."""
        if later:
            self.guard(None, self.box.schedule)
            made = [result.task for _, result in later if result.task is not None]
            self.guard(None, lambda: self.box.created_synced(made))
            self.guard(None, self.publish)
        for future, result in later:
            try:
                future.set_result(result.answer())
            except BaseException as exc:
                future.set_exception(exc)
        later.clear()


# CLI ###########################################################################################
###############################################################################################

class Client:
    """The local API with the token from GURT_TOKEN or BOX_HOME/token."""

    timeout = 60.0                       # seconds for an answer; a keep may take minutes
    transfer_timeout = 600.0             # a put or a get: its body and answer are streamed

    def __init__(self, listen: str, box_home: str, need_token: bool = True) -> None:
        self.host, self.port = parse_listen(listen)
        self.url_host = f"[{self.host}]" if ":" in self.host else self.host   # IPv6 bracketed
        self.token, self.no_token = os.environ.get("GURT_TOKEN", ""), ""
        if not self.token:
            try:
                with open(os.path.join(box_home, "token")) as f:
                    self.token = f.read().strip()
            except OSError as exc:
                self.no_token = f"cannot read gurtd's token in {box_home}: " \
                    f"{exc.strerror or exc}.  Run this as root, set GURT_TOKEN (`gurtd token` " \
                    "as root prints it), or point --box-home (BOX_HOME) at gurtd's folder"
                if need_token:
                    raise click.ClickException(self.no_token) from None

    def unreachable(self, exc: OSError) -> click.ClickException:
        return click.ClickException(
            f"cannot reach gurtd at {self.host}:{self.port} ({exc.strerror or exc}).  Is it "
            "running?  `systemctl start gurtd`, `make run` in a checkout, or `gurtd serve` in "
            "the foreground (as root); --listen (GURT_LISTEN) must be its address")

    def open(self, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None, timeout: float | None = None
             ) -> tuple[Any, Any]:
        """One request: its connection and response, the answer not read yet; or a
        ClickException that says what went wrong (an error status said by CliError)."""
        conn = http.client.HTTPConnection(self.url_host, self.port, timeout=timeout)
        try:
            conn.request(method, "/api" + path, body=body,
                         headers={"Authorization": f"Bearer {self.token}", **(headers or {})})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise CliError.of(resp.status, resp.read(), path)
        except OSError as exc:
            conn.close()
            raise self.unreachable(exc) from None
        except CliError:
            conn.close()
            raise
        return conn, resp

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        conn, resp = self.open(method, path, data, None if data is None else
                               {"Content-Type": "application/json"}, self.timeout)
        try:
            raw = resp.read()
        except OSError as exc:
            raise self.unreachable(exc) from None
        finally:
            conn.close()
        if resp.getheader("Content-Type", "").split(";")[0] == "application/json":
            return json.loads(raw)
        return raw

    def events(self, path: str) -> Iterator[tuple[str, str]]:
        """Server-Sent Events from path as (event, data) pairs; connected (or refused) at
        once, before the first pair is asked for.  No timeout: a quiet task sends nothing
        for a long time."""
        return self.event_pairs(*self.open("GET", path))

    @staticmethod
    def event_pairs(conn: Any, resp: Any) -> Iterator[tuple[str, str]]:
        event, data = "message", []
        for raw in resp:
            line = raw.decode(errors="replace").rstrip("\n")
            if not line:
                if data:
                    yield event, "\n".join(data)
                event, data = "message", []
            elif line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        conn.close()


class CliError(click.ClickException):
    """An API error said for people: gurtd's message and what to do, never a bare status."""

    HINTS = {"tasks": "`gurtd tasks` lists the tasks", "approvals":
             "`gurtd approvals --state approved` (or denied, pending) lists the approvals",
             "workspaces": "`gurtd workspaces` lists the workspaces"}

    def __init__(self, message: str, status: int, code: str, body: Any = None) -> None:
        super().__init__(message)
        self.status, self.code, self.body = status, code, body if isinstance(body, dict) else {}

    @classmethod
    def of(cls, status: int, raw: bytes, path: str) -> "CliError":
        body: Any = None
        try:
            body = json.loads(raw)
            message, code = str(body["error"]), str(body.get("code") or "")
        except (ValueError, KeyError, TypeError):
            message, code = raw.decode(errors="replace").strip()[:200] or "no answer", ""
        message = printable(message)
        topic = path.split("?")[0].split("/")[1] if path.count("/") else ""
        if status == 401:
            message = "gurtd refused the token: BOX_HOME (--box-home) or GURT_TOKEN is not " \
                      "the running gurtd's (`gurtd token` as root prints its token)"
        elif topic in cls.HINTS and (status == 404 or message.lower().startswith("no ")):
            message = f"{message}: {cls.HINTS[topic]}"
        elif status in (429, 503):
            message = f"{message} (gurtd is busy: try again in a moment)"
        elif status == 507:
            message = f"{message} (BOX_HOME's disk is full: undo or remove old tasks' layers)"
        elif status >= 500:
            message = f"gurtd failed: {message} (its log: `journalctl -u gurtd`)"
        return cls(message, status, code, body)


def client_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--listen", envvar="GURT_LISTEN", default=DEFAULT_LISTEN,
                      show_default=True, help="gurtd's address (env GURT_LISTEN)")(fn)
    return click.option("--box-home", envvar="BOX_HOME", default=DEFAULT_BOX_HOME,
                        show_default=True, help="where the token is (env BOX_HOME)")(fn)


def complete_ids(listing: str) -> Callable[..., list[Any]]:
    """Shell completion of ids from a listing of the running gurtd (nothing when unreachable
    or the token is not readable), each with its title or question."""
    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem
        try:
            items = Client(os.environ.get("GURT_LISTEN", DEFAULT_LISTEN),
                           os.environ.get("BOX_HOME", DEFAULT_BOX_HOME)).request("GET", listing)
        except (click.ClickException, OSError, ValueError):
            return []
        return [CompletionItem(
            i["id"], help=short(i.get("title") or i.get("question") or i.get("tool"), 50))
            for i in items if i["id"].startswith(incomplete)]
    return complete


task_argument = click.argument("task_id", shell_complete=complete_ids("/tasks?limit=200"))
approval_argument = click.argument("approval_id",
                                   shell_complete=complete_ids("/approvals?state=pending"))


def json_options(help: str | None = None) -> Callable[..., Any]:
    """--json (the answer as JSON, help its text) and the client options."""
    flag = click.option("--json", "as_json", is_flag=True, help=help)
    return lambda fn: flag(client_options(fn))


def given(**fields: Any) -> dict[str, Any]:
    """The options given (click passes None for one left out), as body or query fields."""
    return {key: value for key, value in fields.items() if value is not None}


def whole(cents: float | None) -> float | None:
    """50.0 as 50: whole cents go out as they were typed."""
    return int(cents) if cents is not None and cents.is_integer() else cents


def workspace_url(name: str, rest: str) -> str:
    """/workspaces/NAME then rest, the name quoted whole (a / in it is no path)."""
    return f"/workspaces/{urllib.parse.quote(name, safe='')}{rest}"


def print_listing(items: list[dict[str, Any]], as_json: bool, row: Callable[[Any], list[str]],
                  headers: list[str], state_column: int | None = None, empty: str = "") -> None:
    """A list answer as JSON, or as a table of row(item) for each item; none: empty said."""
    print_answer(items, as_json, lambda _: print_table([row(item) for item in items], headers,
                                                       state_column) if items else
                 click.echo(empty or "none", err=True))


def print_answer(answer: Any, as_json: bool, say: Callable[[Any], None]) -> None:
    """An answer as JSON, or said for people by say(answer)."""
    if as_json:
        click.echo(json.dumps(answer, indent=1))
    else:
        say(answer)


def print_table(rows: list[list[str]], headers: list[str], state_column: int | None = None
                ) -> None:
    """Columns padded to their widest cell; the state column in colour on a terminal."""
    rows = [[printable(c) for c in row] for row in rows]
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    color = use_color()
    for n, row in enumerate([headers] + rows):
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        if color and n and state_column is not None:
            cells[state_column] = paint(row[state_column]) + \
                " " * (widths[state_column] - len(row[state_column]))
        click.echo("  ".join(cells).rstrip())


def print_task(task: dict[str, Any]) -> None:
    """`gurtd show`: the fields aligned, their values as people say them."""
    width = max(len(key) for key in PUBLIC_FIELDS) + 2
    for key in PUBLIC_FIELDS:
        if key in task:
            lines = str(task[key]).split("\n") if key == "prompt" else [human(key, task[key])]
            click.echo(f"{key + ':':{width}}" + ("\n" + " " * width).join(map(printable, lines)))


def human(key: str, value: Any) -> str:
    """A field's value for people: yes/no, 6 cents, 256 MiB, a local time and how long ago,
    a record as `name value, ...`, a long list cut."""
    if value is None or value == [] or value == {}:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k} {human(k, v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(human(key, v) for v in value[:8]) + \
            (f" and {len(value) - 8} more" if value[8:] else "")
    if key.endswith("Cents"):
        return f"{cents_text(value)} cents"
    if key.endswith("Bytes") and isinstance(value, int) and value >= 1024:
        exp = min((value.bit_length() - 1) // 10, 4)
        return f"{cents_text(round(value / 1024 ** exp, 1))} {' KMGT'[exp]}iB"
    if key.endswith("At") or key in ("time", "lastRun"):
        return when(value)
    return str(value)


def local_time(stamp: Any) -> datetime.datetime | None:
    """An ISO time (2026-11-29T19:50:40.123Z) as local time; None when it is not one."""
    try:
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).astimezone()
    except ValueError:
        return None


def when(stamp: str) -> str:
    """An ISO time as local time and how far from now: 2026-12-01 14:05:09 (2 min ago)."""
    moment = local_time(stamp)
    return str(stamp) if moment is None else f"{moment:%Y-%m-%d %H:%M:%S} ({ago(stamp)})"


def log_entry_text(entry: dict[str, Any]) -> str:
    """One log entry in a line for people (the --json output keeps everything)."""
    kind = entry.get("type", "?")
    if kind == "state":
        return entry.get("state", "") + (f" ({entry['error']})" if entry.get("error") else "")
    if kind == "exit":
        return str(entry.get("code"))
    if kind == "tool":
        outcome = (f"-> {json.dumps(entry['result'])}" if "result" in entry
                   else f"refused: {entry.get('error')}")
        return f"{entry.get('tool')} {json.dumps(entry.get('args'))} {outcome}"
    if kind == "approval":
        if "state" in entry:
            return f"{entry['approval']} {entry['state']} by {entry.get('by')}" + \
                (f": {entry['reason']}" if entry.get("reason") else "")
        return f"{entry['approval']} pending: {entry.get('kind')} {entry.get('tool')} " \
               f"{entry.get('cents')} cents"
    if kind == "dns" and "allowed" in entry:   # else a name held for a person: its text
        verdict = "allowed" if entry.get("allowed") else "refused"
        return f"{entry.get('name')} {entry.get('qtype')} {verdict} " + \
            " ".join(entry.get("addresses") or [])
    if kind == "event":
        event = entry.get("event") or {}
        return droid_step(event) or f"{event.get('type')} " + json.dumps(event)[:150]
    return str(entry.get("text", ""))


def print_log_entry(entry: dict[str, Any]) -> None:
    click.echo(printable(f"{entry.get('time', '')}  {entry.get('type', '?'):8}  "
                         f"{log_entry_text(entry)}").rstrip())


STATE_COLORS = {"queued": "cyan", "running": "blue", "waiting": "yellow", "done": "green",
                "failed": "red", "undone": "magenta", "pending": "yellow",
                "approved": "green", "denied": "red"}


def use_color(err: bool = False) -> bool:
    """Colours on a terminal only, and never with NO_COLOR set (no-color.org)."""
    stream = sys.stderr if err else sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR")


def paint(state: str, err: bool = False) -> str:
    """A state in its colour where stdout (err: stderr) takes colours (use_color)."""
    return click.style(state, fg=STATE_COLORS.get(state), bold=state == "waiting") \
        if use_color(err) else state


def cents_text(value: Any) -> str:
    """100.0 as 100, 0.25 as 0.25: whole cents are printed whole."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4f}".rstrip("0").rstrip(".")


def ago(stamp: str, now: float | None = None) -> str:
    """An ISO time as people say it: just now, 5 s ago, 2 min ago, 4 days ago, in 3 h."""
    moment = local_time(stamp)
    if moment is None:
        return str(stamp)
    seconds = int((time.time() if now is None else now) - moment.timestamp())
    for size, unit in ((86400, " days"), (3600, " h"), (60, " min"), (1, " s")):
        if abs(seconds) >= size * (2 if unit == " days" else 1):
            return f"{seconds // size}{unit} ago" if seconds > 0 else \
                f"in {-seconds // size}{unit}"
    return "just now"


def short(text: Any, width: int) -> str:
    """The first line of text, cut to width with an ellipsis."""
    line = str(text or "").split("\n", 1)[0]
    return line if len(line) <= width else line[:width - 1] + "…"


class Spinner:
    """The task's state and current step on one erasable line of a terminal's stderr, while
    nothing else prints; nothing at all when stderr is not a terminal."""

    FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.state, self.step, self.frame, self.shown = "queued", "", 0, False

    def spin(self) -> None:
        if not self.enabled:
            return
        frames = self.FRAMES if "utf" in (sys.stderr.encoding or "").lower() else "|/-\\"
        self.frame = (self.frame + 1) % len(frames)
        width = shutil.get_terminal_size((80, 24)).columns - 1
        line = short(printable(f"{frames[self.frame]} {self.state}" +
                               (f": {self.step}" if self.step else "")), width)
        sys.stderr.write("\r\x1b[K" + line)
        sys.stderr.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def follow_entry(client: Client, entry: dict[str, Any], spinner: Spinner) -> None:
    """One log entry of a followed task: output to stdout and stderr as the task wrote it;
    steps, tool calls and approvals (with the command that answers them) to stderr."""
    kind = entry.get("type")
    if kind == "stdout":
        click.echo(printable(entry.get("text", "")))
    elif kind == "stderr":
        click.echo(printable(entry.get("text", "")), err=True)
    elif kind == "state":
        spinner.state = entry.get("state", spinner.state)
    elif kind == "step":
        spinner.step = entry.get("text", "")
        click.echo(click.style(printable(f"> {spinner.step}"), dim=use_color(True)), err=True)
    elif kind == "approval" and "state" not in entry:
        for _ in range(50):       # the log line may come before the approval is published
            try:
                approval = client.request("GET", f"/approvals/{entry['approval']}")
                break
            except CliError as exc:
                if exc.status != 404:
                    raise
                time.sleep(0.05)
        else:
            approval = {"id": entry["approval"], "kind": entry.get("kind"), "args": {},
                        "tool": entry.get("tool"), "cents": entry.get("cents")}
        ap = approval["id"]
        if approval["kind"] == "ask":
            text = f"the task asks: {approval.get('question')}\n  answer it: gurtd answer " \
                   f"{ap} 'TEXT'   (or: gurtd deny {ap} --reason TEXT)"
        elif approval["kind"] == "conflict":
            named = [p.get("path", "?") for p in approval["args"].get("paths", [])]
            more = len(named[20:]) + approval["args"].get("morePaths", 0)
            paths = ", ".join(named[:20]) + (f" and {more} more" if more else "")
            text = f"conflict {ap}: tasks that ended while this one ran changed {paths} too" \
                   f"\n  keep the task's: gurtd approve {ap}   the view's: gurtd approve {ap} " \
                   f"--args '{{\"keep\": \"view\"}}'   or: gurtd deny {ap} --reason TEXT"
        else:
            why = "BOX_HOME's disk is nearly full" if approval["kind"] == "disk" else \
                f"{cents_text(approval['cents'])} cents, over the budget"
            text = f"waiting for approval {ap}: {approval['tool']} " \
                   f"{json.dumps(approval['args'])} ({why})\n  gurtd approve {ap}   or   " \
                   f"gurtd deny {ap} --reason TEXT"
        text = "\n".join(printable(line) for line in text.split("\n"))
        click.echo(click.style(text, fg="yellow", bold=True) if use_color(True) else text,
                   err=True)
    elif kind in ("approval", "tool") or (kind == "event" and droid_step(
            entry.get("event") or {})):
        click.echo(printable(f"· {log_entry_text(entry)}"), err=True)


def follow_task(client: Client, task_id: str, as_json: bool) -> None:
    """Print a task's log as it comes until the task ends, a spinner meanwhile on a
    terminal.  The events come from a thread of their own, so that the spinner turns."""
    events: queue.Queue[tuple[str, Any]] = queue.Queue()

    def read() -> None:
        try:
            for event, data in client.events(f"/tasks/{task_id}/log?follow=1"):
                events.put((event, data))
            events.put(("eof", None))
        except BaseException as exc:       # handed to the main thread, which raises it
            events.put(("error", exc))

    threading.Thread(target=read, name="follow", daemon=True).start()
    spinner = Spinner(sys.stderr.isatty() and not as_json)
    while True:
        try:
            event, data = events.get(timeout=0.1)
        except queue.Empty:
            spinner.spin()
            continue
        spinner.clear()                # a no-op unless it was shown (never with as_json)
        if event == "error":
            raise data
        if event in ("end", "eof"):
            return
        if not as_json:
            follow_entry(client, json.loads(data), spinner)


def interrupted(client: Client, task_id: str) -> None:
    """Ctrl-C while following a task: on a terminal, ask whether to stop it; else say how
    to, and leave it running.  Exit 130, as a shell does after SIGINT."""
    click.echo("", err=True)
    if sys.stdin.isatty() and sys.stderr.isatty():
        try:
            stop = click.confirm(f"Stop task {task_id}?", default=False, err=True)
        except (click.Abort, EOFError, KeyboardInterrupt):
            stop = False
        if stop:
            task = client.request("POST", f"/tasks/{task_id}/stop")
            click.echo(f"{task_id} {task['state']}: stopped", err=True)
            sys.exit(130)
    click.echo(f"{task_id} goes on running: `gurtd log -f {task_id}` follows it, "
               f"`gurtd stop {task_id}` stops it", err=True)
    sys.exit(130)


class GroupedHelp(click.Group):
    """`gurtd --help` lists the commands by what they are about, host ones before in-task."""

    SECTIONS = (("Tasks", ("run", "tasks", "show", "log", "diff", "undo", "stop", "review",
                           "keep")),
                ("Decisions", ("approvals", "approve", "deny", "answer", "approve-all",
                               "policies", "policy")),
                ("Files", ("workspaces", "files", "put", "get")),
                ("Sources", ("schedules", "schedule", "hooks")),
                ("The box", ("status", "serve", "portal", "events", "settings", "secret",
                             "wallet", "token")),
                ("Inside a task", ("tool", "mcp")))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        listed = [n for _, names in self.SECTIONS for n in names]
        others = ("Other", tuple(n for n in self.list_commands(ctx) if n not in listed))
        for title, names in self.SECTIONS + (others,):
            rows = [(n, self.commands[n].get_short_help_str(formatter.width - 20))
                    for n in names if n in self.commands]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


@click.group(cls=GroupedHelp, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(VERSION, prog_name="gurtd")
def cli() -> None:
    """gurtd: run AI agent tasks boxed in and undoable.  `gurtd serve` runs the daemon; the
    other commands talk to it on localhost."""


def log_uncaught_everywhere() -> None:
    """Uncaught exceptions of any thread of `gurtd serve` go through log() at priority 3."""
    sys.excepthook = log_uncaught
    threading.excepthook = lambda a: log_uncaught(
        a.exc_type, a.exc_value or a.exc_type(), a.exc_traceback,
        a.thread.name if a.thread else "?")


@cli.command("serve")
@click.option("--box-home", envvar="BOX_HOME", default=DEFAULT_BOX_HOME, show_default=True,
              help="state, workspaces and layers (env BOX_HOME)")
@click.option("--listen", envvar="GURT_LISTEN", default=DEFAULT_LISTEN, show_default=True,
              help="HOST:PORT for the API (env GURT_LISTEN)")
@click.option("--dns-upstream", envvar="GURT_DNS_UPSTREAM", default=None,
              help="IPv4 HOST[:PORT] that resolves tasks' granted names (overrides the "
                   "upstreamDns setting; default: the host's resolv.conf nameserver)")
def cmd_serve(box_home: str, listen: str, dns_upstream: str | None) -> None:
    """Run gurtd in the foreground (as root)."""
    if os.geteuid() != 0:
        raise click.ClickException("gurtd serve must run as root")
    log_uncaught_everywhere()
    try:
        parse_listen(listen)
        if dns_upstream:
            parse_upstream(dns_upstream)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        serve(Box(box_home, listen, dns_upstream))
    except StartError as exc:
        raise click.ClickException(str(exc)) from None


@cli.command("token")
@click.option("--box-home", envvar="BOX_HOME", default=DEFAULT_BOX_HOME, show_default=True)
def cmd_token(box_home: str) -> None:
    """Print the API token."""
    try:
        with open(os.path.join(box_home, "token")) as f:
            click.echo(f.read().strip())
    except OSError as exc:
        raise click.ClickException(f"cannot read the token: {exc}") from None


@cli.command("run")
@click.argument("prompt", required=False)
@click.option("--worker", type=click.Choice(WORKERS), default=None, help="default droid")
@click.option("--workspace", default=None, help="default home")
@click.option("--title", default=None, help="default: the prompt's first line")
@click.option("--host", "hosts", multiple=True, help="a host the task may reach (repeatable)")
@click.option("--tool", "tools", multiple=True, help="a tool the task may call (repeatable)")
@click.option("--budget", type=float, default=None, help="budgetCents (US cents)")
@click.option("--folder", "folders", multiple=True,
              help="personal: a real folder the task works on a copy of (repeatable)")
@click.option("--wait", is_flag=True, help="follow the task to its end; exit 1 unless done")
@json_options("print the task as JSON")
def cmd_run(prompt: str | None, worker: str | None, workspace: str | None, title: str | None,
            hosts: tuple[str, ...], tools: tuple[str, ...], budget: float | None,
            folders: tuple[str, ...], wait: bool, as_json: bool, box_home: str,
            listen: str) -> None:
    """Create a task.  PROMPT is an argument, or standard input when absent or -."""
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            click.echo("Type the prompt; end it with Ctrl-D on a line of its own.", err=True)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty: give it as an argument (gurtd run 'fix "
                               "the failing test') or on standard input")
    body = {"prompt": prompt, "title": title or (prompt.strip().splitlines() or [""])[0][:60],
            **given(worker=worker, workspace=workspace, budgetCents=whole(budget),
                    hosts=list(hosts) or None, tools=list(tools) or None,
                    folders=[os.path.abspath(f) for f in folders] or None)}
    client = Client(listen, box_home)
    if (worker or "droid") == "droid":
        droid_ready(client)
    task = client.request("POST", "/tasks", body)
    if not wait:
        click.echo(json.dumps(task, indent=1) if as_json else task["id"])
        return
    if not as_json:     # the choice Ctrl-C offers is there on a terminal only (interrupted)
        hint = " (Ctrl-C: stop it, or leave it running)" if sys.stdin.isatty() and \
            sys.stderr.isatty() else ""
        click.echo(f"{task['id']} {task['state']}: following it{hint}", err=True)
    try:
        follow_task(client, task["id"], as_json)
    except KeyboardInterrupt:
        interrupted(client, task["id"])
    task = client.request("GET", f"/tasks/{task['id']}")
    print_answer(task, as_json, lambda t: click.echo(
        f"{t['id']} {paint(t['state'], True)}" +
        (f": {printable(t['error'])}" if t.get("error") else "") +
        (f" ({cents_text(t['costCents'])} cents)" if t.get("costCents") else ""), err=True))
    sys.exit(0 if task["state"] == "done" else 1)


def droid_ready(client: Client) -> None:
    """A first run: the droid worker without a model key would only fail; say what to do."""
    if client.request("GET", "/secrets")["model"]["set"] or \
            client.request("GET", "/settings")["droidFactoryKey"]:
        return
    raise click.ClickException(
        "the droid worker has no model set up yet: give gurtd the model key with `gurtd "
        "secret model` (asked for, never shown), or try the fake worker, which runs each "
        "line of the prompt with sh: gurtd run --worker fake 'echo hello'")


@cli.command("tasks")
@click.option("--state", type=click.Choice(STATES), default=None)
@click.option("--workspace", default=None)
@click.option("--limit", type=click.IntRange(1, 1000), default=200)
@json_options()
def cmd_tasks(state: str | None, workspace: str | None, limit: int, as_json: bool,
              box_home: str, listen: str) -> None:
    """List tasks, newest first."""
    query = urllib.parse.urlencode(given(state=state, workspace=workspace, limit=limit))
    tasks, now = Client(listen, box_home).request("GET", f"/tasks?{query}"), time.time()
    print_listing(tasks, as_json, lambda t: [
        t["id"], t["state"], t["worker"], t["workspace"], t.get("source", "api"),
        ago(t["createdAt"], now), cents_text(t.get("costCents", 0)), short(t["title"], 40),
        short(t.get("error") or "", 30)],
        ["ID", "STATE", "WORKER", "WORKSPACE", "SOURCE", "CREATED", "COST", "TITLE", "ERROR"], 1,
        "no tasks" + (" like that" if state or workspace else
                      " yet (gurtd run --worker fake 'echo hello' starts one)"))


def say_task(task: dict[str, Any]) -> None:
    """An action's answer in one line: t0123456789 undone, t0123456789 failed: stopped."""
    said = task["review"] if task.get("review") in ("kept", "undone") else task["state"]
    error = f": {task['error']}" if task.get("error") else ""
    click.echo(printable(f"{task['id']} {said}{error}"))
    merge = task.get("undoMerge") or {}
    if merge.get("reverted"):
        click.echo(printable("  taken out of later copies: " + ", ".join(merge["reverted"])))
    for kept in merge.get("kept") or ():
        click.echo(printable(f"  kept whole: {kept['path']} (task {kept['task']}: "
                             f"{kept['why']})"))
    if merge.get("state") in ("checking", "failed"):
        click.echo(printable(f"  later copies: {merge['state']} "
                             f"{merge.get('error') or '(gurtd log ' + task['id'] + ')'}"))
    elif merge.get("state") == "waiting":
        click.echo(printable(f"  later copies: waiting for the disk ({merge.get('error')}); "
                             f"tried again at {merge.get('retryAt')}"))


def _listing_command(name: str, doc: str, row: Callable[[Any], list[str]], headers: list[str],
                     empty: str) -> None:
    """`gurtd NAME`: the listing GET /api/NAME as a table of row(item), or as JSON."""
    @cli.command(name, help=doc)
    @json_options()
    def command(as_json: bool, box_home: str, listen: str) -> None:
        print_listing(Client(listen, box_home).request("GET", f"/{name}"), as_json, row,
                      headers, empty=empty)


def _task_command(name: str, method: str, suffix: str, doc: str,
                  say: Callable[[Any], None]) -> None:
    @cli.command(name, help=doc)
    @task_argument
    @json_options()
    def command(task_id: str, as_json: bool, box_home: str, listen: str) -> None:
        print_answer(Client(listen, box_home).request(method, f"/tasks/{task_id}{suffix}"),
                     as_json, say)


_task_command("show", "GET", "", "Show a task.", print_task)
_task_command("stop", "POST", "/stop", "Stop a task: it ends as failed with error stopped.",
              say_task)


@cli.command("log")
@task_argument
@click.option("-f", "--follow", is_flag=True, help="keep printing until the task ends")
@json_options("JSON lines as stored")
def cmd_log(task_id: str, follow: bool, as_json: bool, box_home: str, listen: str) -> None:
    """Print a task's log."""
    client = Client(listen, box_home)
    if follow:
        lines: Iterator[str] = (data for event, data in
                                client.events(f"/tasks/{task_id}/log?follow=1")
                                if event != "end")
    else:
        lines = iter(client.request("GET", f"/tasks/{task_id}/log").decode().splitlines())
    for line in lines:
        if as_json:
            click.echo(line)
        else:
            print_log_entry(json.loads(line))


@cli.command("approvals")
@click.option("--state", type=click.Choice(APPROVAL_STATES), default="pending",
              show_default=True)
@click.option("--task", "task_id", default=None)
@json_options()
def cmd_approvals(state: str, task_id: str | None, as_json: bool, box_home: str,
                  listen: str) -> None:
    """List approvals (pending ones by default)."""
    query = urllib.parse.urlencode(given(state=state, task=task_id or None))
    approvals, now = Client(listen, box_home).request("GET", f"/approvals?{query}"), time.time()
    print_listing(approvals, as_json, lambda a: [
        a["id"], a["state"], a["task"], a["kind"], a["tool"], cents_text(a["cents"]),
        ago(a["createdAt"], now), short(a.get("question") or json.dumps(a["args"]), 60)],
        ["ID", "STATE", "TASK", "KIND", "TOOL", "CENTS", "CREATED", "WHAT"], 1,
        f"no {state} approvals" + (f" of task {task_id}" if task_id else ""))


@cli.command("deny")
@approval_argument
@click.option("--reason", required=True, default=None, help="handed back to the task")
@json_options()
def cmd_deny(approval_id: str, reason: str, as_json: bool, box_home: str, listen: str) -> None:
    """Deny a pending approval; the reason goes back to the task."""
    if not reason:
        raise click.UsageError("--reason is required: it goes back to the task")
    approval = Client(listen, box_home).request("POST", f"/approvals/{approval_id}/deny",
                                                {"reason": reason})
    click.echo(json.dumps(approval, indent=1) if as_json else
               f"{approval['id']} {approval['state']}")


@cli.command("answer")
@approval_argument
@click.argument("text")
@client_options
def cmd_answer(approval_id: str, text: str, box_home: str, listen: str) -> None:
    """Answer a task's ask."""
    approval = Client(listen, box_home).request("POST", f"/approvals/{approval_id}/answer",
                                                {"answer": text})
    click.echo(f"{approval['id']} {approval['state']}")


@cli.command("wallet")
@click.option("--set", "balance", type=float, default=None, help="set the balance, in cents")
@json_options()
def cmd_wallet(balance: float | None, as_json: bool, box_home: str, listen: str) -> None:
    """Show the wallet (or set its balance)."""
    client, balance = Client(listen, box_home), whole(balance)
    wallet = client.request("PUT", "/wallet", {"balanceCents": balance}) \
        if balance is not None else client.request("GET", "/wallet")
    if as_json:
        click.echo(json.dumps(wallet, indent=1))
        return
    click.echo(f"balance: {cents_text(wallet['balanceCents'])} cents")
    for entry in wallet["ledger"][-20:]:
        if "set" in entry:
            click.echo(f"{entry['time']}  set to {cents_text(entry['set'])}")
        else:
            click.echo(printable(f"{entry['time']}  {entry['task']} paid "
                                 f"{cents_text(entry['cents'])} to "
                                 f"{entry['to']}" + (f" ({entry['memo']})" if entry.get("memo")
                                                     else "")))


# sources: schedules and hooks
_listing_command("schedules", "List schedules with their next run.", lambda s: [
    s["id"], s["name"][:30], s["cron"], s["timezone"], "on" if s["enabled"] else "off",
    ago(s["nextRuns"][0]) if s["nextRuns"] else "-",
    f"{s.get('lastTask') or '-'} {s.get('lastState') or ''}".strip()],
    ["ID", "NAME", "CRON", "TIMEZONE", "ENABLED", "NEXT RUN", "LAST RUN"],
    "no schedules (gurtd schedule add NAME 'CRON' -- PROMPT adds one)")


@cli.group("schedule")
def cmd_schedule() -> None:
    """Add a schedule, or run one now."""


@cmd_schedule.command("add")
@click.argument("name")
@click.argument("cron")
@click.argument("prompt", nargs=-1, required=True)
@click.option("--timezone", default="UTC", show_default=True, help="an IANA zone")
@click.option("--worker", type=click.Choice(WORKERS), default=None, help="default droid")
@click.option("--workspace", default=None, help="default home")
@click.option("--overlap", type=click.Choice(OVERLAPS), default="skip", show_default=True)
@json_options()
def cmd_schedule_add(name: str, cron: str, prompt: tuple[str, ...], timezone: str,
                     worker: str | None, workspace: str | None, overlap: str, as_json: bool,
                     box_home: str, listen: str) -> None:
    """Add a schedule: gurtd schedule add NAME 'CRON' -- PROMPT"""
    task = {"prompt": " ".join(prompt), **given(worker=worker, workspace=workspace)}
    item = Client(listen, box_home).request("POST", "/schedules", {
        "name": name, "cron": cron, "timezone": timezone, "overlap": overlap, "task": task})
    print_answer(item, as_json,
                 lambda s: click.echo(f"{s['id']} added, next run: " +
                                      (when(s["nextRuns"][0]) if s["nextRuns"] else "none")))


@cmd_schedule.command("run")
@click.argument("schedule_id")
@client_options
def cmd_schedule_run(schedule_id: str, box_home: str, listen: str) -> None:
    """Run a schedule now (its overlap rule applies); prints the task's id."""
    answer = Client(listen, box_home).request("POST", f"/schedules/{schedule_id}/run")
    click.echo(answer["task"]["id"] if answer.get("task") else "queued behind the active run")


_listing_command("hooks", "List hooks (their secrets are never shown again).", lambda h: [
    h["name"], h["source"], h["url"], ", ".join(h["allow"]) or "-", ago(h["createdAt"])],
    ["NAME", "SOURCE", "URL", "BODY MAY SET", "CREATED"],
    "no hooks (POST /api/hooks adds one: see Webhooks in the README)")


# Commands for people at a terminal (issue 12): status, workspaces, files, approve-all,
# events, settings.

@cli.command("status")
@json_options()
def cmd_status(as_json: bool, box_home: str, listen: str) -> None:
    """Is gurtd up: its version, how many tasks run, wait and queue, the wallet, pending
    approvals."""
    client = Client(listen, box_home, need_token=False)
    health = client.request("GET", "/health")        # asks for no token
    up = f"gurtd {health.get('version')} at {client.host}:{client.port}: " + \
        ("up" if health.get("ok") else "not ok")
    if client.no_token:                               # a user who may not read it: say why
        print_answer({"health": health}, as_json,
                     lambda _: click.echo(f"{up}\n(nothing more: {client.no_token})"))
        return
    counts = {state: len(client.request("GET", f"/tasks?state={state}&limit=1000"))
              for state in ("running", "waiting", "queued")}
    pending = client.request("GET", "/approvals?state=pending")
    wallet = client.request("GET", "/wallet")
    if as_json:
        click.echo(json.dumps({"health": health, "tasks": counts, "pendingApprovals":
                               len(pending), "balanceCents": wallet["balanceCents"]}, indent=1))
        return
    click.echo(up)
    click.echo("tasks:      " + ", ".join(
        f"{n}{'+' if n >= 1000 else ''} {paint(s)}"
        for s, n in counts.items()))
    click.echo(f"wallet:     {cents_text(wallet['balanceCents'])} cents")
    click.echo(f"approvals:  {len(pending)} pending" +
               (" (`gurtd approvals` lists them)" if pending else ""))


_listing_command("workspaces", "List workspaces and how many layers (done tasks) each has.",
                 lambda w: [w["name"], str(w.get("layers", 0))], ["NAME", "LAYERS"],
                 "no workspaces")


@cli.command("files")
@click.argument("workspace")
@click.argument("path", required=False, default="")
@json_options("a folder's listing as JSON")
def cmd_files(workspace: str, path: str, as_json: bool, box_home: str, listen: str) -> None:
    """List a folder of a workspace's current view, or print a file: its bytes as they are
    when piped, with control characters escaped on a terminal."""
    quoted = urllib.parse.quote(path.strip("/"))
    answer = Client(listen, box_home).request(
        "GET", workspace_url(workspace, "/files" + (f"/{quoted}" if quoted else "")))
    if isinstance(answer, bytes) and sys.stdout.isatty():   # a task's bytes: no escapes
        for line in answer.decode(errors="replace").split("\n"):
            click.echo(printable(line))
    elif isinstance(answer, bytes):
        sys.stdout.buffer.write(answer)
        sys.stdout.flush()
    else:
        print_answer(answer, as_json, lambda a: print_listing(a["entries"], False, lambda e: [
            e["type"], str(e["size"]) if e["type"] == "file" else "-",
            e["name"] + ("/" if e["type"] == "directory" else "")], ["TYPE", "SIZE", "NAME"],
            empty="an empty folder"))


@cli.command("approve-all")
@click.option("--task", "task_id", default=None, help="only this task's")
@client_options
def cmd_approve_all(task_id: str | None, box_home: str, listen: str) -> None:
    """Approve every pending spending (asks wait for an answer: gurtd answer)."""
    client = Client(listen, box_home)
    done = client.request("POST", "/approvals/approve-all", {"task": task_id} if task_id else {})
    click.echo(f"approved {done['approved']}")
    query = "state=pending" + (f"&task={urllib.parse.quote(task_id)}" if task_id else "")
    for ask in client.request("GET", f"/approvals?{query}"):
        if ask["kind"] == "ask":
            click.echo(printable(f"{ask['id']} asks: {short(ask.get('question'), 60)}  "
                                 f"(gurtd answer {ask['id']} 'TEXT')"))


def event_text(kind: str, data: dict[str, Any]) -> str:
    """One event of /api/events in a line for people."""
    if kind == "task":
        return printable(f"task {data.get('id')} ") + paint(data["state"]) + printable(
            f"  {short(data.get('title'), 50)}" + (f"  ({short(data['error'], 60)})"
                                                   if data.get("error") else ""))
    if kind == "approval":
        what = data.get("question") or f"{data.get('tool')} {cents_text(data.get('cents'))} " \
                                        "cents"
        return printable(f"approval {data.get('id')} ") + paint(data["state"]) + printable(
            f"  {data.get('kind')} of task {data.get('task')}: {short(what, 60)}")
    return printable(f"{kind} {json.dumps(data)[:150]}")


def event_time(data: dict[str, Any]) -> str:
    """When an event happened (its record's own time, local), not when it reached us: a
    replayed event keeps its time."""
    moment = local_time(data.get("answeredAt") or data.get("updatedAt") or
                        data.get("createdAt") or data.get("time"))
    return f"{moment or datetime.datetime.now():%H:%M:%S}"


@cli.command("events")
@click.option("--since", default=None, help="replay what followed this event id")
@json_options("one JSON object a line")
def cmd_events(since: str | None, as_json: bool, box_home: str, listen: str) -> None:
    """Follow gurtd's events (task states, approvals) as they come, until Ctrl-C."""
    client = Client(listen, box_home)
    try:
        stream = client.events("/events" + (f"?since={urllib.parse.quote(since)}"
                                            if since else ""))
        click.echo("following gurtd's events (Ctrl-C ends)", err=True)
        for kind, data in stream:
            parsed = json.loads(data)
            if as_json:
                click.echo(json.dumps({"event": kind, "data": parsed}))
            elif kind == "reset":
                click.echo("(some events were missed: too many at once)")
            else:
                click.echo(f"{event_time(parsed)}  {event_text(kind, parsed)}")
    except KeyboardInterrupt:
        sys.exit(130)


def setting_value(text: str) -> Any:
    """A value given on the command line: JSON when it reads as JSON (8, true, ["a"]),
    else the text itself (claude-opus-5)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@cli.command("settings")
@click.argument("key", required=False)
@click.argument("value", required=False)
@json_options()
def cmd_settings(key: str | None, value: str | None, as_json: bool, box_home: str,
                 listen: str) -> None:
    """Show the settings, one, or change one: gurtd settings maxRunningTasks 4."""
    client = Client(listen, box_home)
    settings = client.request("PUT", "/settings", {key: setting_value(value)}) \
        if value is not None else client.request("GET", "/settings")
    if key is not None and key not in settings:
        raise click.ClickException(f"no setting named {key}; there are: "
                                   f"{', '.join(sorted(settings))}")
    if key is not None:
        print_answer(settings[key], as_json, lambda v: click.echo(printable(json.dumps(v))))
        return
    print_answer(settings, as_json, lambda s: click.echo("\n".join(
        printable(f"{name}: {json.dumps(v)}") for name, v in s.items())))


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None = None) -> None:
        super().__init__("box", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix_path)


def broker_path() -> str:
    """The broker socket of the task this runs in, or an error for people outside one."""
    path = os.environ.get("GURT_BROKER", BROKER_IN_BOX)
    if not os.path.exists(path):
        raise click.ClickException(
            f"not inside a task (no broker at {path}): `gurtd tool` and `gurtd mcp` talk to "
            "the broker of the task they run in.  From the host, run them in a task: gurtd run "
            "--worker fake --tool ask --wait PROMPT runs each line of PROMPT in one (the "
            "README's \"MCP from the host\")")
    return path


def broker_request(method: str, path: str, body: Any = None,
                   opened: Callable[[UnixHTTPConnection], None] | None = None
                   ) -> tuple[int, Any]:
    """One request to the broker socket of the task this runs in.  opened(conn) hears of the
    connection once it is made: hanging it up withdraws a call that waits for a person."""
    conn = UnixHTTPConnection(broker_path())
    try:
        conn.connect()
        if opened is not None:
            opened(conn)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


cli.add_command(client_options(cmd_secret))   # defined in the Model gateway section


@cli.command("tool")
@click.argument("name")
@click.argument("args", required=False, default="{}")
def cmd_tool(name: str, args: str) -> None:
    """Call a tool through the broker, from inside a task: gurtd tool wallet.pay '{"to": "x",
    "cents": 5}'.  Prints the JSON result; exits 1 when the call is refused."""
    try:
        parsed = json.loads(args)
    except ValueError as exc:
        raise click.UsageError(f"ARGS must be JSON: {exc}") from None
    try:
        status, answer = broker_request("POST", "/call", {"tool": name, "args": parsed})
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"the broker did not answer: {exc}") from None
    if status != 200:
        click.echo(answer.get("error", f"refused ({status})"), err=True)
        sys.exit(1)
    click.echo(json.dumps(answer.get("result")))


TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "wallet.pay": {"type": "object", "required": ["to", "cents"], "additionalProperties": False,
                   "properties": {"to": {"type": "string"},
                                  "cents": {"type": "number", "minimum": MIN_PAYMENT_CENTS},
                                  "memo": {"type": "string"}}},
    "ask": {"type": "object", "required": ["question"], "additionalProperties": False,
            "properties": {"question": {"type": "string"}}},
}
# What the built-in tools answer (MCP's outputSchema): a client checks structuredContent by it.
TOOL_OUTPUT_SCHEMAS: dict[str, dict[str, Any]] = {
    "wallet.pay": {"type": "object", "required": ["paid", "to", "cents", "balanceCents"],
                   "properties": {"paid": {"type": "boolean"}, "to": {"type": "string"},
                                  "cents": {"type": "number"},
                                  "balanceCents": {"type": "number"}}},
    "ask": {"type": "object", "required": ["answer"],
            "properties": {"answer": {"type": "string"}}},
}
# Protocol revisions gurtd speaks, newest first: the client's if it is one, else the newest.
MCP_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
MCP_EOF_GRACE = 10.0         # seconds calls in flight may still take once stdin is closed


class McpError(Exception):
    """A JSON-RPC error answer: -32600 invalid request, -32602 invalid params, ..."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def mcp_rpc_id(message: dict[str, Any]) -> Any:
    """The id to answer with: JSON-RPC ids are strings or numbers (null when unusable)."""
    value = message.get("id")
    return value if isinstance(value, (str, int, float)) and not isinstance(value, bool) \
        else None


class McpServer:
    """`gurtd mcp`: a Model Context Protocol server on stdio, inside a task.  Each request runs
    in a thread of its own (a pending ask blocks neither ping nor other calls) and answers
    under a lock on stdout; notifications/cancelled hangs up the request's broker connection,
    and the broker withdraws the approval it was waiting for."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.version = MCP_VERSIONS[0]
        self.calls: dict[Any, UnixHTTPConnection | None] = {}   # in flight, by request id
        self.cancelled: set[Any] = set()

    def send(self, reply: dict[str, Any]) -> None:
        with self.lock:
            self.out.write(json.dumps(reply) + "\n")
            self.out.flush()

    def serve(self, lines: Iterator[str]) -> None:
        threads: list[threading.Thread] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                message = json.loads(line)
            except ValueError:
                self.send({"jsonrpc": "2.0", "id": None,
                           "error": {"code": -32700, "message": "parse error"}})
                continue
            thread = self.dispatch(message)
            if thread is not None:
                threads = [t for t in threads if t.is_alive()] + [thread]
        # stdin closed: calls in flight get MCP_EOF_GRACE seconds to be answered (a piped
        # client reads on); those still waiting then (for a person) are withdrawn, never
        # left pending with nobody to hear the answer.
        deadline = time.monotonic() + MCP_EOF_GRACE
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self.lock:
            pending = list(self.calls.values())
        for conn in pending:
            self.hang_up(conn)
        for thread in threads:
            thread.join(timeout=5.0)

    def dispatch(self, message: Any) -> threading.Thread | None:
        """Check the envelope here (in order); a request then gets a thread of its own."""
        rpc_id = mcp_rpc_id(message) if isinstance(message, dict) else None
        problem = None
        if not isinstance(message, dict):
            problem = "a message is a JSON object"
        elif message.get("jsonrpc") != "2.0":
            problem = 'not a JSON-RPC 2.0 message: "jsonrpc" must be "2.0"'
        elif "method" not in message:
            problem = "a request needs a method (this server sends no requests to answer)"
        elif not isinstance(message["method"], str):
            problem = "method must be a string"
        elif message.get("id") is not None and rpc_id is None:
            problem = "id must be a string or a number"
        if problem is not None:
            self.send({"jsonrpc": "2.0", "id": rpc_id,
                       "error": {"code": -32600, "message": problem}})
            return None
        if "id" not in message:
            self.notice(message)
            return None
        with self.lock:
            self.calls[rpc_id] = None
        thread = threading.Thread(target=self.handle, args=(message, rpc_id), daemon=True)
        thread.start()
        return thread

    def notice(self, message: dict[str, Any]) -> None:
        """A notification: no answer.  Cancelling hangs up the call's broker connection."""
        params = message.get("params")
        if message["method"] != "notifications/cancelled" or not isinstance(params, dict):
            return
        request_id = mcp_rpc_id({"id": params.get("requestId")})
        with self.lock:
            if request_id is None or request_id not in self.calls:
                return
            self.cancelled.add(request_id)
            conn = self.calls[request_id]
        self.hang_up(conn)

    @staticmethod
    def hang_up(conn: UnixHTTPConnection | None) -> None:
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def handle(self, message: dict[str, Any], rpc_id: Any) -> None:
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": rpc_id}
        try:
            params = {} if message.get("params") is None else message["params"]
            if not isinstance(params, dict):
                raise McpError(-32602, "params must be an object")
            reply["result"] = self.answer(message["method"], params, rpc_id)
        except McpError as exc:
            reply["error"] = {"code": exc.code, "message": str(exc)}
        except (OSError, ValueError, http.client.HTTPException) as exc:
            reply["error"] = {"code": -32603, "message": f"the broker did not answer: {exc}"}
        except click.ClickException as exc:     # said for people (no broker here): as it is
            reply["error"] = {"code": -32603, "message": exc.format_message()}
        except Exception as exc:   # one request fails, never the agent's whole session
            reply["error"] = {"code": -32603, "message": f"{type(exc).__name__}: {exc}"}
        finally:
            with self.lock:
                self.calls.pop(rpc_id, None)
                cancelled = rpc_id in self.cancelled
                self.cancelled.discard(rpc_id)
        if not cancelled:    # a cancelled request is not answered (the spec's SHOULD NOT)
            self.send(reply)

    def broker(self, rpc_id: Any, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        def opened(conn: UnixHTTPConnection) -> None:
            with self.lock:
                if rpc_id in self.cancelled:
                    self.hang_up(conn)
                self.calls[rpc_id] = conn
        return broker_request(method, path, body, opened)

    def answer(self, method: str, params: dict[str, Any], rpc_id: Any) -> dict[str, Any]:
        if method == "initialize":
            asked = params.get("protocolVersion")
            self.version = asked if asked in MCP_VERSIONS else MCP_VERSIONS[0]
            return {"protocolVersion": self.version,
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": "gurtd", "version": VERSION}}
        if method == "ping":
            return {}
        if method == "tools/list":
            status, answer = self.broker(rpc_id, "GET", "/tools")
            if status != 200:
                raise McpError(-32603, answer.get("error", f"the broker answered {status}"))
            return {"tools": [self.tool(name) for name in answer["tools"]]}
        if method == "tools/call":
            return self.call(params, rpc_id)
        raise McpError(-32601, f"no method {method}")

    def structured(self) -> bool:
        return self.version >= "2025-06-18"

    def tool(self, name: str) -> dict[str, Any]:
        out = {"name": name, "description": BUILTIN_TOOLS.get(name, "a tool of this box"),
               "inputSchema": TOOL_SCHEMAS.get(name, {"type": "object"})}
        if name in TOOL_OUTPUT_SCHEMAS and self.structured():
            out["outputSchema"] = TOOL_OUTPUT_SCHEMAS[name]
        return out

    def call(self, params: dict[str, Any], rpc_id: Any) -> dict[str, Any]:
        """A tool call.  Unknown or ungranted tools are a protocol error (-32602); a call the
        tool or a person refuses is a result with isError, which the model gets to read."""
        name, args = params.get("name"), params.get("arguments")
        if not isinstance(name, str) or not name:
            raise McpError(-32602, "tools/call needs the tool's name (params.name)")
        args = {} if args is None else args
        if not isinstance(args, dict):
            raise McpError(-32602, "params.arguments must be an object")
        status, answer = self.broker(rpc_id, "POST", "/call", {"tool": name, "args": args})
        if answer.get("code") in ("tool_not_allowed", "not_found"):
            raise McpError(-32602, f"unknown tool: {name} ({answer.get('error')})")
        if status != 200:
            return {"content": [{"type": "text", "text": answer.get("error",
                                                                     f"refused ({status})")}],
                    "isError": True}
        result = answer["result"]
        out: dict[str, Any] = {"content": [{"type": "text", "text": json.dumps(result)}],
                               "isError": False}
        if isinstance(result, dict) and self.structured():
            out["structuredContent"] = result
        return out


@cli.command("mcp")
def cmd_mcp() -> None:
    """A Model Context Protocol server on stdio, inside a task: lists exactly the task's tools
    and forwards calls to the broker (initialize, ping, tools/list, tools/call)."""
    if sys.stdin.isatty():          # a person at the host's terminal, not an MCP client
        broker_path()
    McpServer(sys.stdout).serve(iter(sys.stdin.readline, ""))


# personal mode: review
def review_post(client: Client, path: str, body: dict[str, Any]) -> Any:
    """POST a keep or an undo; a refusal prints its conflicts, one a line, and exits 1.
    Its answer waits for the review thread: a keep of 100,000 files took 66-77 s loaded."""
    client.timeout = 900.0
    try:
        return client.request("POST", path, body)
    except CliError as exc:
        for c in exc.body.get("conflicts", []) + exc.body.get("notUndone", []):
            click.echo(printable(f"conflict  {c.get('folder')}/{c.get('path')}: {c.get('why')}"),
                       err=True)
        raise


@cli.command("review")
@json_options()
def cmd_review(as_json: bool, box_home: str, listen: str) -> None:
    """The personal tasks waiting for the owner: done, with review pending or conflict."""
    tasks = [t for t in Client(listen, box_home).request("GET", "/tasks?state=done&limit=1000")
             if t.get("review") in ("pending", "conflict")]
    print_listing(tasks, as_json, lambda t: [t["id"], t["review"], ", ".join(
        t.get("folders") or []), t["title"][:50]], ["ID", "REVIEW", "FOLDERS", "TITLE"],
        empty="nothing to review")


@cli.command("diff")
@task_argument
@click.option("--path", default=None, help="only this path (or folder)")
@client_options
def cmd_diff(task_id: str, path: str | None, box_home: str, listen: str) -> None:
    """A task's changes as a unified diff (its folders, or its workspace layer)."""
    query = "?path=" + urllib.parse.quote(path) if path else ""
    text = Client(listen, box_home).request("GET", f"/tasks/{task_id}/diff{query}")
    click.echo(text.decode(errors="replace"), nl=False)


@cli.command("keep")
@task_argument
@click.option("--force", is_flag=True, help="the task's version wins over the owner's edits")
@click.option("--path", "paths", multiple=True, help="keep only this path (repeatable)")
@json_options()
def cmd_keep(task_id: str, force: bool, paths: tuple[str, ...], as_json: bool, box_home: str,
             listen: str) -> None:
    """Apply a personal task's changes to the real folders (409: the conflicts, one a line)."""
    body: dict[str, Any] = {"force": True} if force else {}
    if paths:
        body["paths"] = [os.path.abspath(p) if os.path.exists(p) or p.startswith("./")
                         else p for p in paths]
    task = review_post(Client(listen, box_home), f"/tasks/{task_id}/keep", body)
    print_answer(task, as_json, say_task)


@cli.command("undo")
@task_argument
@click.option("--force", is_flag=True, help="a kept task: put the versions from before the "
                                            "keep back even over the owner's later edits")
@json_options()
def cmd_undo(task_id: str, force: bool, as_json: bool, box_home: str, listen: str) -> None:
    """Undo a task: stop it and take its changes away (a kept one's from the real folders)."""
    task = review_post(Client(listen, box_home), f"/tasks/{task_id}/undo",
                       {"force": True} if force else {})
    print_answer(task, as_json, say_task)


# decisions: approve with changes or always, policies
@cli.command("approve")
@approval_argument
@click.option("--reason", default=None, help="kept with it")
@click.option("--args", "args_json", default=None, metavar="JSON",
              help="run the call with these arguments instead (checked like the originals)")
@click.option("--budget", type=float, default=None, metavar="CENTS",
              help="a budget approval: raise the task's budget to CENTS instead")
@click.option("--always", type=click.Choice(POLICY_SCOPES), default=None,
              help="also record a policy: later calls like it in this scope run without asking")
@json_options()
def cmd_approve(approval_id: str, reason: str | None, args_json: str | None,
                budget: float | None, always: str | None, as_json: bool, box_home: str,
                listen: str) -> None:
    """Approve a pending approval: the call runs (or the host is granted)."""
    if sum(x is not None for x in (args_json, budget, always)) > 1:
        raise click.UsageError("give one of --args, --budget, --always")
    body = given(reason=reason or None, budgetCents=budget, scope=always)
    if args_json is not None:
        try:
            body["args"] = json.loads(args_json)
        except ValueError as exc:
            raise click.UsageError(f"--args is not JSON: {exc}") from None
    suffix = "approve" if always is None else "always"
    client = Client(listen, box_home)
    try:
        approval = client.request("POST", f"/approvals/{approval_id}/{suffix}", body)
    except CliError as exc:
        if exc.code == "conflict" and "an ask" in str(exc):
            raise click.ClickException(f"{approval_id} is an ask: answer it with gurtd answer "
                                       f"{approval_id} 'TEXT' (or gurtd deny {approval_id} "
                                       "--reason TEXT)") from None
        raise
    click.echo(json.dumps(approval, indent=1) if as_json else
               f"{approval['id']} {approval['state']}" +
               (f" (policy {approval['policy']})" if approval.get("policy") else ""))


_listing_command("policies", "List the policies (always-approve).", lambda p: [
    p["id"], p["tool"] + (f" {p['host']}" if p.get("host") else ""),
    p["scope"] + (f" {p.get('task') or p.get('workspace')}" if p["scope"] != "box" else ""),
    " ".join(f"{k}={p[k]}" for k in ("maxCents", "totalCents", "expiresAt")
             if p.get(k) is not None) or "-", str(p["spentCents"]), str(p["uses"]),
    "yes" if p["active"] else f"no: {p.get('endedBecause')}"],
    ["ID", "TOOL", "SCOPE", "LIMITS", "SPENT", "USES", "ACTIVE"],
    "no policies (gurtd approve AP --always SCOPE records one)")


@cli.group("policy")
def cmd_policy() -> None:
    """Change policies (always-approve)."""


@cmd_policy.command("rm")
@click.argument("policy_id")
@client_options
def cmd_policy_rm(policy_id: str, box_home: str, listen: str) -> None:
    """Delete a policy: matching calls ask a person again."""
    policy = Client(listen, box_home).request("DELETE", f"/policies/{policy_id}")
    click.echo(f"{policy['id']} deleted")


# files in and out: gurtd put / gurtd get

def say_upload(task: dict[str, Any]) -> None:
    click.echo(printable(f"{task.get('summary', '')} into {task['workspace']}: task "
                         f"{task['id']} (undo it with: gurtd undo {task['id']})"))


@cli.command("put")
@click.argument("workspace")
@click.argument("source", type=click.Path(exists=False, allow_dash=True))
@click.argument("dest", required=False)
@json_options("print the upload's task as JSON")
def cmd_put(workspace: str, source: str, dest: str | None, as_json: bool, box_home: str,
            listen: str) -> None:
    """Put a file or a folder into a workspace, as a layer of its own (undo takes it out).

    SOURCE is a file (it lands at DEST, default its name), a folder (its contents land under
    DEST, default the top), or - for standard input (a file at DEST, else a tar archive)."""
    import tarfile
    client = Client(listen, box_home)
    if source != "-" and not os.path.lexists(source):
        raise click.ClickException(f"{source}: no such file or folder")
    with tempfile.TemporaryFile() as spool:
        if source == "-":
            shutil.copyfileobj(sys.stdin.buffer, spool)
        elif os.path.isdir(source):
            with tarfile.open(fileobj=spool, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
                tar.add(source, arcname=(dest or ".").strip("/") or ".")
        else:
            with open(source, "rb") as f:
                shutil.copyfileobj(f, spool)
        length = spool.tell()
        spool.seek(0)
        if os.path.isdir(source) or (source == "-" and not dest):
            path, ctype = workspace_url(workspace, "/upload"), "application/x-tar"
        else:
            name = dest or os.path.basename(source.rstrip("/"))
            if not name or name == "-":
                raise click.ClickException("name the file: gurtd put WORKSPACE - DEST")
            path = workspace_url(workspace, "/files/" + urllib.parse.quote(name.lstrip("/")))
            ctype = "application/octet-stream"
        _, resp = client.open("PUT" if "/files/" in path else "POST", path, spool, {
            "Content-Type": ctype, "Content-Length": str(length)}, client.transfer_timeout)
        task = json.loads(resp.read())
    print_answer(task, as_json, say_upload)


@cli.command("get")
@click.argument("workspace", required=False)
@click.argument("path", required=False)
@click.option("--task", "task_id", default=None, help="a task's changes instead (tar.gz)")
@click.option("-o", "--output", default=None,
              help="where to write (- for standard output); default: the file's name, or "
                   "WORKSPACE.tar.gz / TASK.tar.gz")
@client_options
def cmd_get(workspace: str | None, path: str | None, task_id: str | None, output: str | None,
            box_home: str, listen: str) -> None:
    """Get a file of a workspace's current view, the whole view as a tar.gz, or (--task) what
    one task added or changed as a tar.gz."""
    client = Client(listen, box_home)
    if task_id:
        if workspace or path:
            raise click.ClickException("give either --task ID or WORKSPACE [PATH]")
        url, default = f"/tasks/{urllib.parse.quote(task_id, safe='')}/archive", \
            f"{task_id}.tar.gz"
    elif not workspace:
        raise click.ClickException("name a workspace (gurtd get WORKSPACE [PATH]) or a task "
                                   "(gurtd get --task ID)")
    elif path:
        url = workspace_url(workspace, "/files/" + urllib.parse.quote(path.lstrip("/")))
        default = os.path.basename(path.rstrip("/")) or workspace
    else:
        url, default = workspace_url(workspace, "/archive"), f"{workspace}.tar.gz"
    _, resp = client.open("GET", url, timeout=client.transfer_timeout)
    if resp.getheader("Content-Type", "").startswith("application/json"):
        listing = json.loads(resp.read())        # a folder: say what is in it
        for entry in listing.get("entries", []):
            click.echo(printable(entry["name"] + ("/" if entry["type"] == "directory" else "")))
        return
    target = output or default
    out = sys.stdout.buffer if target == "-" else open(target, "wb")
    try:
        shutil.copyfileobj(resp, out, 65536)
    finally:
        if out is not sys.stdout.buffer:
            out.close()
            click.echo(f"wrote {target}", err=True)


@cli.command("portal")
@client_options
def cmd_portal(box_home: str, listen: str) -> None:
    """Print a one-time sign-in URL for the portal (a browser on this machine, or through an
    SSH tunnel to the same port); it works once, within two minutes."""
    client = Client(listen, box_home)
    made = client.request("POST", "/sessions/codes", {})
    click.echo(f"http://{client.url_host}:{client.port}{made['path']}")
    click.echo(f"(one use, valid for {int(made['expiresInSeconds'])} seconds)", err=True)


def main() -> None:
    cli(prog_name="gurtd")


if __name__ == "__main__":
    main()
