"""The coordinator's HTTP API from the outside: every refusal is a JSON :class:`ErrorReply` that
names the field, and a refused request changes nothing.

The app is :func:`~maitre.control.api.build_app` over a coordinator with a cluster (queue ``q``)
and a store, on an injected clock, driven in process (``TestClient``, schemathesis's ASGI
transport): no server, no sockets. Three parts:

- hand-written refusals, one per kind (a bad value, a misspelt field, an unknown name, no token,
  an oversized or non-JSON body, a bad manifest), each checked for its status, its body and the
  state it leaves;
- a fuzz of every route from the app's own OpenAPI schema (schemathesis): no 5xx, every 4xx an
  ErrorReply, and a fingerprint of the coordinator's state and store equal before and after
  every refused case;
- the schema itself, checked in as ``docs/openapi.json``.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterator

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck
from schemathesis.config import SchemathesisConfig

from maitre import protocol as p
from maitre.control.api import build_app, openapi_document
from maitre.control.cluster import ClusterState
from maitre.control.coordinator import Coordinator
from maitre.control.store import Store
from maitre.scheduling.model import Queue

with warnings.catch_warnings():  # starlette's TestClient would rather have httpx2: not ours
    warnings.filterwarnings("ignore", message=".*httpx2")
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.timeout(120)

TOKEN = "t"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parent.parent
OPENAPI = ROOT / "docs" / "openapi.json"
REGENERATE = (
    '.venv/bin/python -c "from maitre.control.api import openapi_document; '
    "print(openapi_document(), end='')\" > docs/openapi.json"
)


def manifest(name: str, checkpoint: Path | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "queue": "q",
        "minReplicas": 1,
        "maxReplicas": 1,
        "command": ["python", "train.py"],
    }
    if checkpoint is not None:
        out["checkpointDir"] = str(checkpoint / name)
    return out


class Api:
    """A coordinator with a cluster and a store on an injected clock, and its app."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.t = 1000.0
        self.db = Store(tmp / "state.db")
        cluster = ClusterState([Queue("q")], run_dir=tmp)
        self.co = Coordinator("127.0.0.1:1", clock=lambda: self.t, cluster=cluster, store=self.db, pass_s=0.5)
        self.app = build_app(self.co, token=TOKEN)

    def tick(self) -> None:
        """A scheduling pass (time moves past ``pass_s`` first)."""
        self.t += 1.0
        self.co.tick()

    def fingerprint(self) -> str:
        """Everything a request could change, as the API and the store show it (less what
        moves with the clock alone)."""
        co = self.co
        with co.lock:
            jobs = [co.job_status(j["job_id"]) for j in co.job_list()]
            nodes = [{k: v for k, v in n.items() if k not in ("last_heartbeat_s", "phi")} for n in co.nodes_view()]
            state = {
                "jobs": jobs,
                "nodes": nodes,
                "queues": co.queues_view(),
                "reports": co.reports,
                "stored_jobs": [[job, extra] for job, extra in self.db.jobs()],
                "stored_nodes": sorted(self.db.cluster().nodes),
                "stored_events": sum(1 for _ in self.db.events()),
            }
        return json.dumps(state, sort_keys=True, default=repr)

    def start_two_jobs(self, client: TestClient) -> dict[str, dict[str, Any]]:
        """Jobs ``alpha`` (with a checkpointDir) and ``beta``, one worker each on node ``n0``,
        both RUNNING; returns their start orders by job."""
        for name, ck in (("alpha", self.tmp / "ck"), ("beta", None)):
            ok(client.post("/v1/jobs", json={"manifest": manifest(name, ck)}))
        orders = ok(client.post("/v1/nodes/n0/heartbeat", json={"slots": 2}))
        self.tick()  # places both on n0
        orders = ok(client.post("/v1/nodes/n0/heartbeat", json={"slots": 2, "since": orders["version"]}))
        started = {o["job_id"]: o for o in orders["start"]}
        assert sorted(started) == ["alpha", "beta"], orders
        beat = {
            "slots": 2,
            "since": orders["version"],
            "workers": [{"id": o["worker_id"], "silent_s": 0.0} for o in started.values()],
        }
        ok(client.post("/v1/nodes/n0/heartbeat", json=beat))
        for o in started.values():
            answer = ok(client.post(f"/v1/workers/{o['worker_id']}/rendezvous", json={"from_epoch": 0, "wait_s": 0}))
            assert answer["action"] == "train", answer
        assert {j["job_id"]: j["state"] for j in client.get("/v1/jobs").json()["jobs"]} == {
            "alpha": "RUNNING",
            "beta": "RUNNING",
        }
        return started


def ok(response: Any) -> Any:
    assert response.status_code == 200, (response.status_code, response.text)
    return response.json()


def refused(response: Any, status: int, field: str | None = None) -> dict[str, Any]:
    """The response is ``status`` with an ErrorReply body whose problems name ``field`` (or,
    with ``field`` ending in ``.``, a field under it)."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    p.ErrorReply.model_validate(body)
    fields = [pr["field"] for pr in body["problems"]]
    assert body["error"] and fields, body
    if field is not None:
        assert any(f == field or field.endswith(".") and f.startswith(field) for f in fields), body
    return body


@pytest.fixture
def api(tmp_path: Path) -> Api:
    return Api(tmp_path)


@pytest.fixture
def client(api: Api) -> Iterator[TestClient]:
    with TestClient(api.app, headers=AUTH) as c:  # one event loop for the whole test
        yield c


# -- refusals ----------------------------------------------------------------------------------
BAD_BEATS = [  # (body, the field named)
    ({"slots": 0}, "body.slots"),
    ({"slots": 5000}, "body.slots"),
    ({}, "body.slots"),
    ({"slots": "2"}, "body.slots"),  # no coercion: the schema says integer
    ({"slots": True}, "body.slots"),
    ({"slots": 2, "slotz": 2}, "body.slotz"),
    ({"slots": 2, "labels": {"zone": "eu"}}, "body.labels.zone"),
    ({"slots": 2, "labels": {"capacity_type": "cheap"}}, "body.labels.capacity_type"),
    ({"slots": 2, "labels": {"rack": ""}}, "body.labels.rack"),
    ({"slots": 2, "workers": [{"id": "../etc"}]}, "body.workers.0.id"),
    ({"slots": 2, "workers": [{"id": "w1", "step": -1}]}, "body.workers.0.step"),
    ({"slots": 2, "since": -2}, "body.since"),
]


@pytest.mark.timeout(60)
def test_refusals_are_json_naming_the_field_and_change_nothing(api: Api, client: TestClient) -> None:
    ok(client.post("/v1/nodes/n0/heartbeat", json={"slots": 2, "labels": {"rack": "r1"}}))
    before = api.fingerprint()

    for body, field in BAD_BEATS:
        refused(client.post("/v1/nodes/n1/heartbeat", json=body), 400, field)
        refused(client.post("/v1/nodes/n0/heartbeat", json=body), 400, field)
    refused(client.post("/v1/nodes/bad name/heartbeat", json={"slots": 2}), 400, "path.node")
    refused(client.post("/v1/nodes/n1/watch", json={"since": 0, "wait_s": 60}), 404, "path.node")
    refused(client.post("/v1/nodes/n0/watch", json={"since": 0, "wait_s": 61}), 400, "body.wait_s")

    for route, body in (
        ("rendezvous", {"from_epoch": 0, "wait_s": 30}),
        ("done", {}),
        ("left", None),
        ("exit", {"code": 1}),
        (
            "report",
            {
                "kind": "recovery",
                "epoch": 1,
                "rank": 0,
                "reason": "x",
                "world_size": 1,
                "detected_at": 0.0,
                "rendezvous_s": 0.0,
                "group_s": 0.0,
                "state_s": 0.0,
                "state_bytes": 0,
                "to_next_step_s": 0.0,
                "step": 0,
                "state_source": "none",
            },
        ),
    ):
        refused(client.post(f"/v1/workers/w9/{route}", json=body), 404, "path.worker")
    refused(client.post("/v1/workers/w9/rendezvous", json={"from_epoch": -1}), 400, "body.from_epoch")

    refused(client.get("/v1/jobs/nope"), 404, "path.job")
    for route, body in (("scale", {"workers": 2}), ("suspend", None), ("resume", None), ("cancel", None)):
        refused(client.post(f"/v1/jobs/nope/{route}", json=body), 404, "path.job")
    refused(client.post("/v1/jobs/nope/scale", json={"workers": -1}), 400, "body.workers")

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        with TestClient(api.app, headers=headers) as anonymous:
            refused(anonymous.get("/v1/jobs"), 401, "header.authorization")
            refused(anonymous.post("/v1/jobs", json={"manifest": manifest("sneaky")}), 401, "header.authorization")
            refused(anonymous.post("/v1/nodes/n2/heartbeat", json={"slots": 2}), 401, "header.authorization")
            assert ok(anonymous.get("/v1/health")) == {"ok": True}  # liveness probes stay open

    refused(client.get("/v1/nope"), 404, "path")
    wrong_method = client.get("/v1/nodes/n0/heartbeat")
    refused(wrong_method, 405, "path")
    assert wrong_method.headers["allow"] == "POST"
    assert client.put("/v1/jobs").headers["allow"] == "GET, POST"  # two routes, one path
    refused(
        client.post("/v1/jobs", content=b"x" * (p.MAX_BODY + 1), headers={"content-type": "application/json"}),
        413,
        "header.content-length",
    )
    refused(client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}), 400, "body")
    refused(client.post("/v1/jobs", content=b"name: x"), 400, "body")
    refused(client.post("/v1/jobs", json=["a"]), 400, "body")
    refused(client.post("/v1/jobs", json={"manifest": ["not", "a", "manifest"]}), 400, "body.manifest.")
    refused(client.post("/v1/jobs", json={"manifest": {}, "priority": 1}), 400, "body.priority")

    bad = {"name": "Bad_Name", "queue": "nope", "minReplicas": 3, "maxReplicas": 2, "command": []}
    for given in (bad, json.dumps(bad)):  # the mapping, or its text (JSON is YAML)
        body = refused(client.post("/v1/jobs", json={"manifest": given}), 400, "body.manifest")
        for problem in ("Bad_Name", "no queue 'nope'", "maxReplicas 2 is less than minReplicas 3", "command is empty"):
            assert problem in body["error"], body

    assert api.fingerprint() == before
    assert api.co.job_list() == [] and api.db.jobs() == []
    assert [n["node"] for n in api.co.nodes_view()] == ["n0"]
    assert sorted(api.db.cluster().nodes) == ["n0"]


# -- workers -----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_worker_that_does_not_exist_is_refused_and_changes_nothing(api: Api, client: TestClient) -> None:
    started = api.start_two_jobs(client)
    before = api.fingerprint()
    for wid in ("alpha-w9", "gamma-w1", "alpha"):
        asked = time.monotonic()
        body = refused(
            client.post(
                f"/v1/workers/{wid}/rendezvous", json={"from_epoch": 1, "step": 3, "reason": "peer died", "wait_s": 30}
            ),
            404,
            "path.worker",
        )
        assert wid in body["error"] and time.monotonic() - asked < 5  # at once: no long-poll
        refused(client.post(f"/v1/workers/{wid}/done", json={"step": 3}), 404, "path.worker")
        refused(client.post(f"/v1/workers/{wid}/left"), 404, "path.worker")
        refused(client.post(f"/v1/workers/{wid}/exit", json={"code": -9}), 404, "path.worker")
    # A real worker with a bad request: refused before it touches the worker.
    wid = started["alpha"]["worker_id"]
    refused(client.post(f"/v1/workers/{wid}/rendezvous", json={"from_epoch": 1, "wait_s": 31}), 400, "body.wait_s")
    refused(client.post(f"/v1/workers/{wid}/done", json={"step": 3, "suspend": True}), 400, "body.suspend")
    refused(client.post(f"/v1/workers/{wid}/exit", json={"code": 256}), 400, "body.code")
    assert api.fingerprint() == before
    assert all(j["state"] == "RUNNING" and len(j["members"]) == 1 for j in client.get("/v1/jobs").json()["jobs"])


@pytest.mark.timeout(60)
def test_a_worker_of_one_job_cannot_speak_for_a_worker_of_another(api: Api, client: TestClient) -> None:
    """A worker holds its run's token (its start order's), never the coordinator's: it acts for
    its own worker on the worker routes, and is refused everywhere else, changing nothing."""
    started = api.start_two_jobs(client)
    alpha_token = started["alpha"]["token"]
    assert alpha_token and alpha_token != TOKEN and alpha_token != started["beta"]["token"]
    before = api.fingerprint()
    beta = started["beta"]["worker_id"]
    with TestClient(api.app, headers={"Authorization": f"Bearer {alpha_token}"}) as alpha:
        for route, body in (
            ("done", {"step": 3}),
            ("left", None),
            ("exit", {"code": -9}),
            ("rendezvous", {"from_epoch": 1, "wait_s": 0}),
            ("report", {"epoch": 1}),
        ):
            refused(alpha.post(f"/v1/workers/{beta}/{route}", json=body), 403, "header.authorization")
        refused(alpha.post("/v1/workers/nobody/done", json={"step": 3}), 404, "path.worker")
        # the coordinator's routes: not even reading
        refused(alpha.get("/v1/jobs"), 403, "header.authorization")
        refused(alpha.post("/v1/jobs/beta/cancel"), 403, "header.authorization")
        refused(alpha.post("/v1/nodes/n0/heartbeat", json={"slots": 2}), 403, "header.authorization")
        assert api.fingerprint() == before
        # ... and its own worker's routes are open to it
        ok(alpha.post(f"/v1/workers/{started['alpha']['worker_id']}/done", json={"step": 3}))
    with TestClient(api.app, headers={"Authorization": "Bearer not-a-token"}) as stranger:
        refused(stranger.post(f"/v1/workers/{beta}/done", json={"step": 3}), 401, "header.authorization")
    # a job's token is not in anything the API shows
    for path in ("/v1/jobs", "/v1/jobs/alpha", "/v1/report", "/v1/nodes"):
        assert alpha_token not in client.get(path).text, path


@pytest.mark.timeout(60)
def test_a_refused_suspend_leaves_the_job_as_it_was(api: Api, client: TestClient) -> None:
    started = api.start_two_jobs(client)
    ok(client.post(f"/v1/workers/{started['alpha']['worker_id']}/done", json={"step": 1}))
    before = api.fingerprint()  # alpha completed; the scheduler has not seen it yet
    refused(client.post("/v1/jobs/alpha/suspend", json={"reason": "late"}), 400, "path.job")
    assert api.fingerprint() == before


@pytest.mark.timeout(60)
def test_refusals_of_a_jobs_state_name_the_job_and_change_nothing(api: Api, client: TestClient) -> None:
    api.start_two_jobs(client)
    before = api.fingerprint()
    refused(client.post("/v1/jobs/beta/suspend"), 400, "path.job")  # no checkpointDir
    refused(client.post("/v1/jobs/alpha/resume"), 400, "path.job")  # not suspended
    refused(client.post("/v1/jobs/alpha/scale", json={"workers": 0}), 400, "body.workers")
    ok(client.post("/v1/jobs/beta/cancel"))
    before = api.fingerprint()
    refused(client.post("/v1/jobs/beta/cancel"), 400, "path.job")
    refused(client.post("/v1/jobs/beta/scale", json={"workers": 1}), 400, "body.workers")
    refused(client.post("/v1/jobs/beta/suspend"), 400, "path.job")
    assert api.fingerprint() == before


# -- fuzz --------------------------------------------------------------------------------------
FUZZ_EXAMPLES = int(os.environ.get("MAITRE_FUZZ_EXAMPLES", "100"))
"""Examples per route in the fuzzing phase (schemathesis's coverage and examples phases add
their own cases: about 50-150 more per route)."""

CONFIG = SchemathesisConfig.from_str("""
[checks.positive_data_acceptance]
# A request the schema allows may still be refused for what only the coordinator knows (a
# manifest's content, a job's state): 400, with the field named.
expected-statuses = ["2xx", "400", "401", "404"]
""")
schema = schemathesis.openapi.from_asgi(
    p.API + "/openapi.json",
    build_app(Coordinator("127.0.0.1:1", cluster=ClusterState([Queue("q")], run_dir=Path("."))), token=TOKEN),
    config=CONFIG,
)
KNOWN = {"job": ["alpha", "beta"], "node": ["n0"], "worker": ["alpha-w1", "beta-w1"]}
"""The names :meth:`Api.start_two_jobs` creates: a third of the cases address them instead of
a random (unknown, so 404) name."""


@pytest.fixture
def fuzzed(tmp_path: Path) -> Api:
    """A fresh coordinator per route (state accumulates over its cases), with two running jobs.
    Its long-polls answer at once, as when the server stops: a schema-valid watch or rendezvous
    may ask to wait 60 s or 30 s, and the waits are not what this checks."""
    api = Api(tmp_path)
    with TestClient(api.app, headers=AUTH) as client:
        started = api.start_two_jobs(client)
    assert sorted(o["worker_id"] for o in started.values()) == KNOWN["worker"]
    api.app.state.waiters.closing = True
    return api


@pytest.mark.timeout(max(120, FUZZ_EXAMPLES))  # per route; a case takes 10-50 ms
@schema.parametrize()
@hypothesis.settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_fuzz_refusals_are_error_replies_and_change_nothing(case: Any, fuzzed: Api) -> None:
    names = re.findall(r"\{(\w+)\}", case.operation.path)
    pick = zlib.crc32(json.dumps(case.path_parameters, sort_keys=True, default=repr).encode())
    if names and pick % 3 == 0:
        case.path_parameters = {n: KNOWN[n][pick // 3 % len(KNOWN[n])] for n in names}
    before = fuzzed.fingerprint()
    response = case.call(app=fuzzed.app, headers=AUTH)
    after = fuzzed.fingerprint()
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        p.ErrorReply.model_validate(body)
        assert body["error"] and body["problems"], body
        assert after == before, (
            f"{case.method} {case.formatted_path} was refused ({response.status_code}) but changed the coordinator"
        )
    case.validate_response(response, headers=AUTH, transport_kwargs={"app": fuzzed.app, "headers": AUTH})


# -- the schema --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_the_openapi_schema_is_checked_in() -> None:
    assert OPENAPI.exists() and OPENAPI.read_text() == openapi_document(), (
        f"docs/openapi.json is not the API's schema: regenerate it with\n    {REGENERATE}"
    )


@pytest.mark.timeout(60)
def test_the_schema_documents_the_refusals_the_api_sends() -> None:
    """Every route that can refuse documents an ErrorReply (no FastAPI 422: the API says 400)."""
    doc = json.loads(openapi_document())
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            if path == p.API + p.HEALTH:
                continue
            assert "422" not in op["responses"], (method, path)
            for code in ("400", "401", "404", "413"):
                ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorReply"), (method, path, code)
