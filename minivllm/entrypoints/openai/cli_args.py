"""``minivllm serve``'s own options (vLLM's ``cli_args.py``); the engine options come from
the shared engine argument group. Kept free of heavy imports, so building the CLI parser
does not need the server's dependencies."""

from __future__ import annotations

import argparse


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the name(s) clients send as `model`, the first one in replies (default: "
        "--model; the bundled model answers to SmolLM2-135M-Instruct and its Hub id "
        "HuggingFaceTB/SmolLM2-135M-Instruct)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument(
        "--api-key",
        default=None,
        help="ask clients of /v1/* for this key (Authorization: Bearer KEY), like vLLM's; "
        "/health, /ping, /metrics, /version, /tokenize and /detokenize stay open, and the "
        "live page shows prompts and outputs only with the key: open it as /#key=KEY "
        "(default: no key)",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, queues, KV usage) in the log",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM or Ctrl-C, seconds requests in flight get to finish before they "
        "are aborted (default: 10)",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
