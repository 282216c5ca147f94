"""`megascale executor --driver URL --secret-dir DIR`: a node's executor (started by `launch`,
Kubernetes or Slurm).

The secret directory holds the join token and the driver's certificate (`credentials.py`: a
mounted Kubernetes Secret, `<run_dir>/resilience/executor-secret` on Slurm's shared filesystem,
or the job's secret directory in local mode); no secret is ever
taken on the command line, where `ps` would show it. The work directory defaults to one only
this user can reach: `$XDG_RUNTIME_DIR/megascale/NODE`, else a fresh private directory in the
temporary directory, never a predictable path another user could create first.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from megascale.config.private_files import UnsafePathError
from megascale.resilience.common.api import ApiClient, ApiError
from megascale.resilience.common.credentials import SecretError, load_secret
from megascale.resilience.executor.executor import REQUEST_TIMEOUT_S, Executor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--driver", required=True, help="driver URL, e.g. https://10.0.0.1:29400")
    parser.add_argument(
        "--secret-dir",
        required=True,
        help="directory with the job's token and tls.crt (a mounted Secret, mode 0600 files)",
    )
    parser.add_argument("--node-id", default=os.environ.get("POD_NAME") or socket.gethostname())
    parser.add_argument(
        "--address", help="this node's address for the rendezvous (default: the one that routes to the driver)"
    )
    parser.add_argument(
        "--workdir",
        default="",
        help="per-node files (default: $XDG_RUNTIME_DIR/megascale/NODE, else a new private temporary directory)",
    )
    parser.add_argument("--register-timeout", type=float, default=300.0)
    parser.add_argument(
        "--shared-network",
        action="store_true",
        help="this node shares its interfaces with others (local mode): the traffic rules cannot judge it",
    )


def route_address(driver_url: str) -> str:
    """The local address the kernel would use to reach the driver (no packet is sent)."""
    host = urlparse(driver_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def default_workdir(node_id: str) -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "megascale" / node_id
    return Path(tempfile.mkdtemp(prefix=f"megascale-{node_id}-"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{args.node_id}] %(message)s")
    os.umask(0o077)  # what the executor and its ranks write is this user's only
    try:
        secret = load_secret(args.secret_dir, need_key=False)
        client = ApiClient(args.driver, secret.token, secret.cert_pem, timeout_s=REQUEST_TIMEOUT_S)
        address = args.address or route_address(args.driver)
        workdir = Path(args.workdir) if args.workdir else default_workdir(args.node_id)
        executor = Executor(client, args.node_id, address, workdir, shared_network=args.shared_network)
    except (SecretError, UnsafePathError, ValueError) as exc:
        print(f"megascale executor: {exc}", file=sys.stderr)
        return 2
    try:
        executor.register(args.register_timeout)
    except ApiError as exc:
        print(f"megascale executor: driver refused {args.node_id}: {exc}", file=sys.stderr)
        return 3
    except RuntimeError as exc:
        print(f"megascale executor: {exc}", file=sys.stderr)
        return 1
    return executor.run()
