"""TEST SCAFFOLDING, never installed: a stand-in for ``torchvision``. PyPI's torchvision is a CUDA
build that fails to import beside the CPU torch (``operator torchvision::nms does not exist``),
and SGLang 0.5.23 imports it at launch for its vision models (``sglang/srt/configs/__init__.py``
→ ``nano_nemotron_vl.py`` → ``sglang/srt/multimodal/internvl_utils.py``: ``import
torchvision.transforms as T``; others use ``transforms.v2.functional``, ``ops.boxes``, ``io``).
A text-only model never calls into it: every name here is a placeholder class that raises when
called. There is no ``torchvision`` dist-info, so transformers' ``is_torchvision_available()``
stays False and its fast image processors are never chosen.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__version__ = "0.0.0+kvstrata-test-shim"


class _Missing(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{cls.__qualname__}: torchvision is a test stub here (no images)")


def _missing(name: str) -> Any:
    return _Missing(name, (), {"__module__": "torchvision", "__qualname__": name})


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__getattr__ = lambda attr: _missing(f"{name}.{attr}")  # type: ignore[method-assign]
    mod.__path__ = []  # a package, so that submodules resolve
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, mod)
    return mod


for _name in (
    "transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional",
    "ops", "ops.boxes", "io", "datasets", "models", "utils",
):  # fmt: skip
    _module(f"{__name__}.{_name}")


def __getattr__(attr: str) -> Any:
    return _missing(f"torchvision.{attr}")
