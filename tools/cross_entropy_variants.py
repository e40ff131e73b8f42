"""Launch every cross-entropy kernel variant, on CPU tensors: a script for ``tools/compile_check.py``, which
compiles each launch for sm_90 instead of running it.

    python tools/compile_check.py --verbose tools/cross_entropy_variants.py

Covers bf16, fp16, float32 and float64 logits, forward and backward, vocabularies of 5, 100, 32000 and 50257 (one
block, odd widths, many blocks), contiguous rows and rows of a wider tensor, a scalar's expanded gradient and a
per-row one. Outputs stay unwritten (nothing is run).
"""

import importlib

import torch

cross_entropy = importlib.import_module("varlen.ops.cross_entropy")  # the module, not the function


def main():
    targets = torch.zeros(64, dtype=torch.int64)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        row_max, row_log_sum = torch.zeros(64, dtype=acc), torch.zeros(64, dtype=acc)
        for vocab in (5, 100, 32000, 50257):
            wide = torch.zeros(64, vocab + 3, dtype=dtype)
            for logits in (wide[:, :vocab], torch.zeros(64, vocab, dtype=dtype)):
                print(f"{dtype} V{vocab} row stride {logits.stride(0)}", flush=True)
                cross_entropy.cross_entropy_fwd_triton(logits, targets, -100)
                for scale in (torch.ones((), dtype=acc).expand(64), torch.ones(64, dtype=acc)):
                    cross_entropy.cross_entropy_bwd_triton(logits, targets, row_max, row_log_sum, scale, -100)


if __name__ == "__main__":
    main()
