"""Replica pods: one pod per replica of each MaitreJob, so Kubernetes sees maitre's usage.

With ``maitre operator --replica-pods TEMPLATE`` the operator keeps, for every MaitreJob whose
job has not ended, one pod per replica, by the rule Slurm's replica jobs follow too
(:func:`maitre.engines.units.plan`). Each pod requests the job's ``gpusPerReplica`` as
``nvidia.com/gpu``, so Kubernetes' scheduler, ResourceQuotas and priorities account for it, and
runs one ``maitre agent`` (the template's container ``agent``) that registers the pod as a maitre
node taking that job's workers only (``--label reserved_for=<job>``, ``--node-id`` the pod's
name). So:

- **Growing creates pods.** The first ``minReplicas`` pods carry the job's PriorityClass
  (``maitre-<priorityClassName>``); the surplus, up to ``maxReplicas``, carries
  ``maitre-surplus`` (below every job's minimum, preempting nothing), asked for one at a time:
  a surplus pod that stays Pending is capacity the cluster does not have (its scheduler's words
  are in the MaitreJob's ``ReplicasPending`` condition), and no other is asked for meanwhile.
  The coordinator grows the job onto each agent that joins.
- **Shrinking drains first.** Scaled down (``kubectl scale mj``), the job's Pending pods go
  first; a running one is deleted only once the coordinator has left its node, at a step
  boundary.
- **A pod evicted or deleted by someone else is a graceful leave.** Its agent runs with
  ``--sigterm-notice``: the pod's SIGTERM is a notice, its workers leave at a step boundary
  (``terminationGracePeriodSeconds`` covers the job's checkpoint grace), and the job trains on
  at the smaller size; the operator asks for the replica's pod again.
- A job that has ended has its pods deleted; every pod is owned by its MaitreJob as well, so
  Kubernetes' garbage collector removes what is left when the object goes.

The template is a Pod manifest (``deploy/kubernetes/replica-pods/replica-pod.yaml``): its image,
volumes (the coordinator's token, checkpoints), node selectors and tolerations are the site's;
the operator sets the name, labels, owner, PriorityClass, GPUs, restart policy, grace period and
the agent's per-pod arguments.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maitre.engines.units import Changes, Unit, plan

log = logging.getLogger("maitre.operator")

JOB_LABEL = "maitre.dev/job"
INDEX_LABEL = "maitre.dev/replica"
SURPLUS_CLASS = "maitre-surplus"
GPU = "nvidia.com/gpu"
CONTAINER = "agent"
NOTICE_MARGIN_S = 15.0
"""The agent's notice beyond the job's checkpoint grace (``gracePeriodSeconds``); the pod's
``terminationGracePeriodSeconds`` is the notice and as much again before SIGKILL."""


class TemplateError(ValueError):
    """The replica pod template is not one the operator can use."""


def load_template(path: str | Path) -> dict[str, Any]:
    """A replica pod template (a Pod manifest in YAML) from ``path``, checked."""
    import yaml

    try:
        pod = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TemplateError(f"cannot read the replica pod template {path}: {' '.join(str(exc).split())}") from None
    return check_template(pod, str(path))


def check_template(pod: Any, where: str = "the replica pod template") -> dict[str, Any]:
    if not isinstance(pod, dict) or pod.get("apiVersion") != "v1" or pod.get("kind") != "Pod":
        raise TemplateError(f"{where}: expected a Pod manifest (apiVersion: v1, kind: Pod)")
    if not isinstance(pod.get("metadata") or {}, dict):
        raise TemplateError(f"{where}: metadata must be a mapping")
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list):
        raise TemplateError(f"{where}: spec.containers is required (a list)")
    agent = [c for c in containers if isinstance(c, dict) and c.get("name") == CONTAINER]
    if len(agent) != 1:
        raise TemplateError(f"{where}: one container must be named {CONTAINER!r} (the maitre agent)")
    parts = [agent[0].get("command") or [], agent[0].get("args") or []]
    if not all(isinstance(p, list) and all(isinstance(a, str) for a in p) for p in parts):
        raise TemplateError(f"{where}: container {CONTAINER!r}'s command and args must be lists of strings")
    if not isinstance(agent[0].get("env") or [], list) or not isinstance(agent[0].get("resources") or {}, dict):
        raise TemplateError(f"{where}: container {CONTAINER!r}'s env must be a list, its resources a mapping")
    command = [*parts[0], *parts[1]]
    if "agent" not in command:
        raise TemplateError(f"{where}: container {CONTAINER!r} must run `maitre agent` (its command and args)")
    for flag in ("--node-id", "--nproc-per-node", "--sigterm-notice", "--spot-notice", "--slurm"):
        if flag in command:
            raise TemplateError(f"{where}: {flag} is the operator's to set (or not) for each pod; remove it")
    if "--coordinator" not in command:
        raise TemplateError(f"{where}: the agent needs --coordinator (the coordinator's Service)")
    return pod


def priority_class(priority_class_name: str | None) -> str | None:
    """The PriorityClass of a job's minimum pods (``deploy/kubernetes/base/priorityclasses.yaml``)."""
    return f"maitre-{priority_class_name}" if priority_class_name else None


def pod_for(
    template: dict[str, Any], owner: dict[str, Any], manifest: Any, index: int, surplus: bool
) -> dict[str, Any]:
    """The pod of replica ``index`` of MaitreJob ``owner`` (``manifest``: its parsed spec,
    :class:`maitre.scheduling.spec.JobManifest`)."""
    meta = owner["metadata"]
    job, gpus = meta["name"], manifest.gpus_per_replica
    notice = manifest.grace_period_s + NOTICE_MARGIN_S
    pod = copy.deepcopy(template)
    pmeta = pod["metadata"] = dict(pod.get("metadata") or {})
    for key in ("name", "uid", "resourceVersion", "creationTimestamp"):
        pmeta.pop(key, None)
    pmeta["generateName"] = f"maitre-{job}-{index}-"
    pmeta["namespace"] = meta["namespace"]
    pmeta["labels"] = {
        **(pmeta.get("labels") or {}),
        "app.kubernetes.io/name": "maitre",
        "app.kubernetes.io/component": "replica",
        JOB_LABEL: job,
        INDEX_LABEL: str(index),
    }
    pmeta["ownerReferences"] = [
        {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": job, "uid": meta["uid"], "controller": True}
    ]
    spec = pod["spec"]
    spec["restartPolicy"] = "Never"  # (a pod that ended is asked for again, as a new pod)
    spec["terminationGracePeriodSeconds"] = int(2 * notice)
    cls = SURPLUS_CLASS if surplus else priority_class(manifest.priority_class_name)
    if cls:
        spec["priorityClassName"] = cls
    else:
        spec.pop("priorityClassName", None)
    agent = next(c for c in spec["containers"] if c["name"] == CONTAINER)
    agent["args"] = [
        *(agent.get("args") or []),
        "--node-id", "$(POD_NAME)",
        "--nproc-per-node", str(gpus),
        "--sigterm-notice", f"{notice:g}",
        "--label", f"reserved_for={job}",
        *(["--label", "capacity_type=spot"] if surplus else []),
    ]  # fmt: skip
    env = [e for e in agent.get("env") or [] if e.get("name") != "POD_NAME"]
    agent["env"] = [*env, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    resources = agent["resources"] = dict(agent.get("resources") or {})
    for key in ("limits", "requests"):
        resources[key] = {**(resources.get(key) or {}), GPU: str(gpus)}
    return pod


def unit_of(pod: dict[str, Any]) -> Unit | None:
    """A replica pod as :func:`maitre.engines.units.plan` sees it (None: not a replica pod,
    or one that has ended: it counts for nothing and is deleted)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    labels = meta.get("labels") or {}
    try:
        job, index = labels[JOB_LABEL], int(labels[INDEX_LABEL])
    except (KeyError, ValueError):
        return None
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    pending = status.get("phase", "Pending") == "Pending"
    return Unit(meta["name"], job, index, pending, meta["name"], going=bool(meta.get("deletionTimestamp")))


def unplaced(pod: dict[str, Any]) -> bool:
    """Not bound to a node yet (the scheduler has no room for it, or has not tried)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    bound = (pod.get("spec") or {}).get("nodeName")
    return status.get("phase", "Pending") == "Pending" and not bound and not meta.get("deletionTimestamp")


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's words for a pod it could not place (None: placed, or not tried yet)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("message") or c.get("reason") or "not scheduled"
    return None


def evicted(pod: dict[str, Any]) -> str | None:
    """The kubelet's words for a pod it evicted (node pressure: the pod is Failed, not deleted)."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed" and status.get("reason") == "Evicted":
        return status.get("message") or "evicted by its node's kubelet"
    return None


@dataclass
class ReplicaPods:
    """What the operator keeps between its passes over replica pods (the pass itself is the
    operator's ``_sync_pods``)."""

    template: dict[str, Any]
    deleted: set[str] = field(default_factory=set)
    """Pods this operator deleted (any other pod seen deleting was evicted or deleted by
    someone else: an Event says so, once)."""
    said: set[tuple[str, str]] = field(default_factory=set)
    """What an Event has told already: ``("pending", pod)``, ``("evicted", pod)`` (told once
    across operators too: those Events are named by what they tell), ``("refused", job)``."""
    seen: dict[str, str] = field(default_factory=dict)
    """The replica pods of the last pass, and their jobs (one gone since, not deleted here, was
    deleted by someone else)."""

    def changes(
        self, jobs: list[dict[str, Any]], nodes: dict[str, list[str]], pods: list[dict[str, Any]]
    ) -> tuple[Changes, list[str]]:
        """(what :func:`plan` adds and removes, the pods that ended: to delete)."""
        units, ended = [], []
        for pod in pods:
            unit = unit_of(pod)
            if unit is not None:
                units.append(unit)
            elif JOB_LABEL in (pod["metadata"].get("labels") or {}):
                ended.append(pod["metadata"]["name"])
        return plan(jobs, nodes, units, surplus=len(jobs), surplus_per_job=1), ended

    @staticmethod
    def pending(pods: list[dict[str, Any]], job: str) -> tuple[int, str | None]:
        """How many of ``job``'s pods wait for the scheduler, and its words for the first."""
        waiting = [p for p in pods if unplaced(p) and (p["metadata"].get("labels") or {}).get(JOB_LABEL) == job]
        words = next((w for w in map(unschedulable, waiting) if w), None)
        return len(waiting), words
