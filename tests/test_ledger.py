"""The data ledger: written by two fake workers across membership epochs, then audited."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maitre.runtime.ledger import Ledger, audit, read
from maitre.runtime.sampler import ElasticSampler

pytestmark = pytest.mark.timeout(30)

N, BATCH = 10, 4  # data epochs of 3 steps: 4 + 4 + 2 samples


def write_run(
    directory: Path,
    *,
    lost_attempts: bool = True,
    truncate: bool = True,
    drop_commit: int | None = None,
    duplicate_in: int | None = None,
    recommit: int | None = None,
) -> dict[str, list]:
    """Two workers, w1 and w2, with a committed sampler each.

    Epoch 1: w1 rank 0, w2 rank 1; steps 1-2 commit; step 3 is attempted by both and lost.
    Epoch 2: w2 rank 0, w1 rank 1 (ranks swapped); steps 3-7 commit; w2 attempts step 8 and is
    killed while writing its commit, leaving a truncated last line.
    Returns the global slice of every committed step.
    """
    ledgers = {w: Ledger(directory, w, N) for w in ("w1", "w2")}
    samplers = {w: ElasticSampler(N, BATCH, seed=5) for w in ledgers}
    slices: dict[int, list[int]] = {}

    def step(epoch: int, step_no: int, ranks: dict[str, int], commit: bool) -> None:
        shares = {w: samplers[w].next_slice(r, len(ranks)) for w, r in ranks.items()}
        for w, sl in shares.items():
            indices = list(sl.local_indices)
            if duplicate_in == step_no and w == "w1":
                indices[0] = slices[step_no - 1][0]  # a sample of the previous step again
            ledgers[w].attempt(epoch, step_no, sl.data_epoch, indices)
        if not commit:
            return
        slices[step_no] = next(iter(shares.values())).global_indices
        for w, sl in shares.items():
            samplers[w].advance(sl)
            if drop_commit != step_no:
                ledgers[w].commit(epoch, step_no)

    for s in (1, 2):
        step(1, s, {"w1": 0, "w2": 1}, commit=True)
    if lost_attempts:
        step(1, 3, {"w1": 0, "w2": 1}, commit=False)  # the epoch is lost here
    for s in range(3, 8):
        step(2, s, {"w2": 0, "w1": 1}, commit=True)
    if recommit is not None:
        ledgers["w1"].commit(1, recommit)  # a step that committed in two epochs
    step(2, 8, {"w2": 0, "w1": 1}, commit=False)
    for lg in ledgers.values():
        lg.close()
    if truncate:
        with open(directory / "w2.jsonl", "a") as f:
            f.write('{"k":"c","e":2,"s":8,"t":17')  # kill -9 in the middle of a line
    return {"slices": [slices[s] for s in sorted(slices)]}


def test_ledger_file_format(tmp_path):
    lg = Ledger(tmp_path, "wx", 7)
    lg.attempt(3, 1, 0, [4, 2])
    lg.commit(3, 1)
    lg.close()
    recs = [json.loads(line) for line in (tmp_path / "wx.jsonl").read_text().splitlines()]
    assert (recs[0]["k"], recs[0]["n"]) == ("h", 7)  # the header may carry more (time, pid)
    assert recs[1] == {"k": "a", "e": 3, "s": 1, "d": 0, "i": [4, 2]}
    assert {k: v for k, v in recs[2].items() if k != "t"} == {"k": "c", "e": 3, "s": 1}
    assert isinstance(recs[2]["t"], float)


def test_read_groups_attempts_and_commits(tmp_path):
    write_run(tmp_path)
    attempts, commits, n, rolled_back = read(tmp_path)
    assert n == N
    assert len(attempts[("", 1, 3)]) == 2  # the lost epoch's attempts are there, but unused
    assert commits[3] == {("", 2, 3)} and commits[1] == {("", 1, 1)}
    assert 8 not in commits  # only a truncated commit line


def test_audit_ok(tmp_path):
    run = write_run(tmp_path)
    # the scenario must cross data epochs: slices of 4, 4, 2 samples
    assert [len(s) for s in run["slices"]] == [4, 4, 2, 4, 4, 2, 4]
    result = audit(tmp_path)
    assert result.ok, result.describe()
    assert (result.steps, result.samples, result.complete_data_epochs) == (7, 24, 2)
    assert (result.duplicates, result.missing, result.gaps) == ([], [], [])
    assert result.describe().startswith("exactly once: 24 samples in 7 committed steps")


def test_lost_epoch_attempts_are_what_would_break_the_audit(tmp_path):
    """Sanity check of the scenario: the lost attempts overlap the retried step."""
    write_run(tmp_path)
    attempts, _, _, _ = read(tmp_path)
    lost = sorted(i for rec in attempts[("", 1, 3)] for i in rec["i"])
    retried = sorted(i for rec in attempts[("", 2, 3)] for i in rec["i"])
    assert lost == retried and lost


def test_audit_ok_without_lost_epoch_or_truncation(tmp_path):
    write_run(tmp_path, lost_attempts=False, truncate=False)
    result = audit(tmp_path)
    assert result.ok and result.steps == 7


def test_audit_reports_a_duplicated_sample(tmp_path):
    run = write_run(tmp_path, duplicate_in=5)
    dup = run["slices"][3][0]  # step 4's first sample (data epoch 1), consumed again in step 5
    result = audit(tmp_path)
    assert not result.ok
    assert result.duplicates == [(1, dup)]
    assert len(result.missing) == 1 and result.missing[0][0] == 1  # the one it replaced
    assert result.gaps == []
    assert result.describe().startswith("VIOLATED: 1 repeated, 1 lost samples, 0 missing steps")


def test_audit_reports_a_missing_step(tmp_path):
    run = write_run(tmp_path, drop_commit=4)
    result = audit(tmp_path)
    assert not result.ok
    assert result.gaps == [4]
    assert result.steps == 6
    # step 4's samples never counted: lost in the finished data epoch 1
    assert sorted(i for _, i in result.missing) == sorted(run["slices"][3])
    assert {d for d, _ in result.missing} == {1}
    assert result.duplicates == []
    assert "1 missing steps" in result.describe()


def test_audit_reports_a_step_committed_in_two_epochs(tmp_path):
    write_run(tmp_path, recommit=3)
    result = audit(tmp_path)
    assert not result.ok
    assert (-1, 3) in result.duplicates


def test_audit_of_an_empty_directory(tmp_path):
    result = audit(tmp_path)
    assert result.ok and (result.steps, result.samples) == (0, 0)


@pytest.mark.parametrize("record_resume", [True, False])
def test_resume_from_a_checkpoint_rolls_back_later_commits(tmp_path, record_resume):
    """Run r1 commits steps 1-6 and dies; r2 resumes from the checkpoint of step 4 and trains
    steps 5-6 again. The rolled-back commits count once, but only if the resume is recorded."""
    sampler = ElasticSampler(N, BATCH, seed=5)
    first = Ledger(tmp_path, "w1", N, run_id="r1")
    saved = None
    for s in range(1, 7):
        sl = sampler.next_slice(0, 1)
        first.attempt(1, s, sl.data_epoch, sl.local_indices)
        sampler.advance(sl)
        first.commit(1, s)
        if s == 4:
            saved = sampler.state_dict()
    first.close()
    resumed = ElasticSampler(N, BATCH, seed=5)
    resumed.load_state_dict(saved)
    second = Ledger(tmp_path, "w1", N, run_id="r2")
    if record_resume:
        second.resumed(4)
    for s in (5, 6):
        sl = resumed.next_slice(0, 1)
        second.attempt(1, s, sl.data_epoch, sl.local_indices)  # epoch 1 again: a new coordinator
        resumed.advance(sl)
        second.commit(1, s)
    second.close()
    result = audit(tmp_path)
    if record_resume:
        assert result.ok and result.steps == 6, result.describe()
        assert result.rolled_back == 2
        assert result.describe().endswith("2 committed steps were rolled back and trained again")
    else:
        assert not result.ok and (-1, 5) in result.duplicates
