"""``kvstrata serve --help`` and the config table: groups, metavars, the DRAM floor and
unknown flags.

Every metavar is checked against what the key's parser accepts (a SIZE key takes ``4KiB``, a
count does not; a duration's unit is the one its description names), every key is in exactly
one group, and the help, grouped as redis.conf, comes from the same table.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.cli import main, unknown_option_message
from kvstrata.config import (
    GROUPS,
    OPTIONS,
    ConfigError,
    Option,
    grouped_options,
    groups_of,
    load_config,
    metavar,
)

_UNIT_WORDS = {"MS": r"\bms\b", "SECONDS": r"\bseconds?\b", "MICROS": r"\bmicroseconds\b"}


def _accepts(opt: Option, raw: str) -> bool:
    try:
        opt.parse(raw)
    except (ValueError, TypeError):
        return False
    return True


def _check_metavar(opt: Option) -> None:
    shown = metavar(opt)
    if shown.startswith("{"):
        choices = shown[1:-1].split(",")
        assert all(opt.parse(c) == c for c in choices)
        assert not _accepts(opt, "not-a-choice")
        return
    if "SIZE" in shown:
        assert opt.parse("4KiB") == 4096 and opt.parse("3") == 3
        return
    assert not _accepts(opt, "4KiB") or shown in ("TEXT", "PATH", "KEY", "LIMITS"), shown
    if shown in ("N", "PORT", *_UNIT_WORDS):
        assert opt.parse("5") == 5 and not _accepts(opt, "five")
        assert not re.search(r"\b(ms|seconds?|microseconds)\b", opt.doc) or shown != "N"
    if shown in _UNIT_WORDS:
        assert re.search(_UNIT_WORDS[shown], opt.doc, re.IGNORECASE), (opt.name, opt.doc)
    if shown == "PORT":
        assert opt.name.endswith("port") and _accepts(opt, "0") and not _accepts(opt, "65536")
    if shown == "yes|no":
        assert opt.parse("yes") is True and opt.parse("no") is False
    if shown == "RATIO":
        assert opt.parse("0.5") == 0.5 and not _accepts(opt, "2") and not _accepts(opt, "0")
    if shown == "PATH":
        assert re.search(r"(file|dir|path)$", opt.name), opt.name


@pytest.mark.parametrize("opt", OPTIONS, ids=[o.name for o in OPTIONS])
def test_every_metavar_matches_its_keys_type(opt: Option) -> None:
    _check_metavar(opt)
    # a key that ends like a duration shows its unit, never a bare N
    if re.search(r"-(timeout|ttl|ttl-max|slower-than)$", opt.name):
        assert metavar(opt) in _UNIT_WORDS, opt.name
    # the default goes through the parser as --help prints it
    printed = opt.fmt(opt.default)
    assert opt.parse(printed) == opt.default or printed in ("", "(redacted)"), opt.name


def test_the_metavars_the_issue_named() -> None:
    by_name = {o.name: o for o in OPTIONS}
    assert metavar(by_name["write-wait-timeout"]) == "MS"
    assert metavar(by_name["nvme-slab-max"]) == "SIZE"
    assert metavar(by_name["timeout"]) == "SECONDS"
    assert metavar(by_name["slowlog-log-slower-than"]) == "MICROS"


def test_every_key_is_in_exactly_one_group() -> None:
    for opt in OPTIONS:
        assert len(groups_of(opt.name)) == 1, (opt.name, groups_of(opt.name))
    listed = [o.name for _, options in grouped_options() for o in options]
    assert sorted(listed) == sorted(o.name for o in OPTIONS)
    titles = [t for t, _ in grouped_options()]
    assert "other" not in titles and titles == [t for t, _ in GROUPS]
    assert all(options for _, options in grouped_options()), "an empty group"


def test_help_is_grouped_from_the_table() -> None:
    text = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--help"], capture_output=True, text=True,
        timeout=60,
    ).stdout  # fmt: skip
    flat = " ".join(text.split())
    positions = []
    for title, options in grouped_options():
        heading = f"\n{title}:\n"
        assert heading in text, title
        start = text.index(heading)
        positions.append(start)
        for opt in options:
            flag = f"--{opt.name} {metavar(opt)}"
            assert flag in flat, flag
            assert text.index(f"  --{opt.name} ", start) > start
    assert positions == sorted(positions)
    assert "--write-wait-timeout MS" in flat and "--nvme-slab-max SIZE" in flat
    assert len(text.splitlines()[0]) < 100  # the usage line is one line, not 50


@pytest.mark.parametrize(
    ("raw", "hint"),
    [("12", "write 12GiB for 12 GiB"), ("512KiB", "smallest arena, 1MiB"), ("0", "1MiB")],
)
def test_an_arena_below_one_chunk_is_refused(raw: str, hint: str) -> None:
    with pytest.raises(ConfigError, match="dram-capacity") as caught:
        load_config(flags={"dram-capacity": raw}, env={})
    assert hint in str(caught.value)
    assert load_config(flags={"dram-capacity": "1MiB"}, env={}).dram_capacity == 1024**2
    with pytest.raises(ConfigError, match="4MiB"):  # the floor follows min-chunk-tokens
        load_config(flags={"dram-capacity": "2MiB", "min-chunk-tokens": "64"}, env={})


def test_dram_capacity_12_stops_the_cli_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--dram-capacity", "12", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "12 bytes is below the smallest arena" in err


def test_unknown_flag_suggests_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--dram-capcity", "4GiB"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvstrata serve")
    assert "unknown option --dram-capcity (did you mean --dram-capacity?)" in err
    assert unknown_option_message(["--write-wait-timout=5"]).endswith(
        "(did you mean --write-wait-timeout?)"
    )
    assert "see kvstrata serve --help" in unknown_option_message(["--zzzzzz"])
    assert "unexpected argument '4GiB'" in unknown_option_message(["4GiB"])


def test_an_unknown_key_in_the_toml_file_gets_the_closest(tmp_path: Path) -> None:
    config = tmp_path / "kvstrata.toml"
    config.write_text('dram-capcity = "4GiB"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'dram-capcity' in .*kvstrata.toml "
                       r"\(did you mean 'dram-capacity'\?\)"):  # fmt: skip
        load_config(config_file=config, env={})
