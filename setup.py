"""Builds the optional C extensions (the request scanner, the small-command path, the rANS
coder of the lossless codecs, the client's fused copy and checksum, the NVMe tier's
I/O pool); kvstrata falls back to
pure Python (or zstd) without them."""

import platform

from setuptools import Extension, setup

# the client's copy + xxh3-128 (kvstrata/clients/_copysum.c) over the vendored xxHash; on x86 its
# runtime dispatch picks SSE2/AVX2/AVX-512 as Python's xxhash wheel does
_XXH = "kvstrata/clients/_xxhash"
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
_COPYSUM_SOURCES = ["kvstrata/clients/_copysum.c", f"{_XXH}/xxhash.c"]
_COPYSUM_MACROS = [("XXH_NAMESPACE", "kvs_copysum_")]
if _X86:
    _COPYSUM_SOURCES.append(f"{_XXH}/xxh_x86dispatch.c")
    _COPYSUM_MACROS.append(("KVS_XXH_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "kvstrata.protocol._cresp",
            sources=["kvstrata/protocol/_cresp.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "kvstrata.server._fastpath",
            sources=["kvstrata/server/_fastpath.c"],
            depends=[
                "kvstrata/server/_fastpath_scan.h",
                "kvstrata/server/_fastpath_kv.h",
                "kvstrata/server/_fastpath_conn.h",
            ],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "kvstrata.codecs._rans",
            sources=["kvstrata/codecs/_rans.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        Extension(
            "kvstrata.clients._copysum",
            sources=_COPYSUM_SOURCES,
            depends=[f"{_XXH}/xxhash.h", f"{_XXH}/xxh_x86dispatch.h"],
            define_macros=_COPYSUM_MACROS,
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "kvstrata.tiers._iopool",
            sources=["kvstrata/tiers/_iopool.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
