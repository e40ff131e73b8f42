"""The attention custom ops called directly (``torch.ops.varlen.attention_forward`` / ``attention_backward``), with
operands ``varlen.attention`` never passes: each is checked (``varlen.attn.op_checks``) or read at its own strides."""

import re

import pytest
import torch

from conftest import DEVICE
from utils import assert_close
from varlen import _backend

# The Triton path where it runs (a GPU, or the interpreter), and the PyTorch one.
BACKENDS = ["torch"] + (["triton"] if _backend.triton_unsupported_reason(DEVICE) is None else [])


def extras(alibi=None, cu_q=None, cu_k=None, seed=None, prefix_len=None, documents=None, query_offset=None,
           dropout_sequences=None):
    """The ops' optional tensors, in their order (``function.EXTRA_TENSORS``)."""
    return [alibi, cu_q, cu_k, seed, prefix_len, documents, query_offset, dropout_sequences]


def forward(q, k, v, bias=None, ex=None, max_q=None, max_k=None, causal=False, backend="torch"):
    ex = ex or extras()
    dense = ex[1] is None
    max_q = (q.shape[1] if dense else q.shape[0]) if max_q is None else max_q
    max_k = (k.shape[1] if dense else k.shape[0]) if max_k is None else max_k
    # (scale, causal, window_left, window_right, bottom_right, softcap, dropout_p, deterministic, backend)
    return torch.ops.varlen.attention_forward(q, k, v, bias, ex, max_q, max_k, q.shape[-1] ** -0.5, causal, -1, -1,
                                              False, 0.0, 0.0, False, backend)


def backward(dout, q, k, v, out, lse, ex=None, dlse=None, bias=None, needs=(True, True, True, False),
             backend="torch"):
    ex = ex or extras()
    dense = ex[1] is None
    max_q, max_k = (q.shape[1], k.shape[1]) if dense else (q.shape[0], k.shape[0])
    return torch.ops.varlen.attention_backward(dout, dlse, q, k, v, out, lse, bias, ex, max_q, max_k,
                                               q.shape[-1] ** -0.5, False, -1, -1, False, 0.0, 0.0, False, backend,
                                               list(needs))


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def ints(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


CU = (0, 2, 5)  # two sequences, five rows
REFUSED_FORWARD = [
    (lambda: forward(rand(2, 4, 2, 16), rand(1, 4, 2, 16), rand(1, 4, 2, 16)), "k: batch size 1 differs from q's 2"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 2, 2, 16)), "v: shape (2, 2, 2, 16) differs"),
    (lambda: forward(rand(2, 4, 4, 16), rand(2, 4, 3, 16), rand(2, 4, 3, 16)), "q: 4 heads are not a multiple"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 8), rand(2, 4, 2, 16)), "k: head dim 8 differs from q's 16"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 0)), "q, k, v: head dims must be >= 1"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 16), max_q=8),
     "max_q, max_k: a dense call's are q's and k's sequence lengths (4, 4); got (8, 4)"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 16), bias=rand(2, 2, 2, 4)),
     "bias: shape (2, 2, 2, 4) does not broadcast"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 16), ex=extras(alibi=rand(3))),
     "alibi_slopes: expected shape (2,) or (2, 2), got (3,)"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 16), causal=True,
                     ex=extras(prefix_len=ints(4))), "prefix_len: expected shape (2,), got (1,)"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 16), causal=True,
                     ex=extras(query_offset=ints(2, 2, 2))), "query_offset: expected shape (2,), got (3,)"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 16),
                     ex=extras(documents=torch.zeros(2, 1, 4, dtype=torch.int32, device=DEVICE))),
     "documents: expected shape (2, 2, 4), got (2, 1, 4)"),
    (lambda: forward(rand(5, 2, 16), rand(5, 2, 16), rand(5, 2, 16), ex=extras(cu_q=ints(*CU), cu_k=ints(0, 5))),
     "cu_k: expected shape (3,), got (2,)"),
    (lambda: forward(rand(5, 2, 16), rand(5, 2, 16), rand(4, 2, 16), ex=extras(cu_q=ints(*CU), cu_k=ints(*CU))),
     "v: shape (4, 2, 16) differs from k's (5, 2, 16)"),
    (lambda: forward(rand(5, 2, 16), rand(5, 2, 16), rand(5, 2, 16), ex=extras(cu_q=ints(*CU))),
     "cu_k: missing"),
    (lambda: forward(rand(2, 4, 2, 16), rand(2, 4, 2, 16), rand(2, 4, 2, 16),
                     ex=extras(seed=torch.tensor([1, 2, 3]))), "seed: expected int64 [seed, offset]"),
]


@pytest.mark.parametrize("case", range(len(REFUSED_FORWARD)))
def test_forward_refuses_operands_the_kernels_would_read_past(case):
    call, message = REFUSED_FORWARD[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_refuses_wrong_types():
    q = rand(5, 2, 16)
    with pytest.raises(TypeError, match=re.escape("cu_q: expected int32 or int64 values, got dtype torch.float32")):
        forward(q, q, q, ex=extras(cu_q=torch.tensor(CU, dtype=torch.float32, device=DEVICE), cu_k=ints(*CU)))
    with pytest.raises(TypeError, match=re.escape("k: dtype torch.float16 differs from q's torch.float32")):
        forward(q, q.half(), q.half(), ex=extras(cu_q=ints(*CU), cu_k=ints(*CU)))
    with pytest.raises(ValueError, match=re.escape("seed: expected int64")):
        forward(q, q, q, ex=extras(cu_q=ints(*CU), cu_k=ints(*CU), seed=torch.tensor([1.5, 0.0])))


def test_backward_refuses_operands_the_kernels_would_read_past():
    q, k, v = (rand(2, 4, 2, 16) for _ in range(3))
    out, lse = forward(q, k, v)
    with pytest.raises(ValueError, match=re.escape("dout: expected shape (2, 4, 2, 16)")):
        backward(out[:1], q, k, v, out, lse)
    with pytest.raises(ValueError, match=re.escape("out: expected shape (2, 4, 2, 16)")):
        backward(out, q, k, v, out[:, :2], lse)
    with pytest.raises(ValueError, match=re.escape("lse: expected shape (2, 2, 4) of dtype torch.float32")):
        backward(out, q, k, v, out, lse[:1])
    with pytest.raises(ValueError, match=re.escape("dlse: expected shape (2, 2, 4)")):
        backward(out, q, k, v, out, lse, dlse=lse[:, :1])
    with pytest.raises(ValueError, match=re.escape("needs: a bias gradient asked for without a bias")):
        backward(out, q, k, v, out, lse, needs=(True, True, True, True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_operands_give_what_contiguous_ones_give(backend):
    """Head dims, offsets, per-sequence tensors, out and lse as views with other strides (every other element of a
    wider tensor): the same results as their contiguous copies."""
    def every_other(t):
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]

    q, k, v = (rand(5, 2, 16) for _ in range(3))
    cu = ints(*CU)
    ex = extras(cu_q=cu, cu_k=cu)
    out, lse = forward(q, k, v, ex=ex, causal=True, backend=backend)
    strided_ex = extras(cu_q=every_other(cu), cu_k=every_other(cu))
    got = forward(every_other(q), every_other(k), every_other(v), ex=strided_ex, causal=True, backend=backend)
    assert_close(got[0], out)
    assert_close(got[1], lse)
    dout = rand(5, 2, 16)
    grads = backward(dout, q, k, v, out, lse, ex=ex, backend=backend)
    strided = backward(every_other(dout), q, k, v, every_other(out), every_other(lse), ex=strided_ex, backend=backend)
    for a, b in zip(strided, grads, strict=True):
        assert_close(a, b)
    qd, kd, vd = (rand(2, 4, 2, 16) for _ in range(3))
    want = forward(qd, kd, vd, backend=backend)
    got = forward(every_other(qd), every_other(kd), every_other(vd), backend=backend)
    assert_close(got[0], want[0], name="dense, strided head dims")
    for name in ("prefix_len", "query_offset"):
        per_sequence = ints(2, 1)
        want = forward(qd, kd, vd, ex=extras(**{name: per_sequence}), causal=True, backend=backend)
        got = forward(qd, kd, vd, ex=extras(**{name: every_other(per_sequence)}), causal=True, backend=backend)
        assert_close(got[0], want[0], name=name)
