"""``maitre operator`` against a real Kubernetes control plane (tests/kube_cluster.py): the API
server with RBAC, etcd, the controllers, the scheduler, hollow nodes.

The operator runs as a local process with the token of its ServiceAccount from the kustomize
base, so the API server enforces the base's Role on every request it makes. The coordinator is a
local ``maitre up`` whose local nodes' agents stand for the cluster's nodes (the hollow nodes run
no processes). Stories, on one control plane (it takes 15 s to start): a MaitreJob applied
trains and grows to its maximum; ``kubectl scale`` grows it in place; a second replica of the
operator waits on the Lease while the first leads, and takes over and re-adopts the job when the
first is SIGKILLed mid-job (nothing submitted twice, no Event repeated); a MaitreJob the API
server's schema refuses, and one the coordinator refuses (a condition and a Warning Event);
``kubectl delete`` leaves a final checkpoint before the object goes. Then: a higher-priority
MaitreJob shrinks another in place, which grows back; an unmodified torchrun script as a
MaitreJob of ``elastic: restart``, restarted whole by ``kubectl scale``. And an operator whose
ServiceAccount lacks a permission says which, and starts nothing.

With replica pods (the replica-pods overlay, ``--replica-pods``; the coordinator has no nodes
of its own, and ``kube_cluster.LocalRuntime`` runs each Running pod's agent as a local process,
as a container runtime would): a pod that does not fit stays Pending and is reported; an evicted
pod leaves gracefully and the Pending one takes its GPUs; an operator restarted while that pod
is still terminating tells nothing twice; scaled down, a running pod goes only
after its worker has left; a higher-priority job's pod preempts a surplus pod, gracefully.

Marked ``kubernetes``: ``.ci/run`` runs it on its own line, after building the control plane as
a step of its own (once per machine, about 6 minutes cold, by
``deploy/kubernetes/testbed/build-control-plane``); the fixture only finds the binaries.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

import kube_cluster
from conftest import ROOT, TAG_VAR, announced_address, kill_tagged, wait_for
from maitre.wire import Client

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]
NS = "maitre"


def _env(tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


@contextlib.contextmanager
def maitre_up(tmp_path: Path, tag: str, nodes: int = 2) -> Iterator[tuple[Client, Path]]:
    """``maitre up`` with ``nodes`` local nodes of two slots: the agents that stand for the
    cluster's nodes (a job may be resized again 3 s after the last resize, not 180). Yields a
    client and the token file."""
    state, log = tmp_path / "state", tmp_path / "up.log"
    up = subprocess.Popen(
        [sys.executable, "-m", "maitre.cli", "up", "--nodes", str(nodes), "--slots-per-node", "2",
         "--state-dir", str(state), "--queue", "default", "--resize-cooldown", "3"],
        cwd=ROOT, env=_env(tag), stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        found = wait_for(lambda: announced_address(log), 60, "the coordinator", log)
        yield Client(found, timeout_s=5.0, token=(state / "token").read_text().strip()), state / "token"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=20)
        except subprocess.TimeoutExpired:
            up.kill()


class OperatorProcess:
    """``maitre operator`` as a local process with a ServiceAccount's kubeconfig."""

    def __init__(
        self, tmp_path: Path, kubeconfig: Path, coordinator: Client, token_file: Path, tag: str, name: str = "a"
    ) -> None:
        self.args = (tmp_path, kubeconfig, coordinator, token_file, tag)
        self.name = name
        self.others: list[OperatorProcess] = []
        self.cmd = [
            sys.executable, "-m", "maitre.cli", "operator", "--namespace", NS, "--kubeconfig", str(kubeconfig),
            "--coordinator", coordinator.address, "--token-file", str(token_file), "--resync", "0.5",
            "--lease-seconds", "3",
        ]  # fmt: skip
        self.tmp_path, self.tag, self.n = tmp_path, tag, 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "OperatorProcess":
        self.n += 1
        self.log = self.tmp_path / f"operator-{self.name}{self.n}.log"
        env = {**_env(self.tag), "MAITRE_LOG": "info"}
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def another(self, name: str) -> "OperatorProcess":
        """A second replica of the operator (the same ServiceAccount, coordinator and Lease)."""
        other = OperatorProcess(*self.args, name=name)
        self.others.append(other)
        return other

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        for other in self.others:
            other.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def _apply_base(kube: kube_cluster.KubeCluster, tmp_path: Path, token: str, overlay: str = "base") -> None:
    """``kubectl apply -k`` the base (or an overlay of it), with the coordinator's token."""
    for name in {"base", overlay}:
        shutil.copytree(ROOT / "deploy" / "kubernetes" / name, tmp_path / name, dirs_exist_ok=True)
    (tmp_path / "base" / "token").write_text(token)
    kube.kubectl("apply", "-k", str(tmp_path / overlay))
    kube.kubectl("wait", "--for=condition=Established", "crd/maitrejobs.maitre.dev", "--timeout=60s")


def _sa_kubeconfig(kube: kube_cluster.KubeCluster, tmp_path: Path, name: str) -> Path:
    """A kubeconfig with ServiceAccount ``name``'s token (the token controller's Secret)."""

    def token() -> str | None:
        sa = kube.request("GET", f"/api/v1/namespaces/{NS}/serviceaccounts/{name}", allow=(404,))
        for ref in (sa or {}).get("secrets", []):
            secret = kube.request("GET", f"/api/v1/namespaces/{NS}/secrets/{ref['name']}", allow=(404,))
            if secret and "token" in secret.get("data", {}):
                return base64.b64decode(secret["data"]["token"]).decode()
        return None

    return kube.write_kubeconfig(tmp_path / f"{name}.kubeconfig", name, wait_for(token, 60, f"{name}'s token"))


def _job(name: str, **spec: Any) -> str:
    body = {
        "apiVersion": "maitre.dev/v1alpha1",
        "kind": "MaitreJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"queue": "default", **spec},
    }
    return json.dumps(body)


def _mj(kube: kube_cluster.KubeCluster, name: str) -> dict[str, Any] | None:
    return kube.request("GET", f"/apis/maitre.dev/v1alpha1/namespaces/{NS}/maitrejobs/{name}", allow=(404,))


def _events(kube: kube_cluster.KubeCluster, name: str) -> list[dict[str, Any]]:
    events = kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
    return [e for e in events if e["involvedObject"].get("name") == name and e["involvedObject"]["kind"] == "MaitreJob"]


def _train(steps: int, *extra: str) -> list[str]:
    """The example, tiny, for ``steps`` steps (100,000: until it is deleted)."""
    return [sys.executable, str(ROOT / "examples" / "train.py"), "--steps", str(steps), "--dtype", "float64",
            "--d-model", "16", "--layers", "1", "--heads", "2", "--block", "16", "--global-batch", "8",
            "--micro-batch", "8", "--log-every", "1000", *extra]  # fmt: skip


def _status(kube: kube_cluster.KubeCluster, name: str, what: str, check: Any, log: Any, timeout: float = 90) -> Any:
    """``name``'s status once ``check(status)`` holds."""

    def seen() -> dict[str, Any] | None:
        st = (_mj(kube, name) or {}).get("status") or {}
        return st if check(st) else None

    return wait_for(seen, timeout, what, lambda: f"{_mj(kube, name)}\n{log()}")


def _replica_pod_template(tmp_path: Path, coordinator: Client, token_file: Path) -> Path:
    """``deploy/kubernetes/replica-pods/replica-pod.yaml`` with the local coordinator's address
    and token file in its agent's arguments, without volumes (the hollow nodes mount none), and
    without CPU and memory requests (a hollow node has little of either: the GPUs are what counts)."""
    pod = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "replica-pods" / "replica-pod.yaml").read_text())
    agent = pod["spec"]["containers"][0]
    agent["args"] = ["--coordinator", coordinator.address, "--token-file", str(token_file)]
    agent.pop("volumeMounts")
    agent["resources"] = {}
    pod["spec"].pop("volumes")
    path = tmp_path / "replica-pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    return path


@contextlib.contextmanager
def _operated(
    kube: kube_cluster.KubeCluster, tmp_path: Path, replica_pods: bool = False
) -> Iterator[tuple[Client, "OperatorProcess"]]:
    """A coordinator (``maitre up``), the base applied with its token, and the operator running
    with its ServiceAccount's token; every process they started is gone afterwards. With
    ``replica_pods``: the replica-pods overlay, a coordinator without nodes of its own, and the
    operator's ``--replica-pods`` (the test runs the pods' agents: :class:`LocalRuntime`)."""
    tag = os.urandom(8).hex()
    operator: OperatorProcess | None = None
    try:
        with maitre_up(tmp_path, tag, nodes=0 if replica_pods else 2) as (coordinator, token_file):
            _apply_base(kube, tmp_path, token_file.read_text().strip(), "replica-pods" if replica_pods else "base")
            kubeconfig = _sa_kubeconfig(kube, tmp_path, "maitre-operator")
            operator = OperatorProcess(tmp_path, kubeconfig, coordinator, token_file, tag)
            if replica_pods:
                operator.cmd += ["--replica-pods", str(_replica_pod_template(tmp_path, coordinator, token_file))]
            operator.start()
            yield coordinator, operator
    finally:
        try:
            if operator is not None:
                operator.stop()
            _clear(kube)
        finally:
            time.sleep(1.0)
            left = kill_tagged(tag)
            assert not left, f"processes left behind: {left}"


def _clear(kube: kube_cluster.KubeCluster) -> None:
    """The namespace's MaitreJobs (their finalizer dropped: no operator is left to act on it)
    and replica pods gone, so that what a test leaves, passed or failed, never meets the next."""
    if kube.request("GET", f"/api/v1/namespaces/{NS}", allow=(404,)) is None:
        return

    def left() -> str:
        jobs = kube.kubectl("-n", NS, "get", "maitrejobs", "-o", "name", check=False).stdout.split()
        pods = kube.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=maitre.dev%2Fjob")["items"]
        return " ".join([*jobs, *(f"pod/{p['metadata']['name']}" for p in pods)])

    kube.kubectl("-n", NS, "delete", "maitrejobs", "--all", "--wait=false", check=False)
    for name in kube.kubectl("-n", NS, "get", "maitrejobs", "-o", "name", check=False).stdout.split():
        kube.kubectl("-n", NS, "patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
    for pod in kube.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=maitre.dev%2Fjob")["items"]:
        if pod["metadata"].get("finalizers"):  # (HOLD, where a test failed holding a pod)
            kube.kubectl("-n", NS, "patch", "pod", pod["metadata"]["name"], "--type=merge",
                         "-p", '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip
    kube.kubectl("-n", NS, "delete", "pods", "-l", "maitre.dev/job", "--force", "--grace-period=0", check=False)
    wait_for(lambda: not left(), 60, "the namespace cleared", left)


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kube_cluster.KubeCluster]:
    binaries = kube_cluster.require()
    with kube_cluster.KubeCluster(tmp_path_factory.mktemp("kube"), binaries, nodes=2) as cluster:
        yield cluster


def test_a_maitrejob_is_run_scaled_adopted_refused_and_deleted(kube: kube_cluster.KubeCluster, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    train = _train(100_000, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50")
    with _operated(kube, tmp_path) as (coordinator, operator):

        def status(name: str, what: str, check: Any, timeout: float = 90) -> Any:
            return _status(kube, name, what, check, operator.text, timeout)

        # Applied: submitted with its UID, trains, grows to its maximum.
        kube.kubectl("apply", "-f", "-", stdin=_job("train", minReplicas=1, maxReplicas=2, command=train,
                                                     checkpointDir=str(ckpt)))  # fmt: skip
        st = status("train", "train at 2", lambda s: s.get("phase") == "RUNNING" and s.get("replicas") == 2)
        obj = _mj(kube, "train")
        assert obj is not None and "maitre.dev/job" in obj["metadata"]["finalizers"]
        job = coordinator.get("/jobs/train")
        assert job["origin"] == f"{NS}/train/{obj['metadata']['uid']}"
        conditions = {c["type"]: c["status"] for c in st["conditions"]}
        assert conditions["Running"] == "True" and conditions["Admitted"] == "True"
        reasons = [e["reason"] for e in _events(kube, "train")]
        assert "Submitted" in reasons and "Admitted" in reasons, reasons

        # kubectl scale: grown in place (the same job, a later epoch, no failure).
        epoch = st["epoch"]
        kube.kubectl("-n", NS, "scale", "mj", "train", "--replicas", "3")
        st = status("train", "train at 3 replicas", lambda s: s.get("replicas") == 3)
        assert st["epoch"] > epoch and st["failures"] == 0
        assert coordinator.get("/jobs/train")["max_workers"] == 3

        # Another change to the running job's spec is not applied, and it says so.
        kube.kubectl("-n", NS, "patch", "mj", "train", "--type", "merge", "-p", '{"spec": {"gracePeriodSeconds": 60}}')
        st = status("train", "SpecApplied False", lambda s: any(
            c["type"] == "SpecApplied" and c["status"] == "False" for c in s.get("conditions", [])))  # fmt: skip
        said = {c["type"]: c for c in st["conditions"]}["SpecApplied"]["message"]
        assert "gracePeriodSeconds" in said and "maxReplicas" not in said, said
        assert any(e["reason"] == "SpecNotApplied" and e["type"] == "Warning" for e in _events(kube, "train"))

        # A second replica of the operator waits on the Lease; the first SIGKILLed mid-job, the
        # second takes over and re-adopts the job (nothing submitted twice, no Event repeated).
        standby = operator.another("b").start()
        time.sleep(3.0)
        assert "leads" not in standby.text(), standby.text()
        submitted = reasons.count("Submitted")
        operator.kill()
        step = status("train", "train's status", lambda s: s.get("step"))["step"]
        status("train", "train's status updated by the standby", lambda s: s.get("step", 0) > step + 20)
        assert "leads" in standby.text(), standby.text()
        reasons = [e["reason"] for e in _events(kube, "train")]
        assert reasons.count("Submitted") == submitted, reasons
        assert len(reasons) == len(set((e["reason"], e["message"]) for e in _events(kube, "train"))), reasons
        assert [j["job_id"] for j in coordinator.get("/jobs")["jobs"]] == ["train"]

        # Refused by the API server's schema (minReplicas >= 1), and by the coordinator.
        bad = kube.kubectl("apply", "-f", "-", stdin=_job("bad", minReplicas=0, command=["true"]), check=False)
        assert bad.returncode != 0 and "minReplicas" in bad.stderr, bad.stderr
        kube.kubectl("apply", "-f", "-", stdin=_job("worse", minReplicas=3, maxReplicas=2, command=["true"]))
        st = status("worse", "worse refused", lambda s: s.get("phase") == "INVALID")
        assert "maxReplicas" in st["message"], st
        assert any(e["reason"] == "Invalid" and e["type"] == "Warning" for e in _events(kube, "worse"))
        kube.kubectl("-n", NS, "delete", "mj", "worse", "--timeout=60s")

        # Checkpoints, as the job reports them.
        status("train", "a checkpoint in train's status", lambda s: s.get("lastCheckpointStep", 0) >= 50)

        # kubectl delete: checkpointed at a step boundary, then gone.
        kube.kubectl("-n", NS, "delete", "mj", "train", "--timeout=120s")
        assert _mj(kube, "train") is None
        job = coordinator.get("/jobs/train")
        assert job["state"] == "CANCELLED", job
        assert any(e["kind"] == "suspended" for e in job["events"]), job["events"]
        assert list(ckpt.glob("step-*")), f"no checkpoint in {ckpt}: {os.listdir(ckpt) if ckpt.exists() else '-'}"


def test_an_operator_without_a_permission_says_which(kube: kube_cluster.KubeCluster, tmp_path: Path) -> None:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    kube.kubectl("apply", "-f", "-", stdin=json.dumps(namespace))
    kube.kubectl("-n", NS, "create", "serviceaccount", "nobody", check=False)
    kubeconfig = _sa_kubeconfig(kube, tmp_path, "nobody")
    result = subprocess.run(
        [sys.executable, "-m", "maitre.cli", "operator", "--namespace", NS, "--kubeconfig", str(kubeconfig),
         "--coordinator", "127.0.0.1:9"],
        cwd=ROOT, env=_env(os.urandom(8).hex()), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "may not get maitrejobs (maitre.dev)" in result.stderr and "create events" in result.stderr, result.stderr
    assert "operator-rbac.yaml" in result.stderr

    # The base's Role, without the replica-pods overlay's: with --replica-pods, pods are missing.
    _apply_base(kube, tmp_path, "a-token")
    kube.kubectl("-n", NS, "create", "serviceaccount", "base-only", check=False)
    kube.kubectl("-n", NS, "create", "rolebinding", "base-only", "--role=maitre-operator",
                 f"--serviceaccount={NS}:base-only", check=False)  # fmt: skip
    template = tmp_path / "replica-pod.yaml"
    shutil.copy(ROOT / "deploy" / "kubernetes" / "replica-pods" / "replica-pod.yaml", template)
    result = subprocess.run(
        [sys.executable, "-m", "maitre.cli", "operator", "--namespace", NS, "--kubeconfig",
         str(_sa_kubeconfig(kube, tmp_path, "base-only")), "--coordinator", "127.0.0.1:9", "--replica-pods",
         str(template)],
        cwd=ROOT, env=_env(os.urandom(8).hex()), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "may not list pods; create pods; delete pods in namespace" in result.stderr, result.stderr
    assert "replica-pods/operator-pods-rbac.yaml" in result.stderr


def test_a_higher_priority_maitrejob_shrinks_another_in_place_and_it_grows_back(
    kube: kube_cluster.KubeCluster, tmp_path: Path
) -> None:
    """No eviction: the low-priority job gives up replicas at a step boundary and trains on;
    once the urgent one completes, it grows back."""
    with _operated(kube, tmp_path) as (coordinator, operator):

        def status(name: str, what: str, check: Any, timeout: float = 90) -> Any:
            return _status(kube, name, what, check, operator.text, timeout)

        # (each sample also waits 2 ms, as on an accelerator: 4 replicas train faster than 2, as
        # the scheduler measures, so it grows the job back; CPU time alone would not)
        gpu_like = ("--device-ms-per-sample", "2")
        kube.kubectl("apply", "-f", "-", stdin=_job("batch", priorityClassName="low", minReplicas=1, maxReplicas=4,
                                                     command=_train(100_000, *gpu_like)))  # fmt: skip
        status("batch", "batch at 4 replicas", lambda s: s.get("replicas") == 4)
        kube.kubectl("apply", "-f", "-", stdin=_job("urgent", priorityClassName="high", minReplicas=2,
                                                     maxReplicas=2, command=_train(400, *gpu_like)))  # fmt: skip
        status("urgent", "urgent running at 2", lambda s: s.get("phase") == "RUNNING" and s.get("replicas") == 2)
        st = status("batch", "batch shrunk to 2", lambda s: s.get("replicas") == 2)
        assert st["phase"] == "RUNNING" and st["failures"] == 0, st  # shrunk in place, never stopped
        status("urgent", "urgent completed", lambda s: s.get("phase") == "COMPLETED", timeout=180)
        st = status("batch", "batch grown back to 4", lambda s: s.get("replicas") == 4)
        assert st["failures"] == 0, st
        assert [e for e in _events(kube, "batch") if e["type"] == "Warning"] == [], _events(kube, "batch")
        for name in ("batch", "urgent"):
            kube.kubectl("-n", NS, "delete", "mj", name, "--timeout=120s")
        assert coordinator.get("/jobs/batch")["state"] == "CANCELLED"


def test_an_unmodified_torchrun_script_as_a_maitrejob_is_restarted_whole_by_kubectl_scale(
    kube: kube_cluster.KubeCluster, tmp_path: Path
) -> None:
    """Restart mode through the operator: ``elastic: restart`` in the MaitreJob's spec; ``kubectl
    scale`` stops the gang and starts it again at the new size, from the script's checkpoint."""
    ckpt, out = tmp_path / "ddp", tmp_path / "final.pt"
    script = [sys.executable, str(ROOT / "examples" / "torchrun_ddp.py"), "--steps", "400", "--step-ms", "20",
              "--checkpoint-dir", str(ckpt), "--out", str(out)]  # fmt: skip
    with _operated(kube, tmp_path) as (coordinator, operator):

        def status(what: str, check: Any, timeout: float = 90) -> Any:
            return _status(kube, "ddp", what, check, operator.text, timeout)

        kube.kubectl("apply", "-f", "-", stdin=_job("ddp", elastic="restart", minReplicas=1, maxReplicas=1,
                                                     command=script))  # fmt: skip
        status("ddp running at 1", lambda s: s.get("phase") == "RUNNING" and s.get("replicas") == 1)
        wait_for(lambda: list(ckpt.glob("*")), 60, "the script's first checkpoint", operator.text)
        kube.kubectl("-n", NS, "scale", "mj", "ddp", "--replicas", "2")
        st = status("ddp restarted at 2", lambda s: s.get("restarts", 0) >= 1 and s.get("replicas") == 2)
        assert st["failures"] == 0, st
        st = status("ddp completed", lambda s: s.get("phase") == "COMPLETED", timeout=180)
        assert out.exists(), "the script's rank 0 wrote no final parameters"
        reasons = [e["reason"] for e in _events(kube, "ddp")]
        assert "GangStopped" in reasons, reasons
        kube.kubectl("-n", NS, "delete", "mj", "ddp", "--timeout=60s")


HOLD = "maitre.test/hold"
"""A finalizer of the tests' own: a pod holding it stays terminating until the test lets go."""


def _pods(kube: kube_cluster.KubeCluster, job: str) -> list[dict[str, Any]]:
    """``job``'s replica pods that are not being deleted, by replica index."""
    listed = kube.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=maitre.dev%2Fjob%3D{job}")["items"]
    live = [p for p in listed if not p["metadata"].get("deletionTimestamp")]
    return sorted(live, key=lambda p: int(p["metadata"]["labels"]["maitre.dev/replica"]))


def _phases(kube: kube_cluster.KubeCluster, job: str) -> list[str]:
    return [p["status"].get("phase", "Pending") for p in _pods(kube, job)]


def test_replica_pods_wait_for_capacity_leave_gracefully_when_evicted_and_go_after_the_drain(
    kube: kube_cluster.KubeCluster, tmp_path: Path
) -> None:
    """One pod per replica (``--replica-pods``, the replica-pods overlay): the hollow nodes have
    8 GPUs each, a replica takes 8, so of the 3 replicas asked for one pod stays Pending, and
    the job trains at 2; a pod evicted is a graceful leave (no failure) and the Pending pod takes
    its place; ``kubectl scale`` down deletes the Pending pod, and the running one only after its
    worker has left at a step boundary; ``kubectl delete`` takes every pod with the job."""
    with _operated(kube, tmp_path, replica_pods=True) as (coordinator, operator):
        runtime = kube_cluster.LocalRuntime(kube, NS, _env(operator.tag), tmp_path)
        with runtime:

            def status(what: str, check: Any, timeout: float = 120) -> Any:
                return _status(
                    kube, "wide", what, check, lambda: f"{operator.text()}\n{_phases(kube, 'wide')}", timeout
                )

            kube.kubectl("apply", "-f", "-", stdin=_job("wide", priorityClassName="normal", minReplicas=1,
                                                         maxReplicas=3, gpusPerReplica=8,
                                                         command=_train(100_000)))  # fmt: skip
            st = status("wide at 2, a third pod Pending", lambda s: s.get("replicas") == 2 and s.get("pendingReplicas"))
            assert st["phase"] == "RUNNING" and st["failures"] == 0, st
            waiting = {c["type"]: c for c in st["conditions"]}["ReplicasPending"]
            assert waiting["status"] == "True" and "Insufficient nvidia.com/gpu" in waiting["message"], waiting
            pods = _pods(kube, "wide")
            assert [p["status"]["phase"] for p in pods] == ["Running", "Running", "Pending"], pods
            assert [p["spec"].get("priorityClassName") for p in pods] == ["maitre-normal", *["maitre-surplus"] * 2]
            agent = pods[0]["spec"]["containers"][0]
            assert agent["resources"]["requests"]["nvidia.com/gpu"] == "8"
            assert (
                "reserved_for=wide" in agent["args"]
                and pods[0]["metadata"]["ownerReferences"][0]["kind"] == "MaitreJob"
            )
            nodes = {n["node"]: n for n in coordinator.get("/nodes")["nodes"]}
            assert set(nodes) == {p["metadata"]["name"] for p in pods[:2]}, nodes  # a node per Running pod
            assert all(n["labels"]["reserved_for"] == "wide" and n["slots"] == 8 for n in nodes.values()), nodes

            # Evicted (the Eviction API, as `kubectl drain` does): a graceful leave; the Pending pod
            # takes the freed GPUs, and the replica's pod is asked for again. The test holds the
            # evicted pod terminating (a finalizer of its own), and meanwhile SIGKILLs and restarts
            # the operator: the new one adopts the pods it finds (none made twice, none deleted)
            # and tells nothing again (not the eviction of the pod it sees terminating, nor the
            # Pending pod), and reports on.
            evicted = pods[1]["metadata"]["name"]
            hold = {"metadata": {"finalizers": [HOLD]}}
            kube.kubectl("-n", NS, "patch", "pod", evicted, "--type=merge", "-p", json.dumps(hold))
            eviction = {
                "apiVersion": "policy/v1beta1",
                "kind": "Eviction",
                "metadata": {"name": evicted, "namespace": NS},
            }
            kube.request("POST", f"/api/v1/namespaces/{NS}/pods/{evicted}/eviction", eviction)
            wait_for(lambda: evicted in runtime.terminated, 30, "the evicted pod's SIGTERM", operator.text)
            status("the evicted replica gone", lambda s: s.get("replicas") == 1)
            st = status("wide back at 2", lambda s: s.get("replicas") == 2)
            assert st["failures"] == 0, st
            assert pods[2]["metadata"]["name"] in {n["node"] for n in coordinator.get("/nodes")["nodes"]}
            job = coordinator.get("/jobs/wide")
            assert any(e["kind"] == "worker_left" for e in job["events"]), job["events"]
            assert not any(e["kind"] == "worker_dead" for e in job["events"]), job["events"]
            assert any(e["reason"] == "ReplicaPodEvicted" for e in _events(kube, "wide")), "\n".join(
                f"{e['reason']}: {e['message']}" for e in _events(kube, "wide")
            )
            wait_for(
                lambda: sorted(_phases(kube, "wide")) == ["Pending", "Running", "Running"], 60,
                "the replica's pod asked for again", lambda: str(_phases(kube, "wide")),
            )  # fmt: skip

            (waiting,) = [p["metadata"]["name"] for p in _pods(kube, "wide") if p["status"].get("phase") == "Pending"]
            said = lambda: [e["message"] for e in _events(kube, "wide") if e["reason"] == "ReplicaPodPending"]  # noqa: E731
            wait_for(lambda: any(waiting in m for m in said()), 30, f"{waiting}'s Pending told", operator.text)
            alive = {p["metadata"]["name"] for p in _pods(kube, "wide")}
            told = {e["metadata"]["name"] for e in _events(kube, "wide")}
            step = status("wide's step", lambda s: s.get("step"))["step"]
            operator.kill()
            operator.start()
            status("wide's status from the new operator", lambda s: s.get("step", 0) > step + 20)
            held = kube.request("GET", f"/api/v1/namespaces/{NS}/pods/{evicted}")
            assert held["metadata"]["deletionTimestamp"], held["metadata"]  # (terminating throughout)
            assert {p["metadata"]["name"] for p in _pods(kube, "wide")} == alive
            new = [e["reason"] for e in _events(kube, "wide") if e["metadata"]["name"] not in told]
            assert not {"ReplicaPodCreated", "ReplicaPodDeleted", "ReplicaPodEvicted", "ReplicaPodPending",
                        "Submitted"} & set(new), new  # fmt: skip
            kube.kubectl("-n", NS, "patch", "pod", evicted, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')

            # Scaled down: the Pending pod goes first; a running one only once its worker has left.
            t0 = time.time()
            running = {p["metadata"]["name"] for p in _pods(kube, "wide") if p["status"]["phase"] == "Running"}
            kube.kubectl("-n", NS, "scale", "mj", "wide", "--replicas", "1")
            status("wide at 1", lambda s: s.get("replicas") == 1 and not s.get("pendingReplicas"))
            wait_for(lambda: len(_pods(kube, "wide")) == 1, 60, "one pod left", operator.text)
            (gone,) = running - {p["metadata"]["name"] for p in _pods(kube, "wide")}
            (kept,) = _pods(kube, "wide")  # the minimum's pod; the surplus one was given up
            assert kept["metadata"]["labels"]["maitre.dev/replica"] == "0", kept["metadata"]
            time.sleep(3.0)  # (six passes of the operator: nothing more is made or deleted)
            assert [p["metadata"]["name"] for p in _pods(kube, "wide")] == [kept["metadata"]["name"]]
            wait_for(lambda: gone in runtime.terminated, 30, "the pod's SIGTERM")
            left = [
                e["t"] for e in coordinator.get("/jobs/wide")["events"] if e["kind"] == "worker_left" and e["t"] > t0
            ]
            assert left and min(left) <= runtime.terminated[gone], (left, runtime.terminated[gone])
            assert coordinator.get("/jobs/wide")["failures"] == 0

            # Deleted: the job ends, and every pod with it.
            kube.kubectl("-n", NS, "delete", "mj", "wide", "--timeout=120s")
            assert coordinator.get("/jobs/wide")["state"] == "CANCELLED"
            wait_for(lambda: not _pods(kube, "wide"), 60, "the pods gone", operator.text)


def test_with_replica_pods_a_higher_priority_job_preempts_a_surplus_pod_which_leaves_gracefully(
    kube: kube_cluster.KubeCluster, tmp_path: Path
) -> None:
    """Kubernetes' own preemption, seen by maitre: the cluster is full of a low-priority job's
    pods (its minimum and one surplus); a high-priority MaitreJob's pod preempts the surplus pod
    (``maitre-surplus`` ranks below every job's minimum), whose agent drains at a step boundary:
    the low job shrinks without a failure, and grows back once the high one completes."""
    with _operated(kube, tmp_path, replica_pods=True) as (coordinator, operator):
        with kube_cluster.LocalRuntime(kube, NS, _env(operator.tag), tmp_path) as runtime:

            def status(name: str, what: str, check: Any, timeout: float = 120) -> Any:
                return _status(kube, name, what, check, lambda: f"{operator.text()}\n{_phases(kube, name)}", timeout)

            kube.kubectl("apply", "-f", "-", stdin=_job("batch", priorityClassName="low", minReplicas=1,
                                                         maxReplicas=2, gpusPerReplica=8,
                                                         command=_train(100_000)))  # fmt: skip
            status("batch", "batch at 2", lambda s: s.get("replicas") == 2)
            minimum, surplus = (p["metadata"]["name"] for p in _pods(kube, "batch"))
            kube.kubectl("apply", "-f", "-", stdin=_job("urgent", priorityClassName="high", minReplicas=1,
                                                         maxReplicas=1, gpusPerReplica=8,
                                                         command=_train(300)))  # fmt: skip
            wait_for(lambda: surplus in runtime.terminated, 60, "the surplus pod preempted", operator.text)
            assert minimum not in runtime.terminated
            status("urgent", "urgent running", lambda s: s.get("phase") == "RUNNING")
            st = status("batch", "batch shrunk to 1", lambda s: s.get("replicas") == 1)
            assert st["phase"] == "RUNNING" and st["failures"] == 0, st
            status("urgent", "urgent completed", lambda s: s.get("phase") == "COMPLETED", timeout=180)
            st = status("batch", "batch grown back to 2", lambda s: s.get("replicas") == 2)
            assert st["failures"] == 0, st
            assert not any(e["kind"] == "worker_dead" for e in coordinator.get("/jobs/batch")["events"])
            wait_for(lambda: not _pods(kube, "urgent"), 60, "urgent's pod gone once it completed")
            for name in ("batch", "urgent"):
                kube.kubectl("-n", NS, "delete", "mj", name, "--timeout=120s")
