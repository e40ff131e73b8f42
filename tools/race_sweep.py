"""Hunt for intermittent races in the Hopper attention kernels (GPU): each case runs forward and backward once, then
N more times, and counts the calls whose outputs differ bit for bit from the first.

    PYTHONPATH=src python3 tools/race_sweep.py N [FILTER]

Bitwise-repeatable outputs: out and lse (each query block is one program's work, whichever program takes it), dK and
dV (each key block one program's, a kv head's query heads in order), and dQ and the bias gradient in deterministic
mode only (elsewhere they are added in whatever order the programs come). Every case runs twice: with the persistent
kernels' programs as many as the SMs, and forced to 5, so that each walks many work items (ring positions, buffers
and barrier phases carried across items). FILTER: only the cases whose name contains it. Run several processes side
by side to load the GPU: a race shows more often under load. A line starting ``RACE`` names the outputs that moved.
Found the Q-in-registers race of tiles of 192 (``gluon/forward.py``, fixed in 9bc9bac: 6-9 of 300 calls of the
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


def rand(g, *shape):
    return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)


def make(layout, H, HKV, D, DV, g):
    if layout == "dense":
        return [rand(g, 2, 1500, h, d) for h, d in ((H, D), (HKV, D), (HKV, DV))]
    kl = KEYS if layout == "cross" else LENGTHS
    return [varlen.jagged([rand(g, L, H, D) for L in LENGTHS]),
            *(varlen.jagged([rand(g, L, HKV, d) for L in kl]) for d in (D, DV))]


CASES = {  # name: (layout, H, HKV, D, DV, attention options)
    "D64 dense causal": ("dense", 8, 2, 64, 64, dict(causal=True)),
    "D64 jagged": ("jagged", 8, 8, 64, 64, {}),
    "D64 dense dropout": ("dense", 4, 4, 64, 64, dict(dropout_p=0.1)),
    "D64 dense bias grad det": ("dense", 4, 4, 64, 64, dict(bias=True, deterministic=True)),
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


def flat(x):
    return x.values if isinstance(x, varlen.JaggedTensor) else x


def run(q, k, v, bias, dout, opts):
    prep = [varlen.JaggedTensor(t.values.detach().requires_grad_(), t.offsets, t.max_len)
            if isinstance(t, varlen.JaggedTensor) else t.detach().requires_grad_() for t in (q, k, v)]
    b = bias.detach().requires_grad_() if bias is not None else None
    if opts.get("dropout_p"):
        opts = dict(opts, generator=torch.Generator("cuda").manual_seed(7))
    out, lse = varlen.attention(*prep, bias=b, return_lse=True, **opts)
    leaves = [flat(t) for t in prep] + ([b] if b is not None else [])
    grads = torch.autograd.grad(flat(out), leaves, dout)
    return [flat(out), flat(lse).nan_to_num()] + list(grads)


def main():
    n_calls = int(sys.argv[1])
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    for programs in ("real", 5):
        for name, (layout, H, HKV, D, DV, opts) in CASES.items():
            if only not in name:
                continue
            if programs != "real":
                gluon_forward.sm_count = gluon_dq.sm_count = lambda device, programs=programs: programs
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            q, k, v = make(layout, H, HKV, D, DV, g)
            opts = dict(opts)
            bias = None
            if opts.pop("bias", False):
                bias = rand(g, 1, H, 1500, 1500)
            det = opts.get("deterministic", False)
            dout = rand(g, *flat(q).shape[:-1], DV)
            first = run(q, k, v, bias, dout, opts)
            checked = [n for n in names[:len(first)] if det or n not in ("dq", "dbias")]
            bad = {n: 0 for n in checked}
            for _ in range(n_calls):
                again = run(q, k, v, bias, dout, opts)
                for n, a, f in zip(names, again, first, strict=False):
                    if n in bad and not torch.equal(a, f):
                        bad[n] += 1
            torch.cuda.synchronize()
            flag = "RACE" if any(bad.values()) else "ok"
            print(f"{flag}\tprograms={programs}\t{name}\t{n_calls} calls\t{bad}", flush=True)


if __name__ == "__main__":
    main()
