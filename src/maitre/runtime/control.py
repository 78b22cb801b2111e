"""The control slots: what every rank adds to the step's last reduction beside its gradients.

Summed over the epoch's group with the gradients (:mod:`maitre.runtime.reduction` gives them a
float64 buffer after the last bucket), they make every rank take the same decision at the same
step with no collective of their own: whether to commit, to resize, to save, to stop. A flag is
set where it is > 0 after the sum (one rank asking is enough); a count is the sum.

After the fixed slots (:class:`Slot`) come the timing slots of the straggler detector, three per
member of the epoch's group (:func:`timing`): its compute per unit of work over the window that
ends at this step, its held value over the last windows, and its work per step; zero on the
other steps (:mod:`maitre.runtime.stragglers`).
"""

from __future__ import annotations

from enum import IntEnum


class Slot(IntEnum):
    """The fixed slots, by index."""

    LOSS = 0  # the loss sum of the step's samples (its global sum, once reduced)
    COUNT = 1  # the samples the step trained on (the divisor of the mean)
    RESIZE = 2  # a member was told of a membership change: stop at this boundary
    SAVE = 3  # a checkpoint is due at this step
    STOP = 4  # a member must stop (SIGTERM, the job suspended, its own end)
    TOKEN = 5  # rank 0's random number naming the checkpoint's write (0 elsewhere)
    BUSY = 6  # a member's writer is still writing the last checkpoint
    NONFINITE = 7  # in a replica of several processes: a gradient that is not finite
    LOST = 8  # ... and its epoch lost on one of them
    READY = 9  # a listener (a streamed joiner) caught up: count of those who did
    SKIPPED = 10  # samples whose data could not be loaded (a loader's on_error="skip")


SLOTS = len(Slot)
"""The fixed slots; the timing slots come after them."""

TIMING_PER_MEMBER = 3


def timing_slots(world_size: int) -> int:
    """How many timing slots an epoch of ``world_size`` members needs."""
    return TIMING_PER_MEMBER * world_size


def timing(world_size: int, rank: int) -> tuple[int, int, int]:
    """The indices of ``rank``'s three timing slots: its window's value, its held value and its
    work per step."""
    return SLOTS + rank, SLOTS + world_size + rank, SLOTS + 2 * world_size + rank


def split_timing(values: list[float]) -> tuple[list[float], list[float], list[float]]:
    """The reduced timing slots (every member's), as (values, held values, work per step)."""
    world = len(values) // TIMING_PER_MEMBER
    return values[:world], values[world : 2 * world], values[2 * world :]
