"""The bucketed gradient reduction (:mod:`maitre.runtime.reduction`), with ranks as threads over
gloo: the layout is DDP's and the same everywhere, buckets go out while backward still runs
(only on the last micro-batch), the control slots ride last, a layout that differs between ranks
or a model changed under the loop is refused with a message, and a step lost with buckets in
flight never hands their buffers on. The same reduction under kills and joins, against a
fixed-size run, is in test_elastic_processes.py (the example runs with 4 KiB buckets there)."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT
from maitre import ElasticLoop, ElasticSampler
from maitre.runtime.env import WorkerEnv
from maitre.runtime.group import EpochGroup, EpochLost
from maitre.runtime.reduction import Buckets, Reducer, agree, plan

pytestmark = pytest.mark.timeout(60)
KB = 1 / 1024  # MiB


_SEEDING = threading.Lock()


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32, widths=(8, 64, 64, 64, 4)) -> torch.nn.Module:
    """The same model on every rank (the global RNG is seeded and drawn under a lock: the ranks
    are threads of one process)."""
    with _SEEDING:
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers[:-1]).to(dtype)


def params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def ranks(
    world: int, body: Callable[[EpochGroup], Any], closed: Callable[[int], str | None] = lambda rank: None
) -> list[Any]:
    """Run ``body(group)`` on ``world`` threads, each a rank of one gloo group (its own store
    client); returns each rank's result, or raises the first rank's exception."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def run(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
            group = EpochGroup.create(store, "t/", rank, world, torch.device("cpu"), lambda: closed(rank))
            try:
                results[rank] = body(group)
            finally:  # (a group with a collective in flight is never destroyed)
                group.retire()
        except BaseException as exc:  # noqa: BLE001 (re-raised on the test's thread)
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
        assert not t.is_alive(), "a rank hung"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


# -- the layout ----------------------------------------------------------------------------------
def test_buckets_are_laid_out_in_reverse_order_with_a_small_first_one_and_a_cap() -> None:
    ps = [torch.zeros(256) for _ in range(8)]  # 1 KiB each, float32
    assert plan(ps, Buckets(cap_mb=3 * KB, first_cap_mb=1 * KB)) == [(7,), (6, 5, 4), (3, 2, 1), (0,)]
    assert plan(ps, Buckets(cap_mb=math.inf, first_cap_mb=math.inf)) == [tuple(range(7, -1, -1))]
    # DDP's defaults: a model of 8 KiB is one bucket; a parameter larger than the cap is alone
    assert plan(ps, Buckets()) == [tuple(range(7, -1, -1))]
    big = [torch.zeros(256), torch.zeros(4096), torch.zeros(256)]
    assert plan(big, Buckets(cap_mb=2 * KB, first_cap_mb=2 * KB)) == [(2, 1), (0,)]


def test_each_dtype_has_buckets_of_its_own_in_a_deterministic_order() -> None:
    ps = [
        torch.zeros(256),
        torch.zeros(256, dtype=torch.float64),
        torch.zeros(256),
        torch.zeros(256, dtype=torch.bfloat16),
        torch.zeros(256),
    ]
    layout = plan(ps, Buckets(cap_mb=2 * KB, first_cap_mb=1 * KB))
    # in the order they close: float32's first (1 KiB), float64's (2 KiB at once), float32's
    # second (2 KiB), and bfloat16's (512 B) still open at the end
    assert layout == [(4,), (1,), (2, 0), (3,)]
    assert layout == plan([p.clone() for p in ps], Buckets(cap_mb=2 * KB, first_cap_mb=1 * KB))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cap_mb": 0},
        {"cap_mb": -1.0},
        {"first_cap_mb": 0.0},
        {"cap_mb": float("nan")},
        {"cap_mb": True},
        {"first_cap_mb": "25"},
    ],
)
def test_a_cap_that_is_not_a_positive_size_is_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="must be a positive number of MiB"):
        Buckets(**kwargs)


# -- the reduction, ranks as threads -------------------------------------------------------------
def step(
    reducer: Reducer,
    model: torch.nn.Module,
    group: EpochGroup | None,
    xs: list[torch.Tensor],
    launched_after: list[int] | None = None,
) -> None:
    """One step of ``len(xs)`` micro-batches; ``launched_after`` gets how many buckets had
    been launched after each backward pass."""
    reducer.begin(len(xs), group)
    for x in xs:
        model(x).square().sum().backward()
        if launched_after is not None:
            launched_after.append(reducer._launched)
    reducer.control[0] = 1.0
    reducer.finish(group)


def reference_grads(
    world: int, xs_of: Callable[[int], list[torch.Tensor]], first: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Each rank's gradients summed, computed on one thread with plain autograd (``first``:
    the first layer in that dtype)."""
    model = mlp()
    if first is not None:
        model[0].to(first)
    for rank in range(world):
        for x in xs_of(rank):
            if first is None:
                model(x).square().sum().backward()
            else:
                h = model[1](model[0](x.to(first))).float()
                model[6](model[5](model[4](model[3](model[2](h))))).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def inputs(rank: int, micro: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(5, 8, generator=g) for _ in range(micro)]


def test_buckets_go_out_while_backward_runs_and_only_on_the_last_micro_batch() -> None:
    cfg = Buckets(cap_mb=8 * KB, first_cap_mb=1 * KB)

    def body(group: EpochGroup) -> tuple[list[int], list[torch.Tensor], int, float]:
        model = mlp()
        reducer = Reducer(model, params(model), cfg, control=3)
        launched: list[int] = []
        step(reducer, model, group, inputs(group.rank), launched)
        return launched, [p.grad.clone() for p in model.parameters()], len(reducer.layout), float(reducer.control[0])

    results = ranks(2, body)
    want = reference_grads(2, inputs)
    for launched, grads, buckets, control in results:
        assert buckets >= 4
        # nothing after the first two micro-batches; after the last, every bucket but the one
        # holding the control slots (it waits for the body's end)
        assert launched == [0, 0, buckets - 1]
        assert control == 2.0  # summed over the ranks
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_fsdp2_shards_go_out_layer_by_layer_while_backward_runs(tmp_path) -> None:
    """FSDP2 calls a sharded parameter's post-accumulate-grad hooks once its layer's
    reduce-scatter wrote the gradient: the buckets of a replica's shards go out to the other
    replicas while backward still runs through the layers before them (here, before the first
    layer's backward), on the last micro-batch only, holding what plain autograd gives."""
    import json
    import os

    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "fsdp2_buckets.py")],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "STORE_FILE": str(tmp_path / "store")},
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    buckets = out["buckets"]
    assert buckets >= 3 and out["exact"], out
    assert out["launched_after"] == [0, 0, buckets - 1], out
    assert out["at_first_layer"] == [0, 0, buckets - 1], out  # before layer 0's backward ran


def test_without_overlap_every_bucket_goes_out_at_the_end_with_the_same_result() -> None:
    def body(group: EpochGroup) -> tuple[list[int], list[torch.Tensor]]:
        model = mlp()
        reducer = Reducer(model, params(model), Buckets(cap_mb=8 * KB, overlap=False), 3)
        launched: list[int] = []
        step(reducer, model, group, inputs(group.rank), launched)
        return launched, [p.grad.clone() for p in model.parameters()]

    want = reference_grads(2, inputs)
    for launched, grads in ranks(2, body):
        assert launched == [0, 0, 0]
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_unused_parameters_and_an_empty_share_are_reduced_at_the_end_in_the_same_order() -> None:
    """Rank 0 trains only the head (the rest get no gradient and fire no hook); rank 1 has no
    samples (no backward at all): both launch the same buckets in the same order."""
    cfg = Buckets(cap_mb=4 * KB, first_cap_mb=1 * KB)

    def body(group: EpochGroup) -> list[torch.Tensor]:
        model = mlp()
        reducer = Reducer(model, params(model), cfg, 3)
        reducer.begin(1, group)
        if group.rank == 0:
            head = model[-1]
            head(torch.ones(2, 64)).sum().backward()
        reducer.finish(group)
        return [p.grad.clone() for p in model.parameters()]

    zero, one = ranks(2, body)
    for a, b in zip(zero, one):
        assert torch.equal(a, b)
    assert float(zero[-1].abs().sum()) > 0 and float(zero[0].abs().sum()) == 0


def test_mixed_dtypes_reduce_exactly_and_half_precision_last_gets_its_own_control_bucket() -> None:
    def make() -> torch.nn.Module:
        model = mlp(widths=(8, 16, 16, 4))
        model[0].to(torch.bfloat16)  # the first layer: the last bucket
        model[2].to(torch.float64)
        return model

    def body(group: EpochGroup) -> tuple[list[torch.Tensor], float, int]:
        model = make()
        reducer = Reducer(model, params(model), Buckets(cap_mb=KB, first_cap_mb=KB), 3)
        reducer.begin(1, group)
        x = torch.ones(3, 8, dtype=torch.bfloat16) * (group.rank + 1)
        h = model[1](model[0](x)).double()
        model[4](model[3](model[2](h)).float()).sum().backward()
        reducer.control[1] = 7.0
        reducer.finish(group)
        return [p.grad.clone() for p in model.parameters()], float(reducer.control[1]), reducer.control.dtype.itemsize

    results = ranks(2, body)
    (a, count, size), (b, _, _) = results
    assert count == 14.0 and size == 8  # float64 slots after the bfloat16 bucket
    assert [g.dtype for g in a] == [torch.bfloat16] * 2 + [torch.float64] * 2 + [torch.float32] * 2
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_gradients_divided_on_the_way_in_reduce_to_the_mean_and_the_rest_after() -> None:
    """``divide_early``: the float32 buckets are divided by the step's count as the gradients
    are copied in (no pass over them after the reduction); a bfloat16 one only in scatter()."""

    def body(group: EpochGroup) -> list[torch.Tensor]:
        model = mlp()
        model[0].to(torch.bfloat16)
        reducer = Reducer(model, params(model), Buckets(cap_mb=4 * KB, first_cap_mb=KB), 3, divide_early=True)
        reducer.begin(2, group, count=20)
        for x in inputs(group.rank, 2):
            h = model[1](model[0](x.bfloat16())).float()
            model[6](model[5](model[4](model[3](model[2](h))))).square().sum().backward()
        reducer.finish(group)
        reducer.scatter(20)
        return [p.grad.clone() for p in model.parameters()]

    want = reference_grads(2, lambda r: inputs(r, 2), first=torch.bfloat16)
    for grads in ranks(2, body):
        for g, w in zip(grads[2:], want[2:]):
            torch.testing.assert_close(g, w / 20, rtol=1e-5, atol=1e-7)
        for g, w in zip(grads[:2], want[:2]):  # bfloat16: 3 significant digits
            torch.testing.assert_close(g, (w / 20).to(g.dtype), rtol=2e-2, atol=1e-3)


def test_a_script_that_replaces_or_clears_grads_is_reduced_all_the_same() -> None:
    def body(group: EpochGroup) -> list[torch.Tensor]:
        model = mlp()
        reducer = Reducer(model, params(model), Buckets(cap_mb=4 * KB, first_cap_mb=KB), 3)
        reducer.begin(1, group)
        model.zero_grad(set_to_none=True)  # autograd then makes grads of its own
        model(inputs(group.rank, 1)[0]).square().sum().backward()
        reducer.finish(group)
        return [p.grad.clone() for p in model.parameters()]

    want = reference_grads(2, lambda r: inputs(r, 1))
    for grads in ranks(2, body):
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_backward_pass_after_a_bucket_went_out_is_refused_with_a_message() -> None:
    model = mlp()
    reducer = Reducer(model, params(model), Buckets(cap_mb=4 * KB, first_cap_mb=KB), 3)

    class Quiet:  # a group that launches nothing (one rank alone)
        device = torch.device("cpu")

        def allreduce_async(self, tensor: torch.Tensor) -> None:
            return None

    reducer.begin(1, Quiet())  # type: ignore[arg-type]
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="after its gradient was final"):
        model(torch.ones(2, 8)).sum().backward()


def test_a_layout_that_differs_between_ranks_is_refused_on_every_rank() -> None:
    def body(group: EpochGroup) -> str:
        model = mlp(widths=(8, 64, 4) if group.rank == 0 else (8, 64, 64, 4))
        reducer = Reducer(model, params(model), Buckets(), 3)
        with pytest.raises(RuntimeError, match="gradient buckets differ") as info:
            agree(group, reducer.digest())
        return str(info.value)

    assert all("the same model" in m for m in ranks(2, body))

    def same(group: EpochGroup) -> None:
        model = mlp()
        agree(group, Reducer(model, params(model), Buckets(cap_mb=4 * KB), 3).digest())

    ranks(2, same)


def test_a_step_lost_with_buckets_in_flight_never_hands_their_buffers_on() -> None:
    """Rank 1 never takes part: rank 0's buckets stay in flight until the epoch is closed, the
    step raises EpochLost, and the renewed buffers are new storage."""
    gate = threading.Event()

    def body(group: EpochGroup) -> tuple[set[int], set[int]] | None:
        if group.rank == 1:
            gate.wait(20)
            return None
        model = mlp()
        reducer = Reducer(model, params(model), Buckets(cap_mb=4 * KB, first_cap_mb=KB), 3)
        before = {g.data_ptr() for g in reducer.grads()}
        threading.Timer(0.3, gate.set).start()
        with pytest.raises(EpochLost, match="closed"):
            step(reducer, model, group, inputs(0, 1))
        reducer.renew()
        return before, {g.data_ptr() for g in reducer.grads()}

    result = ranks(2, body, closed=lambda rank: "the coordinator closed the epoch" if gate.is_set() else None)[0]
    assert result is not None
    before, after = result
    assert not before & after


# -- the loop ------------------------------------------------------------------------------------
def loop_for(model: torch.nn.Module, **kw: Any) -> ElasticLoop:
    return ElasticLoop(
        model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(24, 6), env=WorkerEnv.from_environ({}), **kw
    )


def test_parameters_added_after_the_loop_was_built_are_refused_before_the_first_step() -> None:
    model = mlp()
    loop = loop_for(model)
    model.append(torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="trainable parameters changed after the ElasticLoop"):
        next(loop.run(max_steps=2))


def test_a_parameter_whose_shape_changes_between_steps_is_refused() -> None:
    model = mlp()
    loop = loop_for(model)
    run = loop.run(max_steps=3)
    batch = next(run)
    for idx in batch.micro_batches:
        model(torch.ones(len(idx), 8)).sum().backward()
    model[0].weight.data = torch.zeros(65, 8)
    with pytest.raises(RuntimeError, match="parameter 0 of the model changed"):
        next(run)


def test_a_bad_cap_is_refused_before_the_loop_is_built() -> None:
    with pytest.raises(ValueError, match="cap_mb"):
        loop_for(mlp(), buckets=Buckets(cap_mb=0))


@pytest.mark.parametrize("script", ["train.py", "train_llm.py"])
def test_the_examples_refuse_a_bucket_cap_that_is_not_a_size(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--bucket-cap-mb", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--bucket-cap-mb must be a positive number of MiB, got -1.0" in done.stderr
