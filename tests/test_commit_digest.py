"""KV.COMMIT … DIGEST (issue 31): a zero-copy writer sends the xxh3-128 it computed while copying
its bytes into the slot, and the server keeps it unverified instead of hashing the slot again.

The contract under test: a wrong digest can only make its chunk fail verification — on the way
out of DRAM (demotion to NVMe, the shutdown save), on a re-put of the same chunk, or at once
where the commit copies the bytes anyway (write-through) — and is then dropped and counted;
the chunks around it are unaffected, and nothing wrong is ever served or persisted (a restart
rebuilds only verified chunks). Real server on port 0, real client, real files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
import xxhash

from kvstrata.clients import Client
from kvstrata.clients import copysum as copysum_mod
from kvstrata.clients.sync import WriteBatch
from kvstrata.protocol.errors import RespError
from tests.conftest import RunningServer
from tests.fakes import wait_for

NS = "digest@u8@c16"
SLOT = 256 * 1024


def content(i: int, n: int = SLOT) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def info(r: redis.Redis, h: bytes) -> dict[bytes, object] | None:
    reply = r.execute_command("KV.INFO", NS, h)
    if reply is None:
        return None
    return dict(zip(reply[::2], reply[1::2], strict=True)) if isinstance(reply, list) else reply


def commit_with(kv: Client, batch: WriteBatch, digests: list[bytes]) -> None:
    """KV.COMMIT of every slot of ``batch`` with these digests (the client's own are skipped)."""
    batch.done = True
    kv.commit(batch._lease(), *batch.reserved, via=batch._conn, digests=digests)


def fill_raw(batch: WriteBatch, datas: list[bytes]) -> None:
    """Fill the slots through views: the client computes no digest for them."""
    for i, data in enumerate(datas):
        batch.view(i)[:] = data


def test_copy_checksum_compiled_and_python_twin_match_xxhash() -> None:
    for n in (1, 4095, 256 * 1024, 256 * 1024 + 7, 3 * 1024 * 1024 + 1):
        src = content(n, n)
        want = xxhash.xxh3_128_digest(src)
        for fn in (copysum_mod.copy_checksum, copysum_mod._py_copy_checksum):
            dst = bytearray(n)
            assert fn(memoryview(dst), memoryview(src)) == want and bytes(dst) == src
    assert copysum_mod.COMPILED  # setup.py builds it here: the fast path is what is measured
    with pytest.raises(ValueError, match="do not fill"):
        copysum_mod.copy_checksum(memoryview(bytearray(4)), b"12345")


@pytest.fixture(params=["avx2", "sse2"])
def vector_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """The compiled copy's AVX2 loop (where the CPU has it) and its SSE2 one."""
    from kvstrata.clients import _copysum  # type: ignore[attr-defined]

    was = _copysum._use_avx2(request.param == "avx2")
    yield
    _copysum._use_avx2(was)


@pytest.mark.usefixtures("vector_loop")
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (16, 0), (0, 16), (1, 7), (33, 64)])
def test_copy_checksum_at_every_alignment_and_both_store_kinds(src_off: int, dst_off: int) -> None:
    """The compiled copy aligns the destination and loads the source unaligned, and streams
    buffers from 512 KiB up (hashing the source then): every size around its block (64 KiB),
    its vector widths and that threshold, at odd offsets on either side, gives the bytes and
    the digest of xxhash and of the Python twin, and writes nothing outside the slot."""
    for n in (1, 31, 32, 127, 129, 65536 - 1, 65536 + 33, 512 * 1024 - 1, 512 * 1024,
              512 * 1024 + 97, 2 * 1024 * 1024 + 5):  # fmt: skip
        data = content(n + 3, n)
        src = bytearray(src_off + n)
        src[src_off:] = data
        for fn in (copysum_mod.copy_checksum, copysum_mod._py_copy_checksum):
            dst = bytearray(b"\xaa" * (dst_off + n + 64))
            digest = fn(memoryview(dst)[dst_off : dst_off + n], memoryview(src)[src_off:])
            assert digest == xxhash.xxh3_128_digest(data), (fn, n)
            assert dst[dst_off : dst_off + n] == data
            assert dst[:dst_off] == b"\xaa" * dst_off and dst[dst_off + n :] == b"\xaa" * 64


def test_write_sends_digests_the_server_keeps_them_unverified_until_demotion(
    make_server: Callable[..., RunningServer],
) -> None:
    """``write`` of whole slots sends their digests: KV.INFO shows the right checksum, marked
    unverified; KV.GET, KV.MGET and a lease serve exactly the written bytes; a slot filled
    through a view is hashed by the server (verified). Once demoted to NVMe (the copy out of
    DRAM checks it) the chunk reads back exactly and is verified."""
    srv = make_server(dram_capacity=f"{16 * SLOT}", nvme_capacity="64MiB")
    r = redis.Redis(port=srv.port)
    datas = [content(i) for i in range(3)]
    with Client(port=srv.port) as kv:
        with kv.reserve_chain(NS, None, [b"a", b"b", b"c"], [SLOT] * 3, tokens=16) as batch:
            batch.write(0, datas[0])
            batch.write(1, np.frombuffer(datas[1], np.uint8))
            batch.view(2)[:] = datas[2]
            assert set(batch.digests) == {0, 1}
        for h, data, verified in zip((b"a", b"b", b"c"), datas, (0, 0, 1), strict=True):
            got = info(r, h)
            assert got is not None and got[b"checksum"] == xxhash.xxh3_128_hexdigest(data).encode()
            assert got[b"checksum_verified"] == verified
        assert kv.mget(NS, [b"a", b"b", b"c"]) == datas
        lease = kv.lease(NS, [b"a", b"b"], tier="dram")
        assert lease is not None and [bytes(v) for v in lease.views()] == datas[:2]
        lease.release()
        for i in range(40):  # DRAM pressure demotes a, b, c to NVMe
            kv.put(NS, b"f%d" % i, None, content(100 + i))
    assert wait_for(lambda: r.execute_command("KV.MATCH", NS, b"a", "WITHTIERS") == [1, [b"nvme"]])
    got = info(r, b"a")
    assert got is not None and got[b"checksum_verified"] == 1
    assert r.execute_command("KV.GET", NS, b"a") == datas[0]
    stats = r.info("tiers")
    assert stats["kv_integrity_errors"] == 0 and stats["kv_digest_failures"] == 0
    r.close()


def test_wrong_digest_fails_verification_on_demotion_others_unaffected(
    make_server: Callable[..., RunningServer],
) -> None:
    """Scenario: a buggy writer commits three chunks, the middle one with a digest of other
    bytes. In DRAM it serves what the writer wrote (the digest changes no byte); when pressure
    demotes it, the check finds the mismatch: the chunk is dropped from every tier (never
    written to NVMe), kv_digest_failures counts it, and its neighbours are demoted and read
    back exactly."""
    srv = make_server(dram_capacity=f"{16 * SLOT}", nvme_capacity="64MiB")
    r = redis.Redis(port=srv.port)
    datas = [content(10 + i) for i in range(3)]
    wrong = xxhash.xxh3_128_digest(b"other bytes")
    with Client(port=srv.port) as kv:
        batch = kv.reserve_chain(NS, None, [b"x0", b"x1", b"x2"], [SLOT] * 3, tokens=16)
        fill_raw(batch, datas)
        good = [xxhash.xxh3_128_digest(d) for d in datas]
        commit_with(kv, batch, [good[0], wrong, good[2]])
        got = info(r, b"x1")
        assert got is not None and got[b"checksum_verified"] == 0
        assert r.execute_command("KV.GET", NS, b"x1") == datas[1]  # the writer's own bytes
        for i in range(40):
            kv.put(NS, b"f%d" % i, None, content(200 + i))
    assert wait_for(lambda: info(r, b"x1") is None)
    assert r.execute_command("KV.GET", NS, b"x1") is None
    assert wait_for(lambda: r.execute_command("KV.MATCH", NS, b"x2", "WITHTIERS") == [1, [b"nvme"]])
    assert r.execute_command("KV.GET", NS, b"x0") == datas[0]
    assert r.execute_command("KV.GET", NS, b"x2") == datas[2]
    stats = r.info("tiers")
    assert stats["kv_digest_failures"] == 1 and stats["kv_integrity_errors"] == 1
    r.close()


def test_wrong_digest_is_dropped_by_the_shutdown_save_and_restart_is_exact(
    make_server: Callable[..., RunningServer],
) -> None:
    """The shutdown save copies DRAM-only chunks to NVMe through the same check: the chunk with
    a wrong digest is not saved; after a restart the index holds only the verified chunks, each
    reading back exactly."""
    srv = make_server(nvme_capacity="64MiB")
    datas = [content(30 + i) for i in range(3)]
    with Client(port=srv.port) as kv:
        batch = kv.reserve_chain(NS, None, [b"s0", b"s1", b"s2"], [SLOT] * 3, tokens=16)
        fill_raw(batch, datas)
        digests = [xxhash.xxh3_128_digest(d) for d in datas]
        digests[2] = xxhash.xxh3_128_digest(datas[0])
        commit_with(kv, batch, digests)
    srv.stop()
    again = make_server(nvme_capacity="64MiB", data_dir=srv.data_dir)
    r = redis.Redis(port=again.port)
    assert r.execute_command("KV.MATCH", NS, b"s0", b"s1", b"s2") == 2
    assert [r.execute_command("KV.GET", NS, h) for h in (b"s0", b"s1")] == datas[:2]
    assert r.execute_command("KV.GET", NS, b"s2") is None
    got = info(r, b"s0")
    assert got is not None and got[b"checksum_verified"] == 1
    r.close()


def test_wrong_digest_is_refused_at_commit_when_written_through(
    make_server: Callable[..., RunningServer],
) -> None:
    """With NVMe write-through the commit copies the bytes anyway, so it checks the digest at
    once: the chunk before the wrong one is published, the wrong one and the rest are not
    (the error names it), INFO counts kv_digest_refused."""
    srv = make_server(nvme_capacity="64MiB", nvme_write_policy="write-through")
    r = redis.Redis(port=srv.port)
    datas = [content(50 + i) for i in range(3)]
    with Client(port=srv.port) as kv:
        batch = kv.reserve_chain(NS, None, [b"w0", b"w1", b"w2"], [SLOT] * 3, tokens=16)
        fill_raw(batch, datas)
        digests = [xxhash.xxh3_128_digest(d) for d in datas]
        digests[1] = bytes(16)
        with pytest.raises(RespError, match=r"DIGEST of chunk .* does not match"):
            commit_with(kv, batch, digests)
    assert r.execute_command("KV.MATCH", NS, b"w0", b"w1", b"w2") == 1
    got = info(r, b"w0")
    assert got is not None and got[b"checksum_verified"] == 1
    assert r.info("tiers")["kv_digest_refused"] == 1
    r.close()


def test_reput_of_a_chunk_with_a_wrong_digest_stores_the_new_bytes(
    make_server: Callable[..., RunningServer],
) -> None:
    """A chunk committed with the digest of bytes Y while it holds X, then KV.PUT of Y: the
    claim equals Y's checksum, but the put must not take that for "already stored" — the DRAM
    copy is checked, fails, and Y is stored; KV.GET returns Y."""
    srv = make_server(nvme_capacity="0")
    r = redis.Redis(port=srv.port)
    x, y = content(70), content(71)
    with Client(port=srv.port) as kv:
        batch = kv.reserve_chain(NS, None, [b"r"], [SLOT], tokens=16)
        fill_raw(batch, [x])
        commit_with(kv, batch, [xxhash.xxh3_128_digest(y)])
        assert kv.put(NS, b"r", None, y)
    assert r.execute_command("KV.GET", NS, b"r") == y
    got = info(r, b"r")
    assert got is not None and got[b"checksum_verified"] == 1
    assert r.info("tiers")["kv_digest_failures"] == 1
    r.close()


def test_digest_arguments_are_checked_before_the_lease_is_touched(
    server: RunningServer,
) -> None:
    """DIGEST of the wrong length or count, or with a batch but no index, is -ERR and the lease
    stays reserved: a plain KV.COMMIT (an old client's) still publishes it, hashed by the
    server. A single KV.RESERVE slot takes one digest."""
    r = redis.Redis(port=server.port)
    data = content(80, 4096)
    with Client(port=server.port) as kv:
        batch = kv.reserve_chain(NS, None, [b"d0", b"d1"], [4096, 4096], tokens=16)
        fill_raw(batch, [data, data])
        lid, conn = batch._lease(), batch._conn
        for bad, why in (
            ([b"0", b"1", b"DIGEST", b"short", b""], "16 bytes"),
            ([b"0", b"1", b"DIGEST", bytes(16)], "one digest per index"),
            ([b"DIGEST", bytes(16)], "needs the chunks' indexes"),
        ):
            with pytest.raises(RespError, match=why):
                kv._run(_raw_commit(lid, bad), conn)
        batch.commit()  # no digest at all (filled through views)
        got = info(r, b"d1")
        assert got is not None and got[b"checksum_verified"] == 1
        w = kv.reserve(NS, b"single", None, 4096)
        w.write(data)
        assert w.digest == xxhash.xxh3_128_digest(data)
        w.commit()
        got = info(r, b"single")
        assert got is not None and got[b"checksum_verified"] == 0
        assert got[b"checksum"] == xxhash.xxh3_128_hexdigest(data).encode()
    r.close()


def _raw_commit(lease_id: str, tail: list[bytes]) -> object:
    from kvstrata.clients.commands import Call, _ok

    return Call(("KV.COMMIT", lease_id, *tail), _ok)


def test_a_server_without_digest_support_gets_a_plain_commit(server: RunningServer) -> None:
    """A server older than KV.COMMIT … DIGEST reads DIGEST as an index and refuses it before
    touching the lease: the client commits again without digests (the server hashes the
    slots, as before) and sends none to that server from then on."""
    from kvstrata.clients.commands import Call
    from kvstrata.protocol.errors import CommandError

    kv = Client(port=server.port)  # its commands go to ``run`` below
    sent: list[tuple[object, ...]] = []

    def run(call: Call[object], via: object = None) -> object:
        sent.append(call.args)
        if "DIGEST" in call.args:
            raise CommandError("invalid index: value is not an integer")
        return None

    kv._run = run  # type: ignore[method-assign]
    kv.commit("lease1", 0, 1, digests=[bytes(16), b""])
    kv.commit("lease2", 0, digests=[bytes(16)])
    assert sent == [
        ("KV.COMMIT", "lease1", 0, 1, "DIGEST", bytes(16), b""),
        ("KV.COMMIT", "lease1", 0, 1),
        ("KV.COMMIT", "lease2", 0),
    ]
    kv._digests = True

    def refuse(call: Call[object], via: object = None) -> object:
        raise CommandError("other")

    kv._run = refuse  # type: ignore[method-assign]
    with pytest.raises(CommandError, match="other"):  # any other error is the caller's
        kv.commit("lease3", 0, digests=[bytes(16)])
    assert kv._digests
    kv.close()
