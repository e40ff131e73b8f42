"""Launch every rotary-embedding kernel variant the modules use, on CPU tensors: a script for
``tools/compile_check.py``, which compiles each launch for sm_90 instead of running it.

    python tools/compile_check.py --verbose tools/rotary_variants.py

Covers both kernels (angles from positions, given or found from the offsets; cosines and sines from transformers'
tables), bf16, fp16, float32 and float64, both turns (forward and backward), head dims 40, 64, 80, 96 and 128, one
head and 12, and q as a view of a fused q/k/v projection (rows further apart than the heads). Outputs stay unwritten
(nothing is run).
"""

import importlib

import torch

rotary = importlib.import_module("varlen.ops.rotary")  # the module, not varlen.ops.rotary the function


def main():
    positions = torch.arange(300)
    offsets = torch.tensor([0, 100, 100, 300], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for dim in (40, 64, 80, 96, 128):
            inv_freq = torch.ones(dim // 2, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
            tables = torch.zeros(300, dim, dtype=dtype)  # transformers' cos and sin (both halves)
            for heads in (1, 12):
                projection = torch.zeros(300, 3 * heads * dim, dtype=dtype)
                for x in (projection[:, :heads * dim].view(300, heads, dim), torch.zeros(300, heads, dim, dtype=dtype)):
                    for turn in (1, -1):
                        print(f"{dtype} D{dim} H{heads} row stride {x.stride(0)} turn {turn}", flush=True)
                        rotary.rotary_triton(x, positions, inv_freq, turn)
                        rotary.rotary_triton(x, offsets, inv_freq, turn, 100)
                        rotary.rotary_tables_triton(x, tables, tables, turn)


if __name__ == "__main__":
    main()
