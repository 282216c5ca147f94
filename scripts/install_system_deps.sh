#!/usr/bin/env bash
# Debian packages some tests use: redis-server (Redis store), chromium (HTML report render
# check), iproute2 (network namespaces for fault tests), g++ (torch.compile on CPU). Skips what
# is already installed.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v chromium >/dev/null || need+=(chromium)
command -v ip >/dev/null || need+=(iproute2)
command -v g++ >/dev/null || command -v c++ >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  echo "install_system_deps: apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
