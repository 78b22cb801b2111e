"""The loop's recovery paths with ranks as threads, against an in-process coordinator.

The real ElasticLoop, Coordinator (membership, scheduling, failure detection) and c10d stores,
over gloo, with :class:`maitre.inprocess.InProcessCluster` playing the agents: a crash, a hang, a
join and a leave each take seconds, where the same stories with processes
(tests/test_elastic_processes.py) take tens. Each checks what the product promises: the job
completes, the ledger shows every sample trained exactly once, and the final parameters equal a
fixed-size run's in float64 (relative error <= 1e-9).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import maitre
from conftest import relative_error
from maitre import protocol
from maitre.control.detectors import DetectorConfig
from maitre.inprocess import InProcessCluster
from maitre.runtime.env import Mode, WorkerEnv
from maitre.runtime.ledger import audit
from maitre.runtime.link import CoordinatorLink

pytestmark = pytest.mark.timeout(90)

N, GLOBAL_BATCH, STEPS = 384, 24, 60
_g = torch.Generator().manual_seed(0)
X = torch.randn(N, 6, generator=_g, dtype=torch.float64)
Y = torch.randn(N, 1, generator=_g, dtype=torch.float64)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)).double()


INIT = {k: v.clone() for k, v in _model().state_dict().items()}
Fault = Callable[[WorkerEnv, maitre.ElasticLoop, Any], None]


FP16 = {"precision": "fp16", "loss_scale": 1e308, "clip_grad_norm": 0.3}
"""The loss scaler and clipping, in float64 where the comparison means something (autocast leaves
float64 alone); a scale of 1e308 overflows the first steps, so the run starts with skipped steps,
each trained again at half the scale."""


def train_with(out: dict[str, Any], fault: Fault | None = None, step_s: float = 0.01, **recipe: Any):
    """A job's function: trains the model, writes the final state where the job completed.
    ``style="prepare"``: the same training as a plain loop on :func:`maitre.prepare`."""
    if recipe.get("style") == "prepare":
        return _prepared(out, fault, step_s, **recipe)

    def train(env: WorkerEnv, link: CoordinatorLink | None) -> None:
        model = _model()
        model.load_state_dict(INIT)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = maitre.ElasticSampler(N, GLOBAL_BATCH, seed=3)
        scale = recipe.get("loss_scale")
        loop = maitre.ElasticLoop(
            model,
            opt,
            sampler,
            micro_batch_size=8,
            env=env,
            link=link,
            precision=recipe.get("precision"),
            clip_grad_norm=recipe.get("clip_grad_norm"),
            loss_scaler=maitre.LossScaler(scale) if scale else None,
        )
        for batch in loop.run(max_steps=STEPS):
            if fault is not None:
                fault(env, loop, batch)
            for idx in batch.micro_batches:
                if idx:
                    batch.backward(((model(X[idx]) - Y[idx]) ** 2).sum())
            threading.Event().wait(step_s)  # a step long enough for an event to land mid-run
        out.setdefault("ended", {})[env.worker_id] = loop.ended
        if loop.completed and loop.rank == 0:
            out["final"] = {k: v.clone() for k, v in model.state_dict().items()}

    return train


def _prepared(out: dict[str, Any], fault: Fault | None, step_s: float, **recipe: Any):
    """The job's function as users who keep their own loop write it: a DataLoader, a mean loss,
    ``loss.backward(); optimizer.step(); optimizer.zero_grad()``."""

    def train(env: WorkerEnv, link: CoordinatorLink | None) -> None:
        model = _model()
        model.load_state_dict(INIT)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
        model, opt, loader = maitre.prepare(
            model,
            opt,
            data,
            global_batch_size=GLOBAL_BATCH,
            max_steps=STEPS,
            seed=3,
            env=env,
            link=link,
            clip_grad_norm=recipe.get("clip_grad_norm"),
        )
        for x, y in loader:
            if fault is not None and loader.batch is not None:
                fault(env, loader.loop, loader.batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            threading.Event().wait(step_s / 3)  # (three micro-batches a step)
        out.setdefault("ended", {})[env.worker_id] = loader.ended
        if loader.completed and loader.loop.rank == 0:
            out["final"] = {k: v.clone() for k, v in model.state_dict().items()}

    return train


def fixed_size(**recipe: Any) -> dict[str, torch.Tensor]:
    """The same training on one process: what every elastic run must end with."""
    out: dict[str, Any] = {}
    train_with(out, step_s=0.0, **recipe)(WorkerEnv(mode=Mode.SINGLE, worker_id="single", local_rank=0), None)
    return out["final"]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return fixed_size()


def once_at(step: int, rank: int, action: Callable[[WorkerEnv], None]) -> Fault:
    """A fault that fires once, in the member of ``rank`` when it trains ``step``."""
    fired = threading.Event()

    def fault(env: WorkerEnv, loop: maitre.ElasticLoop, batch: Any) -> None:
        if batch.step == step and loop.rank == rank and loop.world_size > rank and not fired.is_set():
            fired.set()
            action(env)

    return fault


def run_job(
    tmp_path: Path,
    cluster: InProcessCluster,
    out: dict[str, Any],
    fault: Fault | None = None,
    *,
    lo: int = 1,
    hi: int = 3,
    during: Callable[[dict[str, Any]], None] | None = None,
    step_s: float = 0.01,
    **recipe: Any,
) -> dict[str, Any]:
    ledger = tmp_path / "ledger"
    env = {protocol.LEDGER_DIR: str(ledger), protocol.RUN_ID: "r1"}
    cluster.submit("j", train_with(out, fault, step_s, **recipe), min_replicas=lo, max_replicas=hi, env=env)
    if during is not None:
        during(cluster.wait_for("j", lambda job: job["state"] == "RUNNING", 30))
    job = cluster.wait_for("j", lambda job: job["state"] in ("COMPLETED", "FAILED"), 60)
    assert job["state"] == "COMPLETED", (job, cluster.errors)
    result = audit(ledger)
    assert result.ok, result.describe()
    assert result.steps == STEPS
    return job


STYLES = pytest.mark.parametrize("style", ["loop", "prepare"])
"""The loop's own body, and the same training as a plain loop on :func:`maitre.prepare`: one
engine underneath, so both end where the fixed-size ``loop`` run does."""


@STYLES
def test_a_crashed_rank_is_replaced_and_the_run_equals_a_fixed_size_one(tmp_path: Path, reference, style) -> None:
    out: dict[str, Any] = {}

    def crash(env: WorkerEnv) -> None:
        raise RuntimeError("injected crash")

    with InProcessCluster(tmp_path, nodes=3) as cluster:
        job = run_job(tmp_path, cluster, out, once_at(20, 1, crash), style=style)
        assert "RuntimeError: injected crash" in cluster.errors.values(), cluster.errors
    assert job["epoch"] >= 2  # the crash closed the first epoch
    assert relative_error(out["final"], reference) <= 1e-9


def test_a_hung_rank_is_found_by_its_silence_and_removed(tmp_path: Path, reference) -> None:
    out: dict[str, Any] = {}
    detector = DetectorConfig(heartbeat_interval_s=0.05, suspect_floor_s=0.5)
    with InProcessCluster(tmp_path, nodes=2, detector=detector) as cluster:
        run_job(tmp_path, cluster, out, once_at(15, 1, lambda env: cluster.hang(env.worker_id)))
        assert "killed" in cluster.errors.values(), cluster.errors
    assert relative_error(out["final"], reference) <= 1e-9


@STYLES
def test_a_joiner_gets_the_live_state_and_a_leaver_goes_without_a_word(tmp_path: Path, reference, style) -> None:
    out: dict[str, Any] = {}
    with InProcessCluster(tmp_path, nodes=2) as cluster:

        def grow_then_shrink(job: dict[str, Any]) -> None:
            cluster.wait_for("j", lambda j: len(j["members"]) == 2 and j["step"] >= 5, 30)
            cluster.add_node()
            cluster.wait_for("j", lambda j: len(j["members"]) == 3, 30)
            assert cluster.job("j")["step"] < STEPS, "the job finished before the joiner came"
            cluster.co.scale("j", 1)

        job = run_job(tmp_path, cluster, out, lo=1, hi=3, during=grow_then_shrink, style=style)
    ended = out["ended"]
    assert sorted(ended.values()) == ["completed", "left", "left"], ended
    assert len(job["members"]) == 1
    assert relative_error(out["final"], reference) <= 1e-9


def grow_at(step: int, cluster: InProcessCluster) -> Callable[[dict[str, Any]], None]:
    def grow(job: dict[str, Any]) -> None:
        cluster.wait_for("j", lambda j: len(j["members"]) == 2 and j["step"] >= step, 30)
        cluster.add_node()

    return grow


def test_fp16_loss_scaling_and_clipping_under_a_crash_and_a_leave(tmp_path: Path) -> None:
    out: dict[str, Any] = {}

    def crash(env: WorkerEnv) -> None:
        raise RuntimeError("injected crash")

    with InProcessCluster(tmp_path, nodes=3) as cluster:

        def leave(job: dict[str, Any]) -> None:
            cluster.wait_for("j", lambda j: j["epoch"] >= 2 and len(j["members"]) == 3 and j["step"] >= 35, 30)
            cluster.co.scale("j", 2)

        job = run_job(tmp_path, cluster, out, once_at(20, 1, crash), during=leave, **FP16)
    assert job["failures"] == 1 and sorted(out["ended"].values()) == ["completed", "completed", "left"]
    skips = [x for x in (tmp_path / "ledger").glob("*.jsonl") if '"k":"x"' in x.read_text()]
    assert skips, "no step overflowed: the scaler's skip was not exercised"
    assert relative_error(out["final"], fixed_size(**FP16)) <= 1e-9


def test_a_joiner_replays_the_steps_trained_while_its_state_streamed(tmp_path: Path, monkeypatch) -> None:
    """The snapshot lands 0.5 s late: the joiner hears the steps trained meanwhile and replays
    them (clipping and the fp16 scaler included) before it trains; the result is exact."""
    monkeypatch.setenv(protocol.TRANSFER_DELAY_S, "0.5")
    out: dict[str, Any] = {}
    with InProcessCluster(tmp_path, nodes=2) as cluster:
        job = run_job(tmp_path, cluster, out, during=grow_at(5, cluster), step_s=0.02, **FP16)
    caught_up = [r for r in job["reports"] if r["kind"] == "caught_up"]
    assert len(caught_up) == 1 and caught_up[0]["replayed"] >= 10, job["reports"]
    assert job["epoch"] == 2  # streamed: no rebuild once caught up
    assert relative_error(out["final"], fixed_size(**FP16)) <= 1e-9


def test_a_job_that_finishes_while_a_joiners_state_streams_completes_without_it(tmp_path: Path, monkeypatch) -> None:
    """The snapshot would land after the last step: the joiner hears the members commit it
    and leaves, holding none of the state; the job completes without a rollback."""
    monkeypatch.setenv(protocol.TRANSFER_DELAY_S, "5")
    out: dict[str, Any] = {}
    with InProcessCluster(tmp_path, nodes=2) as cluster:
        job = run_job(tmp_path, cluster, out, during=grow_at(40, cluster))
    kinds = [e["kind"] for e in job["events"]]
    assert "state_lost" not in kinds and "caught_up" not in kinds, kinds
    assert job["epoch"] == 2 and job["failures"] == 0, kinds
    assert sorted(out["ended"].values()) == ["completed", "completed", "left"], out["ended"]
    assert audit(tmp_path / "ledger").rolled_back == 0


def test_a_rendezvous_the_coordinator_refuses_stops_the_worker_with_an_error(tmp_path: Path) -> None:
    """A worker the coordinator does not know gets :class:`maitre.WorkerStopped`, not an exit."""
    with InProcessCluster(tmp_path, nodes=0) as cluster:
        from maitre.inprocess import InProcessLink, _Node, _Worker

        link = InProcessLink(cluster, _Worker("nobody", _Node("nowhere", 1)))
        env = WorkerEnv(mode=Mode.ELASTIC, worker_id="nobody", local_rank=0, coordinator="in-process")
        with pytest.raises(maitre.WorkerStopped, match="rendezvous refused"):
            train_with({})(env, link)
