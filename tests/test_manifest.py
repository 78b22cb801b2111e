"""Job manifests: valid ones parse to the scheduler's Job; invalid ones name every problem."""

from __future__ import annotations

import json
from typing import Any

import pytest

from maitre.scheduling.model import JobState, Topology
from maitre.scheduling.spec import ManifestError, manifest_from_record, manifest_record, parse_manifest

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
    assert (m.name, m.queue, m.priority, m.min_replicas, m.max_replicas, m.gpus_per_replica) == (
        "bert-large",
        "team-a",
        1000,
        2,
        8,
        2,
    )
    assert not m.preemptible and m.grace_period_s == 90.0
    assert (m.topology.level, m.topology.mode) == ("rack", "required")
    assert m.command == ("python", "train.py", "--steps", "300")
    job = m.job(submitted_at=12.0)
    assert job.state == JobState.PENDING and job.slots_per_replica == 2 and job.elastic
    assert job.topology == Topology(level="rack", mode="required")


def test_defaults_make_a_fixed_gang_of_one() -> None:
    m = parse_manifest({"name": "a", "queue": "q", "command": ["python", "x.py", 3]})
    assert (m.min_replicas, m.max_replicas, m.gpus_per_replica, m.priority) == (1, 1, 1, 0)
    assert m.preemptible and m.topology is None and m.command == ("python", "x.py", "3")
    assert (
        parse_manifest({"name": "a", "queue": "q", "command": "x", "minReplicas": 4}).max_replicas == 4
    )  # maxReplicas defaults to minReplicas


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ManifestError) as err:
        parse_manifest(
            """
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
""",
            queues={"team-a"},
        )
    problems = err.value.problems
    expected = [
        "unknown field 'minReplica' (did you mean 'minReplicas'?)",
        "name 'Bad_Name'",
        "no queue 'nope' (queues: team-a)",
        "not both",
        "maxReplicas 2 is less than",
        "gpusPerReplica must be at least 1",
        "preemptible must be true or false",
        "gracePeriodSeconds must be at least 0",
        "topology.level must be",
        "command is empty",
    ]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == len(expected)


@pytest.mark.parametrize(
    "source, words",
    [
        ("name: [unclosed", "not valid YAML"),
        ("- a\n- b\n", "a mapping of fields"),
        ("queue: q\n", "name is required"),
        ("name: a\nqueue: q\ncommand: 'python \"x'\n", "command: No closing quotation"),
        ("name: a\nqueue: q\ncommand: x\npriorityClassName: urgent\n", "unknown priorityClassName"),
        ("name: a\nqueue: q\ncommand: x\nminReplicas: true\n", "minReplicas must be an integer"),
        ("name: a\nqueue: q\ncommand: x\ntopology: rack\n", "topology must be"),
    ],
)
def test_bad_manifests(source: str, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        parse_manifest(source)


def problems_of(source: str | dict[Any, Any], **kw: Any) -> list[str]:
    with pytest.raises(ManifestError) as err:
        parse_manifest(source, **kw)
    assert str(err.value) == "invalid job manifest: " + "; ".join(err.value.problems)
    return err.value.problems


def test_several_problems_each_name_their_field_path() -> None:
    assert problems_of(
        {"name": "a", "queue": "q", "command": "x", "minReplicas": 0, "topology": {"level": "row", "mode": "strict"}}
    ) == [
        "minReplicas must be at least 1, got 0",
        "topology.level must be 'node', 'rack' or 'block', got 'row'",
        "topology.mode must be 'required' or 'preferred', got 'strict'",
    ]


def test_a_misspelt_nested_key_gets_the_closest_one() -> None:
    assert problems_of("name: a\nqueue: q\ncommand: x\ntopology: {levle: rack}\n") == [
        "unknown field 'topology.levle' (did you mean 'level'?)"
    ]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("minReplicas", "2", "minReplicas must be an integer, got '2'"),
        ("maxReplicas", 2.0, "maxReplicas must be an integer, got 2.0"),
        ("gpusPerReplica", True, "gpusPerReplica must be an integer, got True"),
        ("priority", "high", "priority must be an integer, got 'high'"),
        ("priority", None, "priority must be an integer, got None"),
        ("preemptible", "yes", "preemptible must be true or false, got 'yes'"),
        ("preemptible", 1, "preemptible must be true or false, got 1"),
        ("gracePeriodSeconds", "60", "gracePeriodSeconds must be a number, got '60'"),
        ("gracePeriodSeconds", False, "gracePeriodSeconds must be a number, got False"),
        ("queue", 7, "queue must be a string, got 7"),
        ("queue", "", "queue must not be empty"),
        ("checkpointDir", "", "checkpointDir must not be empty"),
        ("command", ["python", True], "command must be a string or a list of strings, got ['python', True]"),
        ("command", {"run": "x"}, "command must be a string or a list of strings, got {'run': 'x'}"),
        ("topology", ["rack"], "topology must be a mapping of level, mode, got ['rack']"),
    ],
)
def test_wrong_types_are_refused_not_coerced(field: str, value: object, words: str) -> None:
    manifest = {"name": "a", "queue": "q", "command": "x", field: value}
    assert problems_of(manifest) == [words]


def test_extra_keys_are_named_with_or_without_a_close_field() -> None:
    assert problems_of(
        {"name": "a", "queue": "q", "command": "x", "replicas": 2, "zzz": 1, "checkpointdir": "/ck", 3: "x"}
    ) == [
        "unknown field 'replicas' (did you mean 'minReplicas'?)",
        "unknown field 'zzz'",
        "unknown field 'checkpointdir' (did you mean 'checkpointDir'?)",
        "unknown field '3'",
    ]


@pytest.mark.parametrize(
    "source, words",
    [
        ("", "the manifest is empty"),
        ("# nothing but a comment\n", "the manifest is empty"),
        ("just a string", "a manifest is a mapping of fields, got str"),
        ("42", "a manifest is a mapping of fields, got int"),
        ("- name: a\n", "a manifest is a mapping of fields, got list"),
    ],
)
def test_a_manifest_that_is_not_a_mapping(source: str, words: str) -> None:
    assert problems_of(source) == [words]


def test_an_empty_mapping_names_every_required_field() -> None:
    assert problems_of({}) == ["name is required", "queue is required", "command is required"]


def test_priority_comes_from_its_class_or_is_given() -> None:
    base = {"name": "a", "queue": "q", "command": "x"}
    assert parse_manifest({**base, "priority": -5}).priority == -5
    assert parse_manifest({**base, "priorityClassName": "gold"}, priority_classes={"gold": 7}).priority == 7
    assert problems_of({**base, "priorityClassName": "high"}, priority_classes={"gold": 7}) == [
        "unknown priorityClassName 'high' (known: gold=7)"
    ]
    assert problems_of({**base, "queue": "a"}, queues=set()) == ["no queue 'a' (queues: none)"]


def test_a_stored_manifest_parses_back_to_itself() -> None:
    """The coordinator stores a manifest's fields (priority resolved) and parses them on
    restart."""
    m = parse_manifest(GOOD)
    stored = {
        "name": m.name,
        "queue": m.queue,
        "priority": m.priority,
        "minReplicas": m.min_replicas,
        "maxReplicas": m.max_replicas,
        "gpusPerReplica": m.gpus_per_replica,
        "preemptible": m.preemptible,
        "gracePeriodSeconds": m.grace_period_s,
        "topology": m.topology.model_dump(),
        "command": list(m.command),
        "checkpointDir": m.checkpoint_dir,
    }
    again = parse_manifest(stored)
    assert again.job(1.0) == m.job(1.0) and again.command == m.command


@pytest.mark.parametrize("name", ["a\n", "-a", "a-", "A", "a" * 64, "a_b", ""])
def test_names_are_dns_labels(name: str) -> None:
    assert problems_of({"name": name, "queue": "q", "command": "x"}) == [
        f"name {name!r} must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
    ]
    assert parse_manifest({"name": "a" * 63, "queue": "q", "command": "x"}).name == "a" * 63


def test_stragglers_and_spares() -> None:
    """The detector's settings and the policy per job, and warm spares; every limit named."""
    from maitre import protocol
    from maitre.runtime.stragglers import Thresholds

    base = {"name": "a", "queue": "q", "minReplicas": 2, "maxReplicas": 4, "command": "x"}
    m = parse_manifest(
        {
            **base,
            "spares": 2,
            "stragglers": {"policy": "evict", "ratio": 1.5, "windows": 3, "madFloor": 0.1, "cooldownSeconds": 60},
        }
    )
    assert m.spares == 2 and m.stragglers.policy == "evict" and m.stragglers.cooldown_s == 60
    env = protocol.straggler_environ(m.stragglers)
    assert env[protocol.STRAGGLER_POLICY] == "evict" and env[protocol.STRAGGLER_RATIO] == "1.5"
    t = Thresholds.from_environ(env)  # the workers read back what the manifest said
    assert (t.policy, t.ratio, t.windows, t.mad_floor, t.window) == ("evict", 1.5, 3, 0.1, 5)
    assert parse_manifest(base).stragglers is None and parse_manifest(base).spares == 0
    bad = [
        ({"spares": 5}, "spares 5 is more than maxReplicas 4"),
        ({"spares": -1}, "spares must be at least 0"),
        ({"stragglers": {"policy": "kill"}}, "stragglers.policy must be 'report', 'evict' or"),
        ({"stragglers": {"ratio": 1.0}}, "stragglers.ratio must be at least 1.01"),
        ({"stragglers": {"window": 0}}, "stragglers.window must be at least 1"),
        ({"stragglers": {"windows": 65}}, "stragglers.windows must be at most 64"),
        ({"stragglers": {"ratio": 1.2, "drift": 1.3}}, "stragglers.drift 1.3 is above"),
        ({"stragglers": {"cooldownSeconds": -1}}, "stragglers.cooldownSeconds must be at"),
        ({"stragglers": {"treshold": 2}}, "unknown field 'stragglers.treshold'"),
    ]
    for change, words in bad:
        with pytest.raises(ManifestError) as err:
            parse_manifest({**base, **change})
        assert words in str(err.value), (change, str(err.value))


def test_a_stored_manifest_reads_back_equal_whatever_the_classes_are_now() -> None:
    """The store's record keeps the priority resolved at submission: a class renumbered since
    does not move a stored job, and a record an older coordinator wrote (absent fields as
    null, no stragglers) still reads."""
    named = parse_manifest(
        {"name": "a", "queue": "q", "priorityClassName": "team", "command": "python x.py", "stragglers": {"z": 4}},
        priority_classes={"team": 500},
    )
    record = manifest_record(named)
    assert record["priority"] == 500 and record["stragglers"]["z"] == 4 and "checkpointDir" not in record
    assert manifest_from_record(json.loads(json.dumps(record))) == named
    older = {"name": "b", "queue": "q", "priority": 100, "minReplicas": 1, "maxReplicas": 2, "gpusPerReplica": 1}
    older |= {"nprocPerReplica": 1, "mesh": None, "preemptible": True, "gracePeriodSeconds": 30.0, "topology": None}
    older |= {"command": ["python", "x.py"], "checkpointDir": None, "spares": 0}
    assert manifest_from_record(older) == parse_manifest({k: v for k, v in older.items() if v is not None})
