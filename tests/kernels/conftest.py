"""Kernel tests: the `gpu` marker (the Triton kernel matrix on a CUDA device), and the matrix's
placement: in this process on CUDA or under TRITON_INTERPRET=1; otherwise deselected here
(not skipped) because test_interpreter_matrix runs exactly those tests in a child process under
the interpreter."""

from __future__ import annotations

import os

import torch


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: Triton kernel matrix; runs on a CUDA device whenever one is present")
    config.addinivalue_line("markers", "kernel_matrix: runs on CUDA or under the interpreter")


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    moved = [item for item in items if item.get_closest_marker("kernel_matrix")]
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = [item for item in items if not item.get_closest_marker("kernel_matrix")]
