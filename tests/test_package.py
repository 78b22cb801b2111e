"""The package as users get it: a light import, a pinned public API, a wheel that holds its data.

- ``import maitre`` and the parts that never touch a tensor (the scheduling policy, the
  simulator, the CLI's client commands) do not import torch: the public names are imported on
  first use (PEP 562), and the CLI imports the heavy parts inside the commands that need them.
- ``maitre.__all__`` is pinned here, so the public API grows only on purpose.
- A wheel built from the tree holds the traces, the job profiles, the corpus and the example
  training script (package data, read through ``importlib.resources``), and installed outside
  the repository it runs ``maitre simulate`` on a bundled workload and the example.
- ``pip install maitre`` is the training runtime: a node without the ``server`` and ``sim``
  extras runs an agent and its workers and the client commands; the commands that need an
  extra say which, and start nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import maitre

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "maitre"

PUBLIC = [
    "Batch",
    "Buckets",
    "CheckpointConfig",
    "ConstantBatch",
    "ElasticLoop",
    "ElasticSampler",
    "IntervalConfig",
    "LinearScaling",
    "LossScaler",
    "SqrtScaling",
    "TrainState",
    "WorkerStopped",
    "prepare",
    "replica_mesh",
]


def _python(args: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    """This interpreter on ``args`` in ``cwd``, with none of the caller's PYTHON* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MAITRE_", "PYTHON"))}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**base, "OMP_NUM_THREADS": "1", **env},
        timeout=timeout,
    )


def _imported(importtime_stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reports (one line per module imported)."""
    return {m[1] for m in re.finditer(r"^import time:.*\|\s*(\S+)$", importtime_stderr, re.M)}


# -- a light import ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_importing_maitre_and_its_light_parts_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, maitre, maitre.scheduling, maitre.sim, maitre.sim.run, maitre.cli, "
        "maitre.checkpoint.policy; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = _python(["-c", code], tmp_path, timeout=50)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(60)
def test_the_clients_commands_do_not_import_torch(tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text("name: hello\nqueue: default\ncommand: [python, train.py]\n")
    # Port 1 refuses at once (--wait 0: asked once): each command gets as far as asking the
    # coordinator, and fails.
    code = f"""
import sys
from maitre.cli import main
unreachable = ["--coordinator", "127.0.0.1:1", "--wait", "0"]
assert main(["status", *unreachable]) == 1
assert main(["submit", {str(manifest)!r}, *unreachable]) == 1
assert "torch" not in sys.modules, "torch was imported"
"""
    result = _python(["-c", code], tmp_path, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "cannot reach the coordinator" in result.stderr
    for command in (["--help"], ["status", "--help"], ["submit", "--help"]):
        result = _python(["-X", "importtime", "-m", "maitre.cli", *command], tmp_path, timeout=50)
        assert result.returncode == 0, result.stderr
        imported = _imported(result.stderr)  # maitre.cli itself runs as __main__
        assert "maitre.wire" in imported and "torch" not in imported, command


# -- the public API ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_public_api_is_pinned() -> None:
    assert maitre.__all__ == PUBLIC == sorted(PUBLIC)
    from importlib import metadata
    import tomllib

    # One place for the version: pyproject.toml, read back through the package's metadata.
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert maitre.__version__ == metadata.version("maitre") == pyproject["project"]["version"]
    for name in maitre.__all__:
        value = getattr(maitre, name)
        assert value.__name__ == name and value.__module__.startswith("maitre.")
        assert name in dir(maitre)
    with pytest.raises(AttributeError):
        maitre.NotAName  # noqa: B018


# -- the wheel ---------------------------------------------------------------------------------


def _build_wheel(tmp_path: Path) -> Path:
    """A wheel built from a copy of the tree (the build writes ``build/`` and ``*.egg-info``
    next to its sources, and the checkout is not ours to write in); no network."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    dist = tmp_path / "dist"
    result = _python(
        ["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(tree)],
        tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = dist.glob("maitre-*.whl")
    return wheel


@pytest.mark.timeout(600)
def test_the_wheel_holds_the_data_and_runs_from_outside_the_repository(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    traces = "maitre/sim/traces"
    needed = {
        "maitre/examples/train.py",
        "maitre/examples/train_llm.py",
        "maitre/data/text/macbeth.txt",
        "maitre/py.typed",
        f"{traces}/pollux_workloads/workloads/workload-6.csv",
    }
    for app in ("cifar10", "ncf", "deepspeech2", "bert", "yolov3", "imagenet"):
        needed |= {f"{traces}/pollux_app_profiles/{app}/{f}" for f in ("placements.csv", "scalability.csv")}
    assert not needed - names, f"missing from the wheel: {sorted(needed - names)}"
    assert any(re.fullmatch(rf"{traces}/pollux_app_profiles/bert/validation-\d+\.csv", n) for n in names)
    # `pip install maitre` is the training runtime; the rest comes with the extras.
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA")))
    required = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)[^;\n]*(?:; (.*))?$", metadata.decode(), re.M))
    assert sorted(name for name, marker in required.items() if "extra ==" not in marker) == [
        "numpy",
        "pydantic",
        "pyyaml",
        "torch",
        "xxhash",
    ]
    for extra, module in (
        ("server", "fastapi"),
        ("server", "prometheus-client"),
        ("sim", "scipy"),
        ("sim", "matplotlib"),
        ("data", "pyarrow"),
    ):
        assert f'extra == "{extra}"' in required[module], (module, required[module])
    in_tree = {
        f"maitre/{p.relative_to(SRC).as_posix()}"
        for folder in ("data/text", "sim/traces", "examples")
        for p in (SRC / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert not in_tree - names, f"missing from the wheel: {sorted(in_tree - names)}"

    site = tmp_path / "site"
    result = _python(
        ["-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # PYTHONPATH comes before the editable install's path to src/ (a .pth file), so maitre is
    # imported from the wheel's files; the first run checks that it is.
    env = {"PYTHONPATH": str(site)}
    where = """
import json
from importlib import resources
import maitre, maitre.demo, maitre.sim.workload
with resources.as_file(maitre.demo.EXAMPLE) as example:
    print(json.dumps({"maitre": maitre.__file__, "example": str(example),
                      "traces": str(maitre.sim.workload.DATA)}))
"""
    result = _python(["-c", where], tmp_path, timeout=120, **env)
    assert result.returncode == 0, result.stderr
    paths = {k: Path(v) for k, v in json.loads(result.stdout.splitlines()[-1]).items()}
    for path in paths.values():
        assert path.exists() and path.is_relative_to(site), paths
    assert paths["example"] == site / "maitre" / "examples" / "train.py"

    out = tmp_path / "sim"
    result = _python(
        [
            "-X",
            "importtime",
            "-m",
            "maitre.cli",
            "simulate",
            "--workload",
            "pollux-6",
            "--policy",
            "tiresias",
            "--out",
            str(out),
            "--no-plots",
            "--quiet",
            "--limit",
            "5",
        ],
        tmp_path,
        timeout=240,
        **env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())
    assert "torch" not in _imported(result.stderr)  # the simulator does not need it either

    # The example as a user runs it, from the installed package: its corpus is package data too.
    result = _python([str(paths["example"]), "--steps", "2", "--log-every", "1"], tmp_path, timeout=240, **env)
    assert result.returncode == 0, result.stderr
    assert "done: 2 steps" in result.stdout


# -- the training runtime alone ------------------------------------------------------------------

# The modules of the server and sim extras, as if not installed (sys.modules[name] = None: an
# import of one fails, and importlib.util.find_spec says None).
EXTRA_MODULES = ("fastapi", "starlette", "uvicorn", "httptools", "uvloop", "prometheus_client", "scipy", "matplotlib")


def _runtime_only(tmp_path: Path) -> dict[str, str]:
    """The environment of a process (and of the processes it starts) that sees the package as
    ``pip install maitre`` installs it: no server, no simulator."""
    site = tmp_path / "runtime-only"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"import sys\nfor name in {EXTRA_MODULES!r}:\n    sys.modules[name] = None\n"
    )
    return {"PYTHONPATH": str(site)}


@pytest.mark.timeout(120)
def test_the_commands_that_need_an_extra_name_it_and_start_nothing(tmp_path: Path) -> None:
    env = _runtime_only(tmp_path)
    for args, extra in (
        (["up", "--state-dir", str(tmp_path / "state")], "server"),
        (["run", "--nnodes", "1:2", "train.py"], "server"),
        (["demo"], "server"),
        (["simulate", "--workload", "pollux-6", "--policy", "tiresias", "--out", str(tmp_path / "sim")], "sim"),
    ):
        result = _python(["-m", "maitre.cli", *args], tmp_path, timeout=60, **env)
        assert result.returncode == 2, (args, result.stderr)
        assert f"pip install 'maitre[{extra}]'" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "state").exists() and not (tmp_path / "sim").exists()


@pytest.mark.timeout(240)
def test_a_node_with_the_runtime_alone_joins_a_cluster_and_trains(tmp_path: Path) -> None:
    """The coordinator runs where the server extra is installed; a GPU node's agent, its
    workers and the client commands run with the runtime alone, and the job trains to the end
    (the worker checks that it cannot import the server)."""
    from conftest import Procs, example_command, wait_for
    from maitre.wire import Client

    env = _runtime_only(tmp_path)
    probe = _python(
        [
            "-c",
            "import maitre.agent.agent, maitre.runtime.loop, maitre.checkpoint, "
            "maitre.data, maitre.cli; print('runtime ok'); import fastapi",
        ],
        tmp_path,
        timeout=60,
        **env,
    )
    assert probe.stdout.strip() == "runtime ok", probe.stderr
    assert "ModuleNotFoundError: import of fastapi halted" in probe.stderr, probe.stderr
    state, procs = tmp_path / "state", Procs(tmp_path)
    try:
        procs.start("coordinator", "up", "--nodes", "0", "--state-dir", str(state), "--queue", "q")
        log = tmp_path / "coordinator.log"
        address = wait_for(
            lambda: (
                next(
                    (
                        line.split("coordinator at ")[1].split()[0]
                        for line in log.read_text().splitlines()
                        if "coordinator at " in line
                    ),
                    None,
                )
                if log.exists()
                else None
            ),
            60,
            "the coordinator",
            log,
        )
        procs.start(
            "agent",
            "agent",
            "--coordinator",
            address,
            "--token-file",
            str(state / "token"),
            "--nproc-per-node",
            "1",
            "--node-id",
            "gpu-0",
            **env,
        )
        check = (
            "import sys, runpy; assert sys.modules['fastapi'] is None; "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        python, *script = example_command(20)
        manifest = tmp_path / "job.yaml"
        manifest.write_text(
            json.dumps(
                {
                    "name": "lean",
                    "queue": "q",
                    "minReplicas": 1,
                    "maxReplicas": 1,
                    "command": [python, "-c", check, *script],
                }
            )
        )
        submit = _python(
            [
                "-m",
                "maitre.cli",
                "submit",
                str(manifest),
                "--coordinator",
                address,
                "--token-file",
                str(state / "token"),
            ],
            tmp_path,
            timeout=60,
            **env,
        )
        assert submit.returncode == 0, submit.stderr
        client = Client(address, timeout_s=5.0, token=(state / "token").read_text().strip())
        final = wait_for(
            lambda: (j := client.get("/jobs/lean"))["state"] in ("COMPLETED", "FAILED") and j,
            150,
            "the job to finish",
            tmp_path / "agent.log",
        )
        assert final["state"] == "COMPLETED" and final["step"] == 20, final
        status = _python(
            ["-m", "maitre.cli", "status", "--coordinator", address, "--token-file", str(state / "token")],
            tmp_path,
            timeout=60,
            **env,
        )
        assert status.returncode == 0 and "lean" in status.stdout, status.stderr
    finally:
        procs.cleanup()
