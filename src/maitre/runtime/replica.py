"""Replicas that span processes: a mesh inside, maitre's data parallelism across.

A job's *replica* is ``nproc`` processes (the GPUs of one machine, NVLink between them) that hold
one copy of the model between them, sharded by FSDP2 (``dp_shard``) and optionally split by tensor
parallelism (``tp``): ``nproc == dp_shard * tp``. The job grows and shrinks by whole replicas.

Two levels of groups:

* **Inside a replica**, a fixed group of its ``nproc`` processes, which is torch's default process
  group (DeviceMesh, DTensor, FSDP2 and TP all need one), with the replica's mesh on it:
  :func:`replica_mesh` gives it to the script, which builds its model on it as it would under
  torchrun. It lives as long as the replica; a process lost inside takes its replica out.
* **Across replicas**, one group per position in the replica (local rank ``l``): the ``l``-th
  processes of every replica, which hold the same shards. The loop's gradient allreduce runs on
  it, so each shard is summed over the replicas by the processes that hold it. Under maitre it is
  an epoch group, rebuilt in place at each membership change; under torchrun it is the mesh's
  ``replicate`` dimension.

The step, for a process at local rank ``l`` (see :class:`~maitre.runtime.loop.ElasticLoop`):
FSDP's reduce-scatter sums the replica's gradient shards (the loop sets its reduction to a plain
sum), the cross-replica allreduce sums them over the replicas together with the control slots of
position ``l``, and a second, tiny allreduce of the control slots inside the replica makes every
process of every replica see the same totals and flags. Then the loop divides by the global
sample count: the update is the mean over the same global batch at any number of replicas.

Data: the step's global slice is split between the replicas, then each replica's share between
its ``dp_shard`` ranks; the ``tp`` ranks of a shard read the same samples (only the first counts
them).

Tensor parallelism: the script's TP plan (ColwiseParallel and RowwiseParallel with the
activations replicated around them) goes on ``mesh["tp"]``, then FSDP2 on ``mesh["dp_shard"]``.
A parameter the plan leaves whole on the ``tp`` ranks (a norm, the embedding, Rowwise's bias)
gets the same gradient on each of them, checked on the first step (:func:`check_tp_grads`), and
is counted once in the global gradient norm (:func:`counted`).
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from maitre import protocol

MESH_DIMS = ("dp_shard", "tp")


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """The shape of a replica's mesh."""

    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh {name} must be a whole number >= 1, got {size!r}")

    @property
    def nproc(self) -> int:
        return self.dp_shard * self.tp

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """``dp_shard=4,tp=2`` (as ``MAITRE_MESH`` carries it); missing dimensions are 1."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in MESH_DIMS or not value.isdigit():
                raise ValueError(
                    f"bad mesh {text!r}: expected dims {', '.join(MESH_DIMS)} as name=size, e.g. dp_shard=4,tp=2"
                )
            sizes[name] = int(value)
        return cls(**sizes)

    def __str__(self) -> str:
        return f"dp_shard={self.dp_shard},tp={self.tp}"

    def check(self, nproc: int) -> None:
        if self.nproc != nproc:
            raise ValueError(f"the mesh {self} has {self.nproc} processes, the replica has {nproc} (nprocPerReplica)")


def configure_fsdp(model: torch.nn.Module) -> int:
    """Make every FSDP2 module of ``model`` sum its gradients (no division, no PREMUL_SUM, which
    gloo lacks): the loop divides by the global sample count. Returns how many it configured."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover (torch < 2.6 keeps it elsewhere)
        from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
            count += 1
    return count


def check_mesh(model: torch.nn.Module, replica: "Replica | None") -> None:
    """Refuse, before training, a model the loop would train wrong on its replica:

    * sharded on another mesh than its replica's (or on a mesh the loop does not know: it
      would sum different shards together);
    * in a replica with ``dp_shard > 1``, a parameter that FSDP2 does not shard on the
      ``dp_shard`` dimension: plain, or placed by TP alone. Each ``dp_shard`` rank trains on
      its own samples and nothing would add up that parameter's gradients between them.

    With ``dp_shard == 1`` (tensor parallelism alone) a plain parameter is replicated on the
    ``tp`` ranks, which read the same samples; that its gradients agree there is checked on
    the first step (:func:`check_tp_grads`)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plain = [n for n, p in trainable if not is_sharded(p)]
    if replica is not None and replica.spec.dp_shard > 1 and plain:
        raise ValueError(
            f"a replica of {replica.nproc} processes needs its model sharded on the "
            f"replica's mesh (fully_shard); not sharded: {', '.join(plain[:5])}"
        )
    unsplit = []
    for name, p in trainable:
        if not is_sharded(p):
            continue
        mesh = p.device_mesh
        names = tuple(mesh.mesh_dim_names or ())
        if replica is None:
            raise ValueError(
                f"parameter {name} is sharded on a mesh the loop does not know: "
                "build the model on maitre.replica_mesh()"
            )
        sizes = {n: mesh.size(i) for i, n in enumerate(names)}
        if not names or any(n not in MESH_DIMS or sizes[n] != getattr(replica.spec, n) for n in names):
            raise ValueError(
                f"parameter {name} is sharded on a mesh {sizes or 'without names'}"
                f", not on its replica's ({replica.spec}): build the model on "
                "maitre.replica_mesh()"
            )
        if replica.spec.dp_shard > 1 and not _splits(p, "dp_shard"):
            unsplit.append(name)
    if unsplit:
        raise ValueError(
            f"a replica of {replica.spec} needs every parameter sharded by FSDP2 on "
            "its dp_shard dimension (fully_shard(module, mesh=mesh['dp_shard']), "
            f"after the TP plan); not: {', '.join(unsplit[:5])}"
        )


def _splits(t: torch.Tensor, dim: str) -> bool:
    """Whether the DTensor ``t`` is split along the mesh dimension ``dim`` (``Shard``, or FSDP2's
    ``_StridedShard`` over TP, which is no ``Shard`` in torch 2.13); False where it is
    replicated there or its mesh lacks ``dim``."""
    names = tuple(t.device_mesh.mesh_dim_names or ())
    if dim not in names:
        return False
    placement = t.placements[names.index(dim)]
    return not placement.is_replicate() and not placement.is_partial()


def counted(t: torch.Tensor, replica: "Replica") -> bool:
    """Whether this process counts its piece of ``t`` (a parameter or its gradient) in a sum
    over the replica, such as the global gradient norm, so that every element is counted once:
    on each mesh dimension along which ``t`` is not split (replicated there, or not on its mesh;
    a plain tensor on none) only the processes at coordinate 0 count it. A ``tp``-replicated
    norm weight is counted by the first ``tp`` rank of each shard, not ``tp`` times."""
    coordinate = {"dp_shard": replica.dp_rank, "tp": replica.local_rank % replica.spec.tp}
    sharded = is_sharded(t)
    return all(coordinate[d] == 0 for d in MESH_DIMS if not (sharded and _splits(t, d)))


def tp_replicated(t: torch.Tensor, replica: "Replica") -> bool:
    """Whether ``t`` is one whole copy on every ``tp`` rank of a shard (plain, FSDP2's alone, or
    ``Replicate`` on ``tp``, as RowwiseParallel's bias): its gradient must agree there."""
    return replica.spec.tp > 1 and not (is_sharded(t) and _splits(t, "tp"))


def check_tp_grads(model: torch.nn.Module, replica: "Replica | None", tolerance: float = 1e-6) -> bool:
    """After a step's backward (before any reduction across replicas): every ``tp``-replicated
    parameter must have the same gradient on every ``tp`` rank of its shard, which read the same
    samples. That holds when the parameter's input is replicated on ``tp`` (a norm or a bias on
    the residual stream, as ColwiseParallel and RowwiseParallel leave it). It fails when a plain
    parameter meets a ``tp`` shard of the activations (a norm over each local head after
    ColwiseParallel, say): each rank then holds a partial sum that nothing adds up, and the
    ``tp`` ranks' copies drift apart. Such a model is refused here, with the same ValueError on
    every process of the replica.

    Two small collectives: each process's fingerprints of those gradients (their sum and the
    sum of their magnitudes), the extremes over ``tp``, then the verdict over the replica.
    Returns False when it could not decide (a gradient not finite, as in an fp16 step that
    overflowed): ask again on the next step."""
    if replica is None or replica.spec.tp == 1:
        return True
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and tp_replicated(p, replica)]
    if not named:
        return True
    prints = torch.zeros(2 * len(named), dtype=torch.float64)
    for k, (_, p) in enumerate(named):
        if p.grad is not None:
            local = local_tensor(p.grad).detach().double()
            prints[2 * k], prints[2 * k + 1] = local.sum(), local.abs().sum()
    device = local_tensor(named[0][1]).device
    extremes = torch.cat([prints, -prints]).to(device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=replica.mesh.get_group("tp"))
    high, low = extremes[: len(prints)].cpu(), -extremes[len(prints) :].cpu()
    finite = bool(torch.isfinite(extremes).all())
    spread = (high - low) > tolerance * high[1::2].repeat_interleave(2)
    first = int(spread.nonzero()[0]) // 2 if finite and bool(spread.any()) else -1
    verdict = torch.tensor([0.0 if finite else 1.0, float(first + 1)], dtype=torch.float64, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=replica.group)
    if verdict[1] > 0:
        name = named[int(verdict[1]) - 1][0]
        raise ValueError(
            f"parameter {name} is replicated on the tp ranks but got different gradients on "
            "them: its input is split on tp, so each rank holds a partial sum. Give it a place "
            "in the TP plan or gather its input (maitre supports ColwiseParallel and "
            "RowwiseParallel with the activations replicated around them, under FSDP2 or alone)"
        )
    return float(verdict[0]) == 0.0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own storage: a sharded (DTensor) tensor's local shard, else itself."""
    return t.to_local() if is_sharded(t) else t


def is_sharded(p: torch.Tensor) -> bool:
    """A DTensor (a parameter FSDP2 or TP placed on a mesh)."""
    return type(p) is not torch.Tensor and type(p) is not torch.nn.Parameter and isinstance(p, _dtensor())


def _dtensor() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


@dataclass(slots=True)
class Replica:
    """This process's place in its replica (what :func:`replica_mesh` built)."""

    spec: MeshSpec
    local_rank: int
    mesh: Any
    """The replica's ``DeviceMesh`` (dims ``dp_shard``, ``tp``)."""
    group: Any
    """The replica's process group (the control slots' second allreduce)."""
    cross: Any = None
    """Under torchrun: the group of this position across the replicas (the mesh's
    ``replicate`` dimension); under maitre the loop builds it per epoch."""
    replica_rank: int = 0
    replicas: int = 1
    link: Any = None
    """Under maitre: the link to the run's store its group was built on (kept open)."""

    @property
    def nproc(self) -> int:
        return self.spec.nproc

    @property
    def dp_rank(self) -> int:
        return self.local_rank // self.spec.tp

    @property
    def counts_samples(self) -> bool:
        """The first ``tp`` rank of each shard counts its samples and loss (the others read the
        same samples)."""
        return self.local_rank % self.spec.tp == 0


def same_epoch(ok: bool, epoch: int, reduce_max: Callable[[torch.Tensor], None]) -> str | None:
    """After a rendezvous, agree with the other processes of this replica that every one is
    ``ok`` (its group formed) and in the same epoch; None when they all are, else why this
    process must go round again.

    The coordinator answers a replica's processes one by one, so one may be given an epoch that
    closes a moment later while another, asking after, is given the next: trained on, the two
    would pair their replica's collectives across epochs and hang. The process behind goes
    round again (it is told the newer epoch); the ones ahead wait for it here, in the next
    round of this agreement. ``reduce_max``: an allreduce (max) over the replica's group."""
    while True:
        flag = torch.tensor([0.0 if ok else 1.0, float(epoch), -float(epoch)], dtype=torch.float64)
        reduce_max(flag)
        newest, oldest = int(flag[1]), int(-flag[2])
        if float(flag[0]) > 0:
            return "another process of this replica lost the epoch as it formed"
        if newest == oldest:
            return None
        if epoch < newest:
            return f"another process of this replica is in epoch {newest} already"
        # ahead: the others come back from their rendezvous to the next round


_REPLICA: Replica | None = None
_CRASHED = False
"""An uncaught exception ended the script (see :func:`_destroy_at_exit`)."""


def _init_default_group(backend: str, **kwargs: Any) -> None:
    """``dist.init_process_group``, and its ``destroy_process_group`` at the interpreter's exit:
    gloo's groups left to the exit can abort the process once the script is done ("terminate
    called without an active exception": 1 torchrun run of replicas in about 16 here)."""
    dist.init_process_group(backend, **kwargs)
    previous = sys.excepthook

    def note_crash(*exc: Any) -> None:
        global _CRASHED
        _CRASHED = True
        previous(*exc)

    sys.excepthook = note_crash
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """After a script that ended (or exited) on its own nothing is in flight: the groups are
    destroyed. After an uncaught exception a collective may still be, and destroying its group
    would wait on it: the exit is left as it was."""
    if not _CRASHED and dist.is_initialized():
        dist.destroy_process_group()


def current() -> Replica | None:
    """The replica :func:`replica_mesh` built in this process, if any."""
    return _REPLICA


def replica_mesh(dp_shard: int | None = None, tp: int | None = None, device_type: str | None = None) -> Any:
    """The ``DeviceMesh`` of this process's replica (dims ``dp_shard`` and ``tp``), for the
    script to build its model on (``fully_shard(block, mesh=mesh["dp_shard"])``, TP plans on
    ``mesh["tp"]``).

    Under ``maitre run`` the job declares the mesh (``--nproc-per-replica``, ``--mesh``; a
    manifest's ``nprocPerReplica`` and ``mesh``): sizes given here must agree with it, and the
    replica's processes form their own group on the run's store. Under ``torchrun`` the sizes
    given here choose the mesh (default: ``dp_shard`` = the processes of a node,
    ``LOCAL_WORLD_SIZE``, over ``tp``), and the world is split into replicas of
    ``dp_shard * tp`` consecutive ranks. Alone, it is a mesh of one process.
    """
    global _REPLICA
    if _REPLICA is not None:
        return _REPLICA.mesh
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    declared = os.environ.get(protocol.MESH)
    if declared and os.environ.get(protocol.COORDINATOR):  # under maitre, several processes
        spec = MeshSpec.parse(declared)
        asked = MeshSpec(dp_shard or spec.dp_shard, tp or spec.tp)
        if asked != spec:
            raise ValueError(
                f"the script builds a mesh {asked}, the job declares {spec}: "
                "make them agree (the job's --mesh, or the script's sizes)"
            )
        spec.check(int(os.environ.get(protocol.NPROC, "1")))
        link, store = _run_store()
        if not dist.is_initialized():  # the replica's own group: its processes only
            worker = os.environ[protocol.WORKER_ID]
            _init_default_group(
                backend,
                store=dist.PrefixStore(f"replica/{worker}/", store),
                rank=int(os.environ.get(protocol.PROC, "0")),
                world_size=spec.nproc,
            )
        mesh = init_device_mesh(device_type, (spec.dp_shard, spec.tp), mesh_dim_names=MESH_DIMS)
        _REPLICA = Replica(spec, dist.get_rank(), mesh, dist.group.WORLD, link=link)
        return mesh
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        spec = MeshSpec(dp_shard or max(1, local // (tp or 1)), tp or 1)
        if world % spec.nproc:
            raise ValueError(f"a world of {world} processes does not split into replicas of {spec.nproc} ({spec})")
        if not dist.is_initialized():
            _init_default_group(backend)
        replicas = world // spec.nproc
        full = init_device_mesh(
            device_type, (replicas, spec.dp_shard, spec.tp), mesh_dim_names=("replicate", *MESH_DIMS)
        )
        groups = [
            dist.new_group(list(range(r * spec.nproc, (r + 1) * spec.nproc))) for r in range(replicas)
        ]  # every rank makes every group, in one order
        _REPLICA = Replica(
            spec,
            rank % spec.nproc,
            full[MESH_DIMS],
            groups[rank // spec.nproc],
            cross=full.get_group("replicate"),
            replica_rank=rank // spec.nproc,
            replicas=replicas,
        )
        return _REPLICA.mesh
    spec = MeshSpec(dp_shard or 1, tp or 1)
    if spec.nproc != 1:
        raise ValueError(
            f"a mesh of {spec.nproc} processes ({spec}) needs as many processes: run the script under torchrun"
        )
    if not dist.is_initialized():
        _init_default_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device_type, (1, 1), mesh_dim_names=MESH_DIMS)
    _REPLICA = Replica(spec, 0, mesh, dist.group.WORLD)
    return mesh


def _run_store() -> tuple[Any, Any]:
    """The run's c10d store, through its door (as the loop reaches it), before any epoch."""
    from datetime import timedelta

    from maitre.runtime.storelink import StoreLink
    from maitre.wire import parse_address

    host, port = parse_address(os.environ[protocol.STORE])
    link = StoreLink(
        (host.strip("[]"), port), os.environ.get(protocol.STORE_KEY, ""), os.environ.get(protocol.TOKEN, "")
    )
    link.check()
    store = dist.TCPStore("127.0.0.1", link.port, is_master=False, timeout=timedelta(seconds=60))
    return link, store
