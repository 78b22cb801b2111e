"""maitre.prepare: a plain ``loss.backward(); optimizer.step(); optimizer.zero_grad()`` loop on
the elastic loop's engine.

What it promises is what the loop promises: these tests compare a prepared plain loop with the
loop's own body in float64 (the same trajectory, relative error <= 1e-9: one engine), check the
turns a plain loop makes (gradient accumulation, a rank with no samples, a script that breaks
out early, a DataLoader's options kept) and what a script gets wrong (a clear error, never a
silent difference). Through kills and joins: with ranks as threads in tests/test_inprocess.py
(the ``prepare`` style of its stories), and here with real processes under ``maitre run``: a
SIGKILLed worker and a joiner, every sample once, the final parameters those of the script run
alone.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import maitre
from conftest import ROOT, play, relative_error, run_tagged
from maitre.runtime.env import Mode, WorkerEnv
from maitre.runtime.ledger import audit

pytestmark = pytest.mark.timeout(60)

N, GLOBAL, STEPS = 100, 24, 12
_g = torch.Generator().manual_seed(0)
X = torch.randn(N, 6, generator=_g, dtype=torch.float64)
Y = torch.randn(N, 1, generator=_g, dtype=torch.float64)
SINGLE = WorkerEnv(mode=Mode.SINGLE, worker_id="single", local_rank=0)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)).double()


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _schedule(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def loop_body(micro: int, steps: int = STEPS, **options: Any) -> dict[str, torch.Tensor]:
    """The reference: the loop's own body, summed losses."""
    model = _model()
    opt = _opt(model)
    loop = maitre.ElasticLoop(
        model,
        opt,
        maitre.ElasticSampler(N, GLOBAL, seed=3),
        micro_batch_size=micro,
        lr_scheduler=_schedule(opt),
        env=SINGLE,
        **options,
    )
    for batch in loop.run(steps):
        for idx in batch.micro_batches:
            if idx:
                batch.backward(((model(X[idx]) - Y[idx]) ** 2).sum())
    assert loop.completed
    return model.state_dict()


def _steps(steps: int) -> list[list[int]]:
    """The samples of each step of a run alone (a data epoch's last step may be short)."""
    sampler, out = maitre.ElasticSampler(N, GLOBAL, seed=3), []
    for _ in range(steps):
        out.append(sampler.next_slice(0, 1))
        sampler.advance(out[-1])
    return [s.local_indices for s in out]


def prepared(micro: int, loss: str = "mean", steps: int = STEPS, **options: Any) -> tuple[Any, Any, Any]:
    model = _model()
    opt = _opt(model)
    return maitre.prepare(
        model,
        opt,
        TensorDataset(X, Y),
        global_batch_size=GLOBAL,
        max_steps=steps,
        seed=3,
        loss=loss,
        micro_batch_size=micro,
        lr_scheduler=_schedule(opt),
        env=SINGLE,
        **options,
    )


@pytest.mark.parametrize("micro,loss", [(24, "mean"), (7, "mean"), (7, "sum")])
def test_a_plain_loop_trains_what_the_loop_trains(micro: int, loss: str) -> None:
    """Uneven micro-batches (24 = 7 + 7 + 7 + 3) with a mean loss: each backward pass is
    scaled by its own sample count, so the accumulated gradient is the global batch's sum."""
    model, opt, loader = prepared(micro, loss)
    passes = 0
    for x, y in loader:
        err = (model(x) - y) ** 2
        (err.mean() if loss == "mean" else err.sum()).backward()
        opt.step()
        opt.zero_grad()
        passes += 1
    assert loader.completed and loader.ended == "completed" and loader.step == STEPS
    assert passes == sum(-(-len(idx) // micro) for idx in _steps(STEPS))
    assert relative_error(model.state_dict(), loop_body(micro)) <= 1e-9


def test_clipping_and_the_logged_loss_are_the_loops() -> None:
    model, opt, loader = prepared(7, clip_grad_norm=0.05)
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        loader.log_loss(loss)
        opt.step()
    assert relative_error(model.state_dict(), loop_body(7, clip_grad_norm=0.05)) <= 1e-9
    assert loader.loop.last_grad_norm is not None
    # The logged loss is the global batch's mean, as the loop's body logs it.
    model.load_state_dict(loop_body(7, steps=STEPS - 1, clip_grad_norm=0.05))
    idx = _steps(STEPS)[-1]
    with torch.no_grad():
        expected = float(((model(X[idx]) - Y[idx]) ** 2).mean())
    assert loader.loop.last_loss == pytest.approx(expected, rel=1e-12)


def test_step_after_an_earlier_micro_batch_only_accumulates() -> None:
    model, opt, loader = prepared(10)
    it = iter(loader)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(it)  # 10 of 24
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()  # (nothing while the step is open: the loop clears gradients)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert loader.step == 0
    for _ in range(2):  # 10, then the last 4
        x, y = next(it)
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert loader.step == 1
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    loader.close()


def test_a_dataloader_brings_its_batch_size_workers_and_collate() -> None:
    calls = []

    def collate(items: list[Any]) -> Any:
        calls.append(len(items))
        return torch.utils.data.default_collate(items)

    model = _model()
    opt = _opt(model)
    data = DataLoader(TensorDataset(X, Y), batch_size=7, num_workers=1, collate_fn=collate, shuffle=True)
    model, opt, loader = maitre.prepare(
        model, opt, data, global_batch_size=GLOBAL, max_steps=3, seed=3, lr_scheduler=_schedule(opt), env=SINGLE
    )
    assert loader.data._loader.num_workers == 1
    with loader:
        for x, y in loader:
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert loader.completed
    assert relative_error(model.state_dict(), loop_body(7, steps=3)) <= 1e-9
    assert not calls  # (collated in the worker process)


def test_breaking_out_early_leaves_the_model_as_it_was() -> None:
    model, opt, loader = prepared(24)
    for x, y in loader:
        F.mse_loss(model(x), y).backward()
        opt.step()
        if loader.step == 3:
            break
    loader.close()
    assert loader.ended is None and not loader.completed  # (closed by the script: no ending of its own)
    # The hooks are gone: a backward now is plain torch's (no scaling by the batch size).
    x, y = X[:5], Y[:5]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    plain = [p.grad for p in model.parameters()]
    reference = _model()
    reference.load_state_dict(model.state_dict())
    F.mse_loss(reference(x), y).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, reference.parameters()))


def test_bf16_autocast_is_the_loops() -> None:
    model, opt, loader = prepared(24, steps=2, precision="bf16")
    for x, y in loader:
        with loader.autocast():
            out = model(x)
        assert out.dtype == torch.float64  # (CPU autocast leaves float64 alone, as the loop's)
        F.mse_loss(out, y).backward()
        opt.step()
    assert loader.completed


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"loss": "token"}, ValueError, "loss must be one of"),
        ({"max_steps": 0}, ValueError, "max_steps must be 1 or more"),
        ({"precision": "fp16"}, ValueError, "precision='bf16' or None"),
        ({"data": _Stream()}, TypeError, "not a map-style dataset"),
        ({"global_batch_size": N + 1}, ValueError, "larger than the data set"),
    ],
)
def test_what_prepare_refuses(change: dict[str, Any], error: type[Exception], match: str) -> None:
    model = _model()
    args: dict[str, Any] = {"data": TensorDataset(X, Y), "global_batch_size": GLOBAL, "max_steps": 2, "env": SINGLE}
    args.update(change)
    with pytest.raises(error, match=match):
        maitre.prepare(model, _opt(model), args.pop("data"), **args)


def test_a_wrapped_or_prepared_model_is_refused() -> None:
    model, opt, _ = prepared(24)
    with pytest.raises(TypeError, match="prepared already"):
        maitre.prepare(model, opt, TensorDataset(X, Y), global_batch_size=GLOBAL, max_steps=2, env=SINGLE)


def test_the_turns_a_script_gets_wrong_are_named() -> None:
    model, opt, loader = prepared(24)
    with pytest.raises(RuntimeError, match="iterate the prepared loader"):
        next(loader)
    with pytest.raises(RuntimeError, match="no batch trained"):
        opt.step()
    it = iter(loader)
    x, y = next(it)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"step 1: the next batch was asked for before optimizer.step\(\)"):
        next(it)
    with pytest.raises(TypeError, match="no closure"):
        opt.step(lambda: 0.0)
    opt.step()
    with pytest.raises(RuntimeError, match="no batch trained"):
        opt.step()  # twice for one batch
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(loader)
    with pytest.raises(RuntimeError, match="log_loss"):
        loader.close()
        loader.log_loss(1.0)


class _Flaky(Dataset):
    """Index 5 cannot be loaded (trained in two data epochs of the run: skipped twice)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == 5:
            raise ValueError("corrupt record 5")
        return X[i], Y[i]


def test_a_skipped_record_leaves_the_mean_over_the_samples_trained(capsys) -> None:
    model = _model()
    opt = _opt(model)
    model, opt, loader = maitre.prepare(
        model, opt, _Flaky(), global_batch_size=GLOBAL, max_steps=STEPS, seed=3, micro_batch_size=7,
        on_error="skip", env=SINGLE,
    )  # fmt: skip
    for x, y in loader:
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert loader.completed and loader.loop.skipped == 2 and "corrupt record 5" in capsys.readouterr().err
    # The loop's body, leaving sample 5 out of its step's sum and count.
    ref = _model()
    ref_opt = _opt(ref)
    loop = maitre.ElasticLoop(ref, ref_opt, maitre.ElasticSampler(N, GLOBAL, seed=3), micro_batch_size=7, env=SINGLE)
    for batch in loop.run(STEPS):
        for idx in batch.micro_batches:
            kept = [i for i in idx if i != 5]
            batch.skip(len(idx) - len(kept))
            if kept:
                batch.backward(((ref(X[kept]) - Y[kept]) ** 2).sum())
    assert relative_error(model.state_dict(), ref.state_dict()) <= 1e-9


# -- real processes under maitre run -----------------------------------------------------------
EXAMPLE = ROOT / "examples" / "plain_loop.py"
SMALL = ["--dtype", "float64", "--batch", "16"]
PSTEPS = 600  # (steps of a few ms: long enough for the story to play out on a fast machine)


def _example(out: Path, steps: int = PSTEPS) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--steps", str(steps), "--log-every", "100", *SMALL, "--out", str(out)]


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("alone") / "final.pt"
    result = run_tagged(_example(out), timeout=120)
    assert result.returncode == 0, result.stderr
    return torch.load(out, weights_only=True)


@pytest.mark.timeout(180)
def test_a_prepared_script_survives_a_sigkill_and_a_join_exactly(tmp_path: Path, alone) -> None:
    code, lines, run = play(
        tmp_path,
        _example(tmp_path / "final.pt"),
        "kill@100,join@250",
        min_nodes=1,
        max_nodes=3,
        local_nodes=2,
        max_restarts=3,
    )
    assert code == 0, "\n".join(lines)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok, result.describe()
    assert result.steps == PSTEPS
    job = run.job()  # type: ignore[attr-defined]
    assert job["failures"] == 1
    assert any("killed by signal 9" in e.get("reason", "") for e in job["events"])
    worlds = [len(e["members"]) for e in job["events"] if e["kind"] == "epoch"]
    assert 1 in worlds and max(worlds) == 3, worlds  # shrunk by the kill, grown by the join
    assert relative_error(torch.load(tmp_path / "final.pt", weights_only=True), alone) <= 1e-9
