"""The loop users already write, on the elastic engine: :func:`prepare`.

A training script that keeps its own loop hands maitre its model, optimizer and data once, and
gets them back ready for an elastic job::

    model, optimizer, loader = maitre.prepare(model, optimizer, dataset, global_batch_size=64, max_steps=1000)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if loader.completed:                  # every step committed: this is the final model
        torch.save(model.state_dict(), "final.pt")

Underneath is the one engine, :class:`~maitre.runtime.loop.ElasticLoop`: nothing of the step,
the reduction or the recovery is implemented twice. The three objects only turn the loop's
generator, where a plain loop's calls fall:

- **The loader** (:class:`PreparedLoader`) starts the loop on ``iter()`` and hands out the
  collated micro-batches of each step (a :class:`maitre.data.Loader`: worker processes,
  prefetch, exactly once), ``micro_batch_size`` samples at most each, from the samples the loop
  gave this rank: its share of the global batch, whatever the world size.
- **The model** is the caller's own module, unwrapped (its ``state_dict`` keys do not change).
  A loss that is a *mean* over the micro-batch's ``m`` samples (``loss="mean"``, as
  ``F.cross_entropy`` and ``F.mse_loss`` are by default) must count as their *sum*, which is
  what the loop's reduction divides by the global sample count: the step's gradients are
  multiplied by ``m`` as they are copied into the reduction's buckets (no pass of its own), and
  a micro-batch of another size than the step's first (the short last one of a share) has its
  backward pass's gradients scaled by the ratio, by a hook on each parameter, before they
  accumulate. The update is the mean over the global batch at any world size, as a fixed-size
  run's; a term of the loss that does not depend on the samples (a penalty on the parameters)
  counts once per step, as in the fixed-size run. ``loss="sum"``: nothing is scaled.
- **The optimizer** (:class:`PreparedOptimizer`) is a proxy: ``step()`` after a step's last
  micro-batch finishes the step in the loop (the reduction the backward passes started, the
  update, the commit, a checkpoint when one is due, a resize when one is asked for) and loads
  the next step's first micro-batch; after an earlier micro-batch it does nothing (gradient
  accumulation, as DDP's ``no_sync``). ``zero_grad()`` does nothing while a step is open: the
  loop clears the gradients when a step begins.

A step dropped for a membership change (a peer lost while its gradients were reduced) is trained
again from the same samples, transparently: ``optimizer.step()`` returns, the parameters have not
changed, and the loader hands out the step's data again. :attr:`PreparedLoader.step` counts the
committed steps. The loop's learning-rate scheduler is stepped once per committed step: pass it
as ``lr_scheduler=`` and never call its ``step()`` (a dropped step must not move it; a joiner
receives its state with the rest).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from maitre.data.loader import Loader
from maitre.runtime.loop import Batch, ElasticLoop
from maitre.runtime.sampler import ElasticSampler

LOSSES = ("mean", "sum")


class Prepared(NamedTuple):
    """What :func:`prepare` hands back: unpack it as ``model, optimizer, loader``."""

    model: torch.nn.Module
    optimizer: "PreparedOptimizer"
    loader: "PreparedLoader"


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Dataset | DataLoader,
    *,
    global_batch_size: int,
    max_steps: int,
    seed: int = 0,
    shuffle: bool = True,
    loss: str = "mean",
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    prefetch_factor: int | None = None,
    on_error: str = "raise",
    **loop_options: Any,
) -> Prepared:
    """``model``, ``optimizer`` and ``data`` ready for a plain training loop on the elastic
    engine (see the module docstring).

    Args:
        model, optimizer: the script's own; the optimizer over the model's parameters.
        data: a map-style dataset (``__getitem__`` and ``__len__``: a Hugging Face
            ``datasets.Dataset`` too), or a ``DataLoader`` over one, whose ``collate_fn``,
            ``num_workers``, ``pin_memory`` and ``prefetch_factor`` are kept, and whose batch
            size becomes the ``micro_batch_size`` unless that is given (its sampler is not
            kept: the loop decides which samples each rank trains).
        global_batch_size: samples per optimizer step over all ranks, the same at any world
            size (a scaling rule, ``scaling=``, may change it with the world size).
        max_steps: optimizer steps in the whole job.
        seed, shuffle: the global order of the samples (:class:`ElasticSampler`).
        loss: ``"mean"``: the script's loss is a mean over its micro-batch's samples;
            ``"sum"``: a sum.
        num_workers, pin_memory, collate_fn, prefetch_factor, on_error: the data loader's
            (:class:`maitre.data.Loader`); given here, they win over a DataLoader's.
        loop_options: the loop's own (:class:`ElasticLoop`): ``micro_batch_size``,
            ``lr_scheduler``, ``checkpoint``, ``precision``, ``clip_grad_norm``, ``scaling``,
            ``extras``, ``buckets``, ...
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("pass the module itself, not DistributedDataParallel: maitre reduces the gradients")
    if isinstance(optimizer, PreparedOptimizer):
        raise TypeError("this optimizer was prepared already")
    if max_steps < 1:
        raise ValueError(f"max_steps must be 1 or more, got {max_steps}")
    if loop_options.get("precision") == "fp16":
        raise ValueError(
            "prepare() takes precision='bf16' or None: fp16's loss scale goes on the loss, which a plain "
            "loop's loss.backward() keeps to itself (ElasticLoop's batch.backward(loss) applies it)"
        )
    options: dict[str, Any] = {}
    if isinstance(data, DataLoader):
        options = {
            "num_workers": data.num_workers,
            "pin_memory": data.pin_memory,
            "collate_fn": data.collate_fn,
            "prefetch_factor": data.prefetch_factor if data.num_workers else None,
            "worker_init_fn": data.worker_init_fn,
            "multiprocessing_context": data.multiprocessing_context,
        }
        if data.batch_size is not None:  # the batch its forward pass sees: the micro-batch
            loop_options.setdefault("micro_batch_size", data.batch_size)
        data = data.dataset
    if isinstance(data, IterableDataset) or not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise TypeError(
            f"{type(data).__name__} is not a map-style dataset (__getitem__ and __len__): the loop "
            "names each step's samples by index (for token or Parquet shards: maitre.data)"
        )
    given = {"num_workers": num_workers, "pin_memory": pin_memory, "collate_fn": collate_fn}
    options.update({k: v for k, v in given.items() if v is not None})
    if prefetch_factor is not None:
        options["prefetch_factor"] = prefetch_factor
    sampler = ElasticSampler.of(data, global_batch_size, seed=seed, shuffle=shuffle)
    loop = ElasticLoop(model, optimizer, sampler, **loop_options)
    if loop.replica is not None and loop.replica.nproc > 1:
        raise ValueError(
            "prepare() runs replicas of one process each; a replica that spans processes (FSDP2, "
            "tensor parallel) gets its sharded gradients from FSDP2's reduce-scatter, past the hooks "
            "that scale a mean loss: train it with ElasticLoop"
        )
    loader = PreparedLoader(loop, Loader(data, loop, on_error=on_error, **options), max_steps, loss)
    return Prepared(model, PreparedOptimizer(optimizer, loader), loader)


class PreparedLoader:
    """The data of a prepared job, one collated micro-batch per item, and the engine's handle:
    iterating it runs the loop (:attr:`loop`) to the end of the job or of this worker's part in
    it (:attr:`ended`). Iterate it once."""

    def __init__(self, loop: ElasticLoop, data: Loader, max_steps: int, loss: str) -> None:
        self.loop, self.data, self.max_steps = loop, data, max_steps
        self._mean = loss == "mean"
        self._gen: Iterator[Batch] | None = None
        self._batch: Batch | None = None
        """The step being trained (None before the first and once the loop has ended)."""
        self._pieces: Iterator[tuple[int, Any]] = iter(())
        self._ahead: tuple[int, Any] | None = None
        """The next micro-batch of the step (samples, data), loaded ahead: None once the last
        was handed out, so ``optimizer.step()`` knows whether it ends the step."""
        self._samples = 0
        """Samples in the micro-batch handed out last (what a mean loss is over)."""
        self._given = 0
        """Micro-batches of the current step handed out."""
        self._open = False
        """The step's last micro-batch was handed out: ``optimizer.step()`` must come next."""
        self._first = 0
        """Samples in the step's first micro-batch: what its gradients are multiplied by."""
        self._factor = 1.0
        """What each gradient of the current backward pass is scaled by before it accumulates
        (1: nothing; a micro-batch of another size than the first: the ratio)."""
        self._hooks = [p.register_hook(self._scale) for p in loop.params] if self._mean else []
        """(a sum is never scaled: no hook to call on every gradient)"""

    # -- what a script reads ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Committed steps so far (a dropped step, trained again, is counted once)."""
        return self.loop.step

    @property
    def batch(self) -> Batch | None:
        """The loop's view of the step being trained (its rank, world size and indices)."""
        return self._batch

    @property
    def ended(self) -> str | None:
        """Why the loop ended (:attr:`ElasticLoop.ended`); None while it runs."""
        return self.loop.ended

    @property
    def completed(self) -> bool:
        """Every step committed: the model is the job's final one."""
        return self.loop.completed

    def log_loss(self, loss: torch.Tensor | float) -> None:
        """Record the loss of the micro-batch handed out last (a mean or a sum, as ``loss=``
        said): ``loop.last_loss`` is then the global batch's mean loss, the same at any world
        size. Optional: nothing else depends on it."""
        if self._batch is None:
            raise RuntimeError("log_loss() outside a step: iterate the prepared loader first")
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        self._batch.log_loss(loss * self._samples if self._mean else loss)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` in the loop's ``precision`` (nothing without one)."""
        return self._batch.autocast() if self._batch is not None else contextlib.nullcontext()

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> "PreparedLoader":
        if self._gen is not None:
            raise RuntimeError("a prepared loader is iterated once: it runs the whole job (max_steps steps)")
        self._gen = self.loop.run(self.max_steps)
        self._advance()
        return self

    def __next__(self) -> Any:
        if self._gen is None:
            raise RuntimeError("iterate the prepared loader (for batch in loader: ...)")
        while True:
            if self._open:
                raise RuntimeError(
                    f"step {self._batch.step if self._batch else '?'}: the next batch was asked for before "
                    "optimizer.step(): call it once after each batch's backward (for gradient accumulation, "
                    "pass micro_batch_size= to prepare)"
                )
            if self._batch is None:
                raise StopIteration
            if self._ahead is None:  # no samples for this rank in this step: it only reduces
                self._advance()
                continue
            (self._samples, data), self._ahead = self._ahead, next(self._pieces, None)
            self._factor = self._samples / self._first if self._mean else 1.0
            self._given += 1
            self._open = self._ahead is None
            return data

    def close(self) -> None:
        """Stop the loop where it is (a script that breaks out of its loop early) and the data
        workers; the model's hook is removed."""
        if self._gen is not None:
            self._gen.close()  # type: ignore[attr-defined]
        self._batch, self._ahead, self._open = None, None, False
        self._unhook()

    def __enter__(self) -> "PreparedLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the engine's turns ----------------------------------------------------------------------
    def _advance(self) -> None:
        """Turn the loop to its next step: it finishes the current one first (reduce, update,
        commit; or drop it), then begins the next and its first micro-batch is loaded."""
        assert self._gen is not None
        self._open, self._given, self._factor = False, 0, 1.0
        self._batch = next(self._gen, None)
        if self._batch is None:  # the loop ended: completed, or this worker's part is over
            self._ahead = None
            self._unhook()
            return
        self._pieces = self._micro_batches(self._batch)
        self._ahead = next(self._pieces, None)
        if self._ahead is not None and self._mean:
            self._first = self._ahead[0]
            self.loop.multiply_gradients(float(self._first))

    def _micro_batches(self, batch: Batch) -> Iterator[tuple[int, Any]]:
        """(samples, data) of each micro-batch of ``batch`` that has any (records the data set
        failed to load, with ``on_error="skip"``, are left out of the count)."""
        skipped = batch._skipped
        for indices, data in zip(batch.micro_batches, self.data(batch)):
            if data is not None:
                yield len(indices) - (batch._skipped - skipped), data
            skipped = batch._skipped

    def _optimizer_step(self) -> None:
        if self._open:
            self._advance()
        elif self._batch is None or self._given == 0:
            raise RuntimeError("optimizer.step() with no batch trained since the last one")
        # else: an earlier micro-batch of the step: its gradients accumulate

    def _scale(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A parameter's gradient from the current backward pass, before it is accumulated:
        scaled where its micro-batch's size differs from the step's first (whose size the
        reduction multiplies every gradient by)."""
        return None if self._factor == 1.0 else grad * self._factor

    def _unhook(self) -> None:
        self.data.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class PreparedOptimizer:
    """The script's optimizer, whose ``step()`` and ``zero_grad()`` are the loop's turns (see
    the module docstring); everything else (``param_groups``, ``state_dict()``, ...) is the
    optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, loader: PreparedLoader) -> None:
        self.optimizer = optimizer
        self._loader = loader

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise TypeError("a prepared optimizer's step() takes no closure (the loop evaluates nothing again)")
        self._loader._optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._loader._batch is None:  # outside the job's steps: the optimizer's own
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"
