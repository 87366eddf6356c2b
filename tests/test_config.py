"""Configuration: TOML < environment < flags, validation messages, CONFIG GET/SET, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

import kvstrata
from kvstrata.config import OPTIONS, ConfigError, format_size, load_config, option_names, parse_size
from tests.conftest import RunningServer


def test_precedence_flags_over_env_over_toml(tmp_path: Path) -> None:
    toml = tmp_path / "kvstrata.toml"
    toml.write_text('port = 7000\ndram_capacity = "2GiB"\nloglevel = "warning"\n')
    env = {"KVSTRATA_PORT": "7100", "KVSTRATA_DRAM_CAPACITY": "3GiB", "HOME": "/x"}
    cfg = load_config(flags={"port": "7200"}, env=env, config_file=toml)
    assert cfg.port == 7200  # flag
    assert cfg.dram_capacity == 3 * 1024**3  # environment over file
    assert cfg.loglevel == "warning"  # file over default
    assert cfg.bind == "127.0.0.1"  # default


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"port": "70000"}, "invalid value for 'port': 70000 is out of range"),
        ({"dram-capacity": "lots"}, "invalid value for 'dram-capacity': 'lots' is not a size"),
        ({"bind": "example.com"}, "invalid value for 'bind': 'example.com' is not an IP"),
        ({"protected-mode": "maybe"}, "invalid value for 'protected-mode': 'maybe' is not a bool"),
        (
            {"dram-low-watermark": "0.99", "dram-high-watermark": "0.5"},
            "invalid value for 'dram-low-watermark'",
        ),
        ({"tls-port": "6380"}, "invalid value for 'tls-port': needs tls-cert-file"),
    ],
)
def test_bad_values_name_the_key(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(flags=flags, env={})
    assert message in str(info.value)


def test_unknown_keys(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("dram_capacityy = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'dram-capacityy'"):
        load_config(env={}, config_file=toml)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(env={}, config_file=tmp_path / "missing.toml")
    # foreign KVSTRATA_* variables are ignored, not fatal
    assert load_config(env={"KVSTRATA_SOMETHING_ELSE": "1"}).port == 7379


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("65536", 65536), ("4GiB", 4 * 1024**3), ("512mb", 512 * 10**6),
     ("1.5KiB", 1536), ("2 MiB", 2 * 1024**2)],
)  # fmt: skip
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_format_size_round_trips() -> None:
    for n in (0, 1, 4096, 3 * 1024**2, 5 * 1024**3):
        assert parse_size(format_size(n)) == n


def test_config_get_all_and_set(server: RunningServer) -> None:
    r = redis.Redis(port=server.port, protocol=3, decode_responses=True)
    every = r.config_get("*")
    secrets = {"requirepass", "s3-auth-key"}  # shown by exact name only
    assert set(option_names()) - secrets <= set(every)
    assert every["dram-capacity"] == "64MiB" and every["port"] == str(server.port)
    assert every["protected-mode"] == "yes"  # Redis's yes/no, not Python's True/False
    assert every["proto-max-bulk-len"] == str(1024**3)  # Redis prints these in bytes
    assert every["save"] == "" and every["appendonly"] == "no"  # read by redis-benchmark
    assert r.config_set("timeout", 5) and r.config_get("timeout") == {"timeout": "5"}
    with pytest.raises(redis.ResponseError, match="immutable"):
        r.config_set("port", 1234)


def test_idle_timeout_closes_idle_clients(make_server) -> None:
    srv = make_server(timeout=1)
    idle = redis.Redis(port=srv.port)
    assert idle.ping()
    before = set(srv.server.clients)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(srv.server.clients) & before:
        time.sleep(0.2)
    assert not set(srv.server.clients) & before  # the idle connection was closed


def test_cli_version_and_help() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstrata", "version"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("kvstrata ")
    serve_help = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--help"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert "--dram-capacity" in serve_help.stdout and "--requirepass" in serve_help.stdout


def test_cli_version_flag_and_help_metavars_choices_and_env_names() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstrata", "--version"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert (out.returncode, out.stdout.strip()) == (0, f"kvstrata {kvstrata.__version__}")
    text = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--help"], capture_output=True, text=True,
        timeout=60,
    ).stdout  # fmt: skip
    assert "VALUE" not in text
    flat = " ".join(text.split())
    for fragment in (
        "--dram-capacity SIZE", "--nvme-fsync {always,batch,never}", "--port PORT",
        "--protected-mode yes|no", "--dram-high-watermark RATIO", "--data-dir PATH",
        "--shutdown-timeout SECONDS", "env KVSTRATA_DRAM_CAPACITY)", "env KVSTRATA_NVME_FSYNC)",
    ):  # fmt: skip
        assert fragment in flat, fragment
    for opt in OPTIONS:  # every option names its environment variable
        assert f"env {opt.env}" in flat, opt.name


def test_kvstrata_config_variable_names_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('dram-capacity = "lots"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--port", "0"], capture_output=True,
        text=True, timeout=60, env={**os.environ, "KVSTRATA_CONFIG": str(config)},
    )  # fmt: skip
    assert proc.returncode == 2 and "invalid value for 'dram-capacity'" in proc.stderr


def test_unwritable_data_dir_stops_startup(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--port", "0",
         "--data-dir", str(blocker / "sub")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "cannot start" in proc.stderr and "data-dir" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_set_of_several_keys_is_order_free_and_all_or_nothing(server) -> None:
    """Rules across keys hold for the whole CONFIG SET, in any order; a failing pair leaves
    every value as it was and its secrets never reach the slow log."""
    r = redis.Redis(port=server.port, decode_responses=True)
    assert (
        r.execute_command(
            "CONFIG", "SET", "dram-high-watermark", "0.5", "dram-low-watermark", "0.4"
        )
        == "OK"
    )
    assert r.config_get("dram-*watermark") == {
        "dram-high-watermark": "0.5", "dram-low-watermark": "0.4"}  # fmt: skip
    r.config_set("slowlog-log-slower-than", 0)
    with pytest.raises(redis.ResponseError):
        r.execute_command("CONFIG", "SET", "maxclients", "x", "requirepass", "s3cret")
    assert r.config_get("maxclients") == {"maxclients": "10000"}
    assert r.config_get("requirepass") == {"requirepass": ""}
    logged = str(r.slowlog_get(128))
    assert "s3cret" not in logged and "redacted" in logged


def test_clearing_requirepass_frees_waiting_clients(make_server) -> None:
    srv = make_server(requirepass="pw")
    admin = redis.Redis(port=srv.port, password="pw")
    waiting = redis.Redis(port=srv.port)
    with pytest.raises(redis.AuthenticationError):
        waiting.ping()
    admin.config_set("requirepass", "")
    assert waiting.ping() and waiting.set("k", "v" * 100_000)


def test_config_set_loglevel_takes_effect(server) -> None:
    import logging

    r = redis.Redis(port=server.port)
    r.config_set("loglevel", "debug")
    assert logging.getLogger("kvstrata").getEffectiveLevel() == logging.DEBUG
    r.config_set("loglevel", "warning")
    assert logging.getLogger("kvstrata").getEffectiveLevel() == logging.WARNING


# -- booleans are not numbers (TOML's true is Python's 1) ---------------------------------------

NUMBER_KEYS = [o.name for o in OPTIONS if type(o.default) in (int, float)]


@pytest.mark.parametrize("name", NUMBER_KEYS)
def test_a_toml_boolean_is_refused_for_every_size_count_and_duration(
    name: str, tmp_path: Path
) -> None:
    """``nvme-capacity = true`` used to run with a 1-byte NVMe tier (and ``= false`` with the
    tier off): every numeric key refuses a boolean, naming the key and what to write."""
    assert "nvme-capacity" in NUMBER_KEYS and "dram-high-watermark" in NUMBER_KEYS
    for value in ("true", "false"):
        toml = tmp_path / f"{value}.toml"
        toml.write_text(f"{name} = {value}\n")
        with pytest.raises(ConfigError) as err:
            load_config(env={}, config_file=toml)
        assert str(err.value).startswith(f"invalid value for '{name}': {value} is a boolean, not ")
        assert ": write " in str(err.value)


def test_a_boolean_size_in_the_config_file_stops_serve(tmp_path: Path) -> None:
    toml = tmp_path / "kvstrata.toml"
    toml.write_text("nvme-capacity = true\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata", "serve", "--port", "0", "--config", str(toml),
         "--data-dir", str(tmp_path / "data"), "--dram-capacity", "8MiB"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "kvstrata: configuration error: invalid value for 'nvme-capacity': true is a boolean, "
        'not a size: write a size such as 0, 65536, "512MiB" or "4GiB"'
    ]


def test_boolean_words_are_refused_from_flags_env_and_config_set(server: RunningServer) -> None:
    """Flags, environment and CONFIG SET carry text: ``true`` is no size there either, and
    a value set from Python (as the TOML layer does) is held to the same rule."""
    refused = r"invalid value for 'nvme-capacity': '(true|yes)' is not a size"
    with pytest.raises(ConfigError, match=refused):
        load_config(flags={"nvme-capacity": "true"}, env={})
    with pytest.raises(ConfigError, match=refused):
        load_config(env={"KVSTRATA_NVME_CAPACITY": "yes"})
    cfg = load_config(env={})
    with pytest.raises(ConfigError, match="'prefetch-bandwidth': true is a boolean"):
        cfg.set("prefetch-bandwidth", True)
    assert cfg.get("prefetch-bandwidth") == 0
    r = redis.Redis(port=server.port, decode_responses=True)
    for key in ("prefetch-bandwidth", "lease-ttl", "dram-high-watermark"):
        before = r.config_get(key)
        with pytest.raises(redis.ResponseError, match=key):
            r.config_set(key, "true")
        assert r.config_get(key) == before


@pytest.mark.parametrize("value", ["inf", "nan", "7379.5"])
def test_a_toml_float_is_no_integer(value: str, tmp_path: Path) -> None:
    toml = tmp_path / "kvstrata.toml"
    toml.write_text(f"port = {value}\n")
    with pytest.raises(ConfigError, match=r"invalid value for 'port': .* is not an integer"):
        load_config(env={}, config_file=toml)
