"""run_local fails fast and says why when a rank cannot return its result."""

import time

import pytest

from megascale.testing.launch import run_local


def _unpicklable():
    return lambda: None  # the result queue cannot send this


def test_a_result_that_cannot_be_sent_fails_fast():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited without a result"):
        run_local(_unpicklable, 1, timeout_s=60)
    assert time.monotonic() - start < 30
