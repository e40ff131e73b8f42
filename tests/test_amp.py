"""Mixed precision: every varlen op under ``torch.autocast`` acts as the torch op it stands for.

Each op runs on a jagged batch and the matching torch op on the same data (padded, or per sequence) under
the same autocast; the results must have the same dtype and agree to the autocast dtype's rounding, and
parameter gradients come back in the parameters' dtype. CPU (bf16) here; CUDA (bf16, fp16) on the GPU.
The float32 matmul precision switch (TF32 or not) is checked against torch's own settings.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import varlen
from conftest import DEVICE, ON_GPU
from utils import assert_close, random_jagged
from varlen.ops.rotary import rotate

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.bfloat16]
# Relative error of a result computed in the autocast dtype against the same torch op's.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
LENGTHS = [5, 0, 17, 1, 12]


def _padded_mask(x: varlen.JaggedTensor) -> torch.Tensor:
    return torch.arange(x.max_len, device=x.device)[None, :] < x.lengths[:, None]


def _cases():
    """(name, varlen op, the matching torch computation): both take the jagged input x of (B, j, 8)."""
    w = torch.randn(6, 8, device=DEVICE)
    b = torch.randn(6, device=DEVICE)
    w_seq = torch.randn(len(LENGTHS), 8, 3, device=DEVICE)
    g, beta = torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE)

    def reference_rotary(values):  # elementwise: no autocast rule, the input's dtype throughout
        positions = torch.cat([torch.arange(n, device=DEVICE) for n in LENGTHS])
        return rotate(values, positions, 10000.0)

    def padded_softmax(x):
        p = x.to_padded(float("-inf"))
        return varlen.JaggedTensor.from_padded(torch.softmax(p, dim=1).nan_to_num(), LENGTHS).values

    def padded_sum(x):
        return torch.sum(x.to_padded(), dim=1)

    return [
        ("linear", lambda x: varlen.linear(x, w, b).values, lambda x: F.linear(x.values, w, b)),
        ("matmul_shared", lambda x: varlen.matmul(x, w.t()).values, lambda x: x.values @ w.t()),
        ("matmul_per_sequence", lambda x: varlen.matmul(x, w_seq).values,
         lambda x: varlen.JaggedTensor.from_padded(torch.bmm(x.to_padded(), w_seq), LENGTHS).values),
        ("transposed_matmul", lambda x: varlen.transposed_matmul(x, x),
         lambda x: torch.bmm(x.to_padded().transpose(1, 2), x.to_padded())),
        ("softmax_ragged", lambda x: varlen.softmax(x, 1).values, padded_softmax),
        ("softmax_inner", lambda x: varlen.softmax(x, -1).values, lambda x: torch.softmax(x.values, -1)),
        ("sum_ragged", lambda x: varlen.sum(x, 1), padded_sum),
        ("layer_norm", lambda x: varlen.layer_norm(x, 8, g, beta).values,
         lambda x: F.layer_norm(x.values, (8,), g, beta)),
        ("rms_norm", lambda x: varlen.rms_norm(x, 8, g).values, lambda x: F.rms_norm(x.values, (8,), g)),
        ("rotary", lambda x: varlen.rotary(x.with_values(x.values.unflatten(-1, (2, 4)))).values,
         lambda x: reference_rotary(x.values.unflatten(-1, (2, 4)))),
        ("gelu", lambda x: varlen.gelu(x).values, lambda x: F.gelu(x.values)),
        ("swiglu", lambda x: varlen.swiglu(x).values, lambda x: F.silu(x.values[:, :4]) * x.values[:, 4:]),
    ]


@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES, ids=str)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_op_follows_autocast_like_torch(case, input_dtype, autocast_dtype):
    name, ours, theirs = case
    x = random_jagged(LENGTHS, (8,), dtype=input_dtype)
    with torch.autocast(DEVICE.type, dtype=autocast_dtype):
        got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype, f"{name}: {got.dtype} under autocast, torch gives {want.dtype}"
    assert_close(got, want, tol=TOL[autocast_dtype], name=name)


def test_attention_follows_autocast_like_sdpa():
    q, k, v = (random_jagged(LENGTHS, (4, 16)) for _ in range(3))
    for dtype in AUTOCAST_DTYPES:
        with torch.autocast(DEVICE.type, dtype=dtype):
            out, lse = varlen.attention(q, k, v, causal=True, return_lse=True)
            for seq, (a, b, c) in enumerate(zip(q.unbind(), k.unbind(), v.unbind(), strict=True)):
                if a.shape[0] == 0:
                    continue
                ref = F.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1),
                                                     is_causal=True).transpose(0, 1)
                assert out.values.dtype == ref.dtype == dtype
                assert_close(out.unbind()[seq], ref, tol=TOL[dtype], name=f"sequence {seq}")
        assert lse.dtype == torch.float32


def test_parameter_gradients_keep_their_dtype():
    x = random_jagged(LENGTHS, (8,))
    w = torch.randn(8, 8, device=DEVICE, requires_grad=True)
    w_seq = torch.randn(len(LENGTHS), 8, 8, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = varlen.matmul(varlen.linear(x, w), w_seq)
        out = varlen.attention(*(y.with_values(y.values.view(-1, 2, 4)),) * 3)
        loss = varlen.sum(varlen.softmax(out, 1), 1).float().sum()
    loss.backward()
    assert w.grad.dtype == torch.float32 and w_seq.grad.dtype == torch.float32
    assert torch.isfinite(w.grad).all() and torch.isfinite(w_seq.grad).all()


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_matches_torch_nn_under_autocast(norm_first):
    """varlen.nn.TransformerEncoderLayer on a jagged batch against torch.nn's layer on the padded batch with a
    key padding mask, both under the same autocast: outputs and parameter gradients (in float32)."""
    torch.manual_seed(0)
    ours = varlen.nn.TransformerEncoderLayer(32, 4, 64, 0.0, activation="gelu", norm_first=norm_first, device=DEVICE)
    theirs = torch.nn.TransformerEncoderLayer(32, 4, 64, 0.0, activation="gelu", norm_first=norm_first,
                                              batch_first=True, device=DEVICE)
    theirs.load_state_dict(ours.state_dict())
    lengths = [5, 9, 17, 1]
    x = random_jagged(lengths, (32,))
    padding = ~_padded_mask(x)
    for dtype in AUTOCAST_DTYPES:
        with torch.autocast(DEVICE.type, dtype=dtype):
            y = ours(x)
            y_ref = theirs(x.to_padded(), src_key_padding_mask=padding)
        assert y.values.dtype == y_ref.dtype
        y_ref = varlen.JaggedTensor.from_padded(y_ref, lengths).values
        assert_close(y.values, y_ref, tol=TOL[dtype], name="output")
        weights = torch.randn_like(y.values, dtype=torch.float32)
        grads = torch.autograd.grad((y.values.float() * weights).sum(), list(ours.parameters()))
        grads_ref = torch.autograd.grad((y_ref.float() * weights).sum(), list(theirs.parameters()))
        for (name, p), g, r in zip(ours.named_parameters(), grads, grads_ref, strict=True):
            assert g.dtype == p.dtype == torch.float32
            # 5x: both sides' grads carry the forward's roundings plus those of each later sublayer's autocast backward
            assert_close(g, r, tol=5 * TOL[dtype], name=f"d{name}", floor=1e-3)


@pytest.mark.inductor
def test_compiled_model_under_autocast_matches_eager():
    torch.manual_seed(0)
    layer = varlen.nn.TransformerEncoderLayer(32, 4, 64, 0.0, causal=True, device=DEVICE)
    x = random_jagged([5, 9, 17, 1], (32,))

    def run(module):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            return varlen.sum(module(x), 1)

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True, dynamic=True))
    assert compiled.dtype == eager.dtype
    assert_close(compiled, eager, tol=TOL[torch.bfloat16], name="compiled vs eager")


# Each line: the settings to apply, then the expected tl.dot precision of float32 inputs. Run in a fresh
# process each: mixing torch's legacy and new precision APIs leaves global state that other tests would see.
PRECISION_SETTINGS = [
    ("pass", "tf32x3"),  # torch's default: full float32
    ("torch.set_float32_matmul_precision('high')", "tf32"),
    ("torch.set_float32_matmul_precision('medium')", "tf32"),
    ("torch.backends.cuda.matmul.allow_tf32 = True", "tf32"),
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'; torch.backends.cuda.matmul.fp32_precision = 'ieee'",
     "tf32x3"),
    ("torch.set_float32_matmul_precision('high'); torch.backends.cuda.matmul.fp32_precision = 'ieee'", "tf32x3"),
]


def test_float32_dot_precision_follows_torch_settings():
    for setting, expected in PRECISION_SETTINGS:
        code = ("import torch, warnings; warnings.simplefilter('ignore'); from varlen._amp import dot_precision; "
                f"{setting}; print(dot_precision(torch.float32), dot_precision(torch.bfloat16))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [expected, "tf32"], f"{setting!r}: {done.stdout}"
