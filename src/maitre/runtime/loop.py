"""ElasticLoop: the one object in a training script. It owns the step boundary.

A script builds its model, optimizer and data as usual, then iterates::

    loop = maitre.ElasticLoop(model, optimizer, sampler, lr_scheduler=sched)
    for batch in loop.run(max_steps=1000):
        for idx in batch.micro_batches:        # this rank's share of the global batch
            loss = loss_fn(model(x[idx]), y[idx], reduction="sum")
            loss.backward()
            batch.log_loss(loss)

While backward runs, the summed gradients are reduced in buckets as they become final, as DDP
does (:mod:`maitre.runtime.reduction`). Between two iterations the loop finishes the step: the
last bucket carries the control slots (the loss sum, the sample count, a resize flag and the
checkpoint's flags); once every bucket is reduced, the gradients are the mean over the global
sample count (uneven shares weighted exactly), and the loop runs the recipe's step hooks on them
(a loss scaler's overflow check, clipping by the global norm, a callback:
:mod:`maitre.runtime.hooks`), applies the scaling rule's learning-rate factor, steps the
optimizer and the LR schedule, advances the sampler and commits.
With mixed precision the body reads::

    for idx in batch.micro_batches:
        with batch.autocast():                 # bf16 or fp16, as the loop was given
            loss = loss_fn(model(x[idx]), y[idx], reduction="sum")
        batch.backward(loss)                   # scaled for fp16; logs the loss

The flags are how every rank makes the same decision at the same step: any rank whose heartbeat
brought news of a membership change raises the resize flag, any rank whose checkpoint interval
elapsed asks for a save (see :mod:`maitre.checkpoint`), and after the allreduce all ranks agree.

A job that starts with no live state anywhere (its first start, a resume, or every worker lost)
loads the newest complete checkpoint, if one is configured; the state then goes on live.

When the allreduce fails (a peer crashed) or is abandoned (the coordinator closed the epoch: a
peer hung or was removed) the step in flight is dropped, the loop rendezvous for the next epoch
(:mod:`maitre.runtime.recovery`), builds its group, pulls the committed state from a peer that
is ahead (see :mod:`maitre.runtime.transfer`) and yields the same step again with the new shares. The script
never sees the failure. A joiner builds its model before it asks to join, so the running workers
pause only for the rendezvous and the state broadcast.

Under plain ``torchrun`` the same loop runs on a fixed group; alone, on one process.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from maitre import protocol
from maitre.checkpoint.checkpointer import CheckpointConfig, Checkpointer
from maitre.checkpoint.writer import SaveResult
from maitre.runtime.control import SLOTS, Slot
from maitre.runtime.env import Mode, WorkerEnv
from maitre.runtime.group import EpochGroup, EpochLost
from maitre.runtime.heartbeat import CoordinatorView, Heartbeat
from maitre.runtime.hooks import LossScaler, StepHooks, all_finite, clip
from maitre.runtime import replica as replicas
from maitre.runtime.ledger import Ledger
from maitre.runtime.reduction import Buckets, Reducer, agree
from maitre.runtime import recovery
from maitre.runtime.recovery import Ended, Recovery
from maitre.runtime.sampler import ElasticSampler, StepSlice, share_bounds
from maitre.runtime.scaling import ConstantBatch
from maitre.runtime.signals import SigtermLatch
from maitre.runtime.steptiming import StepTiming
from maitre.runtime.streamjoin import Listening, StreamJoin
from maitre.runtime.state import Stateful, TrainState, updated_storages
from maitre.runtime.storelink import StoreLinkError
from maitre.runtime import telemetry
from maitre.runtime.transfer import Packed, Receiver, Sender, broadcast_state, sync_steps
from maitre.runtime.transfer import unpack as transfer_unpack
from maitre.errors import ApiError, CoordinatorUnreachable, WorkerStopped
from maitre.runtime.link import CoordinatorLink, HttpLink

_STALL_FLOOR_S = 0.5
_STALL_STEPS = 5.0


@dataclass(slots=True)
class Batch:
    """One step as this rank sees it."""

    step: int
    """The step being trained (the committed step count plus one)."""
    rank: int
    world_size: int
    slice: StepSlice
    micro_batches: list[list[int]]
    """This process's sample indices, split by the micro-batch size (may be empty lists' list)."""
    mine: list[int] | None = None
    """This process's part of its replica's share, when a replica spans processes."""
    grad_norm: float | None = None
    """The global norm of the reduced gradients, once clipped (for ``on_reduced_grads``)."""
    _loss: "float | torch.Tensor" = 0.0
    """This rank's summed loss so far: a tensor while the losses logged are tensors (summed
    where they lie: reading one would wait for the device in the middle of the step)."""
    _logged: bool = False
    _scale: float = 1.0
    _autocast: tuple[str, torch.dtype] | None = None
    _tokens: int = 0
    _skipped: int = 0

    @property
    def indices(self) -> list[int]:
        """The samples this process trains on (its rank's share, or its part of it)."""
        return self.slice.local_indices if self.mine is None else self.mine

    @property
    def global_batch_size(self) -> int:
        return self.slice.global_count

    def log_tokens(self, tokens: int) -> None:
        """Count ``tokens`` of this rank's work this step: its compute is then timed per token
        rather than per sample (variable sequence lengths do not look slow)."""
        self._tokens += tokens

    @property
    def skipped(self) -> int:
        """Samples of this rank's share skipped so far in this step (:meth:`skip`)."""
        return self._skipped

    def skip(self, samples: int = 1) -> None:
        """``samples`` of this rank's share could not be loaded (a corrupt record, with a
        loader's ``on_error="skip"``): the step's mean is over the samples trained, the same
        whatever the world size, and ``loop.skipped`` counts them."""
        if samples < 0 or self._skipped + samples > len(self.indices):
            raise ValueError(
                f"cannot skip {samples} more of {len(self.indices)} samples ({self._skipped} skipped already)"
            )
        self._skipped += samples

    def log_loss(self, loss_sum: torch.Tensor | float) -> None:
        """Record this rank's summed loss; ``loop.last_loss`` is then the global mean."""
        if isinstance(loss_sum, torch.Tensor):
            self._loss = loss_sum.detach().sum() + self._loss
        else:
            self._loss += float(loss_sum)
        self._logged = True

    def backward(self, loss_sum: torch.Tensor) -> None:
        """``loss_sum.backward()``, times the loss scale with ``precision="fp16"``; logs the loss."""
        self.log_loss(loss_sum)
        (loss_sum * self._scale if self._scale != 1.0 else loss_sum).backward()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` in the loop's precision (nothing without one)."""
        if self._autocast is None:
            return contextlib.nullcontext()
        device_type, dtype = self._autocast
        return torch.autocast(device_type, dtype=dtype)


class ElasticLoop:
    """See the module docstring.

    Args:
        model: the module whose gradients are averaged.
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        sampler: the :class:`ElasticSampler` of the data set.
        lr_scheduler: optional; stepped once per committed step.
        micro_batch_size: split a rank's share into micro-batches of at most this many samples
            (gradient accumulation), so a shrinking world does not run out of memory.
        scaling: the scaling rule (default :class:`ConstantBatch`).
        extras: other stateful objects to carry through joins and checkpoints.
        checkpoint: where and how often to checkpoint (default: from ``maitre run
            --checkpoint-dir``, else none). A job that starts with no live state loads the
            newest complete checkpoint there.
        precision: ``"bf16"`` or ``"fp16"`` for ``batch.autocast()``; fp16 scales the loss
            (``batch.backward``) with ``loss_scaler`` (default: a :class:`LossScaler`).
        clip_grad_norm: clip the reduced gradients to this global norm.
        on_reduced_grads: called as ``fn(batch)`` on every rank between the reduced gradients
            and the optimizer's step (see :mod:`maitre.runtime.hooks`).
        buckets: how the gradients are bucketed and reduced while backward runs (default
            :class:`~maitre.runtime.reduction.Buckets`: DDP's 25 MiB, a 1 MiB first bucket).
        env: where this process runs (default: read from its environment, see
            :class:`~maitre.runtime.env.WorkerEnv`).
        link: how an elastic worker reaches its coordinator, agent and store (default: an
            :class:`~maitre.runtime.link.HttpLink` to those ``env`` names; see
            :class:`~maitre.control.inprocess.InProcessCluster` for ranks as threads).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        *,
        lr_scheduler: Any = None,
        micro_batch_size: int | None = None,
        scaling: Any = None,
        extras: dict[str, Stateful] | None = None,
        env: WorkerEnv | None = None,
        checkpoint: CheckpointConfig | None = None,
        precision: str | None = None,
        clip_grad_norm: float | None = None,
        on_reduced_grads: Any = None,
        loss_scaler: LossScaler | None = None,
        buckets: Buckets | None = None,
        link: CoordinatorLink | None = None,
    ) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.hooks = StepHooks(precision=precision, clip_grad_norm=clip_grad_norm, on_reduced_grads=on_reduced_grads)
        if loss_scaler is not None and precision != "fp16":
            raise ValueError("a loss_scaler is for precision='fp16'")
        self.scaler = loss_scaler if loss_scaler is not None else (LossScaler() if precision == "fp16" else None)
        self.env = env or WorkerEnv.from_environ()
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.scaling = scaling or ConstantBatch()
        self.state = TrainState(
            model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, sampler=sampler, scaling=self.scaling
        )
        self.lr_scheduler = lr_scheduler
        for name, obj in (extras or {}).items():
            self.state.register(name, obj)
        if self.scaler is not None:  # its scale is part of the job's state
            self.state.register("loss_scaler", self.scaler)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        self.replica = replicas.current()
        """This process's replica, when the script built its model on :func:`replica_mesh`."""
        replicas.check_mesh(model, self.replica)
        replicas.configure_fsdp(model)  # FSDP2 sums; the loop divides by the global count
        self._tp_checked = self._spanning is None or self._spanning.spec.tp == 1
        """Whether the tp ranks' copies of a tp-replicated parameter got the same gradients."""
        cfg = checkpoint if checkpoint is not None else CheckpointConfig.from_environ()
        self._timing = StepTiming(self.env, os.environ)  # (ValueError: a bad MAITRE_STRAGGLER_*)
        self._members: list[str] = []
        """The epoch's members (worker ids) by group rank, when the coordinator named them."""
        self.device = self.params[0].device
        self.rank, self.world_size, self.epoch = self.env.rank, self.env.world_size, 0
        self.group: EpochGroup | None = None
        self.last_loss: float | None = None
        self.last_grad_norm: float | None = None
        """The global gradient norm of the last committed step (with ``clip_grad_norm``)."""
        self._reducer = Reducer(model, self.params, buckets or Buckets(), SLOTS, divide_early=self.scaler is None)
        """The gradient buffers, laid out in buckets, and their reduction."""
        self._step_times: deque[float] = deque(maxlen=32)
        self._trained_s = 0.0
        self._committed_at = 0.0
        """Seconds spent in steps that committed (dropped steps do not count)."""
        self._ledger = (
            Ledger(
                self.env.ledger_dir,
                self.env.worker_id if self.env.nproc == 1 else f"{self.env.worker_id}.p{self.env.proc}",
                sampler.num_samples,
                self.env.run_id,
            )
            if self.env.ledger_dir
            else None
        )
        self._link = link
        self.ended: str | None = None
        """Why :meth:`run` ended: ``"completed"`` (every step committed), ``"left"`` (the job went
        on without this worker: scaled down, or it finished while this worker's state streamed
        in), ``"suspended"`` (checkpointed; the job resumes later), ``"stopped"`` (the job ended
        without it: completed, cancelled), ``"SIGTERM"`` (checkpointed, under torchrun or alone;
        the signal is delivered again once the loop has ended). None while it runs."""
        self._reporter: telemetry.Reporter | None = None
        """Progress, checkpoint and restore reports to the coordinator (off the step's path)."""
        self._meter = telemetry.ProgressMeter()
        self._heartbeat: Heartbeat | None = None
        self._store: dist.Store | None = None
        self._store_id: str | None = None
        self._state_lost = False
        """The coordinator says every worker that held the job's state was lost."""
        self._recovery: Recovery | None = None
        self._join = StreamJoin()
        """This epoch's streamed join: who listens, who sends (:mod:`maitre.runtime.streamjoin`)."""
        self._prefix = ""
        """This epoch's store prefix (of this process's cross-replica group)."""
        self._owns_default_group = False
        self._building_since: float | None = None
        self._confirming = False
        """Waiting for the coordinator's word before a long step commits (_confirm_epoch)."""
        self.checkpointer = Checkpointer(cfg, meta={"job_id": self.env.job_id}) if cfg else None
        self._max_steps = 0
        self._sigterm = SigtermLatch()

    # -- public ----------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Committed steps so far."""
        return self.state.step

    @property
    def skipped(self) -> int:
        """Samples left out of the committed steps because their data could not be read
        (:meth:`Batch.skip`), over all ranks: part of the committed state, so it goes on across
        joins, restarts and resumes, and the coordinator's job view shows it."""
        return self.state.skipped

    @property
    def completed(self) -> bool:
        """Whether :meth:`run` ended with every step committed: what a script checks before it
        writes the final model (a worker that left, or stopped with a checkpoint, holds a state
        that is not the last)."""
        return self.ended == "completed"

    def multiply_gradients(self, factor: float) -> None:
        """Multiply every gradient of the step being trained by ``factor`` on its way into the
        reduction, at no cost beyond the copy it is already (call it before the step's last
        backward pass). What turns a plain loop's mean loss over ``factor`` samples into the sum
        the reduction divides by the global count (:mod:`maitre.runtime.prepare`)."""
        self._reducer.multiply(factor)

    def run(self, max_steps: int) -> Iterator[Batch]:
        """Yield one :class:`Batch` per step until ``max_steps`` steps are committed, or until
        this worker's part in the job ends before (:attr:`ended` says why; :attr:`completed`).

        Raises :class:`~maitre.errors.WorkerStopped` when this worker cannot go on: the
        coordinator refused it, stayed out of reach past ``coordinator_timeout_s``, or stopped it
        because the job failed."""
        self._max_steps = max_steps
        self.ended = None
        try:
            self._start()
            while self.state.step < max_steps:
                if self._join.listening is not None:
                    self._listen()
                    continue
                batch = self._next_batch()
                # (A tp replica's first step checks each tp rank's own gradients after the body:
                # none may be reduced before.)
                self._reducer.begin(
                    len(batch.micro_batches), self.group, batch.global_batch_size, early=self._tp_checked
                )
                step_start = self._timing.begin()
                if self.checkpointer is not None:  # (a save's device copy reads the state on)
                    self.checkpointer.fence(update=False)
                yield batch
                if not self._tp_checked:  # each tp rank's own gradients, before any reduction
                    self._tp_checked = replicas.check_tp_grads(self.model, self._spanning)
                if self._finish(batch):
                    elapsed = self._committed_at - step_start  # not the resize that may follow
                    self._step_times.append(elapsed)
                    self._trained_s += elapsed
                    if self.checkpointer is not None:
                        self.checkpointer.record_step(elapsed)
                        if self._heartbeat is not None:
                            view = self._heartbeat.view
                            self.checkpointer.policy.observe_history(view.failures, view.age_s)
            self._done()
            self.ended = "completed"
        except Ended as end:
            self.ended = end.why
            if end.message:
                print(end.message, file=sys.stderr, flush=True)
        finally:
            if self.ended is None and self.group is not None:  # left by an exception
                self.group.retire()  # (set aside: its destructor would wait for a collective)
                self.group = None
            self._reducer.close()
            if self.checkpointer is not None:  # a save in flight becomes durable (or fails)
                self.checkpointer.close()
            if self._reporter is not None:  # (its last checkpoint's report included)
                self._reporter.close()
            self._sigterm.restore()
            if self._heartbeat is not None:
                self._heartbeat.stop()
            if self._ledger is not None:
                self._ledger.close()
            self._timing.close()
            if self._link is not None:
                self._link.close()
        if self.ended == "SIGTERM":
            self._sigterm.deliver()  # the process ends as the signal meant (its own handler, if any)

    @property
    def _spanning(self) -> "replicas.Replica | None":
        """This process's replica when it spans several processes (else None)."""
        return self.replica if self.replica is not None and self.replica.nproc > 1 else None

    @property
    def _counts_samples(self) -> bool:
        """This process counts its samples and writes the ledger (a shard's first tp rank)."""
        return self._spanning is None or self._spanning.counts_samples

    @property
    def _checkpoint_part(self) -> tuple[int, int] | None:
        """(part, parts) of a checkpoint this process writes: its rank's share of the replicated
        state, or, when a replica spans processes, its own shards if its replica is the first
        (the others write nothing: they hold the same shards)."""
        if self._join.listening is not None:  # the parts of a save are the training members'
            return None
        rep = self._spanning
        if rep is None:
            return self.rank, self.world_size
        return (rep.local_rank, rep.nproc) if self.rank == 0 else None

    # -- the step boundary -----------------------------------------------------------------------
    def _next_batch(self) -> Batch:
        size = self.scaling.global_batch_size(self.sampler.global_batch_size, self.world_size)
        if size > self.sampler.num_samples and self.state.step == 0:  # (the job's first: every rank's)
            rule = getattr(self.scaling, "rule", type(self.scaling).__name__)
            raise ValueError(
                f"the global batch ({size}: the {rule} rule at world size {self.world_size}) "
                f"is larger than the data set ({self.sampler.num_samples} samples)"
            )
        slc = self.sampler.next_slice(self.rank, self.world_size, size)
        chunks, mine = self._split(slc.local_indices)
        dtype = self.hooks.autocast_dtype
        return Batch(
            self.state.step + 1,
            self.rank,
            self.world_size,
            slc,
            chunks,
            mine=mine,
            _scale=self.scaler.scale if self.scaler is not None else 1.0,
            _autocast=None if dtype is None else (self.device.type, dtype),
        )

    def _split(self, local: list[int]) -> tuple[list[list[int]], list[int] | None]:
        """This process's micro-batches of its rank's share ``local``, and its part of the share
        when its replica spans processes (else None)."""
        mine: list[int] | None = None
        rep = self._spanning
        most = len(local)
        if rep is not None:  # the replica's share, split by dp_shard rank
            start, end = share_bounds(len(local), rep.dp_rank, rep.spec.dp_shard)
            most = -(-len(local) // rep.spec.dp_shard)  # the largest part of the replica's share
            local = mine = local[start:end]
        micro = self.micro_batch_size or max(1, most)
        chunks = [local[i : i + micro] for i in range(0, len(local), micro)]
        # Every process of a replica runs as many forward passes (FSDP2's collectives pair
        # them up): a smaller part gets empty micro-batches to match the largest.
        chunks += [[]] * (max(1, -(-most // micro)) - len(chunks))
        return chunks, mine

    def upcoming(self) -> Iterator[list[list[int]]]:
        """The micro-batches of this process in each step after the committed one, the step
        being trained first, as the current membership will train them if nothing changes.
        Nothing is consumed: :class:`maitre.data.Loader` prefetches along it and starts again
        from here when a step asks for other samples (a resize, a dropped step)."""
        rank, world = self.rank, self.world_size  # (read now, not at the first ``next``)
        if rank < 0 or self._join.listening is not None:  # a listener trains no samples
            return iter(())
        size = lambda: self.scaling.global_batch_size(self.sampler.global_batch_size, world)
        steps = itertools.islice(
            self.sampler.upcoming(size), max(0, self._max_steps - self.state.step)
        )  # (none past the end)
        return (self._split(s[slice(*share_bounds(len(s), rank, world))])[0] for s in steps)

    def _finish(self, batch: Batch) -> bool:
        """Reduce, update and commit the step. False when it was dropped for a membership change,
        skipped (an fp16 overflow) or only heard (a listener not caught up yet)."""
        control = self._reduce(batch)
        if control is None:
            return False
        if control.device.type != "cpu":  # read once: every slot read below is a host read
            control = control.cpu()
        lst = self._join.listening
        stop = float(control[Slot.STOP]) > 0
        if lst is not None and not lst.caught_up:  # kept, to be replayed once the state lands
            lst.hear(self._reducer.grads(), control)
            committed = False
        else:
            committed = self._update(batch, control)
            if committed:
                self._judge(batch, control)
                self._commit(batch, control, stop)
        if float(control[Slot.READY]) >= self._join.ready_quorum(self._spanning.nproc if self._spanning else 1):
            self._promote()
        if stop and (committed or lst is not None):  # a skipped step asks again next step
            self._stop_here()
        if float(control[Slot.RESIZE]) > 0:
            self._rendezvous("resize")
        return committed

    def _reduce(self, batch: Batch) -> torch.Tensor | None:
        """Finish the reduction of the step's gradients (buckets launched while backward ran)
        with the control slots; returns the reduced control slots, or None when the step was
        dropped (a membership change: recovered already)."""
        control = self._reducer.control
        rep = self._spanning
        lst = self._join.listening
        counts = self._counts_samples and lst is None  # a shard's tp ranks read the same samples
        if counts and isinstance(batch._loss, torch.Tensor):
            control[Slot.LOSS : Slot.LOSS + 1].copy_(batch._loss.reshape(1))
        else:
            control[Slot.LOSS] = batch._loss if counts else 0.0
        control[Slot.COUNT] = len(batch.indices) - batch._skipped if counts else 0.0
        control[Slot.SKIPPED] = batch._skipped if counts else 0.0
        control[Slot.RESIZE] = 1.0 if self._change_requested() else 0.0
        ckpt = self.checkpointer
        part = self._checkpoint_part if ckpt is not None else None  # None: it writes nothing
        control[Slot.SAVE] = (
            1.0
            if part is not None and (ckpt.due(batch.step) or (ckpt.cfg.save_final and batch.step == self._max_steps))
            else 0.0
        )
        control[Slot.STOP] = 1.0 if self._stop_reason() else 0.0
        # A rank still writing the previous save vetoes a new one (it is asked again next step),
        # so no rank blocks on its writer and every rank makes the same decision. (A listener
        # writes no part: the parts of a save are the training members'.)
        control[Slot.BUSY] = 1.0 if ckpt is not None and ckpt.busy else 0.0
        # The committing rank draws the name of the save's temporary directory; the sum
        # carries it to every rank (exact in float32 below 2**24).
        control[Slot.TOKEN] = float(secrets.randbelow(1 << 24)) if ckpt is not None and self.rank == 0 else 0.0
        control[Slot.NONFINITE] = control[Slot.LOST] = 0.0
        control[Slot.READY] = 1.0 if lst is not None and lst.caught_up else 0.0
        self._time_step(batch, control, counts)
        if self._ledger is not None and counts:
            self._ledger.attempt(self.epoch, batch.step, batch.slice.data_epoch, batch.indices)
        lost: EpochLost | None = None
        try:
            began = time.monotonic()
            self._reducer.finish(self.group)
            self._confirm_epoch(began)
        except EpochLost as exc:
            lost = exc
        if rep is not None:  # position l's totals, summed over the replica: every total
            # (a copy: an abandoned allreduce may still write into the buffers). Every process
            # of the replica drops the step if any lost its epoch, so the replica's shards
            # always hold the same step.
            totals = torch.zeros_like(control) if lost is not None else control.clone()
            totals[Slot.LOST] = 1.0 if lost is not None else 0.0
            if self.scaler is not None and lost is None:  # each process checks its own shards
                totals[Slot.NONFINITE] = 0.0 if all_finite(self._reducer.grads()) else 1.0
            dist.all_reduce(totals, group=rep.group)
            if float(totals[Slot.LOST]) > 0 and lost is None:
                lost = EpochLost("another process of this replica lost the epoch", time.monotonic())
            if lost is None:
                control.copy_(totals)
        if lost is not None:
            # The abandoned allreduce still holds these buffers and may yet finish (a peer that
            # was cut off comes back) and write into them: never hand them to the next epoch.
            self._reducer.renew()
            self._recover(lost)
            return None
        return control

    def _update(self, batch: Batch, control: torch.Tensor) -> bool:
        """The update from the reduced gradients (in the buffers) and control slots: the global
        mean, the step hooks, the optimizer and the schedules. False: an fp16 overflow, the step
        commits nothing. A listener replays queued steps through here too, so it stays exact."""
        self._join.await_snapshots()  # a snapshot being copied still reads the live state
        self._state_written()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        count = int(round(float(control[Slot.COUNT])))
        skipped = int(round(float(control[Slot.SKIPPED])))
        if count + skipped != batch.global_batch_size:
            raise RuntimeError(
                f"step {batch.step}: ranks trained on {count} samples and skipped "
                f"{skipped}, the global batch has {batch.global_batch_size}: "
                "shares are inconsistent"
            )
        if self.scaler is not None and (
            float(control[Slot.NONFINITE]) > 0 if self._spanning is not None else not all_finite(self._reducer.grads())
        ):
            return self._skip(batch, scale)  # the same on every rank: the buffers are one
        if scale != 1.0:  # unscaled apart: 1 / (count * scale) may be subnormal, and inexact
            self._reducer.scale(1.0 / scale)
        # The global mean (float32/64 were divided by the global batch on the way in).
        self._reducer.scatter(max(count, 1), early=batch.global_batch_size)
        if self.hooks.clip_grad_norm is not None:
            batch.grad_norm = self.last_grad_norm = clip(self.params, self.hooks.clip_grad_norm)
        if self.hooks.on_reduced_grads is not None:
            self.hooks.on_reduced_grads(batch)
        if self.scaler is not None:
            self.scaler.update(True)
        factor = self.scaling.lr_factor(self.state.step)
        if factor != 1.0:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * factor
        self.optimizer.step()
        if factor != 1.0:
            for g, lr in zip(self.optimizer.param_groups, saved):
                g["lr"] = lr
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.sampler.advance(batch.slice)
        self.state.step += 1
        self.state.skipped += skipped
        self.last_loss = float(control[Slot.LOSS]) / max(count, 1)
        return True

    def _commit(self, batch: Batch, control: torch.Tensor, stop: bool) -> None:
        """After the update: the ledger's commit, the recovery report, a checkpoint."""
        training = self._join.listening is None
        if self._ledger is not None and self._counts_samples and training:
            self._ledger.commit(self.epoch, batch.step)
        if self._recovery is not None:
            self._report_recovery()
        ckpt = self.checkpointer
        # A rank still writing vetoes a save (it is asked again next step), but the last step's
        # has no next step: it waits for the writer, as a stop's does (every rank sees the same
        # step and the same reduced slots, so every rank decides alike).
        final = ckpt is not None and ckpt.cfg.save_final and batch.step == self._max_steps
        save = float(control[Slot.SAVE]) > 0 and (float(control[Slot.BUSY]) == 0 or final)
        part = self._checkpoint_part if ckpt is not None else None
        if part is not None and (save or stop):  # a stop saves even if it must wait
            ckpt.save(
                self.state.state_dict,
                step=self.state.step,
                rank=part[0],
                world_size=part[1],
                token=int(control[Slot.TOKEN]),
                updated=self._updated_storages(),
            )
        elif part is not None:  # after the first step, when the optimizer state exists
            ckpt.prepare(self.state.state_dict, rank=part[0], world_size=part[1])
        elif ckpt is not None and save:  # another replica writes it
            ckpt.saved_elsewhere(self.state.step)
        self._committed_at = time.monotonic()
        if self._reporter is not None and training:
            self._report_progress(batch)

    def _updated_storages(self) -> frozenset[int] | None:
        """The storages only the update writes (the parameters, the optimizer's state): a save's
        device copy of them may run on through the next step's forward and backward (the loop
        fences the state before it writes it). None on the host: the copy is done at once."""
        if self.device.type != "cuda":
            return None
        return updated_storages(self.model, self.optimizer)

    def _state_written(self) -> None:
        """The live state is about to be written (the update, a state received or loaded): the
        device first finishes reading it for a save (on the device; the host goes on)."""
        if self.checkpointer is not None:
            self.checkpointer.fence(update=True)

    # -- per-rank timing: slow ranks (maitre.runtime.stragglers) --------------------------------
    def _size_slots(self) -> None:
        """One timing slot per member of the new epoch's group (none with policy ``off``); the
        window starts afresh (its steps ran in another group). Every member checks that all laid
        out the same buckets (one tiny collective), before the first step can hang on them."""
        assert self.group is not None
        slots = self._timing.slots(self.group.world_size)
        if slots != self._reducer.slots:
            self._reducer.renew(slots)
        agree(self.group, self._reducer.digest())
        self._timing.window.restart()

    def _time_step(self, batch: Batch, control: torch.Tensor, counts: bool) -> None:
        """This rank arrived at the step's first collective (:meth:`StepTiming.end`)."""
        self._timing.end(
            control,
            step=batch.step,
            work=(batch._tokens or len(batch.indices)) if counts else 0,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            group=None if self.group is None else (self.group.rank, self.group.world_size),
            trains=self._join.listening is None,
        )

    def _judge(self, batch: Batch, control: torch.Tensor) -> None:
        """At a window's last step, rank 0 (the first process of its replica) runs the detector
        on every member's slot; each verdict goes out as a ``straggler`` report."""
        det = self._timing.detector
        if det is None or self.rank != 0 or self.env.proc:
            return
        verdicts, named = self._timing.judge(control, batch.step, self._members)
        for verdict in verdicts:
            t = det.t
            report = {**verdict.report(t), "epoch": self.epoch, "world_size": self.world_size}
            if self._reporter is not None and named:
                self._reporter.send(report)  # the coordinator's event: its one line
                continue
            print(
                f"maitre: straggler: {verdict.key} (rank {verdict.rank}) computes "
                f"{verdict.ratio:.2f}x the median since step {verdict.since_step} "
                f"({verdict.windows} windows of {t.window} steps)",
                file=sys.stderr,
                flush=True,
            )

    def _report_progress(self, batch: Batch) -> None:
        """Rank 0 (the first process of its replica) counts its commits; about once a second
        the count goes out, posted in the background (dropped if a post is still in flight)."""
        if self.rank != 0 or self.env.proc:
            self._meter.reset()
            return
        report = self._meter.committed(
            self._committed_at,
            self.state.step,
            batch.global_batch_size,
            self.last_loss if batch._logged else None,
            self.world_size,
            self.state.skipped,
        )
        if report is not None:
            assert self._reporter is not None
            self._reporter.offer(report)

    def _report_checkpoint(self, result: SaveResult) -> None:
        """A finished save: the committing rank tells the coordinator (``checkpoint``)."""
        if result.committer and self._reporter is not None:
            self._reporter.send(telemetry.checkpoint_report(result))

    def _skip(self, batch: Batch, scale: float) -> bool:
        """An overflow in the reduced fp16 gradients: the step commits nothing and is trained
        again (the same samples) at a lower loss scale. A membership change is met after it; a
        stop or a save is asked again by the step trained next."""
        assert self.scaler is not None
        self.scaler.update(False)
        if self._ledger is not None and self._counts_samples and self._join.listening is None:
            self._ledger.skipped(self.epoch, batch.step)
        if self.rank == 0:
            print(
                f"maitre: step {batch.step} overflowed at loss scale {scale:g}; training it "
                f"again at {self.scaler.scale:g}",
                file=sys.stderr,
                flush=True,
            )
        return False

    # -- listening: a member behind catches up while the others train (MAITRE_JOIN=stream) ------
    def _listen(self) -> None:
        """One step as a listener: catch up as far as the time allows (load the snapshot once
        it has landed, replay queued steps), then take part in the step's allreduce with no
        samples. The training members' step goes on meanwhile; a listener that is caught up
        applies each step as it comes and says so, and all are promoted together."""
        lst = self._join.listening
        assert lst is not None
        self._reducer.begin(0, None)
        heard = time.monotonic()
        try:
            self._catch_up(lst)
        except EpochLost as lost:
            self._recover(lost)
            return
        batch = self._listener_batch()
        if self._spanning is not None:
            batch.mine = []  # (no samples of its own)
        self._finish(batch)
        if self._join.listening is lst:
            lst.interval = time.monotonic() - heard
            if not lst.caught_up and lst.heard_upto(self.state.step) >= self._max_steps:
                self._leave_unfinished()

    def _leave_unfinished(self) -> None:
        """The training members committed the last step while this listener's state still
        streamed in: the job is done and this worker holds none of it. It leaves (its script
        never sees the end of a training it did not do), so that the job completes instead of
        waiting for it, or training again from its checkpoint with it as the only member."""
        recovery.leave(
            self._link if not self.env.proc else None,  # (the first process speaks)
            f"maitre: {self.env.worker_id}: the job finished at step "
            f"{self._max_steps} while this worker's state streamed in; it leaves",
        )

    def _catch_up(self, lst: Listening) -> None:
        if not lst.loaded:
            landed = lst.landed()
            if self._spanning is not None:  # the replica's processes load and replay together
                landed = self._replica_agrees(landed)
            if not landed:
                return
            meta, flats = lst.take()
            self._state_written()
            self.state.load_state_dict(transfer_unpack(meta, flats, self._mesh_of()))
            if self.state.step != lst.snapshot_step:
                raise RuntimeError(
                    f"the snapshot holds step {self.state.step}, not "
                    f"{lst.snapshot_step}: its source and this epoch disagree"
                )
            lst.loaded = True
        # Replayed while the training members run their forward and backward: half of a step.
        deadline = time.monotonic() + 0.5 * lst.interval
        while lst.queue:
            grads, control = lst.queue.popleft()
            for buf, g in zip(self._reducer.grads(), grads):
                buf.copy_(g)
            self._update(self._listener_batch(), control)
            lst.replayed += 1
            more = bool(lst.queue) and time.monotonic() < deadline
            if self._spanning is not None:
                more = self._replica_agrees(more)
            if not more:
                break
        self._reducer.clear()  # (its part in the next reduction: zeros)

    def _listener_batch(self) -> Batch:
        """The next step as the training members take it (its global slice), with no share of
        this listener's own: what its replayed and heard steps commit."""
        size = self.scaling.global_batch_size(self.sampler.global_batch_size, self.world_size)
        return Batch(self.state.step + 1, -1, self.world_size, self.sampler.next_slice(0, self.world_size, size), [])

    def _promote(self) -> None:
        """Every listener is caught up: from the next step all members train, on the epoch's
        group as it is (no rebuild)."""
        assert self.group is not None
        self.rank, lst = self._join.promote(self.group.rank)
        self.world_size = self.group.world_size
        self.scaling.on_resize(self.world_size, self.state.step)
        if lst is not None and self._reporter is not None and not self.env.proc:
            # Sent in the background: its peers wait in the next step for this rank (a post
            # here cost a round trip to the coordinator on every member's path).
            self._reporter.send(lst.caught_up_report(self.epoch, self.rank, self.world_size, self.state.step))

    def _confirm_epoch(self, began: float) -> None:
        """A step whose collectives kept this rank waiting past its stall threshold (they began
        at ``began``) commits only once the coordinator, asked after they completed, has not
        given up its epoch; else it is dropped (:class:`EpochLost`).

        A collective completes on a rank once every member has contributed, even if some have
        abandoned it since: their work goes on in the background (see :meth:`_finish`). A rank
        cut off from its peers and from the coordinator is declared hung and removed, its peers
        drop the step and redo it in the next epoch; when the link comes back, the abandoned
        collective completes on the cut-off rank, which committed the step into the ledger a
        second time (found by the link-cut test of tests/test_multihost.py). Its view could not
        tell it: its agent was cut off as well. An epoch is given up under a collective when
        its members wait in it for a member that is silent (hung, cut off, its node dead), so a
        rank that never waited past its stall threshold commits at once, as before."""
        hb = self._heartbeat
        if hb is None or self.group is None:
            return
        done = time.monotonic()
        if done - began <= self._stall_after():
            return
        self._confirming = True  # reported as stalled, so that its agent beats now and often
        try:
            recovery.await_word(lambda: hb.view, self.epoch, done, self.env.coordinator_timeout_s, self.state.step)
        finally:
            self._confirming = False

    def _view(self) -> CoordinatorView | None:
        """The coordinator's last word on this worker (None: no coordinator)."""
        return self._heartbeat.view if self._heartbeat is not None else None

    def _stop_reason(self) -> str | None:
        """Why the job must stop after this step with a checkpoint: SIGTERM (under torchrun or
        alone) or the coordinator suspending the job."""
        if self._sigterm.heard:
            return self._sigterm.heard
        hb = self._heartbeat
        if hb is not None and hb.view.suspend and hb.view.member_epoch == self.epoch:
            return "the job is suspended"
        return None

    def _stop_here(self) -> None:
        """Every rank saved this step; wait until the checkpoint is durable, then exit."""
        reason = self._stop_reason() or "stop requested by a peer"
        saved = None
        if self.checkpointer is not None:
            results = self.checkpointer.wait()
            saved = next((r.path for r in results if r.path is not None), None)
            failed = next((r.error for r in results if r.error), None)
            if failed:
                reason += f"; the checkpoint failed: {failed}"
        if self.rank == 0:
            where = f"checkpoint {saved}" if saved else "no checkpoint written by this rank"
            print(f"maitre: stopped at step {self.state.step} ({reason}); {where}", file=sys.stderr, flush=True)
        if self.env.mode == Mode.ELASTIC and self._link is not None:
            try:
                if not self.env.proc:  # the first process speaks for its replica
                    self._link.done(self.state.step, suspended=True)
            except (CoordinatorUnreachable, ApiError) as exc:
                print(f"maitre: could not report the suspension: {exc}", file=sys.stderr)
            raise Ended("suspended")
        raise Ended("SIGTERM" if self._sigterm.heard else "suspended")

    def _change_requested(self) -> bool:
        hb = self._heartbeat
        if hb is None:
            return False
        view = hb.view  # replies from before this epoch opened are stale news
        return view.member_epoch == self.epoch and (view.change or view.leave)

    # -- membership ------------------------------------------------------------------------------
    def _start(self) -> None:
        if self.env.mode != Mode.ELASTIC and self.checkpointer is not None:
            self._sigterm.catch()
        elif self.env.mode == Mode.ELASTIC and os.environ.get(protocol.SIGTERM_DRAINS):
            self._sigterm.let_pass(self.env.worker_id)
        if self.env.mode == Mode.SINGLE:
            self._resume_from_disk()
            return
        if self.env.mode == Mode.STATIC:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if not dist.is_initialized():
                dist.init_process_group(backend)
                self._owns_default_group = True
            rep = self.replica
            if rep is not None and rep.cross is not None:  # replicas of a mesh each
                self.rank, self.world_size = rep.replica_rank, rep.replicas
                self.group = EpochGroup(rep.cross, rep.replica_rank, rep.replicas, self.device)
            else:
                self.group = EpochGroup(dist.group.WORLD, self.env.rank, self.env.world_size, self.device)
            self._size_slots()
            self._sync_state(Recovery("start", time.time()))
            return
        if self._link is None:
            self._link = HttpLink(self.env)
        self._reporter = telemetry.Reporter(
            self._link.report, on_error=lambda line: print(line, file=sys.stderr, flush=True)
        )
        if self.checkpointer is not None:
            self.checkpointer.on_result = self._report_checkpoint
        self._heartbeat = Heartbeat(
            self._link.beat, self.env.worker_id, self.env.heartbeat_s, self._progress, proc=self.env.proc
        ).start()
        self._recovery = Recovery("join", time.time())
        self._rendezvous("join", from_epoch=0)

    def _progress(self) -> tuple[int, bool, float]:
        group = self.group  # waiting in a collective, or for the members of a new group
        since = group.waiting_since if group is not None else self._building_since
        stalled = since is not None and time.monotonic() - since > self._stall_after()
        return self.state.step, stalled or self._confirming, self._trained_s

    def _stall_after(self) -> float:
        """How long a collective may wait before this worker calls itself stalled."""
        if len(self._step_times) < 3:
            return 2.0
        return max(_STALL_FLOOR_S, _STALL_STEPS * statistics.median(self._step_times))

    def _epoch_closed(self) -> str | None:
        return recovery.epoch_closed(self._view(), self.epoch)

    def _recover(self, lost: EpochLost) -> None:
        if self.env.mode != Mode.ELASTIC:
            raise RuntimeError(f"collective failed outside maitre: {lost.reason}") from lost
        self._recovery = Recovery(lost.reason, time.time() - (time.monotonic() - lost.detected_at))
        if self.checkpointer is not None:  # a peer lost mid-save never sends its part
            self.checkpointer.abandon(f"the epoch was lost under the save: {lost.reason}")
        self._rendezvous(lost.reason, unbuilt=lost)

    def _rendezvous(self, reason: str, from_epoch: int | None = None, unbuilt: EpochLost | None = None) -> None:
        """Leave the current epoch and enter the next one (or leave the job)."""
        assert self._link is not None
        if self._recovery is None:
            self._recovery = Recovery(reason, time.time())
        if self.group is not None:
            self.group.retire()
            self.group = None
        self._join.reset()  # a new epoch decides again
        answer = recovery.rendezvous(
            self._link,
            from_epoch=self.epoch if from_epoch is None else from_epoch,
            step=self.state.step,
            reason=reason,
            lost=unbuilt,
            timeout_s=self.env.coordinator_timeout_s,
            speaks=not self.env.proc,  # (the first process speaks for its replica)
        )
        if self._store is None or answer.store_id != self._store_id:
            # First epoch, or the coordinator restarted since the last one: the run's c10d
            # store is a new server (behind the same door), so connect again.
            self._connect_store(answer)
        rec = self._recovery
        rec.assigned_at = time.time()
        assert answer.epoch is not None and answer.rank is not None and answer.world_size is not None
        assert answer.store_prefix is not None  # (a train answer has them all: Assignment checks)
        self.epoch, self.rank, self.world_size = answer.epoch, answer.rank, answer.world_size
        self._state_lost = bool(answer.state_lost)
        self._building_since = time.monotonic()
        try:
            # A replica of several processes: one group per position, over the replicas.
            prefix = answer.store_prefix + (f"x{self.env.proc}/" if self.env.nproc > 1 else "")
            self._prefix = prefix
            self.group = EpochGroup.create(
                self._store, prefix, self.rank, self.world_size, self.device, self._epoch_closed
            )
            self._members = list(answer.members or [])
            self._size_slots()
            self._building_since = None
            rec.group_at = time.time()
            self._sync_state(rec)
            lost: EpochLost | None = None
        except EpochLost as exc:  # a peer failed while the group formed: go round again
            lost = exc
        self._building_since = None
        if self._spanning is not None:  # every process of the replica in this epoch, or none
            why = replicas.same_epoch(lost is None, self.epoch, self._replica_max)
            if why is not None and lost is None:
                lost = EpochLost(why, time.monotonic())
        if lost is not None:
            self._recover(lost)
            return
        rec.synced_at = time.time()
        if self._join.listening is not None:  # it reports nothing until it trains
            self._recovery = None

    def _replica_agrees(self, ok: bool) -> bool:
        """Whether every process of this replica is ``ok`` (one tiny allreduce inside it): they
        go on, or go round again, together, so their collectives stay in step."""
        flag = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
        self._replica_max(flag)
        return float(flag) == 0.0

    def _replica_max(self, flag: torch.Tensor) -> None:
        """An allreduce (max) of a tiny host tensor inside this replica (on the device its
        backend needs)."""
        assert self._spanning is not None
        there = flag.to(self.device)
        dist.all_reduce(there, op=dist.ReduceOp.MAX, group=self._spanning.group)
        flag.copy_(there.cpu())

    def _connect_store(self, answer: protocol.Assignment) -> None:
        """The run's c10d store, from the link (through its door, for an :class:`HttpLink`)."""
        assert self._link is not None
        self._store = None
        try:
            self._store = self._link.store(answer)
        except StoreLinkError as exc:
            raise WorkerStopped(str(exc)) from None
        self._store_id = answer.store_id

    def _resume_from_disk(self) -> bool:
        """Load the newest complete checkpoint, if any; True if one was loaded."""
        if self.checkpointer is None or not self.checkpointer.cfg.resume:
            return False
        started = time.monotonic()
        rep, replica = self._spanning, self.replica
        # Sharded tensors are cut for this process's mesh; the processes of a replica read
        # different shards, so they agree on which checkpoint they all could load.
        loaded = self.checkpointer.load_latest(
            self.rank if rep is None else self.rank * rep.nproc + rep.local_rank,
            mesh_of=None if replica is None else (lambda names: replica.mesh[names]),
            agree=None if rep is None else self._replica_agrees,
        )
        if loaded is None:
            return False
        self._state_written()
        try:
            self.state.load_state_dict(loaded.tree)
        except (ValueError, KeyError, RuntimeError) as exc:  # another script's, model's or data's
            raise RuntimeError(
                f"cannot resume from {loaded.path}: it does not fit this script's state: {exc}"
            ) from None
        if self._ledger is not None:
            self._ledger.resumed(loaded.step)
        if self.rank == 0 and (rep is None or rep.local_rank == 0):
            print(
                f"maitre: resumed from {loaded.path} at step {loaded.step} (saved by "
                f"{loaded.world_size} worker(s), {loaded.nbytes / 1e6:.1f} MB)",
                flush=True,
            )
            if self._reporter is not None:
                self._reporter.send(telemetry.restore_report(loaded, time.monotonic() - started))
        return True

    def _sync_state(self, rec: Recovery) -> None:
        assert self.group is not None
        steps = sync_steps(self.group, self.state.step)
        rec.state_source = "peer" if max(steps) > 0 else "none"
        if max(steps) == 0:
            # Nobody has live state (the job starts, or restarts whole): every member reads the
            # newest complete checkpoint, if any; the second count repairs any disagreement.
            if self.checkpointer is not None:
                if self._resume_from_disk():
                    rec.state_source = "disk"
                steps = sync_steps(self.group, self.state.step)
                if rec.state_source == "none" and max(steps) > 0:
                    rec.state_source = "peer"  # another member loaded it: it comes from there
            if max(steps) == 0 and self._state_lost and self._ledger is not None:
                # Back to the initial state: what the lost workers committed is undone.
                self._ledger.resumed(0)
        ahead = max(steps)
        behind = [r for r, s in enumerate(steps) if s != ahead]
        if behind and self.env.join == "stream" and self._store is not None:
            self._stream_state(steps, ahead, rec)
            return
        if behind:  # the members at the highest step keep their own state (and RNG streams)
            src = steps.index(ahead)
            tree = self.state.state_dict() if self.group.rank == src else None
            received, rec.state_bytes = broadcast_state(self.group, tree, src, self._mesh_of())
            rec.state_from = src
            if self.state.step < ahead:
                self._state_written()
                self.state.load_state_dict(received)
        if self.env.mode == Mode.ELASTIC:  # (a torchrun group never resizes)
            self.scaling.on_resize(self.world_size, self.state.step)

    def _stream_state(self, steps: list[int], ahead: int, rec: Recovery) -> None:
        """The members behind listen, the others train on at once (:mod:`maitre.runtime.streamjoin`):
        until every listener is caught up the data shares are the training members'."""
        assert self.group is not None and self._store is not None
        join = self._join
        training = join.plan(steps, ahead)
        me, epoch = self.group.rank, self.epoch
        self.world_size = len(training)
        pair = lambda listener: f"{self._prefix}join/{listener}/"
        abandon = lambda: None if self.epoch == epoch and self.group is not None else "the epoch is over"
        source = join.source_of(me, training)
        if source is not None:
            self.rank = -1
            join.listening = Listening(Receiver(self._store, pair(me), self.device, abandon), snapshot_step=ahead)
            rec.state_from = source
            return
        self.rank = training.index(me)
        self.scaling.on_resize(self.world_size, self.state.step)  # before the snapshot: its state
        mine = [pair(listener) for listener in join.listeners_of(me, training)]
        if mine:
            packed = Packed.of(self.state.state_dict(), self.device, lazy=updated_storages(self.model, self.optimizer))
            rec.state_bytes, rec.state_from = packed.nbytes, me
            join.senders.append(Sender(self._store, mine, packed, self.device, abandon))

    def _mesh_of(self) -> Any:
        """Where received sharded tensors live: this replica's mesh (by dimension names)."""
        if self.replica is None:
            return None
        mesh = self.replica.mesh
        return lambda names: mesh[names]

    def _report_recovery(self) -> None:
        rec, self._recovery = self._recovery, None
        if rec is None or self._reporter is None or self.env.proc:  # the first process speaks
            return
        report = rec.report(
            epoch=self.epoch, rank=self.rank, world_size=self.world_size, step=self.state.step, now=time.time()
        )
        self._reporter.send(report)  # in the background: not on the first step's path

    def _done(self) -> None:
        if self.checkpointer is not None:  # the final checkpoint is durable before "done"
            for result in self.checkpointer.wait():
                if result.path is not None and result.step == self._max_steps:
                    print(f"maitre: final checkpoint {result.path}", flush=True)
        if self._owns_default_group:  # left to the interpreter's exit, gloo can abort the process
            dist.destroy_process_group()
            self.group = None
        if self._reporter is not None:  # the last checkpoint's report before "done"
            self._reporter.flush()
        if self._link is not None and not self.env.proc:  # the first process speaks
            try:
                self._link.done(self.state.step)
            except (CoordinatorUnreachable, ApiError) as exc:
                print(f"maitre: could not report completion: {exc}", file=sys.stderr)
