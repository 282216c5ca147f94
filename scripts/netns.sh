#!/usr/bin/env bash
# Simulated nodes in network namespaces for local fault tests (root and iproute2 needed).
#
#   scripts/netns.sh up TAG COUNT       bridge msbrTAG at 10.N.0.1/24 (N in 100-199, from TAG);
#                                       namespaces msTAG-0..COUNT-1, node i at 10.N.0.(10+i) on its
#                                       own veth (eth0 inside)
#   scripts/netns.sh cut TAG I          take node I's link down (a pulled cable)
#   scripts/netns.sh restore TAG I      bring it back
#   scripts/netns.sh down TAG COUNT     remove the namespaces, veths and the bridge
#
# `megascale launch --netns` does the same itself (TAG = the first 4 characters of the job id,
# shown by GET /v1/status). The commands live in megascale/resilience/driver/local.py, one copy only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $EUID -ne 0 ]]; then echo "netns.sh: run as root" >&2; exit 1; fi
PY=${PYTHON:-python}
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
exec "$PY" -m megascale.resilience.driver.local "$@"
