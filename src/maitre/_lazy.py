"""Names a package exports without importing them until first use (PEP 562).

``maitre`` and ``maitre.checkpoint`` export training-side names (torch underneath) from modules
that the CLI, the scheduling policy and the simulator never need; a package binds its
``__getattr__`` and ``__dir__`` to :func:`lazy_exports` so that importing it costs nothing.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names live in the modules
    ``homes`` gives (name -> module)."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        vars(sys.modules[package])[name] = value  # the next lookup is an ordinary one
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
