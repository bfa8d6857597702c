"""The packaging: the systemd unit verifies, the OpenAPI description covers every route."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT

import gurtd as G


def test_the_unit_file_verifies_clean(tmp_path):
    # ExecStart must name an existing program for systemd-analyze, so point it at this checkout.
    with open(os.path.join(ROOT, "gurtd.service")) as f:
        unit = f.read()
    assert "Type=notify" in unit and "Restart=on-failure" in unit
    assert re.search(r"^ExecStart=/usr/local/bin/gurtd serve$", unit, re.M)
    unit = unit.replace("ExecStart=/usr/local/bin/gurtd",
                        f"ExecStart={sys.executable} {os.path.join(ROOT, 'gurtd.py')}")
    path = tmp_path / "gurtd.service"
    path.write_text(unit)
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out


def test_every_directive_of_the_unit_says_why():
    with open(os.path.join(ROOT, "gurtd.service")) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith(("#", "[")) and "=" in line:
            before = [x for x in lines[:i] if x.strip()]
            assert before and (before[-1].startswith("#") or "=" in before[-1]
                               or before[-1].startswith("[")), line


def test_the_openapi_description_has_exactly_the_routes(gurtd):
    doc = gurtd.api("GET", "/api/openapi.json")
    assert doc["openapi"].startswith("3.1")
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routed = {(m, p) for m, p, _, _ in G.ROUTES}
    assert described == routed
    task = doc["components"]["schemas"]["Task"]
    for field in ("title", "prompt", "workspace", "worker", "tools", "hosts", "budgetCents",
                  "source", "id", "state", "user", "layers", "costCents", "createdAt",
                  "updatedAt"):
        assert field in task["required"], field
    assert task["properties"]["state"]["enum"] == list(G.STATES)


def test_health_needs_no_token_and_nothing_else_is_open(gurtd):
    code, body, _ = gurtd.request("GET", "/api/health", token=False)
    assert code == 200 and body["ok"] is True
    opened = {(m, p) for m, p, fn, _ in G.ROUTES if fn in G.OPEN_HANDLERS}
    assert opened == {("GET", "/"), ("POST", "/api/sessions"), ("GET", "/api/sessions/current")}
    for method, pattern, fn, _ in G.ROUTES:
        if pattern == "/api/health" or fn in G.OPEN_HANDLERS:
            continue
        if (method, pattern) == ("POST", "/api/hooks/{name}"):   # signed, not token-held:
            code, body, _ = gurtd.request(method, "/api/hooks/home", token=False)
            assert code == 401 and body["code"] == "bad_signature", body
            continue
        path = pattern.replace("{id}", "t000000000").replace("{name}", "home") \
            .replace("{path}", "x")
        code, body, _ = gurtd.request(method, path, token=False)
        assert code == 401 and body["code"] == "unauthorized", (method, path, code, body)


def test_make_install_and_the_readme_agree():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    first_block = readme.split("```sh", 1)[1].split("```", 1)[0]
    assert "sudo make run" in first_block and "sudo make test" in first_block
    for _, pattern, _, _ in G.ROUTES:
        forms = {pattern, pattern.replace("{id}", "$ID"), pattern.replace("{id}", "$AP"),
                 pattern.replace("/{path}", "/")}
        assert any(form in readme for form in forms), pattern
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "make test" in f.read()
