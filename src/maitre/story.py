"""A run's scripted story (``maitre run --events kill@60,join@120,leave@200``): faults and
membership changes at chosen steps, for demos and drills (``kill-data``: SIGKILL one of a
worker's data workers, as the OOM killer would). Torch-free, so that the CLI refuses a bad
``--events`` before it imports anything heavy.

``kill-data`` kills a data worker of a :class:`maitre.data.Loader` (it names itself
``maitre-data-N``), wherever it sits below the training process. maitre cannot tell whether an
arbitrary script starts data workers, so it takes a job to have them when its command says so:
``--data-workers N`` or ``--num-workers N`` (or ``--data_workers``, ``--num_workers``; ``=N``
too; the last one counts) with N >= 1, as the shipped examples take it. Without that, a story
with ``kill-data`` is refused before anything starts (:func:`check_story`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

EVENT_KINDS = ("kill", "hang", "join", "leave", "kill-data")
DEMO_EVENTS = "kill@60,join@120,leave@200"


@dataclass(frozen=True, slots=True)
class StoryEvent:
    kind: str
    step: int


def parse_events(spec: str) -> list[StoryEvent]:
    """``kill@60,join@120,leave@200`` (or ``demo``) -> events sorted by step."""
    if spec == "demo":
        spec = DEMO_EVENTS
    events = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"([a-z-]+)@(\d+)", part)
        if not match or match.group(1) not in EVENT_KINDS:
            raise ValueError(
                f"bad event {part!r}: expected KIND@STEP with KIND one of "
                f"{', '.join(EVENT_KINDS)} (e.g. kill@60,join@120)"
            )
        events.append(StoryEvent(match.group(1), int(match.group(2))))
    return sorted(events, key=lambda e: e.step)


DATA_WORKER_FLAGS = ("--data-workers", "--num-workers", "--data_workers", "--num_workers")
"""A training command's flags that say how many data workers it loads with (``kill-data``)."""


def data_workers_asked(args: Sequence[str]) -> int | None:
    """The data workers a training command's arguments ask for (the last of
    :data:`DATA_WORKER_FLAGS` wins, as with argparse), or None when none says or its value is
    no integer."""
    asked: int | None = None
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in DATA_WORKER_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            asked = int(value)
        except ValueError:
            asked = None
    return asked


def check_story(events: Sequence[StoryEvent], args: Sequence[str]) -> None:
    """Refuse a story the job cannot play: ``kill-data`` on a job whose command (``args``, the
    script's arguments) shows no data workers."""
    kill_data = [e for e in events if e.kind == "kill-data"]
    if not kill_data:
        return
    asked = data_workers_asked(args)
    if asked is not None and asked >= 1:
        return
    shown = "no data workers" if asked is None else f"{asked} data workers"
    raise ValueError(
        f"kill-data@{kill_data[0].step} kills a data worker of maitre.data.Loader, and this job's command "
        f"shows {shown}: pass the script --data-workers N or --num-workers N with N >= 1 (the flag that "
        "makes it load with data workers), or leave kill-data out"
    )
