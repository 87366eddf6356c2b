"""Builds the optional C request scanner; kvstrata falls back to pure Python without it."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstrata.protocol._cresp",
            sources=["kvstrata/protocol/_cresp.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
