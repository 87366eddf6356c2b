"""Run one benchmark against two checkouts of kvstrata, alternating, and print both in one table.

    python bench/before_after.py --before /path/to/old/checkout [--rounds 3] bench_kv.py [ARGS...]

The benchmark script is taken from ``--before`` (so that both runs print the same table) and runs
``--rounds`` times per side, alternating before/after, with ``PYTHONPATH`` set to the checkout
under test; a server it starts (``python -m kvstrata serve``) inherits it. ``--after`` defaults to
this checkout. The output is the benchmark's own table with every number replaced by
``before→after`` (each the median over the rounds of that position in the output; a number
equal in both, such as a size, is printed once). Lines whose shape differs between runs are
printed as they came from the last after-run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def shape(line: str) -> str:
    """The line without its numbers and with runs of spaces as one (widths vary with values)."""
    return " ".join(NUMBER.sub("#", line).split())


def run(script: Path, args: list[str], checkout: Path) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        sys.exit(f"{script.name} failed with {checkout}:\n{out.stdout}{out.stderr}")
    return out.stdout.splitlines()


def medians(runs: list[list[str]]) -> tuple[list[str], list[list[float] | None]]:
    """The last run's lines, and per line the median of each number (None: shapes differ)."""
    lines = runs[-1]
    result: list[list[float] | None] = []
    for i, line in enumerate(lines):
        rows = [r[i] for r in runs if i < len(r) and shape(r[i]) == shape(line)]
        if len(rows) != len(runs):
            result.append(None)
            continue
        cols = zip(*(map(float, NUMBER.findall(r)) for r in rows), strict=True)
        result.append([statistics.median(c) for c in cols])
    return lines, result


def fmt(value: float) -> str:
    return f"{value:.0f}" if value == int(value) and abs(value) >= 100 else f"{value:.3g}"


def pair(before: float, after: float) -> str:
    return fmt(after) if before == after else f"{fmt(before)}→{fmt(after)}"


def substitute(line: str, values: Iterator[tuple[float, float]]) -> str:
    return NUMBER.sub(lambda _m: pair(*next(values)), line)


def merge(
    before: list[str],
    b_nums: list[list[float] | None],
    after: list[str],
    a_nums: list[list[float] | None],
) -> list[str]:
    out = []
    for i, line in enumerate(after):
        b = b_nums[i] if i < len(before) else None
        a = a_nums[i]
        if not a or b is None or shape(before[i]) != shape(line):
            out.append(line)
            continue
        out.append(substitute(line, iter(zip(b, a, strict=True))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the old checkout")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("bench", help="a script in bench/ of --before, e.g. bench_kv.py")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    a = ap.parse_args()
    script = (a.before / "bench" / a.bench).resolve()
    if not script.is_file():
        sys.exit(f"no benchmark {a.bench} in {a.before}/bench")
    before: list[list[str]] = []
    after: list[list[str]] = []
    for _ in range(a.rounds):
        before.append(run(script, a.args, a.before.resolve()))
        after.append(run(script, a.args, a.after.resolve()))
    b_lines, b_nums = medians(before)
    a_lines, a_nums = medians(after)
    print(f"# {a.bench} {' '.join(a.args)}: before ({a.before}) → after ({a.after}), "
          f"medians of {a.rounds} alternated runs")  # fmt: skip
    print("\n".join(merge(b_lines, b_nums, a_lines, a_nums)))


if __name__ == "__main__":
    main()
