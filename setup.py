"""Builds the optional C extensions (the request scanner, the small-command path); kvstrata
falls back to pure Python without them."""

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
    ]
)
