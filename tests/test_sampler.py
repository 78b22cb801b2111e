"""ElasticSampler: exactly-once consumption across world-size changes, determinism, resumption."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from maitre.runtime.sampler import ElasticSampler, StepSlice, share_bounds

pytestmark = pytest.mark.timeout(30)


def _rank_samplers(committed: ElasticSampler, world: int) -> list[ElasticSampler]:
    """One sampler per rank, each restored from the committed state (as a live transfer does)."""
    out = []
    for _ in range(world):
        s = ElasticSampler(
            committed.num_samples, committed.global_batch_size, seed=committed.seed, shuffle=committed.shuffle
        )
        s.load_state_dict(committed.state_dict())
        out.append(s)
    return out


def _run(
    num_samples: int,
    batch: int,
    worlds: list[int],
    steps: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    scale_batch: bool = False,
) -> tuple[dict[int, Counter], ElasticSampler]:
    """Simulate ``steps`` committed steps, the world size changing between every step.

    Each step every rank computes its own share from its own sampler (restored from the committed
    state); the shares must tile the global slice in rank order. Returns the per-data-epoch counts.
    """
    committed = ElasticSampler(num_samples, batch, seed=seed, shuffle=shuffle)
    seen: dict[int, Counter] = defaultdict(Counter)
    for step in range(steps):
        world = worlds[step % len(worlds)]
        size = batch * world if scale_batch else None
        ranks = _rank_samplers(committed, world)
        slices = [s.next_slice(r, world, size) for r, s in enumerate(ranks)]
        glob = slices[0].global_indices
        for sl in slices:
            assert sl.global_indices == glob
            assert (sl.data_epoch, sl.cursor) == (committed.data_epoch, committed.cursor)
        tiled = [i for sl in slices for i in sl.local_indices]
        assert tiled == glob, f"step {step}: shares do not tile the global slice"
        expected = min(size or batch, num_samples - committed.cursor)
        assert len(glob) == expected
        seen[slices[0].data_epoch].update(tiled)
        for s, sl in zip(ranks, slices):  # every rank commits the same step
            s.advance(sl)
        committed.advance(slices[0])
        assert all(s.state_dict() == committed.state_dict() for s in ranks)
    return seen, committed


@pytest.mark.parametrize(
    "num_samples,batch,worlds,steps,scale_batch",
    [
        (97, 8, [3, 2, 5, 1, 4], 60, False),
        (100, 10, [1], 25, False),
        (50, 7, [4, 4, 2, 7, 3, 1, 6], 40, False),
        (31, 5, [8, 1, 3], 30, False),  # world larger than what is left (empty shares)
        (64, 3, [3, 2, 5, 1, 4], 50, True),  # global batch follows the world size (linear rule)
        (13, 13, [2, 3], 6, False),  # one step per data epoch
    ],
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_index_exactly_once_per_data_epoch(num_samples, batch, worlds, steps, scale_batch, shuffle):
    seen, final = _run(num_samples, batch, worlds, steps, shuffle=shuffle, scale_batch=scale_batch)
    finished = [d for d in seen if d < final.data_epoch]
    assert finished, "the scenario must finish at least one data epoch"
    for d in finished:
        assert sorted(seen[d].elements()) == list(range(num_samples)), f"data epoch {d}"
    if final.data_epoch in seen:  # the data epoch in progress: no repeats, right count
        current = seen[final.data_epoch]
        assert max(current.values()) == 1
        assert sum(current.values()) == final.cursor


@pytest.mark.parametrize(
    "count,world,expected",
    [
        (10, 3, [(0, 4), (4, 7), (7, 10)]),
        (9, 3, [(0, 3), (3, 6), (6, 9)]),
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
        (0, 3, [(0, 0), (0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
        (11, 4, [(0, 3), (3, 6), (6, 9), (9, 11)]),
        (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ],
)
def test_share_bounds_table(count, world, expected):
    assert [share_bounds(count, r, world) for r in range(world)] == expected


@pytest.mark.parametrize("count", range(0, 40))
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 13])
def test_share_bounds_partition(count, world):
    bounds = [share_bounds(count, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    for (_, hi), (lo, _) in zip(bounds, bounds[1:]):
        assert hi == lo  # contiguous, no overlap
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first count % world ranks take one more
    assert sum(s == count // world + 1 for s in sizes) == count % world


def test_last_partial_batch_of_a_data_epoch():
    s = ElasticSampler(10, 4, shuffle=False)
    got = []
    for _ in range(4):
        sl = s.next_slice(0, 2)
        got.append((sl.data_epoch, sl.cursor, sl.global_indices, sl.local_indices))
        s.advance(sl)
    assert got == [
        (0, 0, [0, 1, 2, 3], [0, 1]),
        (0, 4, [4, 5, 6, 7], [4, 5]),
        (0, 8, [8, 9], [8]),  # what is left: a smaller global batch
        (1, 0, [0, 1, 2, 3], [0, 1]),  # the next data epoch starts at cursor 0
    ]
    assert (s.data_epoch, s.cursor) == (1, 4)


def test_partial_batch_rank_share_on_uneven_world():
    s = ElasticSampler(10, 4, shuffle=False)
    s.load_state_dict({**s.state_dict(), "cursor": 8})
    shares = [s.next_slice(r, 3).local_indices for r in range(3)]
    assert shares == [[8], [9], []]


def test_order_is_deterministic_in_seed_and_data_epoch():
    a = ElasticSampler(200, 16, seed=7)
    b = ElasticSampler(200, 16, seed=7)
    c = ElasticSampler(200, 16, seed=8)
    for d in range(3):
        assert a.order(d).tolist() == b.order(d).tolist()
        assert sorted(a.order(d).tolist()) == list(range(200))
    assert a.order(0).tolist() != a.order(1).tolist()
    assert a.order(0).tolist() != c.order(0).tolist()
    assert a.order(0).tolist() != list(range(200))
    # the cache does not leak one epoch's order into another
    first = a.order(0).tolist()
    a.order(5)
    assert a.order(0).tolist() == first
    assert ElasticSampler(9, 2, shuffle=False).order(3).tolist() == list(range(9))


def test_the_order_is_torchs_randperm_of_seed_and_data_epoch_kept_in_4_bytes_a_sample():
    """The permutation is part of what a checkpoint means (its cursor points into it): pinned
    here, so that a state saved by one version resumes on the same samples in the next."""
    import torch

    gen = torch.Generator().manual_seed(5 * 1_000_003 + 2)
    order = ElasticSampler(1000, 8, seed=5).order(2)
    assert order.tolist() == torch.randperm(1000, generator=gen).tolist() and order.dtype == np.int32


def test_order_independent_of_world_size_history():
    """The global slices are the same whatever world sizes consumed them."""

    def slices(worlds):
        s = ElasticSampler(40, 6, seed=3)
        out = []
        for i in range(15):
            sl = s.next_slice(0, worlds[i % len(worlds)])
            out.append(sl.global_indices)
            s.advance(sl)
        return out

    assert slices([1]) == slices([3, 2, 5, 1, 4]) == slices([7])


def test_state_dict_round_trip_resumes_exactly():
    a = ElasticSampler(53, 5, seed=11)
    worlds = [3, 2, 5, 1, 4]
    for i in range(14):  # into the second data epoch
        a.advance(a.next_slice(0, worlds[i % 5]))
    state = a.state_dict()
    assert state == {
        "num_samples": 53,
        "global_batch_size": 5,
        "seed": 11,
        "shuffle": True,
        "data_epoch": 1,
        "cursor": 14 * 5 - 55,
    }
    b = ElasticSampler(53, 50, seed=11)  # global batch comes from the state
    b.load_state_dict(state)
    assert b.global_batch_size == 5
    for i in range(30):
        w = worlds[i % 5]
        sa = [a.next_slice(r, w) for r in range(w)]
        sb = [b.next_slice(r, w) for r in range(w)]
        assert sa == sb
        a.advance(sa[0])
        b.advance(sb[0])
    assert a.state_dict() == b.state_dict()


def test_next_slice_does_not_consume():
    s = ElasticSampler(20, 4, seed=1)
    assert s.next_slice(0, 2) == s.next_slice(0, 2)
    assert (s.data_epoch, s.cursor) == (0, 0)


def test_advance_of_a_stale_slice_raises():
    s = ElasticSampler(20, 4, seed=1)
    first = s.next_slice(0, 2)
    s.advance(first)
    with pytest.raises(RuntimeError, match="cursor 0"):
        s.advance(first)  # the same step twice
    assert (s.data_epoch, s.cursor) == (0, 4)
    wrong_epoch = StepSlice(1, 4, [0, 1, 2, 3], [0, 1])
    with pytest.raises(RuntimeError):
        s.advance(wrong_epoch)
    ahead = StepSlice(0, 8, [0, 1, 2, 3], [0, 1])
    with pytest.raises(RuntimeError):
        s.advance(ahead)
    assert (s.data_epoch, s.cursor) == (0, 4)
    s.advance(s.next_slice(1, 2))
    assert s.cursor == 8


@pytest.mark.parametrize("num_samples,batch", [(0, 4), (-1, 4), (10, 0), (10, -2), (10, 11)])
def test_bad_constructor_args_raise(num_samples, batch):
    with pytest.raises(ValueError, match="empty|positive|larger than the data set"):
        ElasticSampler(num_samples, batch)


@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), (0, 0), (5, 3)])
def test_rank_outside_world_raises(rank, world):
    with pytest.raises(ValueError, match="outside world"):
        ElasticSampler(10, 2).next_slice(rank, world)


@pytest.mark.parametrize("change", [{"num_samples": 11}, {"seed": 1}, {"shuffle": False}])
def test_load_state_dict_of_a_different_data_set_raises(change):
    src = ElasticSampler(10, 2, seed=0, shuffle=True)
    src.advance(src.next_slice(0, 1))
    dst = ElasticSampler(10, 3, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="different data set"):
        dst.load_state_dict({**src.state_dict(), **change})
    assert (dst.data_epoch, dst.cursor, dst.global_batch_size) == (0, 0, 3)  # untouched


def test_a_sources_order_with_ids_outside_the_data_set_is_refused():
    """(Kept in 4 bytes a sample, an id past the data set would otherwise wrap around.)"""
    import torch

    sampler = ElasticSampler(4, 2, order=lambda seed, epoch: [0, 1, 2, 2**31 + 1])
    with pytest.raises(ValueError, match=r"must hold the sample ids 0\.\.3"):
        sampler.next_slice(0, 1)
    tensor = ElasticSampler(4, 2, order=lambda seed, epoch: torch.tensor([3, 1, 0, 2]))
    assert tensor.next_slice(0, 1).global_indices == [3, 1]
