"""Builds the optional C extensions (the request scanner, the small-command path, the rANS
coder of the lossless codecs); kvstrata falls back to pure Python (or zstd) without them."""

from setuptools import Extension, setup

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
            depends=["kvstrata/server/_fastpath_scan.h", "kvstrata/server/_fastpath_kv.h"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "kvstrata.codecs._rans",
            sources=["kvstrata/codecs/_rans.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
    ]
)
