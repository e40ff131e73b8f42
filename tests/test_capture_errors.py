"""What a CUDA graph capture can't contain raises a ValueError naming the way out, instead of a host copy that
breaks the capture (tests/test_cuda_graphs.py captures for real, on a GPU). Here on any device: the capture is
simulated by making the capture test say yes."""

import importlib
import types

import pytest
import torch

import varlen
from varlen.attn import function

# (the modules, not the functions varlen exports under the same names)
offsets_module = importlib.import_module("varlen.offsets")
jagged_module = importlib.import_module("varlen.jagged")


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(offsets_module, "capturing", lambda device: True)


def test_captured_dropout_refuses_a_cpu_generator(monkeypatch):
    """Inside a capture the dropout key is drawn on the GPU, which a CPU generator can't do (torch's error names
    neither the cause nor the way out)."""
    monkeypatch.setattr(function, "capturing", lambda device: True)
    with pytest.raises(ValueError, match=r"generator: a cpu generator while a CUDA graph is being captured "
                                         r"\(dropout_p=0\.25\).*register_generator_state"):
        function.dropout_seed(types.SimpleNamespace(dropout_p=0.25), torch.Generator(), torch.device("cuda"))


def test_dropout_mask_refuses_capture(monkeypatch):
    """A captured call draws its key at each replay: no mask can be read ahead of it inside the capture."""
    monkeypatch.setattr(importlib.import_module("varlen.attn.dropout"), "capturing", lambda device: True)
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"dropout_p: 0\.1 while a CUDA graph is being captured.*outside the capture"):
        varlen.attention_dropout_mask(q, q, 0.1)
    assert varlen.attention_dropout_mask(q, q, 0.0).all()


def test_validated_offsets_refuse_capture(capturing):
    values, offsets = torch.randn(7, 4), torch.tensor([0, 3, 7])
    with pytest.raises(ValueError, match=r"offsets: reading these CUDA offsets .* pass max_len, with validate=False"):
        varlen.JaggedTensor(values, offsets, 7)


def test_missing_max_len_refuses_capture(capturing, monkeypatch):
    monkeypatch.setattr(jagged_module, "checks_metadata", lambda device: False)  # (a GPU outside checking mode)
    with pytest.raises(ValueError, match=r"offsets: .* pass max_len \(JaggedTensor\(values, offsets, max_len, "
                                         r"validate=False\)\)"):
        varlen.JaggedTensor(torch.randn(7, 4), torch.tensor([0, 3, 7]), validate=False)


def test_host_offsets_refuse_capture(capturing):
    x = varlen.JaggedTensor._trusted(torch.randn(7, 4), torch.tensor([0, 3, 7]), 4)
    with pytest.raises(ValueError, match=r"offsets: .* \(unbind, select on dim 0, or on dim 1 without fill_value\)"):
        x.unbind()
    with pytest.raises(ValueError, match=r"offsets: .* runs outside the capture"):
        varlen.select(x, 0, 1)


def test_from_padded_lengths_refuse_capture(capturing):
    with pytest.raises(ValueError, match=r"lengths: .* call from_padded outside the capture"):
        varlen.JaggedTensor.from_padded(torch.randn(2, 4, 3), torch.tensor([3, 4]), max_len=4)
