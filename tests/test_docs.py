"""Generated docs match the code, and the README's test command is what CI runs."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

from kvstrata.config import render_markdown as config_markdown
from kvstrata.server.registry import load_all, render_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_commands_md_is_current() -> None:
    expected = render_markdown(load_all())
    assert (ROOT / "docs/commands.md").read_text() == expected, (
        "docs/commands.md is stale: python -m kvstrata.server.registry > docs/commands.md"
    )


def test_configuration_md_is_current() -> None:
    assert (ROOT / "docs/configuration.md").read_text() == config_markdown(), (
        "docs/configuration.md is stale: python -m kvstrata.config > docs/configuration.md"
    )


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    assert "./scripts/test.sh" in readme and "./scripts/test.sh" in ci


def test_every_command_is_documented() -> None:
    table = load_all()
    for spec in table:
        specs = list(spec.subcommands.values()) if spec.subcommands else [spec]
        for s in specs:
            assert s.summary, f"{s.name} has no summary"
            assert s.group, f"{s.name} has no group"


def _methods(module: str, cls: str) -> dict[str, ast.AST]:
    tree = ast.parse((ROOT / module).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {f.name: f for f in body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}


def _attr_calls(node: ast.AST) -> set[str]:
    """``a.b.name(…)`` → ``b.name`` (``self.writes.put`` → ``writes.put``), ``x.name`` → name."""
    out = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            owner = call.func.value
            prefix = f"{owner.attr}." if isinstance(owner, ast.Attribute) else ""
            out.add(prefix + call.func.attr)
    return out


def _source(handler: Callable[..., object]) -> str:
    """The handler's source and that of the functions of its module it calls (``_put_slow``),
    transitively."""
    module = sys.modules[handler.__module__]
    seen: dict[str, str] = {}
    todo = [handler]
    while todo:
        fn = todo.pop()
        if fn.__name__ in seen:
            continue
        seen[fn.__name__] = text = inspect.getsource(fn)
        for name in re.findall(r"\b(\w+)\(", text):
            helper = getattr(module, name, None)
            if inspect.isfunction(helper) and helper.__module__ == module.__name__:
                todo.append(helper)
    return "\n".join(seen.values())


def test_commands_that_can_answer_busy_document_it() -> None:
    """The write path's methods that raise BusyError (or wait on another writer of the key,
    which ends in BusyError), the KVStore methods that call them, and the command handlers
    that call those: each such command's reply docs mention -BUSY. Found from the source, so
    a new caller is not left out; one level deep on each side (a command that reaches the
    write path through another module, as SET's large values do, is not followed)."""
    raising = {
        name
        for name, fn in _methods("kvstrata/store/kvstore/write.py", "WritePath").items()
        if "wait_key" in _attr_calls(fn)
        or any(isinstance(n, ast.Raise) and "BusyError" in ast.unparse(n) for n in ast.walk(fn))
    }
    facade = {
        name
        for name, fn in _methods("kvstrata/store/kvstore/__init__.py", "KVStore").items()
        if {f"writes.{m}" for m in raising} & _attr_calls(fn)
    }
    callers = {}
    for spec in load_all():
        for s in list(spec.subcommands.values()) if spec.subcommands else [spec]:
            if s.handler is not None:
                called = set(re.findall(r"\bstore(?:_of\(ctx\))?\.(\w+)\(", _source(s.handler)))
                if called & facade:
                    callers[s.name] = s.reply
    assert {"put", "reserve"} <= facade and {"KV.PUT", "KV.RESERVE"} <= set(callers)
    assert [name for name, reply in callers.items() if "-BUSY" not in reply] == []
