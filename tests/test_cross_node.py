"""Two kvstrata servers with their own DRAM and NVMe sharing one S3 bucket (moto over HTTP),
driven through redis-py: what node A stores is matched (KV.MATCH, KV.MATCHTOKENS), loaded
(KV.GET, KV.LEASE) and session-prefetched on node B. Waits are bounded polls of INFO."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from kvstrata.store.hashing import chunk_hashes
from tests.conftest import RunningServer

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]

NS = "xnode@bf16@c16"
CHUNK = 16
SIZE = 64 * 1024


def client(srv: RunningServer) -> redis.Redis:
    return redis.Redis(host=srv.host, port=srv.port, protocol=3, socket_timeout=30)


def pair(make_server: Callable[..., RunningServer], endpoint: str, bucket: str) -> Any:
    common = {"s3_endpoint": endpoint, "s3_bucket": bucket, "dram_capacity": "8MiB",
              "nvme_capacity": "16MiB"}  # fmt: skip
    a = make_server(s3_write_policy="write-through", **common)
    b = make_server(**common)
    return client(a), client(b)


def put_chain(r: redis.Redis, hashes: list[bytes]) -> list[bytes]:
    payloads = []
    parent = b""
    for i, h in enumerate(hashes):
        data = bytes([i + 1]) * SIZE
        assert r.execute_command("KV.PUT", NS, h, parent, data, "TOKENS", CHUNK) == 1
        payloads.append(data)
        parent = h
    return payloads


def info(r: redis.Redis, section: str) -> dict[str, Any]:
    return dict(r.info(section))


def test_chain_stored_on_a_is_matched_and_loaded_on_b(
    make_server: Callable[..., RunningServer], moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: A stores 5 chunks hashed from tokens (write-through to S3). B matches them
    in one round trip each way (hashes and tokens), GETs one, leases the chain, and shows
    where the chunks were found."""
    ra, rb = pair(make_server, moto_server.endpoint, s3_bucket)
    tokens = list(range(5 * CHUNK + 2))
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    hashes = chunk_hashes(packed, NS, CHUNK)
    payloads = put_chain(ra, hashes)
    assert rb.execute_command("KV.MATCH", NS, *hashes[:3]) == 3
    matched = rb.execute_command("KV.MATCHTOKENS", NS, packed, "CHUNK", CHUNK)
    assert matched[:2] == [5 * CHUNK, 5] and matched[2] == hashes
    assert rb.execute_command("KV.MATCH", NS, *hashes, b"nope", "WITHTIERS") == [5, [b"s3"] * 5]
    assert rb.execute_command("KV.GET", NS, hashes[4]) == payloads[4]
    lease_id, handles = rb.execute_command("KV.LEASE", NS, *hashes)
    assert lease_id and len(handles) == 5
    assert rb.execute_command("KV.RELEASE", lease_id) == b"OK"
    tiers = rb.execute_command("KV.MATCH", NS, *hashes, "WITHTIERS")[1]
    assert tiers == [b"dram"] * 5
    stats = info(rb, "tiers")
    assert stats["remote_found"] == 5 and stats["s3_bytes_out"] == 5 * SIZE
    assert rb.execute_command("KV.MATCH", NS, b"unknown-1", b"unknown-2") == 0


def test_session_prefetch_on_b_before_the_next_lease(
    make_server: Callable[..., RunningServer], moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: B learned of A's 4-chunk conversation through KV.MATCH (chunks in s3 only);
    KV.SESSION records its tail on B and KV.PREFETCH SESSION returns at once. INFO prefetch
    then shows the request done and KV.INFO shows each chunk in DRAM, so the next KV.LEASE
    promotes nothing itself."""
    ra, rb = pair(make_server, moto_server.endpoint, s3_bucket)
    hashes = chunk_hashes(struct.pack("<64I", *range(100, 164)), NS, CHUNK)
    put_chain(ra, hashes)
    assert rb.execute_command("KV.MATCH", NS, *hashes) == 4
    assert rb.execute_command("KV.SESSION", NS, "conv-7", hashes[-1]) == b"OK"
    request_id, queued = rb.execute_command("KV.PREFETCH", NS, "SESSION", "conv-7")
    assert request_id > 0 and queued == 4
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pf = info(rb, "prefetch")
        if pf["prefetch_done"] >= 1 and pf["prefetch_running"] == 0:
            break
        time.sleep(0.05)
    pf = info(rb, "prefetch")
    assert (pf["prefetch_done"], pf["prefetch_late"], pf["prefetch_chunks"]) == (1, 0, 4)
    assert pf["prefetch_bytes"] == 4 * SIZE and pf["sessions"] == 1
    for h in hashes:
        assert b"dram" in rb.execute_command("KV.INFO", NS, h)[b"tiers"]
    promotions = info(rb, "tiers")["dram_promotions"]
    lease_id, handles = rb.execute_command("KV.LEASE", NS, *hashes)
    assert len(handles) == 4
    assert info(rb, "tiers")["dram_promotions"] == promotions
    rb.execute_command("KV.RELEASE", lease_id)


def test_planted_session_with_a_400_digit_expiry_is_absent_and_the_own_record_kept(
    make_server: Callable[..., RunningServer], moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario (no s3-auth-key): B knows A's 4-chunk chain from S3 and records session
    conv-8 at its tail; then an object planted with boto3 replaces B's session object: tail
    chunk 1, ``expires_ms`` a 400-digit integer. KV.PREFETCH SESSION used to answer ``-ERR
    internal error … int too large to convert to float`` after dropping B's record; now the
    object is an invalid one (counted, left in the bucket) and B's own tail is prefetched: 4
    chunks, served with A's bytes."""
    from kvstrata.tiers.s3_objects import session_name

    ra, rb = pair(make_server, moto_server.endpoint, s3_bucket)
    hashes = chunk_hashes(struct.pack("<64I", *range(300, 364)), NS, CHUNK)
    payloads = put_chain(ra, hashes)
    assert rb.execute_command("KV.MATCH", NS, *hashes) == 4
    assert rb.execute_command("KV.SESSION", NS, "conv-8", hashes[-1]) == b"OK"
    deadline = time.monotonic() + 20
    while info(rb, "tiers")["s3_sessions_written"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert info(rb, "tiers")["s3_sessions_written"] == 1
    fields = f'"namespace":"{NS}","session":"{b"conv-8".hex()}","tail":"{hashes[1].hex()}"'
    body = ('{"format":1,' + fields + ',"expires_ms":' + "9" * 400 + "}").encode()
    name = session_name("kvstrata", NS, b"conv-8")
    s3 = moto_server.client()
    s3.put_object(Bucket=s3_bucket, Key=name, Body=body)
    request_id, queued = rb.execute_command("KV.PREFETCH", NS, "SESSION", "conv-8")
    assert request_id > 0 and queued == 4
    assert wait_prefetched(rb, 1)["prefetch_chunks"] == 4
    assert info(rb, "tiers")["s3_invalid_objects"] == 1
    assert [rb.execute_command("KV.GET", NS, h) for h in hashes] == payloads
    assert s3.get_object(Bucket=s3_bucket, Key=name)["Body"].read() == body


def wait_prefetched(r: redis.Redis, done: int) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pf = info(r, "prefetch")
        if pf["prefetch_done"] >= done and pf["prefetch_running"] == 0:
            return pf
        time.sleep(0.05)
    return info(r, "prefetch")


def test_session_recorded_on_a_is_prefetched_in_full_on_b_and_c(
    make_server: Callable[..., RunningServer], moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario (a load balancer sends the next turn elsewhere): A stores a 4-chunk
    conversation and records KV.SESSION. B never heard of the session nor its chunks;
    KV.PREFETCH SESSION on B finds the session object in S3, walks the chain through S3 and
    promotes all 4 chunks. C knows the session's tail only (its own KV.SESSION) and also
    gets the whole chain, not just the tail."""
    ra, rb = pair(make_server, moto_server.endpoint, s3_bucket)
    rc = client(make_server(s3_endpoint=moto_server.endpoint, s3_bucket=s3_bucket,
                            dram_capacity="8MiB", nvme_capacity="16MiB"))  # fmt: skip
    hashes = chunk_hashes(struct.pack("<64I", *range(300, 364)), NS, CHUNK)
    put_chain(ra, hashes)
    assert ra.execute_command("KV.SESSION", NS, "turns", hashes[-1]) == b"OK"
    deadline = time.monotonic() + 20
    while info(ra, "prefetch").get("sessions_shared_written", 0) < 1 and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    for r in (rb, rc):
        if r is rc:
            assert rc.execute_command("KV.SESSION", NS, "turns", hashes[-1]) == b"OK"
        request_id, queued = r.execute_command("KV.PREFETCH", NS, "SESSION", "turns")
        assert request_id > 0 and queued == 4
        pf = wait_prefetched(r, 1)
        assert (pf["prefetch_done"], pf["prefetch_chunks"]) == (1, 4)
        tiers = r.execute_command("KV.MATCH", NS, *hashes, "WITHTIERS")
        assert tiers == [4, [b"dram"] * 4]
    assert rb.execute_command("KV.PREFETCH", NS, "SESSION", "nobody") == [0, 0]


def test_planted_object_with_empty_codec_does_not_break_puts(
    make_server: Callable[..., RunningServer], moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: an object planted with boto3 has the right payload checksum but an empty
    kvs-codec. Node B's GET is a miss (counted in s3_invalid_objects, the object stays), and
    30 ordinary KV.PUTs that push DRAM's victims to NVMe all succeed."""
    from kvstrata.chunks import ChunkKey
    from kvstrata.tiers.checksum import checksum
    from kvstrata.tiers.s3_objects import object_name

    body = b"\x05" * SIZE
    name = object_name("kvstrata", ChunkKey(NS, b"planted"))
    md = {"kvs-version": "1", "kvs-parent": "", "kvs-tokens": "4", "kvs-codec": "",
          "kvs-checksum": checksum(body).hex(), "kvs-size": str(SIZE)}  # fmt: skip
    s3 = moto_server.client()
    s3.put_object(Bucket=s3_bucket, Key=name, Body=body, Metadata=md)
    rb = client(make_server(s3_endpoint=moto_server.endpoint, s3_bucket=s3_bucket,
                            dram_capacity="1MiB", nvme_capacity="16MiB"))  # fmt: skip
    got = rb.execute_command("KV.GET", NS, b"planted")
    failed = []
    for i in range(30):
        try:
            rb.execute_command("KV.PUT", NS, b"p%d" % i, b"", bytes([i]) * (4 * SIZE))
        except redis.ResponseError as exc:
            failed.append(str(exc))
    assert failed == []
    assert got is None and info(rb, "tiers")["s3_invalid_objects"] == 1
    assert s3.head_object(Bucket=s3_bucket, Key=name)["Metadata"]["kvs-codec"] == ""


def test_auth_key_is_redacted(
    make_server: Callable[..., RunningServer], moto_server: MotoServer, s3_bucket: str
) -> None:
    """s3-auth-key is never shown: CONFIG GET by name answers "(redacted)", patterns skip
    it, INFO says only that authentication is on."""
    key = "secret-auth-key-" + "z" * 16
    r = client(make_server(s3_endpoint=moto_server.endpoint, s3_bucket=s3_bucket,
                           s3_auth_key=key))  # fmt: skip
    assert r.config_get("s3-auth-key") == {"s3-auth-key": "(redacted)"}
    assert "s3-auth-key" not in r.config_get("*")
    everything = r.execute_command("INFO", "everything")
    text = everything.decode() if isinstance(everything, bytes) else str(everything)
    assert key not in text and info(r, "tiers")["s3_auth"] == "on"
    try:
        r.config_set("s3-auth-key", "x" * 20)
        raise AssertionError("CONFIG SET s3-auth-key succeeded")
    except redis.ResponseError as exc:
        assert "x" * 20 not in str(exc)
