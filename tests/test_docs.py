"""The README and the docs site (mkdocs.yml, docs/): the README stays a landing page that starts
with the two set-up commands; every relative link of the README and of the pages reaches a file;
what docs/hooks.py generates covers what it must (every command of the CLI, every public name of
the API, the README's summary of the benchmarks as the results say it); and, where mkdocs is
installed, ``mkdocs build --strict`` passes (``.ci/run`` builds the site too).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
SETUP = [
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[test]' && .venv/bin/maitre demo",
    ".venv/bin/python -m pytest",
]
FENCE = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("maitre_docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code, where a link is no link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


@pytest.mark.timeout(30)
def test_readme_is_a_landing_page_that_starts_with_the_set_up_commands() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/"
    first = FENCE.search(text)
    assert first is not None, "README.md has no code block"
    assert first.group(0).startswith("```bash\n"), "the first code block is not the set-up block"
    assert first.group(0).splitlines()[1:-1] == SETUP
    before = [line for line in text[: first.start()].splitlines() if line.strip()]
    assert before == ["# maitre"], f"README.md has {before} before its set-up commands"
    assert "](#" not in _prose(text), "README.md links to a section it no longer has"
    assert not re.search(r"\bissues? \d", text), "the README's status names issue numbers"


@pytest.mark.timeout(30)
def test_every_relative_link_reaches_a_file() -> None:
    """Links are relative paths, so they work on GitHub as in the site; each must reach a file
    (mkdocs checks the anchors within the site)."""
    missing, seen = [], 0
    for page in _pages():
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # (a URL, or an anchor on the same page)
            seen += 1
            path = target.split("#", 1)[0]
            if path.startswith("/") or not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert seen > 50, f"only {seen} relative links found: is the pattern still right?"
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def _every_command(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += [child, *_every_command(child)]
    return found


@pytest.mark.timeout(60)
def test_the_cli_reference_names_every_command_and_argument() -> None:
    from maitre.cli import build_parser

    reference = _hooks().cli_reference()
    commands = _every_command(build_parser())
    assert "maitre data prepare" in {c.prog for c in commands}
    for command in commands:
        heading = f"\n{'#' * (1 + command.prog.count(' '))} {command.prog} {{#"
        assert heading in reference, f"the CLI reference has no section for {command.prog}"
        section = reference.split(heading, 1)[1].split("\n#", 1)[0]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            if not isinstance(action, argparse._SubParsersAction):
                assert f"`{name}" in section or f", {name}" in section, (command.prog, name)
    page = (DOCS / "reference" / "cli.md").read_text()
    assert _hooks().CLI_MARKER in page


@pytest.mark.timeout(60)
def test_the_api_reference_documents_the_public_api() -> None:
    """Every name of ``maitre.__all__`` and ``maitre.data.__all__``, and the job manifest, has a
    mkdocstrings block at the module that defines it."""
    import maitre
    import maitre.data

    page = (DOCS / "reference" / "api.md").read_text()
    blocks = set(re.findall(r"^::: ([\w.]+)$", page, re.M))
    wanted = {f"{maitre._HOMES[name]}.{name}" for name in maitre.__all__}
    wanted |= {f"{getattr(maitre.data, name).__module__}.{name}" for name in maitre.data.__all__}
    wanted.add("maitre.scheduling.spec.JobManifest")
    assert not wanted - blocks, f"docs/reference/api.md lacks {sorted(wanted - blocks)}"


@pytest.mark.timeout(120)
def test_the_readme_summary_of_the_benchmarks_is_what_the_results_say() -> None:
    """README.md carries the headline figures (the house rule: benchmark tables go in the README);
    they are the table docs/hooks.py renders from benchmarks/results, so a rerun that changes a
    figure fails here until the README has it (paste ``summary()``'s output)."""
    hooks = _hooks()
    table = hooks.summary()
    assert table.count("\n") >= 6
    assert table in README.read_text(), "README.md's benchmark summary is not:\n" + table
    assert hooks.SUMMARY_MARKER in (DOCS / "benchmarks.md").read_text()


@pytest.mark.timeout(120)
def test_the_readme_summary_draws_on_one_run_set() -> None:
    """The files the README's table draws on (``SUMMARY_RESULTS``, and no other) are of one
    commit and, for the CPU figures, one machine: a file whose stamp records its machine and
    that is from another commit or machine fails here, named. Those measured before the stamp
    had the machine, on a loaded machine, or in fewer than three rounds are named in a warning
    (and in the list under the table on the docs' page)."""
    hooks = _hooks()
    drawn: list[str] = []
    load = hooks.load_result
    hooks.load_result = lambda name: drawn.append(name) or load(name)
    try:
        hooks.summary()
    finally:
        hooks.load_result = load
    assert sorted(set(drawn)) == sorted(hooks.SUMMARY_RESULTS)
    report = hooks.summary_report()
    if report.notes:
        warnings.warn(f"README.md's benchmark table ({report.table}): " + " | ".join(report.notes), stacklevel=1)
    assert not report.wrong, f"README.md's benchmark table ({report.table}) draws on:\n" + "\n".join(report.wrong)


def test_a_result_of_another_commit_or_machine_than_the_summary_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hooks = _hooks()
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    commit, date = "a" * 40, "2026-12-08T10:00:00+00:00"
    machine = {
        "cpu": "AMD EPYC",
        "cores": 2,
        "affinity": 2,
        "copy_gb_s": 9.0,
        "copy_mb": 256,
        "load_start": 0.3,
        "load_end": 1.9,
        "run_s": 600.0,
        "run_cpus": 1.8,
        "loaded": False,
    }

    def write(name: str, **stamp: object) -> None:
        measured = {"commit": commit, "date": date, "machine": machine, **stamp}
        (tmp_path / f"{name}.json").write_text(json.dumps({"measured": measured}))

    for name in hooks.SUMMARY_RESULTS:
        write(name)
    write("gpu", machine={**machine, "cpu": "Intel Xeon", "cores": 16, "affinity": 16, "copy_gb_s": 20.0})
    write("simulator", machine={**machine, "copy_gb_s": 2.0})  # (simulated time: no machine's)
    assert hooks.summary_report() == (
        "the table's commit: aaaaaaa (7 of 7 files with their machine recorded); its CPU figures' "
        "machine: 2 cores (AMD EPYC, memory copy 9.00 GB/s)",
        [],
        [],
    )
    assert hooks.summary_notes() == ""
    write("data", commit="b" * 40)
    write("checkpoint", machine={**machine, "copy_gb_s": 4.4})  # (the copy floor 2x apart)
    write("recovery", machine={**machine, "cores": 4, "affinity": 4})
    write("restart", machine={**machine, "loaded": True, "load_start": 2.5}, rounds={"argument": "--reps", "count": 1})
    (tmp_path / "throughput.json").write_text(json.dumps({"measured": {"commit": "c" * 40, "date": date}}))
    table, wrong, notes = hooks.summary_report()
    assert table.startswith("the table's commit: aaaaaaa (5 of 6 files with their machine recorded)"), table
    assert wrong == [
        "benchmarks/results/data.json: measured on commit bbbbbbb",
        "benchmarks/results/recovery.json: another machine: 4 cores (AMD EPYC, memory copy 9.00 GB/s)",
        "benchmarks/results/checkpoint.json: another machine: 2 cores (AMD EPYC, memory copy 4.40 GB/s)",
    ]
    assert notes == [
        "benchmarks/results/throughput.json: measured on commit ccccccc; machine not recorded",
        "benchmarks/results/restart.json: measured on a loaded machine (load 2.50 on 2 cores at the start; "
        "AMD EPYC, memory copy 9.00 GB/s); each headline figure is a single run (--reps 1), not a median of 3 "
        "rounds or more",
    ]
    page = hooks.summary_notes()
    assert "benchmarks/results/data.json: measured on commit bbbbbbb" in page.replace("\\", "")
    assert "throughput.json" in page and "restart.json" in page


@pytest.mark.timeout(120)
def test_a_marker_that_cannot_be_rendered_stops_the_build() -> None:
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    hooks = _hooks()

    class Page:
        class file:  # noqa: N801 (what mkdocs's Page has)
            src_uri = "x.md"

    with pytest.raises(PluginError, match="no benchmarks/results/nothing.json"):
        hooks.on_page_markdown("<!-- results: nothing -->\n", page=Page, config=None, files=None)
    out = hooks.on_page_markdown("a\n<!-- results: scheduler -->\nb\n", page=Page, config=None, files=None)
    assert "<!-- results" not in out and "| pass p50 |" in out and "measured on commit" in out
    html = hooks.on_page_content(
        "a :class:<code>~maitre.data.Loader</code> and :func:<code>maitre.runtime.replica.replica_mesh</code>"
    )
    assert html == "a <code>Loader</code> and <code>maitre.runtime.replica.replica_mesh</code>"
    assert hooks.on_page_content("<p>then iterates::</p>\n<pre><code>x") == "<p>then iterates:</p>\n<pre><code>x"


@pytest.mark.timeout(300)
def test_mkdocs_build_strict_passes(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    built = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    assert {
        "index.html",
        "reference/cli/index.html",
        "reference/api/index.html",
        "benchmarks/index.html",
        "changelog/index.html",
    } <= built
    for page in site.rglob("*.html"):
        text = page.read_text()
        assert "<!-- results" not in text and "<!-- cli-reference" not in text, page
    assert "step-time-against-ddp-and-fsdp2" in (site / "benchmarks" / "index.html").read_text()
    assert "Unreleased" in (site / "changelog" / "index.html").read_text()


SUBJECTS_SINCE = "9512044"
"""The last commit whose subject ran past 72 characters: the rule holds for every one after it."""


@pytest.mark.timeout(30)
def test_commit_subjects_fit_on_a_line() -> None:
    """``git log --oneline`` and a mail's subject show 72 characters: the detail is the body's."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (a source tree without its history)")
    result = subprocess.run(
        ["git", "log", "--format=%h %s", f"{SUBJECTS_SINCE}..HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    if result.returncode != 0:  # (a shallow clone without that commit)
        pytest.skip(f"git log: {result.stderr.strip()}")
    long = [line for line in result.stdout.splitlines() if len(line.split(" ", 1)[1]) > 72]
    assert not long, "commit subjects over 72 characters:\n" + "\n".join(long)
