"""statetree encode/decode and TrainState capture/restore."""

from __future__ import annotations

import math
import random

import pytest
import torch

try:
    import numpy as np
except ImportError:  # numpy is optional: torch runs without it
    np = None

from maitre.runtime.sampler import ElasticSampler
from maitre.runtime.state import TrainState
from maitre.runtime.statetree import decode, dumps, encode, loads

pytestmark = pytest.mark.timeout(30)


def _wire(tree):
    """Encode, go through JSON bytes (as the transfer does), copy the tensors, decode."""
    skeleton, tensors = encode(tree)
    data = dumps(skeleton)
    assert isinstance(data, bytes)
    return decode(loads(data), [t.detach().clone() for t in tensors]), len(tensors)


def _assert_same(a, b, path="root"):
    """Deep equality that is exact for tensors, keeps tuple/list and key types, and NaN == NaN."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=path)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def _model_and_adamw(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-2},
            {"params": model[2].parameters(), "lr": 3e-3, "weight_decay": 0.0},
        ],
        betas=(0.85, 0.995),
        amsgrad=True,
    )
    return model, opt


def _train_step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def test_adamw_state_dict_round_trip_after_a_step():
    model, opt = _model_and_adamw()
    _train_step(model, opt, 1)
    sd = opt.state_dict()
    assert set(sd["state"]) == {0, 1, 2, 3}  # int keys
    assert sd["param_groups"][0]["betas"] == (0.85, 0.995)
    back, n = _wire(sd)
    _assert_same(sd, back)
    assert n == 4 * 4  # step, exp_avg, exp_avg_sq, max_exp_avg_sq per parameter
    assert isinstance(back["param_groups"][1]["betas"], tuple)
    assert all(isinstance(k, int) for k in back["state"])

    # the decoded state drives a fresh optimizer exactly like the original one
    model2, opt2 = _model_and_adamw(seed=99)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(back)
    for s in (2, 3):
        _train_step(model, opt, s)
        _train_step(model2, opt2, s)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "tree",
    [
        {"a": float("inf"), "b": float("-inf"), "c": float("nan"), "d": -0.0, "e": 1e-310},
        {"none": None, "t": True, "f": False, "i": -(2**62), "s": "ünïcode"},
        {0: "zero", 1: (1, 2.5, None), "name": [None, {"x": ()}]},  # mixed int/str keys
        {"__tensor__": 0, "__tuple__": [1], "__dict__": [[1, 2]]},  # keys that look like markers
        {5: {7: {9: (torch.zeros(0), [torch.arange(3)])}}},
        ((), [], {}, ((1,),)),
        [
            torch.tensor(float("nan")),
            torch.tensor([1, 2], dtype=torch.int8),
            torch.ones(2, 2, dtype=torch.bfloat16),
            torch.tensor(True),
        ],
        None,
        3.25,
    ],
)
def test_round_trip_table(tree):
    back, _ = _wire(tree)
    _assert_same(tree, back)


def test_same_tensor_twice_gets_two_placeholders_in_order():
    t = torch.arange(4.0)
    skeleton, tensors = encode({"a": t, "b": [t, torch.ones(1)]})
    assert skeleton == {"a": {"__tensor__": 0}, "b": [{"__tensor__": 1}, {"__tensor__": 2}]}
    assert tensors[0] is t and tensors[1] is t


@pytest.mark.skipif(np is None, reason="numpy is not installed")
def test_numpy_values_become_plain_types():
    skeleton, tensors = encode(
        {"s": np.float64(1.5), "i": np.int32(7), "b": np.bool_(True), "a": np.arange(3), "u": np.uint32(2**32 - 1)}
    )
    back = loads(dumps(skeleton))
    assert back == {"s": 1.5, "i": 7, "b": True, "a": {"__tensor__": 0}, "u": 2**32 - 1}
    assert [type(back[k]) for k in ("s", "i", "b", "u")] == [float, int, bool, int]
    assert torch.equal(tensors[0], torch.arange(3))


@pytest.mark.parametrize(
    "tree,where,what",
    [
        ({"opt": {"state": {0: {"fn": object()}}}}, ".opt.state.0.fn", "object"),
        ({"a": [1, {2, 3}]}, ".a[1]", "set"),
        ({"a": (1, b"raw")}, ".a[1]", "bytes"),
        ({"a": {"b": 1 + 2j}}, ".a.b", "complex"),
        (object(), "root", "object"),
        ({"f": lambda: 0}, ".f", "function"),
    ],
)
def test_unsupported_value_raises_type_error_naming_the_path(tree, where, what):
    with pytest.raises(TypeError) as info:
        encode(tree)
    assert where in str(info.value)
    assert what in str(info.value)


@pytest.mark.parametrize("key", [(1, 2), True, 1.5, None])
def test_unsupported_key_raises_type_error_naming_the_path(key):
    with pytest.raises(TypeError) as info:
        encode({"outer": {"inner": {key: 1}}})
    assert ".outer.inner" in str(info.value)
    assert repr(key) in str(info.value)


@pytest.mark.parametrize(
    "skeleton,n",
    [
        ({"__tensor__": 1}, 1),
        ({"__tensor__": -1}, 1),
        ({"a": [{"__tensor__": 0}]}, 0),
        ({"__tensor__": "0"}, 1),
        ({"__tensor__": 0.0}, 1),
        ({"__tuple__": [{"__tensor__": 5}]}, 2),
        ({"__dict__": [[1, {"__tensor__": 2}]]}, 2),
    ],
)
def test_decode_rejects_out_of_range_placeholder(skeleton, n):
    with pytest.raises(ValueError, match="out of range"):
        decode(skeleton, [torch.zeros(1) for _ in range(n)])


def _make_state(seed: int):
    model, opt = _model_and_adamw(seed)
    sampler = ElasticSampler(50, 6, seed=4)
    ts = TrainState(model=model, optimizer=opt, sampler=sampler)
    return ts, model, opt, sampler


def _draws():
    return (
        random.random(),
        random.randint(0, 10**9),
        torch.rand(3).tolist(),
        torch.randint(0, 10**6, (2,)).tolist(),
        None if np is None else np.random.rand(2).tolist(),
    )


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed + 1)
    if np is not None:
        np.random.seed(seed + 2)


def test_train_state_round_trip_restores_everything():
    ts, model, opt, sampler = _make_state(0)
    for s in range(3):
        _train_step(model, opt, s)
        sampler.advance(sampler.next_slice(0, 2))
        ts.step += 1
    _seed_all(123)
    _draws()  # move the generators off their seeds

    tree = ts.state_dict()
    assert set(tree) == {"model", "optimizer", "sampler", "step", "skipped", "rng"}
    skeleton, tensors = encode(tree)
    data, tensors = dumps(skeleton), [t.detach().clone() for t in tensors]
    expected_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected_opt, _ = _wire(opt.state_dict())
    expected_draws = _draws()

    # the original goes on; the capture must not follow it
    _train_step(model, opt, 10)
    original_next = [p.detach().clone() for p in model.parameters()]
    sampler.advance(sampler.next_slice(0, 2))
    ts.step += 1
    _seed_all(0)

    fresh, model2, opt2, sampler2 = _make_state(seed=42)
    fresh.load_state_dict(decode(loads(data), tensors))
    assert fresh.step == 3
    assert (sampler2.data_epoch, sampler2.cursor) == (0, 18)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_params[k]), k
    _assert_same(opt2.state_dict(), expected_opt)
    assert _draws() == expected_draws  # python, torch and numpy draw the same numbers

    # and the restored copy trains exactly like the original did from the same point
    _train_step(model2, opt2, 10)
    for p, q in zip(model2.parameters(), original_next):
        assert torch.equal(p, q)


def test_train_state_restored_copies_then_diverge_identically():
    a, model_a, opt_a, _ = _make_state(0)
    _train_step(model_a, opt_a, 1)
    skeleton, tensors = encode(a.state_dict())
    skeleton = loads(dumps(skeleton))
    b, model_b, opt_b, _ = _make_state(7)
    # each copy gets its own tensors: decode hands back the very tensors it is given, and an
    # optimizer keeps loaded state tensors as they are (no copy)
    b.load_state_dict(decode(skeleton, [t.detach().clone() for t in tensors]))
    a.load_state_dict(decode(skeleton, [t.detach().clone() for t in tensors]))
    for s in (2, 3, 4):
        _train_step(model_a, opt_a, s)
        _train_step(model_b, opt_b, s)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_train_state_load_missing_entry_raises():
    ts, *_ = _make_state(0)
    tree = ts.state_dict()
    del tree["sampler"]
    with pytest.raises(ValueError, match="sampler"):
        ts.load_state_dict(tree)


@pytest.mark.parametrize("name", ["model", "step", "skipped", "rng"])
def test_train_state_register_rejects_taken_names(name):
    ts, *_ = _make_state(0)
    with pytest.raises(ValueError, match="already taken"):
        ts.register(name, ElasticSampler(3, 1))


def test_train_state_register_extra_object_round_trips():
    ts, *_ = _make_state(0)
    extra = ElasticSampler(9, 2, seed=5)
    extra.advance(extra.next_slice(0, 1))
    ts.register("extra", extra)
    tree, _ = _wire(ts.state_dict())
    other, *_ = _make_state(1)
    extra2 = ElasticSampler(9, 2, seed=5)
    other.register("extra", extra2)
    other.load_state_dict(tree)
    assert extra2.state_dict() == extra.state_dict()
    assert extra2.cursor == 2


def test_placements_round_trip_with_fsdp_over_tp_strided_shards():
    """FSDP2 over TP places a parameter ``_StridedShard`` on dp_shard (no ``Shard`` in torch
    2.13): its split factor orders the pieces, so it must survive the trip to a joiner."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from maitre.runtime.statetree import _placement, _placement_of

    for placement in (Shard(0), Shard(1), Replicate(), _StridedShard(0, split_factor=2)):
        back = _placement_of(loads(dumps(_placement(placement))))
        assert back == placement and type(back) is type(placement), placement
    assert _placement(_StridedShard(0, split_factor=2)) == ["strided_shard", 0, 2]
    with pytest.raises(TypeError, match="partial sums are not state"):
        _placement(Partial())
    for bad in (["strided_shard", 0, 0], ["strided_shard", 0], ["shard", "0"], ["partial"]):
        with pytest.raises(ValueError, match="unknown placement"):
            _placement_of(bad)
