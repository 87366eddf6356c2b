"""The blocking boto3 requests of the S3 tier (run on its executor, never on the event loop).

Each method is one request (or one managed transfer) and judges the object it got *by the
object's own metadata*, never by what a node believed about it before:

- :meth:`S3Requests.get` reads into the caller's buffer in steps (short reads checked), hashing
  the bytes as they arrive (xxh3 checksum and, with an auth key, the payload MAC). An object
  larger than the buffer is not read: :class:`ObjectChanged` carries its metadata instead.
- :meth:`S3Requests.delete_version` deletes only the version that was examined (``IfMatch`` on
  its ETag, which S3, MinIO and moto honour); a store that refuses the condition gets a plain
  delete, a store that answers 412 (the object was replaced meanwhile) keeps the new object.

With ``s3-codec`` set, :meth:`S3Requests.put` stores what
:func:`kvstrata.codecs.tier.encode_for_tier` makes of the payload (when it gains) and
:meth:`S3Requests.get` decodes it into the caller's buffer, then checks the chunk's own
checksum over the decoded bytes.

Raised here: ``InvalidObject``/``AuthFailure``/``CorruptObject`` (``s3_objects``),
``ObjectChanged`` and botocore errors (translated by the tier).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.codecs import CodecError, decode_into
from kvstrata.codecs.tier import encode_for_tier
from kvstrata.tiers.base import Buffer, ObjectChanged, TierIOError
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.s3_auth import ObjectAuth
from kvstrata.tiers.s3_objects import (
    MAX_SESSION_BODY,
    AuthFailure,
    CorruptObject,
    InvalidObject,
    SessionObject,
    check_session_tag,
    decode_metadata,
    decode_session,
    encode_metadata,
    encode_session,
    mac_version,
    object_encoding,
    payload_tag,
    session_metadata,
)

try:
    from botocore.exceptions import ClientError
except ImportError:  # pragma: no cover - boto3 is the optional [s3] extra

    class ClientError(Exception):  # type: ignore[no-redef]
        """Stand-in so ``except`` works without botocore; never raised."""


MiB = 1024 * 1024
_READ_STEP = 1 * MiB  # urllib3 copies each readinto through a temporary of this size
_NO_CONDITION = frozenset({"NotImplemented", "InvalidArgument", "501"})


@dataclass(frozen=True, slots=True)
class Head:
    """What a HEAD (or GET) says about an object: its metadata and the version read."""

    meta: ChunkMeta | None  # None: an object of another format version
    etag: str


class S3Requests:
    """Blocking requests against one bucket; ``auth`` signs and checks objects when set."""

    def __init__(self, client: Any, bucket: str, transfer: Any, multipart_threshold: int,
                 auth: ObjectAuth | None, codec: str = "none") -> None:  # fmt: skip
        self.client = client
        self.codec = codec  # s3-codec
        self.bucket = bucket
        self.transfer = transfer
        self.multipart_threshold = multipart_threshold
        self.auth = auth
        self.conditional_deletes = True  # False once the store refused IfMatch

    # -- chunks ----------------------------------------------------------------------------------

    def judge(self, key: ChunkKey, md: Mapping[str, str], length: int) -> ChunkMeta | None:
        """The object's metadata, validated (and authenticated with a key); raises
        InvalidObject / AuthFailure."""
        meta = decode_metadata(key, md, length)
        if meta is not None and self.auth is not None:
            payload_tag(md, meta, self.auth)
        return meta

    def head(self, key: ChunkKey, name: str) -> Head:
        resp = self.client.head_object(Bucket=self.bucket, Key=name)
        meta = self.judge(key, resp.get("Metadata", {}), int(resp["ContentLength"]))
        return Head(meta, str(resp.get("ETag", "")))

    def put(self, name: str, meta: ChunkMeta, data: Buffer) -> int:
        """Upload one chunk; returns the bytes stored (less than ``meta.size`` when coded)."""
        coded = None if self.codec == "none" else encode_for_tier(data, self.codec)
        encoding = None if coded is None else coded[0]
        if coded is not None:
            data = coded[1]
        stored = memoryview(data).nbytes
        tag = None
        if self.auth is not None:
            tag = self.auth.payload_tag(mac_version(encoding), meta, data)
        metadata = encode_metadata(meta, tag, self.auth, encoding, stored)
        if stored >= self.multipart_threshold:
            self.client.upload_fileobj(
                io.BytesIO(data), self.bucket, name, ExtraArgs={"Metadata": metadata},
                Config=self.transfer,
            )  # fmt: skip
        else:
            body = data if isinstance(data, bytes | bytearray) else bytes(data)  # boto3: no views
            self.client.put_object(Bucket=self.bucket, Key=name, Body=body, Metadata=metadata)
        return stored

    def get(self, key: ChunkKey, name: str, out: memoryview) -> Head:
        """Read the object into ``out`` and verify it against its own metadata (checksum, and
        the payload tag with a key). Raises CorruptObject (with the ETag as its second
        argument) when the bytes disagree, ObjectChanged when it does not fit ``out``."""
        resp = self.client.get_object(Bucket=self.bucket, Key=name)
        body = resp["Body"]
        try:
            length, md = int(resp["ContentLength"]), resp.get("Metadata", {})
            etag = str(resp.get("ETag", ""))
            meta = self.judge(key, md, length)
            if meta is None:
                return Head(None, etag)
            dst = memoryview(out).cast("B")
            if dst.nbytes < meta.size:
                raise ObjectChanged(meta, f"s3 chunk of {meta.size} bytes, expected {dst.nbytes}")
            encoding = object_encoding(md)
            mac, expected = None, b""
            if self.auth is not None:
                expected = payload_tag(md, meta, self.auth)
                mac = self.auth.payload_mac(mac_version(encoding), meta)
            coded = None if encoding is None else memoryview(bytearray(length))
            if coded is not None:
                dst, chunk = coded, dst  # read the coded bytes aside, decode into the buffer
            filled = 0
            while filled < length:
                step = dst[filled : min(length, filled + _READ_STEP)]
                n = body.readinto(step)
                if not n:
                    raise TierIOError(f"s3 get {name}: short read, {filled} of {length} bytes")
                if mac is not None:
                    mac.update(step[:n])
                filled += n
            if mac is not None and not ObjectAuth.same(mac.digest(), expected):
                raise AuthFailure("payload tag does not verify")
            if coded is not None:
                dst = chunk
                try:
                    head = decode_into(coded, dst[: meta.size])
                except CodecError as exc:
                    raise CorruptObject(f"{encoding}: {exc}", etag) from None
                if head.codec != encoding:
                    raise CorruptObject(f"coded as {head.codec}, metadata says {encoding}", etag)
                length = meta.size
            digest = checksum(dst[:length])
            if digest != meta.checksum:
                why = f"checksum {digest.hex()} != stored {meta.checksum.hex()}"
                raise CorruptObject(why, etag)
            return Head(meta, etag)
        finally:
            body.close()

    def delete_version(self, name: str, etag: str) -> bool:
        """Delete the object if it is still the version ``etag``; False when it changed."""
        if etag and self.conditional_deletes:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=name, IfMatch=etag)
                return True
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code in ("PreconditionFailed", "412"):
                    return False
                if code not in _NO_CONDITION:
                    raise
                self.conditional_deletes = False
        self.client.delete_object(Bucket=self.bucket, Key=name)
        return True

    def list_page(self, prefix: str, token: str | None) -> tuple[list[tuple[str, int]], str | None]:
        args = {"Bucket": self.bucket, "Prefix": f"{prefix}/" if prefix else ""}
        if token:
            args["ContinuationToken"] = token
        resp = self.client.list_objects_v2(**args)
        page = [(o["Key"], int(o["Size"])) for o in resp.get("Contents", [])]
        return page, resp.get("NextContinuationToken") if resp.get("IsTruncated") else None

    # -- sessions --------------------------------------------------------------------------------

    def put_session(self, name: str, obj: SessionObject) -> None:
        body = encode_session(obj)
        tag = None if self.auth is None else self.auth.session_tag(name, body)
        self.client.put_object(
            Bucket=self.bucket, Key=name, Body=body, Metadata=session_metadata(tag)
        )

    def get_session(self, name: str, ns: str, session: bytes, max_ttl_ms: int) -> SessionObject:
        resp = self.client.get_object(Bucket=self.bucket, Key=name)
        body = resp["Body"]
        try:
            if int(resp["ContentLength"]) > MAX_SESSION_BODY:
                raise InvalidObject("session object too large")
            data = body.read(MAX_SESSION_BODY + 1)
        finally:
            body.close()
        if len(data) > MAX_SESSION_BODY:
            raise InvalidObject("session object too large")
        if self.auth is not None:
            check_session_tag(resp.get("Metadata", {}), name, data, self.auth)
        return decode_session(ns, session, data, max_ttl_ms)
