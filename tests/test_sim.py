"""The capacity planner: shared policy, the seeds' worked examples, traces, workloads, CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.cli import main as cli_main
from kvstrata.config import OPTIONS
from kvstrata.sim.economics import MODELS, hardware, load_seconds, model_from_config
from kvstrata.sim.engine import Simulator
from kvstrata.sim.replay import DEFAULTS
from kvstrata.sim.vtiers import TierSpec
from kvstrata.sim.workload import Workload, generate, load_workload
from kvstrata.store.index import ChunkRecord
from kvstrata.store.policy import tier_policy
from kvstrata.tracefile import Event, read_trace, write_trace

KIB = 1024
NS = "m"


def _sim(**sizes: int) -> Simulator:
    specs = [
        TierSpec(name, size, 64e9, 1e-5, tier_policy(DEFAULTS, name))
        for name, size in sizes.items()
    ]
    return Simulator(specs)


def _chain(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def _put_chain(sim: Simulator, hashes: list[bytes], size: int) -> None:
    for i, h in enumerate(hashes):
        sim.tick(0)
        sim.put(NS, h, hashes[i - 1] if i else b"", size, 256)


def _tiers(sim: Simulator, h: bytes) -> set[str]:
    rec = sim.index.get(ChunkKey(NS, h))
    return set() if rec is None else set(rec.tiers)


def test_user_a_demoted_to_dram_by_user_b_then_promoted_on_follow_up() -> None:
    """The seeds' HierarchicalKVManager scenario: the GPU pool holds one user's prefix. User A
    leases it into the GPU; user B's prefix pushes A's chunks down to DRAM (demotions, not
    evictions: DRAM keeps them); A's follow-up finds them in DRAM and promotes them back."""
    sim = _sim(gpu=4 * 64 * KIB, dram=64 * 64 * KIB)
    gpu = sim.by_name["gpu"].counters
    a, b = _chain("a", 3), _chain("b", 3)
    _put_chain(sim, a, 64 * KIB)
    sim.tick(1)
    assert sim.lease(NS, a) == 3
    assert all(_tiers(sim, h) == {"gpu", "dram"} for h in a)
    _put_chain(sim, b, 64 * KIB)
    sim.tick(2)
    assert sim.lease(NS, b) == 3
    assert all(_tiers(sim, h) == {"dram"} for h in a)  # A went down to DRAM, not away
    assert all("gpu" in _tiers(sim, h) for h in b)
    assert gpu.demotions == 3 and gpu.evictions == 0 and gpu.promotions == 6
    sim.tick(30)  # the seeds' 30-second pause, then A's follow-up
    assert sim.match(NS, a) == 3
    assert [t for t, _, _ in sim.requests[-1].found] == ["dram"] * 3
    assert sim.lease(NS, a) == 3
    assert all("gpu" in _tiers(sim, h) for h in a)  # promoted back on the follow-up
    assert gpu.promotions == 9 and gpu.demotions == 6


def test_victims_are_lru_leaves_and_go_down_a_tier() -> None:
    """DRAM holds 8 chunks (demoted above 95 % down to 85 %): a 6-chunk chain then a 4-chunk
    one. Each victim has no child in DRAM when it is chosen (the first chain, complete before
    any eviction, keeps a prefix); victims are written back to NVMe (demotions)."""
    sim = _sim(dram=8 * 16 * KIB, nvme=64 * 20 * KIB)
    first, second = _chain("x", 6), _chain("y", 4)
    leaves: list[bool] = []
    move_down = sim.move_down

    def watched(rec: ChunkRecord, i: int) -> bool:
        leaves.append(rec.is_leaf_in("dram"))
        return move_down(rec, i)

    sim.move_down = watched  # type: ignore[method-assign]
    _put_chain(sim, first, 16 * KIB)
    _put_chain(sim, second, 16 * KIB)
    assert leaves and all(leaves)
    in_dram = [h for h in first if "dram" in _tiers(sim, h)]
    assert in_dram == first[: len(in_dram)] and len(in_dram) < 6
    kept = sum("dram" in _tiers(sim, h) for h in first + second)
    assert kept == 6  # 85 % of 8
    assert all(_tiers(sim, h) == {"nvme"} for h in first + second if "dram" not in _tiers(sim, h))
    dram = sim.by_name["dram"].counters
    assert dram.demotions == 10 - kept and dram.evictions == 0
    # a cold hit is promoted back into DRAM and counted per tier like the read path does
    sim.tick(9)
    assert sim.get(NS, first[-1]) == "nvme"
    assert dram.misses == 1 and sim.by_name["nvme"].counters.hits == 1
    assert dram.promotions == 1 and "dram" in _tiers(sim, first[-1])


def test_seeds_worked_example_70b_32k_prompt() -> None:
    """32k-token prompt, Llama-3-70B: ~4,500 TFLOPs of prefill (2 x 70e9 x 32768 = 4,588;
    4,627 with the exact 70.6e9 parameters); 1 GB over PCIe Gen5 (64 GB/s) is 15.6 ms. The
    8-bit KV of 32k tokens is 5.37 GB, not the seeds' ~1 GB (80 layers x 8 KV heads x 128 x
    2 x 32768 x 1 B): 1 GB is ~6,100 tokens of this model."""
    m = MODELS["llama-3-70b"]
    tokens = 32_768
    assert m.prefill_flops(tokens) / 1e12 == pytest.approx(4_600, rel=0.02)
    assert 2 * 70e9 * tokens / 1e12 == pytest.approx(4_500, rel=0.02)
    fp8 = type(m)(m.name, m.params, m.layers, m.kv_heads, m.head_dim, 1.0)
    assert fp8.kv_size(tokens) == 2 * 80 * 8 * 128 * tokens
    assert fp8.kv_size(tokens) / 1e9 == pytest.approx(5.37, rel=0.01)
    pcie = hardware().links["dram"]
    assert load_seconds(1e9, pcie) * 1e3 == pytest.approx(15.6, abs=0.1)


def test_model_from_transformers_config(tmp_path: Path) -> None:
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = model_from_config(path)
    assert m.params == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B's shapes
    assert m.kv_size(1) == 2 * 32 * 8 * 128 * 2


def test_trace_round_trip_and_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [
        Event(0.0, "put", NS, (b"\x01",), b"", 4096, 256),
        Event(0.1, "match", NS, (b"\x01", b"\x02"), tokens=512),
        Event(0.2, "get", NS, (b"\x01",)),
        Event(0.21, "get", NS, (b"\x01",), tier="nvme"),
        Event(0.22, "get", NS, (b"\x02",), tier=""),
        Event(0.23, "fetch", NS, (b"\x01",), to="dram"),
        Event(0.3, "session", NS, (b"\x01",), session=b"u1"),
        Event(0.4, "prefetch", NS, (), session=b"u1"),
        Event(0.5, "lease", NS, (b"\x01",), to="dram"),
    ]
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        write_trace(events, f)
    assert list(read_trace(path)) == events
    with open(path, "a") as f:
        f.write('{"op": "put", "ns": "m", "hash": "zz"}\n')
    rc = cli_main(["simulate", "--trace", str(path), "--dram", "1MiB", "--nvme", "4MiB"])
    err = capsys.readouterr().err
    assert rc == 2 and "t.jsonl:10" in err and "Traceback" not in err


def test_workload_is_deterministic_and_shares_prefixes(tmp_path: Path) -> None:
    wl = Workload(duration=20, sessions_per_second=1, chunk_tokens=64)
    one, two = list(generate(wl)), list(generate(wl))
    assert one == two and len(one) > 10
    roots = {item.hashes[0] for item in one if hasattr(item, "hashes") and item.hashes}
    assert len(roots) <= wl.system_prompts  # the system prompts are shared prefixes
    toml = tmp_path / "w.toml"
    toml.write_text("[workload]\nduration = 5\nchat-think = 10\n")
    assert load_workload(toml, {"zipf": "1.3"}).chat_think == 10.0
    with pytest.raises(ValueError, match="unknown workload key 'bogus'"):
        load_workload(None, {"bogus": "1"})


def test_cli_json_has_kv_stats_counters(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--set", "duration=30", "--set", "sessions_per_second=2",
            "--dram", "8GiB", "--nvme", "32GiB", "--model", "llama-3-8b", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    for tier in ("dram", "nvme"):
        assert {"hits", "misses", "promotions", "demotions", "evictions"} <= set(rep["tiers"][tier])
    assert rep["requests"] > 0 and rep["ttft"]["p50"] <= rep["ttft"]["recompute_p50"]
    assert rep["gpu_seconds"]["saved"] > 0


def test_cli_sweep_table_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--set", "duration=30", "--nvme", "32GiB", "--model", "llama-3-8b",
            "--sweep", "dram=1GiB..4GiB"]  # fmt: skip
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    rows = out.strip().splitlines()
    assert "dram size" in rows[0] and [r.split()[0] for r in rows[1:]] == ["1GiB", "2GiB", "4GiB"]
    hit = [float(r.split()[1]) for r in rows[1:]]
    assert hit == sorted(hit)  # more DRAM never caches fewer tokens here
    assert "sweep 3/3" in err


SWEEP = ["simulate", "--set", "duration=20", "--nvme", "32GiB", "--model", "llama-3-8b",
         "--sweep", "dram=1GiB..2GiB"]  # fmt: skip


def test_cli_plot_without_matplotlib_still_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot where matplotlib is not installed: said before the sweep runs (not after it),
    the table is printed anyway, no PNG, exit status 1."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, find_spec says None
    png = tmp_path / "sweep.png"
    assert cli_main([*SWEEP, "--plot", str(png)]) == 1
    out, err = capsys.readouterr()
    assert "needs matplotlib" in err and err.index("needs matplotlib") < err.index("sweep 1/2")
    assert "dram size" in out and len(out.strip().splitlines()) == 3
    assert not png.exists() and "Traceback" not in err


def test_cli_plot_writes_a_titled_png_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    titles: list[str] = []
    real = Figure.savefig

    def spy(fig: Figure, *args: object, **kw: object) -> None:
        titles.append(fig.get_suptitle())
        titles.extend(f"{a.get_xlabel()}|{a.get_ylabel()}" for a in fig.axes)
        real(fig, *args, **kw)  # type: ignore[arg-type]

    png = tmp_path / "sweep.png"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", spy)
        assert cli_main([*SWEEP, "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png.resolve()}" in err and "dram size" in out
    assert "dram size sweep" in titles[0]
    assert "dram size (GiB)|hit ratio (%)" in titles and any("(ms)" in t for t in titles)


def test_cli_hardware_local_measures_this_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--hardware local:DIR measures compute, memory copies and a file in DIR, and the run's
    economics use those figures (the report names them); a bad spec is a usage error."""
    argv = ["simulate", "--set", "duration=10", "--dram", "1GiB", "--nvme", "4GiB",
            "--model", "llama-3-8b", "--json", "--hardware", f"local:{tmp_path}"]  # fmt: skip
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    rep = json.loads(out)
    assert rep["hardware"].startswith("local(") and "GFLOP/s" in err and "nvme" in err
    assert not list(tmp_path.iterdir())  # the calibration file is gone
    assert cli_main([*argv[:-1], "gpu9000"]) == 2
    assert "invalid --hardware" in capsys.readouterr().err


def test_cli_plot_needs_a_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["simulate", "--set", "duration=1", "--dram", "1GiB", "--nvme", "1GiB",
                     "--plot", "x.png"]) == 2  # fmt: skip
    assert "--plot draws a sweep" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "duration=1", "--nvme", "1GiB"], "--dram SIZE and --nvme SIZE are required"),
        (["--set", "duration=1", "--dram", "lots", "--nvme", "1"], "invalid --dram"),
        (["--set", "duration=1", "--nvme", "1", "--sweep", "ram=1..2"], "invalid --sweep"),
        (["--dram", "1", "--nvme", "1"], "give --trace FILE or --workload"),
        (["--set", "x=1", "--dram", "1", "--nvme", "1"], "unknown workload key"),
    ],
)
def test_cli_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_server_records_trace_without_payloads(make_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """serve --trace-file: one line per KV.PUT/GET/MGET hash/MATCH/LEASE (and its release)/
    SESSION/PREFETCH (KV.MATCH PREFETCH's too; a session's with its chain resolved) with sizes
    and hashes only; replaying it reproduces the hit the server counted."""
    import redis

    path = tmp_path / "trace.jsonl"
    srv = make_server(trace_file=str(path))
    r = redis.Redis(port=srv.port)
    payload = b"SECRET" * 1000
    r.execute_command("KV.PUT", NS, b"\x01", b"", payload, "TOKENS", 256)
    r.execute_command("KV.MATCH", NS, b"\x01", b"\x02", "PREFETCH")
    r.execute_command("KV.GET", NS, b"\x01")
    r.execute_command("KV.MGET", NS, b"\x01", b"\x02")
    lease = r.execute_command("KV.LEASE", NS, b"\x01")
    r.execute_command("KV.RELEASE", lease[0])
    r.execute_command("KV.SESSION", NS, "u1", b"\x01")
    r.execute_command("KV.PREFETCH", NS, "SESSION", "u1")
    r.execute_command("KV.PREFETCH", NS, b"\x01", "TO", "dram")
    r.close()
    srv.stop()
    text = path.read_text()
    assert "SECRET" not in text and payload.hex()[:32] not in text
    ops = [json.loads(line)["op"] for line in text.splitlines()]
    assert ops == [
        "put", "match", "prefetch", "get", "get", "get", "lease", "release", "session",
        "prefetch", "prefetch",
    ]  # fmt: skip
    events = list(read_trace(path))
    assert events[0].size == len(payload) and events[0].tokens == 256
    assert events[2].hashes == (b"\x01",)  # MATCH PREFETCH: the found prefix
    assert events[6].lease and events[7].lease == events[6].lease
    assert events[8].session == b"u1" and events[9].hashes == (b"\x01",)  # the session's chain
    assert events[10].to == "dram"
    # each read says which tier served it ("": a miss), so a replay can check itself per read
    assert [e.tier for e in events if e.op == "get"] == ["dram", "dram", ""]
    assert events[6].found == ("dram",)  # the tier its one chunk was a read of
    sim = _sim(dram=64 << 20)
    from kvstrata.sim.replay import replay

    replay(sim, events)
    assert sim.by_name["dram"].counters.hits == 3  # GET, MGET's first hash, LEASE
    assert sim.checked == {"reads": 4, "same": 4} and not sim.differ  # 3 gets, 1 leased


def test_trace_file_is_a_config_key() -> None:
    assert any(o.name == "trace-file" and o.default == "" for o in OPTIONS)


def test_cli_says_how_many_replayed_reads_agree_with_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``get`` records that say where the server served each read: the replay reports how
    many it served from the same tier (here one agrees, one does not: the server recorded an
    NVMe hit for a chunk the replay holds in DRAM)."""
    events = [
        Event(0.0, "put", NS, (b"\x01",), b"", 4096, 256),
        Event(0.1, "get", NS, (b"\x01",), tier="dram"),
        Event(0.2, "get", NS, (b"\x01",), tier="nvme"),
        Event(0.3, "get", NS, (b"\x02",), tier=""),
    ]
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        write_trace(events, f)
    argv = ["simulate", "--trace", str(path), "--dram", "1MiB", "--nvme", "4MiB"]
    assert cli_main(argv) == 0
    assert "served from the tier the server recorded: 2 of 3 (66.7 %)" in capsys.readouterr().out
    assert cli_main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reads_checked"] == {"reads": 3, "same": 2}
