"""A request flood from one source address, in its own process (so that it takes no GIL from the
victim node the test runs beside it): `python -m tests.security.flood PORT SOURCE CONNECTIONS
SECONDS PIPELINED` with the raw request on stdin; prints the answers counted by status as JSON.

Each connection is TLS without a certificate check (an attacker's), bound to SOURCE, sends
PIPELINED copies of the request at once and one more behind each 200, and reconnects when the
driver closes it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


async def _one(
    port: int, source: str, raw: bytes, pipelined: int, stop_at: float, delay: float, seen: Counter[str]
) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    await asyncio.sleep(delay)
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=ctx, local_addr=(source, 0)), 5
            )
            writer.write(raw * pipelined)
            while time.monotonic() < stop_at and (line := await asyncio.wait_for(reader.readline(), 5)):
                if line.startswith(b"HTTP/1.1 "):
                    status = line.split()[1].decode()
                    seen[status] += 1
                    if status == "200":  # else the driver closes the connection: reconnect
                        writer.write(raw)
            writer.close()
        except (OSError, asyncio.TimeoutError, ssl.SSLError):
            seen["dropped"] += 1
            await asyncio.sleep(0.05)


async def _flood(port: int, source: str, raw: bytes, connections: int, seconds: float, pipelined: int) -> Counter[str]:
    seen: Counter[str] = Counter()
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(_one(port, source, raw, pipelined, stop_at, i * 0.004, seen) for i in range(connections)))
    return seen


def start(port: int, source: str, raw: bytes, connections: int, seconds: float, pipelined: int = 1) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.security.flood",
            str(port),
            source,
            str(connections),
            str(seconds),
            str(pipelined),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    proc.stdin.write(raw)
    proc.stdin.close()
    return proc


def result(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict[str, int]:
    proc.wait(timeout_s)
    return json.loads(proc.stdout.read())


if __name__ == "__main__":
    port, source, connections, seconds, pipelined = sys.argv[1:6]
    request = sys.stdin.buffer.read()
    counts = asyncio.run(_flood(int(port), source, request, int(connections), float(seconds), int(pipelined)))
    print(json.dumps(counts))
