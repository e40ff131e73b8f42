"""Launch every layer / RMS norm kernel variant, on CPU tensors: a script for ``tools/compile_check.py``, which
compiles each launch for sm_90 instead of running it.

    python tools/compile_check.py --verbose tools/norm_variants.py

Covers bf16, fp16, float32 and float64, layer norm (weight and bias, weight only, neither) and RMS norm (weight or
none), forward and backward (with and without the affine gradients), rows of 1, 17, 768 and 4096 elements and the
widest each dtype takes (``max_cols``). Outputs stay unwritten (nothing is run).
"""

import torch

from varlen.ops import _norm_kernels as kernels

# (centered, weight, bias)
FORMS = [(True, True, True), (True, True, False), (True, False, False), (False, True, False), (False, False, False)]


def main():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for n_cols in sorted({1, 17, 768, min(4096, kernels.max_cols(dtype)), kernels.max_cols(dtype)}):
            x = torch.zeros(300, n_cols, dtype=dtype)
            for centered, has_weight, has_bias in FORMS:
                print(f"{dtype} F{n_cols} centered={centered} weight={has_weight} bias={has_bias}", flush=True)
                weight = torch.ones(n_cols, dtype=dtype) if has_weight else None
                bias = torch.zeros(n_cols, dtype=dtype) if has_bias else None
                _, mean, rstd = kernels.norm_fwd_triton(x, weight, bias, 1e-5, centered)
                for affine_grads in (True, False):
                    kernels.norm_bwd_triton(x, weight, x, mean, rstd, centered, has_weight and affine_grads,
                                            has_bias and affine_grads)


if __name__ == "__main__":
    main()
