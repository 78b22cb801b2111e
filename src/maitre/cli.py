"""``maitre`` command line: run, up, agent, submit, status, scale, suspend, resume, cancel, demo,
simulate.

Every command validates its input before it starts anything; a bad flag, a missing script or an
unreachable coordinator is one line on stderr and a non-zero exit, with nothing left running. A
command that needs a coordinator waits ``--wait`` seconds (default :data:`WAIT_S`) for one that
is starting (its token file not written yet, its port not open or not answering yet) before it
says that it is not up.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import ssl
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

from maitre import protocol
from maitre.protocol import COORDINATOR as _COORDINATOR
from maitre.protocol import LOG as _LOG
from maitre.protocol import TLS_CA as _TLS_CA
from maitre.protocol import TOKEN as _TOKEN
from maitre.protocol import TOKEN_FILE as _TOKEN_FILE
from maitre.wire import ApiError, Client, CoordinatorUnreachable, parse_address

if TYPE_CHECKING:
    from maitre.scheduling.model import Queue


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{self.prog}: {message} (see --help)")


# What each extra of the package installs (pyproject.toml), by the modules a command imports:
# `pip install maitre` is the training runtime alone (a worker, its agent, the client commands).
EXTRAS = {
    "server": ("fastapi", "uvicorn", "prometheus_client"),
    "sim": ("scipy", "matplotlib"),
    "kubernetes": ("kubernetes",),
}


def require(extra: str, command: str, modules: Sequence[str] | None = None) -> None:
    """Refuses ``command`` up front, naming the extra to install, when a module it needs is
    missing (not half-way through, with a coordinator started)."""
    import importlib.util

    missing = [m for m in modules or EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"maitre {command} needs {', '.join(missing)}, which the {extra!r} "
            f"extra installs: pip install 'maitre[{extra}]'"
        )


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX``."""
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise UsageError(f"--nnodes must be N or MIN:MAX, got {text!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1:
        raise UsageError(f"--nnodes minimum must be at least 1, got {text!r}")
    if lo > hi:
        raise UsageError(f"--nnodes {text}: the minimum {lo} exceeds the maximum {hi}")
    return lo, hi


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} must be at least 1, got {value}")
    return value


WAIT_S = 30.0
"""How long a command waits for a coordinator that is starting, by default (``--wait``)."""


def _wait_seconds(text: str) -> float:
    """``--wait``'s value: a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < math.inf:  # (nan is neither)
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds (0: no wait), got {text!r}")
    return value


def _coordinator(args: argparse.Namespace) -> Client:
    """The coordinator the command names, once it answers (see :func:`_up`)."""
    return _up(_client(args), args)


def _client(args: argparse.Namespace) -> Client:
    """A client of the coordinator the command names, its address and ``--tls-ca`` checked (it
    asks nothing yet); its token is ``$MAITRE_TOKEN``'s, until :func:`_up` reads the token file."""
    address = args.coordinator or os.environ.get(_COORDINATOR)
    if not address:
        raise UsageError("no coordinator: pass --coordinator HOST:PORT or set MAITRE_COORDINATOR")
    try:
        parse_address(address)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tls_ca = args.tls_ca or os.environ.get(_TLS_CA) or None
    try:
        return Client(address, timeout_s=5.0, token=os.environ.get(_TOKEN) or None, tls_ca=tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--tls-ca {tls_ca}: not a PEM certificate bundle ({exc})") from None


def _up(client: Client, args: argparse.Namespace) -> Client:
    """``client`` with the token file's token, once its coordinator answers: a coordinator that
    is starting is waited for up to ``--wait`` seconds (its token file not there yet; its port
    not open, or not answering: ``/health``, which needs no token, is asked), then the command
    fails, saying that it is not up. ``--wait 0`` asks once, as the command's own request."""
    wait_s: float = args.wait
    deadline = time.monotonic() + wait_s
    said = not sys.stderr.isatty()  # on a terminal, one line says that it waits; a script's stderr stays one line

    def waiting() -> None:
        nonlocal said
        if not said:
            said = True
            print(f"maitre: waiting up to {wait_s:g}s for the coordinator at {client.address}", file=sys.stderr)

    token_file = args.token_file or os.environ.get(_TOKEN_FILE)
    if token_file:
        while wait_s > 0 and not Path(token_file).exists():
            if time.monotonic() >= deadline:
                raise CoordinatorUnreachable(
                    f"the coordinator at {client.address} is not up: no token file {token_file} after "
                    f"waiting {wait_s:g}s (its `maitre up` writes it as it starts); --wait SECONDS waits longer"
                )
            waiting()
            time.sleep(0.1)
        client.token = _read_token(token_file)
    while wait_s > 0:
        try:
            client.get(protocol.HEALTH, timeout_s=max(0.1, min(client.timeout_s, deadline - time.monotonic())))
            break
        except ApiError:
            break  # it answers (the command's own request says what is wrong)
        except CoordinatorUnreachable as exc:
            if isinstance(exc.__cause__, ssl.SSLError):
                raise  # (a certificate that is not the coordinator's: waiting mends nothing)
            if time.monotonic() >= deadline:
                raise CoordinatorUnreachable(
                    f"cannot reach the coordinator at {client.address} after waiting {wait_s:g}s: it is not up "
                    f"({exc.__cause__ or exc}); --wait SECONDS waits longer"
                ) from None
            waiting()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return client


def _read_token(path: str) -> str:
    """A token file's token (a Kubernetes Secret's key, the coordinator's ``<state-dir>/token``)."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --token-file: {exc}") from None
    if not token:
        raise UsageError(f"--token-file {path} is empty")
    return token


def cmd_run(args: argparse.Namespace) -> int:
    from maitre.story import check_story, parse_events

    require("server", "run")  # it hosts the job's coordinator

    lo, hi = parse_nnodes(args.nnodes)
    per_replica = _positive("--nproc-per-replica", args.nproc_per_replica)
    nproc = _positive("--nproc-per-node", args.nproc_per_node if args.nproc_per_node is not None else per_replica)
    if nproc % per_replica:
        raise UsageError(f"--nproc-per-node {nproc} does not hold whole replicas of --nproc-per-replica {per_replica}")
    if args.mesh is not None:
        from maitre.runtime.replica import MeshSpec

        try:
            MeshSpec.parse(args.mesh).check(per_replica)
        except ValueError as exc:
            raise UsageError(f"--mesh: {exc}") from None
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.elastic == "restart" and (args.events or args.mesh or args.resume):
        flag = "--events" if args.events else "--mesh" if args.mesh else "--resume"
        raise UsageError(
            f"{flag} is maitre's loop's (an unmodified script reports no steps and resumes from its own "
            "checkpoints); leave it out with --elastic restart"
        )
    if args.success_marker is not None and (args.elastic != "restart" or not args.success_marker):
        raise UsageError("--success-marker needs --elastic restart and a non-empty text")
    from maitre.runtime.stragglers import Injected, Thresholds

    try:  # the workers inherit them: an error here, before anything starts
        Thresholds.from_environ(os.environ)
        Injected.from_environ(os.environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.local_nodes is not None and not lo <= args.local_nodes <= hi:
        raise UsageError(f"--local-nodes {args.local_nodes} outside --nnodes {lo}:{hi}")
    if args.module:
        command = [sys.executable, "-m", args.script, *args.script_args]
    else:
        script = Path(args.script)
        if not script.is_file():
            raise UsageError(f"script not found: {args.script}")
        command = [sys.executable, str(script.resolve()), *args.script_args]
    try:
        events = parse_events(args.events or "")
        check_story(events, args.script_args)  # (kill-data: the command must show data workers)
    except ValueError as exc:
        raise UsageError(f"--events: {exc}") from None
    checkpoint_dir = _checkpoint_dir(args)
    _check_port(args.host, args.port)
    from maitre.launch import Run, RunConfig  # torch: only once the flags are known good

    cfg = RunConfig(
        command=command,
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=nproc,
        nproc_per_replica=per_replica,
        mesh=args.mesh,
        max_restarts=args.max_restarts,
        local_nodes=args.local_nodes,
        host=args.host,
        port=args.port,
        job_id=args.job_id,
        events=events,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        ledger=not args.no_ledger,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        mtbf_s=args.mtbf,
        checkpoint_keep=args.checkpoint_keep,
        resume=args.resume,
        grace_period_s=args.grace_period,
        elastic=args.elastic,
        success_marker=args.success_marker,
    )
    try:
        run = Run(cfg)
    except ValueError as exc:  # the job it would submit is not a valid one (its --job-id)
        raise UsageError(f"--job-id {args.job_id}: {exc}") from None
    except (OSError, RuntimeError) as exc:
        raise UsageError(f"cannot start the coordinator on {args.host}:{args.port}: {exc}") from None
    for sig in (signal.SIGINT, signal.SIGTERM):  # the first one suspends (with checkpoints)
        signal.signal(sig, lambda signum, frame: run.request_stop(signal.Signals(signum).name))
    run.start()
    try:
        return run.wait()
    except KeyboardInterrupt:
        run.shutdown()
        return 130


def _checkpoint_dir(args: argparse.Namespace) -> Path | None:
    """Check the checkpoint flags; refuse to mix a new run into an old run's checkpoints."""
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    if args.checkpoint_keep < 1:
        raise UsageError(f"--checkpoint-keep must be at least 1, got {args.checkpoint_keep}")
    if args.mtbf is not None and not args.mtbf > 0:
        raise UsageError(f"--mtbf must be a positive number of seconds, got {args.mtbf}")
    if not args.grace_period > 0:
        raise UsageError(f"--grace-period must be positive, got {args.grace_period}")
    if args.checkpoint_dir is None:
        for flag, value in (
            ("--resume", args.resume),
            ("--checkpoint-every", args.checkpoint_every),
            ("--mtbf", args.mtbf),
        ):
            if value:
                raise UsageError(f"{flag} needs --checkpoint-dir")
        return None
    from maitre.checkpoint.loader import newest_complete

    directory = Path(args.checkpoint_dir)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--checkpoint-dir {directory} exists and is not a directory")
    newest = newest_complete(directory)
    if newest is not None and not args.resume:
        raise UsageError(
            f"{directory} holds checkpoints of an earlier run (newest: {newest.name});"
            " pass --resume to continue from it, or choose another directory"
        )
    if newest is None and args.resume:
        print(f"maitre: no complete checkpoint in {directory}: starting from step 0", file=sys.stderr, flush=True)
    return directory


def _notices(args: argparse.Namespace):
    """``--spot-notice`` and its interval, checked (None without a source)."""
    from maitre.agent.notices import NoticeWatcher, source

    for flag, value in (
        ("--spot-notice-interval", args.spot_notice_interval),
        ("--spot-notice-default", args.spot_notice_default),
    ):
        if value is not None and not (value > 0 and value < math.inf):
            raise UsageError(f"{flag} must be a positive number of seconds, got {value:g}")
    if args.sigterm_notice is not None:
        from maitre.agent.notices import SigtermSource

        if args.spot_notice is not None:
            raise UsageError("--sigterm-notice and --spot-notice: one notice source per agent")
        try:
            src = SigtermSource(args.sigterm_notice)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return NoticeWatcher(src, interval_s=0.2)
    if args.spot_notice is None:
        for flag, value in (
            ("--spot-notice-interval", args.spot_notice_interval),
            ("--spot-notice-default", args.spot_notice_default),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --spot-notice")
        return None
    try:
        src = source(args.spot_notice)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    kw = {
        k: v
        for k, v in (("interval_s", args.spot_notice_interval), ("default_notice_s", args.spot_notice_default))
        if v is not None
    }
    return NoticeWatcher(src, **kw)


def _health_monitor(args: argparse.Namespace):
    """``--health-interval``, ``--health-timeout``, ``--health-check``, checked."""
    from maitre.agent.health import HealthConfig, HealthMonitor, command

    for flag, value in (("--health-interval", args.health_interval), ("--health-timeout", args.health_timeout)):
        if not value < math.inf:
            raise UsageError(f"{flag} must be a number of seconds, got {value:g}")
    try:
        cfg = HealthConfig(
            interval_s=args.health_interval,
            timeout_s=args.health_timeout,
            command=command(args.health_check) if args.health_check else None,
            builtin=not args.no_health_builtin,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return HealthMonitor(cfg)


def cmd_agent(args: argparse.Namespace) -> int:
    from maitre.agent import netaddr, warmstart
    from maitre.agent.agent import Agent

    client = _client(args)  # (the coordinator is waited for once every flag is checked)
    nproc = _positive("--nproc-per-node", args.nproc_per_node)
    labels = _labels(args.label or [])
    node = args.node_id
    if args.slurm:  # a replica job's agent: the node is Slurm's, and so are its labels
        from maitre.engines.slurm.agentside import identity
        from maitre.engines.slurm.commands import Slurm

        try:
            node, slurm_labels = identity(os.environ, Slurm())
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        labels = {**slurm_labels, **labels}
    if args.iface and args.iface not in {name for _, name in socket.if_nameindex()}:
        raise UsageError(f"--iface {args.iface}: no such network interface on this machine")
    notices = _notices(args)
    health = _health_monitor(args)
    _up(client, args)  # one that is starting is waited for, up to --wait
    client.get(protocol.JOBS)  # fail fast (unreachable, or a wrong token), before any worker starts
    node = node or f"{socket.gethostname()}-{os.getpid()}"
    # A SIGTERM that reaches the workers too (Slurm's proctrack/cgroup) is the agent's notice.
    extra_env = {protocol.SIGTERM_DRAINS: "1"} if args.sigterm_notice is not None else {}
    agent = Agent(
        client.address,
        node,
        nproc,
        token=client.token,
        labels=labels,
        iface=args.iface,
        tls_ca=client.tls_ca,
        notices=notices,
        health=health,
        extra_env=extra_env,
    )
    print(
        f"maitre: agent {node} with {nproc} slot(s) joined {client.address}"
        + (
            f", watching {notices.src.description} for spot notices every {notices.interval_s:g}s"
            if notices is not None
            else ""
        ),
        flush=True,
    )
    advertised = netaddr.worker_env(client.address, os.environ, args.iface)
    if advertised:
        print("maitre: workers advertise " + " ".join(f"{k}={v}" for k, v in advertised.items()), flush=True)
    # `kill -USR1` prints every thread's stack to stderr: where a stuck agent waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.sigterm_notice is None:  # SIGTERM stops the agent as SIGINT does: workers too
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    if notices is not None and hasattr(notices.src, "arm"):
        notices.src.arm()
        threading.Thread(target=_leave_when_drained, args=(agent, notices), daemon=True).start()
    try:
        agent.serve()
    except KeyboardInterrupt:
        pass
    finally:
        agent.stop()
        warmstart.reap()  # (the process's one agent: whatever it forked ends with it)
    return 0


def _leave_when_drained(agent: Any, notices: Any) -> None:
    """``--sigterm-notice``: after SIGTERM, once the coordinator has heard the notice and the
    node's workers are gone (they leave at a step boundary), or at the notice's deadline, the
    agent stops (its last beat says the node goes now)."""
    src = notices.src
    while src.fired_at is None:
        time.sleep(0.1)
    fired = time.monotonic()
    deadline = fired + src.notice_s
    while time.monotonic() < deadline:
        heard = notices.current is not None and agent.heard_at is not None and agent.heard_at > fired
        if heard and not agent.running():
            break
        time.sleep(0.1)
    agent.leave()


def cmd_scale(args: argparse.Namespace) -> int:
    reply = _coordinator(args).post(protocol.JOB_SCALE.format(job=args.job), {"workers": args.workers})
    leaving = ", ".join(reply["leaving"]) or "none"
    print(f"maitre: job {args.job} scaled to {reply['target']} workers (leaving: {leaving})")
    return 0


def cmd_suspend(args: argparse.Namespace) -> int:
    reply = _coordinator(args).post(protocol.JOB_SUSPEND.format(job=args.job), {"reason": "maitre suspend"})
    print(f"maitre: job {args.job} is {reply['state']}: its workers checkpoint, then stop")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    client = _coordinator(args)
    jobs = [client.get(protocol.JOB.format(job=args.job))] if args.job else client.get(protocol.JOBS)["jobs"]
    nodes = [] if args.job else client.get(protocol.NODES)["nodes"]
    queues = [] if args.job else client.get(protocol.QUEUES)["queues"]
    if args.json:
        print(json.dumps({"jobs": jobs, "nodes": nodes, "queues": queues} if not args.job else jobs[0], indent=2))
        return 0
    rows = [
        [
            j["job_id"],
            j.get("queue", "-"),
            str(j.get("priority", "-")),
            j["state"],
            str(j["epoch"]),
            str(j["step"]),
            f"{len(j['members'])}/{j['max_workers']}",
            _spares(j),
            str(j["failures"]),
            _placement(j.get("placement")) or j.get("waiting_for", ""),
        ]
        for j in jobs
    ]
    print(_table(["JOB", "QUEUE", "PRIO", "STATE", "EPOCH", "STEP", "WORKERS", "SPARES", "FAILS", "NODES"], rows))
    if nodes:
        spares = {w for j in jobs for w in j.get("spares", [])}  # marked in a node's list
        print()
        print(
            _table(
                ["NODE", "STATE", "SLOTS", "USED", "RACK", "TYPE", "PRICE/H", "PHI", "HEALTH", "WORKERS"],
                [
                    [
                        n["node"],
                        "RECLAIMED"
                        if n.get("reclaimed")
                        else "draining"
                        if n.get("draining")
                        else "UNHEALTHY"
                        if n.get("unhealthy")
                        else "suspect"
                        if n.get("suspect")
                        else "alive"
                        if n["alive"]
                        else "DEAD",
                        str(n["slots"]),
                        str(n["used"]),
                        n["labels"].get("rack", ""),
                        n["labels"].get("capacity_type", "on-demand"),
                        "-" if n.get("price") is None else f"{n['price']:g}",
                        "-" if n["phi"] is None else f"{n['phi']:.1f}",
                        _health(n.get("health")),
                        " ".join(f"{w}(spare)" if w in spares else w for w in n["workers"]),
                    ]
                    for n in nodes
                ],
            )
        )
        for n in nodes:  # why a node is avoided
            h, sus = n.get("health"), n.get("suspect")
            if h is not None and not h["ok"]:
                print(
                    f"  {n['node']}: health probe failed ({h['probe']}, {h['seconds']:g}s, "
                    f"{h['age_s']:.0f}s ago): {' | '.join(h['detail'].splitlines())}"
                )
            if sus is not None:
                left = max(0.0, sus["until"] - time.time())
                print(
                    f"  {n['node']}: suspect for up to {left:.0f}s more, or until a health "
                    f"probe passes: {sus['reason']}"
                )
        report = client.get(protocol.REPORT)
        if report.get("cost") is not None:
            print()
            print(
                _table(
                    ["QUEUE", "SLOT-H", "SPOT SLOT-H", "COST", "ALL ON-DEMAND"],
                    [
                        [
                            q,
                            f"{c['held_slot_s'] / 3600:.3f}",
                            f"{c['spot_slot_s'] / 3600:.3f}",
                            _money(c["cost"]),
                            _money(c["on_demand_cost"]),
                        ]
                        for q, c in report["queues"].items()
                    ]
                    + [
                        [
                            "(all)",
                            f"{report['held_slot_s'] / 3600:.3f}",
                            f"{report['spot_slot_s'] / 3600:.3f}",
                            _money(report["cost"]),
                            _money(report["on_demand_cost"]),
                        ]
                    ],
                )
            )
    if queues:
        print()
        print(
            _table(
                ["QUEUE", "GUARANTEED", "BORROW", "WEIGHT", "ALLOCATED", "JOBS"],
                [
                    [
                        q["queue"],
                        str(q["guaranteed"]),
                        "any" if q["borrowing_limit"] is None else str(q["borrowing_limit"]),
                        f"{q['weight']:g}",
                        str(q["allocated"]),
                        str(q["jobs"]),
                    ]
                    for q in queues
                ],
            )
        )
    return 0


def _health(h: dict[str, Any] | None) -> str:
    """A node's latest probe in a cell: ``ok 12s ago``, ``FAILED 3s ago``, ``-`` (none)."""
    if h is None:
        return "-"
    return f"{'ok' if h['ok'] else 'FAILED'} {h['age_s']:.0f}s ago"


def _spares(job: dict[str, Any]) -> str:
    """Warm spares started and waiting, of those the job keeps (``-``: it keeps none)."""
    wanted = job.get("spares_wanted", 0)
    return f"{len(job.get('spares', []))}/{wanted}" if wanted else "-"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _placement(placement: dict[str, int] | None) -> str:
    return " ".join(f"{n}x{r}" for n, r in sorted((placement or {}).items()))


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])


def _labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in protocol.LABELS or not value:
            raise UsageError(
                f"--label {item!r}: expected rack=, block=, capacity_type=, accelerator= or reserved_for= with a value"
            )
        if key == "capacity_type" and value not in ("on-demand", "spot"):
            raise UsageError(f"--label {item!r}: capacity_type is on-demand or spot")
        if key == "reserved_for" and not re.fullmatch(protocol.NAME_PATTERN, value):
            raise UsageError(f"--label {item!r}: reserved_for names a job (letters, digits, '_', '.', '-')")
        labels[key] = value
    return labels


def parse_queue(text: str) -> "Queue":
    """``NAME[:GUARANTEED[:BORROWING_LIMIT[:WEIGHT]]]``; an empty or ``*`` limit is no limit."""
    from maitre.scheduling.model import Queue

    parts = text.split(":")
    if not 1 <= len(parts) <= 4 or not parts[0]:
        raise UsageError(f"--queue {text!r}: expected NAME[:GUARANTEED[:BORROW[:WEIGHT]]]")
    try:
        guaranteed = int(parts[1]) if len(parts) > 1 and parts[1] else 0
        borrow = int(parts[2]) if len(parts) > 2 and parts[2] not in ("", "*") else None
        weight = float(parts[3]) if len(parts) > 3 and parts[3] else 1.0
        return Queue(parts[0], guaranteed, borrow, weight)
    except ValueError as exc:
        raise UsageError(f"--queue {text!r}: {exc}") from None


def parse_prices(items: list[str]) -> dict[str, float]:
    """``--price TYPE=PRICE`` (repeatable): per slot (GPU) hour, over the defaults."""
    from maitre.control.cluster import DEFAULT_PRICES

    prices, given = dict(DEFAULT_PRICES), set()
    for item in items:
        kind, sep, value = item.partition("=")
        if not sep or kind not in DEFAULT_PRICES:
            raise UsageError(f"--price {item!r}: expected on-demand=PRICE or spot=PRICE")
        if kind in given:
            raise UsageError(f"--price: {kind} is given twice")
        try:
            price = float(value)
        except ValueError:
            raise UsageError(f"--price {item!r}: {value!r} is not a number") from None
        if not 0 <= price < math.inf:
            raise UsageError(f"--price {item!r}: a price is a number >= 0")
        prices[kind] = price
        given.add(kind)
    return prices


def _tls(args: argparse.Namespace) -> dict[str, str | None]:
    """``maitre up``'s certificate and key, checked as a pair before anything starts; the CA
    its own agents (and the printed export line) check it with: ``--tls-ca``, else the
    certificate itself (a self-signed one is its own CA)."""
    if not args.tls_cert and not args.tls_key:
        if args.tls_ca:
            raise UsageError("--tls-ca is for a coordinator served over HTTPS: give --tls-cert and --tls-key too")
        return {}
    if not (args.tls_cert and args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(
            f"--tls-cert {args.tls_cert} / --tls-key {args.tls_key}: not a PEM certificate and its key ({exc})"
        ) from None
    ca = args.tls_ca or args.tls_cert
    try:
        ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"--tls-ca {ca}: not a PEM certificate bundle ({exc})") from None
    return {"tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_ca": ca}


def cmd_up(args: argparse.Namespace) -> int:
    from maitre.scheduling.policy import PolicyConfig

    require("server", "up")

    if args.slurm and args.nodes not in (None, 0):
        raise UsageError("--nodes and --slurm: on Slurm the nodes are Slurm's replica jobs")
    if args.nodes is None:
        args.nodes = 0 if args.slurm else 2
    if args.nodes < 0:
        raise UsageError(f"--nodes must be >= 0, got {args.nodes}")
    slots = _positive("--slots-per-node", args.slots_per_node)
    racks = _positive("--racks", args.racks)
    queues = [parse_queue(q) for q in args.queue or []]
    if len({q.name for q in queues}) != len(queues):
        raise UsageError("--queue: a queue is given twice")
    policy = PolicyConfig()
    if args.resize_cooldown is not None:
        if not args.resize_cooldown >= 0:  # (NaN too)
            raise UsageError(f"--resize-cooldown must be a number of seconds >= 0, got {args.resize_cooldown:g}")
        policy.resize_cooldown_s = args.resize_cooldown
    prices = parse_prices(args.price or [])
    if not 0 <= args.spot_nodes <= args.nodes:
        raise UsageError(f"--spot-nodes must be between 0 and --nodes {args.nodes}, got {args.spot_nodes}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.store_port:
        _check_port(args.host, args.store_port, "--store-port")
    token = _read_token(args.token_file) if args.token_file else None
    _check_port(args.host, args.port)
    tls = _tls(args)
    slurm = _slurm(args)
    from maitre.control.store import StoreError  # torch (maitre.local): once the flags are good
    from maitre.local import LocalCluster, UpConfig

    cfg = UpConfig(
        state_dir=Path(args.state_dir),
        queues=queues,
        nodes=args.nodes,
        slots_per_node=slots,
        racks=racks,
        host=args.host,
        port=args.port,
        store_port=args.store_port,
        token=token,
        policy=policy,
        quiet_workers=not args.worker_output,
        prices=prices,
        spot_nodes=args.spot_nodes,
        max_restarts=args.max_restarts,
        **tls,
    )
    try:
        cluster = LocalCluster(cfg)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    except (OSError, RuntimeError) as exc:
        raise UsageError(f"cannot start the coordinator on {args.host}:{args.port}: {exc}") from None
    print(
        f"maitre: coordinator at {cluster.address} with {args.nodes} local node(s) x {slots} "
        f"slot(s); state in {cfg.state_dir}",
        flush=True,
    )
    ca = f" {_TLS_CA}={Path(cfg.tls_ca).resolve()}" if cfg.tls_ca else ""
    print(
        f"maitre: export {_COORDINATOR}={cluster.address} {_TOKEN_FILE}={cluster.token_file.resolve()}{ca}", flush=True
    )
    print(f"maitre: dashboard at {cluster.dashboard_url}", flush=True)
    cluster.start()
    engine = None
    if slurm is not None:
        from maitre.engines.slurm.engine import SlurmEngine
        from maitre.engines.slurm.replicas import AgentCommand

        slurm_cfg, runner, inv = slurm
        token_file = str(cluster.token_file.resolve())
        agent = AgentCommand(
            cluster.address,
            token_file,
            slurm_cfg.nproc_per_node,
            str(Path(cfg.tls_ca).resolve()) if cfg.tls_ca else None,
        )
        engine = SlurmEngine(
            Client(cluster.address, token=cluster.token, tls_ca=cfg.tls_ca), slurm_cfg, agent, runner, inv
        ).start()
        print(
            f"maitre: on Slurm: {len(inv.nodes)} node(s); minimum in partition "
            f"{slurm_cfg.partition}, surplus in {slurm_cfg.scavenger or '(none)'}; replica "
            f"jobs' logs in {slurm_cfg.log_dir}",
            flush=True,
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        if engine is not None:
            engine.stop()
        cluster.stop()
    return 0


def _slurm(args: argparse.Namespace):
    """``--slurm`` and its flags, checked against the Slurm there is (None without --slurm):
    a Slurm that does not answer or lacks a partition is one line naming the command."""
    given = [
        f
        for f, v in (
            ("--slurm-partition", args.slurm_partition),
            ("--slurm-scavenger", args.slurm_scavenger),
            ("--slurm-qos", args.slurm_qos),
            ("--slurm-account", args.slurm_account),
        )
        if v is not None
    ]
    if not args.slurm:
        if given:
            raise UsageError(f"{given[0]} needs --slurm")
        return None
    from maitre.engines.slurm.commands import Slurm, SlurmError
    from maitre.engines.slurm.engine import SlurmConfig, check

    log_dir = Path(args.state_dir) / "slurm"
    try:
        cfg = SlurmConfig(
            partition=args.slurm_partition or "normal",
            scavenger=args.slurm_scavenger,
            qos=args.slurm_qos,
            account=args.slurm_account,
            gpus_per_replica=max(0, args.slurm_gpus_per_replica),
            nproc_per_node=_positive("--slots-per-node", args.slots_per_node),
            log_dir=str(log_dir.resolve()),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    runner = Slurm()
    try:
        inv = check(runner, cfg)
    except SlurmError as exc:
        raise UsageError(f"Slurm: {exc}") from None
    log_dir.mkdir(parents=True, exist_ok=True)
    return cfg, runner, inv


def cmd_submit(args: argparse.Namespace) -> int:
    path = Path(args.manifest)
    try:
        text = sys.stdin.read() if args.manifest == "-" else path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {args.manifest}: {exc}") from None
    from maitre.scheduling.spec import ManifestError, parse_manifest

    try:
        parse_manifest(text)  # every problem here, before the coordinator is even asked
    except ManifestError as exc:
        raise UsageError(f"{args.manifest}: {exc}") from None
    reply = _coordinator(args).post(protocol.JOBS, {"manifest": text})
    print(f"maitre: job {reply['job_id']} submitted to queue {reply['queue']} (priority {reply['priority']})")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    _coordinator(args).post(protocol.JOB_CANCEL.format(job=args.job))
    print(f"maitre: job {args.job} cancelled: its workers stop")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    reply = _coordinator(args).post(protocol.JOB_RESUME.format(job=args.job))
    print(
        f"maitre: job {args.job} may run again ({reply['state']}); it resumes from its newest "
        "checkpoint when the scheduler admits it"
    )
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    require("kubernetes", "operator")
    import signal
    import threading

    from kubernetes import client, config

    from maitre.engines.kubernetes.operator import Operator, OperatorConfig, missing_permissions
    from maitre.engines.kubernetes.pods import load_template

    try:
        template = None if args.replica_pods is None else load_template(args.replica_pods)
        cfg = OperatorConfig(
            namespace=args.namespace,
            resync_s=args.resync,
            lease_name=args.lease_name,
            lease_s=args.lease_seconds,
            renew_s=max(2, args.lease_seconds * 2 // 3),
            retry_s=max(1, args.lease_seconds // 6),
            replica_pods=template,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        if args.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # the pod's ServiceAccount
        else:
            config.load_kube_config(config_file=args.kubeconfig)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise UsageError(f"no Kubernetes API server to talk to: {exc}") from None
    api = client.ApiClient()
    try:
        missing = missing_permissions(api, cfg.namespace, replica_pods=template is not None)
    except (OSError, client.exceptions.ApiException) as exc:
        raise UsageError(f"cannot ask the Kubernetes API server what the operator may do: {exc}") from None
    if missing:
        raise UsageError(
            f"the operator may not {'; '.join(missing)} in namespace {cfg.namespace}: grant it what "
            "deploy/kubernetes/base/operator-rbac.yaml's Role grants"
            + (" and, for replica pods, deploy/kubernetes/replica-pods/operator-pods-rbac.yaml's" if template else "")
        )
    coordinator = _coordinator(args)
    coordinator.get(protocol.JOBS)  # reachable, and the token is right, before anything else
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"maitre: operator {cfg.identity}: MaitreJobs of namespace {cfg.namespace} -> coordinator "
        f"{coordinator.address} (acts once it holds Lease {cfg.lease_name})",
        flush=True,
    )
    if not Operator(cfg, api, coordinator).run(stop):
        print(f"maitre: operator {cfg.identity} lost its Lease and stopped", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    require("server", "demo")
    from maitre.demo import Demo, DemoConfig

    steps = _positive("--steps", args.steps)
    cfg = DemoConfig(
        steps=steps,
        urgent_at_step=min(150, steps // 4),
        urgent_steps=max(1, steps // 4),
        run_dir=Path(args.run_dir) if args.run_dir else None,
    )
    return Demo(cfg).run()


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from maitre.data.prepare import PrepareError, prepare

    try:
        meta = prepare(
            args.inputs or None,
            args.out,
            vocab_size=args.vocab_size,
            shard_tokens=args.shard_tokens,
            progress=not args.quiet,
        )
    except PrepareError as exc:
        raise UsageError(str(exc)) from None
    print(
        f"maitre: {meta['tokens']:,} tokens ({meta['dtype']}, a vocabulary of "
        f"{meta['vocab_size']:,}) in {len(meta['shards'])} shards under {args.out}"  # type: ignore[arg-type]
    )
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    import secrets

    require("server", "dashboard", ["fastapi", "uvicorn"])
    from maitre.dashboard.replay import ReplayError, find
    from maitre.dashboard.server import ReplayServer

    _check_port(args.host, args.port)
    try:
        path = find(Path(args.dir), args.policy)
        server = ReplayServer(path, secrets.token_urlsafe(24), args.host, args.port)
    except ReplayError as exc:
        raise UsageError(f"cannot replay: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    events = server.log.since(0)
    span = events[-1]["t"] - events[0]["t"]
    print(f"maitre: replaying {path}: {len(events)} events over {span:.0f} s", flush=True)
    print(f"maitre: dashboard at {server.url}?token={server.token}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        stop.wait()
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    require("sim", "simulate", ["scipy"] + ([] if args.no_plots else ["matplotlib"]))
    from maitre.sim import run as sim_run
    from maitre.sim.scenarios import parse_cluster
    from maitre.sim.workload import WorkloadError

    policies = [args.policy] + [p for p in (args.compare or "").split(",") if p]
    try:
        opts = sim_run.SimOptions(
            workload=args.workload,
            policies=policies,
            cluster=parse_cluster(args.cluster) if args.cluster else None,
            resize=args.resize,
            adaptive_batch=args.adaptive_batch,
            spot=args.spot,
            price=args.price,
            spot_price=args.spot_price,
            spot_life_h=args.spot_life_h,
            notice_s=args.notice_s,
            mtbf_h=args.mtbf_h,
            checkpoint_s=args.checkpoint_s,
            interval_s=args.interval_s,
            seed=args.seed,
            limit=args.limit,
            plots=not args.no_plots,
        )
        sim_run.main(opts, Path(args.out), progress=not args.quiet)
    except WorkloadError as exc:
        raise UsageError(f"bad workload: {exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return 0


def _check_port(host: str, port: int, flag: str = "--port") -> None:
    if not 0 <= port <= 65535:
        raise UsageError(f"{flag} must be in 0..65535, got {port}")
    try:  # can this machine listen there at all? (else TCPStore retries for 30 s)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except (OSError, OverflowError) as exc:
        raise UsageError(f"cannot start the coordinator on {host}:{port}: {exc}") from None


def _coordinator_args(parser: argparse.ArgumentParser) -> None:
    """Where the coordinator is and the token it wants (see :func:`_coordinator`)."""
    parser.add_argument("--coordinator", help="HOST:PORT (default: $MAITRE_COORDINATOR)")
    parser.add_argument(
        "--token-file",
        help="a file holding the coordinator's token (default: "
        "$MAITRE_TOKEN_FILE; else $MAITRE_TOKEN, the token itself)",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="speak HTTPS to the coordinator and check its certificate against these (default: $MAITRE_TLS_CA)",
    )
    parser.add_argument(
        "--wait",
        type=_wait_seconds,
        default=WAIT_S,
        metavar="SECONDS",
        help=f"wait this long for a coordinator that is starting (its token file not written yet, its port "
        f"not open yet), then say it is not up (default {WAIT_S:g}; 0: ask once)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="maitre", description="Elastic training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser(
        "run",
        help="run a training script elastically on this machine",
        description="Start a coordinator, local agents and the script's workers.",
    )
    run.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (torchrun's flag)")
    run.add_argument(
        "--nproc-per-node", type=int, help="processes per node (default: one replica's, --nproc-per-replica)"
    )
    run.add_argument(
        "--nproc-per-replica",
        type=int,
        default=1,
        help="processes of one replica, on one node (FSDP2 or TP inside; the job "
        "grows and shrinks by whole replicas; default 1)",
    )
    run.add_argument(
        "--mesh",
        help="the replica's mesh, e.g. dp_shard=2,tp=2 (default: "
        "dp_shard=--nproc-per-replica); the script's replica_mesh() must agree",
    )
    run.add_argument("--max-restarts", type=int, default=3, help="failure events survived before the job fails")
    run.add_argument(
        "--elastic",
        choices=("inplace", "restart"),
        default="inplace",
        help="inplace (default): a script on maitre's loop, resized in place; restart: an unmodified "
        "torchrun script (init_process_group('env://')), stopped and started again whole at each change",
    )
    run.add_argument(
        "--success-marker",
        metavar="TEXT",
        help="--elastic restart: a line a finished worker prints; exiting 0 without it is a failure",
    )
    run.add_argument(
        "--local-nodes", type=int, help="agents started on this machine (default: the minimum of --nnodes)"
    )
    run.add_argument("--host", default="127.0.0.1", help="address the coordinator listens on")
    run.add_argument("--port", type=int, default=0, help="coordinator HTTP port (0: any free)")
    run.add_argument("--job-id", default="job", help="name of the job")
    run.add_argument(
        "--events",
        help="scripted story, e.g. kill@60,join@120,leave@200 (kinds: kill, hang, join, leave, kill-data: "
        "the script's arguments must show data workers, --data-workers N or --num-workers N), or 'demo'",
    )
    run.add_argument("--run-dir", help="where the data ledger goes (default: a new temp dir)")
    run.add_argument("--no-ledger", action="store_true", help="do not record consumed samples")
    run.add_argument(
        "--checkpoint-dir",
        help="checkpoint the job here (a shared directory in "
        "a cluster); SIGINT/SIGTERM then suspends the job with a checkpoint",
    )
    run.add_argument(
        "--checkpoint-every",
        type=int,
        help="steps between checkpoints (default: the Young/Daly interval from measured cost and failure rate)",
    )
    run.add_argument("--checkpoint-keep", type=int, default=3, help="complete checkpoints kept (default 3)")
    run.add_argument(
        "--mtbf",
        type=float,
        help="the job's mean time between failures in "
        "seconds, for the checkpoint interval (default: estimated from its history)",
    )
    run.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint in --checkpoint-dir"
    )
    run.add_argument(
        "--grace-period",
        type=float,
        default=60.0,
        help="seconds a suspended job has to checkpoint and stop (default 60)",
    )
    run.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(fn=cmd_run)

    agent = sub.add_parser("agent", help="add this machine as a node of a running coordinator")
    _coordinator_args(agent)
    agent.add_argument("--nproc-per-node", type=int, default=1, help="worker slots on this node")
    agent.add_argument("--node-id", help="node name (default: host name and pid)")
    agent.add_argument(
        "--label",
        action="append",
        help="rack=R, block=B, capacity_type="
        "on-demand|spot, accelerator=A or reserved_for=JOB (the node takes that "
        "job's workers only) (repeatable)",
    )
    agent.add_argument(
        "--iface",
        metavar="NAME",
        help="network interface the workers advertise "
        "to their peers (default: the one that reaches the coordinator, none on "
        "loopback; $GLOO_SOCKET_IFNAME and $NCCL_SOCKET_IFNAME, if set, win)",
    )
    agent.add_argument(
        "--spot-notice",
        metavar="SOURCE",
        help="watch for spot notices: "
        "file:PATH, or an http(s):// URL polled like instance metadata (AWS "
        "spot/instance-action, GCE instance/preempted); on a notice the node is "
        "drained before its deadline",
    )
    agent.add_argument(
        "--spot-notice-interval",
        type=float,
        metavar="SECONDS",
        help="how often the source is polled (default 5, AWS's guidance)",
    )
    agent.add_argument(
        "--spot-notice-default",
        type=float,
        metavar="SECONDS",
        help="the warning a notice without a time gives (GCE's TRUE; default 30)",
    )
    agent.add_argument(
        "--sigterm-notice",
        type=float,
        metavar="SECONDS",
        help="treat SIGTERM as a notice that the node goes in SECONDS (Slurm's "
        "GraceTime, a pod's grace period): the node is drained, its workers "
        "leave at a step boundary, then the agent exits",
    )
    agent.add_argument(
        "--slurm",
        action="store_true",
        help="run as a Slurm replica job's "
        "agent (maitre up --slurm submits these): the node is named and "
        "labelled (switches as rack/block, GPU type) as Slurm knows it",
    )
    agent.add_argument(
        "--health-interval",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="probe the node's health this often (default 300; 0: only at "
        "start and when the coordinator asks); a failing probe drains the node",
    )
    agent.add_argument(
        "--health-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a probe still running after this long is killed and fails (default 60)",
    )
    agent.add_argument(
        "--health-check",
        metavar="CMD",
        help="the site's own check, run after "
        "the built-in compute and memory probe: exit 0 is healthy, the last "
        "lines of its output say why not (like Slurm's HealthCheckProgram)",
    )
    agent.add_argument(
        "--no-health-builtin", action="store_true", help="skip the built-in probe (then --health-check is needed)"
    )
    agent.set_defaults(fn=cmd_agent)

    scale = sub.add_parser("scale", help="set a job's number of workers (a submitted job: its maxReplicas)")
    scale.add_argument("job")
    scale.add_argument("workers", type=int)
    _coordinator_args(scale)
    scale.set_defaults(fn=cmd_scale)

    suspend = sub.add_parser(
        "suspend", help="checkpoint a job and stop it (maitre resume JOB runs it again from that checkpoint)"
    )
    suspend.add_argument("job")
    _coordinator_args(suspend)
    suspend.set_defaults(fn=cmd_suspend)

    up = sub.add_parser(
        "up",
        help="start a scheduled cluster: coordinator and local nodes",
        description="Start a coordinator that schedules submitted jobs, with "
        "local agents; restart it on the same --state-dir to carry on.",
    )
    up.add_argument(
        "--state-dir", default="maitre-state", help="coordinator state, token and ledgers (default ./maitre-state)"
    )
    up.add_argument("--nodes", type=int, help="local nodes (default 2; 0: coordinator only)")
    up.add_argument("--slots-per-node", type=int, default=2, help="worker slots per node")
    up.add_argument("--racks", type=int, default=1, help="spread local nodes over N racks")
    up.add_argument(
        "--queue",
        action="append",
        help="NAME[:GUARANTEED[:BORROW[:WEIGHT]]] (repeatable; default: one queue 'default')",
    )
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=0, help="HTTP port (0: the stored one or any)")
    up.add_argument(
        "--store-port",
        type=int,
        default=0,
        help="the runs' c10d store port, which workers connect to (0: the stored one or any; fix it behind a Service)",
    )
    up.add_argument(
        "--token-file",
        help="the API token to use (e.g. a Kubernetes Secret's key) "
        "instead of <state-dir>/token's or a new one; it is written there too",
    )
    up.add_argument(
        "--resize-cooldown",
        type=float,
        metavar="SECONDS",
        help="seconds after a running job's admission or last resize before the "
        "scheduler grows or rebalances it again (damping: no back and forth); an "
        "elastic job that lost a node grows back onto it only then (default: the "
        "policy's, 180)",
    )
    up.add_argument(
        "--max-restarts", type=int, default=3, help="failure events a job survives before it fails (each job's)"
    )
    up.add_argument(
        "--price",
        action="append",
        metavar="TYPE=PRICE",
        help="price per slot (GPU) hour of a capacity type, for the cost report "
        "(repeatable; default on-demand=2.5 spot=0.75, the simulator's)",
    )
    up.add_argument(
        "--spot-nodes",
        type=int,
        default=0,
        help="the last N local nodes are "
        "spot; each watches <state-dir>/notices/<node>.json for a notice "
        '(write {"notice_s": 30} there to reclaim it)',
    )
    up.add_argument(
        "--slurm",
        action="store_true",
        help="run on the Slurm cluster that "
        "Slurm's commands reach ($SLURM_CONF): each job's replicas are Slurm jobs, "
        "each one node's agent (see docs/operations/slurm.md)",
    )
    up.add_argument("--slurm-partition", metavar="P", help="where each job's minimum runs (default normal)")
    up.add_argument(
        "--slurm-scavenger",
        metavar="S",
        help="preemptible partition for the elastic surplus (default: none, jobs run at their minimum)",
    )
    up.add_argument("--slurm-qos", metavar="Q", help="QOS of the replica jobs")
    up.add_argument("--slurm-account", metavar="A", help="account of the replica jobs (sacct)")
    up.add_argument(
        "--slurm-gpus-per-replica",
        type=int,
        default=0,
        metavar="N",
        help="--gres=gpu:N on each replica job (default: none asked)",
    )
    up.add_argument("--worker-output", action="store_true", help="print workers' output")
    up.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="serve the API over HTTPS with this certificate (its names must include the address agents use)",
    )
    up.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    up.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="what signs the certificate, for the local "
        "nodes and the export line (default: the certificate, if self-signed)",
    )
    up.set_defaults(fn=cmd_up)

    submit = sub.add_parser("submit", help="submit a job manifest (YAML) to the scheduler")
    submit.add_argument("manifest", help="the job's YAML file, or - for stdin")
    _coordinator_args(submit)
    submit.set_defaults(fn=cmd_submit)

    for name, fn, text in (
        ("cancel", cmd_cancel, "stop a submitted job for good"),
        ("resume", cmd_resume, "let a job suspended by maitre suspend run again"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("job")
        _coordinator_args(cmd)
        cmd.set_defaults(fn=fn)

    op = sub.add_parser(
        "operator",
        help="act on the MaitreJobs of a Kubernetes namespace: submit, scale, report and delete "
        "their jobs (needs maitre[kubernetes])",
    )
    op.add_argument("--namespace", required=True, help="the namespace whose MaitreJobs it acts on")
    op.add_argument(
        "--kubeconfig", help="the API server and credentials (default: the pod's ServiceAccount, else ~/.kube/config)"
    )
    op.add_argument("--resync", type=float, default=2.0, help="seconds between two passes over every MaitreJob")
    op.add_argument("--lease-name", default="maitre-operator", help="the Lease its replicas elect a leader with")
    op.add_argument(
        "--lease-seconds", type=int, default=15, help="how long a leader's Lease holds unrenewed (at least 3)"
    )
    op.add_argument(
        "--replica-pods",
        metavar="TEMPLATE",
        help="keep one pod per replica of every MaitreJob, made from this Pod manifest (its container "
        "'agent' runs maitre agent), so Kubernetes' scheduler, quotas and priorities see each replica "
        "(default: jobs run on the agents already there)",
    )
    _coordinator_args(op)
    op.set_defaults(fn=cmd_operator)

    demo = sub.add_parser(
        "demo",
        help="watch the scheduler: 4 nodes (2 spot), three jobs, a "
        "preemption, a crash and a spot reclaim (about 3 minutes)",
    )
    demo.add_argument("--steps", type=int, default=900, help="steps of each elastic job (default 900: about 3 minutes)")
    demo.add_argument("--run-dir", help="where state and ledgers go (default: a temp dir)")
    demo.set_defaults(fn=cmd_demo)

    data = sub.add_parser("data", help="prepare training data").add_subparsers(
        dest="data_command", required=True, parser_class=_Parser
    )
    prep = data.add_parser(
        "prepare", help="text files into token shards, with a tokenizer trained on them (nothing downloaded)"
    )
    prep.add_argument(
        "inputs", nargs="*", help="text files, or folders of *.txt (default: the text shipped with maitre)"
    )
    prep.add_argument("--out", required=True, help="a new folder for the shards")
    prep.add_argument("--vocab-size", type=int, default=4096, help="the tokenizer's vocabulary (default 4096)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard file (default 16,777,216)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(fn=cmd_data_prepare)

    sim = sub.add_parser("simulate", help="replay a cluster trace through scheduling policies")
    sim.add_argument(
        "--workload",
        required=True,
        help="a workload CSV (Pollux's or Philly's columns) or pollux-N[@LOAD], philly, daytime-inference, pressure",
    )
    sim.add_argument("--policy", required=True, help="fifo, tiresias, optimus, pollux, maitre")
    sim.add_argument("--compare", help="more policies, comma-separated")
    sim.add_argument("--cluster", help="NODESxGPUS (default: the workload's, 16x4 for Pollux's)")
    sim.add_argument("--out", required=True, help="directory for summary.json, CSVs and plots")
    sim.add_argument(
        "--resize",
        default="30",
        help="seconds every resize costs, or 'measured' (maitre's, from "
        "benchmarks/results/recovery.json); default 30, Pollux's",
    )
    sim.add_argument(
        "--adaptive-batch", action="store_true", help="maitre jobs let the scheduler pick their batch size by goodput"
    )
    sim.add_argument("--spot", type=float, default=0.0, help="fraction of nodes that are spot")
    sim.add_argument("--price", type=float, default=2.5, help="on-demand $ per GPU-hour")
    sim.add_argument("--spot-price", type=float, default=0.75, help="spot $ per GPU-hour")
    sim.add_argument(
        "--spot-life-h", type=float, default=4.0, help="mean hours a spot node lives before it is reclaimed"
    )
    sim.add_argument("--notice-s", type=float, default=120.0, help="spot reclaim notice")
    sim.add_argument("--mtbf-h", type=float, default=math.inf, help="node MTBF in hours")
    sim.add_argument(
        "--checkpoint-s", type=float, default=0.0, help="seconds a checkpoint blocks training (Young/Daly interval)"
    )
    sim.add_argument("--interval-s", type=float, default=60.0, help="scheduling interval")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--limit", type=int, help="only the first N jobs of the workload")
    sim.add_argument("--no-plots", action="store_true")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(fn=cmd_simulate)

    dash = sub.add_parser(
        "dashboard",
        help="serve the dashboard over a recorded event log "
        "(a simulation's --out, a coordinator's --state-dir, or a .jsonl)",
    )
    dash.add_argument("dir", help="the directory (or the events file) to replay")
    dash.add_argument("--policy", help="which policy's run, in a simulation's output with several (default: maitre)")
    dash.add_argument("--host", default="127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    dash.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    dash.set_defaults(fn=cmd_dashboard)

    status = sub.add_parser("status", help="show jobs, nodes and queues")
    status.add_argument("job", nargs="?")
    _coordinator_args(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(fn=cmd_status)
    return parser


def _logging() -> None:
    """maitre's own modules log through ``logging`` (``maitre.coordinator``, ``maitre.agent``,
    ...); the CLI shows their warnings on stderr, ``MAITRE_LOG=debug`` shows more. What a
    command prints for its user (tables, events, summaries) is not logging."""
    level = os.environ.get(_LOG, "warning").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.WARNING), format="maitre: %(name)s: %(levelname)s: %(message)s"
    )
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLogger().level))


def main(argv: Sequence[str] | None = None) -> int:
    _logging()
    try:
        args = build_parser().parse_args(argv)
        return args.fn(args)
    except UsageError as exc:
        print(f"maitre: error: {exc}", file=sys.stderr)
        return 2
    except CoordinatorUnreachable as exc:
        print(f"maitre: error: {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"maitre: error: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
