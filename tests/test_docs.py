"""Generated docs match the code, and the README's test command is what CI runs."""

from __future__ import annotations

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
