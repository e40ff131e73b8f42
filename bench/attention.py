"""Attention forward/backward TFLOP/s and peak memory: varlen next to its peers, measured in one run.

    PYTHONPATH=src python3 bench/attention.py --suite dense varlen features --out bench/results/attention.md

Timing: medians of ``triton.testing.do_bench``; backward = (forward + backward) - forward, as in
shared/peers.md. FLOPs: forward 4·B·H·Sq·Sk·D (halved when causal; the visible pairs for windows),
backward 2.5 x forward. Peers: SDPA flash, efficient and cuDNN, and FlexAttention (compiled).
Tile tuning is ``bench/attention_sweep.py``'s job.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F

import varlen
from varlen._amp import float32_matmul_precision

DEV = "cuda"
BF16 = torch.bfloat16


def do_bench(fn, grad_to_none=None):
    from triton.testing import do_bench as _do_bench

    return _do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=grad_to_none)


def time_fwd_bwd(fn, leaves, flops):
    """(fwd TFLOP/s, bwd TFLOP/s, peak MiB of one fwd+bwd step above what was allocated before it)."""
    try:
        out = fn()
        out = out.values if isinstance(out, varlen.JaggedTensor) else out
        grad = torch.randn_like(out)
        del out

        def fwd_bwd():
            o = fn()
            (o.values if isinstance(o, varlen.JaggedTensor) else o).backward(grad)

        fwd = do_bench(fn)
        total = do_bench(fwd_bwd, grad_to_none=leaves)
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        for t in leaves:
            t.grad = None
        return flops / fwd / 1e9, 2.5 * flops / (total - fwd) / 1e9, peak
    except Exception as exc:  # a peer without a kernel for this case
        return "n/a: " + str(exc).replace("\n", " ")[:90]


def fmt(r):
    return r if isinstance(r, str) else f"{r[0]:.0f} / {r[1]:.0f}"


def peers_dense(q, k, v, causal, flops, with_flex, gqa=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    res = {}
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fn(be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
        res[name] = time_fwd_bwd(fn, [qt, kt, vt], flops)
    if with_flex:
        res["flex"] = flex_dense(qt, kt, vt, causal, flops, gqa)
    return res


_FLEX = None


def flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        # One compiled graph per shape; past dynamo's default limit of 8 recompiles, Flex would silently
        # fall back to its unfused eager path (seen: 8 TFLOP/s and 20-100 GB) in the later suites.
        torch._dynamo.config.cache_size_limit = 256
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_dense(qt, kt, vt, causal, flops, gqa=False):
    from torch.nn.attention.flex_attention import create_block_mask

    S = qt.shape[2]
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, S, S) if causal else None
    return time_fwd_bwd(lambda: flex()(qt, kt, vt, block_mask=bm, enable_gqa=gqa), [qt, kt, vt], flops)


def suite_dense(args, rows):
    for D in (64, 128):
        for S in (1024, 4096, 16384):
            B, H = max(1, 16384 // S), 2048 // D
            for causal in (False, True):
                q, k, v = (torch.randn(B, S, H, D, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
                flops = 4 * B * H * S * S * D * (0.5 if causal else 1)
                res = {"varlen": time_fwd_bwd(lambda: varlen.attention(q, k, v, causal=causal), [q, k, v], flops)}
                res["varlen_det"] = time_fwd_bwd(
                    lambda: varlen.attention(q, k, v, causal=causal, deterministic=True), [q, k, v], flops)
                res.update(peers_dense(q, k, v, causal, flops, with_flex=S >= 4096))
                rows.append(dict(suite="dense", case=f"D{D} S{S} B{B} H{H}" + (" causal" if causal else ""),
                                 res=res))
                print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)


def varlen_lengths():
    g = torch.Generator().manual_seed(0)
    return torch.randint(256, 4097, (16,), generator=g).tolist()


def suite_varlen(args, rows):
    from torch.nn.attention.flex_attention import create_block_mask

    lens, H, D = varlen_lengths(), 16, 128
    total = sum(lens)
    flops_full = sum(4 * H * L * L * D for L in lens)
    for causal in (False, True):
        flops = flops_full * (0.5 if causal else 1)
        q, k, v = (varlen.jagged([torch.randn(L, H, D, dtype=BF16) for L in lens], device=DEV) for _ in range(3))
        for t in (q, k, v):
            t.values.requires_grad_(True)
        leaves = [q.values, k.values, v.values]
        res = {"varlen": time_fwd_bwd(lambda: varlen.attention(q, k, v, causal=causal), leaves, flops)}
        res["varlen_det"] = time_fwd_bwd(lambda: varlen.attention(q, k, v, causal=causal, deterministic=True),
                                         leaves, flops)
        # Flex with a document mask over the packed sequence.
        qp, kp, vp = (t.values.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
                      for t in (q, k, v))
        doc = torch.cat([torch.full((L,), i) for i, L in enumerate(lens)]).to(DEV)
        pos = torch.cat([torch.arange(L) for L in lens]).to(DEV)
        if causal:
            mm = lambda b, h, i, j: (doc[i] == doc[j]) & (pos[i] >= pos[j])  # noqa: E731
        else:
            mm = lambda b, h, i, j: doc[i] == doc[j]  # noqa: E731
        bm = create_block_mask(mm, None, None, total, total)
        res["flex_docmask"] = time_fwd_bwd(lambda: flex()(qp, kp, vp, block_mask=bm), [qp, kp, vp], flops)
        # What users do without varlen: pad to the longest and mask (SDPA efficient).
        from torch.nn.attention import SDPBackend, sdpa_kernel

        Bn, S = len(lens), max(lens)
        qq, kk, vv = (torch.randn(Bn, H, S, D, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
        keep = (torch.arange(S)[None] < torch.tensor(lens)[:, None]).to(DEV)[:, None, None, :]
        if causal:
            keep = keep & torch.ones(S, S, dtype=torch.bool, device=DEV).tril()

        def padded():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=keep)
        res["padded_efficient"] = time_fwd_bwd(padded, [qq, kk, vv], flops)
        rows.append(dict(suite="varlen", case=f"16 seqs 256-4096 ({total} tokens) H16 D128"
                         + (" causal" if causal else ""), res=res))
        print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)


def suite_features(args, rows):
    # GQA 32/8 causal, B2 S4096 D128
    B, Hq, Hk, S, D = 2, 32, 8, 4096, 128
    q = torch.randn(B, S, Hq, D, device=DEV, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(B, S, Hk, D, device=DEV, dtype=BF16, requires_grad=True) for _ in range(2))
    flops = 4 * B * Hq * S * S * D * 0.5
    res = {"varlen": time_fwd_bwd(lambda: varlen.attention(q, k, v, causal=True), [q, k, v], flops)}
    res.update(peers_dense(q, k, v, True, flops, with_flex=True, gqa=True))
    rows.append(dict(suite="features", case="GQA 32/8 causal B2 S4096 D128", res=res))
    print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)
    # Sliding window 1024, causal, S16384
    B, H, S, D, W = 1, 16, 16384, 128, 1024
    q, k, v = (torch.randn(B, S, H, D, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
    flops = 4 * B * H * D * sum(min(i + 1, W) for i in range(S))
    res = {"varlen": time_fwd_bwd(lambda: varlen.attention(q, k, v, causal=True, window=(W - 1, 0)),
                                  [q, k, v], flops)}
    from torch.nn.attention.flex_attention import create_block_mask

    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    bmw = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < W), None, None, S, S)
    res["flex"] = time_fwd_bwd(lambda: flex()(qt, kt, vt, block_mask=bmw), [qt, kt, vt], flops)
    rows.append(dict(suite="features", case="window 1024 causal B1 S16384 H16 D128", res=res))
    print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)


def suite_fp32(args, rows):
    """float32 inputs: varlen at full float32 accuracy (torch's default: products from bf16 parts) and with TF32
    allowed, next to SDPA's memory-efficient kernel (the only fused float32 one), B·S = 16k tokens, H·D = 512.
    Then the demo's shape: 64 jagged sequences of 2-1025 tokens, H4 D64, against the padded batch + mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F32 = torch.float32
    for D in (64, 128):
        for S in (1024, 4096):
            B, H = 16384 // S, 512 // D
            for causal in (False, True):
                q, k, v = (torch.randn(B, S, H, D, device=DEV, dtype=F32, requires_grad=True) for _ in range(3))
                qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
                flops = 4 * B * H * S * S * D * (0.5 if causal else 1)
                res = {}

                def efficient():
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                for prec in ("ieee", "tf32"):
                    with float32_matmul_precision(prec):
                        res[f"varlen {prec}"] = time_fwd_bwd(lambda: varlen.attention(q, k, v, causal=causal),
                                                             [q, k, v], flops)
                        res[f"sdpa_efficient {prec}"] = time_fwd_bwd(efficient, [qt, kt, vt], flops)
                rows.append(dict(suite="fp32", case=f"D{D} S{S} B{B} H{H}" + (" causal" if causal else ""), res=res))
                print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(2, 1026, (64,), generator=g).tolist()
    H, D = 4, 64
    flops = sum(4 * H * L * L * D for L in lens)
    q, k, v = (varlen.jagged([torch.randn(L, H, D) for L in lens], device=DEV) for _ in range(3))
    for t in (q, k, v):
        t.values.requires_grad_(True)
    S = max(lens)
    qq, kk, vv = (torch.randn(len(lens), H, S, D, device=DEV, requires_grad=True) for _ in range(3))
    keep = (torch.arange(S)[None] < torch.tensor(lens)[:, None]).to(DEV)[:, None, None, :]

    def padded():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=keep)
    res = {}
    for prec in ("ieee", "tf32"):
        with float32_matmul_precision(prec):
            res[f"varlen {prec}"] = time_fwd_bwd(lambda: varlen.attention(q, k, v), [q.values, k.values, v.values],
                                                 flops)
            res[f"padded sdpa_efficient {prec}"] = time_fwd_bwd(padded, [qq, kk, vv], flops)
    rows.append(dict(suite="fp32", case=f"demo shape: 64 seqs 2-1025 ({sum(lens)} tokens) H4 D64, useful FLOPs",
                     res=res))
    print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)


def suite_bias_dropout(args, rows):
    """Issue 4's cases: a learnable bias, dropout, and a jagged batch with a learnable bias."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, S, D = 4, 16, 2048, 128
    flops = 4 * B * H * S * S * D
    q, k, v = (torch.randn(B, S, H, D, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    bias = torch.randn(B, H, S, S, device=DEV, dtype=BF16, requires_grad=True)
    res = {"varlen": time_fwd_bwd(lambda: varlen.attention(q, k, v, bias=bias), [q, k, v, bias], flops)}
    res["varlen_det"] = time_fwd_bwd(lambda: varlen.attention(q, k, v, bias=bias, deterministic=True),
                                     [q, k, v, bias], flops)

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias)
    res["sdpa_efficient"] = time_fwd_bwd(efficient, [qt, kt, vt, bias], flops)
    res["flex"] = time_fwd_bwd(lambda: flex()(qt, kt, vt, score_mod=lambda s, b, h, i, j: s + bias[b, h, i, j]),
                               [qt, kt, vt, bias], flops)
    rows.append(dict(suite="bias & dropout", case="bias (B,H,S,S) with grad, B4 S2048 H16 D128", res=res))
    print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)
    shared = torch.randn(1, H, S, S, device=DEV, dtype=BF16, requires_grad=True)
    res = {"varlen": time_fwd_bwd(lambda: varlen.attention(q, k, v, bias=shared), [q, k, v, shared], flops)}
    res["varlen_det"] = time_fwd_bwd(lambda: varlen.attention(q, k, v, bias=shared, deterministic=True),
                                     [q, k, v, shared], flops)

    def efficient_shared():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=shared)
    res["sdpa_efficient"] = time_fwd_bwd(efficient_shared, [qt, kt, vt, shared], flops)
    res["flex"] = time_fwd_bwd(lambda: flex()(qt, kt, vt, score_mod=lambda s, b, h, i, j: s + shared[0, h, i, j]),
                               [qt, kt, vt, shared], flops)
    rows.append(dict(suite="bias & dropout", case="bias (1,H,S,S) with grad, B4 S2048 H16 D128", res=res))
    print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)

    # Dropout at S2k, where a step's host time is close to its GPU time, and at S8k, where the kernels bound it.
    for B_drop, S_drop in ((B, S), (1, 4 * S)):
        flops = 4 * B_drop * H * S_drop * S_drop * D
        q, k, v = (torch.randn(B_drop, S_drop, H, D, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        res = {"varlen": time_fwd_bwd(lambda: varlen.attention(q, k, v, dropout_p=0.1), [q, k, v], flops)}
        for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def fn(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qt, kt, vt, dropout_p=0.1)
            res[name] = time_fwd_bwd(fn, [qt, kt, vt], flops)
        rows.append(dict(suite="bias & dropout", case=f"dropout 0.1, B{B_drop} S{S_drop} H{H} D{D}", res=res))
        print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)

    # Jagged batch with a learnable (1, H, max, max) bias; the padded alternative is SDPA efficient on
    # the padded batch with the bias plus a -inf padding mask (no peer runs this jagged).
    lens = varlen_lengths()
    total, Lmax = sum(lens), max(lens)
    flops = sum(4 * H * L * L * D for L in lens)
    qj, kj, vj = (varlen.jagged([torch.randn(L, H, D, dtype=BF16) for L in lens], device=DEV) for _ in range(3))
    for t in (qj, kj, vj):
        t.values.requires_grad_(True)
    rel = torch.randn(1, H, Lmax, Lmax, device=DEV, dtype=BF16, requires_grad=True)
    res = {"varlen": time_fwd_bwd(lambda: varlen.attention(qj, kj, vj, bias=rel),
                                  [qj.values, kj.values, vj.values, rel], flops)}
    qp, kp, vp = (torch.randn(len(lens), H, Lmax, D, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
    pad = torch.zeros(len(lens), 1, 1, Lmax, device=DEV, dtype=BF16)
    pad.masked_fill_((torch.arange(Lmax)[None] >= torch.tensor(lens)[:, None]).to(DEV)[:, None, None, :],
                     float("-inf"))

    def padded():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=rel + pad)
    res["padded_efficient"] = time_fwd_bwd(padded, [qp, kp, vp, rel], flops)
    rows.append(dict(suite="bias & dropout", case=f"jagged 16 seqs ({total} tokens) + bias (1,H,max,max) with grad",
                     res=res))
    print(json.dumps({"case": rows[-1]["case"], **{n: fmt(r) for n, r in res.items()}}), flush=True)


def write_table(rows, path):
    import triton

    head = (f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today()}. TFLOP/s forward / backward (bf16 unless the suite says float32), "
            "medians of do_bench; backward = (fwd+bwd) - fwd; FLOPs 4·B·H·Sq·Sk·D, halved when causal, backward 2.5x. "
            "Peak memory: one forward+backward step, above what was allocated before it (inputs included "
            "there; the bias gradient, where there is one, counts).\n")
    lines = [head]
    for suite in dict.fromkeys(r["suite"] for r in rows):
        srows = [r for r in rows if r["suite"] == suite]
        names = list(dict.fromkeys(n for r in srows for n in r["res"]))
        lines.append(f"\n### {suite}\n\n| case | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for r in srows:
            lines.append(f"| {r['case']} | " + " | ".join(fmt(r["res"].get(n, "")) for n in names) + " |")
        mem = [(r["case"], n, x[2]) for r in srows for n, x in r["res"].items() if not isinstance(x, str)]
        if suite != "dense":
            lines.append("\nPeak memory above inputs (MiB): " + "; ".join(f"{c} {n}: {m:.0f}" for c, n, m in mem))
    text = "\n".join(lines) + "\n"
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", nargs="+", default=["dense", "varlen", "features", "bias_dropout", "fp32"],
                    choices=["dense", "varlen", "features", "bias_dropout", "fp32"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    rows = []
    for s in args.suite:
        {"dense": suite_dense, "varlen": suite_varlen, "features": suite_features,
         "bias_dropout": suite_bias_dropout, "fp32": suite_fp32}[s](args, rows)
    if rows:
        write_table(rows, args.out)


if __name__ == "__main__":
    main()
