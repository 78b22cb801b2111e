"""``maitre operator``: MaitreJobs acted on, in a Kubernetes namespace, through the coordinator.

Each MaitreJob is reconciled against the coordinator's job of the same name, level-triggered:
read both, make them agree, write what was seen into the object's ``status``:

- **Submitted once, by UID.** A MaitreJob's job carries ``origin: namespace/name/uid``. The
  operator submits a job when the coordinator has none of that name (or only an ended one), and
  adopts one whose origin is the object's: a restarted operator finds its jobs and submits
  nothing twice. A live job of that name from an older object of the same name (deleted while no
  operator ran) is cancelled first; any other job of that name is left alone and the object gets
  a ``Conflict`` condition.
- **A manifest the coordinator refuses** (its checks across fields: the API server's schema has
  checked the rest) gets an ``Invalid`` condition and a Warning Event with the coordinator's
  words, and is not submitted again until its spec changes.
- **``kubectl scale mj J --replicas N``** (the scale subresource: ``spec.maxReplicas``) becomes
  ``maitre scale``: the job grows or shrinks in place. Other changes to a running job's spec are
  not applied: the manifest the coordinator took is kept in the annotation ``maitre.dev/submitted``
  (replica pods are made from it), and a changed field is named by the condition ``SpecApplied``
  (False) and a Warning Event; delete and apply again.
- **``kubectl delete``**: a finalizer (``maitre.dev/job``) holds the object while its job leaves
  gracefully: suspended first where it checkpoints (every worker leaves at a step boundary, a
  final checkpoint written), then cancelled; the finalizer goes once the job has ended.
- **Status and Events.** ``status`` holds the phase, the replicas training and targeted, the
  epoch and step, the gangs restarted (``elastic: restart``), the last checkpoint's step, the
  conditions, and how many of the job's events became Kubernetes Events (``eventsSeen``: a
  restarted operator does not repeat them). Only fields the CRD declares are written
  (:mod:`maitre.engines.kubernetes.crd`): a real API server prunes the rest.
- **One acts at a time.** Replicas of the operator elect a leader over a ``coordination.k8s.io``
  Lease; only the leader reconciles, and it stops the moment it cannot renew.

Built on the official ``kubernetes`` client rather than kopf: a reconcile of each object against
the coordinator is a loop over list and watch, which the client gives directly, and its leader
election runs over a Lease (kopf's peering is a resource of its own, and its default of storing
handler results under ``status`` is pruned by a structural schema, as seen against a real API
server). The RBAC it needs is in ``deploy/kubernetes/base/operator-rbac.yaml``; a request the
API server forbids is reported with the verb and resource that are missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from maitre.engines.kubernetes.crd import GROUP, KIND, PLURAL, VERSION, API_VERSION, manifest_of
from maitre.engines.kubernetes.pods import JOB_LABEL, ReplicaPods, evicted, pod_for, unschedulable
from maitre.errors import ApiError, CoordinatorUnreachable
from maitre.wire import Client

log = logging.getLogger("maitre.operator")

FINALIZER = f"{GROUP}/job"
SUBMITTED = f"{GROUP}/submitted"
"""The annotation that keeps the manifest as the coordinator took it (JSON): what the job runs,
whatever the spec says since (only ``maxReplicas`` follows the spec: ``kubectl scale``)."""
FOLLOWED = ("maxReplicas", "origin")
ENDED = ("COMPLETED", "FAILED", "CANCELLED")
TROUBLE = ("fail", "dead", "lost", "hung", "kill", "evict", "crash")
"""Words that make a job event a Warning Event (the rest are Normal): a resize is news, a
worker lost is trouble."""


class Forbidden(RuntimeError):
    """The API server refused the operator a request: RBAC lacks a verb on a resource."""


NEEDED = (
    (GROUP, PLURAL, "", ("get", "list", "watch", "patch")),
    (GROUP, PLURAL, "status", ("get", "patch")),
    ("", "events", "", ("create",)),
    ("coordination.k8s.io", "leases", "", ("get", "create", "update")),
)
"""(API group, resource, subresource, verbs) the operator needs in its namespace: what
``deploy/kubernetes/base/operator-rbac.yaml`` grants."""
NEEDED_FOR_PODS = (("", "pods", "", ("list", "create", "delete")),)
"""And with replica pods (``--replica-pods``): what ``deploy/kubernetes/replica-pods``'s Role
adds."""


def missing_permissions(api: Any, namespace: str, replica_pods: bool = False) -> list[str]:
    """What of :data:`NEEDED` (and :data:`NEEDED_FOR_PODS`) the operator's credentials may not
    do in ``namespace``, asked of the API server (a SelfSubjectAccessReview each: any
    authenticated user may ask)."""
    from kubernetes import client

    authz = client.AuthorizationV1Api(api)
    missing = []
    for group, resource, sub, verbs in (*NEEDED, *(NEEDED_FOR_PODS if replica_pods else ())):
        for verb in verbs:
            attrs = client.V1ResourceAttributes(
                group=group, resource=resource, subresource=sub or None, verb=verb, namespace=namespace
            )
            spec = client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs)
            answer = authz.create_self_subject_access_review(client.V1SelfSubjectAccessReview(spec=spec))
            if not answer.status.allowed:
                where = f"{resource}/{sub}" if sub else resource
                missing.append(f"{verb} {where}{f' ({group})' if group else ''}")
    return missing


@dataclass
class OperatorConfig:
    namespace: str
    """The namespace whose MaitreJobs this operator acts on."""
    resync_s: float = 2.0
    """Every object is reconciled at least this often (a watch wakes the loop sooner)."""
    lease_name: str = "maitre-operator"
    lease_s: int = 15
    """How long a leader's Lease holds without renewal (a new operator waits this long for a
    dead one's)."""
    renew_s: int = 10
    retry_s: int = 2
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    replica_pods: dict[str, Any] | None = None
    """A replica pod template (:mod:`maitre.engines.kubernetes.pods`): one pod per replica of
    every MaitreJob (None: the jobs run on the agents already there, the DaemonSet's)."""

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("the operator needs a namespace")
        if not self.resync_s > 0:
            raise ValueError(f"resync must be positive, got {self.resync_s}")
        if self.retry_s < 1 or not self.lease_s > self.renew_s > 1.2 * self.retry_s:
            raise ValueError(
                f"the Lease's times must satisfy lease > renew > 1.2 x retry >= 1.2 s, got "
                f"{self.lease_s}, {self.renew_s}, {self.retry_s}"
            )


def json_message(body: Any) -> str:
    """The ``message`` of an API server's error body (its text where it is not JSON)."""
    try:
        return str(json.loads(body)["message"])
    except (TypeError, ValueError, KeyError):
        return " ".join(str(body).split())[:500]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Operator:
    """Reconciles the MaitreJobs of ``cfg.namespace`` against ``coordinator``, through
    ``api`` (a ``kubernetes.client.ApiClient``)."""

    def __init__(self, cfg: OperatorConfig, api: Any, coordinator: Client) -> None:
        from kubernetes import client

        self.cfg = cfg
        self.api = api
        self.objects = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.coordinator = coordinator
        self.leading = threading.Event()
        self.wake = threading.Event()
        self.pods = None if cfg.replica_pods is None else ReplicaPods(cfg.replica_pods)
        self._pending: dict[str, tuple[int, str | None]] = {}

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> bool:
        """Elect a leader; while this one leads, reconcile until ``stop`` is set. False: it
        stopped because it lost its Lease (another may lead now)."""
        from kubernetes import client
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        def lead() -> None:
            log.info("%s leads (Lease %s/%s)", self.cfg.identity, self.cfg.namespace, self.cfg.lease_name)
            self.leading.set()
            threading.Thread(target=self._watch, args=(stop,), name="maitre-operator-watch", daemon=True).start()
            self.loop(stop)

        def lost() -> None:
            if self.leading.is_set():
                log.error("%s lost its Lease: it stops acting", self.cfg.identity)
            self.leading.clear()
            lost_lease.set()
            stop.set()

        lost_lease = threading.Event()

        # (the client's election logs every renewal at INFO: its news is this module's to say)
        logging.getLogger("leaderelection").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
        lock = LeaseLock(self.cfg.lease_name, self.cfg.namespace, self.cfg.identity)
        lock.api_instance = client.CoordinationV1Api(self.api)  # (this operator's credentials)
        config = electionconfig.Config(lock, self.cfg.lease_s, self.cfg.renew_s, self.cfg.retry_s, lead, lost)
        election = leaderelection.LeaderElection(config)
        thread = threading.Thread(target=election.run, name="maitre-operator-lease", daemon=True)
        thread.start()
        stop.wait()
        self.leading.clear()
        return not lost_lease.is_set()

    def loop(self, stop: threading.Event) -> None:
        while not stop.is_set() and self.leading.is_set():
            try:
                self.reconcile_all()
            except Forbidden as exc:
                log.error("%s", exc)
            except CoordinatorUnreachable as exc:
                log.warning("%s (trying again)", exc)
            except Exception:  # a pass that failed is tried again at the next one
                log.exception("a reconcile pass failed")
            self.wake.wait(self.cfg.resync_s)
            self.wake.clear()

    def _watch(self, stop: threading.Event) -> None:
        """Wakes the loop on every change of a MaitreJob (the loop still resyncs without it)."""
        from kubernetes import watch

        while not stop.is_set() and self.leading.is_set():
            try:
                for _ in watch.Watch().stream(
                    self.objects.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self.cfg.namespace,
                    PLURAL,
                    timeout_seconds=30,
                ):
                    self.wake.set()
                    if stop.is_set():
                        return
            except Exception as exc:  # (an expired resourceVersion, a restarted API server)
                log.debug("watch ended: %s", exc)
                stop.wait(self.cfg.retry_s)

    # -- one pass ---------------------------------------------------------------------------------
    def reconcile_all(self) -> None:
        listed = self._k8s(
            "list",
            PLURAL,
            lambda: self.objects.list_namespaced_custom_object(GROUP, VERSION, self.cfg.namespace, PLURAL),
        )
        jobs = {j["job_id"]: j for j in self.coordinator.get("/jobs")["jobs"]}
        items = listed.get("items", [])
        pods = self._list_pods() if self.pods is not None else []
        if self.pods is not None:
            self._pending = {o["metadata"]["name"]: self.pods.pending(pods, o["metadata"]["name"]) for o in items}
        for obj in items:
            if not self.leading.is_set():
                return
            self.reconcile(obj, jobs.get(obj["metadata"]["name"]))
        if self.pods is not None and self.leading.is_set():
            self._sync_pods(items, jobs, pods)

    def reconcile(self, obj: dict[str, Any], job: dict[str, Any] | None) -> None:
        """Make the coordinator's ``job`` (None: it has none of this name) agree with ``obj``."""
        meta = obj["metadata"]
        name, uid = meta["name"], meta["uid"]
        origin = f"{self.cfg.namespace}/{name}/{uid}"
        ours = job is not None and job.get("origin") == origin
        if meta.get("deletionTimestamp"):
            self._delete(obj, job if ours else None)
            return
        if FINALIZER not in meta.get("finalizers", []):
            self._patch(obj, {"metadata": {"finalizers": [*meta.get("finalizers", []), FINALIZER]}})
        status = obj.get("status") or {}
        if not ours:
            if job is not None and job["state"] not in ENDED:
                other = job.get("origin") or ""
                if other.startswith(f"{self.cfg.namespace}/{name}/"):  # an older object's job
                    self.coordinator.post(f"/jobs/{name}/cancel")
                    self.event(obj, "Normal", "Replaced", f"cancelled job {name} of an earlier MaitreJob {name}")
                    return
                self._status(obj, self._condition(status, "Conflict", "True", "NameTaken",
                    f"the coordinator runs a job named {name} that this MaitreJob did not submit "
                    f"({other or 'submitted by hand'}); rename one"))  # fmt: skip
                return
            self._submit(obj, origin, status)
            return
        assert job is not None
        self._apply_scale(obj, job)
        self._report(obj, job, status)

    # -- the parts --------------------------------------------------------------------------------
    def _submit(self, obj: dict[str, Any], origin: str, status: dict[str, Any]) -> None:
        meta = obj["metadata"]
        if status.get("phase") == "INVALID" and status.get("observedGeneration") == meta.get("generation", 0):
            return  # refused at this generation already: said so then
        try:
            manifest = {**manifest_of(obj), "origin": origin}
            answer = self.coordinator.post("/jobs", {"manifest": manifest})
        except (ApiError, ValueError) as exc:
            if isinstance(exc, ApiError) and exc.status >= 500:
                raise
            words = getattr(exc, "message", None) or str(exc)
            self.event(obj, "Warning", "Invalid", f"the coordinator refused the job: {words}")
            self._status(obj, {"phase": "INVALID", "message": words, "observedGeneration": meta.get("generation", 0),
                               **self._condition(status, "Invalid", "True", "Refused", words)})  # fmt: skip
            return
        keep = json.dumps(manifest, separators=(",", ":"), sort_keys=True)
        self._patch(obj, {"metadata": {"annotations": {SUBMITTED: keep}}})
        obj["metadata"].setdefault("annotations", {})[SUBMITTED] = keep
        self.event(
            obj,
            "Normal",
            "Submitted",
            f"job {answer['job_id']} submitted to queue {answer['queue']} at priority {answer['priority']}",
        )
        self._status(
            obj,
            {"phase": "PENDING", "jobId": answer["job_id"], "eventsSeen": 0, "message": "submitted",
             "observedGeneration": meta.get("generation", 0),
             **self._condition(status, "Invalid", "False", "Accepted", "the coordinator took the job")},
        )  # fmt: skip

    def _apply_scale(self, obj: dict[str, Any], job: dict[str, Any]) -> None:
        want = obj["spec"].get("maxReplicas", obj["spec"].get("minReplicas", 1))
        if job["state"] in ENDED or want == job["max_workers"]:
            return
        try:
            self.coordinator.post(f"/jobs/{job['job_id']}/scale", {"workers": want})
        except ApiError as exc:
            if exc.status >= 500:
                raise
            self.event(obj, "Warning", "ScaleRefused", f"maxReplicas {want}: {exc.message}")
            return
        self.event(obj, "Normal", "Scaled", f"maxReplicas {job['max_workers']} -> {want}")

    def _report(self, obj: dict[str, Any], job: dict[str, Any], status: dict[str, Any]) -> None:
        """The job's view into ``status``; its new events as Kubernetes Events."""
        detail = self.coordinator.get(f"/jobs/{job['job_id']}")
        events = detail.get("events", [])
        seen = int(status.get("eventsSeen", 0))
        if seen > len(events):  # (a job submitted again under this object: its events restart)
            seen = 0
        for e in events[seen:]:
            self._job_event(obj, e)
        phase = detail["state"]
        if status.get("phase") == "PENDING" and phase not in ("PENDING", *ENDED):
            placed = sum((detail.get("placement") or {}).values())
            self.event(obj, "Normal", "Admitted", f"admitted: {placed} slot(s) placed")
        checkpoints = [r for r in detail.get("reports", []) if r.get("kind") == "checkpoint"]
        new: dict[str, Any] = {
            "phase": phase,
            "jobId": detail["job_id"],
            "replicas": len(detail.get("members", [])),
            "targetReplicas": detail.get("target", 0),
            "epoch": detail.get("epoch", 0),
            "step": detail.get("step", 0),
            "failures": detail.get("failures", 0),
            "restarts": len(detail.get("restarts", [])),
            "message": detail.get("failure") or detail.get("waiting_for") or phase.lower(),
            "eventsSeen": len(events),
            "observedGeneration": obj["metadata"].get("generation", 0),
        }
        if checkpoints:
            new["lastCheckpointStep"] = int(checkpoints[-1].get("step", 0))
        conditions = {"conditions": status.get("conditions", [])}
        if changed := self._unapplied(obj):
            words = f"changed since the job was submitted, not applied: {', '.join(changed)} (delete and apply again)"
            if {c["type"]: c for c in conditions["conditions"]}.get("SpecApplied", {}).get("message") != words:
                self.event(obj, "Warning", "SpecNotApplied", words)
            conditions = self._condition(conditions, "SpecApplied", "False", "Changed", words)
        else:
            conditions = self._condition(
                conditions, "SpecApplied", "True", "Submitted", "the job runs the spec as applied"
            )
        if self.pods is not None:
            waiting, words = self._pending.get(obj["metadata"]["name"], (0, None))
            new["pendingReplicas"] = waiting
            conditions = self._condition(
                conditions, "ReplicasPending", "True" if waiting else "False",
                "Unschedulable" if words else ("Pending" if waiting else "Placed"),
                f"{waiting} replica pod(s) wait for the scheduler: {words or 'not placed yet'}" if waiting
                else "every replica pod asked for is placed",
            )  # fmt: skip
        for kind, on in (
            ("Admitted", phase != "PENDING"),
            ("Running", phase == "RUNNING"),
            ("Suspended", phase == "SUSPENDED"),
            ("Completed", phase == "COMPLETED"),
            ("Failed", phase == "FAILED"),
        ):
            value, words = ("True" if on else "False"), f"the job is {phase}"
            conditions = self._condition(conditions, kind, value, phase.title(), words)
        new["conditions"] = conditions["conditions"]
        if any(status.get(k) != v for k, v in new.items()):
            self._status(obj, new)

    @staticmethod
    def _unapplied(obj: dict[str, Any]) -> list[str]:
        """The spec's fields that differ from the manifest submitted (:data:`SUBMITTED`), but
        ``maxReplicas``, which ``kubectl scale`` changes in place."""
        text = (obj["metadata"].get("annotations") or {}).get(SUBMITTED)
        if not text:
            return []
        try:
            then = json.loads(text)
        except ValueError:
            return ["the annotation " + SUBMITTED]
        now = manifest_of(obj)
        keys = (set(then) | set(now)) - {"name", *FOLLOWED}
        return sorted(k for k in keys if then.get(k) != now.get(k))

    def _delete(self, obj: dict[str, Any], job: dict[str, Any] | None) -> None:
        """Leave gracefully, then let the object go: a job that checkpoints is suspended (its
        workers leave at a step boundary, a final checkpoint written), then cancelled; one that
        does not is cancelled. The finalizer goes once the job has ended (or was never ours)."""
        meta = obj["metadata"]
        if FINALIZER not in meta.get("finalizers", []):
            return
        state = None if job is None else job["state"]
        if state is None or state in ENDED:
            kept = [f for f in meta.get("finalizers", []) if f != FINALIZER]
            self._patch(obj, {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}})
            return
        assert job is not None
        name = job["job_id"]
        if state == "SUSPENDING":
            return  # (its grace period bounds the wait)
        if state in ("ADMITTED", "RENDEZVOUS", "RUNNING") and obj["spec"].get("checkpointDir"):
            try:
                self.coordinator.post(f"/jobs/{name}/suspend", {"reason": f"MaitreJob {meta['name']} was deleted"})
            except ApiError as exc:
                if exc.status >= 500:
                    raise
                log.info("job %s: not suspended (%s): cancelled", name, exc.message)
            else:
                self.event(obj, "Normal", "Leaving", "deleted: every worker leaves at a step boundary, checkpointed")
                self._status(obj, {"phase": "SUSPENDING"})
                return
        self.coordinator.post(f"/jobs/{name}/cancel")
        how = "checkpointed and cancelled" if state == "SUSPENDED" else "cancelled"
        self.event(obj, "Normal", "Cancelled", f"deleted: job {name} {how}")

    # -- replica pods -----------------------------------------------------------------------------
    def _list_pods(self) -> list[dict[str, Any]]:
        listed = self._k8s(
            "list", "pods", lambda: self.core.list_namespaced_pod(self.cfg.namespace, label_selector=JOB_LABEL)
        )
        return [self.api.sanitize_for_serialization(p) for p in listed.items]

    def _sync_pods(
        self, items: list[dict[str, Any]], jobs: dict[str, dict[str, Any]], pods: list[dict[str, Any]]
    ) -> None:
        """One pass of :class:`ReplicaPods`: pods asked for, deleted, and Events of pods that
        someone else deleted or the scheduler cannot place."""
        from kubernetes.client.exceptions import ApiException

        assert self.pods is not None
        objects = {o["metadata"]["name"]: o for o in items}
        ours = [
            j for name, j in jobs.items() if name in objects
            and j.get("origin") == f"{self.cfg.namespace}/{name}/{objects[name]['metadata']['uid']}"
        ]  # fmt: skip
        nodes = {n["node"]: n["workers"] for n in self.coordinator.get("/nodes")["nodes"] if n["alive"]}
        changes, ended = self.pods.changes(ours, nodes, pods)
        by_name = {p["metadata"]["name"]: p for p in pods}
        for name in [*ended, *changes.remove]:
            pod = by_name[name]
            if name in self.pods.deleted or pod["metadata"].get("deletionTimestamp"):
                continue
            job = pod["metadata"]["labels"][JOB_LABEL]
            try:
                self._k8s(
                    "delete",
                    "pods",
                    lambda name=name: self.core.delete_namespaced_pod(name, self.cfg.namespace),  # type: ignore[misc]
                    missing_ok=True,
                )
            except ApiException as exc:  # (tried again at the next pass)
                log.warning("pod %s not deleted: %s %s", name, exc.status, json_message(exc.body))
                continue
            self.pods.deleted.add(name)
            if job not in objects:
                continue
            phase = (pod.get("status") or {}).get("phase", "Pending")
            if words := evicted(pod):
                self.event(objects[job], "Warning", "ReplicaPodEvicted",
                           f"pod {name} was evicted by its node ({words}): its replica is asked for again",
                           once=f"evicted/{name}")  # fmt: skip
                continue
            why = (
                "it ended" if name in ended
                else "its job needs it no more" if phase != "Pending" else "not placed, and no longer wanted"
            )  # fmt: skip
            self.event(objects[job], "Normal", "ReplicaPodDeleted", f"pod {name} ({phase}) deleted: {why}")
        for add in changes.add:
            obj = objects[add.job]
            if obj["metadata"].get("deletionTimestamp"):
                continue  # (leaving: no replica is asked for again)
            try:
                body = pod_for(self.pods.template, obj, self._submitted(obj), add.index, add.surplus)
            except ValueError as exc:  # (a ManifestError: the spec as submitted no longer parses)
                self._refused(obj, add.index, str(exc))
                continue
            self._create_pod(obj, body, add.index, add.surplus)
        # Pods deleted by someone else (evicted, preempted, drained), seen deleting or already gone.
        now = {p["metadata"]["name"]: p["metadata"]["labels"].get(JOB_LABEL, "") for p in pods}
        deleting = {n for n, p in by_name.items() if p["metadata"].get("deletionTimestamp")}
        for name in sorted((set(self.pods.seen) - set(now)) | deleting):
            job = now.get(name) or self.pods.seen.get(name, "")
            if name in self.pods.deleted or ("evicted", name) in self.pods.said or job not in objects:
                continue
            self.pods.said.add(("evicted", name))
            self.event(objects[job], "Warning", "ReplicaPodEvicted",
                       f"pod {name} was deleted by someone else (evicted, preempted or drained): its agent "
                       "leaves at a step boundary, and the replica's pod is asked for again",
                       once=f"evicted/{name}")  # fmt: skip
        for name, pod in by_name.items():
            if ("pending", name) not in self.pods.said and now[name] in objects and (words := unschedulable(pod)):
                self.pods.said.add(("pending", name))
                self.event(objects[now[name]], "Normal", "ReplicaPodPending", f"pod {name}: {words}",
                           once=f"pending/{name}")  # fmt: skip
        self.pods.deleted &= set(now)  # (pods gone for good are forgotten)
        self.pods.said = {(kind, name) for kind, name in self.pods.said if kind == "refused" or name in now}
        self.pods.seen = now

    def _create_pod(self, obj: dict[str, Any], body: dict[str, Any], index: int, surplus: bool) -> None:
        """Create a replica pod. One the API server refuses for what it is (a ResourceQuota
        exceeded, an admission policy, an invalid field of the template) is a Warning Event,
        once until a pod of that job is created again; a 403 of RBAC is :class:`Forbidden`."""
        from kubernetes.client.exceptions import ApiException

        assert self.pods is not None
        try:
            made = self.core.create_namespaced_pod(self.cfg.namespace, body)
        except ApiException as exc:
            words = json_message(exc.body)
            if exc.status == 403 and "cannot create resource" in words:
                raise Forbidden(
                    f"the API server forbids the operator to create pods in namespace {self.cfg.namespace}: its "
                    "Role lacks that (deploy/kubernetes/replica-pods/operator-pods-rbac.yaml)"
                ) from None
            if not 400 <= exc.status < 500:
                raise
            self._refused(obj, index, words)
            return
        self.pods.said.discard(("refused", obj["metadata"]["name"]))
        kind = "surplus" if surplus else "minimum"
        self.event(obj, "Normal", "ReplicaPodCreated", f"pod {made.metadata.name} for replica {index} ({kind})")

    def _refused(self, obj: dict[str, Any], index: int, words: str) -> None:
        assert self.pods is not None
        job = obj["metadata"]["name"]
        if ("refused", job) not in self.pods.said:
            self.pods.said.add(("refused", job))
            self.event(obj, "Warning", "ReplicaPodRefused", f"replica {index}'s pod: {words}")

    def _submitted(self, obj: dict[str, Any]) -> Any:
        """The job's manifest as the coordinator took it (:data:`SUBMITTED`; the spec now, for an
        object submitted before the annotation existed), parsed."""
        from maitre.scheduling.spec import parse_manifest

        text = (obj["metadata"].get("annotations") or {}).get(SUBMITTED)
        return parse_manifest(json.loads(text) if text else manifest_of(obj))

    # -- writing to the API server ----------------------------------------------------------------
    @staticmethod
    def _condition(status: dict[str, Any], kind: str, value: str, reason: str, message: str) -> dict[str, Any]:
        """``{"conditions": [...]}`` with condition ``kind`` set, its time kept if unchanged.
        (No field is ever an empty string: the API server, 1.20, refused those as nulls.)"""
        conditions = [dict(c) for c in status.get("conditions", [])]
        for c in conditions:
            if c["type"] == kind:
                if c["status"] != value:
                    c["lastTransitionTime"] = _now()
                c.update(status=value, reason=reason, message=message)
                break
        else:
            conditions.append(
                {"type": kind, "status": value, "reason": reason, "message": message, "lastTransitionTime": _now()}
            )
        return {"conditions": conditions}

    def _status(self, obj: dict[str, Any], fields: dict[str, Any]) -> None:
        meta = obj["metadata"]
        obj.setdefault("status", {}).update(fields)
        self._k8s(
            "patch",
            f"{PLURAL}/status",
            lambda: self.objects.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.cfg.namespace, PLURAL, meta["name"], {"status": fields}
            ),
            missing_ok=True,
        )

    def _patch(self, obj: dict[str, Any], body: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self._k8s(
            "patch",
            PLURAL,
            lambda: self.objects.patch_namespaced_custom_object(
                GROUP, VERSION, self.cfg.namespace, PLURAL, meta["name"], body
            ),
            missing_ok=True,
        )

    def event(self, obj: dict[str, Any], kind: str, reason: str, message: str, once: str | None = None) -> None:
        """A Kubernetes Event about ``obj`` (``kubectl describe mj`` shows it). With ``once`` (what
        it tells, e.g. ``evicted/<pod>``) it is told once for ``obj``, by whichever operator comes
        first: its name is made from ``once``, so an operator started again finds it told (the API
        server answers 409) instead of telling it twice."""
        meta = obj["metadata"]
        now = _now()
        if once is None:
            named: dict[str, str] = {"generateName": f"{meta['name']}."}
        else:
            digest = hashlib.sha256(f"{meta['uid']}/{once}".encode()).hexdigest()[:16]
            named = {"name": f"{meta['name']}.{digest}"}
        body = {
            "metadata": {**named, "namespace": self.cfg.namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": self.cfg.namespace,
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message[:1000],
            "type": kind,
            "source": {"component": "maitre-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self._k8s(
            "create",
            "events",
            lambda: self.core.create_namespaced_event(self.cfg.namespace, body),
            exists_ok=once is not None,  # (409: told already)
        )

    def _job_event(self, obj: dict[str, Any], e: dict[str, Any]) -> None:
        kind = str(e.get("kind", "event"))
        reason = "".join(w.title() for w in kind.split("_")) or "Event"
        words = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "kind") and v not in (None, "", [], {}))
        when = f" (coordinator time {e['t']})" if "t" in e else ""
        trouble = any(w in f"{kind} {words}".lower() for w in TROUBLE)
        self.event(obj, "Warning" if trouble else "Normal", reason, f"{words or kind}{when}")

    def _k8s(
        self, verb: str, resource: str, call: Callable[[], Any], missing_ok: bool = False, exists_ok: bool = False
    ) -> Any:
        """``call()``, with a 403 named as the permission it lacks (and a 404 let go where the
        object may have gone meanwhile; a 409 where it may have changed, or, ``exists_ok``, where
        a create finds it made already)."""
        from kubernetes.client.exceptions import ApiException

        try:
            return call()
        except ApiException as exc:
            if exc.status == 403:
                raise Forbidden(
                    f"the API server forbids the operator to {verb} {resource} in namespace "
                    f"{self.cfg.namespace}: its Role lacks that (deploy/kubernetes/base/operator-rbac.yaml)"
                ) from None
            if exc.status == 404 and missing_ok:
                return None
            if exc.status == 409 and (missing_ok or exists_ok):  # (the next pass sees it anew; or made)
                return None
            raise
