"""Which Triton kernel variants a stream of jagged batches asks for, computed without a GPU.

    python tests/specialization_probe.py [--batches 50]

Triton compiles one variant of a kernel per *specialization key*: the arguments' types, integer
arguments' value classes (equal to 1, divisible by 16), pointer alignment, constexprs and launch options.
This script computes those keys with Triton's own binder (``create_function_from_signature``, what
``JITFunction.run`` calls before looking up its cache) for every launch varlen makes, instead of launching:
the outputs stay unwritten, which no host code reads. It runs one warm-up batch, then ``--batches`` more
of random lengths through attention (forward and backward, with GQA, causal masks and dropout), the jagged
ops and an encoder layer, and prints, as JSON, the keys that appeared after the warm-up, per kernel.

``tests/test_specialization.py`` runs it: new keys after the warm-up mean that training on new batches
would keep compiling.
"""

from __future__ import annotations

import argparse
import json
import os

# Kernels must be JITFunctions (compiled launches), not the interpreter's: Triton decides at import.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import varlen  # noqa: E402
import varlen.attn.triton.backend  # noqa: E402, F401  (imported on first use otherwise: after the flag below)
import varlen.ops._linear_kernels  # noqa: E402, F401
from varlen.ops import _norm_kernels  # noqa: E402

# The norms' backward launches as many programs as a GPU holds (one SM on the CPU): an H100's count, so that short
# batches' program counts vary as they do there.
_norm_kernels.sm_count = lambda device: 132
# varlen sends CPU tensors to its Triton path only under the interpreter flag, read at each call.
os.environ["TRITON_INTERPRET"] = "1"

BACKEND = make_backend(GPUTarget("cuda", 90, 32))
_binders: dict = {}
# kernel name -> {specialization key: ((parameter name, its entry), ...) plus launch options}
keys: dict[str, dict[str, tuple]] = {}


def _record(self, *args, grid, warmup, **kwargs):
    binder = _binders.get(self)
    if binder is None:
        binder = _binders[self] = create_function_from_signature(self.signature, self.params, BACKEND)
    _, specialization, options = binder(*args, **kwargs)
    entries = tuple(zip((p.name for p in self.params), map(repr, specialization), strict=True))
    entries += tuple((name, repr(value)) for name, value in sorted(options.items()))
    keys.setdefault(self.__name__, {})[repr(entries)] = entries


def _differences(new: tuple, warm: list[tuple]) -> list[str]:
    """The parameters whose entries differ between ``new`` and the warm-up key closest to it."""
    closest = min(warm, key=lambda old: sum(a != b for a, b in zip(old, new, strict=True)))
    return [f"{name}: {old} -> {now}" for (name, old), (_, now) in zip(closest, new, strict=True) if old != now]


def one_batch(gen: torch.Generator, layer: varlen.nn.TransformerEncoderLayer) -> None:
    lengths = torch.randint(1, 1001, (32,), generator=gen).tolist()
    heads, kv_heads, dim = 4, 2, 64
    q = varlen.jagged([torch.randn(n, heads, dim) for n in lengths]).requires_grad_()
    k = q.with_values(torch.randn(q.total, kv_heads, dim, requires_grad=True))
    v = q.with_values(torch.randn(q.total, kv_heads, dim, requires_grad=True))
    for options in (dict(causal=True), dict(dropout_p=0.1), dict(causal=True, deterministic=True)):
        out = varlen.attention(q, k, v, backend="triton", **options)
        out.values.sum().backward()
    x = q.with_values(torch.randn(q.total, 16, requires_grad=True))
    varlen.JaggedTensor.from_padded(x.to_padded(), lengths).values.sum().backward()
    varlen.sum(x, 1).sum().backward()
    varlen.softmax(x, 1).values.sum().backward()
    varlen.select(x, 1, -1, fill_value=0.0).sum().backward()
    w = torch.randn(len(lengths), 16, 8, requires_grad=True)
    varlen.matmul(x, w).values.sum().backward()
    norm_weight = torch.randn(16, requires_grad=True)
    varlen.rms_norm(x, 16, norm_weight).values.sum().backward()
    varlen.layer_norm(x, 16, norm_weight, norm_weight).values.sum().backward()
    varlen.swiglu(x).values.sum().backward()
    varlen.rotary(q).values.sum().backward()
    varlen.cross_entropy(x.values, torch.randint(0, 16, (x.total,), generator=gen)).backward()
    hidden = q.with_values(torch.randn(q.total, layer.self_attn.embed_dim))
    layer(hidden).values.sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    layer = varlen.nn.TransformerEncoderLayer(64, 4, 128, 0.0, causal=True)
    JITFunction.run = _record
    with varlen.use_backend("triton"):
        one_batch(gen, layer)
        warm = {name: dict(found) for name, found in keys.items()}
        for _ in range(args.batches):
            one_batch(gen, layer)
    new = {}
    for name, found in keys.items():
        fresh = [entries for key, entries in found.items() if key not in warm.get(name, {})]
        if fresh:
            new[name] = [_differences(entries, list(warm.get(name, {}).values()) or [entries]) for entries in fresh]
    print(json.dumps({"kernels": sorted(keys), "new_after_warmup": new}))


if __name__ == "__main__":
    main()
