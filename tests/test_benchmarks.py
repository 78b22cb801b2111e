"""Every benchmark runs: each script in benchmarks/ at its ``--smoke`` size (the smallest state,
steps and repetitions that go through all its code paths), so that a change of maitre's API that
breaks a benchmark fails here, in the commit that makes it. Each writes its JSON to this test's
temporary directory (never over benchmarks/results/), stamped with the commit it ran on, and
leaves no process behind. ``benchmarks/gpu_check.py`` needs a GPU to measure anything: it is only
imported and its arguments parsed.

The scripts run side by side, ``AT_ONCE`` at a time, the longest first: most of a smoke run's
time is processes starting and waiting on each other (a rendezvous, a detector's window), which
another script's run fills. Each script still has a test of its own, which waits for its run.

Also: every committed result says the commit and date it was measured on, and the docs render
each as a table with that line under it (docs/hooks.py, each script's ``table(result)``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

from conftest import ROOT, TAG_VAR, _tagged_pids, kill_tagged

BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
HELPERS = {
    "_results.py": "--smoke, --out and the results' stamp, shared by the scripts",
    "workload.py": "recovery.py's and restart.py's training process (their smokes run it every way)",
}
AT_ONCE = 3
SMOKE = {  # script: seconds it may take (a few times what it takes on 2 shared cores, side by side)
    "checkpoint.py": 120,
    "control_plane.py": 120,
    "dashboard.py": 120,
    "data.py": 120,
    "eviction.py": 180,
    "recovery.py": 360,
    "replicas.py": 240,
    "restart.py": 240,
    "scheduler.py": 60,
    "simulator.py": 120,
    "spares.py": 180,
    "stragglers.py": 240,
    "throughput.py": 180,
    "warmstart.py": 120,
}
PARSE_ONLY = ["gpu_check.py"]
COMMIT = re.compile(r"[0-9a-f]{40}(-dirty)?")


def _results_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_results", BENCHMARKS / "_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.json")}


def _run(cmd: list[str], timeout: float, tmp: Path) -> subprocess.CompletedProcess[str]:
    """``cmd`` from the repository's root, every process it starts tagged and its temporary
    files under ``tmp``; fails on a timeout or on a process left behind (and kills those)."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    (tmp / "tmp").mkdir(exist_ok=True)  # (torchrun's agents leave torchelastic_* directories)
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp / "tmp")})
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tagged(tag)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{out[-6000:]}")
    finally:
        deadline = time.monotonic() + 10  # (a fork server ends just after its parent)
        while _tagged_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = kill_tagged(tag)
    assert not left, f"{' '.join(cmd)} left processes {left} behind:\n{out[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def test_every_script_has_a_smoke_test() -> None:
    """A new script in benchmarks/ without a smoke run here fails this test."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - set(HELPERS)
    assert scripts == set(SMOKE) | set(PARSE_ONLY)


class SmokeRuns:
    """The smoke runs of the scripts this session's tests ask for, started together on the first
    ask, ``AT_ONCE`` at a time, the longest (by their ``SMOKE`` allowance) first."""

    def __init__(self, scripts: list[str], folder: Path) -> None:
        self.folder = folder
        self.committed = _digest(RESULTS)
        self.pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="smoke")
        self.runs: dict[str, Future[subprocess.CompletedProcess[str]]] = {
            s: self.pool.submit(self._smoke, s) for s in sorted(scripts, key=lambda s: -SMOKE[s])
        }

    def _smoke(self, script: str) -> subprocess.CompletedProcess[str]:
        if script == "dashboard.py":
            from browser import need_chromium

            need_chromium()  # (pytest's Skipped, raised again in the test that waits)
        out = self.folder / script.replace(".py", "")
        out.mkdir()
        return _run([sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out)], SMOKE[script], out)

    def result(self, script: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        return self.runs[script].result(), self.folder / script.replace(".py", "")

    def close(self) -> None:
        for run in self.runs.values():
            run.cancel()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    asked = sorted(
        {
            item.callspec.params["script"]
            for item in request.session.items
            if getattr(item, "originalname", "") == "test_smoke"
        }
    )
    runs = SmokeRuns(asked, tmp_path_factory.mktemp("smoke"))
    try:
        yield runs
    finally:
        runs.close()


# (a test waits for its own run, which may wait for the runs started before it: the sum)
@pytest.mark.timeout(sum(SMOKE.values()) + 60)
@pytest.mark.parametrize("script", list(SMOKE))
def test_smoke(script: str, smoke_runs: SmokeRuns) -> None:
    done, tmp_path = smoke_runs.result(script)
    assert done.returncode == 0, done.stdout[-6000:]
    out = tmp_path / script.replace(".py", ".json")
    assert out.exists(), f"no {out.name} in {sorted(p.name for p in tmp_path.iterdir())}"
    result = json.loads(out.read_text())
    assert COMMIT.fullmatch(result["measured"]["commit"]), result["measured"]
    assert result["measured"]["smoke"] is True
    assert list(result)[0] == "measured" and len(result) > 1
    assert _digest(RESULTS) == smoke_runs.committed, "a smoke run wrote to benchmarks/results/"


@pytest.mark.timeout(60)
def test_gpu_check_imports_and_parses_its_arguments(tmp_path: Path) -> None:
    """Without a GPU: the module imports (its main is not run) and ``--help`` answers."""
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main)
    done = _run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--help"], 50, tmp_path)
    assert done.returncode == 0 and "usage: gpu_check.py" in done.stdout, done.stdout
    bad = _run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--no-such-flag"], 50, tmp_path)
    assert bad.returncode == 2, bad.stdout


def test_smoke_results_never_go_to_the_committed_results(tmp_path: Path) -> None:
    import argparse

    results = _results_module()
    with pytest.raises(SystemExit):
        results.parse(argparse.ArgumentParser(), "x", {}, ["--smoke", "--out", str(RESULTS)])
    with pytest.raises(SystemExit):
        results.parse(argparse.ArgumentParser(), "x", {}, ["--smoke", "--out", str(RESULTS / "x.json")])
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    args = results.parse(p, "x", {"reps": 1}, ["--smoke"])
    assert args.reps == 1 and args.out.name == "x.json" and args.out.parent != RESULTS
    args.out.parent.rmdir()
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    args = results.parse(p, "x", {"reps": 1}, ["--smoke", "--reps", "2", "--out", str(tmp_path)])
    assert args.reps == 2 and args.out == tmp_path / "x.json"  # (what was given stays)
    assert results.parse(argparse.ArgumentParser(), "x", {}, []).out == RESULTS / "x.json"
    written = json.loads(results.write_results(tmp_path / "y.json", {"a": 1}).read_text())
    assert list(written) == ["measured", "a"] and "smoke" not in written["measured"]
    assert COMMIT.fullmatch(written["measured"]["commit"])


def test_committed_results_say_when_they_were_measured() -> None:
    """Every committed result carries the commit and date it was measured on, some page of the
    docs asks for it (``<!-- results: NAME -->``), and what the docs render for it is its table
    with both quoted under it, so a reader can tell a fresh figure from a stale one."""
    spec = importlib.util.spec_from_file_location("maitre_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    pages = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    asked = set(hooks.RESULTS_MARKER.findall(pages))
    tracked = subprocess.run(
        ["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    paths = [ROOT / p for p in tracked if p.endswith(".json")] or sorted(RESULTS.glob("*.json"))
    assert paths
    for path in paths:
        measured = json.loads(path.read_text())["measured"]
        assert COMMIT.fullmatch(measured["commit"]), (path.name, measured)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", measured["date"])
        assert not measured.get("smoke"), f"{path.name} is a smoke run's"
        assert path.stem in asked, f"no page of docs/ has <!-- results: {path.stem} -->"
        short = measured["commit"][:7] + ("-dirty" if measured["commit"].endswith("-dirty") else "")
        line = f"`benchmarks/results/{path.name}`: measured on commit `{short}`, {measured['date'][:10]}"
        rendered = hooks.render_results(path.stem)
        assert rendered.rstrip().endswith(line + "."), f"the docs' {path.stem} table lacks {line!r}"
        assert "|---" in rendered, f"the docs render no table for {path.name}"
