"""Slow ranks: the detector on synthetic and on recorded timings, its settings, and real runs.

The synthetic runs model what the per-step traces of real runs on an oversubscribed machine
showed (:func:`simulate`): uneven shares with a fixed cost per step, jitter on every rank, late
wake-ups, a neighbour now and then; a slow rank computes ``factor`` times longer from its onset
on. Each rank keeps its window as the loop does (:class:`Window`), and the detector sees its
numbers once per window. Recorded timings of real noise-only runs are replayed the same way.
Then three real workers under ``maitre run``, one slowed by fault injection
(``MAITRE_SLOW_RANK``), and the same run without it, both with jitter on every rank.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import example_command, play, relative_error
from maitre import protocol
from maitre.runtime.ledger import audit
from maitre.runtime.stragglers import Detector, Injected, Thresholds, Window, share_factors
from test_metrics import ok, sample, world  # noqa: F401 -- (world: a fixture)

RANKS = 4
STEPS = 120
RUNS = 1000


def simulate(
    seed: int,
    slow: tuple[int, float, int] | None = None,
    ranks: int = RANKS,
    steps: int = STEPS,
    t: Thresholds | None = None,
) -> tuple[list, list]:
    """One run: its verdicts, and the neighbours' visits ``(rank, first step, last step)``.
    ``slow``: (rank, factor, onset step).

    The noise is what real runs on an oversubscribed machine showed (their per-rank traces):
    a step costs a fixed part (a third of a 4-sample step: per step and micro-batch) plus its
    samples, so the ranks of the smaller share (global batch 14 over 4 ranks: 4, 4, 3, 3) look
    slower per sample; ~10% jitter everywhere; on every rank, at a third of the steps, the OS
    serves it late (an exponential delay, a third of a step on average); and a neighbour, now
    and then, takes a random rank's core for up to 10 steps (2x to 3x as long)."""
    rng = random.Random(seed)
    t = t or Thresholds()
    det = Detector(t)
    windows = [Window(t.window * t.windows) for _ in range(ranks)]
    shares = [14 // ranks + (r < 14 % ranks) for r in range(ranks)]
    neighbour = (-1, 0, 1.0)  # (rank, until step, factor)
    found, visits = [], []
    for step in range(1, steps + 1):
        if neighbour[1] + 5 < step and rng.random() < 0.05:  # (5 steps apart, at least)
            neighbour = (rng.randrange(ranks), step + rng.randrange(8), rng.uniform(1.5, 3.0))
            visits.append((neighbour[0], step, neighbour[1]))
        for r in range(ranks):
            seconds = 0.01 * (1 + shares[r]) * rng.lognormvariate(0.0, 0.1)
            if rng.random() < 1 / 4:
                seconds += rng.expovariate(1 / 0.005)  # descheduled, woken up late
            if r == neighbour[0] and step <= neighbour[1]:
                seconds *= neighbour[2]
            if slow is not None and r == slow[0] and step >= slow[2]:
                seconds *= slow[1]
            windows[r].add(seconds, shares[r])
        if step % t.window == 0:
            values, held, works = zip(*(w.take() for w in windows))
            found += det.observe(
                step - t.window + 1, step, list(values), [f"w{r}" for r in range(ranks)], list(works), list(held)
            )
    return found, visits


@pytest.mark.timeout(60)
def test_noise_only_flags_nothing_in_a_thousand_runs() -> None:
    flagged = sum(1 for seed in range(RUNS) if simulate(seed)[0])
    assert flagged / RUNS <= 0.01, f"{flagged} of {RUNS} noise-only runs flagged a rank"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_a_slow_rank_is_found_within_twenty_steps_with_its_onset(factor: float) -> None:
    onset, late, wrong, runs = 43, [], [], RUNS // 2
    for seed in range(runs):
        slow_rank = seed % RANKS
        verdicts, visits = simulate(seed, (slow_rank, factor, onset))
        mine = [v for v in verdicts if v.key == f"w{slow_rank}"]
        if not mine or mine[0].step > onset + 20:
            late.append(seed)
            continue
        v = mine[0]
        # The onset is told to a window (5 steps): the one it fell in, or one of the next two
        # or the one before (noise below or above ``drift``); or that of a neighbour's visit
        # that ran into it (it was slow since).
        began = min([first for r, first, last in visits if r == slow_rank and first <= onset <= last + 10] + [onset])
        if not (began - 10 < v.since_step <= onset + 10) or v.rank != slow_rank:
            wrong.append((seed, v))
        assert v.ratio >= 1.3 and v.windows == 3 and v.evidence[-1]["step"] == v.step
        assert v.evidence[-1]["held"] == v.ratio and v.evidence[-1]["z"] >= 3
        assert [e["ratio"] for e in v.evidence[-3:]] == [
            pytest.approx(e["value"] / e["share"] / e["median"], rel=1e-3) for e in v.evidence[-3:]
        ]
    assert len(late) <= runs // 100, f"{len(late)} of {runs} runs late or missed: {late[:10]}"
    assert len(wrong) <= runs // 100, wrong[:5]
    # Others are no stragglers: any verdict names the slow rank only.
    assert all(v.key == f"w{1}" for v in simulate(1, (1, factor, onset))[0])


REAL_NOISE = Path(__file__).parent / "data" / "straggler_noise.json"
"""Every rank's compute per step in 4 real noise-only runs on a loaded machine (its "about")."""


def replay(
    compute_ms: list[list[float]], work: list[int], slow: tuple[int, float, int] | None = None, shift: int = 0
) -> list:
    """The loop's window and detector on recorded timings (rotated by ``shift`` steps; ``slow``:
    that rank's compute times the factor from the onset on)."""
    t = Thresholds()
    det, windows, found = Detector(t), [Window(t.window * t.windows) for _ in work], []
    series = [s[3:][shift:] + s[3:][:shift] for s in compute_ms]  # (not the warm-up)
    for i in range(len(series[0])):
        step = i + 1
        for r, s in enumerate(series):
            factor = slow[1] if slow is not None and r == slow[0] and step >= slow[2] else 1.0
            windows[r].add(s[i] / 1000 * factor, work[r])
        if step % t.window == 0:
            values, held, works = zip(*(w.take() for w in windows))
            found += det.observe(step - t.window + 1, step, list(values), None, list(works), list(held))
    return found


@pytest.mark.timeout(30)
def test_real_noise_flags_nothing_and_a_slow_rank_in_it_is_found() -> None:
    """The recorded runs, each rotated 10 ways: no verdict; each rank in turn 1.5x slower from
    a step (three onsets a rank, across the window): found within 20 steps, and only it."""
    runs = json.loads(REAL_NOISE.read_text())["runs"]
    for run in runs:
        for shift in range(0, 90, 9):
            assert replay(run["compute_ms"], run["work"], shift=shift) == []
        for rank in range(len(run["work"])):
            for onset in (31, 43, 57):
                found = replay(run["compute_ms"], run["work"], (rank, 1.5, onset))
                assert found and found[0].step - onset <= 20, (rank, onset, found)
                assert {v.rank for v in found} == {rank}


@pytest.mark.timeout(30)
def test_the_window_keeps_lower_quartiles_and_a_held_pace() -> None:
    w = Window(span=10)
    for seconds in [1.0, 9.0, 2.0, 8.0, 3.0]:  # per 2 samples; descheduled twice
        w.add(seconds, 2)
    assert w.take() == (1.0, 0.0, 2)  # the second lowest of 5; no held pace before 10 steps
    for seconds in [8.0, 8.0, 8.0, 8.0, 80.0]:
        w.add(seconds, 4)
    assert w.take() == (2.0, 1.5, 4)  # of the last 10 per-sample values, the third lowest
    w.add(1.0, 0)  # no work (a listener's step): nothing
    assert w.take() == (0.0, 0.0, 0.0)
    w.restart()
    w.add(1.0, 1)
    assert w.take() == (1.0, 0.0, 1)


@pytest.mark.timeout(30)
def test_uneven_shares_are_corrected_by_levels_one_slow_rank_does_not_move() -> None:
    # A step costs 1 + its samples: the ranks of 3 samples look (4/3) / (5/4) slower per sample.
    fair = {0: 5 / 4, 1: 5 / 4, 2: 4 / 3, 3: 4 / 3}
    works = {0: 4, 1: 4, 2: 3, 3: 3}
    f = share_factors(fair, works)
    assert f[0] == f[1] == 1.0 and f[2] == f[3] == pytest.approx((4 / 3) / (5 / 4))
    assert share_factors({**fair, 3: 2.0}, works) == f  # rank 3 slow: its level's lower median
    assert share_factors({**fair, 0: 2.0}, works) == f
    # Bounded by a step of fixed cost only (4/3 here), never below 1 for the smaller share.
    assert share_factors({**fair, 2: 3.0, 3: 3.0}, works)[2] == pytest.approx(4 / 3)
    assert share_factors({**fair, 2: 1.0, 3: 1.0}, works)[2] == 1.0
    # A level of one rank (5, 5, 4), or no works (tokens): not corrected.
    assert share_factors({0: 1.0, 1: 1.0, 2: 1.2}, {0: 5, 1: 5, 2: 4}) == {0: 1.0, 1: 1.0, 2: 1.0}
    assert share_factors(fair, {}) == {r: 1.0 for r in fair}
    # In the detector: ranks of the smaller share, 8% slower per sample, are no stragglers.
    det = Detector()
    for i in range(10):
        assert det.observe(i * 5 + 1, i * 5 + 5, [1.0, 1.0, 1.35, 1.35], None, [4, 4, 3, 3]) == []
    assert Detector().observe(1, 5, [1.0, 1.0, 1.0], None, [4, 4, 3], [1.0, 1.0, 1.0]) == []


@pytest.mark.timeout(30)
def test_injected_slowness_and_jitter_from_the_environment() -> None:
    faults = Injected.from_environ({protocol.SLOW_RANK: "1:0.5:40", protocol.STEP_JITTER: "0.3"})
    assert faults.slow == (1, 0.5, 40) and faults.jitter == 0.3 and faults
    assert not Injected.from_environ({})
    plain = Injected.from_environ({protocol.SLOW_RANK: "2:2"})
    assert plain.slow == (2, 2.0, 1) and plain.pause(2, 1, 0.1) == pytest.approx(0.2)
    assert plain.pause(1, 5, 0.1) == 0.0
    late = Injected(slow=(1, 0.5, 40))
    assert late.pause(1, 39, 0.1) == 0.0 and late.pause(1, 40, 0.1) == pytest.approx(0.05)
    pauses = [Injected(jitter=0.3).pause(0, 1, 1.0) for _ in range(200)]
    assert 0.0 <= min(pauses) < 0.05 and 0.25 < max(pauses) < 0.3
    for var, text in [
        (protocol.SLOW_RANK, "1"),
        (protocol.SLOW_RANK, "-1:0.5"),
        (protocol.SLOW_RANK, "1:nan"),
        (protocol.SLOW_RANK, "1:0.5:0"),
        (protocol.SLOW_RANK, "1:0.5:x"),
        (protocol.STEP_JITTER, "-0.1"),
        (protocol.STEP_JITTER, "nan"),
        (protocol.STEP_JITTER, "lots"),
    ]:
        with pytest.raises(ValueError, match=var):
            Injected.from_environ({var: text})


@pytest.mark.timeout(30)
def test_a_rank_is_reported_once_per_slowdown_and_again_after_it_recovered() -> None:
    t = Thresholds()
    det = Detector(t)
    fast, slow = [1.0, 1.02, 0.98, 1.01], [1.0, 2.0, 0.98, 1.01]
    series = [fast] * 4 + [slow] * 10 + [fast] * 10 + [slow] * 4
    found = [(i, v) for i, values in enumerate(series) for v in det.observe(i * 5 + 1, i * 5 + 5, values)]
    assert [(i, v.key, v.since_step) for i, v in found] == [(6, "1", 21), (26, "1", 121)]


@pytest.mark.timeout(30)
def test_too_few_ranks_or_idle_slots_give_no_verdict() -> None:
    det = Detector()
    for i in range(10):  # two ranks: no majority to judge by
        assert det.observe(i * 5 + 1, i * 5 + 5, [1.0, 3.0]) == []
    for i in range(10):  # a listener's slot (0: no work) is left out
        assert det.observe(i * 5 + 1, i * 5 + 5, [1.0, 3.0, 0.0]) == []


@pytest.mark.timeout(30)
def test_thresholds_from_the_environment() -> None:
    t = Thresholds.from_environ(
        {
            protocol.STRAGGLER_WINDOW: "10",
            protocol.STRAGGLER_RATIO: "1.5",
            protocol.STRAGGLER_Z: "4",
            protocol.STRAGGLER_WINDOWS: "3",
            protocol.STRAGGLER_POLICY: "off",
        }
    )
    assert (t.window, t.ratio, t.z, t.windows, t.policy) == (10, 1.5, 4.0, 3, "off")
    assert Thresholds.from_environ({}) == Thresholds()
    bad = {
        protocol.STRAGGLER_WINDOW: "0",
        protocol.STRAGGLER_WINDOW + "_": "x",
        protocol.STRAGGLER_RATIO: "1.0",
        protocol.STRAGGLER_Z: "nan",
        protocol.STRAGGLER_MAD_FLOOR: "0",
        protocol.STRAGGLER_WINDOWS: "2.5",
    }
    for var, text in bad.items():
        if not var.endswith("_"):
            with pytest.raises(ValueError, match=var):
                Thresholds.from_environ({var: text})
    with pytest.raises(ValueError, match="no such policy"):
        Thresholds.from_environ({protocol.STRAGGLER_POLICY: "kill"})
    assert Thresholds.from_environ({protocol.STRAGGLER_POLICY: "evict"}).policy == "evict"
    assert Thresholds(ratio=2, window=10).ratio == 2
    for bad_field in (
        {"ratio": 0.5},
        {"window": 2.5},
        {"windows": 65},
        {"z": float("inf")},
        {"policy": "kill"},
        {"min_ranks": 2},
    ):
        with pytest.raises(ValueError):
            Thresholds(**bad_field)
    with pytest.raises(ValueError, match="onset would come after"):
        Thresholds.from_environ({protocol.STRAGGLER_DRIFT: "1.5"})


def straggler_report(worker: str, **changes: object) -> dict:
    det, found = Detector(), []
    for i in range(3):
        found += det.observe(i * 5 + 1, i * 5 + 5, [1.0, 2.0, 1.0], ["a", worker, "c"])
    [verdict] = found
    return {**verdict.report(det.t), "epoch": 1, "world_size": 3, **changes}


@pytest.mark.timeout(60)
def test_the_coordinator_names_the_node_counts_it_and_refuses_bad_reports(world) -> None:
    co, client, t = world
    ok(
        client.post(
            "/v1/jobs",
            json={
                "manifest": {
                    "name": "a",
                    "queue": "q",
                    "minReplicas": 2,
                    "maxReplicas": 2,
                    "command": ["python", "train.py"],
                }
            },
        )
    )
    orders = ok(client.post("/v1/nodes/n0/heartbeat", json={"slots": 2}))
    t[0] += 1.0
    co.tick()  # admits it on n0
    orders = ok(client.post("/v1/nodes/n0/heartbeat", json={"slots": 2, "since": orders["version"]}))
    w1, w2 = sorted(o["worker_id"] for o in orders["start"])
    report = f"/v1/workers/{w1}/report"
    bad = [
        {"policy": "kill"},
        {"ratio": -1.0},
        {"since_step": -1},
        {"straggler": "a b"},
        {"windows": 0},
        {"surprise": 1},
        {"evidence": [{"step": 1}]},
    ]
    for change in bad:
        response = client.post(report, json=straggler_report(w2, **change))
        assert response.status_code == 400, (change, response.text)
    assert not co.reports["a"]
    ok(client.post(report, json=straggler_report(w2)))
    [event] = [e for e in co.db.events(job="a") if e["kind"] == "straggler"]
    assert (event["worker"], event["node"], event["reporter"], event["rank"]) == (w2, "n0", w1, 1)
    assert event["ratio"] == 2.0 and event["since_step"] == 1 and event["step"] == 15
    assert [w["step"] for w in event["evidence"]] == [5, 10, 15] and event["policy"] == "report"
    assert event["evidence"][-1]["held"] == 2.0
    text = co.metrics.render().decode()
    assert sample(text, "maitre_stragglers_total", job="a") == 1


REAL_STEPS = 60
REAL = ("--global-batch", "14")
"""Uneven shares: 5, 5 and 4 samples."""
DEVICE = ("--device-ms-per-sample", "8")
"""A step of 5 samples holds a device-like 40 ms (a sleep: no CPU), so that its held pace spans
~0.6 s, longer than the OS's own imbalance between processes on a loaded machine (with steps
of ~12 ms, 15 of them are within it: one rank kept off its core for 0.2 s looks slow)."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slow", ["1:0.5", ""], ids=["rank1-1.5x", "noise-only"])
def test_a_real_run_reports_its_slow_rank_and_stays_exact(tmp_path: Path, monkeypatch, reference, slow: str) -> None:
    """Three workers under ``maitre run``, uneven shares, every rank sleeping a random part
    (up to 30%) of its compute each step (MAITRE_STEP_JITTER); with MAITRE_SLOW_RANK=1:0.5
    rank 1 computes 1.5x as long: a ``straggler`` event names its worker and node within 30
    steps (20 on a quiet machine), the metric counts it, and the run is exact (every sample once, the parameters of
    a fixed-size run). Without: nothing."""
    monkeypatch.setenv(protocol.STEP_JITTER, "0.3")
    if slow:
        monkeypatch.setenv(protocol.SLOW_RANK, slow)
    code, lines, run = play(
        tmp_path,
        example_command(REAL_STEPS, tmp_path / "final.pt", REAL + DEVICE),
        "",
        min_nodes=3,
        max_nodes=3,
        local_nodes=3,
        max_restarts=0,
    )
    assert code == 0, "\n".join(lines)
    result = audit(tmp_path / "run" / "ledger")
    assert result.ok and result.steps == REAL_STEPS, result.describe()
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert relative_error(final, reference(REAL_STEPS, *REAL)) <= 1e-5

    job = run.job()
    found = [r for r in job["reports"] if r["kind"] == "straggler"]  # (as their events)
    text = run.coordinator.metrics.render().decode()
    assert (sample(text, "maitre_stragglers_total", job=job["job_id"]) or 0) == len(found)
    if not slow:
        assert found == [], found
        return
    members = next(e for e in job["events"] if e["kind"] == "epoch")["members"]
    node_of = {w["id"]: w["node"] for w in job["workers"]}
    assert len(found) == 1, [(r["step"], r["ratio"]) for r in found]  # once: it stays slow
    verdict = found[0]
    assert verdict["worker"] == members[1] and verdict["node"] == node_of[members[1]], verdict
    assert verdict["rank"] == 1 and verdict["reporter"] == members[0]
    assert verdict["ratio"] >= 1.3 and verdict["windows"] == 3
    # Slow from the start: the onset within the first two windows, and the verdict three windows
    # on (15 steps), or a window or two later where the machine's own load made a window of it
    # look ordinary (seen beside a CPU hog: step 25). How soon it is found on recorded noise is
    # test_a_slow_rank_is_found_within_twenty_steps_with_its_onset's, over many seeds.
    assert verdict["since_step"] <= 10 and verdict["step"] <= 30, verdict
    # In the terminal, one line (the evidence is the event's, in the log and the dashboard).
    [line] = [line for line in lines if "straggler" in line]
    assert f"straggler: {members[1]} on {node_of[members[1]]} (rank 1) computes" in line, line
    assert len(line) < 200, line
    assert verdict["evidence"][-1]["held"] == verdict["ratio"], verdict["evidence"]
