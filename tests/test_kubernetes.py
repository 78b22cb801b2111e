"""maitre on Kubernetes, checked offline (no API server can be had here): every manifest under
``deploy/kubernetes`` against the schemas of a pinned Kubernetes version (``kubernetes-validate``,
strict: a misspelt field is an error), the base as kustomize renders it (``kubectl kustomize``,
Debian's ``kubernetes-client`` under CI), the ``MaitreJob`` CRD equal to the one generated from
the job manifest's model and structural as the API server requires, a sample MaitreJob checked
against the CRD's schema and by maitre's own manifest checks, copies with a missing or wrong
field rejected, and the manifests' command lines parsed by maitre's own CLI (the flags they
pass exist, the ports they name agree, the grace periods leave the agents time to drain).

What is not tested: that an API server accepts them, that a cluster schedules them, the
kubelet's SIGTERM and the GPU device plugin (``tests/test_sigterm.py`` sends an agent SIGTERM
as the kubelet would), Kueue.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from maitre.engines.kubernetes import crd as k8s
from maitre.scheduling.spec import PRIORITY_CLASSES, ManifestError, parse_manifest

pytestmark = pytest.mark.timeout(60)

KUBERNETES = "1.33.0"
"""The Kubernetes version the manifests are validated against (kubernetes-validate ships its
schemas; strict: no field the version does not know)."""
ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
CRD = BASE / "maitrejob-crd.yaml"
SAMPLE = DEPLOY / "examples" / "maitrejob.yaml"
REGENERATE = "python -m maitre.engines.kubernetes crd > deploy/kubernetes/base/maitrejob-crd.yaml"


def _kv():
    try:
        import kubernetes_validate
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is not installed (pip install -e '.[test]')")
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    return kubernetes_validate


def _jsonschema():
    """jsonschema, which kubernetes-validate brings."""
    _kv()
    import jsonschema

    return jsonschema


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _manifests() -> list[Path]:
    """Every Kubernetes manifest under deploy/kubernetes (kustomize's own file aside)."""
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def _named(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for p in _manifests()
        for d in _docs(p)
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _validate(doc: dict[str, Any]) -> None:
    """One document against the pinned version's schema; a MaitreJob against the CRD's."""
    if doc.get("kind") == k8s.KIND:
        jsonschema = _jsonschema()
        schema = _docs(CRD)[0]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        jsonschema.Draft4Validator(schema).validate(doc)
        return
    _kv().validate(doc, KUBERNETES, strict=True)


def _token_secret() -> dict[str, Any]:
    """The Secret kustomization.yaml's secretGenerator makes (from a token file git ignores)."""
    gen = yaml.safe_load((BASE / "kustomization.yaml").read_text())["secretGenerator"][0]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": gen["name"], "namespace": "maitre"},
        "data": {name: "ZHVtbXkK" for name in gen["files"]},
    }


# -- every manifest, as written and as kustomize renders the base ---------------------------
@pytest.mark.parametrize("path", _manifests(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_validates_against_the_pinned_kubernetes(path: Path) -> None:
    docs = _docs(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        _validate(doc)


def test_the_generated_token_secret_validates() -> None:
    _validate(_token_secret())


def test_kustomization_lists_every_file_of_the_base_and_the_token_is_never_committed() -> None:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    files = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kust["resources"]) == sorted(files)
    assert kust["namespace"] == "maitre" and _named("Namespace")["metadata"]["name"] == "maitre"
    secret = _token_secret()["metadata"]["name"]
    assert kust["generatorOptions"]["disableNameSuffixHash"] is True  # the pods name it as is
    assert "token" in (BASE / ".gitignore").read_text().split()
    ignored = subprocess.run(["git", "check-ignore", "-q", str(BASE / "token")], cwd=ROOT)
    assert ignored.returncode == 0, "git would commit deploy/kubernetes/base/token"
    for kind in ("StatefulSet", "DaemonSet"):  # both read the token from that Secret
        volumes = _named(kind)["spec"]["template"]["spec"]["volumes"]
        assert {"name": "token", "secret": {"secretName": secret, "defaultMode": 0o440}} in volumes, (kind, volumes)


def _kubectl() -> str:
    """Debian's kubectl (kustomize's renderer here); skipped where there is none, failed under CI."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is missing (Debian's kubernetes-client; .ci/run installs it)")
        pytest.skip("no kubectl here (apt-get install kubernetes-client)")
    return kubectl


def test_kustomize_renders_the_base_into_manifests_that_validate(tmp_path: Path) -> None:
    kubectl = _kubectl()
    base = tmp_path / "base"
    shutil.copytree(BASE, base)
    (base / "token").write_text("a-test-token\n")
    done = subprocess.run([kubectl, "kustomize", str(base)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d is not None]
    written = [d for p in sorted(BASE.glob("*.yaml")) if p.name != "kustomization.yaml" for d in _docs(p)]
    assert len(docs) == len(written) + 1  # and the Secret
    for doc in docs:
        _validate(doc)
        if doc["kind"] not in ("Namespace", "PriorityClass", "CustomResourceDefinition"):
            assert doc["metadata"]["namespace"] == "maitre", doc["metadata"]
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("StatefulSet", "DaemonSet")]
    assert {c["image"] for p in pods for c in p["containers"]} == {"maitre:0.1.0"}


# -- the MaitreJob resource -----------------------------------------------------------------
def test_the_committed_crd_is_the_one_generated_from_the_manifest_model() -> None:
    assert CRD.read_text() == k8s.crd_yaml(), (
        f"{CRD.relative_to(ROOT)} is not the generated CRD: regenerate it with\n    {REGENERATE}"
    )
    done = subprocess.run(
        [sys.executable, "-m", "maitre.engines.kubernetes", "crd"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and done.stdout == CRD.read_text(), done.stderr


def test_the_crd_spec_has_every_manifest_field_but_the_name_and_origin() -> None:
    """(the name is metadata.name; the origin is what the operator writes: the object's UID)"""
    from maitre.scheduling.spec import JobManifest

    fields = {f.alias or n for n, f in JobManifest.model_fields.items()}
    spec = k8s.spec_schema()
    assert set(spec["properties"]) == fields - {"name", "origin"}
    assert spec["required"] == ["queue", "command"]
    assert spec["properties"]["command"] == {
        "type": "array",
        "items": {"type": "string"},
        "description": f"{JobManifest.model_fields['command'].description} In a MaitreJob: a list.",
    }


_STRUCTURAL = {
    "type",
    "description",
    "default",
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "minItems",
    "maxItems",
    "items",
    "properties",
    "required",
}
_TYPES = {"object", "array", "string", "integer", "number", "boolean"}


def _structural_problems(node: dict[str, Any], at: str) -> list[str]:
    """What the API server would refuse in a CRD's schema (apiextensions' structural rules, as
    far as this schema goes): a node without a type, a reference, a union of types, a null,
    ``additionalProperties: false``, a default or enum its node's type does not hold."""
    jsonschema = _jsonschema()

    problems = [f"{at}: {key}" for key in sorted(set(node) - _STRUCTURAL)]
    if node.get("type") not in _TYPES:
        problems.append(f"{at}: type {node.get('type')!r}")
    bounds = {k: v for k, v in node.items() if k not in ("default", "description", "items", "properties", "required")}
    checks = [("default", node["default"], bounds)] if "default" in node else []
    checks += [("enum", value, {"type": node.get("type")}) for value in node.get("enum", [])]
    for key, value, schema in checks:
        try:
            jsonschema.Draft4Validator(schema).validate(value)
        except jsonschema.ValidationError as exc:
            problems.append(f"{at}: {key} {value!r}: {exc.message}")
    for name in node.get("required", []):
        if name not in node.get("properties", {}):
            problems.append(f"{at}: required {name!r} is no property")
    for name, sub in node.get("properties", {}).items():
        problems += _structural_problems(sub, f"{at}.{name}")
    if "items" in node:
        problems += _structural_problems(node["items"], f"{at}[]")
    return problems


def test_the_crd_schema_is_structural() -> None:
    version = _docs(CRD)[0]["spec"]["versions"][0]
    assert _structural_problems(version["schema"]["openAPIV3Schema"], "") == []
    scale = version["subresources"]["scale"]  # kubectl scale: maxReplicas, as maitre scale
    assert scale["specReplicasPath"] == ".spec.maxReplicas"
    assert _structural_problems(
        {
            "type": "object",
            "properties": {
                "a": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "b": {"type": "object", "additionalProperties": False},
                "c": {"type": "integer", "default": "2"},
            },
        },
        "",
    ) == [
        ".a: anyOf",
        ".a: type None",
        ".b: additionalProperties",
        ".c: default '2': '2' is not of type 'integer'",
    ]  # the check itself can fail


def test_a_field_no_structural_schema_can_hold_fails_the_generation() -> None:
    with pytest.raises(k8s.SchemaError, match="spec.x: no type a CRD can hold"):
        k8s._structural({"anyOf": [{"type": "null"}]}, {}, "spec.x")  # None, and only None


def test_the_sample_maitrejob_fits_the_crd_and_is_a_valid_manifest() -> None:
    (job,) = _docs(SAMPLE)
    _validate(job)
    manifest = parse_manifest(k8s.manifest_of(job), queues={"default"})
    assert manifest.name == job["metadata"]["name"] == "bert-large"
    assert (manifest.min_replicas, manifest.max_replicas, manifest.priority) == (2, 8, 1000)
    assert manifest.stragglers is not None and manifest.stragglers.policy == "evict"
    done = subprocess.run(
        [sys.executable, "-m", "maitre.engines.kubernetes", "manifest", "-"],
        input=SAMPLE.read_text(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout) == k8s.manifest_of(job)


# -- copies with a missing or wrong field are rejected --------------------------------------
def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``doc`` with ``path`` (dots; list indices as numbers) set, or deleted when
    ``value`` is ``DELETE``."""
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    return doc


DELETE = object()
POD = "spec.template.spec"
BROKEN = [
    ("StatefulSet", None, "spec.selector", DELETE),  # required
    ("StatefulSet", None, f"{POD}.containers.0.ports.0.containerPort", "8080"),  # a string
    ("StatefulSet", None, f"{POD}.terminationGracePeriodSecond", 30),  # misspelt
    ("StatefulSet", None, "spec.volumeClaimTemplates.0.spec.accessModes", "ReadWriteOnce"),
    ("StatefulSet", None, "apiVersion", "apps/v1beta1"),  # long gone
    ("DaemonSet", None, f"{POD}.containers.0.name", DELETE),
    ("DaemonSet", None, f"{POD}.containers.0.resources.limit", {"nvidia.com/gpu": 8}),
    ("DaemonSet", None, f"{POD}.containers.0.env.0.valueFrom.fieldRef", {"path": "x"}),
    ("Service", "maitre-coordinator", "spec.ports.0.port", DELETE),
    ("Service", "maitre-coordinator", "spec.ports.1.port", "store"),
    ("PriorityClass", "maitre-agent", "value", DELETE),
    ("PriorityClass", "maitre-agent", "preemptionPolicy", ["Never"]),
    ("PersistentVolumeClaim", None, "spec.resources.requests", "1Ti"),
    ("CustomResourceDefinition", None, "spec.versions.0.served", DELETE),
    ("CustomResourceDefinition", None, "spec.names.plural", DELETE),
    (
        "CustomResourceDefinition",
        None,
        "spec.versions.0.schema.openAPIV3Schema.properties.spec.properties.queue.minLength",
        "1",
    ),
    ("Job", None, "spec.template.spec.containers", "agent"),
    ("MaitreJob", None, "spec.queue", DELETE),
    ("MaitreJob", None, "spec.minReplicas", "2"),
    ("MaitreJob", None, "spec.topology.level", "zone"),
    ("MaitreJob", None, "spec.command", "python train.py"),  # a list in Kubernetes
    ("MaitreJob", None, "spec.stragglers.ratio", 1.0),
    ("MaitreJob", None, "spec", DELETE),
]


@pytest.mark.parametrize(("kind", "name", "path", "value"), BROKEN, ids=[f"{k}:{p}" for k, _, p, _ in BROKEN])
def test_a_manifest_with_a_missing_or_wrong_field_is_rejected(kind, name, path, value) -> None:
    jsonschema, kv = _jsonschema(), _kv()
    good = _named(kind, name)
    _validate(good)
    with pytest.raises((kv.ValidationError, kv.SchemaNotFoundError, jsonschema.ValidationError)):
        _validate(_set(good, path, value))


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        ("spec.maxReplica", 4, "unknown field 'maxReplica' (did you mean 'maxReplicas'?)"),
        ("spec.maxReplicas", 1, "maxReplicas 1 is less than minReplicas 2"),
        ("spec.priority", 5, "give priority or priorityClassName, not both"),
        ("spec.name", "other", "spec.name: the job's name is metadata.name"),
        ("metadata.name", DELETE, "metadata.name is required"),
        ("kind", "Job", "not a MaitreJob of maitre.dev/v1alpha1"),
    ],
)
def test_what_the_crd_cannot_check_maitre_refuses_by_name(
    path: str, value: Any, says: str, capsys, tmp_path: Path
) -> None:
    """Unknown fields (which the API server prunes, and kubectl refuses) and checks across
    fields are maitre's: ``manifest`` names the problem before anything is submitted."""
    (job,) = _docs(SAMPLE)
    with pytest.raises(ManifestError) as caught:
        parse_manifest(k8s.manifest_of(_set(job, path, value)))
    assert says in str(caught.value), caught.value
    bad = tmp_path / "job.yaml"
    bad.write_text(yaml.safe_dump(_set(job, path, value)))
    assert k8s.main(["manifest", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("maitre: error:") and says in err and not out, (out, err)


# -- the manifests agree with maitre --------------------------------------------------------
def _cli(container: dict[str, Any]) -> Any:
    """The container's command line as maitre's own parser reads it (it must parse)."""
    from maitre.cli import build_parser

    assert container["command"][0] == "maitre"
    return build_parser().parse_args([*container["command"][1:], *container["args"]])


def test_the_manifests_pass_flags_that_maitre_has_and_agree_with_each_other() -> None:
    coordinator = _named("StatefulSet")
    (co,) = coordinator["spec"]["template"]["spec"]["containers"]
    up = _cli(co)
    assert (up.command, up.nodes, up.host) == ("up", 0, "0.0.0.0")
    ports = {p["name"]: p["containerPort"] for p in co["ports"]}
    assert ports == {"http": up.port, "store": up.store_port} and up.store_port
    mounts = {m["name"]: m["mountPath"] for m in co["volumeMounts"]}
    assert up.state_dir == mounts["state"]
    assert [t["metadata"]["name"] for t in coordinator["spec"]["volumeClaimTemplates"]] == ["state"]
    assert Path(up.token_file).parent == Path(mounts["token"])

    service = _named("Service", "maitre-coordinator")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert service["spec"]["selector"] == coordinator["spec"]["template"]["metadata"]["labels"]
    assert _named("Service", "maitre-coordinator-pods")["spec"]["clusterIP"] == "None"
    assert coordinator["spec"]["serviceName"] == "maitre-coordinator-pods"

    for kind in ("DaemonSet", "Job"):  # the node agents, and a MaitreJob's under Kueue
        pod = _named(kind)["spec"]["template"]["spec"]
        (agent_c,) = pod["containers"]
        agent = _cli(agent_c)
        assert agent.command == "agent"
        host, port = agent.coordinator.rsplit(":", 1)
        assert (host, int(port)) == (service["metadata"]["name"], ports["http"])
        assert Path(agent.token_file).parent == Path(
            {m["name"]: m["mountPath"] for m in agent_c["volumeMounts"]}["token"]
        )
        assert agent_c["resources"]["limits"]["nvidia.com/gpu"] == agent.nproc_per_node
        # SIGTERM drains the node within --sigterm-notice; the agent then needs a few seconds
        # to stop what is left (3 s) and say it goes, before the kubelet's SIGKILL
        assert agent.sigterm_notice is not None
        assert agent.sigterm_notice + 5 <= pod["terminationGracePeriodSeconds"], kind
        assert pod["priorityClassName"] in {"maitre-agent"} | {f"maitre-{c}" for c in PRIORITY_CLASSES}


def test_the_priority_classes_carry_maitres_priorities() -> None:
    for name, value in PRIORITY_CLASSES.items():
        assert _named("PriorityClass", f"maitre-{name}")["value"] == value
    assert (
        _named("PriorityClass", "maitre-coordinator")["value"]
        > _named("PriorityClass", "maitre-agent")["value"]
        > max(PRIORITY_CLASSES.values())
    )
    assert _named("PriorityClass", "maitre-agent")["preemptionPolicy"] == "Never"
    kueue = _named("Job")
    assert kueue["metadata"]["annotations"] == {"kueue.x-k8s.io/elastic-job": "true"}
    assert "kueue.x-k8s.io/queue-name" in kueue["metadata"]["labels"]


# -- what the StatefulSet asks of maitre up -------------------------------------------------
def test_up_takes_its_token_and_store_port_from_flags(tmp_path: Path) -> None:
    """The Secret's token and a fixed store port (behind the Service): the coordinator uses
    them, writes the token to its state directory, and keeps both when restarted."""
    import socket

    from maitre.local import LocalCluster, UpConfig

    with socket.socket() as s:  # a free port, for the store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = LocalCluster(
        UpConfig(state_dir=tmp_path, token="from-the-secret", store_port=port), out=lambda line: None
    ).start()
    try:
        assert cluster.token == "from-the-secret" and cluster.server.door.port == port
        assert (tmp_path / "token").read_text().strip() == "from-the-secret"
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--token-file", "/nonexistent/token"), "cannot read --token-file"),
        (("--token-file", "EMPTY"), "is empty"),
        (("--store-port", "70000"), "--store-port must be in 0..65535"),
    ],
)
def test_up_refuses_a_bad_token_file_or_store_port(args, says, capsys, tmp_path: Path) -> None:
    from maitre.cli import main

    (tmp_path / "EMPTY").write_text("\n")
    args = tuple(str(tmp_path / a) if a == "EMPTY" else a for a in args)
    assert main(["up", "--state-dir", str(tmp_path / "s"), "--nodes", "0", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("maitre: error:") and says in err and "\n" not in err, err
    assert not (tmp_path / "s").exists()  # nothing was started or written


# -- the operator: its RBAC, and replica pods ----------------------------------------------
def _rules(role: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    return {(g, *r.partition("/")[::2], v) for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip


def test_the_operators_roles_grant_exactly_what_it_asks_for() -> None:
    from maitre.engines.kubernetes.operator import NEEDED, NEEDED_FOR_PODS

    def asked(needed: Any) -> set[tuple[str, str, str, str]]:
        return {(g, r, s, v) for g, r, s, verbs in needed for v in verbs}

    assert _rules(_named("Role", "maitre-operator")) == asked(NEEDED)
    assert _rules(_named("Role", "maitre-operator-pods")) == asked(NEEDED_FOR_PODS)


def _owner() -> dict[str, Any]:
    obj = copy.deepcopy(_docs(SAMPLE)[0])
    obj["metadata"].update(namespace="maitre", uid="1c0ffee0-0000-4000-8000-000000000001")
    return obj


@pytest.mark.parametrize("surplus", [False, True])
def test_a_replica_pod_is_the_template_with_the_jobs_gpus_class_and_agent_flags(surplus: bool) -> None:
    from maitre.engines.kubernetes import pods

    template = pods.load_template(DEPLOY / "replica-pods" / "replica-pod.yaml")
    owner = _owner()
    manifest = parse_manifest(k8s.manifest_of(owner))
    pod = pods.pod_for(template, owner, manifest, 3, surplus)
    _validate(pod)
    name = owner["metadata"]["name"]
    assert pod["metadata"]["generateName"] == f"maitre-{name}-3-"
    assert pod["metadata"]["labels"][pods.JOB_LABEL] == name and pod["metadata"]["labels"][pods.INDEX_LABEL] == "3"
    (ref,) = pod["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "MaitreJob",
        name,
        owner["metadata"]["uid"],
        True,
    )
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    wanted = "maitre-surplus" if surplus else f"maitre-{manifest.priority_class_name}"
    assert spec["priorityClassName"] == wanted and _named("PriorityClass", wanted)
    (container,) = spec["containers"]
    agent = _cli(container)
    gpus = manifest.gpus_per_replica
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus) == str(agent.nproc_per_node)
    assert agent.node_id == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert f"reserved_for={name}" in agent.label and ("capacity_type=spot" in agent.label) == surplus
    # the notice covers the job's checkpoint grace; the kubelet's SIGKILL comes well after it
    assert (
        manifest.grace_period_s < agent.sigterm_notice
        and agent.sigterm_notice + 5 <= spec["terminationGracePeriodSeconds"]
    )
    host, port = agent.coordinator.rsplit(":", 1)
    service = _named("Service", "maitre-coordinator")
    assert (host, int(port)) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    assert template == pods.load_template(DEPLOY / "replica-pods" / "replica-pod.yaml")  # (not changed)


def test_surplus_pods_rank_below_every_jobs_minimum_and_preempt_nothing() -> None:
    surplus = _named("PriorityClass", "maitre-surplus")
    assert surplus["value"] < min(PRIORITY_CLASSES.values()) and surplus["preemptionPolicy"] == "Never"


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda p: p.update(kind="Deployment"), "expected a Pod manifest"),
        (lambda p: p["spec"]["containers"][0].update(name="main"), "one container must be named 'agent'"),
        (lambda p: p["spec"]["containers"][0].update(command=["python", "train.py"]), "must run `maitre agent`"),
        (lambda p: p["spec"]["containers"][0]["args"].extend(["--node-id", "x"]), "--node-id is the operator's"),
        (lambda p: p["spec"]["containers"][0].update(args=[]), "needs --coordinator"),
        (lambda p: p.pop("spec"), "spec.containers is required"),
        (lambda p: p["spec"]["containers"][0].update(args="--coordinator x"), "must be lists of strings"),
        (lambda p: p["spec"]["containers"][0]["args"].extend(["--spot-notice", "file:/x"]), "--spot-notice is the"),
        (lambda p: p["spec"]["containers"][0].update(env={"A": "1"}), "env must be a list"),
    ],
)
def test_a_replica_pod_template_that_cannot_serve_is_refused_by_name(edit: Any, says: str, tmp_path: Path) -> None:
    template = yaml.safe_load((DEPLOY / "replica-pods" / "replica-pod.yaml").read_text())
    edit(template)
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(template))
    done = subprocess.run(
        [sys.executable, "-m", "maitre.cli", "operator", "--namespace", "maitre", "--replica-pods", str(path),
         "--coordinator", "127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert str(path) in done.stderr or "replica pod template" in done.stderr


def test_replica_pods_are_asked_for_one_surplus_at_a_time_never_in_a_loop_and_ended_ones_deleted() -> None:
    from maitre.engines.kubernetes import pods
    from maitre.engines.units import Add

    keeper = pods.ReplicaPods(template={})
    job = {"job_id": "a", "state": "RUNNING", "min_workers": 1, "max_workers": 3, "workers": []}

    def pod(name: str, index: int, phase: str) -> dict[str, Any]:
        labels = {pods.JOB_LABEL: "a", pods.INDEX_LABEL: str(index)}
        return {"metadata": {"name": name, "labels": labels}, "status": {"phase": phase}}

    changes, ended = keeper.changes([job], {}, [])
    assert (changes.add, ended) == ([Add("a", 0, False), Add("a", 1, True)], [])
    changes, _ = keeper.changes([job], {}, [pod("p0", 0, "Running"), pod("p1", 1, "Pending")])
    assert changes.add == []  # a surplus pod waits: capacity the cluster does not have
    changes, ended = keeper.changes([job], {}, [pod("p0", 0, "Running"), pod("p1", 1, "Failed")])
    assert changes.add == [Add("a", 1, True)] and ended == ["p1"]
    # scaled down to 1, the coordinator left the minimum's node (p0): p0 goes, and is not asked
    # for again (the job trains on its surplus pod; asking would only remove it again)
    job1 = {**job, "max_workers": 1, "workers": [{"id": "w2"}]}
    nodes = {"p0": [], "p2": ["w2"]}
    changes, _ = keeper.changes([job1], nodes, [pod("p0", 0, "Running"), pod("p2", 2, "Running")])
    assert (changes.add, changes.remove) == ([], ["p0"])
    changes, _ = keeper.changes([job1], nodes, [pod("p2", 2, "Running")])
    assert (changes.add, changes.remove) == ([], [])
    # a pod being deleted keeps its index (not asked for again) and is no pod to remove
    going = pod("p1", 1, "Running")
    going["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    changes, _ = keeper.changes([{**job, "max_workers": 2}], {}, [pod("p0", 0, "Running"), going])
    assert (changes.add, changes.remove) == ([], [])
    waiting = pod("p2", 2, "Pending")
    waiting["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "message": "0/2 nodes: GPUs"}]
    bound = pod("p3", 3, "Pending")  # (bound to a node, its container starting: placed)
    bound["spec"] = {"nodeName": "node-1"}
    assert keeper.pending([pod("p0", 0, "Running"), waiting, bound], "a") == (1, "0/2 nodes: GPUs")


def test_kustomize_renders_the_replica_pods_overlay(tmp_path: Path) -> None:
    kubectl = _kubectl()
    for name in ("base", "replica-pods"):
        shutil.copytree(DEPLOY / name, tmp_path / name)
    (tmp_path / "base" / "token").write_text("a-test-token\n")
    done = subprocess.run(
        [kubectl, "kustomize", str(tmp_path / "replica-pods")], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d is not None]
    for doc in docs:
        _validate(doc)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("DaemonSet", "maitre-agent") not in kinds and ("Role", "maitre-operator-pods") in kinds
    (operator,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = operator["spec"]["template"]["spec"]
    args = _cli(spec["containers"][0])
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "maitre-replica-pod"]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["replica-pod"]["configMap"]["name"] == "maitre-replica-pod"
    assert Path(args.replica_pods) == Path(mounts["replica-pod"]) / "replica-pod.yaml"
    assert config["data"]["replica-pod.yaml"] == (DEPLOY / "replica-pods" / "replica-pod.yaml").read_text()
