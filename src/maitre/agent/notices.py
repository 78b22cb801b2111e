"""Spot notices: the agent's watch on the source that says when its node will be taken away.

A source is named ``file:PATH`` or an ``http(s)://`` URL (``maitre agent --spot-notice``). The
watcher polls it every ``interval_s`` (AWS's guidance for its instance metadata is 5 s) and
understands three shapes (and SIGTERM itself, :class:`SigtermSource`, polled often):

=============  ===========================================================================
AWS            ``/latest/meta-data/spot/instance-action``: 404 while there is no notice; 200
               with ``{"action": "terminate"|"stop", "time": "2026-12-01T21:00:00Z"}``: the
               node goes at ``time``. IMDSv2: the watcher asks for a session token (``PUT
               /latest/api/token``) and sends it; where the service has no tokens (IMDSv1
               only) it asks without one.
GCE            ``/computeMetadata/v1/instance/preempted`` (sent with ``Metadata-Flavor:
               Google``): ``FALSE``, or ``TRUE``: the node goes ``default_notice_s`` (30 s, as
               on GCE) after the watcher first saw it.
a file         absent: no notice; present: ``{"deadline": <unix time>}``, ``{"notice_s": 30}``
               (counted from the file's modification time) or the AWS shape.
=============  ===========================================================================

A source that cannot be reached, or answers with anything else, is logged once per change of
what it says (not once a poll) and the node keeps running: only a well-formed notice drains it.
Once a notice is seen it stands (clouds do not take one back); the agent sends it with every
beat (:class:`maitre.protocol.SpotNotice`) as the seconds left, so that the coordinator needs
no clock of the agent's.

Standard library only; time comes from ``clock`` (unix seconds), so tests drive it.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

log = logging.getLogger("maitre.agent.notices")

DEFAULT_INTERVAL_S = 5.0
"""How often the source is polled (AWS's guidance for ``spot/instance-action``)."""
DEFAULT_NOTICE_S = 30.0
"""The warning a notice without a time of its own gives (GCE's ``preempted``: 30 s)."""
_MAX_BODY = 64 << 10


class NoticeError(ValueError):
    """The source's answer is no notice and no "no notice" either (garbage)."""


@dataclass(frozen=True, slots=True)
class Notice:
    deadline: float
    """Unix time (the agent's clock) when the node goes."""
    action: str
    source: str

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.deadline - now)


# -- what a source says -------------------------------------------------------------------------
def parse_time(text: object) -> float:
    """An RFC 3339 time (``2026-12-01T21:00:00Z``) as unix seconds."""
    if not isinstance(text, str):
        raise NoticeError(f"time must be an RFC 3339 string, got {text!r}")
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise NoticeError(f"time {text!r} is not an RFC 3339 time") from None
    if when.tzinfo is None:
        raise NoticeError(f"time {text!r} has no time zone")
    return when.timestamp()


def parse_aws(body: str) -> tuple[str, float]:
    """AWS's instance-action document: (action, deadline)."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise NoticeError(f"not JSON: {body[:80]!r}") from None
    if not isinstance(doc, dict) or "action" not in doc or "time" not in doc:
        raise NoticeError(f'expected {{"action": ..., "time": ...}}, got {body[:80]!r}')
    action = doc["action"]
    if action not in ("terminate", "stop", "hibernate"):
        raise NoticeError(f"unknown action {action!r} (terminate, stop or hibernate)")
    return action, parse_time(doc["time"])


def parse_gce(body: str) -> bool | None:
    """GCE's ``preempted``: True, False, or None when the body is not that shape."""
    word = body.strip().upper()
    return True if word == "TRUE" else False if word == "FALSE" else None


def parse_file(text: str, mtime: float) -> tuple[str, float]:
    """A notice file: (action, deadline)."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise NoticeError(f"not JSON: {text[:80]!r}") from None
    if isinstance(doc, dict) and "action" in doc and "time" in doc:
        return parse_aws(text)
    if not isinstance(doc, dict) or len(doc.keys() & {"deadline", "notice_s"}) != 1:
        raise NoticeError(
            'expected {"deadline": <unix time>}, {"notice_s": <seconds>} or '
            f'AWS\'s {{"action": ..., "time": ...}}, got {text[:80]!r}'
        )
    key = "deadline" if "deadline" in doc else "notice_s"
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise NoticeError(f"{key} must be a number >= 0, got {value!r}")
    action = doc.get("action", "terminate")
    if not isinstance(action, str) or not action:
        raise NoticeError(f"action must be a word, got {action!r}")
    return action, float(value) if key == "deadline" else mtime + float(value)


# -- sources ------------------------------------------------------------------------------------
class FileSource:
    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("--spot-notice file: needs a path (file:PATH)")
        self.path = Path(path)
        self.description = f"file:{path}"

    def read(self, now: float, default_notice_s: float) -> tuple[str, float] | None:
        try:
            mtime = os.stat(self.path).st_mtime
            with open(self.path, "rb") as f:
                text = f.read(_MAX_BODY).decode("utf-8", "replace")
        except FileNotFoundError:
            return None
        if not text.strip():
            return None  # being written: read it again next poll
        return parse_file(text, mtime)


AWS_TOKEN_TTL_S = 21600
"""The IMDSv2 session token's lifetime asked for (AWS's most: 6 hours); renewed before it ends."""


class HttpSource:
    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = url
        self.description = url
        self.timeout_s = timeout_s
        self._seen_true: float | None = None
        """When GCE's ``preempted`` first said TRUE (its deadline counts from then)."""
        split = urllib.parse.urlsplit(url)
        self._token_url = (
            f"{split.scheme}://{split.netloc}/latest/api/token" if split.path.startswith("/latest/meta-data/") else None
        )
        """AWS's instance metadata: where its IMDSv2 session tokens come from."""
        self._token: tuple[str, float] | None = None
        """(token, monotonic time to renew it by); ("", t): the service has no tokens."""

    def read(self, now: float, default_notice_s: float) -> tuple[str, float] | None:
        body = self._get(retry=True)
        if body is None:
            return None
        gce = parse_gce(body)
        if gce is not None:
            if not gce:
                return None
            if self._seen_true is None:
                self._seen_true = now
            return "preempt", self._seen_true + default_notice_s
        return parse_aws(body)

    def _get(self, retry: bool) -> str | None:
        """The body (None: 404, AWS's "no instance action"); NoticeError for anything else."""
        headers = {"Metadata-Flavor": "Google"}
        token = self._aws_token()
        if token:
            headers["X-aws-ec2-metadata-token"] = token
        request = urllib.request.Request(self.url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.read(_MAX_BODY).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # AWS: no instance action scheduled
                return None
            if exc.code == 401 and self._token_url and retry:  # a token expired or revoked
                self._token = None
                return self._get(retry=False)
            raise NoticeError(f"HTTP {exc.code} {exc.reason}") from None
        except http.client.HTTPException as exc:  # not HTTP at all
            raise NoticeError(f"not an HTTP answer ({type(exc).__name__})") from None

    def _aws_token(self) -> str:
        """IMDSv2's session token ("" where the URL is not AWS's metadata, or where the service
        gives none: IMDSv1, which answers the token's PUT with 403, 404, 405 or 501)."""
        if self._token_url is None:
            return ""
        if self._token is not None and time.monotonic() < self._token[1]:
            return self._token[0]
        request = urllib.request.Request(
            self._token_url, method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                token = reply.read(4096).decode("ascii", "replace").strip()
        except urllib.error.HTTPError as exc:
            if exc.code in (403, 404, 405, 501):  # no tokens here: ask without (for an hour)
                self._token = ("", time.monotonic() + 3600)
                return ""
            raise NoticeError(f"IMDSv2 token: HTTP {exc.code} {exc.reason}") from None
        except http.client.HTTPException as exc:
            raise NoticeError(f"IMDSv2 token: not an HTTP answer ({type(exc).__name__})") from None
        if not token or any(c.isspace() for c in token):
            raise NoticeError(f"IMDSv2 token: not a token ({token[:40]!r})")
        self._token = (token, time.monotonic() + AWS_TOKEN_TTL_S - 60)
        return token


class SigtermSource:
    """SIGTERM as a notice of ``notice_s`` seconds (``maitre agent --sigterm-notice S``): what a
    cluster engine sends before it takes the node back (Slurm's preemption, then ``GraceTime``;
    ``scancel``; a pod's deletion, then its grace period). :meth:`arm` installs the handler
    (main thread only); :meth:`fire` is what it does."""

    description = "SIGTERM"

    def __init__(self, notice_s: float, clock: Callable[[], float] = time.time) -> None:
        if not notice_s > 0:
            raise ValueError(f"--sigterm-notice must be a positive number of seconds, got {notice_s}")
        self.notice_s = notice_s
        self.clock = clock
        self.fired_at: float | None = None

    def arm(self) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: self.fire())

    def fire(self) -> None:
        if self.fired_at is None:
            self.fired_at = self.clock()

    def read(self, now: float, default_notice_s: float) -> tuple[str, float] | None:
        return None if self.fired_at is None else ("terminate", self.fired_at + self.notice_s)


def source(spec: str) -> FileSource | HttpSource:
    """``file:PATH`` or an ``http(s)://`` URL (ValueError otherwise)."""
    if spec.startswith("file:"):
        return FileSource(spec[len("file:") :])
    if spec.startswith(("http://", "https://")):
        rest = spec.split("://", 1)[1]
        if not rest or rest.startswith("/"):
            raise ValueError(f"--spot-notice {spec!r}: the URL has no host")
        return HttpSource(spec)
    raise ValueError(f"--spot-notice {spec!r}: expected file:PATH or an http(s):// URL")


# -- the watch ----------------------------------------------------------------------------------
class NoticeWatcher:
    """Polls a source every ``interval_s`` on a thread of its own; ``current`` is the notice
    once one was seen, and ``on_notice`` is called once, then."""

    def __init__(
        self,
        src: FileSource | HttpSource | SigtermSource,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        default_notice_s: float = DEFAULT_NOTICE_S,
        on_notice: Callable[[Notice], None] = lambda notice: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"--spot-notice-interval must be positive, got {interval_s}")
        if not default_notice_s >= 0:
            raise ValueError(f"the default notice must be >= 0 s, got {default_notice_s}")
        self.src = src
        self.interval_s = interval_s
        self.default_notice_s = default_notice_s
        self.on_notice = on_notice
        self.clock = clock
        self.current: Notice | None = None
        self.status = "not polled yet"
        """What the source said last: ``no notice``, ``notice ...`` or what was wrong."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> Notice | None:
        """Ask the source once (the thread does this every ``interval_s``)."""
        if self.current is not None:
            return self.current
        now = self.clock()
        try:
            said = self.src.read(now, self.default_notice_s)
        except NoticeError as exc:
            self._say(f"garbage from {self.src.description}: {exc}", logging.WARNING)
            return None
        except (OSError, ValueError) as exc:  # unreachable, refused, timed out, unreadable
            reason = getattr(exc, "reason", None) or exc
            self._say(f"{self.src.description} unreachable: {reason}", logging.WARNING)
            return None
        if said is None:
            self._say(f"{self.src.description}: no notice", logging.INFO)
            return None
        action, deadline = said
        self.current = Notice(deadline, action, self.src.description)
        self._say(
            f"{self.src.description}: spot notice, {action} in {self.current.remaining_s(now):.0f}s", logging.WARNING
        )
        self.on_notice(self.current)
        return self.current

    def _say(self, status: str, level: int) -> None:
        if status != self.status:  # once per change, not once a poll
            self.status = status
            log.log(
                level,
                "%s (the node keeps running)" if level == logging.WARNING and self.current is None else "%s",
                status,
            )

    def start(self) -> "NoticeWatcher":
        self._thread = threading.Thread(target=self._run, name="maitre-notices", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set() and self.current is None:
            self.poll()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
