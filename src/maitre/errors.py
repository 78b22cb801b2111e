"""maitre's exceptions, in one place::

    MaitreError
    ├── IllegalMove             a job state change the state machine does not allow (a bug in
    │                           maitre; see maitre.scheduling.lifecycle)
    ├── WorkerStopped           a training loop cannot go on in its job (refused, the
    │                           coordinator out of reach too long, the job failed)
    ├── RequestError            a request the coordinator refuses (the API answers 4xx)
    │   ├── BadRequest          400: the request is wrong (``field`` says where)
    │   └── NotFound            404: no such job, node or worker
    └── ClientError             what a client of the coordinator sees
        ├── CoordinatorUnreachable   the connection failed or timed out (the caller decides
        │                            whether to retry)
        └── ApiError            the coordinator answered 4xx/5xx; ``status``, ``message``

Checkpoints, manifests and the coordinator's store have their own errors, each a ``ValueError``
or ``Exception`` next to the format it guards (``CheckpointError``, ``ManifestError``,
``StoreError``): they are raised by code that has no coordinator.

Stdlib only: the training process imports it.
"""

from __future__ import annotations


class MaitreError(Exception):
    pass


class IllegalMove(MaitreError, RuntimeError):
    pass


class RequestError(MaitreError):
    status = 400

    def __init__(self, message: str, field: str = "body") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class BadRequest(RequestError, ValueError):
    status = 400


class NotFound(RequestError, KeyError):
    status = 404

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class WorkerStopped(MaitreError, RuntimeError):
    """A training loop cannot go on in its job: the coordinator refused it, stayed out of reach
    past the worker's timeout, or stopped it because the job failed."""


class ClientError(MaitreError):
    pass


class CoordinatorUnreachable(ClientError, ConnectionError):
    pass


class ApiError(ClientError, RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"coordinator answered {status}: {message}")
        self.status = status
        self.message = message
