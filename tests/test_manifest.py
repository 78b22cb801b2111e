"""Job manifests: valid ones parse to the scheduler's Job; invalid ones name every problem."""

from __future__ import annotations

import pytest

from maitre.scheduling.model import Phase, Topology
from maitre.scheduling.spec import ManifestError, parse_manifest

pytestmark = pytest.mark.timeout(30)

GOOD = """
name: bert-large
queue: team-a
priorityClassName: high
minReplicas: 2
maxReplicas: 8
gpusPerReplica: 2
preemptible: false
gracePeriodSeconds: 90
topology: {level: rack, mode: required}
command: python train.py --steps 300
checkpointDir: /shared/ckpt/bert-large
"""


def test_a_full_manifest() -> None:
    m = parse_manifest(GOOD, queues={"team-a", "team-b"})
    assert (m.name, m.queue, m.priority, m.min_replicas, m.max_replicas, m.gpus_per_replica) == \
        ("bert-large", "team-a", 1000, 2, 8, 2)
    assert not m.preemptible and m.grace_period_s == 90.0
    assert (m.topology.level, m.topology.mode) == ("rack", "required")
    assert m.command == ("python", "train.py", "--steps", "300")
    job = m.job(submitted_at=12.0)
    assert job.phase == Phase.PENDING and job.slots_per_replica == 2 and job.elastic
    assert job.topology == Topology(level="rack", mode="required")


def test_defaults_make_a_fixed_gang_of_one() -> None:
    m = parse_manifest({"name": "a", "queue": "q", "command": ["python", "x.py", 3]})
    assert (m.min_replicas, m.max_replicas, m.gpus_per_replica, m.priority) == (1, 1, 1, 0)
    assert m.preemptible and m.topology is None and m.command == ("python", "x.py", "3")
    assert parse_manifest({"name": "a", "queue": "q", "command": "x", "minReplicas": 4}
                          ).max_replicas == 4  # maxReplicas defaults to minReplicas


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ManifestError) as err:
        parse_manifest("""
name: Bad_Name
queue: nope
priority: 5
priorityClassName: high
minReplica: 2
minReplicas: 4
maxReplicas: 2
gpusPerReplica: 0
preemptible: maybe
gracePeriodSeconds: -1
topology: {level: row}
command: []
""", queues={"team-a"})
    problems = err.value.problems
    expected = ["unknown field 'minReplica' (did you mean 'minReplicas'?)", "name 'Bad_Name'",
                "no queue 'nope' (queues: team-a)", "not both", "maxReplicas 2 is less than",
                "gpusPerReplica must be at least 1", "preemptible must be true or false",
                "gracePeriodSeconds must be at least 0", "topology.level must be",
                "command is empty"]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == len(expected)


@pytest.mark.parametrize("source, words", [
    ("name: [unclosed", "not valid YAML"),
    ("- a\n- b\n", "a mapping of fields"),
    ("queue: q\n", "name is required"),
    ("name: a\nqueue: q\ncommand: 'python \"x'\n", "command: No closing quotation"),
    ("name: a\nqueue: q\ncommand: x\npriorityClassName: urgent\n", "unknown priorityClassName"),
    ("name: a\nqueue: q\ncommand: x\nminReplicas: true\n", "minReplicas must be an integer"),
    ("name: a\nqueue: q\ncommand: x\ntopology: rack\n", "topology must be"),
])
def test_bad_manifests(source: str, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        parse_manifest(source)
