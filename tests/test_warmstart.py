"""Warm worker start (:mod:`maitre.agent.warmstart`): a worker forked from the agent's fork server
is the command it stands for, as ``python`` would have started it: its arguments, environment,
working directory, ``__main__``, exit code, its own session, its output on pipes, and the thread
count its environment asks for (torch sized its pool in the fork server, before the worker's
environment existed). Real processes: this is process semantics."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from maitre.agent import warmstart

PY = sys.executable

PROBE = """
import json, os, sys
import torch
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
json.dump(
    {
        "argv": sys.argv,
        "name": __name__,
        "cwd": os.getcwd(),
        "var": os.environ.get("PROBE_VAR"),
        "leftover": os.environ.get("PROBE_NOT_GIVEN"),
        "sid": os.getsid(0),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
    },
    open(sys.argv[1], "w"),
)
sys.exit(3)
"""


def _finish(proc: warmstart.WarmProcess) -> tuple[int, str, str]:
    code = proc.wait(60)
    return code, proc.stdout.read(), proc.stderr.read()


@pytest.mark.timeout(120)
def test_a_warm_worker_is_its_command_as_python_would_start_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_NOT_GIVEN", "the agent's own")  # not in the worker's env: not seen
    script, out, work = tmp_path / "probe.py", tmp_path / "out.json", tmp_path / "work"
    script.write_text(PROBE)
    work.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "PROBE_VAR": "given", "OMP_NUM_THREADS": "1"}
    proc = warmstart.WarmProcess([PY, str(script), str(out), "--flag"], env, cwd=str(work))
    code, stdout, stderr = _finish(proc)
    assert (code, stdout, stderr) == (3, "to stdout\n", "to stderr\n")
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(script), str(out), "--flag"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(work) and seen["var"] == "given" and seen["leftover"] is None
    assert seen["pid"] == proc.pid and seen["sid"] == proc.pid  # a session of its own
    assert seen["threads"] == 1, seen  # OMP_NUM_THREADS=1, whatever the fork server's count


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", ["2", None])
def test_a_warm_worker_computes_with_the_threads_its_environment_asks_for(tmp_path: Path, threads) -> None:
    """``None``: no OMP_NUM_THREADS, torch's own default (what a cold start gets)."""
    script, out = tmp_path / "probe.py", tmp_path / "out.json"
    script.write_text(PROBE)
    env = {"PATH": os.environ.get("PATH", "")} | ({"OMP_NUM_THREADS": threads} if threads else {})
    code, _, _ = _finish(warmstart.WarmProcess([PY, str(script), str(out)], env))
    assert code == 3
    want = int(threads) if threads else _cold_threads(env)
    assert json.loads(out.read_text())["threads"] == want


def _cold_threads(env: dict[str, str]) -> int:
    import subprocess

    done = subprocess.run(
        [PY, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True, text=True, timeout=60
    )
    return int(done.stdout)


@pytest.mark.timeout(120)
def test_a_module_starts_warm_with_python_dash_m(tmp_path: Path) -> None:
    (tmp_path / "probe_module.py").write_text(PROBE)
    out = tmp_path / "out.json"
    code, _, _ = _finish(warmstart.WarmProcess([PY, "-m", "probe_module", str(out)], {}, cwd=str(tmp_path)))
    assert code == 3
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv"][1:] == [str(out)]


@pytest.mark.timeout(120)
def test_an_uncaught_exception_exits_1_with_its_traceback_last(tmp_path: Path) -> None:
    """The agent takes a failing worker's last line of stderr as its error (``Type: message``)."""
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('bad learning rate')\n")
    code, _, stderr = _finish(warmstart.WarmProcess([PY, str(script)], {}))
    assert code == 1
    assert stderr.splitlines()[0] == "Traceback (most recent call last):", stderr
    assert stderr.splitlines()[-1] == "ValueError: bad learning rate", stderr


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("command", "target"),
    [
        ([PY, "train.py", "--steps", "3"], ("path", "train.py", ["train.py", "--steps", "3"])),
        ([PY, "-m", "pkg.train", "--x"], ("module", "pkg.train", ["pkg.train", "--x"])),
        ([PY, "-X", "importtime", "train.py"], None),  # interpreter flags: run as asked
        ([PY, "-c", "print(1)"], None),
        (["/usr/bin/env", "python3", "train.py"], None),  # another interpreter, maybe
        ([PY], None),
        (["bash", "run.sh"], None),
    ],
)
def test_only_this_interpreter_running_a_script_or_module_starts_warm(command, target) -> None:
    assert warmstart.warm_target(command) == target


@pytest.mark.timeout(10)
def test_warm_start_can_be_turned_off() -> None:
    assert warmstart.enabled({}) and not warmstart.enabled({warmstart.ENV: "0"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("end", "code", "said"),
    [
        ("pass", 0, ""),
        ("raise ValueError('late')", 1, "ValueError: late"),
        ("sys.exit(4)", 4, ""),
        ("sys.exit('cannot go on')", 1, "cannot go on"),
        ("raise KeyboardInterrupt", -2, "KeyboardInterrupt"),  # python ends by SIGINT then
    ],
)
def test_a_warm_worker_ends_as_python_ends(tmp_path: Path, end: str, code: int, said: str) -> None:
    """Its non-daemon threads are waited for and its ``atexit`` functions run, however the
    script ends (a W&B run's ``finish``, a writer's last flush), and ``sys.exit`` means what it
    means to python."""
    script, marks = tmp_path / "ends.py", tmp_path / "marks"
    script.write_text(
        "import atexit, sys, threading, time\n"
        f"marks = open({str(marks)!r}, 'a', buffering=1)\n"
        "atexit.register(lambda: marks.write('atexit\\n'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), marks.write('thread\\n'))).start()\n"
        f"{end}\n"
    )
    got, _, stderr = _finish(warmstart.WarmProcess([PY, str(script)], {}))
    assert got == code, stderr
    assert (stderr.splitlines() or [""])[-1] == said, stderr
    assert marks.read_text() == "thread\natexit\n"


@pytest.mark.timeout(120)
def test_reap_ends_every_warm_worker_and_what_it_started(tmp_path: Path) -> None:
    """The last act of an agent's process: a warm worker is a non-daemon child, which python
    waits for at exit, so none may be left running; its session goes with it."""
    script, pid_file = tmp_path / "stays.py", tmp_path / "child.pid"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    proc = warmstart.WarmProcess([PY, str(script)], {})
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the worker did not start its child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    warmstart.reap()
    assert proc.poll() == -signal.SIGKILL
    while time.monotonic() < deadline:  # (the child is the fork server's grandchild: init reaps it)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the worker's own child outlived it")


AGENT = """
import os, sys, time
from maitre.agent import warmstart
if __name__ == "__main__":
    warmstart.PRELOAD = ["maitre.agent.warmstart"]  # (torch's imports: seconds a round, same race)
    for _ in range(int(sys.argv[2])):
        warmstart.WarmProcess([sys.executable, sys.argv[1]], {"PATH": os.environ.get("PATH", "")})
        print("started", flush=True)
    time.sleep(60)
"""


@pytest.mark.timeout(240)
def test_an_agent_gone_in_any_window_of_a_start_leaves_no_worker_behind(tmp_path: Path) -> None:
    """An agent process (here a stand-in that only starts warm workers, one after another)
    ended without a word (SIGKILL, or SIGTERM, which python does not handle) at 16 points
    spread over its fork server's start and its workers' starts: no worker, no fork server of
    its, nothing they started outlives it. Before the workers watched their agent, every worker
    started trained on (in its own session), and a start under way when the agent went was
    forked after it, by the orphaned fork server."""
    from conftest import TAG_VAR, kill_tagged, pids_with_env

    import subprocess

    worker, agent = tmp_path / "train.py", tmp_path / "agent.py"
    worker.write_text("import time\ntime.sleep(60)\n")
    agent.write_text(AGENT)
    tag = os.urandom(8).hex()
    env = {**os.environ, TAG_VAR: tag, "PYTHONUNBUFFERED": "1"}
    left: dict[float, list[int]] = {}
    try:
        for i in range(16):
            proc = subprocess.Popen([PY, str(agent), str(worker), "6"], env=env, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            if i % 2:  # half of them once the first worker started: a start of a warm fork server
                assert proc.stdout.readline() == "started\n"
            delay = (i // 4) * 0.06
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL if i % 4 < 2 else signal.SIGTERM)
            proc.wait(10)
            proc.stdout.close()
            deadline = time.monotonic() + 10
            while (pids := pids_with_env(TAG_VAR, tag)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pids:
                left[round(delay, 2)] = pids
                kill_tagged(tag)
    finally:
        kill_tagged(tag)
    assert not left, f"processes outlived their agent (seconds after its start or first worker: pids): {left}"
