"""`gateway serve`: flags and/or a YAML file → a frozen config → the app on uvloop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .config import DEFAULT_POLICY, POLICY_NAMES, ConfigError, GatewayConfig, from_mapping, load_yaml
from .limits import raise_fd_limit
from .tokens import check_sources

if TYPE_CHECKING:
    from .control import ControlPlane

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible, replica-aware gateway for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--replica", action="append", metavar="URL", help="a replica's base URL (repeat for more)")
    serve.add_argument("--config", metavar="FILE", help="YAML config file (flags override it)")
    serve.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument("--policy", choices=POLICY_NAMES, help=f"routing policy (default {DEFAULT_POLICY})")
    serve.add_argument("--default-max-tokens", type=int, help="output budget for requests that name none")
    serve.add_argument("--queue-size", type=int, help="admission queue bound (0: no queue)")
    serve.add_argument("--api-key", action="append", metavar="KEY", help="accept this client key (repeatable)")
    serve.add_argument("--upstream-api-key", metavar="KEY", help="send this key to the replicas")
    serve.add_argument("--admin-key", metavar="KEY", help="turn on the admin API (/admin/replicas) for this key")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    serve.add_argument("--workers", metavar="N", help="worker processes on the one port (default 1; auto: one per CPU)")
    serve.add_argument("--otlp-traces-endpoint", metavar="URL",
                       help="export OpenTelemetry spans here (OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces)")
    serve.add_argument("--trace-sample-ratio", type=float, metavar="R",
                       help="share of new traces recorded (default 1.0; a client's sampled flag is followed)")
    return parser


def build_config(args: argparse.Namespace) -> GatewayConfig:
    """The config file's values, with the flags given on the command line on top."""
    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {args.config!r} must hold a mapping")
    if args.replica:
        data["replicas"] = list(data.get("replicas") or []) + list(args.replica)
    for flag, key in (("host", "host"), ("port", "port"), ("policy", "policy"),
                      ("default_max_tokens", "default_max_tokens"), ("upstream_api_key", "upstream_api_key"),
                      ("admin_key", "admin_key"), ("log_level", "log_level")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    if args.api_key:
        data["api_keys"] = list(args.api_key)
    if args.workers is not None:
        data["workers"] = args.workers
    for flag, key in (("otlp_traces_endpoint", "endpoint"), ("trace_sample_ratio", "sampling_ratio")):
        if getattr(args, flag) is not None:
            data["tracing"] = {**(data.get("tracing") or {}), key: getattr(args, flag)}
    if args.queue_size is not None:
        data["queue"] = {**(data.get("queue") or {}), "max_size": args.queue_size}
    return from_mapping(data)


def serve(config: GatewayConfig, reload: Callable[[], GatewayConfig] | None = None) -> None:
    """One process, or a supervisor and `config.workers` workers (gateway/workers.py); SIGHUP calls `reload`."""
    import uvloop

    from .workers import serve_workers

    try:
        if config.workers > 1:
            serve_workers(config, reload)
        else:
            uvloop.run(_serve(config, reload))
    except OSError as exc:  # the address is taken, or not ours to listen on
        sys.exit(f"gateway: cannot serve on {config.host}:{config.port}: {exc.strerror or exc}")


async def _serve(config: GatewayConfig, reload: Callable[[], GatewayConfig] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully (requests in flight get up to 30 s to finish)."""
    from .app import freeze_startup_objects, running

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(config) as (gateway, port):
        freeze_startup_objects()
        loop.add_signal_handler(signal.SIGHUP, _reloader(gateway.control, reload))
        logger.info("gateway on %s:%d, policy %s, replicas %s", config.host, port, config.policy,
                    ", ".join(r.url for r in config.replicas) or "(from DNS)")
        await stop.wait()
        logger.info("stopping: finishing the requests in flight")


def _reloader(control: ControlPlane | None, reload: Callable[[], GatewayConfig] | None) -> Callable[[], None]:
    """SIGHUP in one process: the config file's replicas and discovery entries apply at once."""
    def on_hup() -> None:
        if control is None or reload is None:
            return
        try:
            control.reload(reload())
        except ValueError as exc:
            logger.error("SIGHUP: the new configuration is not valid, keeping the old one: %s", exc)
            return
        logger.info("SIGHUP: replicas reloaded (other settings change with a restart, or with --workers > 1)")
    return on_hup


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        config = build_config(args)
        check_sources(config.tokenizer_map())  # here: with --workers, a worker finding it would only be restarted
    except ConfigError as exc:
        print(f"gateway: bad configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_fd_limit()  # here, in the first process, before the workers start (they inherit it) or files are opened
    serve(config, lambda: build_config(args))


if __name__ == "__main__":
    main()
