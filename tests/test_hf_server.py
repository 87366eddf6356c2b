"""transformers integration end to end: a real kvstrata server on port 0 and the real client."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from kvstrata.clients.hf import HFPrefixCache
from kvstrata.clients.sync import Client
from tests.hf_fakes import recompute_greedy, recompute_logits, tiny_llama

C = 16


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("load", ["lease", "mget"])
def test_restore_through_server_is_exact(server: Any, model: Any, load: str) -> None:
    """Chunks stored through KV.PUT come back (zero-copy lease or KV.MGET) bit for bit: the
    logits equal a recompute split at the same place, greedy output a full recompute."""
    ids = _ids(70)
    with Client(port=server.port) as kv:
        pc = HFPrefixCache(model, kv, chunk_tokens=C, load=load)  # type: ignore[arg-type]
        assert pc.prefill(ids[:, :64]).reused_tokens == 0
        assert pc.wait_stored() == 4
        res = pc.prefill(ids, store=False)
        assert (res.reused_tokens, res.tiers) == (64, ("dram",) * 4)
        assert pc.load == load  # the lease path did not fall back
        assert torch.equal(res.logits, recompute_logits(model, ids, split=64))
        assert pc.generate(ids, 6, store=False).tokens == recompute_greedy(model, ids, 6)
        pc.close()


def test_codecs_do_not_mix_on_the_server(server: Any, model: Any) -> None:
    ids = _ids(48)
    with Client(port=server.port) as kv:
        raw = HFPrefixCache(model, kv, chunk_tokens=C)
        raw.prefill(ids)
        raw.wait_stored()
        int4 = HFPrefixCache(model, kv, chunk_tokens=C, codec="int4")
        assert int4.prefill(ids).reused_tokens == 0
        int4.wait_stored()
        assert int4.prefill(ids, store=False).reused_tokens == 47
        assert raw.prefill(ids, store=False).reused_tokens == 47


def test_restart_restores_from_nvme_with_same_logits(
    make_server: Callable[..., Any], tmp_path: Path, model: Any
) -> None:
    """Write-through puts reach NVMe; after a restart the index is rebuilt from disk, the match
    reports the nvme tier, and the restored logits equal those before the restart."""
    data = tmp_path / "persist"
    ids = _ids(70)
    srv = make_server(data_dir=data, nvme_write_policy="write-through")
    with Client(port=srv.port) as kv:
        pc = HFPrefixCache(model, kv, chunk_tokens=C)
        pc.prefill(ids[:, :64])
        pc.wait_stored()
        before = pc.prefill(ids, store=False)
    srv.stop()
    srv2 = make_server(data_dir=data)
    with Client(port=srv2.port) as kv:
        pc = HFPrefixCache(model, kv, chunk_tokens=C)
        after = pc.prefill(ids, store=False)
        assert after.reused_tokens == 64 and after.tiers == ("nvme",) * 4
        assert torch.equal(after.logits, before.logits)
        assert torch.equal(after.logits, recompute_logits(model, ids, split=64))
        again = pc.prefill(ids, store=False)  # the read promoted the chunks
        assert again.tiers == ("dram",) * 4


def test_stores_are_written_in_place_with_one_reserve_per_prompt(server: Any, model: Any) -> None:
    """On the server's host a prompt's new chunks are encoded straight into shared memory:
    one KV.MRESERVE and one KV.COMMIT for the four chunks, no KV.PUT; a later prompt that
    extends it reserves only its new chunk, and everything restores exactly."""
    import redis

    ids = _ids(90, seed=3)
    r = redis.Redis(port=server.port)
    r.config_resetstat()
    with Client(port=server.port) as kv:
        pc = HFPrefixCache(model, kv, chunk_tokens=C)
        pc.prefill(ids[:, :64])
        assert pc.wait_stored() == 4
        stats = r.info("commandstats")
        assert stats["cmdstat_kv.mreserve"]["calls"] == 1
        assert stats["cmdstat_kv.commit"]["calls"] == 1
        assert "cmdstat_kv.put" not in stats
        res = pc.prefill(ids[:, :81])
        assert res.reused_tokens == 64 and pc.wait_stored() == 5
        assert r.info("commandstats")["cmdstat_kv.mreserve"]["calls"] == 2
        assert r.execute_command("KV.MATCH", pc.namespace, *pc.hashes(ids[:, :81])) == 5
        res = pc.prefill(ids, store=False)
        assert res.reused_tokens == 80
        assert torch.equal(res.logits, recompute_logits(model, ids, split=80))
        pc.close()


def test_stores_fall_back_to_put_when_the_arena_is_not_mappable(
    server: Any, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server on another host: the reserved slots cannot be mapped, the batch is aborted and
    the chunks go as KV.PUT (and keep going that way); they restore exactly over KV.MGET."""
    from kvstrata.clients import handles as client_handles
    from kvstrata.clients.handles import RegionMapError

    def unmappable(region: Any) -> Any:
        raise RegionMapError("not on this host")

    monkeypatch.setattr(client_handles, "map_shm", unmappable)
    monkeypatch.setattr(client_handles, "_shm", {})
    ids = _ids(70, seed=4)
    with Client(port=server.port) as kv:
        pc = HFPrefixCache(model, kv, chunk_tokens=C, load="mget")
        pc.prefill(ids[:, :64])
        assert pc.wait_stored() == 4 and not pc.store_in_place
        res = pc.prefill(ids, store=False)
        assert res.reused_tokens == 64
        assert torch.equal(res.logits, recompute_logits(model, ids, split=64))
        pc.close()
