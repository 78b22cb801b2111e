"""The ``maitre`` command line: bad input is one clear line on stderr and a non-zero exit, with
nothing left running; a script that fails before joining, or with the same exception on every
rank, fails the job at once with that error.

Every command runs as a subprocess with a unique tag in its environment. Worker processes inherit
the environment of ``maitre run``, so scanning ``/proc`` for the tag finds anything the command
left behind, whatever session or process group it is in; the fixture kills (by pid) whatever a
test leaves, and the tests assert there is nothing to kill.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import EXAMPLE, ROOT, TAG_VAR
from conftest import _tagged_pids as tagged_pids

MAITRE = [sys.executable, "-m", "maitre.cli"]


# -- processes -----------------------------------------------------------------------------------
def settle(find: Callable[[], list[int]], grace_s: float = 5.0) -> list[int]:
    """What ``find`` still reports after up to ``grace_s`` (children may take a moment to go)."""
    deadline = time.monotonic() + grace_s
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


class Cli:
    """Runs ``maitre`` commands tagged for the leftover scan."""

    def __init__(self, tmpdir: Path) -> None:
        self.tag = uuid.uuid4().hex
        self.tmpdir = tmpdir  # the commands' TMPDIR: default run directories land here
        tmpdir.mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAITRE_")}
        env.update(
            {TAG_VAR: self.tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmpdir)}, **extra
        )
        return env

    def start(self, *args: str, **extra_env: str) -> subprocess.Popen[str]:
        """``maitre ARGS`` started, its output piped."""
        return subprocess.Popen(
            [*MAITRE, *args],
            cwd=ROOT,
            env=self.env(**extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def __call__(self, *args: str, timeout: float = 60, **extra_env: str) -> subprocess.CompletedProcess[str]:
        proc = self.start(*args, **extra_env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_leftovers()
            out, err = proc.communicate()
            pytest.fail(f"maitre {' '.join(args)} ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def leftovers(self) -> list[int]:
        return settle(lambda: tagged_pids(self.tag))

    def kill_leftovers(self) -> None:
        for pid in tagged_pids(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def cli(tmp_path: Path):
    runner = Cli(tmp_path / "cli-tmp")
    yield runner
    runner.kill_leftovers()


def free_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound, read, closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(stderr: str) -> str:
    """The single non-empty line of ``stderr`` (with its trailing newline stripped)."""
    lines = stderr.rstrip("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip(), f"expected one line on stderr, got:\n{stderr}"
    return lines[0]


def assert_rejected(result: subprocess.CompletedProcess[str], cli: Cli, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    line = one_line(result.stderr)
    assert line.startswith("maitre: error: "), line
    assert "Traceback" not in result.stderr
    assert result.stdout == "", result.stdout
    assert cli.leftovers() == [], "the command left processes running"
    return line


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_nnodes_min_above_max(cli: Cli) -> None:
    line = assert_rejected(cli("run", "--nnodes", "4:2", str(EXAMPLE)), cli)
    assert "minimum" in line and "maximum" in line, line
    assert "4:2" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["abc", "0", "2:", "1:2:3", "-1", ""])
def test_nnodes_malformed(cli: Cli, value: str) -> None:
    line = assert_rejected(cli("run", "--nnodes", value, str(EXAMPLE)), cli)
    assert "--nnodes" in line, line


@pytest.mark.timeout(60)
def test_nproc_per_node_zero(cli: Cli) -> None:
    line = assert_rejected(cli("run", "--nproc-per-node", "0", str(EXAMPLE)), cli)
    assert "--nproc-per-node" in line and "at least 1" in line, line


@pytest.mark.timeout(60)
def test_nproc_per_node_not_a_number(cli: Cli) -> None:
    line = assert_rejected(cli("run", "--nproc-per-node", "two", str(EXAMPLE)), cli)
    assert "--nproc-per-node" in line and "'two'" in line, line


@pytest.mark.timeout(60)
def test_max_restarts_negative(cli: Cli) -> None:
    line = assert_rejected(cli("run", "--max-restarts", "-1", str(EXAMPLE)), cli)
    assert "--max-restarts" in line, line


@pytest.mark.timeout(60)
def test_straggler_thresholds_out_of_range(cli: Cli) -> None:
    line = assert_rejected(cli("run", str(EXAMPLE), MAITRE_STRAGGLER_RATIO="0.9"), cli)
    assert "MAITRE_STRAGGLER_RATIO=0.9: " in line and "out of range" in line, line


@pytest.mark.timeout(60)
def test_local_nodes_outside_nnodes(cli: Cli) -> None:
    line = assert_rejected(cli("run", "--nnodes", "1:2", "--local-nodes", "3", str(EXAMPLE)), cli)
    assert "--local-nodes" in line, line


@pytest.mark.timeout(60)
def test_missing_script(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "no_such_script.py"
    line = assert_rejected(cli("run", "--nnodes", "2", str(missing)), cli)
    assert "script not found" in line and str(missing) in line, line


@pytest.mark.timeout(60)
def test_script_is_a_directory(cli: Cli, tmp_path: Path) -> None:
    line = assert_rejected(cli("run", str(tmp_path)), cli)
    assert "script not found" in line, line


@pytest.mark.timeout(60)
def test_unknown_flag_is_one_line_not_a_usage_block(cli: Cli) -> None:
    line = assert_rejected(cli("run", "--bogus", "x.py"), cli)
    assert "--bogus" in line, line
    assert "usage:" not in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [(), ("frobnicate",), ("run",)], ids=["nothing", "unknown", "run"])
def test_missing_or_unknown_command(cli: Cli, args: tuple[str, ...]) -> None:
    line = assert_rejected(cli(*args), cli)
    assert "usage:" not in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["explode@3", "kill@", "kill@-1", "kill"])
def test_bad_events(cli: Cli, spec: str) -> None:
    line = assert_rejected(cli("run", "--nnodes", "2", "--events", spec, str(EXAMPLE)), cli)
    assert "--events" in line and "kill, hang, join, leave" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [(), ("--data-workers", "0"), ("--data-workers", "two")], ids=["none", "0", "bad"])
def test_kill_data_without_data_workers_is_refused_before_anything_starts(
    cli: Cli, tmp_path: Path, workers: tuple[str, ...]
) -> None:
    """``kill-data`` kills a data worker; a job whose command shows none (no ``--data-workers N``
    or ``--num-workers N`` with N >= 1) would run a drill that does nothing: refused, before any
    directory is made."""
    checkpoints = tmp_path / "ckpt"
    args = ("run", "--checkpoint-dir", str(checkpoints), "--events", "kill@5,kill-data@10", str(EXAMPLE))
    line = assert_rejected(cli(*args, "--steps", "20", *workers), cli)
    assert "--events: kill-data@10" in line and "--data-workers N or --num-workers N" in line, line
    assert sorted(p.name for p in cli.tmpdir.iterdir()) == [] and not checkpoints.exists()


def test_the_data_workers_a_command_shows() -> None:
    from maitre.story import check_story, data_workers_asked, parse_events

    assert data_workers_asked(["--steps", "5", "--data-workers", "2"]) == 2
    assert data_workers_asked(["--num_workers=3"]) == 3
    assert data_workers_asked(["--data-workers", "2", "--data-workers", "0"]) == 0  # (the last wins)
    assert data_workers_asked(["--workers", "2", "--data-workers"]) is None
    check_story(parse_events("kill-data@3"), ["--num-workers", "1"])
    check_story(parse_events("kill@3,join@5"), [])  # (only kill-data asks)
    with pytest.raises(ValueError, match="shows 0 data workers"):
        check_story(parse_events("kill-data@3"), ["--num-workers", "0"])


@pytest.mark.timeout(60)
def test_port_in_use(cli: Cli) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = assert_rejected(cli("run", "--port", str(port), str(EXAMPLE)), cli)
    assert "cannot start the coordinator" in line and str(port) in line, line


@pytest.mark.timeout(60)
def test_rejected_run_leaves_no_run_directory(cli: Cli) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert_rejected(cli("run", "--port", str(busy.getsockname()[1]), str(EXAMPLE)), cli)
    assert sorted(p.name for p in cli.tmpdir.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port", ["99999", "-5"])
def test_port_out_of_range(cli: Cli, port: str) -> None:
    line = assert_rejected(cli("run", "--port", port, str(EXAMPLE)), cli)
    assert "--port" in line or "port" in line, line


@pytest.mark.timeout(60)
def test_agent_coordinator_not_listening(cli: Cli) -> None:
    port = free_port()
    line = assert_rejected(cli("agent", "--coordinator", f"127.0.0.1:{port}", "--wait", "0"), cli, code=1)
    assert "cannot reach the coordinator" in line and f"127.0.0.1:{port}" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "address", ["notanaddress", "127.0.0.1", ":80", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:port"]
)
def test_agent_bad_address(cli: Cli, address: str) -> None:
    line = assert_rejected(cli("agent", "--coordinator", address), cli)
    assert "HOST:PORT" in line and repr(address) in line, line


@pytest.mark.timeout(60)
def test_agent_bad_address_from_environment(cli: Cli) -> None:
    line = assert_rejected(cli("agent", MAITRE_COORDINATOR="notanaddress"), cli)
    assert "HOST:PORT" in line, line


@pytest.mark.timeout(60)
def test_agent_nproc_per_node_zero(cli: Cli) -> None:
    line = assert_rejected(cli("agent", "--coordinator", f"127.0.0.1:{free_port()}", "--nproc-per-node", "0"), cli)
    assert "--nproc-per-node" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("scale", "job", "2"), ("status",), ("agent",)])
def test_no_coordinator_configured(cli: Cli, args: tuple[str, ...]) -> None:
    line = assert_rejected(cli(*args), cli)
    assert "no coordinator" in line and "MAITRE_COORDINATOR" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("scale", "job", "2"), ("status",), ("status", "job")])
def test_scale_and_status_coordinator_not_listening(cli: Cli, args: tuple[str, ...]) -> None:
    port = free_port()
    line = assert_rejected(cli(*args, "--coordinator", f"127.0.0.1:{port}", "--wait", "0"), cli, code=1)
    assert "cannot reach the coordinator" in line, line


# -- a coordinator that is starting, or never answers -----------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["-1", "x", "nan", "inf"])
def test_wait_not_a_number_of_seconds(cli: Cli, value: str) -> None:
    line = assert_rejected(cli("status", "--coordinator", "127.0.0.1:1", f"--wait={value}"), cli)
    assert "--wait" in line and repr(value) in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("submit", "JOB"), ("status",), ("scale", "job", "2"), ("cancel", "job")])
def test_the_commands_say_a_coordinator_is_not_up_after_their_wait(
    cli: Cli, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Nothing listening, or no token file: each command waits its ``--wait``, then says the
    coordinator is not up, in one line."""
    manifest = tmp_path / "job.yaml"
    manifest.write_text("name: late\nqueue: default\ncommand: [python, train.py]\n")
    args = tuple(str(manifest) if a == "JOB" else a for a in args)
    where = ["--coordinator", f"127.0.0.1:{free_port()}", "--wait", "1.5"]
    started = time.monotonic()
    closed = cli.start(*args, *where)
    no_token = cli.start(*args, *where, "--token-file", str(tmp_path / "state" / "token"))
    results = {}
    for name, proc in (("closed", closed), ("no token", no_token)):
        out, err = proc.communicate(timeout=30)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert time.monotonic() - started >= 1.5
    line = assert_rejected(results["closed"], cli, code=1)
    assert "not up" in line and "after waiting 1.5s" in line and "--wait SECONDS" in line, line
    line = assert_rejected(results["no token"], cli, code=1)
    assert "not up" in line and "no token file" in line and "after waiting 1.5s" in line, line


@pytest.mark.timeout(60)
def test_an_agent_whose_coordinator_never_answers_exits_after_its_wait(cli: Cli) -> None:
    """A port that is open but never answers (a coordinator hung at start-up): the agent asks
    until its ``--wait`` is over, then exits with one line; no worker was started."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # (the kernel completes the connection; nothing ever reads or answers)
        started = time.monotonic()
        result = cli("agent", "--coordinator", f"127.0.0.1:{silent.getsockname()[1]}", "--wait", "2")
        waited = time.monotonic() - started
    line = assert_rejected(result, cli, code=1)
    assert "not up" in line and "after waiting 2s" in line and "timed out" in line, line
    assert waited >= 2, waited


def _late_coordinator(state: Path, port: int, token: str | None = None):
    """A coordinator on ``port`` with ``state``, started now (in this process: no nodes)."""
    from maitre.local import LocalCluster, UpConfig

    return LocalCluster(UpConfig(state_dir=state, port=port, nodes=0, token=token), out=lambda line: None).start()


@pytest.mark.timeout(90)
def test_the_commands_wait_for_a_coordinator_that_comes_up_late(cli: Cli, tmp_path: Path) -> None:
    """A script's commands started 2 s before their coordinator (its token file not written, its
    port not open): each waits, then does its work. Submit waits on the coordinator's own token
    file; status has its token already and waits on the port; scale and cancel wait on a token
    file the test writes once the job is there (so each has a job to act on)."""
    from maitre.launch import write_token

    port = free_port()
    state = tmp_path / "state"
    manifest = tmp_path / "job.yaml"
    manifest.write_text("name: late\nqueue: default\nminReplicas: 1\nmaxReplicas: 2\ncommand: [python, t.py]\n")
    where = ["--coordinator", f"127.0.0.1:{port}", "--wait", "40"]
    gates = {name: tmp_path / f"{name}-token" for name in ("status", "scale", "cancel")}
    token = uuid.uuid4().hex
    write_token(gates["status"], token)
    procs = {
        "submit": cli.start("submit", str(manifest), *where, "--token-file", str(state / "token")),
        "status": cli.start("status", *where, "--token-file", str(gates["status"])),
        "scale": cli.start("scale", "late", "1", *where, "--token-file", str(gates["scale"])),
        "cancel": cli.start("cancel", "late", *where, "--token-file", str(gates["cancel"])),
    }

    def done(name: str) -> tuple[str, str]:
        out, err = procs[name].communicate(timeout=45)
        assert procs[name].returncode == 0, (name, out, err)
        return out, err

    up = None
    try:
        time.sleep(2.0)
        assert {n: p.poll() for n, p in procs.items()} == dict.fromkeys(procs), "a command did not wait"
        up = _late_coordinator(state, port, token)
        out, _ = done("submit")
        assert "job late submitted to queue default" in out, out
        out, _ = done("status")
        assert out.startswith("JOB"), out
        write_token(gates["scale"], token)
        out, _ = done("scale")
        assert "job late scaled to 1 workers" in out, out
        write_token(gates["cancel"], token)
        out, _ = done("cancel")
        assert "job late cancelled" in out, out
        assert up.coordinator.job_status("late")["state"] == "CANCELLED"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if up is not None:
            up.stop()
    assert cli.leftovers() == []


@pytest.mark.timeout(90)
def test_an_agent_waits_for_a_coordinator_that_comes_up_late(cli: Cli, tmp_path: Path) -> None:
    """``maitre agent`` started 2 s before its coordinator joins it once it is up."""
    from conftest import wait_for

    port = free_port()
    state = tmp_path / "state"
    agent = cli.start(
        "agent", "--coordinator", f"127.0.0.1:{port}", "--token-file", str(state / "token"), "--wait", "40",
        "--node-id", "late", "--health-interval", "0", "--no-health-builtin", "--health-check", "true",
    )  # fmt: skip
    up = None
    try:
        time.sleep(2.0)
        assert agent.poll() is None, agent.communicate()
        up = _late_coordinator(state, port)
        wait_for(lambda: any(n["node"] == "late" for n in up.coordinator.nodes_view()), 45, "the agent to join")
        agent.send_signal(signal.SIGINT)
        out, err = agent.communicate(timeout=30)
        assert agent.returncode == 0, (out, err)
        assert "maitre: agent late with 1 slot(s) joined" in out, out
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
        if up is not None:
            up.stop()
    assert cli.leftovers() == []


@pytest.mark.timeout(60)
def test_scale_workers_not_a_number(cli: Cli) -> None:
    line = assert_rejected(cli("scale", "job", "many", "--coordinator", "127.0.0.1:1"), cli)
    assert "'many'" in line, line


@pytest.mark.timeout(60)
def test_console_script_rejects_the_same_way(tmp_path: Path) -> None:
    """The installed ``maitre`` entry point behaves like ``python -m maitre.cli``."""
    script = Path(sys.executable).with_name("maitre")
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    result = subprocess.run(
        [str(script), "run", "--nnodes", "4:2", str(EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "minimum" in one_line(result.stderr) and result.stdout == ""


# -- scripts that fail ---------------------------------------------------------------------------
BOOM = 'raise RuntimeError("boom before join")\n'

SAME_BUG = textwrap.dedent("""\
    import torch
    import maitre

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(64, 4)
    sampler = maitre.ElasticSampler(64, 8, seed=0)
    loop = maitre.ElasticLoop(model, optimizer, sampler)
    for batch in loop.run(max_steps=50):
        if batch.step == 3:
            raise ValueError("same bug everywhere")
        for idx in batch.micro_batches:
            if idx:
                model(data[idx]).pow(2).sum().backward()
    print("finished", loop.step)
    """)


def job_failed_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("maitre: job failed:")]
    assert len(lines) == 1, f"expected one 'job failed' line:\n{stdout}"
    return lines[0]


def run_script(
    cli: Cli, tmp_path: Path, name: str, source: str, *, restarts: int, timeout: float
) -> tuple[Path, subprocess.CompletedProcess[str], float]:
    """``maitre run --nnodes 2`` of a script written from ``source`` under a unique name."""
    script = tmp_path / f"{name}_{uuid.uuid4().hex}.py"
    script.write_text(source)
    started = time.monotonic()
    result = cli(
        "run",
        "--nnodes",
        "2",
        "--max-restarts",
        str(restarts),
        "--run-dir",
        str(tmp_path / "run"),
        str(script),
        timeout=timeout,
    )
    return script, result, time.monotonic() - started


@pytest.mark.timeout(120)
def test_worker_dies_before_joining(cli: Cli, tmp_path: Path) -> None:
    script, result, elapsed = run_script(cli, tmp_path, "boom", BOOM, restarts=3, timeout=90)
    assert result.returncode != 0, result.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    failed = job_failed_line(result.stdout)
    assert "boom before join" in failed and "RuntimeError" in failed, failed
    assert "Traceback" not in result.stderr, result.stderr
    assert cli.leftovers() == []


@pytest.mark.timeout(180)
def test_same_exception_on_every_rank_fails_fast(cli: Cli, tmp_path: Path) -> None:
    script, result, elapsed = run_script(cli, tmp_path, "same_bug", SAME_BUG, restarts=5, timeout=150)
    assert result.returncode == 1, result.stdout
    failed = job_failed_line(result.stdout)
    assert "ValueError: same bug everywhere" in failed, failed
    assert "every worker failed" in failed, failed
    assert "exceeded --max-restarts" not in failed, failed
    # Not one restart: the only epoch is the first, and its loss is the only failure event.
    assert not re.search(r"epoch [2-9]\d* opened", result.stdout), result.stdout
    summary = re.search(
        r"maitre: job \S+ FAILED at step \d+ after (\d+) membership epoch\(s\), "
        r"(\d+) failure\(s\)",
        result.stdout,
    )
    assert summary, result.stdout
    assert int(summary.group(1)) == 1 and int(summary.group(2)) == 1, summary.group(0)
    assert "finished" not in result.stdout
    assert elapsed < 120, f"took {elapsed:.0f} s to fail"
    assert cli.leftovers() == []


# -- checkpoint flags ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--checkpoint-dir", "CK", "--checkpoint-every", "0"], "--checkpoint-every must be"),
        (["--checkpoint-dir", "CK", "--mtbf", "-3"], "--mtbf must be"),
        (["--checkpoint-dir", "CK", "--checkpoint-keep", "0"], "--checkpoint-keep must be"),
        (["--checkpoint-dir", "CK", "--grace-period", "0"], "--grace-period must be"),
        (["--checkpoint-dir", "FILE"], "is not a directory"),
    ],
)
def test_bad_checkpoint_flags(cli: Cli, tmp_path: Path, flags: list[str], words: str) -> None:
    (tmp_path / "FILE").write_text("x")
    flags = [str(tmp_path / f) if f in ("CK", "FILE") else f for f in flags]
    line = assert_rejected(cli("run", *flags, str(EXAMPLE)), cli)
    assert words in line, line
    assert not (tmp_path / "CK").exists()


@pytest.mark.timeout(60)
def test_run_refuses_an_earlier_runs_checkpoints_without_resume(cli: Cli, tmp_path: Path) -> None:
    from maitre.checkpoint import CheckpointConfig, Checkpointer

    ck = Checkpointer(CheckpointConfig(directory=tmp_path / "ck"))
    ck.save({"w": torch.zeros(3), "step": 4}, step=4, rank=0, world_size=1, token=1)
    ck.close()
    line = assert_rejected(cli("run", "--checkpoint-dir", str(tmp_path / "ck"), str(EXAMPLE)), cli)
    assert "step-000000004" in line and "--resume" in line, line


# -- the scheduled cluster: up, submit, status, cancel -------------------------------------------
@pytest.mark.timeout(60)
def test_submit_names_every_problem_of_a_manifest(cli: Cli, tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text("name: Bad_Name\nqueue: q\nminReplicas: 0\nmaxReplica: 4\n")
    line = assert_rejected(cli("submit", str(manifest)), cli)
    for words in (
        "Bad_Name",
        "minReplicas must be at least 1",
        "unknown field 'maxReplica' (did you mean 'maxReplicas'?)",
        "command is required",
    ):
        assert words in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args,words",
    [
        (("up", "--queue", "a:x"), "--queue 'a:x'"),
        (("up", "--queue", "a:1", "--queue", "a:2"), "given twice"),
        (("up", "--nodes", "-1"), "--nodes"),
        (("up", "--slots-per-node", "0"), "--slots-per-node"),
        (("up", "--resize-cooldown", "-5"), "--resize-cooldown must be a number of seconds >= 0"),
        (("up", "--resize-cooldown", "nan"), "--resize-cooldown must be a number of seconds >= 0"),
        (("up", "--max-restarts", "-1"), "--max-restarts must be >= 0, got -1"),
        (("agent", "--coordinator", "127.0.0.1:1", "--label", "color=red"), "--label 'color=red'"),
        (("agent", "--coordinator", "127.0.0.1:1", "--label", "capacity_type=cheap"), "on-demand or spot"),
        (("agent", "--coordinator", "127.0.0.1:1", "--label", "reserved_for=a job"), "names a job"),
        (("submit", "/nonexistent/job.yaml"), "cannot read /nonexistent/job.yaml"),
    ],
)
def test_cluster_commands_reject_bad_flags(cli: Cli, args: tuple[str, ...], words: str) -> None:
    line = assert_rejected(cli(*args), cli)
    assert words in line, line


@pytest.mark.timeout(60)
def test_up_refuses_a_state_file_that_is_not_its_own(cli: Cli, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.db").write_bytes(b"not a database at all" * 100)
    line = assert_rejected(cli("up", "--state-dir", str(state), "--nodes", "0"), cli)
    assert "is not a maitre coordinator store" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("cancel", "job"), ("resume", "job")])
def test_cancel_and_resume_coordinator_not_listening(cli: Cli, args: tuple[str, ...]) -> None:
    line = assert_rejected(cli(*args, "--coordinator", f"127.0.0.1:{free_port()}", "--wait", "0"), cli, code=1)
    assert "cannot reach the coordinator" in line, line


@pytest.mark.timeout(120)
def test_up_submit_status_cancel(cli: Cli, tmp_path: Path) -> None:
    """A cluster from the command line: jobs, nodes and queues as tables, a job cancelled."""
    state = tmp_path / "state"
    up = subprocess.Popen(
        [
            *MAITRE,
            "up",
            "--state-dir",
            str(state),
            "--nodes",
            "1",
            "--slots-per-node",
            "2",
            "--queue",
            "team-a:2",
            "--queue",
            "team-b:0:1",
        ],
        cwd=ROOT,
        env=cli.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        while not any("coordinator at " in line for line in lines) and len(lines) < 50:
            lines.append(up.stdout.readline())  # event lines may come first
        export = next(line for line in iter(up.stdout.readline, "") if line.startswith("maitre: export")).split()
        env = dict(kv.split("=", 1) for kv in export if "=" in kv)
        assert set(env) == {"MAITRE_COORDINATOR", "MAITRE_TOKEN_FILE"}, export
        assert (state / "token").stat().st_mode & 0o777 == 0o600
        manifest = tmp_path / "job.yaml"
        manifest.write_text(
            textwrap.dedent(f"""\
            name: long
            queue: team-a
            priorityClassName: high
            minReplicas: 1
            maxReplicas: 2
            command: [{sys.executable}, {EXAMPLE}, --steps, "100000", --d-model, "16",
                      --layers, "1", --heads, "2", --block, "16", --global-batch, "4",
                      --device-ms-per-sample, "20"]
            """)
        )
        result = cli("submit", str(manifest), **env)
        assert result.returncode == 0, result.stderr
        assert "job long submitted to queue team-a (priority 1000)" in result.stdout
        unknown = manifest.read_text().replace("queue: team-a", "queue: team-c")
        (tmp_path / "other.yaml").write_text(unknown.replace("name: long", "name: other"))
        rejected = cli("submit", str(tmp_path / "other.yaml"), **env)
        assert rejected.returncode == 1 and "no queue 'team-c'" in rejected.stderr, rejected

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = cli("status", **env)
            if re.search(r"long\s+team-a\s+1000\s+RUNNING", status.stdout):
                break
            time.sleep(0.5)
        assert re.search(r"long\s+team-a\s+1000\s+RUNNING", status.stdout), status.stdout
        assert re.search(r"node-0\s+alive\s+2\s+2\s+rack-0\s+on-demand\s+2\.5\s", status.stdout), (
            status.stdout
        )  # with its price per slot-hour
        assert re.search(r"\(all\)\s+\d+\.\d{3}\s+0\.000\s+\d+\.\d{4}\s+\d+\.\d{4}", status.stdout), (
            status.stdout
        )  # the cost table: nothing on spot
        assert re.search(r"team-a\s+2\s+any\s+1\s+2\s+1", status.stdout), status.stdout
        assert re.search(r"team-b\s+0\s+1\s+1\s+0\s+0", status.stdout), status.stdout

        assert cli("cancel", "long", **env).returncode == 0
        again = cli("cancel", "long", **env)
        assert again.returncode == 1 and "already CANCELLED" in again.stderr
        missing = cli("cancel", "nope", **env)
        assert missing.returncode == 1 and "no job 'nope'" in missing.stderr
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "CANCELLED" not in cli("status", "long", **env).stdout:
            time.sleep(0.5)
        assert "CANCELLED" in cli("status", "long", **env).stdout
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cli.kill_leftovers()
    assert up.returncode == 0, up.stderr.read()
    assert cli.leftovers() == [], "maitre up left processes running"
