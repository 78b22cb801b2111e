"""Headless Chromium for the dashboard's tests: Debian's ``chromium`` (``.ci/run`` installs it),
driven by Playwright's Python client pointed at that binary (no browser is downloaded).

Without the binary the browser tests are skipped on a developer's machine, and fail under CI
(``CI`` set), where a skipped browser test would hide a missing dependency.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

CHROMIUM = os.environ.get("MAITRE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
"""Without the background-networking flags Chromium keeps trying hosts this machine cannot
reach; ``--no-sandbox``: CI runs as root."""


def need_chromium() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("playwright is not installed (pip install -e '.[test]')")
        pytest.skip("playwright is not installed")
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs Debian's package")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    return CHROMIUM


class Page:
    """A page and everything it said on its console that was an error."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def open(self, url: str, timeout_s: float = 30) -> None:
        self.page.goto(url)
        self.ready(timeout_s)

    def ready(self, timeout_s: float = 30) -> None:
        self.page.wait_for_function("window.__maitre && window.__maitre.ready", timeout=timeout_s * 1000)

    def view(self, name: str) -> None:
        """Go to a view (``scaling``, ``job/a-lm``...) of the page already open."""
        self.page.evaluate(f"location.hash = {('#/' + name)!r}")
        self.page.wait_for_function("window.__maitre.renderedAt > 0")

    def js(self, expression: str) -> Any:
        return self.page.evaluate(expression)

    def page_errors(self) -> list[str]:
        return self.errors + self.js("window.__maitre ? window.__maitre.errors : []")


@contextmanager
def browser() -> Iterator[Any]:
    binary = need_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=binary, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def browser_if_any() -> Iterator[Any]:
    """:func:`browser`, or None where there is none and this is not CI (a test that is about
    more than the page runs on without it)."""
    try:
        need_chromium()
    except pytest.skip.Exception:
        yield None
        return
    with browser() as b:
        yield b


def new_page(b: Any, width: int = 1300, height: int = 900) -> Page:
    return Page(b.new_page(viewport={"width": width, "height": height}))


@contextmanager
def replay_page(tmp_path: Any, events: list[dict[str, Any]], token: str) -> Iterator[Page]:
    """A page signed in to a replay (``maitre dashboard``) of ``events``, numbered in order
    (``seq`` from 1, ``t`` the index in seconds, ``job`` null unless given)."""
    import json

    from maitre.dashboard.server import ReplayServer

    path = tmp_path / "events.jsonl"
    path.write_text(
        "".join(json.dumps({"seq": k + 1, "t": float(k), "job": None, **e}) + "\n" for k, e in enumerate(events))
    )
    with ReplayServer(path, token) as srv, browser() as b:
        page = new_page(b)
        page.open(f"{srv.url}?token={token}")
        yield page
