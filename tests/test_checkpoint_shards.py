"""Checkpoints of sharded state in one process: the pieces' arithmetic (:mod:`maitre.checkpoint.
reshard`) against torch's own, and saves and loads of DTensors on meshes of several ranks, each
rank played in turn on a fake process group (torch's ``fake`` backend: a mesh of any size, no
communication), its writer in its own thread as in a real save."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import xxhash

from maitre.checkpoint import Checkpointer, CheckpointConfig, UnusableCheckpoint, load, load_latest
from maitre.checkpoint import format as fmt
from maitre.checkpoint import reshard

pytestmark = pytest.mark.timeout(60)

SHARD0, SHARD1, REPLICATE = ["shard", 0], ["shard", 1], ["replicate"]


# -- the arithmetic ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,sizes,placements",
    [
        ((8, 3), (2,), [SHARD0]),
        ((7, 3), (3,), [SHARD0]),
        ((1, 32), (2,), [SHARD0]),
        ((2,), (4,), [SHARD0]),
        ((5, 6), (2, 3), [SHARD0, SHARD1]),
        ((9, 4), (2, 2), [SHARD0, SHARD0]),
        ((5, 6), (2, 2), [SHARD1, REPLICATE]),
        ((), (2,), [REPLICATE]),
    ],
)
def test_boxes_are_torchs_local_shards(shape, sizes, placements) -> None:
    """Each coordinate's box is the local shape and global offset DTensor gives it (uneven and
    empty chunks, two mesh dims on one tensor dim, replication)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    torch_placements = [Replicate() if p == REPLICATE else Shard(p[1]) for p in placements]
    for coordinate in itertools.product(*(range(k) for k in sizes)):
        local, offset = _compute_local_shape_and_global_offset(shape, sizes, list(coordinate), torch_placements)
        box = reshard.box_of(shape, placements, sizes, coordinate)
        assert box[1] == tuple(local), coordinate
        if reshard.numel(box):
            assert box[0] == tuple(offset), coordinate


def boxes(shape, sizes, placements):
    return [reshard.box_of(shape, placements, sizes, c) for c in itertools.product(*(range(k) for k in sizes))]


def test_cover_is_exact() -> None:
    assert reshard.check_cover((7, 3), boxes((7, 3), (3,), [SHARD0])) is None
    assert reshard.check_cover((5, 6), boxes((5, 6), (2, 3), [SHARD0, SHARD1])) is None
    assert reshard.check_cover((), [((), ())]) is None
    halves = boxes((8, 3), (2,), [SHARD0])
    assert "hold 12 of its 24 elements" in reshard.check_cover((8, 3), halves[:1])
    assert "overlap" in reshard.check_cover((8, 3), [*halves, ((3, 0), (2, 3))])
    assert "outside" in reshard.check_cover((8, 3), [*halves, ((8, 0), (1, 3))])
    assert "outside" in reshard.check_cover((8, 3), [((0,), (24,))])  # another rank


def test_cut_reshards_any_layout_onto_any_other() -> None:
    full = torch.arange(5 * 6, dtype=torch.float64).view(5, 6)
    saved = boxes((5, 6), (2, 3), [SHARD0, SHARD1])
    pieces = [(b, full[b[0][0] : b[0][0] + b[1][0], b[0][1] : b[0][1] + b[1][1]].clone()) for b in saved]
    for target in [reshard.whole((5, 6)), *boxes((5, 6), (3,), [SHARD1]), *boxes((5, 6), (4,), [SHARD0])]:
        (r, c), (h, w) = target
        assert torch.equal(reshard.cut(target, pieces, torch.float64), full[r : r + h, c : c + w])
    assert reshard.cut(saved[0], pieces, torch.float64) is pieces[0][1]  # no copy


# -- saves and loads on fake meshes ----------------------------------------------------------------
FULL = {
    "w": torch.arange(7 * 3, dtype=torch.float64).view(7, 3),  # uneven over 2 and 3
    "b": torch.arange(3, dtype=torch.float32),  # an empty piece over 4
    "m": torch.arange(4 * 6, dtype=torch.float64).view(4, 6),
}  # sharded on dim 1
PLACED = {"w": [SHARD0], "b": [SHARD0], "m": [SHARD1]}


class FakeMesh:
    """One rank of a mesh of ``sizes`` (dims dp_shard, tp) on the fake backend, for a ``with``."""

    def __init__(self, sizes: tuple[int, int], rank: int) -> None:
        self.sizes, self.rank = sizes, rank

    def __enter__(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.sizes[0] * self.sizes[1])
        return init_device_mesh("cpu", self.sizes, mesh_dim_names=("dp_shard", "tp"))

    def __exit__(self, *exc) -> None:
        dist.destroy_process_group()


def sharded_state(mesh, step: int = 6, **override) -> dict:
    """FSDP2's layout: every tensor sharded on ``dp_shard`` (replicated over ``tp``), a plain
    tensor and plain values beside them."""
    from torch.distributed.tensor import distribute_tensor, Replicate, Shard

    model = {}
    for name, full in FULL.items():
        placements = [Shard(p[1]) for p in PLACED[name]] + [Replicate()]
        model[name] = distribute_tensor(full, mesh, placements, src_data_rank=None)
        model[name].to_local().copy_(
            reshard.cut(
                reshard.box_of(full.shape, PLACED[name] + [REPLICATE], mesh.shape, mesh.get_coordinate()),
                [(reshard.whole(full.shape), full)],
                full.dtype,
            )
        )
    state = {"model": model, "plain": torch.tensor([1.5, 2.5]), "step": step, "sampler": {"cursor": 48}}
    state.update(override)
    return state


def save_sharded(root: Path, sizes: tuple[int, int], step: int = 6, state=sharded_state, **cfg) -> list:
    """Every rank of a mesh of ``sizes`` saves its part (rank 0 last: it commits)."""
    world = sizes[0] * sizes[1]
    ckpts = [Checkpointer(CheckpointConfig(directory=root, **cfg), log=lambda _: None) for _ in range(world)]
    for rank in [*range(1, world), 0]:
        with FakeMesh(sizes, rank) as mesh:
            ckpts[rank].save(state(mesh, step), step=step, rank=rank, world_size=world, token=3)
    results = [ck.wait() for ck in ckpts]
    for ck in ckpts:
        ck.close()
    return results


def expected_piece(name: str, mesh) -> torch.Tensor:
    box = reshard.box_of(FULL[name].shape, PLACED[name] + [REPLICATE], mesh.shape, mesh.get_coordinate())
    return reshard.cut(box, [(reshard.whole(FULL[name].shape), FULL[name])], FULL[name].dtype)


def test_each_rank_writes_its_pieces_and_the_commit_lists_them_all(tmp_path: Path) -> None:
    results = save_sharded(tmp_path / "ckpt", (2, 2))
    path = results[0][0].path
    assert path == tmp_path / "ckpt" / "step-000000006"
    assert all(r[0].error is None for r in results), results
    manifest = fmt.read_manifest(path)
    assert manifest["format"] == fmt.FORMAT_SHARDED and manifest["world_size"] == 4
    # tp rank 1 holds the same pieces as tp rank 0: only the first of them writes
    assert sorted(p.name for p in path.glob("shard-*")) == [fmt.shard_name(0), fmt.shard_name(2)]
    tensors = json.loads((path / fmt.STATE).read_bytes())["tensors"]
    by_shape = {tuple(t[1]): t[2] for t in tensors}
    assert by_shape[(7, 3)] == [[0, [0, 0], [4, 3]], [2, [4, 0], [3, 3]]]
    assert by_shape[(3,)] == [[0, [0], [2]], [2, [2], [1]]]
    assert by_shape[(2,)] == 0  # the plain tensor, whole, by rank 0
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))


@pytest.mark.parametrize("sizes", [(1, 1), (3, 1), (4, 1), (2, 2), (1, 2)])
def test_a_sharded_checkpoint_loads_on_any_mesh(tmp_path: Path, sizes) -> None:
    save_sharded(tmp_path / "ckpt", (2, 2))
    for rank in range(sizes[0] * sizes[1]):
        with FakeMesh(sizes, rank) as mesh:
            loaded = load_latest(tmp_path / "ckpt", rank, mesh_of=lambda names: mesh[names])
            assert loaded is not None and loaded.step == 6
            for name in FULL:
                t = loaded.tree["model"][name]
                assert t.shape == FULL[name].shape and t.device_mesh.shape == sizes
                assert [getattr(p, "dim", None) for p in t.placements] == [PLACED[name][0][1], None]
                assert torch.equal(t.to_local(), expected_piece(name, mesh)), (name, rank)
            assert torch.equal(loaded.tree["plain"], torch.tensor([1.5, 2.5]))
            assert loaded.tree["sampler"] == {"cursor": 48}


def test_what_comes_from_a_shard_used_in_part_does_not_keep_it_in_memory(tmp_path: Path) -> None:
    """Rank 1 reads rank 0's shard for the plain tensor only: it gets a copy, not a view that
    would keep rank 0's pieces alive; its own shard it uses whole, as views."""
    save_sharded(tmp_path / "ckpt", (2, 1))
    with FakeMesh((2, 1), 1) as mesh:
        loaded = load(tmp_path / "ckpt" / "step-000000006", 1, mesh_of=lambda n: mesh[n])
    plain = loaded.tree["plain"]
    assert plain.untyped_storage().nbytes() == plain.nbytes
    w = loaded.tree["model"]["w"].to_local()
    assert w.untyped_storage().nbytes() > w.nbytes


def test_without_a_mesh_sharded_tensors_load_whole(tmp_path: Path) -> None:
    save_sharded(tmp_path / "ckpt", (2, 1))
    loaded = load(tmp_path / "ckpt" / "step-000000006")
    for name, full in FULL.items():
        assert type(loaded.tree["model"][name]) is torch.Tensor
        assert torch.equal(loaded.tree["model"][name], full)


def rewrite(path: Path, edit) -> None:
    """Change state.json with ``edit`` and make the manifest vouch for it again (what a hand
    put together, or other code, could leave: every checksum right)."""
    state = json.loads((path / fmt.STATE).read_bytes())
    edit(state)
    (path / fmt.STATE).unlink()
    size, digest = fmt.write_json(path / fmt.STATE, state)
    body = fmt.read_manifest(path)
    body["files"][fmt.STATE] = {"size": size, "xxh3_64": digest}
    (path / fmt.MANIFEST).unlink()
    fmt.write_manifest(path / fmt.MANIFEST, body)


def test_shards_that_do_not_cover_a_tensor_are_refused_not_skipped(tmp_path: Path) -> None:
    """A checkpoint whose pieces leave a hole is refused with the tensor's name, even with an
    older good one beside it: it is not damage to fall back from."""
    save_sharded(tmp_path / "ckpt", (2, 1), step=4)
    save_sharded(tmp_path / "ckpt", (2, 1), step=6)
    newest = tmp_path / "ckpt" / "step-000000006"

    def drop_a_piece(state: dict) -> None:
        index = state["skeleton"]["model"]["w"]["__dtensor__"]
        state["tensors"][index][2].pop()

    rewrite(newest, drop_a_piece)
    with FakeMesh((2, 1), 0) as mesh:
        with pytest.raises(
            UnusableCheckpoint,
            match=r"is refused: its shards do not cover "
            r"model\.w \(shape \[7, 3\]\): its pieces hold 12 of its 21 elements",
        ):
            load_latest(tmp_path / "ckpt", mesh_of=lambda names: mesh[names], log=pytest.fail)


def test_a_piece_outside_its_tensor_or_a_foreign_mesh_is_refused(tmp_path: Path) -> None:
    save_sharded(tmp_path / "ckpt", (2, 1))
    path = tmp_path / "ckpt" / "step-000000006"
    with FakeMesh((2, 1), 0) as mesh:

        def foreign(names):
            raise KeyError(f"no mesh dims {names}")

        with pytest.raises(UnusableCheckpoint, match="sharded on mesh dims"):
            load(path, mesh_of=foreign)

        def widen(state: dict) -> None:
            state["tensors"][state["skeleton"]["model"]["w"]["__dtensor__"]][2][1][1] = [5, 0]

        rewrite(path, widen)
        with pytest.raises(UnusableCheckpoint, match="lies outside"):
            load(path, mesh_of=lambda names: mesh[names])


def test_a_shard_that_holds_other_pieces_than_listed_is_corrupt(tmp_path: Path) -> None:
    save_sharded(tmp_path / "ckpt", (2, 1))
    path = tmp_path / "ckpt" / "step-000000006"

    def swap(state: dict) -> None:  # w's pieces said to be in each other's shard
        pieces = state["tensors"][state["skeleton"]["model"]["w"]["__dtensor__"]][2]
        pieces[0][0], pieces[1][0] = pieces[1][0], pieces[0][0]

    rewrite(path, swap)
    with pytest.raises(fmt.CorruptCheckpoint, match="does not match state.json"):
        load(path)


def test_the_processes_of_a_replica_agree_on_the_checkpoint(tmp_path: Path) -> None:
    """One that any of them could not load (its shards differ) is skipped by all."""
    save_sharded(tmp_path / "ckpt", (2, 1), step=4)
    save_sharded(tmp_path / "ckpt", (2, 1), step=6)
    votes: list[bool] = []
    warnings: list[str] = []

    def agree(ok: bool) -> bool:  # the other process failed the first one it tried
        votes.append(ok)
        return ok and len(votes) > 1

    with FakeMesh((2, 1), 0) as mesh:
        loaded = load_latest(tmp_path / "ckpt", mesh_of=lambda names: mesh[names], agree=agree, log=warnings.append)
    assert loaded is not None and loaded.step == 4 and votes == [True, True]
    assert len(warnings) == 1 and "another process of this replica could not load it" in warnings[0]


def test_ranks_that_saved_other_states_commit_nothing(tmp_path: Path) -> None:
    def odd(mesh, step):  # rank 1's plain tensor has another shape
        return sharded_state(mesh, step, plain=torch.zeros(3 if dist.get_rank() else 2))

    results = save_sharded(tmp_path / "ckpt", (2, 1), state=odd)
    assert results[0][0].path is None
    assert "rank 1 saved other tensors than rank 0" in results[0][0].error
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_unsharded_checkpoints_are_the_format_they_were(tmp_path: Path) -> None:
    ck = Checkpointer(CheckpointConfig(directory=tmp_path))
    ck.save({"w": torch.ones(3), "step": 1}, step=1, rank=0, world_size=1, token=1)
    ck.close()
    body = fmt.read_manifest(tmp_path / "step-000000001")
    assert body["format"] == "maitre-checkpoint/1"
    state = (tmp_path / "step-000000001" / fmt.STATE).read_bytes()
    assert xxhash.xxh3_64_hexdigest(state) == body["files"][fmt.STATE]["xxh3_64"]
    assert json.loads(state)["tensors"] == [["F32", [3], 0]]
