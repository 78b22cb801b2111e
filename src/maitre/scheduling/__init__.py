"""Scheduling: the cluster and job model and the policy, a pure function of them (no I/O)."""

from maitre.scheduling.model import Cluster, Job, Node, Phase, Queue, Topology
from maitre.scheduling.policy import Action, Plan, PolicyConfig, place, schedule

__all__ = ["Action", "Cluster", "Job", "Node", "Phase", "Plan", "PolicyConfig", "Queue",
           "Topology", "place", "schedule"]
