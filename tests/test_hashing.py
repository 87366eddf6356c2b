"""Chained chunk hashing: the vectors published in docs/hashing.md, an independent
re-implementation, input forms (ints, numpy, packed bytes, torch) and validation."""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.store.hashing import chain_hash, chunk_hashes, pack_tokens, seed

DOC = Path(__file__).resolve().parents[1] / "docs" / "hashing.md"


@dataclass(frozen=True)
class Vector:
    name: str
    namespace: str
    extra: list[bytes]
    chunk_tokens: int
    tokens: list[int]
    seed: bytes
    hashes: list[bytes]


def _parse_block(block: str) -> Vector:
    fields: dict[str, str] = {}
    hashes: dict[int, bytes] = {}
    for line in block.strip().splitlines():
        key, _, value = (part.strip() for part in line.partition("="))
        m = re.fullmatch(r"hash\[(\d+)\]", key)
        if m:
            hashes[int(m.group(1))] = bytes.fromhex(value)
        else:
            fields[key] = value
    assert sorted(hashes) == list(range(len(hashes))), "hash indexes must be 0..n-1"
    if fields.get("hashes") != "(none)":
        assert hashes, f"vector {fields.get('name')} lists no hashes"
    extra = fields["extra"]
    return Vector(
        name=fields["name"],
        namespace=fields["namespace"],
        extra=[] if extra == "(none)" else [bytes.fromhex(x) for x in extra.split()],
        chunk_tokens=int(fields["chunk_tokens"]),
        tokens=[int(t) for t in fields["tokens"].split()],
        seed=bytes.fromhex(fields["seed"]),
        hashes=[hashes[i] for i in range(len(hashes))],
    )


def _doc_vectors() -> list[Vector]:
    text = DOC.read_text()
    section = text[text.index("## Test vectors") :]
    blocks = re.findall(r"```text\n(name\s*=.*?)```", section, re.S)
    return [_parse_block(b) for b in blocks]


VECTORS = _doc_vectors()


def _ref_seed(ns: bytes, extra: list[bytes]) -> bytes:
    """Independent, deliberately naive implementation of the spec."""
    data = b"kvstrata-v1\0" + struct.pack("<I", len(ns)) + ns + struct.pack("<I", len(extra))
    for e in extra:
        data += struct.pack("<I", len(e)) + e
    return hashlib.sha256(data).digest()


def _ref_hashes(tokens: list[int], ns: bytes, c: int, extra: list[bytes]) -> list[bytes]:
    prev, out = _ref_seed(ns, extra), []
    for i in range(len(tokens) // c):
        chunk = b"".join(struct.pack("<I", t) for t in tokens[i * c : (i + 1) * c])
        prev = hashlib.sha256(prev + chunk).digest()
        out.append(prev)
    return out


def test_doc_publishes_enough_vectors() -> None:
    names = [v.name for v in VECTORS]
    assert len(VECTORS) >= 6
    assert len(set(names)) == len(names)
    assert any(len(v.hashes) >= 3 for v in VECTORS)
    assert any(v.extra for v in VECTORS)
    assert len({v.namespace for v in VECTORS}) >= 2


@pytest.mark.parametrize("vec", VECTORS, ids=lambda v: v.name)
def test_doc_vector_matches_code(vec: Vector) -> None:
    assert seed(vec.namespace, vec.extra) == vec.seed
    assert chunk_hashes(vec.tokens, vec.namespace, vec.chunk_tokens, vec.extra) == vec.hashes


@pytest.mark.parametrize("vec", VECTORS, ids=lambda v: v.name)
def test_doc_vector_matches_reference(vec: Vector) -> None:
    ns = vec.namespace.encode()
    assert _ref_seed(ns, vec.extra) == vec.seed
    assert _ref_hashes(vec.tokens, ns, vec.chunk_tokens, vec.extra) == vec.hashes


def test_doc_vectors_relations() -> None:
    by = {v.name: v for v in VECTORS}
    assert by["partial-chunk-ignored"].hashes == by["chain-of-three"].hashes[:2]
    assert not set(by["other-namespace"].hashes) & set(by["chain-of-three"].hashes)
    assert by["extra-split-ab"].seed != by["extra-split-a-b"].seed
    assert by["shorter-than-chunk"].hashes == []
    h = by["chunk-of-one"].hashes
    assert h[0] != h[1]


def test_worked_example_preimage() -> None:
    ns = b"llama-3.1-8b@bf16@tp1r0@c4"
    pre = bytes.fromhex(
        "6b767374726174612d7631001a0000006c6c616d612d332e312d3862406266313640747031723040633400000000"
    )
    assert pre == b"kvstrata-v1\0" + struct.pack("<I", 26) + ns + b"\0\0\0\0"
    assert hashlib.sha256(pre).digest() == seed(ns)
    assert seed(ns) == seed(ns.decode())


def test_input_forms_agree() -> None:
    rng = np.random.default_rng(7)
    arr = rng.integers(0, 2**32, size=4 * 64 + 3, dtype=np.uint64)
    want = _ref_hashes([int(t) for t in arr], b"ns", 64, [b"x"])
    assert len(want) == 4
    assert chunk_hashes(arr, "ns", 64, [b"x"]) == want
    assert chunk_hashes(arr.astype("<u4"), "ns", 64, [b"x"]) == want
    assert chunk_hashes(arr.astype(">u4"), "ns", 64, [b"x"]) == want
    assert chunk_hashes(arr.astype(np.int64), "ns", 64, [b"x"]) == want
    assert chunk_hashes([int(t) for t in arr], "ns", 64, ["x"]) == want
    packed = arr.astype("<u4").tobytes()
    assert chunk_hashes(packed, "ns", 64, [b"x"]) == want
    assert chunk_hashes(bytearray(packed), "ns", 64, [b"x"]) == want
    assert chunk_hashes(memoryview(packed), "ns", 64, [b"x"]) == want
    strided = np.repeat(arr.astype("<u4"), 2)[::2]
    assert chunk_hashes(strided, "ns", 64, [b"x"]) == want


def test_torch_tensor_input() -> None:
    torch = pytest.importorskip("torch")
    tokens = list(range(1000, 1000 + 96))
    assert chunk_hashes(torch.tensor(tokens), "ns", 32) == _ref_hashes(tokens, b"ns", 32, [])


def test_chain_hash_links() -> None:
    tokens = list(range(20))
    hashes = chunk_hashes(tokens, "ns", 5)
    assert chain_hash(seed("ns"), pack_tokens(tokens[:5])) == hashes[0]
    for i in range(1, 4):
        assert chain_hash(hashes[i - 1], pack_tokens(tokens[5 * i : 5 * i + 5])) == hashes[i]


def test_pack_tokens() -> None:
    assert pack_tokens([0, 1, 2**32 - 1]) == b"\0\0\0\0\1\0\0\0\xff\xff\xff\xff"
    assert pack_tokens([]) == b""
    assert pack_tokens(np.array([258], dtype=np.uint16)) == b"\x02\x01\0\0"
    assert pack_tokens(b"abcd") == b"abcd"


@pytest.mark.parametrize("bad", [[-1], [2**32], [2**70], np.array([-5]), np.array([2**40])])
def test_out_of_range_tokens_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="outside"):
        pack_tokens(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        chunk_hashes(bad, "ns", 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[1.5], [True], ["1"], np.array([1.0]), [None]])
def test_non_integer_tokens_rejected(bad: object) -> None:
    with pytest.raises(TypeError):
        pack_tokens(bad)  # type: ignore[arg-type]


def test_bad_packed_length_and_chunk_size() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        chunk_hashes(b"abcde", "ns", 1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_hashes([1, 2], "ns", 0)
    with pytest.raises(TypeError):
        seed("ns", [123])  # type: ignore[list-item]


def test_large_prompt_shape() -> None:
    tokens = np.arange(128 * 1024, dtype=np.uint32)
    hashes = chunk_hashes(tokens, "ns", 256)
    assert len(hashes) == 512
    assert all(len(h) == 32 for h in hashes)
    assert len(set(hashes)) == 512


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    c=st.integers(1, 9),
    ns=st.text(alphabet="abcxyz09@.-", min_size=1, max_size=20),
    extra=st.lists(st.binary(max_size=6), max_size=3),
)
def test_matches_reference_property(tokens: list[int], c: int, ns: str, extra: list[bytes]) -> None:
    assert chunk_hashes(tokens, ns, c, extra) == _ref_hashes(tokens, ns.encode(), c, extra)
