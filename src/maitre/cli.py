"""``maitre`` command line: run, agent, scale, suspend, status.

Every command validates its input before it starts anything; a bad flag, a missing script or an
unreachable coordinator is one line on stderr and a non-zero exit, with nothing left running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from maitre.wire import ApiError, Client, CoordinatorUnreachable, parse_address


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{self.prog}: {message} (see --help)")


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


def _coordinator(args: argparse.Namespace) -> Client:
    address = args.coordinator or os.environ.get("MAITRE_COORDINATOR")
    if not address:
        raise UsageError("no coordinator: pass --coordinator HOST:PORT or set MAITRE_COORDINATOR")
    try:
        parse_address(address)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    token = os.environ.get("MAITRE_TOKEN") or None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(f"cannot read --token-file: {exc}") from None
        if not token:
            raise UsageError(f"--token-file {args.token_file} is empty")
    return Client(address, timeout_s=5.0, token=token)


def cmd_run(args: argparse.Namespace) -> int:
    from maitre.launch import Run, RunConfig, parse_events

    lo, hi = parse_nnodes(args.nnodes)
    nproc = _positive("--nproc-per-node", args.nproc_per_node)
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
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
    except ValueError as exc:
        raise UsageError(f"--events: {exc}") from None
    checkpoint_dir = _checkpoint_dir(args)
    cfg = RunConfig(command=command, min_nodes=lo, max_nodes=hi, nproc_per_node=nproc,
                    max_restarts=args.max_restarts, local_nodes=args.local_nodes, host=args.host,
                    port=args.port, job_id=args.job_id, events=events,
                    run_dir=Path(args.run_dir) if args.run_dir else None,
                    ledger=not args.no_ledger, checkpoint_dir=checkpoint_dir,
                    checkpoint_every=args.checkpoint_every, mtbf_s=args.mtbf,
                    checkpoint_keep=args.checkpoint_keep,
                    resume=args.resume, grace_period_s=args.grace_period)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    try:  # can this machine listen there at all? (else TCPStore retries for 30 s)
        with socket.socket() as probe:
            probe.bind((args.host, args.port))
    except (OSError, OverflowError) as exc:
        raise UsageError(f"cannot start the coordinator on {args.host}:{args.port}: {exc}") from None
    try:
        run = Run(cfg)
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
        for flag, value in (("--resume", args.resume), ("--checkpoint-every", args.checkpoint_every),
                            ("--mtbf", args.mtbf)):
            if value:
                raise UsageError(f"{flag} needs --checkpoint-dir")
        return None
    from maitre.checkpoint.loader import newest_complete

    directory = Path(args.checkpoint_dir)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--checkpoint-dir {directory} exists and is not a directory")
    newest = newest_complete(directory)
    if newest is not None and not args.resume:
        raise UsageError(f"{directory} holds checkpoints of an earlier run (newest: {newest.name});"
                         " pass --resume to continue from it, or choose another directory")
    if newest is None and args.resume:
        print(f"maitre: no complete checkpoint in {directory}: starting from step 0",
              file=sys.stderr, flush=True)
    return directory


def cmd_agent(args: argparse.Namespace) -> int:
    from maitre.agent.agent import Agent

    client = _coordinator(args)
    nproc = _positive("--nproc-per-node", args.nproc_per_node)
    client.get("/jobs")  # fail fast (unreachable, or a wrong token), before any worker starts
    node = args.node_id or f"{socket.gethostname()}-{os.getpid()}"
    agent = Agent(client.address, node, nproc, token=client.token)
    print(f"maitre: agent {node} with {nproc} slot(s) joined {client.address}", flush=True)
    try:
        agent.serve()
    except KeyboardInterrupt:
        pass
    finally:
        agent.stop()
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    reply = _coordinator(args).post(f"/jobs/{args.job}/scale", {"workers": args.workers})
    leaving = ", ".join(reply["leaving"]) or "none"
    print(f"maitre: job {args.job} scaled to {reply['target']} workers (leaving: {leaving})")
    return 0


def cmd_suspend(args: argparse.Namespace) -> int:
    reply = _coordinator(args).post(f"/jobs/{args.job}/suspend", {"reason": "maitre suspend"})
    print(f"maitre: job {args.job} is {reply['state']}: its workers checkpoint, then stop")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    client = _coordinator(args)
    jobs = [client.get(f"/jobs/{args.job}")] if args.job else client.get("/jobs")["jobs"]
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    print(f"{'JOB':<16} {'STATE':<11} {'EPOCH':>5} {'STEP':>7} {'WORKERS':>8} {'FAILURES':>8}")
    for j in jobs:
        print(f"{j['job_id']:<16} {j['state']:<11} {j['epoch']:>5} {j['step']:>7} "
              f"{len(j['members']):>3}/{j['max_workers']:<4} {j['failures']:>8}")
    return 0


def _coordinator_args(parser: argparse.ArgumentParser) -> None:
    """Where the coordinator is and the token it wants (see :func:`_coordinator`)."""
    parser.add_argument("--coordinator", help="HOST:PORT (default: $MAITRE_COORDINATOR)")
    parser.add_argument("--token-file", help="the coordinator's token (default: $MAITRE_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="maitre", description="Elastic training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a training script elastically on this machine",
                         description="Start a coordinator, local agents and the script's workers.")
    run.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (torchrun's flag)")
    run.add_argument("--nproc-per-node", type=int, default=1, help="workers per node")
    run.add_argument("--max-restarts", type=int, default=3,
                     help="failure events survived before the job fails")
    run.add_argument("--local-nodes", type=int, help="agents started on this machine "
                     "(default: the minimum of --nnodes)")
    run.add_argument("--host", default="127.0.0.1", help="address the coordinator listens on")
    run.add_argument("--port", type=int, default=0, help="coordinator HTTP port (0: any free)")
    run.add_argument("--job-id", default="job", help="name of the job")
    run.add_argument("--events", help="scripted story, e.g. kill@60,join@120,leave@200 "
                     "(kinds: kill, hang, join, leave), or 'demo'")
    run.add_argument("--run-dir", help="where the data ledger goes (default: a new temp dir)")
    run.add_argument("--no-ledger", action="store_true", help="do not record consumed samples")
    run.add_argument("--checkpoint-dir", help="checkpoint the job here (a shared directory in "
                     "a cluster); SIGINT/SIGTERM then suspends the job with a checkpoint")
    run.add_argument("--checkpoint-every", type=int, help="steps between checkpoints "
                     "(default: the Young/Daly interval from measured cost and failure rate)")
    run.add_argument("--checkpoint-keep", type=int, default=3,
                     help="complete checkpoints kept (default 3)")
    run.add_argument("--mtbf", type=float, help="the job's mean time between failures in "
                     "seconds, for the checkpoint interval (default: estimated from its history)")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest complete checkpoint in --checkpoint-dir")
    run.add_argument("--grace-period", type=float, default=60.0,
                     help="seconds a suspended job has to checkpoint and stop (default 60)")
    run.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(fn=cmd_run)

    agent = sub.add_parser("agent", help="add this machine as a node of a running coordinator")
    _coordinator_args(agent)
    agent.add_argument("--nproc-per-node", type=int, default=1, help="worker slots on this node")
    agent.add_argument("--node-id", help="node name (default: host name and pid)")
    agent.set_defaults(fn=cmd_agent)

    scale = sub.add_parser("scale", help="set a job's number of workers")
    scale.add_argument("job")
    scale.add_argument("workers", type=int)
    _coordinator_args(scale)
    scale.set_defaults(fn=cmd_scale)

    suspend = sub.add_parser("suspend", help="checkpoint a job and stop it (resume with "
                             "maitre run --resume)")
    suspend.add_argument("job")
    _coordinator_args(suspend)
    suspend.set_defaults(fn=cmd_suspend)

    status = sub.add_parser("status", help="show jobs")
    status.add_argument("job", nargs="?")
    _coordinator_args(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(fn=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
