"""What a configuration value can be: sizes, numbers in a range, choices, addresses, shares of
the DRAM arena, and the metavar ``serve --help`` shows for each parser. Every parser takes what
a flag, an environment variable or a TOML file gives and returns the typed value or raises
``ValueError``; :mod:`kvstrata.config.load` names the key in the :class:`ConfigError`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.buffer_limits import parse_buffer_limits

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}  # fmt: skip


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


_SIZE_HINT = 'write a size such as 0, 65536, "512MiB" or "4GiB"'


def _refuse_bool(value: object, what: str, hint: str) -> None:
    """TOML's ``true``/``false`` are ints to Python (``int(True) == 1``): without this a
    ``nvme-capacity = true`` ran with a 1-byte tier. No size, count or duration is a boolean."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not {what}: {hint}")


def parse_size(text: str | int) -> int:
    """``4GiB`` → 4294967296; ``512mb`` → 512000000 (Redis: mb is 1024², we follow SI/IEC)."""
    _refuse_bool(text, "a size", _SIZE_HINT)
    if isinstance(text, int):
        if text < 0:
            raise ValueError("must not be negative")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 0, 65536, 512MiB, 4GiB)")
    number, unit = m.group(1), (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown unit in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB)")
    return int(float(number) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _yes_no(value: Any) -> str:
    return "yes" if value else "no"


#: what ``serve --help`` shows for the values of each parser (``_choice`` lists its choices);
#: the factories below add their closures with the unit they were given
METAVARS: dict[Callable[[Any], Any], str] = {}


def _typed(parse: Callable[[Any], Any], metavar: str) -> Any:
    """Record ``parse``'s metavar (SIZE, MS, SECONDS…) and return it."""
    METAVARS[parse] = metavar
    return parse


def _float(lo: float, hi: float, unit: str = "NUMBER") -> Callable[[Any], float]:
    def parse(text: Any) -> float:
        _refuse_bool(text, "a number", f"write a number from {lo} to {hi}")
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise ValueError(f"{text!r} is not a number") from None
        if not lo <= value <= hi:  # also refuses nan
            raise ValueError(f"{value} is out of range [{lo}, {hi}]")
        return value

    return _typed(parse, unit)


LOG_LEVELS = {"debug": 10, "verbose": 20, "notice": 20, "warning": 30}


def apply_loglevel(level: str) -> None:
    """Make a (new) loglevel take effect on kvstrata's loggers."""
    import logging

    logging.getLogger("kvstrata").setLevel(LOG_LEVELS[level])


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("yes", "true", "on", "1"):
        return True
    if low in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"{text!r} is not a boolean (yes/no)")


def _int(lo: int, hi: int, unit: str = "N") -> Callable[[Any], int]:
    """Integers in ``[lo, hi]``; ``unit`` (N, MS, SECONDS, MICROS, PORT) is the metavar."""

    def parse(text: Any) -> int:
        _refuse_bool(text, "an integer", f"write an integer from {lo} to {hi}")
        if isinstance(text, float) and not text.is_integer():  # TOML 2.5, inf, nan
            raise ValueError(f"{text!r} is not an integer (write one from {lo} to {hi})")
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise ValueError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise ValueError(f"{value} is out of range [{lo}, {hi}]")
        return value

    return _typed(parse, unit)


def _ratio(text: Any) -> float:
    _refuse_bool(text, "a ratio", "write a number above 0 and at most 1, such as 0.9")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{value} must be in (0, 1]")
    return value


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    parse.choices = choices  # type: ignore[attr-defined]  # shown by --help
    return parse


def _str(text: Any) -> str:
    _refuse_bool(text, "text", 'write it in quotes ("...")')
    return str(text)


def _path(text: Any) -> str:
    """A file or folder name (shown as PATH by ``--help``)."""
    return _str(text)


def _auth_key(text: Any) -> str:
    key = str(text)
    if key and len(key) < 16:
        raise ValueError("must be empty or at least 16 characters")  # never echo the key
    return key


def _redacted(value: Any) -> str:
    return "(redacted)" if value else ""


def _bind(text: Any) -> str:
    parts = str(text).split()
    if not parts:
        raise ValueError("needs at least one address")
    for part in parts:
        host = part.lstrip("-")
        if host in ("localhost", "*"):
            continue
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(f"{part!r} is not an IP address") from None
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Share:
    """A bound given as a percentage of the DRAM arena (``50%``) instead of a size."""

    percent: float

    def of(self, capacity: int) -> int:
        return int(capacity * self.percent / 100)

    def __str__(self) -> str:
        return f"{self.percent:g}%"


def share_or_size(value: Any, capacity: int) -> int:
    """The bytes a :func:`_share_or_size` value stands for in an arena of ``capacity``."""
    return value.of(capacity) if isinstance(value, Share) else int(value)


def _share_or_size(text: Any) -> Share | int:
    """``50%`` (of the DRAM arena) or a size."""
    if isinstance(text, Share):
        return text
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size or a percentage")
    raw = str(text).strip()
    if raw.endswith("%"):
        try:
            percent = float(raw[:-1])
        except ValueError:
            raise ValueError(f"{text!r} is not a percentage") from None
        if not 0 < percent <= 100:  # also refuses nan
            raise ValueError(f"{text!r} must be above 0% and at most 100%")
        return Share(percent)
    return parse_size(text)


def _format_share_or_size(value: Any) -> str:
    return str(value) if isinstance(value, Share) else format_size(value)


def _size_at_most(limit: int) -> Callable[[Any], int]:
    def parse(text: Any) -> int:
        n = parse_size(text)
        if n > limit:
            raise ValueError(f"must be at most {format_size(limit)}")
        return n

    return _typed(parse, "SIZE")


#: the metavars of the plain parsers (the factories above record theirs)
METAVARS.update({
    parse_size: "SIZE", _bool: "yes|no", _ratio: "RATIO", _bind: "ADDR", _path: "PATH",
    _str: "TEXT", _auth_key: "KEY", _share_or_size: "SIZE|PERCENT",
    parse_buffer_limits: "LIMITS",
})  # fmt: skip
