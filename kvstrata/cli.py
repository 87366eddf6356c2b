"""Command line: ``kvstrata serve``, ``kvstrata version``, ``kvstrata demo``,
``kvstrata simulate``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from kvstrata import __version__
from kvstrata.config import LOG_LEVELS, OPTIONS, Config, ConfigError, format_size, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata", description="A tiered cache server for LLM KV caches (speaks RESP)."
    )
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the server (DRAM + NVMe under --data-dir)")
    serve.add_argument("--config", metavar="FILE", help="TOML config file")
    for opt in OPTIONS:
        serve.add_argument(
            f"--{opt.name}", dest=opt.name.replace("-", "_"), metavar="VALUE", default=None,
            help=f"{opt.doc} (default: {opt.fmt(opt.default) if opt.default != '' else 'empty'})",
        )  # fmt: skip
    sub.add_parser("version", help="print the version")
    sub.add_parser(
        "demo", help="multi-turn transformers demo against an embedded server (demo --help)"
    )
    sub.add_parser(
        "simulate", help="capacity planner: replay a trace or workload (simulate --help)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own options
        return _demo(argv[1:])
    if argv[:1] == ["simulate"]:  # so does the planner
        from kvstrata.sim.cli import main as simulate_main

        return simulate_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(f"kvstrata {__version__}")
        return 0
    if args.command != "serve":
        _parser().print_help()
        return 2
    flags = {o.name: getattr(args, o.name.replace("-", "_")) for o in OPTIONS}
    try:
        config = load_config(flags=flags, config_file=args.config)
    except ConfigError as exc:
        print(f"kvstrata: configuration error: {exc}", file=sys.stderr)
        return 2
    return serve(config, args.config or "")


def _demo(argv: list[str]) -> int:
    try:
        from kvstrata.demo import main as demo_main
    except ImportError as exc:
        print(f"kvstrata demo needs the 'hf' extra: pip install 'kvstrata[hf]' ({exc})")
        return 2
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
        ready = asyncio.ensure_future(server.wait_ready())
        await asyncio.wait([runner, ready], return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and not runner.done():
            log.info(_startup_line(server, loop_name))
        else:
            ready.cancel()
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
    ]
    return " ".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
