"""``python -m kvstrata.config > docs/configuration.md``."""

from kvstrata.config.render import render_markdown

print(render_markdown(), end="")
