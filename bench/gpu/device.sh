#!/usr/bin/env bash
# The one device call for the H200 figures (issue 12), run from the repository root there:
#
#   run(command="bash bench/gpu/device.sh", carry=[".whl"], timeout_s=590)
#
# The device has PyTorch but no network and no tomli_w; the wheel travels in the ignored
# `.whl/` folder (docs/gpu_efficiency.md says how to fetch it). Output is unbuffered and
# tee'd into $OUT with the JSON, so a run cut short still returns its log.
set -o pipefail
out="${OUT:-/tmp}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>&1 | tee "$out/nvidia_smi.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
python3 bench/gpu/run.py "$@" 2>&1 | tee "$out/gpu_bench.log"
