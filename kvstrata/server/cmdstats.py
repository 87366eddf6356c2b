"""Per-command statistics: INFO commandstats and errorstats (Redis's formats), and the latency
histograms the Prometheus exporter publishes.

The connection calls :meth:`CommandStats.record` once per executed command (a dict look-up
and a few additions; a bisect into the latency buckets only while the metrics endpoint is on),
:meth:`CommandStats.reject` for a command refused before it ran (arity, ``NOAUTH``,
``LOADING``) and :meth:`CommandStats.error` for every error reply, keyed by its first word as
Redis does (``errorstat_ERR:count=3``). ``CONFIG RESETSTAT`` resets them.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

#: upper bounds (seconds) of the latency histogram buckets; the last bucket is +Inf
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class CommandStat:
    """Calls, time and failures of one command (``name`` in Redis's lower-case form)."""

    __slots__ = ("buckets", "calls", "failed", "name", "rejected", "seconds")

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.seconds = 0.0
        self.rejected = 0
        self.failed = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)

    def info(self) -> str:
        usec = int(self.seconds * 1e6)
        per_call = usec / self.calls if self.calls else 0.0
        return (
            f"calls={self.calls},usec={usec},usec_per_call={per_call:.2f},"
            f"rejected_calls={self.rejected},failed_calls={self.failed}"
        )


class CommandStats:
    """See the module docstring."""

    def __init__(self) -> None:
        self.commands: dict[str, CommandStat] = {}
        self.errors: dict[str, int] = {}
        #: fill the latency buckets too (only the metrics endpoint reads them)
        self.histograms = False

    def _stat(self, name: str) -> CommandStat:
        stat = self.commands.get(name)
        if stat is None:
            stat = self.commands[name] = CommandStat(name.lower())
        return stat

    def record(self, name: str, seconds: float, failed: bool) -> None:
        """One executed command (``name`` as in the registry: ``GET``, ``CONFIG|GET``)."""
        stat = self.commands.get(name)
        if stat is None:
            stat = self._stat(name)
        stat.calls += 1
        stat.seconds += seconds
        if failed:
            stat.failed += 1
        if self.histograms:
            stat.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def reject(self, name: str) -> None:
        self._stat(name).rejected += 1

    def reject_args(self, registry: Any, args: list[Any]) -> None:
        """Count a known command (or subcommand) refused before it ran; unknown names only
        reach errorstats, as in Redis."""
        spec = registry.lookup(args[0]) if args else None
        if spec is None:
            return
        if spec.subcommands and len(args) >= 2:
            spec = spec.subcommands.get(bytes(args[1]).upper().decode("utf-8", "replace"), spec)
        self.reject(spec.name)

    def error(self, prefix: str) -> None:
        self.errors[prefix] = self.errors.get(prefix, 0) + 1

    def reset(self) -> None:
        self.commands.clear()
        self.errors.clear()

    def info_commandstats(self) -> list[tuple[str, object]]:
        return [(f"cmdstat_{s.name}", s.info()) for s in self.commands.values()
                if s.calls or s.rejected]  # fmt: skip

    def info_errorstats(self) -> list[tuple[str, object]]:
        return [(f"errorstat_{prefix}", f"count={n}") for prefix, n in self.errors.items()]
