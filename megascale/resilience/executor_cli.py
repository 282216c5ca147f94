"""`megascale executor --driver URL`: a node's executor (started by `launch`, Kubernetes or Slurm).

The token comes from `--token-file` or `$MEGASCALE_DRIVER_TOKEN` (a Kubernetes secret, a file
on a shared filesystem); it is never taken on the command line, where `ps` would show it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from megascale.resilience.api import ApiClient, ApiError
from megascale.resilience.executor import Executor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--driver", required=True, help="driver URL, e.g. http://10.0.0.1:29400")
    parser.add_argument("--token-file", help="file holding the driver's token "
                                             "(default: $MEGASCALE_DRIVER_TOKEN)")
    parser.add_argument("--node-id", default=os.environ.get("POD_NAME") or socket.gethostname())
    parser.add_argument("--address", help="this node's address for the rendezvous "
                                          "(default: the one that routes to the driver)")
    parser.add_argument("--workdir", default="", help="per-node files (default: /tmp/megascale/NODE)")
    parser.add_argument("--register-timeout", type=float, default=300.0)
    parser.add_argument("--shared-network", action="store_true",
                        help="this node shares its interfaces with others (local mode): "
                             "the traffic rules cannot judge it")


def route_address(driver_url: str) -> str:
    """The local address the kernel would use to reach the driver (no packet is sent)."""
    host = urlparse(driver_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{args.node_id}] %(message)s")
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    else:
        token = os.environ.get("MEGASCALE_DRIVER_TOKEN", "")
    if not token:
        print("megascale executor: no token (--token-file or $MEGASCALE_DRIVER_TOKEN)", file=sys.stderr)
        return 2
    address = args.address or route_address(args.driver)
    workdir = Path(args.workdir or f"/tmp/megascale/{args.node_id}")
    executor = Executor(ApiClient(args.driver, token), args.node_id, address, workdir,
                        shared_network=args.shared_network)
    try:
        executor.register(args.register_timeout)
    except ApiError as exc:
        print(f"megascale executor: driver refused {args.node_id}: {exc}", file=sys.stderr)
        return 3
    except RuntimeError as exc:
        print(f"megascale executor: {exc}", file=sys.stderr)
        return 1
    return executor.run()
