"""Launch every attention kernel variant the tuned configs select, on CPU tensors: a script for
``tools/compile_check.py``, which compiles each launch for sm_90 instead of running it.

    python tools/compile_check.py --verbose tools/attention_variants.py
    ATTENTION_VARIANTS="D256 float32" python tools/compile_check.py tools/attention_variants.py  # a subset

Covers bf16 and float32 (both dot precisions) at head dims 64, 128 and 256 (float32 "ieee" also at 36 and 100, bf16
also at 40 and 96, which the Gluon kernels compute in tiles of 64 and 128, and 160 and 192, in the Gluon forward's
tiles of 192 and the Gluon dK and dV kernel's of 256, beside the Triton kernels; and value head dims other than the
query's, "D192v128" for multi-head latent attention's heads among them);
dense, jagged and GQA; causal, window, prefix and document masks; bias (full and broadcast, with gradients),
ALiBi + softcap, dropout (its key a host int, or in memory); deterministic mode (the Gluon backward's ordered dQ adds
without a mask and under causal and right-window masks, jagged, GQA, dropout; the Triton kernels with a bias); TMA
loads and pointer loads; and
the Gluon forward and backward for every case they support (their "gluon forward ..." and "gluon ..." labels; at
D64 the forward also with three query warpgroups, "gluon forward 3wg ...", and the backward with one key block
per program and with two, "gluon one block ..." and "gluon pairs ..."; past 128 the backward's dK and dV kernel in
tiles of 192 and 256 and its dQ kernel (the Triton one with dropout), "gluon wide ..."). Outputs stay unwritten
(nothing is run).
"""

import itertools
import os

import torch

from varlen.attn.gluon import backward as gluon_backward
from varlen.attn.gluon import backward_dq as gluon_backward_dq
from varlen.attn.gluon import backward_wide as gluon_backward_wide
from varlen.attn.gluon import common as gluon_common
from varlen.attn.gluon import forward as gluon_forward
from varlen.attn.options import AttentionOptions, DropoutSeed, Problem
from varlen.attn.triton import configs, program
from varlen.attn.triton.backward import launch_backward
from varlen.attn.triton.forward import launch_forward

# The configs are chosen for a Hopper GPU; these tensors are CPU ones.
configs.has_tma = lambda device: True
gluon_backward.applies = (lambda problem, opts, q, k, v, dout, bias, alibi, seed:
                          gluon_backward.supports(problem, opts, q.dtype, bias, alibi, seed))
gluon_backward_wide.applies = (lambda problem, opts, q, k, v, dout, bias, alibi, seed:
                               gluon_backward_wide.supports(problem, opts, q.dtype, bias, alibi, seed))
gluon_backward_dq.applies = (lambda problem, opts, q, k, v, dout, bias, alibi, seed:
                             gluon_backward_dq.supports(problem, opts, q.dtype, bias, alibi, seed))
gluon_forward.applies = (lambda problem, opts, q, k, v, bias, alibi, seed:
                         gluon_forward.supports(problem, opts, q.dtype, bias, alibi, seed))


def _problem(D, DV, jagged, group, S=256):
    B, H = 2, 4
    cu = torch.tensor([0, 100, 256], dtype=torch.int32) if jagged else None
    return Problem(B, H, H // group, D, DV, S, S, not jagged, cu, cu)


def _tensors(problem, dtype):
    shape = (problem.cu_q[-1].item(),) if not problem.dense else (problem.batch, problem.max_q)
    q = torch.empty(*shape, problem.heads, problem.head_dim, dtype=dtype)
    do = torch.empty(*shape, problem.heads, problem.head_dim_v, dtype=dtype)
    k = torch.empty(*shape, problem.kv_heads, problem.head_dim, dtype=dtype)
    v = torch.empty(*shape, problem.kv_heads, problem.head_dim_v, dtype=dtype)
    return q, k, v, do


FEATURES = {
    "plain": {}, "causal": dict(causal=True), "window": dict(causal=True, window_left=64),
    "prefix": dict(causal=True, prefix=True), "documents": dict(causal=True, documents=True),
    "bias_full": dict(bias="BHQK"), "bias_broadcast": dict(bias="1HQK"),
    "bias_causal": dict(causal=True, bias="1HQK"),  # (the Gluon backward's masked tiles with a bias)
    "bias_deterministic": dict(bias="1HQK", deterministic=True),  # the recompute kernel _bwd_dbias_kernel
    "alibi_softcap": dict(alibi=True, softcap=20.0),
    "dropout": dict(dropout=0.1), "deterministic": dict(causal=True, deterministic=True),
    # Deterministic calls in the Gluon backward (its ordered dQ adds, without a mask or under causal-like masks) with a
    # right window only and with dropout; with a bias (its gradient stored), the Triton kernels.
    "deterministic_right": dict(window_right=30, deterministic=True),
    "deterministic_dropout": dict(dropout=0.1, causal=True, deterministic=True),
    "deterministic_plain": dict(deterministic=True),
    "deterministic_bias": dict(bias="BHQK", causal=True, deterministic=True),
    "dropout_threshold_one": dict(dropout=2**-8),  # the mask's threshold 1: an integer Triton makes a constant
    "dropout_device_seed": dict(dropout=0.1, device_seed=True),  # the key in memory (captured graphs: DropoutSeed)
    "positions": dict(causal=True, positions=True, dropout=0.1),
}
# (head dim, or the query's and the value's, dtype, float32 dot precision, jagged, GQA group, features): every feature
# at D 64, 128 and 256 in bf16,
# the layouts and GQA at the common features, float32 at the plain and causal cases, float32 at full accuracy with
# every feature.
CASES = [
    *((D, torch.bfloat16, "ieee", False, 1, name) for D in (64, 128) for name in FEATURES),
    *((D, torch.bfloat16, "ieee", True, group, name) for D in (64, 128) for group in (1, 4)
      for name in ("plain", "causal", "bias_full", "bias_broadcast", "dropout", "positions")),
    # Deterministic calls jagged and with GQA, and at head dims below their tile's (the Gluon backward's DET).
    *((D, torch.bfloat16, "ieee", jagged, group, name) for D in (64, 128)
      for jagged, group in ((True, 1), (True, 4), (False, 4))
      for name in ("deterministic", "deterministic_right", "deterministic_plain")),
    *((D, torch.bfloat16, "ieee", False, 1, name) for D in (40, 96)
      for name in ("deterministic", "deterministic_right", "deterministic_plain")),
    # Dense GQA under a causal mask: the Gluon backward's grid in groups of kv heads (program.kv_head_groups).
    *((D, torch.bfloat16, "ieee", False, 4, "causal") for D in (64, 128)),
    # Dense GQA with a bias broadcast over sequences: the Gluon backward's first stores (gluon_backward.stores_first),
    # with a band at D64 (its zero tiles), and a query head loop per tile flag.
    *((D, torch.bfloat16, "ieee", False, 4, name) for D in (64, 128) for name in ("bias_broadcast", "bias_causal")),
    *((D, torch.float32, precision, False, 1, name) for D in (64, 128) for precision in ("ieee", "tf32")
      for name in ("plain", "causal")),
    # float32 at full accuracy splits the operands into bf16 parts (configs.splits_bf16): their shared memory next
    # to each feature and layout.
    *((D, torch.float32, "ieee", jagged, group, name) for D in (64, 128)
      for jagged, group, name in ((False, 1, "bias_full"), (False, 1, "bias_broadcast"), (False, 1, "dropout"),
                                  (False, 1, "deterministic"), (True, 4, "causal"), (True, 1, "positions"))),
    # ... and head dims that are no multiple of 8 (parts padded to one: parts.part_width).
    *((D, torch.float32, "ieee", False, 1, name) for D in (36, 100) for name in ("plain", "causal")),
    # Head dims below their Gluon tile's (gluon.common.tile_head_dim): the kernels' 3-D descriptors, host and device.
    *((D, torch.bfloat16, "ieee", jagged, group, name) for D in (40, 96)
      for jagged, group, name in ((False, 1, "plain"), (False, 1, "causal"), (False, 1, "window"),
                                  (False, 1, "dropout"), (False, 1, "bias_broadcast"), (False, 4, "causal"),
                                  (True, 4, "causal"), (True, 1, "plain"))),
    *((256, torch.float32, "ieee", False, 1, name) for name in ("plain", "causal")),
    # D256 in bf16 with every feature (its tuned tiles, configs.HEAD256_SWEEP, are the largest that fit shared memory
    # without a bias or dropout), jagged and GQA; D192 and D160 in the forward's tiles of 192 (parts of 128 and 64
    # columns; D160's through 3-D descriptors) and the backward's of 256.
    *((256, torch.bfloat16, "ieee", False, 1, name) for name in FEATURES),
    *((256, torch.bfloat16, "ieee", True, 4, name) for name in ("plain", "causal")),
    *((D, torch.bfloat16, "ieee", jagged, group, name) for D in (160, 192)
      for jagged, group, name in ((False, 1, "plain"), (False, 1, "causal"), (False, 1, "window"),
                                  (True, 4, "causal"))),
    # (float32 D256 with TF32 dots once overflowed shared memory in the backward: configs.float32_untuned_256_tf32)
    *((256, torch.float32, "tf32", False, 1, name) for name in ("plain", "causal", "deterministic")),
    # Value head dims other than the query's (gluon.common.wide_tile_head_dims): multi-head latent attention's
    # 192 / 128 (the forward and the backward's Gluon kernels in tiles of 192 and 128), 256 / 128, 192 / 64, 136 / 96,
    # and 128 / 64 and 96 / 80 (the forward in tiles of 128 and 64, and in one tile of 128; the Triton backward).
    *(((192, 128), torch.bfloat16, "ieee", jagged, group, name)
      for jagged, group, name in ((False, 1, "plain"), (False, 1, "causal"), (False, 1, "window"),
                                  (False, 1, "dropout"), (True, 4, "causal"))),
    *((dims, torch.bfloat16, "ieee", False, 1, "causal")
      for dims in ((256, 128), (192, 64), (128, 64), (136, 96), (96, 80))),
    ((128, 64), torch.bfloat16, "ieee", False, 1, "dropout"),
]


def main():
    for dims, dtype, precision, jagged, group, name in CASES:
        D, DV = dims if isinstance(dims, tuple) else (dims, dims)
        f = FEATURES[name]
        torch.backends.cuda.matmul.fp32_precision = precision
        problem = _problem(D, DV, jagged, group)
        q, k, v, do = _tensors(problem, dtype)
        B, H, S = problem.batch, problem.heads, problem.max_q
        bias = {"BHQK": torch.empty(B, H, S, S, dtype=dtype), "1HQK": torch.empty(1, H, S, S, dtype=dtype)}.get(
            f.get("bias"))
        opts = AttentionOptions(scale=D ** -0.5, causal=f.get("causal", False), window_left=f.get("window_left", -1),
                                window_right=f.get("window_right", -1),
                                softcap=f.get("softcap", 0.0), dropout_p=f.get("dropout", 0.0),
                                deterministic=f.get("deterministic", False),
                                prefix_len=torch.full((B,), 17, dtype=torch.int32) if f.get("prefix") else None,
                                documents=torch.zeros(2, B, S, dtype=torch.int32) if f.get("documents") else None,
                                query_offset=torch.zeros(B, dtype=torch.int32) if f.get("positions") else None,
                                dropout_sequences=torch.zeros(B, dtype=torch.int32) if f.get("positions") else None)
        alibi = torch.empty(B, H) if f.get("alibi") else None
        seed = None
        if f.get("dropout"):  # (a host key, or one in memory as a captured call draws it: options.DropoutSeed)
            seed = DropoutSeed(torch.ones(1, dtype=torch.int64), 0) if f.get("device_seed") else DropoutSeed(1, 2)
        for tma in (True, False) if name in ("plain", "causal") else (True,):
            dims = f"D{D}" if DV == D else f"D{D}v{DV}"
            label = (f"case {dims} {str(dtype)[6:]} {precision} {'jagged' if jagged else 'dense'} group{group} {name} "
                     f"{'tma' if tma else 'pointers'}")
            if os.environ.get("ATTENTION_VARIANTS", "") not in label:
                continue
            print(label, flush=True)
            fwd = configs.forward_config(problem, dtype, q.device, bias=bias is not None, dropout=seed is not None,
                                         tma=tma)
            bwd = configs.backward_config(problem, dtype, opts.masked, opts.deterministic, q.device,
                                          bias=bias is not None, dropout=seed is not None, tma=tma)
            out, lse = launch_forward(q, k, v, bias, alibi, problem, opts, seed, fwd, tma=tma, gluon=False)
            launch_backward(do, None, q, k, v, out, lse, bias, alibi, problem, opts, seed, bwd,
                            need_dbias=bias is not None, tma=tma, gluon=False)
            if tma and gluon_forward.supports(problem, opts, dtype, bias, alibi, seed):
                print(label.replace("case", "gluon forward"), flush=True)
                launch_forward(q, k, v, bias, alibi, problem, opts, seed, fwd, tma=tma, gluon=True)
                # At a tile head dim of 64 also with three query warpgroups (the rule takes them from 2048 queries).
                if gluon_common.wide_tile_head_dims(D, DV) == (64, 64):
                    print(label.replace("case", "gluon forward 3wg"), flush=True)
                    rule, gluon_forward.query_warpgroups = gluon_forward.query_warpgroups, lambda *args: 3
                    launch_forward(q, k, v, bias, alibi, problem, opts, seed, fwd, tma=tma, gluon=True)
                    gluon_forward.query_warpgroups = rule
            if (tma and gluon_backward_wide.supports(problem, opts, dtype, bias, alibi, seed)
                    and not gluon_backward.supports(problem, opts, dtype, bias, alibi, seed)):
                # Past a head dim of 128: dK and dV in tiles of 192 or 256, then dQ (the Gluon dQ kernel, or with
                # dropout the Triton one); dense calls also at
                # lengths that are no whole number of tiles (descriptors made by each program).
                print(label.replace("case", "gluon wide"), flush=True)
                launch_backward(do, None, q, k, v, out, lse, bias, alibi, problem, opts, seed, bwd,
                                need_dbias=False, tma=tma, gluon=True)
                if problem.dense:
                    ragged = _problem(D, DV, jagged, group, S=200)
                    rq, rk, rv, rdo = _tensors(ragged, dtype)
                    r_out, r_lse = launch_forward(rq, rk, rv, None, alibi, ragged, opts, seed, fwd, tma=tma,
                                                  gluon=False)
                    launch_backward(rdo, None, rq, rk, rv, r_out, r_lse, None, alibi, ragged, opts, seed, bwd,
                                    need_dbias=False, tma=tma, gluon=True)
            if tma and gluon_backward.supports(problem, opts, dtype, bias, alibi, seed):
                # At D64 one key block per program and two, whatever the rule takes (gluon_backward.pairs); dense
                # GQA also in groups of one kv head (program.kv_head_groups: the rule counts SMs, 1 here, and
                # takes none).
                rule, groups_rule = gluon_backward.pairs, program.kv_head_groups
                grouped = (False, True) if problem.dense and group > 1 else (False,)
                try:
                    pairable = gluon_common.tile_head_dim(D) == 64 and not opts.deterministic  # (one block: DET)
                    for paired, groups in itertools.product((False, True) if pairable else (None,), grouped):
                        program.kv_head_groups = (lambda *args: 1) if groups else groups_rule
                        if paired is not None:
                            gluon_backward.pairs = lambda *args, paired=paired: paired
                        form = {None: "gluon", False: "gluon one block", True: "gluon pairs"}[paired]
                        print(label.replace("case", form + (" in kv head groups" if groups else "")), flush=True)
                        launch_backward(do, None, q, k, v, out, lse, bias, alibi, problem, opts, seed, bwd,
                                        need_dbias=bias is not None, tma=tma, gluon=True)
                        if problem.dense:
                            # Lengths that are no whole number of tiles: each program makes its descriptors
                            # (gluon_backward.host_descriptors).
                            ragged = _problem(D, DV, jagged, group, S=200)
                            rq, rk, rv, rdo = _tensors(ragged, dtype)
                            r_bias = None if bias is None else torch.empty(*bias.shape[:2], 200, 200, dtype=dtype)
                            r_out, r_lse = launch_forward(rq, rk, rv, r_bias, alibi, ragged, opts, seed, fwd, tma=tma,
                                                          gluon=False)
                            launch_backward(rdo, None, rq, rk, rv, r_out, r_lse, r_bias, alibi, ragged, opts, seed,
                                            bwd, need_dbias=r_bias is not None, tma=tma, gluon=True)
                finally:
                    gluon_backward.pairs, program.kv_head_groups = rule, groups_rule

if __name__ == "__main__":
    main()
