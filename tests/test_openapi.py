"""The OpenAPI description as real clients no one here wrote take it: a validator, schemathesis
against a live gurtd, and a generated Python client used for real calls."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest

import gurtd as G
from conftest import Gurtd, running_gurtd

VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def g() -> Iterator[Gurtd]:
    with running_gurtd() as box:
        yield box


def tool(name: str) -> str:
    """A command of the test requirements (requirements-test.txt); missing is a failure."""
    path = os.path.join(VENV_BIN, name)
    assert os.access(path, os.X_OK), f"{name} is missing: pip install -r requirements-test.txt"
    return path


def test_the_description_is_valid_and_names_where_gurtd_listens(g: Gurtd) -> None:
    from openapi_spec_validator import validate
    doc = g.api("GET", "/api/openapi.json")
    validate(doc)
    assert doc["servers"] == [{"url": f"http://127.0.0.1:{g.port}"}]
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


def test_every_route_is_documented() -> None:
    """Routes without an API_DOCS entry get a minimal description; this lists them."""
    missing = G.undocumented_routes()
    if missing:
        print("\nRoutes without an API_DOCS entry (add one beside ROUTES):")
        for method, pattern in missing:
            print(f"    ({method!r}, {pattern!r})")
    assert not missing, "routes without an API_DOCS entry: " + \
        ", ".join(f"{m} {p}" for m, p in missing)


def test_a_route_added_without_docs_still_gets_a_valid_description() -> None:
    from openapi_spec_validator import validate
    route = ("POST", "/api/tasks/{id}/frobnicate", G.h_health, "A route of tomorrow")
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
# suffix, a model is priced, or a body is a tar archive are not things a schema can say.
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


def test_schemathesis_finds_no_fault_in_a_live_gurtd(tmp_path: Any) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    with running_gurtd() as box:
        # a droid task would start the real Droid CLI: schemathesis gets fake ones only
        box.api("PUT", "/api/settings", {"droidPath": "/nonexistent/droid"})
        box.run("echo a task to read", workspace="home")
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


def test_a_generated_client_creates_a_workspace_and_puts_a_file(g: Gurtd, tmp_path: Any) -> None:
    spec = tmp_path / "openapi.json"
    spec.write_text(json.dumps(g.api("GET", "/api/openapi.json")))
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
        client = client_mod.AuthenticatedClient(base_url=f"http://127.0.0.1:{g.port}",
                                                token=g.token)
        health = get_health.sync(client=client)
        assert health.ok is True and health.version == G.VERSION
        ws = create_workspace.sync(client=client, body=CreateWorkspaceBody(name="generated"))
        assert ws.name == "generated" and ws.layers == 0
        task = put_workspace_file.sync(client=client, name="generated", path="hello.txt",
                                       body=File(payload=io.BytesIO(b"from a generated client")))
        assert task.worker.value == "upload" and task.state.value == "done"
        assert g.file("generated", "hello.txt") == b"from a generated client"
        done = list_tasks.sync(client=client, state=ListTasksState.DONE, workspace="generated")
        assert [t.id for t in done] == [task.id]
        assert undo_task.sync(client=client, id=task.id).state.value == "undone"
        assert g.file("generated", "hello.txt") is None
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("gurtd_client")]:
            del sys.modules[name]
