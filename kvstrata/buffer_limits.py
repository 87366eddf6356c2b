"""``client-output-buffer-limit``: Redis's syntax and semantics, per client class.

``<class> <hard limit> <soft limit> <soft seconds>`` repeated; classes are ``normal``,
``monitor`` (kvstrata: MONITOR clients, which Redis counts as normal), ``replica`` (alias
``slave``) and ``pubsub`` (accepted for compatibility; kvstrata has neither). A client whose
unsent output reaches the hard limit, or stays above the soft limit for more than the soft
seconds, is disconnected. 0 disables a limit. Sizes take kvstrata's units (``32MiB``, ``32mb``
= 32·10⁶, plain bytes). Setting some classes leaves the others as they were (as in Redis).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

CLASSES = ("normal", "monitor", "replica", "pubsub")
_ALIASES = {"slave": "replica"}


@dataclass(frozen=True, slots=True)
class BufferLimit:
    hard: int = 0
    soft: int = 0
    soft_seconds: int = 0


@dataclass(frozen=True, slots=True)
class BufferLimits:
    """One :class:`BufferLimit` per class; ``given`` names the classes a parse set."""

    normal: BufferLimit = BufferLimit()
    monitor: BufferLimit = BufferLimit(32 * 1024**2, 8 * 1024**2, 60)
    replica: BufferLimit = BufferLimit(256 * 1024**2, 64 * 1024**2, 60)
    pubsub: BufferLimit = BufferLimit(32 * 1024**2, 8 * 1024**2, 60)
    given: tuple[str, ...] = CLASSES

    def merged_into(self, old: BufferLimits) -> BufferLimits:
        """``old`` with the classes this value gives replaced."""
        return replace(old, **{c: getattr(self, c) for c in self.given}, given=CLASSES)

    def render(self) -> str:
        return " ".join(
            f"{c} {lim.hard} {lim.soft} {lim.soft_seconds}"
            for c in CLASSES
            for lim in (getattr(self, c),)
        )

    def __str__(self) -> str:
        return self.render()


def parse_buffer_limits(text: object) -> BufferLimits:
    """Parse Redis's syntax; raises ValueError with Redis-like wording."""
    if isinstance(text, BufferLimits):
        return text
    from kvstrata.config import parse_size  # here: config imports this module

    words = str(text).split()
    if not words or len(words) % 4:
        raise ValueError("wrong number of arguments (class hard soft seconds, repeated)")
    out: dict[str, BufferLimit] = {}
    for i in range(0, len(words), 4):
        name = words[i].lower()
        name = _ALIASES.get(name, name)
        if name not in CLASSES:
            raise ValueError(f"invalid client class {words[i]!r} ({', '.join(CLASSES)})")
        try:
            hard, soft = parse_size(words[i + 1]), parse_size(words[i + 2])
            seconds = int(words[i + 3])
        except ValueError as exc:
            raise ValueError(f"invalid limit for class {name}: {exc}") from None
        if seconds < 0:
            raise ValueError(f"invalid soft seconds for class {name}: {seconds}")
        out[name] = BufferLimit(hard, soft, seconds)
    return replace(BufferLimits(), **out, given=tuple(out))
