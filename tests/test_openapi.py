"""The OpenAPI description as real clients no one here wrote take it: a validator, schemathesis
against a live gurtd, and a generated Python client used for real calls."""

from __future__ import annotations

import importlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gurtd as G
from conftest import Gurtd, eventually, running_gurtd

VENV_BIN = os.path.dirname(sys.executable)
SHARED_GURTD = True


def tool(name: str) -> str:
    """A command of the test requirements (requirements-test.txt); missing is a failure."""
    path = os.path.join(VENV_BIN, name)
    assert os.access(path, os.X_OK), f"{name} is missing: pip install -r requirements-test.txt"
    return path


def test_the_description_is_valid_and_names_where_gurtd_listens(gurtd: Gurtd) -> None:
    from openapi_spec_validator import validate
    doc = gurtd.api("GET", "/api/openapi.json")
    validate(doc)
    assert doc["servers"] == [{"url": f"http://127.0.0.1:{gurtd.port}"}]
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) == len(G.ROUTES)
    listing = doc["paths"]["/api/tasks"]["get"]
    assert {p["name"] for p in listing["parameters"]} == {"state", "workspace", "limit"}
    assert set(listing["responses"]) >= {"200", "400", "401", "403"}
    assert "default" not in listing["responses"]
    log = doc["paths"]["/api/tasks/{id}/log"]["get"]["responses"]["200"]["content"]
    assert set(log) == {"application/jsonl", "text/event-stream"}
    upload = doc["paths"]["/api/workspaces/{name}/upload"]["post"]["requestBody"]["content"]
    assert "application/x-tar" in upload and "application/gzip" in upload


@pytest.mark.pure
def test_every_route_is_documented() -> None:
    """Routes without answers get a minimal description; this lists them."""
    missing = G.undocumented_routes()
    if missing:
        print("\nRoutes without answers (add them to their Route in ROUTES):")
        for method, pattern in missing:
            print(f"    ({method!r}, {pattern!r})")
    assert not missing, "routes without answers: " + \
        ", ".join(f"{m} {p}" for m, p in missing)


@pytest.mark.pure
def test_a_route_added_without_docs_still_gets_a_valid_description() -> None:
    from openapi_spec_validator import validate
    route = G.Route("POST", "/api/tasks/{id}/frobnicate", G.h_health, "A route of tomorrow")
    G.ROUTES.append(route)
    try:
        doc = G.openapi()
        assert ("POST", "/api/tasks/{id}/frobnicate") in G.undocumented_routes()
    finally:
        G.ROUTES.remove(route)
    validate(doc)
    op = doc["paths"]["/api/tasks/{id}/frobnicate"]["post"]
    assert op["operationId"] == "post_api_tasks_id_frobnicate" and op["tags"] == ["tasks"]
    assert op["parameters"][0]["name"] == "id" and "401" in op["responses"]


@pytest.mark.pure
def test_the_schemas_come_from_the_tables_that_validate() -> None:
    schemas = G.openapi()["components"]["schemas"]
    for name in ("Task", "TaskCreate", "Approval", "Workspace", "Wallet", "LedgerEntry",
                 "Settings", "SettingsUpdate", "Change", "FileEntry", "FileList", "Health",
                 "Error"):
        assert name in schemas, name
    settings = schemas["Settings"]["properties"]
    assert set(settings) == set(G.DEFAULT_SETTINGS)
    assert {k: v["default"] for k, v in settings.items()} == G.DEFAULT_SETTINGS
    assert schemas["SettingsUpdate"]["additionalProperties"] is False
    create = schemas["TaskCreate"]
    assert create["additionalProperties"] is False and create["required"] == ["title", "prompt"]
    # every field a create takes, but the personal ones that are refused for now
    assert set(create["properties"]) == set(G.TASK_FIELDS)
    assert create["properties"]["worker"]["enum"] == list(G.WORKERS)
    assert set(schemas["Task"]["properties"]) >= set(G.PUBLIC_FIELDS)
    assert "upload" in schemas["Task"]["properties"]["worker"]["enum"]
    assert schemas["Approval"]["properties"]["state"]["enum"] == list(G.APPROVAL_STATES)


# Task ids that do not exist are a 400 ("No task with this id", the GurtOS contract), not a
# 404; whether a workspace exists, the droid CLI is installed, a wildcard is under a public
# suffix, a model is priced, or a body is a tar archive are not things a schema can say; nor
# are a policy's fields that go with its scope and tool, whether a cron line ever matches or a
# time zone exists, or whether a schedule's run can still make its task (its workspace).
SCHEMATHESIS_CONFIG = """
[[operations]]
include-path-regex = "^/api/tasks/\\\\{id\\\\}"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]

[[operations]]
include-operation-id = ["createTask", "putSettings", "uploadWorkspaceArchive", "createPolicy",
                        "createSchedule", "updateSchedule", "runSchedule", "createHook"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]

"""

# Not allow_header_conformance: the router answers a method on /api/approvals/approve-all
# with `Allow: GET, POST`, as GET /api/approvals/{id} matches that path too (a 404 then).
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
          "positive_data_acceptance,unsupported_method,missing_required_header")


# A schedule of its own for the routes of one schedule (a drawn id is only ever a 404), and
# another for the delete.  POST /api/hooks/{name} is exercised too, but schemathesis cannot
# sign a body with a hook's secret: every case is the 401 of a wrong signature, and signed
# deliveries are test_the_new_routes_answer_what_their_description_says's and test_sources'.
PINNED_SCHEDULES = """
[[operations]]
include-operation-id = ["getSchedule", "updateSchedule", "runSchedule"]
parameters = {{ "path.id" = "{kept}" }}

[[operations]]
include-operation-id = ["deleteSchedule"]
parameters = {{ "path.id" = "{deleted}" }}
"""


def test_schemathesis_finds_no_fault_in_a_live_gurtd(tmp_path: Any) -> None:
    config = tmp_path / "schemathesis.toml"
    with running_gurtd() as box:
        # a droid task would start the real Droid CLI: schemathesis gets fake ones only
        box.api("PUT", "/api/settings", {"droidPath": "/nonexistent/droid"})
        box.run("echo a task to read", workspace="home")
        kept, deleted = (box.api("POST", "/api/schedules", {
            "name": name, "cron": "0 3 * * *", "overlap": overlap,
            "task": {"prompt": "echo scheduled", "worker": "fake"}})["id"]
            for name, overlap in (("kept", "skip"), ("deleted", "queue")))
        config.write_text(SCHEMATHESIS_CONFIG + PINNED_SCHEDULES.format(kept=kept,
                                                                         deleted=deleted))
        undocumented = [arg for m, p in G.undocumented_routes()   # test_every_route_is_...
                        for arg in ("--exclude-operation-id", G.auto_operation_id(m, p))]
        result = subprocess.run(
            [tool("schemathesis"), "--config-file", str(config), "run",
             f"http://127.0.0.1:{box.port}/api/openapi.json",
             "-H", f"Authorization: Bearer {box.token}",
             "--checks", CHECKS, "--phases", "examples,coverage,fuzzing",
             "--max-examples", "6", "--seed", "12", "--no-shrink", "--request-timeout", "20",
             "--exclude-path", "/api/events",      # an endless stream: tested in test_http
             "--output-truncate", "false", *undocumented],
            capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        assert box.proc is not None and box.proc.poll() is None, box.log_text()
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-3000:]


def inline_refs(node: Any, schemas: dict[str, Any]) -> Any:
    """A schema with every #/components/schemas/X replaced by X (they do not nest in a loop)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return inline_refs(schemas[node["$ref"].rsplit("/", 1)[1]], schemas)
        return {k: inline_refs(v, schemas) for k, v in node.items()}
    if isinstance(node, list):
        return [inline_refs(v, schemas) for v in node]
    return node


class Documented:
    """Requests to a live gurtd, each answer checked against the description it serves: the
    status is listed, the content type is listed, the body (JSON) fits its schema, and the
    headers it says are required are there."""

    def __init__(self, g: Gurtd) -> None:
        self.g = g
        self.doc = g.api("GET", "/api/openapi.json")

    def __call__(self, method: str, pattern: str, path: str, status: int, body: Any = None,
                 headers: dict[str, str] | None = None, token: bool = True,
                 raw: bytes | None = None) -> tuple[Any, dict[str, str]]:
        import jsonschema
        code, data, got = self.g.request(method, path, body, headers, token, raw)
        assert code == status, (method, path, code, data)
        op = self.doc["paths"][pattern][method.lower()]
        assert str(code) in op["responses"], (method, pattern, code, "not documented")
        answer = op["responses"][str(code)]
        ctype = {k.lower(): v for k, v in got.items()}["content-type"].split(";")[0].strip()
        assert ctype in answer["content"], (method, pattern, code, ctype)
        if ctype == "application/json":
            schema = inline_refs(answer["content"][ctype]["schema"],
                                 self.doc["components"]["schemas"])
            jsonschema.Draft202012Validator(
                schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
            ).validate(data)
        for name, header in answer.get("headers", {}).items():
            if header["required"]:
                assert name.lower() in {k.lower() for k in got}, (method, pattern, name)
        return data, got


def test_the_new_routes_answer_what_their_description_says(gurtd: Gurtd) -> None:
    """A client written from the description signs the portal in, makes a policy, a
    schedule and a hook, delivers to the hook, and reads a diff: every answer is one the
    description lists, in its content type and schema."""
    call = Documented(gurtd)
    portal = {"X-Gurt-Portal": "1"}
    _, got = call("POST", "/api/sessions", "/api/sessions", 201, {"token": gurtd.token}, portal,
                  token=False)
    cookie = {k.lower(): v for k, v in got.items()}["set-cookie"].split(";")[0]
    call("POST", "/api/sessions", "/api/sessions", 401, {"token": "wrong"}, portal, token=False)
    call("POST", "/api/sessions", "/api/sessions", 403, {"token": gurtd.token}, token=False)
    current, _ = call("GET", "/api/sessions/current", "/api/sessions/current", 200,
                      headers={"Cookie": cookie}, token=False)
    assert current["signedIn"] is True and current["session"]["current"] is True
    assert call("GET", "/api/sessions/current", "/api/sessions/current", 200,
                token=False)[0] == {"signedIn": False}
    code, _ = call("POST", "/api/sessions/codes", "/api/sessions/codes", 201)
    call("POST", "/api/sessions/codes", "/api/sessions/codes", 403,
         headers={"Cookie": cookie, "X-Gurt-Portal": "1"}, token=False)
    assert code["path"] == "/?code=" + code["code"]
    sessions, _ = call("GET", "/api/sessions", "/api/sessions", 200)
    call("DELETE", "/api/sessions/{id}", f"/api/sessions/{sessions[0]['id']}", 200)
    call("DELETE", "/api/sessions/{id}", f"/api/sessions/{sessions[0]['id']}", 404)
    page, _ = call("GET", "/", "/", 200, token=False)
    assert b"<html" in page.lower()

    policy, _ = call("POST", "/api/policies", "/api/policies", 201,
                     {"tool": "host", "scope": "workspace", "workspace": "home",
                      "host": "*.example.com", "maxCents": None, "totalCents": 50,
                      "expiresAt": "2099-01-01T00:00:00+01:00"})
    assert policy["active"] is True and policy["expiresAt"] == "2098-12-31T23:00:00Z"
    call("POST", "/api/policies", "/api/policies", 400, {"tool": "ask", "scope": "box"})
    call("GET", "/api/policies", "/api/policies", 200)
    call("DELETE", "/api/policies/{id}", f"/api/policies/{policy['id']}", 200)
    call("DELETE", "/api/policies/{id}", f"/api/policies/{policy['id']}", 404)

    sched, _ = call("POST", "/api/schedules", "/api/schedules", 201,
                    {"name": "nightly", "cron": "0 3 * * MON-FRI", "timezone": "Europe/Berlin",
                     "task": {"prompt": "sleep 30", "worker": "fake"}})
    assert len(sched["nextRuns"]) == 5
    one = f"/api/schedules/{sched['id']}"
    run, _ = call("POST", "/api/schedules/{id}/run", one + "/run", 201)
    call("POST", "/api/schedules/{id}/run", one + "/run", 409)     # overlap: skip
    call("PUT", "/api/schedules/{id}", one, 200, {"overlap": "queue", "enabled": False})
    queued, _ = call("POST", "/api/schedules/{id}/run", one + "/run", 202)
    assert queued["queued"] is True and queued["schedule"]["nextRuns"] == []
    call("PUT", "/api/schedules/{id}", one, 400, {"cron": "0 3 30 2 *"})
    call("GET", "/api/schedules", "/api/schedules", 200)
    gurtd.api("POST", f"/api/tasks/{run['task']['id']}/stop")
    call("DELETE", "/api/schedules/{id}", one, 200)
    call("GET", "/api/schedules/{id}", one, 404)

    hook, _ = call("POST", "/api/hooks", "/api/hooks", 201,
                   {"name": "gh", "source": "gh", "task": {"worker": "fake"}, "allow": ["hosts"]})
    call("POST", "/api/hooks", "/api/hooks", 409, {"name": "gh", "source": "gh"})
    raw = json.dumps({"title": "from a hook", "prompt": "echo hooked"}).encode()
    stamp = str(int(time.time()))
    signed = {"X-Gurt-Signature": G.hook_signature(hook["secret"], stamp, "delivery-1", raw),
              "X-Gurt-Timestamp": stamp, "X-Gurt-Delivery": "delivery-1",
              "Content-Type": "application/json"}
    task, _ = call("POST", "/api/hooks/{name}", "/api/hooks/gh", 201, headers=signed,
                   token=False, raw=raw)
    call("POST", "/api/hooks/{name}", "/api/hooks/gh", 409, headers=signed, token=False,
         raw=raw)
    call("POST", "/api/hooks/{name}", "/api/hooks/gh", 401, headers={**signed,
         "X-Gurt-Signature": "sha256=" + "0" * 64}, token=False, raw=raw)
    hooks, _ = call("GET", "/api/hooks", "/api/hooks", 200)
    assert "secret" not in hooks[0]
    call("DELETE", "/api/hooks/{name}", "/api/hooks/gh", 200)

    done = gurtd.wait(task["id"])
    diff, _ = call("GET", "/api/tasks/{id}/diff", f"/api/tasks/{done['id']}/diff", 200)
    assert diff == b""                          # echo changed nothing in its layer
    call("POST", "/api/tasks/{id}/keep", f"/api/tasks/{done['id']}/keep", 400)  # not personal
    call("GET", "/api/tasks/{id}/diff", "/api/tasks/t000000000/diff", 400)


def test_an_approval_and_its_always_answer_fit_their_description(gurtd: Gurtd) -> None:
    """A task pays above its budget: the approval gurtd answers, and the always-approve that
    answers it with a policy, are what the description says (decision fields included)."""
    call = Documented(gurtd)
    gurtd.api("PUT", "/api/wallet", {"balanceCents": 100})
    task = gurtd.create("gurtd tool wallet.pay '{\"to\": \"shop\", \"cents\": 2}'",
                        tools=["wallet.pay"], budgetCents=0)
    pending = eventually(lambda: gurtd.approvals(state="pending", task=task["id"]), 30,
                         "a pending approval")
    one = f"/api/approvals/{pending[0]['id']}"
    approval, _ = call("GET", "/api/approvals/{id}", one, 200)
    assert approval["kind"] == "budget" and approval["canAlwaysApprove"] is True
    call("POST", "/api/approvals/{id}/always", one + "/always", 400,
         {"scope": "task", "maxCents": 1})               # would not allow this very call
    approved, _ = call("POST", "/api/approvals/{id}/always", one + "/always", 200,
                       {"scope": "task", "totalCents": 10, "reason": "small payments"})
    assert approved["state"] == "approved" and approved["policy"].startswith("p")
    assert approved["canAlwaysApprove"] is False and approved["alwaysBlockedReason"]
    call("POST", "/api/approvals/{id}/approve", one + "/approve", 409)
    call("POST", "/api/approvals/{id}/always", one + "/always", 409, {"scope": "box"})
    policies, _ = call("GET", "/api/policies", "/api/policies", 200)
    assert [p["spentCents"] for p in policies if p["id"] == approved["policy"]] == [2]
    assert gurtd.wait(task["id"])["state"] == "done"


def test_a_personal_tasks_diff_keep_and_undo_fit_their_description(gurtd: Gurtd,
                                                                    owner_folder: str) -> None:
    """My folder, a task's edit of it, and my own edit after the start: the diff, the 409
    of a keep and of an undo (with conflicts), and the forced answers are as described."""
    call = Documented(gurtd)
    folder = owner_folder                  # its a.txt says hello
    task = gurtd.run(f"cd '{folder}' && echo task > a.txt", folder=folder)
    one = f"/api/tasks/{task['id']}"
    diff, _ = call("GET", "/api/tasks/{id}/diff", one + "/diff", 200)
    assert b"-hello" in diff and b"+task" in diff, diff
    Path(folder, "a.txt").write_text("mine\n")  # mine, after the start
    refused, _ = call("POST", "/api/tasks/{id}/keep", one + "/keep", 409, {})
    assert [c["path"] for c in refused["conflicts"]] == ["a.txt"], refused
    call("POST", "/api/tasks/{id}/keep", one + "/keep", 400, {"paths": []})
    kept, _ = call("POST", "/api/tasks/{id}/keep", one + "/keep", 200, {"force": True})
    assert kept["review"] == "kept"
    with open(os.path.join(folder, "a.txt"), "a") as f:       # mine again, after it
        f.write("more\n")
    refused, _ = call("POST", "/api/tasks/{id}/undo", one + "/undo", 409, {})
    assert [c["path"] for c in refused["conflicts"]] == ["a.txt"], refused
    undone, _ = call("POST", "/api/tasks/{id}/undo", one + "/undo", 200, {"force": True})
    assert undone["state"] == "undone"
    assert open(os.path.join(folder, "a.txt")).read() == "mine\n"    # from before it
    assert not os.path.exists(os.path.join(gurtd.home, "review", task["id"]))


def test_a_conflict_a_merge_and_an_exact_undo_fit_their_description(gurtd: Gurtd) -> None:
    """Two tasks side by side change line 5 of one file and append to another: the conflict
    approval (its args), its answer, the merged task and the undone one's undoMerge are as
    described."""
    call = Documented(gurtd)
    f, g = (f"{n}-{secrets.token_hex(3)}.txt" for n in "fg")
    for name in (f, g):
        gurtd.api("PUT", f"/api/workspaces/home/files/{name}",
                  raw="".join(f"line {i}\n" for i in range(1, 9)).encode(),
                  headers={"Content-Type": "application/octet-stream"}, status=201)

    def gate(task_id: str, kind: str) -> dict[str, Any]:
        return eventually(lambda: next((a for a in gurtd.api(
            "GET", f"/api/approvals?state=pending&task={task_id}") if a["kind"] == kind), None),
            30, f"{kind} of {task_id}")
    ask = "gurtd tool ask '{\"question\": \"end?\"}'"
    a, b = (gurtd.create(f"sed -i 's/^line 5$/five by {n}/' {f}; echo {n} >> {g}\n{ask}",
                         tools=["ask"])["id"] for n in "ab")
    gates = {t: gate(t, "ask") for t in (a, b)}
    gurtd.api("POST", f"/api/approvals/{gates[b]['id']}/answer", {"answer": "go"})
    assert gurtd.wait(b)["state"] == "done"
    gurtd.api("POST", f"/api/approvals/{gates[a]['id']}/answer", {"answer": "go"})
    one = f"/api/approvals/{gate(a, 'conflict')['id']}"
    conflict, _ = call("GET", "/api/approvals/{id}", one, 200)
    assert [p["path"] for p in conflict["args"]["paths"]] == [f]
    assert conflict["args"]["merged"] == [g]
    call("POST", "/api/approvals/{id}/approve", one + "/approve", 400,
         {"args": {"keep": "neither"}})
    call("POST", "/api/approvals/{id}/approve", one + "/approve", 200, {"args": {"keep": "task"}})
    assert gurtd.wait(a)["state"] == "done"
    merged, _ = call("GET", "/api/tasks/{id}", f"/api/tasks/{a}", 200)
    assert merged["merged"] == [g]
    call("POST", "/api/tasks/{id}/undo", f"/api/tasks/{b}/undo", 200)
    eventually(lambda: "undoMerge" in gurtd.task(b), 30, "the undo's revert")
    undone, _ = call("GET", "/api/tasks/{id}", f"/api/tasks/{b}", 200)
    assert undone["undoMerge"]["reverted"] == [g], undone
    assert [k["path"] for k in undone["undoMerge"]["kept"]] == [f]


def test_a_generated_client_creates_a_workspace_and_puts_a_file(gurtd: Gurtd,
                                                                tmp_path: Any) -> None:
    spec = tmp_path / "openapi.json"
    spec.write_text(json.dumps(gurtd.api("GET", "/api/openapi.json")))
    env = dict(os.environ, PATH=VENV_BIN + ":" + os.environ.get("PATH", ""))
    result = subprocess.run([tool("openapi-python-client"), "generate", "--path", str(spec),
                             "--output-path", str(tmp_path / "gurtd_client"), "--meta", "none"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        client_mod = importlib.import_module("gurtd_client")
        from gurtd_client.api.files import put_workspace_file
        from gurtd_client.api.service import get_health
        from gurtd_client.api.tasks import list_tasks, undo_task
        from gurtd_client.api.workspaces import create_workspace
        from gurtd_client.models import CreateWorkspaceBody, ListTasksState
        from gurtd_client.types import File
        import io
        client = client_mod.AuthenticatedClient(base_url=f"http://127.0.0.1:{gurtd.port}",
                                                token=gurtd.token)
        health = get_health.sync(client=client)
        assert health.ok is True and health.version == G.VERSION
        ws = create_workspace.sync(client=client, body=CreateWorkspaceBody(name="generated"))
        assert ws.name == "generated" and ws.layers == 0
        task = put_workspace_file.sync(client=client, name="generated", path="hello.txt",
                                       body=File(payload=io.BytesIO(b"from a generated client")))
        assert task.worker.value == "upload" and task.state.value == "done"
        assert gurtd.file("generated", "hello.txt") == b"from a generated client"
        done = list_tasks.sync(client=client, state=ListTasksState.DONE, workspace="generated")
        assert [t.id for t in done] == [task.id]
        assert undo_task.sync(client=client, id=task.id).state.value == "undone"
        assert gurtd.file("generated", "hello.txt") is None
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("gurtd_client")]:
            del sys.modules[name]
