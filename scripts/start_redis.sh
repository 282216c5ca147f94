#!/usr/bin/env bash
# Start a private redis-server on loopback for parallel.store = "redis" and print its URL
# (pass it as --parallel.redis_url=...). No persistence: rendezvous keys are throw-away.
# Usage: bash scripts/start_redis.sh [PORT]      Stop: redis-cli -p PORT shutdown nosave
set -euo pipefail
if ! command -v redis-server >/dev/null; then
  echo "start_redis: redis-server is not installed (bash scripts/install_system_deps.sh)" >&2
  exit 1
fi
PORT=${1:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
DIR=$(mktemp -d -t megascale-redis-XXXXXX)
redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$DIR" \
  --daemonize yes --pidfile "$DIR/redis.pid" --logfile "$DIR/redis.log" \
  --maxclients 20000 --tcp-backlog 4096
for _ in $(seq 100); do
  redis-cli -p "$PORT" ping >/dev/null 2>&1 && { echo "redis://127.0.0.1:$PORT/0"; exit 0; }
  sleep 0.1
done
echo "start_redis: redis-server did not answer on port $PORT (log: $DIR/redis.log)" >&2
exit 1
