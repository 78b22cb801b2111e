"""The import direction of the packages, as the tree promises it.

    cli, launch, local (maitre up), demo  ->  control, agent, runtime, checkpoint  ->  wire
    runtime (the training process)  ->  checkpoint  ->  runtime.statetree (the state encoding)
    scheduling (the policy: pure, no torch) is imported by the coordinator and the simulator
    sim (the simulator: no torch, no processes) imports only scheduling
    engines (Slurm, Kubernetes: the cluster's own commands) speak to the coordinator over wire only
      (and read the job manifest's model)
    dashboard (the web page and its routes, live or replay) reads an event log, nothing else
    serving (uvicorn on a thread: the API's server and the replay's) imports nothing of maitre

The training process never imports the coordinator or the agent; the coordinator never imports
torch-side training code; the checkpoint package uses only the runtime's state encoding.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "maitre"

_TOP = ("maitre.launch", "maitre.cli", "maitre.local", "maitre.demo")
FORBIDDEN = {
    "runtime": ("maitre.control", "maitre.agent", *_TOP),
    "checkpoint": (
        "maitre.control",
        "maitre.agent",
        *_TOP,
        "maitre.runtime.loop",
        "maitre.runtime.group",
        "maitre.runtime.heartbeat",
    ),
    "control": ("maitre.runtime", "maitre.checkpoint", "maitre.agent", *_TOP),
    "agent": ("maitre.control", "maitre.checkpoint", *_TOP),
    # the input pipeline runs in the training process, beside the loop it feeds
    "data": ("maitre.control", "maitre.agent", "maitre.checkpoint", *_TOP),
    "scheduling": ("maitre.control", "maitre.runtime", "maitre.checkpoint", "maitre.agent", *_TOP, "torch"),
    "sim": ("maitre.control", "maitre.runtime", "maitre.checkpoint", "maitre.agent", *_TOP, "torch"),
    "engines": (
        "maitre.control",
        "maitre.runtime",
        "maitre.checkpoint",
        "maitre.agent",
        # of the scheduling package only the job manifest (a MaitreJob's fields)
        "maitre.scheduling.policy",
        "maitre.scheduling.assign",
        "maitre.scheduling.model",
        "maitre.scheduling.lifecycle",
        "maitre.sim",
        "maitre.dashboard",
        *_TOP,
        "torch",
    ),
    "dashboard": (
        "maitre.control",
        "maitre.runtime",
        "maitre.checkpoint",
        "maitre.agent",
        "maitre.scheduling",
        "maitre.sim",
        *_TOP,
        "torch",
    ),
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.timeout(30)
@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package: str) -> None:
    bad = []
    for path in sorted((SRC / package).rglob("*.py")):
        for name in imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(30)
def test_wire_imports_nothing_of_maitre_but_its_errors() -> None:
    """The CLI's and the worker's client stays stdlib (``maitre status`` starts fast)."""
    assert not [n for n in imports(SRC / "wire.py") if n.startswith("maitre") and not n.startswith("maitre.errors")]


@pytest.mark.timeout(30)
def test_serving_imports_nothing_of_maitre() -> None:
    """The web server under the coordinator's API and a replay's dashboard: neutral ground."""
    assert not [n for n in imports(SRC / "serving.py") if n.startswith("maitre")]


@pytest.mark.timeout(30)
def test_the_wire_speaks_the_protocols_prefix() -> None:
    from maitre import protocol, wire

    assert wire.API == protocol.API


@pytest.mark.timeout(30)
def test_every_maitre_variable_is_named_in_the_protocol_only() -> None:
    """``MAITRE_*`` names are spelt once, in :mod:`maitre.protocol`; the rest import them."""
    import re

    spelt = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "protocol.py":
            continue
        for match in re.finditer(r"[\"']MAITRE_[A-Z_]+", path.read_text()):
            spelt.append(f"{path.relative_to(SRC)}: {match.group(0)}")
    assert not spelt, "\n".join(spelt)


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports: at the top or
    inside a function (a deferred import is still a dependency), not under TYPE_CHECKING."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # maitre.x.y.SomeClass -> maitre.x.y
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        todo = list(ast.parse(path.read_text()).body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                deps.update(owner(f"{base}.{alias.name}") for alias in node.names)
            elif isinstance(node, ast.Import):
                deps.update(owner(alias.name) for alias in node.names)
            else:
                todo.extend(ast.iter_child_nodes(node))
        graph[name] = {d for d in deps if d and d != name}
    return graph


@pytest.mark.timeout(30)
def test_no_import_cycle_between_the_packages_modules() -> None:
    """A cycle, even through a deferred import, means two modules that cannot be read (or
    changed) one without the other: each is named with the path that leads back to it."""
    graph = _module_graph()
    assert len(graph) > 80 and "maitre.scheduling.spec" in graph["maitre.protocol"]
    cycles = []
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        for dep in sorted(graph[module]):
            if dep in path:
                cycles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in done:
                walk(dep, path + [dep])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    assert not cycles, "\n".join(cycles)


LIFECYCLE = {
    # a managed job's lifecycle (maitre.control.job): its placement, bounds, deadlines, runs
    "placement",
    "last_resize_at",
    "min_replicas",
    "max_replicas",
    "suspend_deadline",
    "held",
    "admitted_at",
    "ended_at",
    "suspended_run",
    "incarnation",
    "workers_started",
    "generation",
}
RUN = {"target", "min_workers", "max_workers"}
"""A run's size and bounds: its membership's own, and the job module's."""
WRITERS = {
    "control/job.py": LIFECYCLE | RUN | {"move"},
    # the run moves the job's state (epochs, its end); ``ended_at``: its workers' own
    "control/membership.py": RUN | {"move", "ended_at"},
    "control/restarts.py": RUN | {"move", "ended_at"},  # (a run too: a restart-mode job's)
}
NOT_THE_COORDINATORS = ("scheduling/", "sim/")
"""The policy and the simulator change their own copies of jobs (the pass hands the policy
copies; the simulator has no coordinator)."""


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, attribute)`` of each write of an attribute in LIFECYCLE | RUN: assigned (alone,
    in a tuple, augmented), an item set or deleted, a mutating method called on it, and each
    call of ``.move()`` (the job's state)."""
    watched = LIFECYCLE | RUN
    out = []

    def target(node: ast.AST) -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                target(elt)
        elif isinstance(node, ast.Attribute) and node.attr in watched:
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr in watched:
            out.append((node.lineno, node.value.attr))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            target(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                target(t)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr == "move" and (
                ast.unparse(owner).endswith("job") or any("JobState" in ast.unparse(a) for a in node.args)
            ):
                out.append((node.lineno, "move"))  # (a job's: job.move(...), m.job.move(JobState.X))
            elif (
                node.func.attr in ("pop", "update", "clear", "setdefault", "popitem", "__setitem__")
                and isinstance(owner, ast.Attribute)
                and owner.attr in watched
            ):
                out.append((node.lineno, owner.attr))
    return out


def test_a_jobs_lifecycle_is_written_by_the_job_module_only() -> None:
    """Nothing but :mod:`maitre.control.job` writes a managed job's placement, bounds,
    deadlines or runs, or moves its state (its running membership moves the state, and owns its
    own target): the other modules call the job's verbs. A constructor's own ``self.x = ...``
    in ``__init__`` is a new object, not a write of a job's."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(NOT_THE_COORDINATORS):
            continue
        tree = ast.parse(path.read_text(), str(path))
        inits = {
            n.lineno
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.name == "__init__"
            for n in ast.walk(f)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        }
        allowed = WRITERS.get(rel, set())
        found += [f"{rel}:{line}: {attr}" for line, attr in _writes(tree) if attr not in allowed and line not in inits]
    assert not found, "lifecycle written outside maitre.control.job:\n" + "\n".join(found)


TRAINING_PROCESS = ("runtime/", "data/", "checkpoint/")


def test_the_training_processs_code_writes_no_environment_variable() -> None:
    """The loop, the data pipeline and the checkpointer read the environment the agent or
    torchrun gave the process, and never change it: a script reads rank and world size from
    the loop (it used to find ``RANK`` and ``WORLD_SIZE`` rewritten under it at every epoch)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(TRAINING_PROCESS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            write = False
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                write = any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ" for t in flat)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                write = (owner == "os.environ" and node.func.attr in ("update", "setdefault", "pop", "clear")) or (
                    owner == "os" and node.func.attr in ("putenv", "unsetenv")
                )
            if write:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "the training process's environment written:\n" + "\n".join(found)


_OWN_PROCESSES = {("data/loader.py", "_WorkerInit")}
"""Classes whose code runs in processes maitre started (a data worker ends itself when the
training process that owns it is gone)."""


def test_the_training_processs_code_never_exits_the_process() -> None:
    """A library in a user's process ends what it runs, never the process: no ``SystemExit``,
    ``sys.exit``, ``os._exit`` or ``os.kill`` of itself (the loop's ``run()`` returns, and says
    why in ``loop.ended``; a worker that cannot go on gets ``maitre.WorkerStopped``)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(TRAINING_PROCESS):
            continue
        tree = ast.parse(path.read_text(), str(path))
        own = {  # code that runs in processes of maitre's own, not the user's
            id(n)
            for c in tree.body
            if isinstance(c, ast.ClassDef) and (rel, c.name) in _OWN_PROCESSES
            for n in ast.walk(c)
        }
        for node in ast.walk(tree):
            if id(node) in own:
                continue
            text = ast.unparse(node) if isinstance(node, (ast.Raise, ast.Call)) else ""
            if isinstance(node, ast.Raise) and node.exc is not None and "SystemExit" in ast.unparse(node.exc):
                found.append(f"{rel}:{node.lineno}: {text[:80]}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "os._exit", "exit", "quit"):
                found.append(f"{rel}:{node.lineno}: {text[:80]}")
    assert not found, "the training process's code exits the process:\n" + "\n".join(found)
