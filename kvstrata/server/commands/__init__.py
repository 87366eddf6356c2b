"""One module per command family; importing a module registers its commands."""

from __future__ import annotations

import importlib
import pkgutil


def load() -> None:
    """Import every command module in this package (idempotent)."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{info.name}")
