"""A FAKE accelab server: the fakes of fakes_serve.py (no model, slow on purpose) through the same
runner as `accelab serve` (signals, grace period), for the SIGTERM tests.

    python tests/fake_server.py --kind generate --delay 0.1 --port 0
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from fakes_serve import FAKES  # this script's folder, tests/, is first on sys.path


def main(argv: list[str] | None = None) -> int:
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import run_server

    parser = argparse.ArgumentParser(description="A FAKE accelab server (for tests): no model, slow on purpose.")
    parser.add_argument("--kind", choices=sorted(FAKES), default="embed")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds per batch (per token for generate)")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--grace-period", type=float, default=10.0)
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds the fake model takes to load")
    args = parser.parse_args(argv)
    config = ServeConfig(
        model_name=f"fake-{args.kind}",
        plan_name="fake",
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        grace_period_s=args.grace_period,
    )

    def factory() -> Any:
        time.sleep(args.load_delay)
        return FAKES[args.kind](name=config.model_name, delay_s=args.delay)

    return run_server(config, factory)


if __name__ == "__main__":
    raise SystemExit(main())
