"""A run's scripted story (``maitre run --events kill@60,join@120,leave@200``): faults and
membership changes at chosen steps, for demos and drills (``kill-data``: SIGKILL one of a
worker's data loader processes, as the OOM killer would). Torch-free, so that the CLI refuses a
bad ``--events`` before it imports anything heavy."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
