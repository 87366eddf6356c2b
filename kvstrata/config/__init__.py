"""One typed configuration from a TOML file, ``KVSTRATA_*`` environment variables and flags.

Precedence: command-line flags > environment > TOML file > defaults. Every key has a Redis-style
dashed name (``dram-capacity``) used by ``CONFIG GET/SET``, TOML (dashes or underscores), the
flag (``--dram-capacity``) and the environment (``KVSTRATA_DRAM_CAPACITY``). A bad value raises
:class:`ConfigError` naming the key and what is wrong. ``docs/configuration.md`` is generated
from :data:`OPTIONS` (``python -m kvstrata.config``).

The package: ``values`` (what a value can be: the parsers, sizes, metavars), ``table`` (every
key: :data:`OPTIONS`), ``load`` (:class:`Config`, :func:`load_config`: the layers and the rules
across keys) and ``render`` (the groups of ``serve --help`` and docs/configuration.md). Import
from ``kvstrata.config``; the names below are its interface.
"""

from __future__ import annotations

from dataclasses import fields

from kvstrata.config.load import FLOOR_BYTES_PER_TOKEN, Config, dram_floor, load_config
from kvstrata.config.render import GROUPS, grouped_options, groups_of, metavar, render_markdown
from kvstrata.config.table import OPTIONS, Option, option, option_names
from kvstrata.config.values import (
    LOG_LEVELS,
    METAVARS,
    ConfigError,
    Share,
    apply_loglevel,
    format_size,
    parse_size,
    share_or_size,
)

__all__ = [
    "FLOOR_BYTES_PER_TOKEN",
    "GROUPS",
    "LOG_LEVELS",
    "METAVARS",
    "OPTIONS",
    "Config",
    "ConfigError",
    "Option",
    "Share",
    "apply_loglevel",
    "dram_floor",
    "fields",
    "format_size",
    "grouped_options",
    "groups_of",
    "load_config",
    "metavar",
    "option",
    "option_names",
    "parse_size",
    "render_markdown",
    "share_or_size",
]
