"""Fixtures for the model tests: compiled paths need a C++ compiler for inductor on CPU."""

import os
import shutil

import pytest


@pytest.fixture
def cpu_compiler():
    """Skip when inductor has no C++ compiler (scripts/install_system_deps.sh installs g++);
    with one, a failure of the compiled path is a failure, not a skip."""
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++")):
        pytest.skip("no C++ compiler for torch.compile on CPU (apt-get install g++)")
