"""run_local fails fast and says why when a rank cannot return its result, and runs one thread a rank."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.testing.launch import run_local

REPO = Path(__file__).resolve().parents[2]


def _unpicklable():
    return lambda: None  # the result queue cannot send this


def test_a_result_that_cannot_be_sent_fails_fast():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited without a result"):
        run_local(_unpicklable, 1, timeout_s=60)
    assert time.monotonic() - start < 30


SCRIPT = """
import torch  # spawn re-imports this module in every child before the rank's environment is set

from megascale.testing.launch import run_local

if __name__ == "__main__":
    print(run_local(torch.get_num_threads, 2))
"""


def test_ranks_run_one_thread_even_when_the_parents_main_imported_torch_first(tmp_path):
    # a bench run as `python bench/x.py` on a machine with OMP_NUM_THREADS=3: before the fix its
    # ranks ran 3 threads each (2 ranks on 2 cores oversubscribed the measurements)
    script = tmp_path / "main.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "3", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[1, 1]"
