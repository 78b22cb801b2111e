"""The step hooks (:mod:`maitre.runtime.hooks`): the loss scaler's rule, what bad settings get, and
the loop alone against a hand-written step on the global batch: clipping by the global norm, a
callback on the reduced gradients, fp16 steps that overflow and commit nothing. The same hooks
under crashes, joins and leaves are in test_elastic_processes.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from maitre import ElasticLoop, ElasticSampler, LossScaler
from maitre.runtime.env import WorkerEnv
from maitre.runtime.ledger import audit

pytestmark = pytest.mark.timeout(60)
N, BATCH, MICRO = 48, 12, 4


def test_the_scaler_backs_off_on_an_overflow_and_grows_after_a_run_of_good_steps() -> None:
    s = LossScaler(init_scale=8.0, growth_interval=3)
    s.update(True)
    s.update(True)
    assert (s.scale, s.good_steps) == (8.0, 2)
    s.update(False)
    assert (s.scale, s.good_steps, s.skipped) == (4.0, 0, 1)
    for _ in range(3):
        s.update(True)
    assert (s.scale, s.good_steps) == (8.0, 0)
    again = LossScaler()
    again.load_state_dict(json.loads(json.dumps(s.state_dict())))  # plain JSON values
    assert (again.scale, again.good_steps, again.skipped) == (8.0, 0, 1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
    ],
)
def test_bad_scaler_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LossScaler(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"precision": "fp8"}, "precision must be one of bf16, fp16"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm must be a positive number"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm must be a positive number"),
        ({"on_reduced_grads": 3}, "on_reduced_grads must be callable"),
        ({"loss_scaler": LossScaler()}, "a loss_scaler is for precision='fp16'"),
    ],
)
def test_bad_hook_settings_are_refused_before_anything_runs(kwargs, message) -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=message):
        ElasticLoop(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            ElasticSampler(N, BATCH),
            env=WorkerEnv.from_environ({}),
            **kwargs,
        )


def data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=g, dtype=dtype), torch.randn(N, 1, generator=g, dtype=dtype)


def make(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x).float(), y.float(), reduction="sum")


def reference(
    steps: int,
    dtype: torch.dtype,
    *,
    clip: float | None = None,
    halve: bool = False,
    scale: float | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[dict, int]:
    """The recipe written by hand on one process: the same global batches and micro-batches;
    the mean gradient, unscaled, clipped to the global norm, optionally halved; an overflow
    skips the step and trains the same batch again at half the scale."""
    model, opt = make(dtype)
    x, y = data(dtype)
    sampler = ElasticSampler(N, BATCH)
    skipped = 0
    step = 0
    while step < steps:
        slc = sampler.next_slice(0, 1, BATCH)
        idx = slc.local_indices
        opt.zero_grad(set_to_none=False)
        for i in range(0, len(idx), MICRO):
            part = idx[i : i + MICRO]
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                out = model(x[part])
            loss = torch.nn.functional.mse_loss(out.float(), y[part].float(), reduction="sum")
            (loss * scale if scale else loss).backward()
        grads = [p.grad for p in model.parameters()]
        if scale and not all(bool(torch.isfinite(g).all()) for g in grads):
            scale *= 0.5
            skipped += 1
            continue
        for g in grads:
            if scale:
                g.mul_(1.0 / scale)
            g.mul_(1.0 / len(idx))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if halve:
            for g in grads:
                g.mul_(0.5)
        opt.step()
        sampler.advance(slc)
        step += 1
    return copy.deepcopy(model.state_dict()), skipped


def train(steps: int, dtype: torch.dtype, **hooks) -> tuple[dict, ElasticLoop]:
    model, opt = make(dtype)
    x, y = data(dtype)
    loop = ElasticLoop(
        model, opt, ElasticSampler(N, BATCH), micro_batch_size=MICRO, env=WorkerEnv.from_environ(), **hooks
    )
    for batch in loop.run(max_steps=steps):
        for idx in batch.micro_batches:
            with batch.autocast():
                out = model(x[idx])
            batch.backward(torch.nn.functional.mse_loss(out.float(), y[idx].float(), reduction="sum"))
    return copy.deepcopy(model.state_dict()), loop


def close(a: dict, b: dict, tol: float) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in a)


def test_clipping_is_by_the_norm_of_the_global_mean_gradient() -> None:
    norms: list[float] = []
    got, _ = train(12, torch.float64, clip_grad_norm=0.3, on_reduced_grads=lambda batch: norms.append(batch.grad_norm))
    want, _ = reference(12, torch.float64, clip=0.3)
    assert close(got, want, 1e-12)
    assert len(norms) == 12 and max(norms) > 0.3, "the clip was active"
    unclipped, _ = reference(12, torch.float64)
    assert not close(got, unclipped, 1e-6)


def test_the_callback_sees_and_may_change_the_reduced_gradients() -> None:
    def halve(batch) -> None:
        assert batch.global_batch_size == BATCH and batch.grad_norm is None
        for p in params:
            p.grad.mul_(0.5)

    model, opt = make(torch.float64)
    params = list(model.parameters())
    x, y = data(torch.float64)
    loop = ElasticLoop(
        model,
        opt,
        ElasticSampler(N, BATCH),
        micro_batch_size=MICRO,
        env=WorkerEnv.from_environ({}),
        on_reduced_grads=halve,
    )
    for batch in loop.run(max_steps=10):
        for idx in batch.micro_batches:
            batch.backward(loss_of(model, x[idx], y[idx]))
    want, _ = reference(10, torch.float64, halve=True)
    assert close(model.state_dict(), want, 1e-12)


def test_fp16_overflows_skip_the_step_which_commits_nothing(tmp_path: Path, monkeypatch) -> None:
    """Started at a loss scale that overflows, the first steps are skipped and trained again
    at half the scale each time: the same parameters as the hand-written rule, and the ledger
    shows every sample trained once, in the steps that committed."""
    monkeypatch.setenv("MAITRE_LEDGER_DIR", str(tmp_path / "ledger"))
    got, loop = train(8, torch.float32, precision="fp16", loss_scaler=LossScaler(2.0**40))
    want, skipped = reference(8, torch.float32, scale=2.0**40, autocast=torch.float16)
    assert skipped > 3 and loop.scaler.skipped == skipped and loop.step == 8
    assert loop.scaler.scale == 2.0**40 * 0.5**skipped
    assert close(got, want, 1e-6)
    result = audit(tmp_path / "ledger")
    assert result.ok and result.steps == 8 and result.samples == 8 * BATCH, result.describe()


def test_bf16_autocasts_the_forward_and_keeps_the_parameters_in_their_dtype() -> None:
    seen: list[torch.dtype] = []
    model, opt = make(torch.float32)
    x, y = data(torch.float32)
    loop = ElasticLoop(model, opt, ElasticSampler(N, BATCH), env=WorkerEnv.from_environ({}), precision="bf16")
    for batch in loop.run(max_steps=2):
        for idx in batch.micro_batches:
            with batch.autocast():
                out = model(x[idx])
            seen.append(out.dtype)
            batch.backward(torch.nn.functional.mse_loss(out.float(), y[idx], reduction="sum"))
    assert seen == [torch.bfloat16, torch.bfloat16] and loop.scaler is None
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
