"""Command line: ``kvstrata serve``, ``kvstrata version``, ``kvstrata demo``,
``kvstrata simulate``."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import sys
import time
from pathlib import Path

from kvstrata import __version__
from kvstrata.config import (
    LOG_LEVELS,
    OPTIONS,
    Config,
    ConfigError,
    format_size,
    grouped_options,
    load_config,
    metavar,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata", description="A tiered cache server for LLM KV caches (speaks RESP)."
    )
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser(
        "serve", help="run the server (DRAM + NVMe under --data-dir)",
        usage="kvstrata serve [--config FILE] [--option value ...]  (kvstrata serve --help)",
        description="Run the server. Every option can also be set with its KVSTRATA_* "
        "environment variable or a key of the --config file; flags win. Sizes take B, KiB, "
        "MiB, GiB, TiB or KB, MB, GB (a bare number is bytes); MS, SECONDS and MICROS are "
        "milliseconds, seconds and microseconds. docs/configuration.md lists the same keys.",
    )  # fmt: skip
    serve.add_argument("--config", metavar="FILE", help="TOML config file (env KVSTRATA_CONFIG)")
    for title, options in grouped_options():
        group = serve.add_argument_group(title)
        for opt in options:
            default = opt.fmt(opt.default) if opt.default != "" else "empty"
            group.add_argument(
                f"--{opt.name}", dest=opt.name.replace("-", "_"), metavar=metavar(opt),
                default=None,
                help=f"{opt.doc} (default: {default}; env {opt.env})".replace("%", "%%"),
            )  # fmt: skip
    sub.add_parser("version", help="print the version")
    sub.add_parser(
        "demo", help="multi-turn transformers demo against an embedded server (demo --help)"
    )
    sub.add_parser(
        "simulate", help="capacity planner: replay a trace or workload (simulate --help)"
    )
    return parser


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["serve"]


def unknown_option_message(extras: list[str]) -> str:
    """``unknown option --dram-capcity (did you mean --dram-capacity?)`` for the first
    argument ``serve`` did not take (difflib's closest flag, when one is close)."""
    flags = ["--config", *(f"--{o.name}" for o in OPTIONS)]
    word = next((e for e in extras if e.startswith("-")), extras[0])
    if not word.startswith("-"):
        return f"unexpected argument {word!r} (every value follows its --flag)"
    name = word.split("=", 1)[0]
    close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
    if not close and not name.startswith("--"):
        close = difflib.get_close_matches("-" + name, flags, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else " (see kvstrata serve --help)"
    return f"unknown option {name}{hint}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own options
        return _demo(argv[1:])
    if argv[:1] == ["simulate"]:  # so does the planner
        from kvstrata.sim.cli import main as simulate_main

        return simulate_main(argv[1:])
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras and args.command == "serve":
        _serve_parser(parser).error(unknown_option_message(extras))
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command == "version":
        print(f"kvstrata {__version__}")
        return 0
    if args.command != "serve":
        _parser().print_help()
        return 2
    flags = {o.name: getattr(args, o.name.replace("-", "_")) for o in OPTIONS}
    config_file = args.config or os.environ.get("KVSTRATA_CONFIG") or None
    try:
        config = load_config(flags=flags, config_file=config_file)
    except ConfigError as exc:
        print(f"kvstrata: configuration error: {exc}", file=sys.stderr)
        return 2
    return serve(config, config_file or "")


def _demo(argv: list[str]) -> int:
    from kvstrata.demo import main as demo_main  # imports neither torch nor transformers

    return demo_main(argv)


def serve(config: Config, config_file: str = "") -> int:
    logging.basicConfig(
        level=LOG_LEVELS[config.loglevel],
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
    )
    log = logging.getLogger("kvstrata")
    try:
        import uvloop

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    from kvstrata.server.app import Server

    async def run() -> None:
        server = Server(config, config_file)
        runner = asyncio.ensure_future(server.run(install_signals=True))
        for step, line in ((server.wait_listening, _listening_line), (server.wait_ready, None)):
            waiter = asyncio.ensure_future(step())
            await asyncio.wait([runner, waiter], return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done() or runner.done():
                waiter.cancel()
                break
            log.info(line(server) if line else _startup_line(server, loop_name))
        await runner

    try:
        asyncio.run(run())
    except ConfigError as exc:
        print(f"kvstrata: configuration error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvstrata: cannot start: {exc}", file=sys.stderr)
        return 1
    except _startup_errors() as exc:
        print(f"kvstrata: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _startup_errors() -> tuple[type[BaseException], ...]:
    from kvstrata.tiers.base import TierError

    return (TierError,)


def _listening_line(server: object) -> str:
    from kvstrata.server.app import Server

    assert isinstance(server, Server)
    return (
        f"kvstrata {__version__} listening on {server.config.bind} port={server.port}; loading "
        "(building the tiers, indexing NVMe): KV commands get -LOADING until ready"
    )


def _startup_line(server: object, loop_name: str) -> str:
    from kvstrata.server.app import Server

    assert isinstance(server, Server)
    cfg = server.config
    tiers = "none (KV.* disabled)"
    if server.store is not None:
        tiers = ", ".join(
            f"{t.name} {format_size(t.capacity) if t.capacity else 'unbounded'}"
            for t in getattr(server.store, "tiers", [])
        )
    parts = [
        f"kvstrata {__version__} ready on {cfg.bind} port={server.port}",
        f"tls-port={server.tls_port}" if server.tls_port else "tls=off",
        f"auth={'on' if cfg.requirepass else 'off'}",
        f"protected-mode={'yes' if cfg.protected_mode else 'no'}",
        f"data-dir={Path(cfg.data_dir).resolve()}",
        f"tiers: {tiers}",
        f"loop={loop_name}",
        f"loaded in {time.time() - server.loading_start_time:.2f}s",
    ]
    return " ".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
