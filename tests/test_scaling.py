"""Scaling rules: global batch and learning-rate factor by world size, with warm-up."""

from __future__ import annotations

import math

import pytest

from maitre.runtime.scaling import ConstantBatch, LinearScaling, SqrtScaling

pytestmark = pytest.mark.timeout(30)


def test_constant_batch_ignores_the_world() -> None:
    rule = ConstantBatch()
    rule.on_resize(5, 10)
    assert rule.global_batch_size(64, 5) == 64
    assert rule.lr_factor(11) == 1.0


@pytest.mark.parametrize("cls,scale", [(LinearScaling, lambda r: r), (SqrtScaling, math.sqrt)])
def test_factor_ramps_to_the_new_world_over_the_warmup(cls, scale) -> None:
    rule = cls(per_rank_batch_size=8, base_world_size=2, warmup_steps=10)
    rule.on_resize(2, 0)
    assert rule.lr_factor(0) == pytest.approx(1.0)
    assert rule.global_batch_size(999, 4) == 32
    rule.on_resize(4, 100)  # the world doubles at step 100
    assert rule.lr_factor(100) == pytest.approx(1.0)
    assert rule.lr_factor(105) == pytest.approx(1.0 + 0.5 * (scale(2.0) - 1.0))
    assert rule.lr_factor(110) == pytest.approx(scale(2.0))
    assert rule.lr_factor(500) == pytest.approx(scale(2.0))
    rule.on_resize(1, 200)  # shrink mid-way from the reached factor
    assert rule.lr_factor(200) == pytest.approx(scale(2.0))
    assert rule.lr_factor(210) == pytest.approx(scale(0.5))


def test_state_round_trip_and_rule_mismatch() -> None:
    a = LinearScaling(per_rank_batch_size=4, base_world_size=1, warmup_steps=4)
    a.on_resize(3, 7)
    b = LinearScaling(per_rank_batch_size=4, base_world_size=1, warmup_steps=4)
    b.load_state_dict(a.state_dict())
    assert [b.lr_factor(s) for s in range(7, 13)] == [a.lr_factor(s) for s in range(7, 13)]
    with pytest.raises(ValueError, match="sqrt"):
        SqrtScaling(per_rank_batch_size=4, base_world_size=1).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="constant"):
        ConstantBatch().load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(per_rank_batch_size=0, base_world_size=1),
        dict(per_rank_batch_size=1, base_world_size=0),
        dict(per_rank_batch_size=1, base_world_size=1, warmup_steps=-1),
    ],
)
def test_bad_settings_are_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        LinearScaling(**kwargs)


def test_a_per_rank_batch_larger_than_the_data_set_is_refused_before_the_first_step() -> None:
    import torch

    from maitre.runtime.env import WorkerEnv
    from maitre.runtime.loop import ElasticLoop
    from maitre.runtime.sampler import ElasticSampler

    model = torch.nn.Linear(2, 1)
    rule = LinearScaling(per_rank_batch_size=8, base_world_size=1)
    loop = ElasticLoop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ElasticSampler(6, 2),
        scaling=rule,
        env=WorkerEnv.from_environ({}),
    )
    with pytest.raises(
        ValueError, match=r"global batch \(8: the linear rule at world size 1\) is larger than the data set \(6"
    ):
        next(iter(loop.run(3)))
    assert loop.state.step == 0
