"""Resolving the configuration: defaults < TOML file < environment < flags, each value parsed
with its key's parser, then the rules across keys (:class:`Config`, :func:`load_config`).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.buffer_limits import BufferLimits
from kvstrata.config.table import _BY_NAME, OPTIONS, Option
from kvstrata.config.values import ConfigError, format_size


@dataclass(slots=True)
class Config:
    """Resolved settings; attribute names are the dashed names with underscores."""

    values: dict[str, Any]

    def __getattr__(self, attr: str) -> Any:
        try:
            return self.values[attr.replace("_", "-")]
        except KeyError:
            raise AttributeError(attr) from None

    def get(self, name: str) -> Any:
        return self.values[name]

    def set(self, name: str, raw: Any, check: bool = True) -> None:
        """Validate and set (CONFIG SET); raises ConfigError. With ``check=False`` the rules
        across keys are left to a later :meth:`check` (a CONFIG SET of several keys)."""
        opt = _BY_NAME.get(name)
        if opt is None:
            raise ConfigError(f"Unknown option or number of arguments for CONFIG SET - '{name}'")
        if not opt.mutable:
            raise ConfigError(
                f"CONFIG SET failed (possibly related to argument '{name}') - "
                "can't set immutable config"
            )
        self.values[name] = _merge(self.values.get(name), _parse(opt, raw))
        if check:
            _check(self.values)

    def check(self) -> None:
        """Rules across keys (low watermarks below high ones, TLS files with a TLS port)."""
        _check(self.values)

    def render(self, name: str) -> str:
        """The value as CONFIG GET prints it."""
        return _BY_NAME[name].fmt(self.values[name]) if name in _BY_NAME else ""

    def items(self) -> list[tuple[str, str]]:
        return [(o.name, o.fmt(self.values[o.name])) for o in OPTIONS]

    @property
    def nvme_dir(self) -> Path:
        return Path(self.values["nvme-path"] or Path(self.values["data-dir"]) / "nvme")

    @property
    def binds(self) -> list[str]:
        return str(self.values["bind"]).split()


def _parse(opt: Option, raw: Any) -> Any:
    try:
        return opt.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"invalid value for '{opt.name}': {exc}") from None


def _merge(old: Any, new: Any) -> Any:
    """A value that names only part of a key (some classes of client-output-buffer-limit)
    keeps the rest of the old one."""
    if isinstance(new, BufferLimits) and isinstance(old, BufferLimits):
        return new.merged_into(old)
    return new


def _check(values: Mapping[str, Any]) -> None:
    for tier in ("gpu", "dram", "nvme"):
        lo, hi = values[f"{tier}-low-watermark"], values[f"{tier}-high-watermark"]
        if lo > hi:
            raise ConfigError(
                f"invalid value for '{tier}-low-watermark': {lo} is above "
                f"{tier}-high-watermark ({hi})"
            )
    if values["chunk-tokens"] < values["min-chunk-tokens"]:
        raise ConfigError(
            f"invalid value for 'min-chunk-tokens': {values['min-chunk-tokens']} is above "
            f"chunk-tokens ({values['chunk-tokens']})"
        )
    if values["kv-events-replay-endpoint"] and not values["kv-events-endpoint"]:
        raise ConfigError("invalid value for 'kv-events-replay-endpoint': needs kv-events-endpoint")
    if values["tls-port"] and not (values["tls-cert-file"] and values["tls-key-file"]):
        raise ConfigError("invalid value for 'tls-port': needs tls-cert-file and tls-key-file")
    if values["tls-port"] and values["tls-auth-clients"] != "no" and not values["tls-ca-cert-file"]:
        # Redis refuses this too: no client certificate could ever be verified
        raise ConfigError(
            f"invalid value for 'tls-auth-clients': {values['tls-auth-clients']} needs "
            "tls-ca-cert-file (the CA that signs client certificates)"
        )


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> Config:
    """Resolve defaults < TOML file < environment < flags. Keys in ``flags`` are dashed."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {o.name: o.default for o in OPTIONS}
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if config_file:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        layers.append((f"{path}", {k.replace("_", "-"): v for k, v in data.items()}))
    prefix = "KVSTRATA_"
    layers.append(("environment", {
        k[len(prefix):].lower().replace("_", "-"): v for k, v in env.items()
        if k.startswith(prefix) and k not in ("KVSTRATA_CONFIG",)
    }))  # fmt: skip
    layers.append(("command line", dict(flags or {})))
    for source, layer in layers:
        for name, raw in layer.items():
            if raw is None:
                continue
            opt = _BY_NAME.get(name)
            if opt is None:
                if source == "environment":
                    continue  # foreign KVSTRATA_* variables are not ours to judge
                close = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.6)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"unknown key '{name}' in {source}{hint}")
            values[name] = _merge(values[name], _parse(opt, raw))
    _check(values)
    _check_dram_floor(values)
    return Config(values)


#: KV bytes per token the smallest DRAM arena must hold for one chunk of ``min-chunk-tokens``
#: (64 KiB: fp16 KV of a 1–3B model; a 7B-class model's is 128–512 KiB)
FLOOR_BYTES_PER_TOKEN = 64 * 1024


def dram_floor(min_chunk_tokens: int) -> int:
    """The smallest ``dram-capacity`` accepted: one chunk of ``min-chunk-tokens`` tokens at
    :data:`FLOOR_BYTES_PER_TOKEN` (1 MiB with the default 16)."""
    return min_chunk_tokens * FLOOR_BYTES_PER_TOKEN


def _check_dram_floor(values: Mapping[str, Any]) -> None:
    """Refuse an arena too small for one chunk (``--dram-capacity 12`` is 12 bytes, not GiB).
    Checked at start only: dram-capacity cannot change at run time."""
    size, tokens = values["dram-capacity"], values["min-chunk-tokens"]
    floor = dram_floor(tokens)
    if size >= floor:
        return
    hint = ""
    if size and size * 1024**3 >= floor:
        hint = f"; a size without a unit is in bytes: write {size}GiB for {size} GiB"
    raise ConfigError(
        f"invalid value for 'dram-capacity': {size} bytes is below the smallest arena, "
        f"{format_size(floor)} (one chunk of min-chunk-tokens = {tokens} tokens at "
        f"{FLOOR_BYTES_PER_TOKEN // 1024} KiB of KV per token){hint}"
    )
