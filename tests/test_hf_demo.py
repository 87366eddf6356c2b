"""``kvstrata demo`` end to end with a tiny model: turn 2 reuses turn 1 through the server."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tqdm")

from kvstrata.demo import main


def test_demo_reuses_previous_turns(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--turns", "2", "--layers", "1", "--hidden", "64", "--system-tokens", "64",
            "--user-tokens", "16", "--reply-tokens", "4", "--chunk-tokens", "16",
            "--dram-capacity", "16MiB"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[12] ", line)]
    assert [r[0] for r in rows] == ["1", "2"]
    assert rows[0][1:3] == ["80", "0"]  # prompt 64 + 16, nothing cached yet
    # turn 2: 80 + 4 reply + 16 = 100 tokens; 83 were in the cache -> 5 full chunks
    assert rows[1][1:4] == ["100", "80", "dram:5"]
