"""Replicas that span processes (:mod:`maitre.runtime.replica`): FSDP2 inside each replica,
maitre's gradient allreduce across them, with the global count as the divisor.

Under torchrun the world is split into replicas of ``dp_shard`` processes; the final parameters
must equal one process's (float64, clipped by the global norm) whatever the split. What a
replica gets wrong is refused before training."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, play, relative_error, run_tagged

SCRIPT = ROOT / "tests" / "scripts" / "sharded_mlp.py"
pytestmark = pytest.mark.timeout(300)


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(SCRIPT),
        *args,
    ]


class MaxOverThreads:
    """An allreduce (max) between ``n`` threads: what a replica's group does for its processes."""

    def __init__(self, n: int) -> None:
        import threading

        self.barrier = threading.Barrier(n, timeout=10)
        self.flags: list[torch.Tensor] = []
        self.rounds = 0

    def __call__(self, flag: torch.Tensor) -> None:
        self.flags.append(flag.clone())
        if self.barrier.wait() == 0:
            self.rounds += 1
        flag.copy_(torch.stack(self.flags).amax(0))
        self.barrier.wait()
        if self.barrier.wait() == 0:
            self.flags.clear()
        self.barrier.wait()


@pytest.mark.timeout(30)
def test_a_replicas_processes_told_different_epochs_meet_in_the_newer_one() -> None:
    """The coordinator told one process epoch 4 and the other, which asked a moment before,
    epoch 3 (closed since): the one behind goes round again, the one ahead waits for it in the
    next round, and both train in epoch 4. A process whose group did not form sends both round
    again. (Trained on, the two would pair their replica's collectives across epochs: the
    replicas benchmark's crash hung that way in CI.)"""
    import threading

    from maitre.runtime.replica import same_epoch

    reduce_max = MaxOverThreads(2)
    said: dict[str, list[str | None]] = {"ahead": [], "behind": []}

    def ahead() -> None:
        said["ahead"].append(same_epoch(True, 4, reduce_max))

    def behind() -> None:
        why = same_epoch(True, 3, reduce_max)
        said["behind"].append(why)
        if why is not None:  # its rendezvous again: the coordinator tells it epoch 4
            said["behind"].append(same_epoch(True, 4, reduce_max))

    threads = [threading.Thread(target=f) for f in (ahead, behind)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert said == {"ahead": [None], "behind": ["another process of this replica is in epoch 4 already", None]}
    assert reduce_max.rounds == 2
    reduce_max = MaxOverThreads(2)
    lost: list[str | None] = []
    threads = [
        threading.Thread(target=lambda ok=ok: lost.append(same_epoch(ok, 5, reduce_max))) for ok in (True, False)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert lost == ["another process of this replica lost the epoch as it formed"] * 2


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("alone") / "final.pt"
    result = run_tagged([sys.executable, str(SCRIPT), "--out", str(out)], timeout=200)
    assert result.returncode == 0, result.stderr
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize(
    "nproc,dp_shard",
    [
        pytest.param(4, 2, marks=pytest.mark.slow),
        pytest.param(2, 2, marks=pytest.mark.slow),
        pytest.param(2, 1, marks=pytest.mark.slow),
    ],  # (the default suite's time: FSDP2 replicas
    ids=["2 replicas of 2", "1 replica of 2", "2 replicas of 1"],
)  # under maitre run below, and
# under torchrun in test_replica_checkpoints.py's saved checkpoint)
def test_fsdp_replicas_under_torchrun_match_one_process(tmp_path: Path, alone, nproc: int, dp_shard: int) -> None:
    out = tmp_path / "final.pt"
    result = run_tagged(
        torchrun(nproc, "--dp-shard", str(dp_shard), "--out", str(out)),
        timeout=240,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    error = relative_error(torch.load(out, weights_only=True), alone)
    assert error <= 1e-12, error


@pytest.mark.slow  # (the default suite: fp16 over FSDP2 replicas under maitre run, below)
def test_fp16_overflows_are_decided_alike_by_every_process_of_every_replica(tmp_path: Path) -> None:
    """The loss scaler over sharded gradients: each process checks its own shards, the replica
    adds up the verdicts, so a step that overflowed anywhere is skipped everywhere (float64, a
    scale that overflows the first steps: the same skips and parameters as one process)."""
    alone, two = tmp_path / "alone.pt", tmp_path / "two.pt"
    result = run_tagged([sys.executable, str(SCRIPT), "--loss-scale", "1e308", "--out", str(alone)], timeout=120)
    assert result.returncode == 0, result.stderr
    skipped = result.stdout.strip().rsplit(", ", 1)[1]
    assert skipped != "0 skipped", result.stdout
    result = run_tagged(
        torchrun(4, "--dp-shard", "2", "--loss-scale", "1e308", "--out", str(two)),
        timeout=240,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.strip().endswith(skipped), result.stdout
    error = relative_error(torch.load(two, weights_only=True), torch.load(alone, weights_only=True))
    assert error <= 1e-12, error


def test_a_world_that_does_not_split_into_replicas_is_refused(tmp_path: Path) -> None:
    result = run_tagged(
        torchrun(3, "--dp-shard", "2", "--out", str(tmp_path / "x.pt")),
        timeout=240,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    assert result.returncode != 0
    assert "a world of 3 processes does not split into replicas of 2" in result.stderr
    assert not (tmp_path / "x.pt").exists()


def test_a_mesh_larger_than_one_process_is_refused_alone(tmp_path: Path) -> None:
    result = run_tagged([sys.executable, str(SCRIPT), "--dp-shard", "2", "--out", str(tmp_path / "x.pt")], timeout=120)
    assert result.returncode != 0
    assert "a mesh of 2 processes (dp_shard=2,tp=1) needs as many processes" in result.stderr


def test_the_mesh_spec_reads_and_checks_its_sizes() -> None:
    from maitre.runtime.replica import MeshSpec

    assert MeshSpec.parse("dp_shard=4,tp=2") == MeshSpec(4, 2)
    assert MeshSpec.parse("tp=2").nproc == 2 and str(MeshSpec(4, 2)) == "dp_shard=4,tp=2"
    for bad in ("dp=4", "dp_shard=x", "dp_shard=0"):
        with pytest.raises(ValueError, match="mesh"):
            MeshSpec.parse(bad)
    with pytest.raises(ValueError, match="the mesh dp_shard=4,tp=2 has 8 processes, the replica has 4"):
        MeshSpec(4, 2).check(4)


# -- under maitre: replicas of two processes that crash, hang, join and leave ------------------------
def run_replicas(
    tmp_path: Path, events: str, steps: int, *, nodes: int, max_nodes: int = 3, extra: tuple[str, ...] = ()
) -> tuple[int, list[str], object]:
    command = [
        sys.executable,
        str(SCRIPT),
        "--dp-shard",
        "2",
        "--steps",
        str(steps),
        "--out",
        str(tmp_path / "final.pt"),
        *extra,
    ]
    return play(
        tmp_path,
        command,
        events,
        min_nodes=1,
        max_nodes=max_nodes,
        local_nodes=nodes,
        nproc_per_node=2,
        nproc_per_replica=2,
        max_restarts=5,
    )


def check_replicas(tmp_path: Path, code: int, lines: list[str], run: object, alone: dict[str, torch.Tensor]) -> dict:
    """The story's job completed, every sample once, and one process's parameters (1e-10)."""
    from maitre.runtime.ledger import audit

    assert code == 0, "\n".join(lines)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == 400, result.describe()
    error = relative_error(torch.load(tmp_path / "final.pt", weights_only=True), alone)
    assert error <= 1e-10, error
    return run.job()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def alone_400(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("alone") / "final.pt"
    result = run_tagged([sys.executable, str(SCRIPT), "--steps", "400", "--out", str(out)], timeout=200)
    assert result.returncode == 0, result.stderr
    return torch.load(out, weights_only=True)


@pytest.mark.slow  # (45-130 s; the default suite has the kill and join of replicas below)
@pytest.mark.timeout(240)
def test_fsdp_replicas_survive_a_crash_a_hang_a_join_and_a_leave(tmp_path: Path, alone_400) -> None:
    """Three replicas of two processes (FSDP2 inside each): kill -9 of one process takes its
    replica out and the others go on; a stopped process is found hung and its replica removed;
    a new node's replica joins and gets its shards, position by position, from a live replica;
    one replica leaves. Every sample once, and one process's parameters."""
    code, lines, run = run_replicas(tmp_path, "kill@20,hang@50,join@80,leave@120", 400, nodes=3, max_nodes=4)
    job = check_replicas(tmp_path, code, lines, run, alone_400)
    assert job["failures"] == 2, "\n".join(lines)
    assert any("hung" in e.get("reason", "") for e in job["events"]), job["events"]
    assert any(e["kind"] == "worker_left" for e in job["events"])
    sizes = [len(e["members"]) for e in job["events"] if e["kind"] == "epoch"]
    assert max(sizes) >= 3 and sizes[-1] < max(sizes), sizes
    ledgers = sorted(p.name for p in (tmp_path / "run" / "ledger").glob("*.jsonl"))
    assert all(".p0." in n or ".p1." in n for n in ledgers), ledgers  # a ledger per process


@pytest.mark.slow  # (the fp16 story below replays too; this one checks no rebuild follows)
@pytest.mark.timeout(180)
def test_a_replica_joins_while_the_others_train(tmp_path: Path, alone_400, monkeypatch) -> None:
    """A third replica of two processes joins: each of its processes listens on its position's
    group and gets its shards from a live replica's process at the same position; the snapshot
    lands late, so the joining replica replays dozens of steps, its two processes in step (their
    clipping is one collective), before all three replicas train."""
    monkeypatch.setenv("MAITRE_TRANSFER_DELAY_S", "1.5")
    code, lines, run = run_replicas(tmp_path, "join@30", 400, nodes=2)
    job = check_replicas(tmp_path, code, lines, run, alone_400)
    caught_up = [r for r in job["reports"] if r["kind"] == "caught_up"]
    assert len(caught_up) == 1 and caught_up[0]["replayed"] >= 10, "\n".join(lines)
    assert caught_up[0]["world_size"] == 3 and job["epoch"] == 2, "\n".join(lines)


# Back in the default suite: it hung once in a clean-clone CI run on 2026-12-02 (epoch 5, the
# survivor's replica and the killed one's replacement, both of two processes, made no step for
# 180 s after the replacement joined) and failed once in 8 runs. The same shape hung the replicas
# benchmark's crash smoke on 2026-12-05, its ledgers showing why: one replica's two processes in
# different epochs (the coordinator had told one an epoch that closed the moment after). Fixed by
# replica.same_epoch (test_a_replicas_processes_told_different_epochs_meet_in_the_newer_one).
@pytest.mark.timeout(180)
def test_fp16_over_fsdp2_replicas_under_maitre_run_through_a_kill_and_a_join(tmp_path: Path, monkeypatch) -> None:
    """The loss scaler over FSDP2 replicas under maitre: the first steps overflow (a scale of
    1e308 in float64) and are skipped by every process of every replica alike, one process is
    killed and its replica replaced, a node's replica joins (and replays, its snapshot late);
    the same parameters as one process with the same scaler."""
    from maitre.runtime.ledger import audit

    out = tmp_path / "alone.pt"
    alone = run_tagged(
        [sys.executable, str(SCRIPT), "--steps", "200", "--loss-scale", "1e308", "--out", str(out)], timeout=120
    )
    assert alone.returncode == 0, alone.stderr
    monkeypatch.setenv("MAITRE_TRANSFER_DELAY_S", "1.0")
    code, lines, run = run_replicas(tmp_path, "kill@20,join@60", 200, nodes=2, extra=("--loss-scale", "1e308"))
    assert code == 0, "\n".join(lines)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == 200, result.describe()
    error = relative_error(torch.load(tmp_path / "final.pt", weights_only=True), torch.load(out, weights_only=True))
    assert error <= 1e-10, error
    skips = [x for x in (tmp_path / "run" / "ledger").glob("*.jsonl") if '"k":"x"' in x.read_text()]
    assert skips, "no step overflowed: the scaler's skip was not exercised"
    caught_up = [r for r in run.job()["reports"] if r["kind"] == "caught_up"]  # type: ignore[attr-defined]
    assert caught_up and max(r["replayed"] for r in caught_up) >= 5, "\n".join(lines)


# -- the example: a Llama-style decoder sharded by FSDP2 -----------------------------------------------
LLM = ROOT / "examples" / "train_llm.py"
LLM_TINY = [
    "--steps",
    "16",
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--block",
    "16",
    "--global-batch",
    "12",
    "--micro-batch",
    "2",
    "--dtype",
    "float64",
    "--clip",
    "0.5",
    "--log-every",
    "4",
]


@pytest.fixture(scope="module")
def llm_alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("llm") / "final.pt"
    result = run_tagged([sys.executable, str(LLM), *LLM_TINY, "--out", str(out)], timeout=200)
    assert result.returncode == 0, result.stderr
    assert "done: 16 steps" in result.stdout
    return torch.load(out, weights_only=True)


@pytest.mark.slow  # (the example's replicas: under maitre run below; FSDP2 under torchrun: above)
def test_the_llm_example_under_torchrun_matches_one_process(tmp_path: Path, llm_alone) -> None:
    out = tmp_path / "final.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(LLM),
        *LLM_TINY,
        "--dp-shard",
        "2",
        "--out",
        str(out),
    ]
    result = run_tagged(cmd, timeout=240, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "replicas 2" in result.stdout
    assert relative_error(torch.load(out, weights_only=True), llm_alone) <= 1e-10


def test_the_llm_example_under_maitre_run_matches_one_process(tmp_path: Path, llm_alone) -> None:
    out = tmp_path / "final.pt"
    cmd = [
        sys.executable,
        "-m",
        "maitre.cli",
        "run",
        "--nnodes",
        "2",
        "--nproc-per-replica",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        str(LLM),
        *LLM_TINY,
        "--out",
        str(out),
    ]
    result = run_tagged(cmd, timeout=240)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "exactly once" in result.stdout, result.stdout
    assert relative_error(torch.load(out, weights_only=True), llm_alone) <= 1e-10


def test_a_model_sharded_on_a_mesh_of_its_own_is_refused() -> None:
    """Sharded on a mesh the loop does not know, its allreduce would add different shards."""
    script = (
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "import maitre\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "model = torch.nn.Linear(2, 1)\n"
        "fully_shard(model, mesh=init_device_mesh('cpu', (1,), mesh_dim_names=('mine',)))\n"
        "maitre.ElasticLoop(model, torch.optim.SGD(model.parameters(), lr=0.1),\n"
        "                   maitre.ElasticSampler(8, 4))\n"
    )
    result = run_tagged([sys.executable, "-c", script], timeout=120)
    assert result.returncode != 0
    assert "sharded on a mesh the loop does not know: build the model on maitre.replica_mesh()" in result.stderr, (
        result.stderr
    )
