"""Hunt for intermittent races in the Hopper kernels that coordinate programs or warps (GPU): each case runs forward
and backward once, then N more times, and counts the calls whose outputs moved from the first call's.

    PYTHONPATH=src python3 tools/race_sweep.py N [FILTER]

Outputs a call must repeat bit for bit: attention's out and lse (each query block is one program's work, whichever
program takes it), dK and dV (each key block one program's, a kv head's query heads in order), a full-shape bias's
gradient (each tile stored once), and, in deterministic mode, dQ and a broadcast bias's gradient; the jagged softmax
forward and backward (its cooperative programs combine a sequence's chunks in chunk order). Outputs added in whatever
order the programs come (dQ and a broadcast bias's gradient otherwise) must stay within 2% of their largest value of
the first call's: a race there (a lost or doubled add, a flag read too early) moves them by far more. Attention
cases run twice: with the persistent kernels' programs as many as the SMs, and forced to 5, so that each walks many
work items (ring positions, buffers and barrier phases carried across items). Each case alternates two batches (other
values, and jagged lengths in another order), each call against its own batch's first: a kernel that read a
descriptor or a flag left by the other batch's call (the descriptors the kernels make on the device sit at
addresses the next call reuses) would move. FILTER: only the cases whose name contains it. Run several processes
side by side to load the GPU: a race shows more often under load. A line starting ``RACE`` counts, per output, the
calls that moved (N calls of each batch: 2N per case).

Found the Q-in-registers race of tiles of 192 (``attn/gluon/forward.py``, fixed in 9bc9bac: 6-9 of 300 calls of the
cross-window D192 case at 5 programs, 1 of 300 at the SM count); bench/NOTES.md has the runs.
"""

import sys
import zlib

import torch

import varlen
from varlen.attn.gluon import backward_dq as gluon_dq
from varlen.attn.gluon import forward as gluon_forward

LENGTHS = [0, 1, 17, 1000, 300, 2500, 64, 129, 700]
KEYS = [5, 0, 40, 900, 333, 2600, 64, 1, 800]
# (every sequence in the cooperative plans' chunks, held in shared memory on sm_90: the longest is 66 backward chunks
# of 128 rows, the bound of a 132-SM GPU; a longest of 120,000 rows, as here before, took the split plans)
SOFTMAX_LENGTHS = [1, 17, 5000, 0, 8448, 3, 2000]
NEAR = 2e-2  # (outputs summed in any order: the largest change allowed, relative to the largest value)

ATTENTION = {  # name: (layout, H, HKV, D, DV, attention options; "bias": "full" (B,H,S,S) or "broadcast" (1,H,S,S),
    # dense S 1024 there (the Gluon backward takes a bias whose rows are a multiple of 8 elements), else 1500)
    "D64 dense causal": ("dense", 8, 2, 64, 64, dict(causal=True)),
    "D64 jagged": ("jagged", 8, 8, 64, 64, {}),
    "D64 dense dropout": ("dense", 4, 4, 64, 64, dict(dropout_p=0.1)),
    "D64 dense broadcast bias grad": ("dense", 4, 4, 64, 64, dict(bias="broadcast")),
    "D64 dense broadcast bias grad deterministic": ("dense", 4, 4, 64, 64, dict(bias="broadcast", deterministic=True)),
    "D128 dense full bias grad causal": ("dense", 4, 4, 128, 128, dict(bias="full", causal=True)),
    "D96 jagged window": ("jagged", 8, 2, 96, 96, dict(window=(200, 0))),
    "D128 dense": ("dense", 8, 2, 128, 128, {}),
    "D128 jagged causal": ("jagged", 8, 2, 128, 128, dict(causal=True)),
    "D128 cross causal bottom_right": ("cross", 8, 2, 128, 128, dict(causal=True, align="bottom_right")),
    "D128 dense deterministic": ("dense", 8, 2, 128, 128, dict(deterministic=True)),
    "D128 jagged deterministic causal": ("jagged", 8, 8, 128, 128, dict(causal=True, deterministic=True)),
    "D192 dense causal": ("dense", 8, 2, 192, 192, dict(causal=True)),
    "D192 cross window": ("cross", 8, 2, 192, 192, dict(window=(100, 0))),
    "D160 jagged": ("jagged", 4, 4, 160, 160, {}),
    "D256 dense": ("dense", 4, 2, 256, 256, {}),
    "D256 jagged causal deterministic": ("jagged", 4, 4, 256, 256, dict(causal=True, deterministic=True)),
    "MLA 192/128 jagged causal": ("jagged", 8, 8, 192, 128, dict(causal=True)),
}
SOFTMAX = {"softmax bf16": torch.bfloat16, "softmax fp16": torch.float16, "softmax fp32": torch.float32}


def rand(g, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=g).to("cuda", dtype)


def flat(x):
    return x.values if isinstance(x, varlen.JaggedTensor) else x


def leaf(t):
    if isinstance(t, varlen.JaggedTensor):
        return varlen.JaggedTensor(t.values.detach().requires_grad_(), t.offsets, t.max_len)
    return t.detach().requires_grad_()


def attention_case(name, g, batch):
    """A function running the case's forward and backward on its ``batch``-th batch (0 or 1: jagged lengths rotated
    by that much), returning [(output name, tensor, bitwise)]."""
    layout, H, HKV, D, DV, opts = ATTENTION[name]
    opts = dict(opts)
    bias_shape = opts.pop("bias", None)
    S = 1024 if bias_shape else 1500
    if layout == "dense":
        q, k, v = (rand(g, 2, S, h, d) for h, d in ((H, D), (HKV, D), (HKV, DV)))
    else:
        ql = LENGTHS[batch:] + LENGTHS[:batch]
        kl = KEYS[batch:] + KEYS[:batch] if layout == "cross" else ql
        q = varlen.jagged([rand(g, L, H, D) for L in ql])
        k, v = (varlen.jagged([rand(g, L, HKV, d) for L in kl]) for d in (D, DV))
    bias = rand(g, 2 if bias_shape == "full" else 1, H, S, S) if bias_shape else None
    det = opts.get("deterministic", False)
    dout = rand(g, *flat(q).shape[:-1], DV)

    def call():
        prep, b = [leaf(t) for t in (q, k, v)], (leaf(bias) if bias is not None else None)
        drop = dict(generator=torch.Generator("cuda").manual_seed(7)) if opts.get("dropout_p") else {}
        out, lse = varlen.attention(*prep, bias=b, return_lse=True, **opts, **drop)
        grads = torch.autograd.grad(flat(out), [flat(t) for t in prep] + ([b] if b is not None else []), dout)
        named = [("out", flat(out), True), ("lse", flat(lse).nan_to_num(), True), ("dq", grads[0], det),
                 ("dk", grads[1], True), ("dv", grads[2], True)]
        if b is not None:
            named.append(("dbias", grads[3], det or bias_shape == "full"))
        return named

    return call


def softmax_case(name, g, batch):
    dtype = SOFTMAX[name]
    x = varlen.jagged([rand(g, L, 64, dtype=dtype) for L in SOFTMAX_LENGTHS[batch:] + SOFTMAX_LENGTHS[:batch]])
    dy = rand(g, *x.values.shape, dtype=dtype)

    def call():
        xl = leaf(x)
        y = varlen.softmax(xl, 1)
        (dx,) = torch.autograd.grad(y.values, [xl.values], dy)
        return [("y", y.values, True), ("dx", dx, True)]

    return call


def moved(again, first, bitwise):
    if bitwise:
        return not torch.equal(again, first)
    return (again.float() - first.float()).abs().max().item() > NEAR * first.float().abs().max().item()


def sweep(calls, n_calls):
    """Per output, the calls of the alternated ``calls`` that moved from their own first call's."""
    firsts = [call() for call in calls]
    counts = {name: 0 for name, _, _ in firsts[0]}
    for _ in range(n_calls):
        for call, first in zip(calls, firsts, strict=True):
            for (name, again, bitwise), (_, was, _) in zip(call(), first, strict=True):
                counts[name] += moved(again, was, bitwise)
    torch.cuda.synchronize()
    return counts


def main():
    n_calls = int(sys.argv[1])
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    runs = [(name, "real", attention_case) for name in ATTENTION]
    runs += [(name, 5, attention_case) for name in ATTENTION] + [(name, "real", softmax_case) for name in SOFTMAX]
    sm_count = gluon_forward.sm_count
    for name, programs, make in runs:
        if only not in name:
            continue
        forced = sm_count if programs == "real" else (lambda device, programs=programs: programs)
        gluon_forward.sm_count = gluon_dq.sm_count = forced
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        counts = sweep([make(name, g, batch) for batch in (0, 1)], n_calls)
        flag = "RACE" if any(counts.values()) else "ok"
        print(f"{flag}\tprograms={programs}\t{name}\t{n_calls} calls x 2 batches\t{counts}", flush=True)


if __name__ == "__main__":
    main()
