"""Test setup. Without a GPU, Triton kernels run under the interpreter on CPU tensors; the variable
must be set before any kernel is defined, hence here, before the tests import draftgraph."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The GPU tier (tests/gpu/) needs CUDA; on CPU-only machines (CI) it is not collected at all.
collect_ignore = [] if torch.cuda.is_available() else ["gpu"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
