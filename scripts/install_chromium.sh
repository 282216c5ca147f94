#!/usr/bin/env bash
# Install Debian's headless-capable Chromium, used by tests/diagnostics/test_report_browser.py
# to check that the run report renders in a real browser. Needs root (or sudo).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  echo "chromium already installed: $(chromium --version 2>/dev/null || true)"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
chromium --version
