# kvstrata server image: python:3.11-slim, no torch, with the S3 tier (boto3) and the
# Prometheus endpoint (prometheus-client; KVSTRATA_METRICS_PORT turns it on).
#
#   docker build -t kvstrata .
#   docker run --rm -p 127.0.0.1:7379:7379 --shm-size 2g -e KVSTRATA_REQUIREPASS=secret kvstrata
#
# Every setting is a flag of `kvstrata serve` or a KVSTRATA_<KEY> environment variable
# (docs/configuration.md). The server binds 0.0.0.0 inside the container; with an empty
# KVSTRATA_REQUIREPASS protected mode refuses every client that is not on the container's own
# loopback, so set a password to reach it through a published port. The DRAM tier lives in
# /dev/shm: give the container a --shm-size above KVSTRATA_DRAM_CAPACITY (Docker's default is
# 64 MiB).

FROM python:3.11-slim AS build
# A compiler for the optional C request scanner (kvstrata falls back to pure Python without it).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[s3,metrics]"

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin kvstrata \
    && mkdir -p /data && chown kvstrata:kvstrata /data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "kvstrata[s3,metrics]" \
    && rm -rf /wheels
# PING over RESP (AUTH first when a password is set); exit 0 only on +PONG.
RUN printf '%s\n' \
    '#!/usr/bin/env python3' \
    'import os, socket, sys' \
    'def cmd(*words):' \
    '    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)' \
    'password = os.environ.get("KVSTRATA_REQUIREPASS", "").encode()' \
    'port = int(os.environ.get("KVSTRATA_PORT", "7379"))' \
    'with socket.create_connection(("127.0.0.1", port), timeout=3) as s:' \
    '    s.sendall((cmd(b"AUTH", password) if password else b"") + cmd(b"PING"))' \
    '    reply = b""' \
    '    while b"PONG" not in reply and b"\n-" not in b"\n" + reply:' \
    '        data = s.recv(4096)' \
    '        if not data:' \
    '            break' \
    '        reply += data' \
    'sys.exit(0 if b"+PONG" in reply else 1)' \
    > /usr/local/bin/kvstrata-healthcheck \
    && chmod 0755 /usr/local/bin/kvstrata-healthcheck

USER kvstrata
WORKDIR /data
ENV PYTHONUNBUFFERED=1 \
    KVSTRATA_DATA_DIR=/data
VOLUME ["/data"]
EXPOSE 7379
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["kvstrata-healthcheck"]
ENTRYPOINT ["kvstrata", "serve"]
CMD ["--bind", "0.0.0.0", "--port", "7379", "--data-dir", "/data"]
