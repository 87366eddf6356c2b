"""The arrows of docs/architecture.md, read from the source: ``server → store → tiers``.

A tier never imports the store or the server (house rule 6), and the chunk types both layers
share live below them in ``kvstrata/chunks.py``, which imports neither. Every import statement
counts, including those under ``TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvstrata"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    return _imports_in(path.read_text(), _module_name(path), path.name == "__init__.py")


def _imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module a source names in an import statement, relative imports resolved."""
    package = module.split(".")
    if not is_package:
        package.pop()
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _offenders(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in paths:
        bad = sorted(
            m for m in _imports(path) if any(m == f or m.startswith(f + ".") for f in forbidden)
        )
        if bad:
            out[str(path.relative_to(ROOT))] = bad
    return out


def test_tiers_import_nothing_from_the_store_or_the_server() -> None:
    tiers = sorted((PKG / "tiers").glob("*.py"))
    assert len(tiers) > 10
    assert _offenders(tiers, ("kvstrata.store", "kvstrata.server")) == {}
    # The check reads real imports: the tiers do name the shared chunk types.
    assert any("kvstrata.chunks" in _imports(p) for p in tiers)


def test_chunk_types_sit_below_the_store_and_the_tiers() -> None:
    forbidden = ("kvstrata.store", "kvstrata.tiers", "kvstrata.server", "kvstrata.clients")
    assert _offenders([PKG / "chunks.py"], forbidden) == {}


def test_the_reader_resolves_relative_and_lazy_imports() -> None:
    source = (
        "from ..store.keys import ChunkKey\n"
        "from . import base\n"
        "def f():\n"
        "    import kvstrata.server.app\n"
    )
    found = _imports_in(source, "kvstrata.tiers.x")
    assert {"kvstrata.store.keys", "kvstrata.tiers.base", "kvstrata.server.app"} <= found
