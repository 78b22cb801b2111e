"""What the docs generate at build time, so that it cannot drift from the code and the results
(mkdocs hooks: ``hooks: [docs/hooks.py]`` in mkdocs.yml). A page asks for each by a marker on a
line of its own:

* ``<!-- cli-reference -->``: every command of ``maitre.cli.build_parser()``, nested ones too
  (``maitre data prepare``), with its usage and each argument's help and default
  (:func:`cli_reference`);
* ``<!-- results: NAME -->``: ``benchmarks/results/NAME.json`` as a table, rendered by the
  ``table(result)`` of the script that writes it (``benchmarks/NAME.py``; ``gpu.json``:
  ``benchmarks/gpu_check.py``; ``chaos.json``: ``tests/chaos/chaos_report.py``), followed by the
  commit and date it was measured on, the machine (its cores, processor and copy bandwidth, its
  load; "on a loaded machine" where the load was above its cores; "machine not recorded" for a
  result measured before the stamp had it) and, where a headline figure was asked for fewer
  than three rounds, that it is a single run (:func:`render_results`, :func:`measured_line`);
* ``<!-- results-summary -->``: the headline figures, maitre beside what one would use instead
  (:func:`summary`); README.md carries the same table, and ``tests/test_docs.py`` checks that it
  is this one. On the docs' page a list follows it: the files it draws on that are not of one
  run set (another commit or machine than the table's others, no machine recorded, a loaded
  machine, fewer than three rounds: :func:`summary_report`), which ``tests/test_docs.py`` names.

Sphinx roles in docstrings (``:class:`~maitre.data.Loader```), which the API reference shows as
mkdocstrings renders them, become plain code (:func:`on_page_content`).
"""

from __future__ import annotations

import argparse
import functools
import html
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
RENDERERS = {"gpu": BENCHMARKS / "gpu_check.py", "chaos": ROOT / "tests" / "chaos" / "chaos_report.py"}
"""The file whose ``table(result)`` renders a result, where it is not ``benchmarks/NAME.py``."""

RESULTS_MARKER = re.compile(r"^<!-- results: ([\w-]+) -->[ \t]*$", re.M)
CLI_MARKER = "<!-- cli-reference -->"
SUMMARY_MARKER = "<!-- results-summary -->"
SUMMARY_RESULTS = {
    "throughput": "cpu",
    "gpu": "gpu",
    "data": "cpu",
    "recovery": "cpu",
    "restart": "cpu",
    "checkpoint": "cpu",
    "simulator": "simulated",
}
"""The results :func:`summary` draws on, and what their figures are: CPU timings (whose machine
must be the table's), a GPU's (its own machine), simulated time (no machine's)."""
COPY_SPREAD = 1.5
"""Two CPU results whose copy bandwidths are further apart than this factor are of two machines
(or of one in two states): the checkpoint's headline did not hold where it was 2x apart."""
_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj|const):<code>(~?)([^<]+)</code>")
_LITERAL = re.compile(r"::</p>(\s*<pre>)")  # reST's "text::" before an indented code block


class DocsError(Exception):
    """A marker that cannot be rendered: the build stops (mkdocs reports the page)."""


# --- benchmark results ---------------------------------------------------------------------------


def committed_results() -> list[str]:
    """The names of the results JSONs git tracks (every one in the folder outside a checkout)."""
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "benchmarks/results"], cwd=ROOT, check=True, capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        tracked = []
    paths = [ROOT / p for p in tracked if p.endswith(".json")] or sorted(RESULTS.glob("*.json"))
    return sorted(p.stem for p in paths)


def load_result(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise DocsError(f"no benchmarks/results/{name}.json")
    return json.loads(path.read_text())


@functools.cache
def renderer(name: str) -> Callable[[dict[str, Any]], str]:
    """The ``table`` function of the file that writes ``name``'s results, loaded by its path
    (benchmarks/ is not a package; its scripts import ``_results`` from beside them)."""
    path = RENDERERS.get(name, BENCHMARKS / f"{name}.py")
    if not path.is_file():
        raise DocsError(f"nothing renders benchmarks/results/{name}.json: no {path.relative_to(ROOT)}")
    for folder in (str(path.parent), str(BENCHMARKS)):
        if folder not in sys.path:
            sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(f"maitre_docs_{name}", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (as an import would: dataclasses look their module up)
    spec.loader.exec_module(module)
    table = getattr(module, "table", None)
    if table is None:
        raise DocsError(f"{path.relative_to(ROOT)} has no table(result)")
    return table


@functools.cache
def bench_results() -> ModuleType:
    """``benchmarks/_results.py``, loaded by its path (its wording of a run's rounds)."""
    spec = importlib.util.spec_from_file_location("maitre_docs_bench_results", BENCHMARKS / "_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _short(commit: str) -> str:
    return commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")


def _stamp(name: str, result: dict[str, Any]) -> dict[str, Any]:
    stamp = result.get("measured")
    if not isinstance(stamp, dict) or "commit" not in stamp or "date" not in stamp:
        raise DocsError(f"benchmarks/results/{name}.json has no measured commit and date")
    return stamp


def _load(value: float | None) -> str:
    return "not known" if value is None else f"{value:.2f}"


def machine_words(machine: dict[str, Any]) -> str:
    """A result's ``measured.machine`` in words: "on 2 cores (AMD EPYC, memory copy 9.10 GB/s),
    load 0.42 at the start and 1.96 at the end", or "on a loaded machine (load 3.10 on 2 cores at
    the start; ...)"."""
    cores = machine["cores"]
    start, end, own = machine.get("load_start"), machine.get("load_end"), machine.get("run_cpus", 0.0)
    what = f"{machine['cpu']}, memory copy {machine['copy_gb_s']:.2f} GB/s"
    if machine.get("loaded"):
        if start is not None and start > cores:
            load = f"load {start:.2f} on {cores} cores at the start"
        else:
            others = None if end is None else end - own
            load = f"load {_load(others)} on {cores} cores at the end, the run's own {own:.2f} left out"
        return f"on a loaded machine ({load}; {what})"
    on = f"{cores} cores" if machine.get("affinity", cores) == cores else f"{machine['affinity']} of {cores} cores"
    return f"on {on} ({what}), load {_load(start)} at the start and {_load(end)} at the end"


def few_rounds(stamp: dict[str, Any]) -> str | None:
    """What a stamp's rounds say of its headline figures, where they are fewer than three."""
    rounds, results = stamp.get("rounds"), bench_results()
    if not isinstance(rounds, dict) or rounds.get("count", results.MIN_ROUNDS) >= results.MIN_ROUNDS:
        return None
    return results.rounds_words(rounds["argument"], rounds["count"])


def measured_line(name: str, result: dict[str, Any]) -> str:
    """ "`benchmarks/results/NAME.json`: measured on commit `abcdef1`, YYYY-MM-DD, on 2 cores
    (...)" from the result's ``measured`` stamp (``-dirty`` kept: the tree had uncommitted
    changes; the machine by :func:`machine_words`, or "machine not recorded"), then, where a
    headline figure had fewer than three rounds, that it is a single run."""
    stamp = _stamp(name, result)
    line = f"`benchmarks/results/{name}.json`: measured on commit `{_short(stamp['commit'])}`, {stamp['date'][:10]}"
    machine = stamp.get("machine")
    line += f", {machine_words(machine)}" if isinstance(machine, dict) else "; machine not recorded"
    if (rounds := few_rounds(stamp)) is not None:
        line += f"; {rounds}"
    return line


def render_results(name: str) -> str:
    """``benchmarks/results/NAME.json`` as Markdown: its table, then the line saying when it was
    measured."""
    result = load_result(name)
    return f"{renderer(name)(result).rstrip()}\n\n{measured_line(name, result)}."


def summary() -> str:
    """The headline figures as one Markdown table: maitre beside what one would use instead,
    each from the committed results (README.md carries this table, docs/benchmarks.md too)."""
    tp, gpu, data = load_result("throughput"), load_result("gpu"), load_result("data")
    rec, ckpt, sim = load_result("recovery"), load_result("checkpoint"), load_result("simulator")
    restart = load_result("restart")
    link = tp["link"]["4"]
    gpu4 = gpu["overhead"]["micro_batches_4"]
    jpeg, wait, first = data["jpeg"]["throughput"], data["wait"], data["first_batch"]
    worst_ms = max(v for k, v in first.items() if k.endswith("_ms") and k != "step_ms")
    m, t = rec["maitre"], rec["torchrun"]
    big = max((r for r in ckpt.values() if isinstance(r, dict) and "state_mb" in r), key=lambda r: r["state_mb"])
    jct = sim["load1_mean_avg_jct_s"]["maitre, goodput batch"]
    rows = [
        (
            "step time, 4 ranks over a 1 Gbit link, MLP of 50.6 M parameters",
            f"{1000 * link['maitre']['step_s']:,.0f} ms",
            f"DDP: {1000 * link['ddp']['step_s']:,.0f} ms",
            link["maitre"]["step_s"] / link["ddp"]["step_s"],
        ),
        (
            "the same, sharded (maitre's loop on FSDP2)",
            f"{1000 * link['maitre-fsdp2']['step_s']:,.0f} ms",
            f"FSDP2: {1000 * link['fsdp2']['step_s']:,.0f} ms",
            link["maitre-fsdp2"]["step_s"] / link["fsdp2"]["step_s"],
        ),
        (
            f"step time on one {gpu['device'].removeprefix('NVIDIA ')}, "
            f"{gpu4['plain']['params'] / 1e9:.2f} B bf16 decoder, "
            f"{gpu4['plain']['tokens_per_step'] // 1024} k tokens a step",
            f"{1000 * gpu4['maitre']['step_s']:.1f} ms",
            f"DDP: {1000 * gpu4['ddp']['step_s']:.1f} ms",
            gpu4["maitre"]["step_s"] / gpu4["ddp"]["step_s"],
        ),
        (
            f"data loading, JPEGs, {data['setup']['workers']} workers (samples/s: higher is better)",
            f"{jpeg['maitre_samples_s']:,.0f}",
            f"DataLoader: {jpeg['dataloader_samples_s']:,.0f}",
            jpeg["maitre_samples_s"] / jpeg["dataloader_samples_s"],
        ),
        (
            f"data: training with {data['setup']['workers']} data workers, waiting for data in a "
            f"{wait['step_ms']:.0f} ms step",
            f"{wait['wait_ms_mean']:.1f} ms",
            f"the 2% target: {0.02 * wait['step_ms']:.1f} ms",
            wait["wait_ms_mean"] / (0.02 * wait["step_ms"]),
        ),
        (
            "data: a resume or a resize to its first batch, anywhere in the data epoch (worst)",
            f"{worst_ms:.0f} ms",
            f"one step: {first['step_ms']:.0f} ms",
            first["worst_vs_step"],
        ),
        (
            "a worker killed: from the kill to the next step",
            f"{m['crash_to_step_s']:.3f} s",
            f"torchrun: {t['crash_to_step_s']:.2f} s",
            m["crash_to_step_s"] / t["crash_to_step_s"],
        ),
        (
            "a worker joins: the running workers pause",
            f"{m['join_pause_s']:.3f} s",
            f"torchrun: {t['join_pause_s']:.2f} s",
            m["join_pause_s"] / t["join_pause_s"],
        ),
        (
            f"a node of {restart['workers']} lost, an unmodified DDP script: to the next step (restart mode)",
            f"{restart['restart']['to_step_s']:.1f} s",
            f"torchrun elastic: {restart['torchrun']['to_step_s']:.1f} s",
            restart["restart"]["to_step_s"] / restart["torchrun"]["to_step_s"],
        ),
        (
            f"a checkpoint of {big['state_mb']:,.0f} MB: training blocked",
            f"{big['maitre_block_s']:.3f} s",
            f"`dcp.async_save`: {big['dcp_async_block_s']:.3f} s",
            big["maitre_block_s"] / big["dcp_async_block_s"],
        ),
        (
            "scheduling, the 8 Pollux workloads (simulated): mean average JCT",
            f"{jct['ours']:,.0f} s",
            f"Pollux (published): {jct['published']:,.0f} s",
            jct["ours"] / jct["published"],
        ),
    ]
    lines = [
        "| figure (2 CPU cores and gloo, unless it says a GPU) | maitre | instead | maitre / instead |",
        "|---|---|---|---|",
    ]
    lines += [f"| {what} | {ours} | {theirs} | {ratio:.3f} |" for what, ours, theirs, ratio in rows]
    return "\n".join(lines)


def _machine_key(machine: dict[str, Any]) -> tuple[Any, ...]:
    return (machine.get("cpu"), machine.get("cores"), machine.get("affinity"))


def _machine_desc(cpu: Any, cores: Any, affinity: Any, copy: float) -> str:
    on = f"{cores} cores" if affinity == cores else f"{affinity} of {cores} cores"
    return f"{on} ({cpu}, memory copy {copy:.2f} GB/s)"


def _most_common(values: list[tuple[Any, str]]) -> tuple[Any, int, bool]:
    """The value most of ``(value, date)`` share, how many share it, and whether it won a tie
    (as the one measured last)."""
    count: dict[Any, list[Any]] = {}
    for value, date in values:
        count.setdefault(value, [0, ""])
        count[value][0] += 1
        count[value][1] = max(count[value][1], date)
    best = max(count, key=lambda v: tuple(count[v]))
    return best, count[best][0], sum(c == count[best][0] for c, _ in count.values()) > 1


class SummaryReport(NamedTuple):
    """What :func:`summary_report` finds: ``table``, the commit and machine it takes as the
    table's, in words; ``wrong`` and ``notes``, a line for each file, naming it."""

    table: str
    wrong: list[str]
    notes: list[str]


def summary_report() -> SummaryReport:
    """The files :func:`summary` draws on (``SUMMARY_RESULTS``) that are not of one run set, each
    named with what is not.

    The table's commit is the one most of its files share (of those whose stamp records their
    machine, if any do; the newest of a tie); its machine, the processor and cores most of its
    CPU results were measured on, with their median copy bandwidth. ``wrong``: a file whose stamp
    records its machine and that is from another commit, or (a CPU result) from another machine:
    other cores or processor, or a copy bandwidth more than ``COPY_SPREAD`` times apart.
    ``notes``: a file measured before the stamp had the machine (from another commit too, if so),
    on a loaded machine, or with fewer than three rounds."""
    stamps = {name: _stamp(name, load_result(name)) for name in SUMMARY_RESULTS}
    stamped = [n for n, s in stamps.items() if isinstance(s.get("machine"), dict)]
    pool = stamped or list(stamps)
    commit, shared, tie = _most_common([(stamps[n]["commit"], stamps[n]["date"]) for n in pool])
    table = f"the table's commit: {_short(commit)} ({shared} of {len(pool)} files"
    table += f"{' with their machine recorded' if stamped else ''}{', the newest of a tie' if tie else ''})"
    cpu = [n for n in stamped if SUMMARY_RESULTS[n] == "cpu"]
    key, copy = None, None
    if cpu:
        key, _, _ = _most_common([(_machine_key(stamps[n]["machine"]), stamps[n]["date"]) for n in cpu])
        copies = sorted(stamps[n]["machine"]["copy_gb_s"] for n in cpu if _machine_key(stamps[n]["machine"]) == key)
        copy = copies[len(copies) // 2]
        table += f"; its CPU figures' machine: {_machine_desc(*key, copy)}"
    else:
        table += "; its CPU figures' machine: not recorded"
    wrong, notes = [], []
    for name, stamp in stamps.items():
        machine, bad, soft = stamp.get("machine"), [], []
        if stamp["commit"] != commit:
            (bad if name in stamped else soft).append(f"measured on commit {_short(stamp['commit'])}")
        if not isinstance(machine, dict):
            soft.append("machine not recorded")
        else:
            if name in cpu and copy is not None:
                ratio = machine["copy_gb_s"] / copy
                if _machine_key(machine) != key or not 1 / COPY_SPREAD <= ratio <= COPY_SPREAD:
                    bad.append(f"another machine: {_machine_desc(*_machine_key(machine), machine['copy_gb_s'])}")
            if machine.get("loaded"):
                soft.append(f"measured {machine_words(machine)}")
        if (rounds := few_rounds(stamp)) is not None:
            soft.append(rounds)
        if bad:
            wrong.append(f"benchmarks/results/{name}.json: " + "; ".join(bad + soft))
        elif soft:
            notes.append(f"benchmarks/results/{name}.json: " + "; ".join(soft))
    return SummaryReport(table, wrong, notes)


def summary_notes() -> str:
    """:func:`summary_report` as Markdown, for the docs' page under the table: the table's commit
    and machine, and a list of the files that are not of them ("" when none is)."""
    report = summary_report()
    if not report.wrong and not report.notes:
        return ""
    head = f"Not all of one run set (one commit, one machine, three rounds or more): {report.table}."
    return "\n".join([_text(head), "", *(f"- {_text(line)}" for line in report.wrong + report.notes)])


# --- the CLI reference ---------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def commands(
    parser: argparse.ArgumentParser,
    summary: str = "",
) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """``parser`` and every subcommand below it, depth first, each with its one-line help."""
    yield parser, summary
    sub = _subparsers(parser)
    if sub is not None:
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        for name, child in sub.choices.items():
            yield from commands(child, helps.get(name, ""))


def _text(s: str) -> str:
    """Help text as Markdown text in a table cell: nothing in it is markup."""
    s = html.escape(s, quote=False)
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", s)


def _default(action: argparse.Action) -> str:
    if action.required and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE, argparse.REMAINDER):
        return "required"
    default = action.default
    if (
        default is None
        or default is argparse.SUPPRESS
        or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))
    ):
        return ""
    return f"`{default}`"


def _anchor(prog: str) -> str:
    return prog.replace(" ", "-")


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """Every command of ``parser`` (by default ``maitre.cli.build_parser()``) in Markdown: an
    index, then a section per command with its usage and a table of its arguments."""
    if parser is None:
        from maitre.cli import build_parser

        parser = build_parser()
    found = list(commands(parser))
    out = ["| command | what it does |", "|---|---|"]
    out += [f"| [`{p.prog}`](#{_anchor(p.prog)}) | {_text(s)} |" for p, s in found[1:]]
    for p, text in found:
        formatter = argparse.HelpFormatter(p.prog, width=80, max_help_position=40)
        formatter.add_usage(p.usage, p._actions, p._mutually_exclusive_groups)
        level = "#" * min(2 + p.prog.count(" ") - 1, 4) if p is not parser else "##"
        out += ["", f"{level} {p.prog} {{#{_anchor(p.prog)}}}", ""]
        about = " ".join(x for x in (text and text[0].upper() + text[1:] + ".", p.description or "") if x)
        if about:
            out += [_text(about), ""]
        out += ["```text", formatter.format_help().strip(), "```"]
        rows = []
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            invocation = formatter._format_action_invocation(action)
            if action.nargs == argparse.REMAINDER:
                invocation += " ..."
            help_text = formatter._expand_help(action) if action.help else ""
            rows.append(f"| `{invocation}` | {_text(help_text)} | {_default(action)} |")
        sub = _subparsers(p)
        if sub is not None and p is not parser:  # (the index above lists the top level's)
            out += [
                "",
                "Its commands: " + ", ".join(f"[`{c.prog}`](#{_anchor(c.prog)})" for c in sub.choices.values()) + ".",
            ]
        if rows:
            out += ["", "| argument | what it does | default |", "|---|---|---|", *rows]
    return "\n".join(out)


# --- mkdocs events -------------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """Replaces the markers (see the module's docstring); a result that cannot be rendered stops
    the build, naming the page."""
    try:
        if CLI_MARKER in markdown:
            markdown = markdown.replace(CLI_MARKER, cli_reference())
        if SUMMARY_MARKER in markdown:
            notes = summary_notes()
            markdown = markdown.replace(SUMMARY_MARKER, summary() + (f"\n\n{notes}" if notes else ""))
        return RESULTS_MARKER.sub(lambda m: render_results(m[1]), markdown)
    except (DocsError, KeyError, TypeError, ValueError) as exc:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"docs/hooks.py: {page.file.src_uri}: {type(exc).__name__}: {exc}") from exc


def on_page_content(html_text: str, **kwargs: Any) -> str:
    """Docstrings written for Sphinx, as mkdocstrings renders them, read as Sphinx shows them:
    ``:class:`~a.b.C``` (``:class:<code>~a.b.C</code>``) becomes ``<code>C</code>`` (``~``: the
    last name only), and the "::" that introduces a code block a single ":"."""
    html_text = _ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html_text)
    return _LITERAL.sub(r":</p>\1", html_text)
