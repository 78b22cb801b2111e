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
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from conftest import ROOT, TAG_VAR, _tagged_pids, kill_tagged
import fairclock
from fairclock import FairClock

BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
HELPERS = {
    "_results.py": "--smoke, --out and the results' stamp, shared by the scripts",
    "workload.py": "recovery.py's and restart.py's training process (their smokes run it every way)",
}
AT_ONCE = 3
SMOKE = {  # script: seconds of the machine its smoke run takes, AT_ONCE side by side on 2 cores
    "checkpoint.py": 9,
    "control_plane.py": 13,
    "dashboard.py": 20,
    "data.py": 6,
    "eviction.py": 22,
    "recovery.py": 75,
    "replicas.py": 39,
    "restart.py": 69,
    "scheduler.py": 1,
    "simulator.py": 7,
    "spares.py": 17,
    "stragglers.py": 30,
    "throughput.py": 48,
    "warmstart.py": 10,
}
"""Measured: ``SMOKE_REPORT=smoke.json pytest tests/test_benchmarks.py -k smoke`` writes each run's
seconds on the wall, on :class:`fairclock.FairClock` (the wall less what other processes took of
the machine) and of CPU; these are the fair clock's, rounded up (2026-12-07, 2 cores, the
suite's smoke tier alone: 173 s in all). A run fails past ``MARGIN`` times its figure plus
``START_S`` on that clock: the limits follow what the runs take, and a machine busy with
something else slows them without failing them. A run past ``DRIFT`` times its figure warns:
the figure wants measuring again."""
MARGIN = 3.0
START_S = 30.0
"""Start-up allowance over the margin: a few seconds' run must not fail on one slow import."""
DRIFT = 1.5
PARSE_ONLY = ["gpu_check.py"]


def smoke_limit_s(script: str) -> float:
    """Seconds of the fair clock a smoke run may take."""
    return MARGIN * SMOKE[script] + START_S


COMMIT = re.compile(r"[0-9a-f]{40}(-dirty)?")


def _results_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_results", BENCHMARKS / "_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True, slots=True)
class Smoke:
    """One smoke run: how it ended, and what it took."""

    done: subprocess.CompletedProcess[str]
    wall_s: float
    fair_s: float
    """Seconds of :class:`FairClock`: the wall, less what other processes took of the machine."""
    cpu_s: float
    """CPU seconds of its process and those of its descendants that were reaped in its tree."""


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.json")}


def _run(cmd: list[str], limit_s: float, tmp: Path, clock: FairClock) -> Smoke:
    """``cmd`` from the repository's root, every process it starts tagged and its temporary
    files under ``tmp``; fails past ``limit_s`` seconds of ``clock`` (seconds the machine left
    to this session: a busy neighbour slows the run, it does not fail it) or on a process left
    behind (and kills those)."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    (tmp / "tmp").mkdir(exist_ok=True)  # (torchrun's agents leave torchelastic_* directories)
    env.update({TAG_VAR: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp / "tmp")})
    started, wall = clock.now(), time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        while True:  # (wait4: the CPU its tree used, as far as its processes reaped each other)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            if clock.now() - started > limit_s:
                kill_tagged(tag)
                proc.wait()
                reader.join(10)
                pytest.fail(
                    f"{' '.join(cmd)} ran past {limit_s:.0f} s of the machine's time "
                    f"({time.monotonic() - wall:.0f} s on the wall):\n{''.join(lines)[-6000:]}"
                )
            time.sleep(0.2)
        reader.join(30)
    finally:
        if proc.stdout is not None and not reader.is_alive():
            proc.stdout.close()
        deadline = time.monotonic() + 10  # (a fork server ends just after its parent)
        while _tagged_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = kill_tagged(tag)
    out = "".join(lines)
    assert not left, f"{' '.join(cmd)} left processes {left} behind:\n{out[-6000:]}"
    return Smoke(
        subprocess.CompletedProcess(cmd, proc.returncode, out, ""),
        wall_s=time.monotonic() - wall,
        fair_s=clock.now() - started,
        cpu_s=usage.ru_utime + usage.ru_stime,
    )


def test_every_script_has_a_smoke_test() -> None:
    """A new script in benchmarks/ without a smoke run here fails this test."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - set(HELPERS)
    assert scripts == set(SMOKE) | set(PARSE_ONLY)


class SmokeRuns:
    """The smoke runs of the scripts this session's tests ask for, started together on the first
    ask, ``AT_ONCE`` at a time, the longest (by their ``SMOKE`` figure) first."""

    def __init__(self, scripts: list[str], folder: Path) -> None:
        self.folder = folder
        self.committed = _digest(RESULTS)
        self.clock = FairClock()
        self.pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="smoke")
        self.runs: dict[str, Future[Smoke]] = {
            s: self.pool.submit(self._smoke, s) for s in sorted(scripts, key=lambda s: -SMOKE[s])
        }

    def _smoke(self, script: str) -> Smoke:
        if script == "dashboard.py":
            from browser import need_chromium

            need_chromium()  # (pytest's Skipped, raised again in the test that waits)
        out = self.folder / script.replace(".py", "")
        out.mkdir()
        cmd = [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out)]
        return _run(cmd, smoke_limit_s(script), out, self.clock)

    def result(self, script: str) -> tuple[Smoke, Path]:
        return self.runs[script].result(), self.folder / script.replace(".py", "")

    def close(self) -> None:
        for run in self.runs.values():
            run.cancel()
        self.pool.shutdown(wait=True)
        self.clock.close()
        report = os.environ.get("SMOKE_REPORT")
        if report:
            done = {s: r.result() for s, r in self.runs.items() if r.done() and not r.exception()}
            figures = {s: {"wall_s": r.wall_s, "fair_s": r.fair_s, "cpu_s": r.cpu_s} for s, r in done.items()}
            Path(report).write_text(json.dumps({"cores": self.clock.cores, "runs": figures}, indent=1) + "\n")


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


# A test waits for its own run, which may wait for the runs started before it: the sum of their
# limits, on a clock that may run at FairClock's floor (a quarter of the wall) when others take
# the machine. The fair clock's limit is the one that fails a slow run; this one ends a stuck test.
@pytest.mark.timeout(int(sum(map(smoke_limit_s, SMOKE)) / FairClock.FLOOR) + 60)
@pytest.mark.parametrize("script", list(SMOKE))
def test_smoke(script: str, smoke_runs: SmokeRuns) -> None:
    run, tmp_path = smoke_runs.result(script)
    done = run.done
    assert done.returncode == 0, done.stdout[-6000:]
    out = tmp_path / script.replace(".py", ".json")
    assert out.exists(), f"no {out.name} in {sorted(p.name for p in tmp_path.iterdir())}"
    result = json.loads(out.read_text())
    assert COMMIT.fullmatch(result["measured"]["commit"]), result["measured"]
    assert result["measured"]["smoke"] is True
    assert list(result)[0] == "measured" and len(result) > 1
    assert _digest(RESULTS) == smoke_runs.committed, "a smoke run wrote to benchmarks/results/"
    if run.fair_s > DRIFT * SMOKE[script]:
        warnings.warn(
            f"{script}'s smoke run took {run.fair_s:.0f} s of the machine ({run.wall_s:.0f} s on the wall, "
            f"{run.cpu_s:.0f} s of CPU), its measured figure {SMOKE[script]} s: measure it again",
            stacklevel=1,
        )


@pytest.mark.timeout(60)
def test_gpu_check_imports_and_parses_its_arguments(tmp_path: Path) -> None:
    """Without a GPU: the module imports (its main is not run) and ``--help`` answers."""
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main)
    clock = FairClock()
    try:
        done = _run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--help"], 50, tmp_path, clock).done
        assert done.returncode == 0 and "usage: gpu_check.py" in done.stdout, done.stdout
        bad = _run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--no-such-flag"], 50, tmp_path, clock).done
        assert bad.returncode == 2, bad.stdout
    finally:
        clock.close()


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
        last = rendered.rstrip().splitlines()[-1]
        assert last.startswith(line) and last.endswith("."), f"the docs' {path.stem} table lacks {line!r}"
        machine = measured.get("machine")  # (the results measured before the stamp had it: said)
        assert (hooks.machine_words(machine) if machine else "; machine not recorded") in last, last
        assert "|---" in rendered, f"the docs render no table for {path.name}"


@pytest.mark.timeout(10)
def test_the_fair_clock_slows_for_others_load_not_for_the_sessions_own() -> None:
    """Two samples of a process table a second apart, on 2 cores: the session's own processes
    (however busy) leave the clock at full speed; another's core takes half; others taking
    every core stop it, and the clock then runs at its floor."""
    from maitre.procs import Proc

    def table(ours: float, theirs: float) -> dict[int, Proc]:
        return {
            1: Proc(1, 0, "S", "pytest", 0.0),
            2: Proc(2, 1, "R", "smoke", ours),  # (a child of the session)
            3: Proc(3, 2, "R", "worker", ours),  # (its grandchild)
            9: Proc(9, 0, "R", "hog", theirs),
        }

    assert fairclock.free_share(1, table(0, 0), table(1.0, 0), 1.0, 2) == 1.0
    assert fairclock.free_share(1, table(0, 0), table(0, 1.0), 1.0, 2) == 0.5
    assert fairclock.free_share(1, table(0, 0), table(1.0, 5.0), 1.0, 2) == 0.0
    # one of theirs started within the period is not seen: the clock runs fast, the limit strict
    assert fairclock.free_share(1, table(0, 0), {**table(0, 0), 4: Proc(4, 0, "R", "new", 1.0)}, 1.0, 2) == 1.0
    clock = FairClock(period_s=0.05, floor=0.25)
    try:
        time.sleep(0.3)
        assert FairClock.FLOOR * clock.wall() <= clock.now() <= clock.wall() + 0.01
    finally:
        clock.close()


MACHINE = {"cpu", "cores", "affinity", "copy_gb_s", "copy_mb", "load_start", "load_end", "run_s", "run_cpus", "loaded"}


@pytest.mark.timeout(180)
def test_a_smoke_run_records_its_machine_and_says_its_figures_are_single_runs(tmp_path: Path) -> None:
    """``checkpoint.py --smoke`` (a headline script, ``--reps 1``): its stamp has the machine and
    the rounds, and it said, as it started, that each headline figure is a single run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "TORCHELASTIC_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)})
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "checkpoint.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("checkpoint: each headline figure is a single run (--reps 1)"), done.stdout[:500]
    measured = json.loads((tmp_path / "checkpoint.json").read_text())["measured"]
    machine = measured["machine"]
    assert set(machine) == MACHINE, machine
    assert machine["cores"] == os.cpu_count() and 1 <= machine["affinity"] <= machine["cores"]
    assert machine["copy_gb_s"] > 0 and machine["copy_mb"] == 16 and machine["run_s"] > 0
    assert all(isinstance(machine[k], float) for k in ("load_start", "load_end")), machine
    assert machine["loaded"] is _results_module().loaded(machine)
    assert measured["rounds"] == {"argument": "--reps", "count": 1}


def test_a_headline_script_asked_for_fewer_than_three_rounds_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each script of ``HEADLINE_ROUNDS`` records its rounds; below three it prints that each
    headline figure is a single run (or the median of two), and the docs' line says it too."""
    import argparse

    results = _results_module()
    hooks = _hooks()
    assert set(results.HEADLINE_ROUNDS) == {n for n, kind in hooks.SUMMARY_RESULTS.items() if kind == "cpu"}
    for count, said in ((1, "a single run (--rounds 1)"), (2, "the median of 2 runs (--rounds 2)"), (3, None)):
        p = argparse.ArgumentParser()
        p.add_argument("--rounds", type=int, default=3)
        args = results.parse(p, "throughput", {}, ["--rounds", str(count), "--out", str(tmp_path)])
        printed = capsys.readouterr().out
        assert (said in printed) if said else printed == "", printed
        stamp = json.loads(results.write_results(args.out, {"x": 1}).read_text())["measured"]
        capsys.readouterr()  # ("wrote ...")
        assert stamp["rounds"] == {"argument": "--rounds", "count": count}
        line = hooks.measured_line("throughput", {"measured": stamp})
        assert (said in line) if said else "single run" not in line and "median of" not in line, line
    p = argparse.ArgumentParser()
    p.add_argument("--passes", type=int, default=60)
    args = results.parse(p, "scheduler", {}, ["--passes", "1", "--out", str(tmp_path)])
    assert capsys.readouterr().out == ""  # (not a headline script: no rounds)
    assert "rounds" not in json.loads(results.write_results(args.out, {"x": 1}).read_text())["measured"]


def test_a_run_on_a_loaded_machine_says_so_under_its_table() -> None:
    """``loaded``: the load at the start above the cores, or the load at the end less the run's
    own cores above them; the docs' line says "on a loaded machine (load X on N cores ...)"."""
    results, hooks = _results_module(), _hooks()
    base = {"cpu": "AMD EPYC", "cores": 2, "affinity": 2, "copy_gb_s": 9.5, "copy_mb": 256, "run_s": 60.0}
    quiet = {**base, "load_start": 0.5, "load_end": 2.6, "run_cpus": 1.9}  # (its own 4 ranks' load)
    busy_start = {**base, "load_start": 3.25, "load_end": 1.0, "run_cpus": 0.9}
    busy_end = {**base, "load_start": 1.0, "load_end": 4.5, "run_cpus": 1.5}
    assert not results.loaded(quiet) and results.loaded(busy_start) and results.loaded(busy_end)
    stamp = {"commit": "a" * 40, "date": "2026-12-08T10:00:00+00:00"}
    line = hooks.measured_line("x", {"measured": {**stamp, "machine": {**quiet, "loaded": False}}})
    assert line == (
        "`benchmarks/results/x.json`: measured on commit `aaaaaaa`, 2026-12-08, on 2 cores "
        "(AMD EPYC, memory copy 9.50 GB/s), load 0.50 at the start and 2.60 at the end"
    )
    line = hooks.measured_line("x", {"measured": {**stamp, "machine": {**busy_start, "loaded": True}}})
    assert ", on a loaded machine (load 3.25 on 2 cores at the start; AMD EPYC, memory copy 9.50 GB/s)" in line
    line = hooks.measured_line("x", {"measured": {**stamp, "machine": {**busy_end, "loaded": True}}})
    assert "on a loaded machine (load 3.00 on 2 cores at the end, the run's own 1.50 left out;" in line
    assert hooks.measured_line("x", {"measured": stamp}).endswith("2026-12-08; machine not recorded")


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("maitre_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


@pytest.mark.timeout(60)
def test_a_run_past_its_limit_fails_and_leaves_nothing(tmp_path: Path) -> None:
    """A hang on a quiet machine is still a failure, at its limit, with nothing left running."""
    clock = FairClock(period_s=0.2)
    try:
        with pytest.raises(pytest.fail.Exception, match="ran past 1 s of the machine's time"):
            _run([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], 1.0, tmp_path, clock)
    finally:
        clock.close()
