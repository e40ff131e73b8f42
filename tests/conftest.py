"""Shared test set-up: one device for the whole run, Triton's interpreter on CPU, seeded RNG.

On a machine without CUDA the Triton kernels run through Triton's interpreter, which must be switched
on before Triton is first imported: that happens here, ahead of every test module.
"""

import math
import os
import zlib

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import varlen  # noqa: E402  (after TRITON_INTERPRET is set)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Small CPU ops are dominated by thread start-up when each xdist worker uses every core (measured
# here: a small attention reference forward+backward took 408 ms with 2 threads and 5 ms with 1).
torch.set_num_threads(1)


def pytest_report_header(config):
    mode = "CUDA" if ON_GPU else f"CPU, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    return f"varlen {varlen.__version__}, torch {torch.__version__}, kernels on {mode}"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed(request):
    """A fresh, reproducible seed per test (derived from its id), so failures replay exactly."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture
def poison_empty(monkeypatch):
    """``torch.empty``/``empty_like``/``Tensor.new_empty`` hand out NaN-filled memory (-7 for integers, True for
    bool) during the test, so an element that a kernel forgets to write (or reads before writing) shows up."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        if t.is_floating_point():
            return t.fill_(math.nan)
        return t.fill_(True) if t.dtype == torch.bool else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(real_new_empty(self, *a, **k)))
