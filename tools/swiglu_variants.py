"""Launch every SwiGLU kernel variant the modules use, on CPU tensors: a script for ``tools/compile_check.py``,
which compiles each launch for sm_90 instead of running it.

    python tools/compile_check.py --verbose tools/swiglu_variants.py

Covers bf16, fp16, float32 and float64, forward and backward, halves of 4, 17, 688 and 2048 features (one tile
row, odd widths, several tiles per row), contiguous rows and rows of a wider projection. Outputs stay unwritten
(nothing is run).
"""

import importlib

import torch

swiglu = importlib.import_module("varlen.ops.swiglu")  # the module, not varlen.ops.swiglu the function


def main():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for half in (4, 17, 688, 2048):
            projection = torch.zeros(300, 3 * half, dtype=dtype)
            for x in (projection[:, :2 * half], torch.zeros(300, 2 * half, dtype=dtype)):
                print(f"{dtype} F{half} row stride {x.stride(0)}", flush=True)
                swiglu.swiglu_fwd_triton(x)
                swiglu.swiglu_bwd_triton(x, torch.zeros(300, half, dtype=dtype))


if __name__ == "__main__":
    main()
