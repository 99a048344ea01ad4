"""`python -m connector.router`: run the push-aware router with uvicorn.

    python -m connector.router --port 8000 \\
        --prefill http://p0:8100,engine_id=prefill-0,side_channel=p0:5600 \\
        --prefill http://p1:8100,engine_id=prefill-1,side_channel=p1:5600 \\
        --decode http://d0:8200 --decode http://d1:8200 \\
        --otlp-traces-endpoint http://jaeger:4317
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from connector.router.config import ConfigError, RouterConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m connector.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", default=[], metavar="URL,engine_id=ID,side_channel=H:P",
                   help="a P engine (repeat for several; round-robin). Optional tp_size=N, pp_size=N")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a D engine URL (repeat for several; round-robin)")
    p.add_argument("--config", type=Path, help='JSON: {"prefill": [{"url", "engine_id", "side_channel"}], '
                                               '"decode": [URL, ...]} (added to the flags)')
    p.add_argument("--otlp-traces-endpoint", help="OTLP endpoint for the router's spans "
                   "(protocol from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, default grpc); off when not given")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to an engine")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one leg")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = RouterConfig.from_args(args.prefill, args.decode, args.config,
                                        connect_timeout_s=args.connect_timeout,
                                        request_timeout_s=args.request_timeout)
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    import logging

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from connector.router.app import build_app
    from connector.router.tracing import RouterTracing

    app = build_app(config, RouterTracing(args.otlp_traces_endpoint))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
