"""Checkpoints in one process: format, full state, split across ranks (ranks as threads),
verification and fallback, retention, and the interval policy."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from maitre.checkpoint import CheckpointConfig, Checkpointer, IntervalConfig, load, load_latest
from maitre.checkpoint import format as fmt
from maitre.checkpoint.policy import IntervalPolicy, daly_interval_s
from maitre.checkpoint.snapshot import plan, split
from maitre.runtime.sampler import ElasticSampler
from maitre.runtime.scaling import LinearScaling
from maitre.runtime.state import TrainState, storage, updated_storages


class Counter:
    """A user-registered extra."""

    def __init__(self) -> None:
        self.seen = 0
        self.history: list[float] = []

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.history = state["seen"], list(state["history"])


def make_state(seed: int = 0, steps: int = 3) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.register_buffer("scale", torch.arange(4, dtype=torch.float64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = ElasticSampler(100, 10, seed=0)
    scaling = LinearScaling(per_rank_batch_size=4, base_world_size=2, warmup_steps=5)
    extra = Counter()
    state = TrainState(model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, scaling=scaling)
    state.register("counter", extra)
    for _ in range(steps):
        slc = sampler.next_slice(0, 1)
        model(torch.randn(len(slc.local_indices), 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        sampler.advance(slc)
        scaling.on_resize(3, state.step)
        extra.seen += len(slc.local_indices)
        extra.history.append(random.random())
        state.step += 1
    return state


def config(tmp_path: Path, **kw) -> CheckpointConfig:
    return CheckpointConfig(directory=tmp_path / "ckpt", **kw)


def save(state: TrainState, ck: Checkpointer, *, rank: int = 0, world: int = 1, token: int = 7) -> None:
    ck.save(state.state_dict, step=state.step, rank=rank, world_size=world, token=token)


def assert_same_state(a: TrainState, b: TrainState) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for name in ("model", "scaling", "sampler", "counter", "lr_scheduler"):
        assert repr(sa[name]) == repr(sb[name]), name
    oa, ob = sa["optimizer"], sb["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]
    for k in oa["state"]:
        for key, value in oa["state"][k].items():
            assert torch.equal(value, ob["state"][k][key]), (k, key)
    assert a.step == b.step


def test_full_state_round_trip(tmp_path: Path) -> None:
    np.random.seed(3)
    state = make_state(steps=5)
    random.seed(11)
    torch.manual_seed(12)
    ck = Checkpointer(config(tmp_path))
    save(state, ck)
    assert ck.wait()[0].error is None
    expected = (random.random(), torch.rand(3), np.random.rand())  # what the RNGs give next

    fresh = make_state(seed=1, steps=0)
    loaded = load_latest(tmp_path / "ckpt")
    assert loaded is not None and loaded.step == 5
    fresh.load_state_dict(loaded.tree)
    assert_same_state(fresh, state)
    assert fresh.objects["sampler"].cursor == state.objects["sampler"].cursor == 50
    got = (random.random(), torch.rand(3), np.random.rand())
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and got[2] == expected[2]
    ck.close()


def test_shards_are_safetensors(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    state = make_state()
    ck = Checkpointer(config(tmp_path))
    save(state, ck)
    ck.close()
    directory = tmp_path / "ckpt" / "step-000000003"
    tensors = safetensors.load_file(str(directory / "shard-00000.safetensors"))
    specs = json.loads((directory / "state.json").read_bytes())["tensors"]
    assert len(tensors) == len(specs)
    weight = state.objects["model"].state_dict()["0.weight"]
    assert any(torch.equal(t, weight) for t in tensors.values())


def run_ranks(world: int, fn) -> None:
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def test_replicated_state_is_split_across_ranks_and_loads_at_any_world_size(tmp_path: Path) -> None:
    world = 3
    states = [make_state(steps=4) for _ in range(world)]
    for s in states:
        s.objects["counter"].seen = 123
    rngs = []
    results = {}

    def rank_fn(rank: int) -> None:
        ck = Checkpointer(config(tmp_path))
        with lock:
            torch.manual_seed(100 + rank)
            tree = states[rank].state_dict()
            rngs.append((rank, tree["rng"]["torch"].clone()))
        ck.save(tree, step=4, rank=rank, world_size=world, token=99)
        results[rank] = ck.wait()
        ck.close()

    lock = threading.Lock()
    run_ranks(world, rank_fn)
    assert results[0][0].path == tmp_path / "ckpt" / "step-000000004"
    assert all(results[r][0].error is None for r in range(world))
    directory = results[0][0].path
    shards = sorted(p.name for p in directory.glob("shard-*"))
    assert shards == [fmt.shard_name(r) for r in range(world)]
    sizes = [(directory / s).stat().st_size for s in shards]
    total = sum(sizes)
    assert max(sizes) < 0.6 * total, sizes  # each rank wrote a part, not the whole
    manifest = fmt.read_manifest(directory)
    assert set(manifest["files"]) == {*shards, "state.json", *(fmt.rank_name(r) for r in range(3))}
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))

    by_rank = dict(rngs)
    for new_world in (2, 5):
        for rank in range(new_world):
            loaded = load(directory, rank)
            fresh = make_state(seed=5, steps=0)
            fresh.load_state_dict(loaded.tree)
            assert_same_state(fresh, states[0])
            assert torch.equal(loaded.tree["rng"]["torch"], by_rank[rank % world])


def test_plan_balances_bytes() -> None:
    owner = plan([100, 10, 10, 60, 40, 30], 3)
    load = [0, 0, 0]
    for size, r in zip([100, 10, 10, 60, 40, 30], owner):
        load[r] += size
    assert sorted(load) == [70, 80, 100]  # the 100 is one tensor: the others share the rest
    assert plan([5, 5], 1) == [0, 0]


def test_what_only_the_update_writes_is_told_from_what_a_step_may_write() -> None:
    """A save's GPU copy of the optimizer's parameters and state runs on through the next
    forward and backward (fenced before the update); what the step may write before (a
    batch-norm's running statistics, a frozen teacher's weights the script updates, an
    embedding renormalized in place by its forward) must be copied first. The state tree's
    tensors are told apart by their storage. A streamed join's snapshot copies the same way."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(10, 4, max_norm=1.0),  # its forward writes its weight
            "net": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)),
            "teacher": torch.nn.Linear(8, 2),  # not the optimizer's: an EMA the body updates
        }
    )
    opt = torch.optim.AdamW([*model["emb"].parameters(), *model["net"].parameters()], lr=0.1)
    model["net"](model["emb"](torch.arange(16) % 10)).sum().backward()
    opt.step()
    tree = TrainState(model=model, optimizer=opt).state_dict()
    updated = updated_storages(model, opt)
    late = {
        path
        for path, t in [
            *tree["model"].items(),
            *((f"opt.{i}.{k}", v) for i, s in tree["optimizer"]["state"].items() for k, v in s.items()),
        ]
        if storage(t) in updated
    }
    assert late == {
        *(f"net.{i}.{k}" for i in range(3) for k in ("weight", "bias")),
        *(f"opt.{i}.{k}" for i in range(7) for k in ("step", "exp_avg", "exp_avg_sq")),
    }
    early = [t for t in split(tree, 0, 1).tensors if storage(t) not in updated]
    assert {storage(t) for t in early} == {
        storage(t)
        for t in (
            model["emb"].weight,
            model["net"][1].running_mean,
            model["net"][1].running_var,
            model["net"][1].num_batches_tracked,
            model["teacher"].weight,
            model["teacher"].bias,
        )
    }


def two_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    state = make_state(steps=2)
    ck = Checkpointer(config(tmp_path))
    save(state, ck)
    state.step = 4
    save(state, ck)
    ck.close()
    return tmp_path / "ckpt" / "step-000000002", tmp_path / "ckpt" / "step-000000004"


def flip_byte(path: Path, offset_from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_in_tensor_data_is_detected(tmp_path: Path) -> None:
    older, newer = two_checkpoints(tmp_path)
    shard = newer / "shard-00000.safetensors"
    flip_byte(shard)
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.load_file(str(shard))  # the format itself has no checksum: loads silently
    warnings: list[str] = []
    loaded = load_latest(tmp_path / "ckpt", log=warnings.append)
    assert loaded is not None and loaded.path == older
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0] and "step-000000004" in warnings[0]


def _truncate(d: Path) -> None:
    shard = d / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])


def _garble_manifest(d: Path) -> None:
    doc = json.loads((d / "manifest.json").read_bytes())
    doc["body"]["step"] = 5
    (d / "manifest.json").write_text(json.dumps(doc))


def _swap_state(d: Path) -> None:
    (d / "state.json").write_text((d / "state.json").read_text().replace('"step":4', '"step":5'))


DAMAGE = {
    "truncated shard": (_truncate, "has"),
    "missing shard": (lambda d: (d / "shard-00000.safetensors").unlink(), "missing"),
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), "no manifest"),
    "manifest not json": (lambda d: (d / "manifest.json").write_text("{"), "not valid JSON"),
    "manifest altered": (_garble_manifest, "manifest's checksum"),
    "state altered": (_swap_state, "checksum mismatch"),
    "rank file altered": (lambda d: flip_byte(d / "rank-00000.json", 3), "checksum mismatch"),
    "empty directory": (lambda d: [p.unlink() for p in d.iterdir()], "no manifest"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path, damage: str) -> None:
    older, newer = two_checkpoints(tmp_path)
    fn, reason = DAMAGE[damage]
    fn(newer)
    warnings: list[str] = []
    loaded = load_latest(tmp_path / "ckpt", log=warnings.append)
    assert loaded is not None and loaded.path == older and loaded.step == 2
    assert len(warnings) == 1 and reason in warnings[0], warnings


def test_nothing_loadable(tmp_path: Path) -> None:
    assert load_latest(tmp_path / "absent") is None
    older, newer = two_checkpoints(tmp_path)
    (older / "manifest.json").unlink()
    (newer / "manifest.json").unlink()
    warnings: list[str] = []
    assert load_latest(tmp_path / "ckpt", log=warnings.append) is None
    assert len(warnings) == 2


def save_step_4_again(tmp_path: Path):
    """Another state of step 4 saved over :func:`two_checkpoints`: (the state, the save's
    result, the checkpointer's log lines)."""
    state = make_state(seed=9, steps=4)
    lines: list[str] = []
    ck = Checkpointer(config(tmp_path), log=lines.append)
    save(state, ck)
    result = ck.wait()[0]
    ck.close()
    return state, result, lines


def test_never_overwrites_a_checkpoint(tmp_path: Path) -> None:
    older, newer = two_checkpoints(tmp_path)
    before = {p.name: p.read_bytes() for p in newer.iterdir()}
    state, result, errors = save_step_4_again(tmp_path)
    assert result.path is None and "already exists" in (result.error or "")
    assert {p.name: p.read_bytes() for p in newer.iterdir()} == before
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    assert errors and "training goes on" in errors[0]


def test_a_save_of_a_step_whose_checkpoint_is_corrupt_sets_that_one_aside(tmp_path: Path) -> None:
    """A run that resumed from step 2 because step 4 did not verify saves step 4 again: the
    corrupt one is renamed out of the way (kept for a look), the new one takes its name."""
    older, newer = two_checkpoints(tmp_path)
    flip_byte(newer / fmt.shard_name(0))
    state, result, lines = save_step_4_again(tmp_path)
    assert result.path == newer and result.error is None, result
    fmt.verify(newer)
    aside = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".corrupt-")]
    assert len(aside) == 1 and aside[0].startswith(".corrupt-step-000000004-"), aside
    assert any("did not verify" in line and aside[0] in line for line in lines), lines
    loaded, fresh = load_latest(tmp_path / "ckpt"), make_state(seed=1, steps=0)
    assert loaded is not None and loaded.path == newer
    fresh.load_state_dict(loaded.tree)
    assert_same_state(fresh, state)
    state.step = 9  # once its step is older than every checkpoint kept, it goes too
    ck = Checkpointer(config(tmp_path, keep=1))
    save(state, ck, token=9)
    ck.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000009"]


def test_keeps_the_newest_k(tmp_path: Path) -> None:
    state = make_state(steps=0)
    ck = Checkpointer(config(tmp_path, keep=2))
    for step in range(1, 6):
        state.step = step
        save(state, ck, token=step)
    ck.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000004", "step-000000005"]


def test_a_rank_that_never_reports_fails_the_save_not_training(tmp_path: Path) -> None:
    state = make_state(steps=2)
    errors: list[str] = []
    ck = Checkpointer(config(tmp_path, commit_timeout_s=0.3), log=errors.append)
    block = ck.save(state.state_dict, step=2, rank=0, world_size=2, token=1)
    assert block < 1.0
    result = ck.wait()[0]
    ck.close()
    assert result.path is None and "rank 1 did not finish" in (result.error or "")
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_rank_killed_mid_save_holds_the_commit_only_as_long_as_parts_take(tmp_path: Path, monkeypatch) -> None:
    """Ranks write their parts at once: one that takes far longer than the committer's own is
    gone (killed mid-save, its part never comes). The commit gives up after max(floor, 20x its
    own part's time), not ``commit_timeout_s``, which would skip every save meanwhile (a busy
    writer vetoes them): the chaos run saw ten minutes of no checkpoint after such a kill."""
    from maitre.checkpoint import writer

    monkeypatch.setattr(writer, "COMMIT_WAIT_FLOOR_S", 0.5)
    state = make_state(steps=2)
    ck = Checkpointer(config(tmp_path, commit_timeout_s=600), log=lambda line: None)
    started = time.monotonic()
    ck.save(state.state_dict, step=2, rank=0, world_size=2, token=1)
    result = ck.wait()[0]
    waited = time.monotonic() - started
    ck.close()
    assert result.path is None and "rank 1 did not finish" in (result.error or "")
    assert waited < 30, waited  # (0.5 s here; 600 s before)


def test_a_save_whose_epoch_was_lost_is_given_up_at_once(tmp_path: Path) -> None:
    """The loop lost its epoch under a save (a rank died mid-save): the committer stops waiting
    for the parts at once, and the next save is not held back."""
    state = make_state(steps=2)
    ck = Checkpointer(config(tmp_path, commit_timeout_s=600), log=lambda line: None)
    started = time.monotonic()
    ck.save(state.state_dict, step=2, rank=0, world_size=2, token=1)
    time.sleep(0.2)
    ck.abandon("peer failed")
    result = ck.wait()[0]
    assert time.monotonic() - started < 10
    assert result.path is None and "given up waiting for rank 1's part: peer failed" in (result.error or ""), result
    state.step = 3  # the writer is free for the next one, which waits for nothing old
    ck.save(state.state_dict, step=3, rank=0, world_size=1, token=2)
    again = ck.wait()[-1]
    ck.close()
    assert again.error is None and again.path is not None


def test_a_rank_that_fails_aborts_the_commit_at_once(tmp_path: Path) -> None:
    state = make_state(steps=2)
    ck = Checkpointer(config(tmp_path, commit_timeout_s=30), log=lambda line: None)
    tmp = tmp_path / "ckpt" / fmt.tmp_dir_name(2, 5)
    tmp.mkdir(parents=True)
    (tmp / "rank-00001.failed").write_text(json.dumps({"error": "[Errno 28] No space left"}))
    ck.save(state.state_dict, step=2, rank=0, world_size=2, token=5)
    result = ck.wait()[0]
    ck.close()
    assert result.path is None and "No space left" in (result.error or "")


# -- the interval policy -------------------------------------------------------------------------
def test_daly_interval() -> None:
    # sqrt(2 * 10 * 3600) = 268.3; Daly's correction: * (1 + sqrt(10/7200)/3 + 10/7200/9) - 10
    assert daly_interval_s(10, 3600) == pytest.approx(261.70, abs=0.01)
    assert daly_interval_s(0.01, 3600) == pytest.approx((2 * 0.01 * 3600) ** 0.5, rel=0.01)
    assert daly_interval_s(100, 40) == 40  # cost beyond 2 M: checkpoint once per MTBF
    assert daly_interval_s(0, 100) == 0


def test_policy_uses_measured_cost_and_failure_history() -> None:
    policy = IntervalPolicy(IntervalConfig(min_interval_s=1, max_interval_s=10_000, prior_mtbf_s=3600), now=0.0)
    assert policy.interval_s() == 1  # nothing measured: the first save measures the cost
    for _ in range(10):
        policy.record_step(0.1, writer_busy=False)
    policy.started(step=10, now=5.0, block_s=0.2)
    policy.record_step(0.4, writer_busy=True)  # 0.3 s slower while the writer ran
    policy.record_step(0.1, writer_busy=True)
    policy.finished()
    assert policy.cost_s == pytest.approx(0.5)
    assert policy.interval_s() == pytest.approx(daly_interval_s(0.5, 3600))
    policy.observe_history(failures=3, age_s=400)
    assert policy.mtbf_s() == pytest.approx(1000)
    assert policy.interval_s() == pytest.approx(daly_interval_s(0.5, 1000))
    assert not policy.due(11, now=5.0 + 20)
    assert policy.due(11, now=5.0 + 40)
    assert not policy.due(10, now=1e9)  # never the step already saved


def test_policy_bounds_and_fixed_steps() -> None:
    bounded = IntervalPolicy(IntervalConfig(mtbf_s=1e9, max_interval_s=600), now=0.0)
    bounded.started(1, 0.0, 5.0)
    bounded.finished()
    assert bounded.interval_s() == 600
    fixed = IntervalPolicy(IntervalConfig(every_steps=5), now=0.0)
    assert [s for s in range(1, 16) if fixed.due(s, 0.0) and fixed.started(s, 0.0, 0.0) is None] == [5, 10, 15]


@pytest.mark.parametrize("bad", [dict(every_steps=0), dict(mtbf_s=0), dict(min_interval_s=5, max_interval_s=1)])
def test_interval_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        IntervalConfig(**bad)


def test_checkpoint_config_from_environment(tmp_path: Path) -> None:
    assert CheckpointConfig.from_environ({}) is None
    cfg = CheckpointConfig.from_environ(
        {
            "MAITRE_CHECKPOINT_DIR": str(tmp_path),
            "MAITRE_CHECKPOINT_EVERY": "7",
            "MAITRE_MTBF_S": "60",
            "MAITRE_CHECKPOINT_KEEP": "5",
        }
    )
    assert cfg is not None and cfg.directory == tmp_path and cfg.keep == 5
    assert cfg.interval.every_steps == 7 and cfg.interval.mtbf_s == 60
    with pytest.raises(ValueError):
        CheckpointConfig(directory=tmp_path, keep=0)


def test_leftovers_of_killed_saves_and_deletions_are_ignored_then_removed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    older, newer = two_checkpoints(tmp_path)
    (root / ".deleting-step-000000001").mkdir()  # a kill halfway through deleting an old one
    (root / ".deleting-step-000000001" / "manifest.json").write_text("{}")
    (root / fmt.tmp_dir_name(3, 11)).mkdir()  # a kill before the rename
    assert load_latest(root, log=pytest.fail).path == newer
    state = make_state(steps=0)
    state.step = 6
    ck = Checkpointer(config(tmp_path))
    save(state, ck)
    ck.close()
    assert sorted(p.name for p in root.iterdir()) == [older.name, newer.name, "step-000000006"]


def test_prepare_sizes_the_buffer_for_this_ranks_part_in_the_background(tmp_path: Path) -> None:
    state = make_state(steps=1)
    ck = Checkpointer(config(tmp_path))
    ck.prepare(state.state_dict, rank=1, world_size=3)
    ck.wait()
    from maitre.checkpoint.snapshot import part_bytes

    need, on_gpu = part_bytes(state.state_dict(), 1, 3)
    total, _ = part_bytes(state.state_dict(), 0, 1)
    assert not on_gpu and 0 < need < total and ck._buffers.capacity == need
    ck.prepare(state.state_dict, rank=1, world_size=3)  # done already: nothing to do
    assert not ck.busy
    ck.close()
