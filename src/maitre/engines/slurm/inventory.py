"""What Slurm says the cluster is: nodes (CPUs, GPUs from GRES, features, partitions, state),
partitions (priority tier, preemption mode, grace time) and the switch tree, if any.

Parsing is pure (text in, dataclasses out) so it is tested on Slurm's own output; :func:`read`
asks the cluster. A node's labels for maitre's scheduler come from here: its leaf switch is its
``rack`` and the switch above that its ``block`` (``topology.conf``); without a switch tree, a
feature ``rack<N>``/``block<N>`` says the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from maitre.engines.slurm.commands import Slurm, SlurmError

_PAIR = re.compile(r"(\S+?)=(\S*)")


def fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` (scontrol's --oneliner) as a dict; values have no spaces."""
    return {k: v for k, v in _PAIR.findall(line)}


def gpus(gres: str) -> int:
    """GPUs in a GRES string: ``gpu:2``, ``gpu:a100:4(S:0-1)``, ``gpu:2,shard:8``; (null) is 0."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def expand(hostlist: str) -> list[str]:
    """Slurm's compressed host list (``node[1-3,7],gpu01``) as names."""
    names: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", hostlist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{i:0{width}d}")
    return names


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str
    cpus: int
    gpus: int
    state: str
    """Slurm's state, lowercase (``idle``, ``allocated``, ``mixed``, ``down+drain`` ...)."""
    partitions: tuple[str, ...]
    features: tuple[str, ...]
    labels: dict[str, str] = field(default_factory=dict)
    """maitre's labels: ``rack``, ``block`` (from switches or features), ``accelerator``."""


@dataclass(frozen=True, slots=True)
class Partition:
    name: str
    priority_tier: int
    preempt_mode: str
    grace_s: float
    nodes: tuple[str, ...]
    state: str


def parse_topology(text: str) -> dict[str, dict[str, str]]:
    """``scontrol show topology``: each node's ``rack`` (its leaf switch) and ``block`` (the
    switch above it), where there is one."""
    switches = [fields(line) for line in text.splitlines() if line.startswith("SwitchName=")]
    parent = {}
    for sw in switches:
        for child in expand(sw.get("Switches", "")) if sw.get("Switches") else ():
            parent[child] = sw["SwitchName"]
    labels: dict[str, dict[str, str]] = {}
    for sw in switches:
        if sw.get("Level", "0") != "0":
            continue
        for node in expand(sw.get("Nodes", "")):
            labels[node] = {"rack": sw["SwitchName"]}
            if sw["SwitchName"] in parent:
                labels[node]["block"] = parent[sw["SwitchName"]]
    return labels


def parse_nodes(text: str, topology: dict[str, dict[str, str]] | None = None) -> list[SlurmNode]:
    """``scontrol show nodes --oneliner`` as nodes, labelled from ``topology`` or features."""
    nodes = []
    for line in text.splitlines():
        if not line.startswith("NodeName="):
            continue
        f = fields(line)
        features = tuple(x for x in f.get("AvailableFeatures", "").split(",") if x and x != "(null)")
        labels = dict((topology or {}).get(f["NodeName"], {}))
        for feat in features:
            m = re.fullmatch(r"(rack|block)[-_=]?(.+)", feat)
            if m and m.group(1) not in labels:
                labels[m.group(1)] = feat
        gres = f.get("Gres", "(null)")
        kind = re.match(r"gpu:([A-Za-z][\w.-]*):\d", gres)
        if kind:
            labels["accelerator"] = kind.group(1)
        nodes.append(
            SlurmNode(
                name=f["NodeName"],
                cpus=int(f.get("CPUTot", "0") or 0),
                gpus=gpus(gres),
                state=f.get("State", "unknown").lower(),
                partitions=tuple(p for p in f.get("Partitions", "").split(",") if p),
                features=features,
                labels=labels,
            )
        )
    return nodes


def _seconds(text: str) -> float:
    """Slurm's durations: ``SS``, ``MM:SS``, ``HH:MM:SS``, ``D-HH:MM:SS``."""
    days, _, rest = text.rpartition("-")
    total = 0.0
    for part in rest.split(":"):
        total = total * 60 + float(part)
    return total + (float(days) * 86400 if days else 0.0)


def parse_partitions(text: str) -> dict[str, Partition]:
    """``scontrol show partition --oneliner``."""
    parts = {}
    for line in text.splitlines():
        if not line.startswith("PartitionName="):
            continue
        f = fields(line)
        nodes = f.get("Nodes", "")
        parts[f["PartitionName"]] = Partition(
            name=f["PartitionName"],
            priority_tier=int(f.get("PriorityTier", "1")),
            preempt_mode=f.get("PreemptMode", "OFF"),
            grace_s=_seconds(f.get("GraceTime", "0")),
            nodes=tuple(expand(nodes)) if nodes and nodes != "(null)" else (),
            state=f.get("State", "UP"),
        )
    return parts


def parse_kill_wait(text: str) -> float | None:
    """``KillWait`` of ``scontrol show config`` (``KillWait = 5 sec``): how long ``scancel``'s
    SIGTERM is given before SIGKILL."""
    m = re.search(r"^KillWait\s*=\s*(\d+)", text, re.M)
    return float(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Inventory:
    nodes: list[SlurmNode]
    partitions: dict[str, Partition]
    kill_wait_s: float | None = None
    """Slurm's ``KillWait``: the notice a cancelled (not preempted) job gets."""

    def partition(self, name: str) -> Partition:
        """The partition, or a :class:`SlurmError` that names the ones there are."""
        if name not in self.partitions:
            raise SlurmError(
                ["scontrol", "show", "partition", name],
                f"Partition {name!r} does not exist (Slurm has: {', '.join(sorted(self.partitions)) or 'none'})",
            )
        return self.partitions[name]

    def node(self, name: str) -> SlurmNode | None:
        return next((n for n in self.nodes if n.name == name), None)


def read(slurm: Slurm) -> Inventory:
    """Ask Slurm (four ``scontrol`` calls); :class:`SlurmError` when it does not answer."""
    try:
        topology = parse_topology(slurm("scontrol", "show", "topology"))
    except SlurmError:  # topology/none (or an old scontrol): no switches, features may say
        topology = {}
    nodes = parse_nodes(slurm("scontrol", "show", "nodes", "--oneliner"), topology)
    parts = parse_partitions(slurm("scontrol", "show", "partition", "--oneliner"))
    return Inventory(nodes, parts, parse_kill_wait(slurm("scontrol", "show", "config")))
