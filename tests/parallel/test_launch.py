"""run_local fails fast and says why when a rank cannot return its result; its ranks run one
thread each and fork from a preloaded server with the caller's environment of the moment."""

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
import torch  # every rank re-imports this module before its environment is set

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


def _environment_and_preloaded(name: str) -> tuple[str | None, bool]:
    return os.environ.get(name), "torch._dynamo" in sys.modules


def test_ranks_fork_from_a_preloaded_server_with_the_callers_environment_of_now(monkeypatch):
    # the fork server keeps the environment it started with: a variable set after it started
    # must still reach the rank (as spawn would pass it), and one removed must not
    run_local(_environment_and_preloaded, 1, args=("MEGASCALE_TEST_MARK",))  # the server is up
    monkeypatch.setenv("MEGASCALE_TEST_MARK", "set after the server started")
    [(value, preloaded)] = run_local(_environment_and_preloaded, 1, args=("MEGASCALE_TEST_MARK",))
    assert value == "set after the server started"
    # nothing a rank runs here imports torch._dynamo: only the server's preload can have (a
    # fresh interpreter per rank paid ~4 s of CPU for torch and it)
    assert preloaded
    monkeypatch.delenv("MEGASCALE_TEST_MARK")
    assert run_local(_environment_and_preloaded, 1, args=("MEGASCALE_TEST_MARK",))[0][0] is None
