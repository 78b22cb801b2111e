"""Scheduling: the cluster and job model, the job state machine, job manifests, and the policy: a pure function of
them (no I/O), called alike by the coordinator and the simulator."""

from maitre.scheduling.lifecycle import JobState
from maitre.scheduling.model import Cluster, Job, Node, Queue, Topology
from maitre.scheduling.policy import Action, Plan, PolicyConfig, place, schedule
from maitre.scheduling.spec import JobManifest, ManifestError, parse_manifest

__all__ = [
    "Action",
    "Cluster",
    "Job",
    "JobManifest",
    "JobState",
    "ManifestError",
    "Node",
    "Plan",
    "PolicyConfig",
    "Queue",
    "Topology",
    "parse_manifest",
    "place",
    "schedule",
]
