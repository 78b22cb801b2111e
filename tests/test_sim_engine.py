"""The simulator's event engine: order, cancellation, the clock, and bit-for-bit determinism."""

from __future__ import annotations

import pytest

from maitre.sim.engine import Engine

pytestmark = pytest.mark.timeout(30)


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    engine, seen = Engine(), []
    for name, t in [("c", 2.0), ("a", 1.0), ("b", 1.0), ("d", 1.0)]:
        engine.at(t, seen.append, name)
    engine.run()
    assert seen == ["a", "b", "d", "c"] and engine.now == 2.0 and engine.processed == 4


def test_callbacks_schedule_more_and_cancelled_events_never_run() -> None:
    engine, seen = Engine(), []

    def tick(n: int) -> None:
        seen.append((engine.now, n))
        if n < 3:
            engine.after(1.5, tick, n + 1)

    engine.at(0.0, tick, 0)
    doomed = engine.at(2.0, seen.append, "doomed")
    doomed.cancel()
    assert engine.pending() == 1  # the cancelled one does not count
    engine.run()
    assert seen == [(0.0, 0), (1.5, 1), (3.0, 2), (4.5, 3)]


def test_run_until_stops_the_clock_there_and_resumes() -> None:
    engine, seen = Engine(), []
    for t in (1.0, 5.0, 9.0):
        engine.at(t, seen.append, t)
    assert engine.run(until=6.0) == 6.0 and seen == [1.0, 5.0]
    with pytest.raises(ValueError, match="in the past"):
        engine.at(5.5, seen.append, "late")
    engine.run()
    assert seen == [1.0, 5.0, 9.0]
    with pytest.raises(ValueError, match="finite"):
        engine.at(float("nan"), seen.append, "never")


def _story(seed: int, entities: list[str]) -> list[tuple[float, str, float]]:
    """A little random world: each entity arrives after an exponential wait, then works."""
    engine, log = Engine(seed), []

    def arrive(name: str) -> None:
        work = engine.rng(name).expovariate(1 / 50)
        log.append((engine.now, name, work))
        engine.after(work, log.append, (engine.now + work, name, -1.0))

    for name in entities:
        engine.at(engine.rng(name).expovariate(1 / 10), arrive, name)
    engine.run()
    return log


def test_the_same_inputs_give_the_same_outputs_bit_for_bit() -> None:
    names = [f"job-{i}" for i in range(50)]
    assert _story(7, names) == _story(7, names)
    assert _story(7, names) != _story(8, names)


def test_one_entitys_draws_do_not_depend_on_the_others() -> None:
    full = {name: (t, w) for t, name, w in _story(3, ["a", "b", "c"]) if w >= 0}
    alone = {name: (t, w) for t, name, w in _story(3, ["b"]) if w >= 0}
    assert full["b"] == alone["b"]


# -- workloads ----------------------------------------------------------------------------------
from maitre.sim.workload import WorkloadError, load_workload, parse_workload, pollux_workload  # noqa: E402


@pytest.mark.parametrize("load,count", [(0.5, 80), (1.0, 160), (1.5, 240), (2.0, 320)])
def test_the_bundled_pollux_workloads_load(load: float, count: int) -> None:
    for number in range(1, 9):
        jobs = load_workload(pollux_workload(number, load))
        assert len(jobs) == count
        assert [j.time for j in jobs] == sorted(j.time for j in jobs)
        assert all(j.time <= 8 * 3600 for j in jobs)


def test_workload_6_is_the_one_of_the_paper() -> None:
    jobs = load_workload(pollux_workload(6))
    assert jobs[0].name == "cifar10-0" and jobs[0].time == 53 and jobs[0].num_replicas == 6
    assert {j.application for j in jobs} <= {"cifar10", "ncf", "deepspeech2", "bert", "yolov3", "imagenet"}


def test_a_bad_workload_names_every_problem() -> None:
    text = "name,time,application,num_replicas,batch_size\na,10,cifar10,2,128\na,-1,resnet,0,64\nb,soon,ncf,1,1\n"
    with pytest.raises(WorkloadError) as err:
        parse_workload(text, "w.csv")
    problems = err.value.problems
    assert any("line 3: name 'a'" in p for p in problems)
    assert any("line 3: time -1" in p for p in problems)
    assert any("line 3: application 'resnet'" in p for p in problems)
    assert any("line 3: num_replicas" in p for p in problems)
    assert any("line 4: time, num_replicas and batch_size must be numbers" in p for p in problems)
    with pytest.raises(WorkloadError, match="missing column"):
        parse_workload("name,time\nx,1\n")
    with pytest.raises(WorkloadError, match="cannot read it"):
        load_workload("/nonexistent/workload.csv")
    with pytest.raises(ValueError, match="loads 0.5"):
        pollux_workload(9)


def test_stop_ends_the_run_after_the_current_event() -> None:
    engine, seen = Engine(), []
    engine.at(1.0, lambda: (seen.append(1), engine.stop()))
    engine.at(2.0, seen.append, 2)
    engine.run()
    assert seen == [1] and engine.now == 1.0 and engine.pending() == 1
