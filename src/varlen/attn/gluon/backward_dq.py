"""Hopper attention backward in Gluon past a head dim of 128: dQ, warp-specialized and persistent, beside
``backward_wide.py``'s dK and dV.

Past 128 ``backward_wide.py``'s kernel computes dK and dV only (its shared memory has no room for dQ's float32 staging,
nor its registers for a third accumulator), and dQ came from the Triton dQ kernel, whose tiles are powers of two: at
head dim 192 a quarter of its products ran on zeros, and it took 37-42% of a step (H100, bench/NOTES.md). This kernel
walks the forward's work items (``forward.py``: blocks of 128 queries of one head, two query warpgroups of 64, the
loader warp and its K and V rings, each item claimed by a ticket) and computes per key tile

    S = Q Kᵀ,  P = exp2(qk_scale S - lse2),  dP = dO Vᵀ,  dS = P (dP - delta),  dQ += dS K

with dQ in registers (64 x D float32 per warpgroup; in a tile of 192 two accumulators, of 128 and 64 columns, as the
forward's). A tile's S and dP are issued with the previous tile's dQ product, so that its P and dS run under that
product. ``lse2`` (log2 units, +inf for a query that sees no key: P = 0) and ``delta`` come from the Triton backward's
preprocess; the loader brings each block's dO with its Q (``forward._load_tiles``'s ``WITH_DO``). dQ, times the
softmax scale, is staged in the warpgroup's part of Q, whose tile has its shape, and leaves by a TMA store where its
64 rows lie in the sequence (by masked stores at a sequence's first or last rows); Q is released once the store has
read it. dQ is stored, not added: deterministic.

Scope (:func:`supports`): what ``backward_wide.py`` takes (``common.wide_tile_head_dims``: Q's and K's head dim in a
tile of 192 or 256, V's in its own tile) but dropout, whose Philox tile (``gluon/dropout.py``) is 128 keys wide where
these tiles are 64 or 32 (:func:`block_keys`); those keep the Triton dQ kernel. Rows past a sequence's end and keys
past it are handled as the forward handles them: queries there are computed and never stored, keys there are masked
out of P (their K rows, read from the next sequence, multiply zeros: NaN or inf there would make dQ NaN, as in the
forward's O). Gluon doesn't run in the interpreter: the GPU tests cover every variant it accepts.
"""

from __future__ import annotations

import torch

from ..._launch import fast_launch
from ...tiling import cdiv, sm_count
from ..triton.launch import ensure_allocator
from ..triton.masks import Mask, in_band
from ..triton.program import Rows, Seqs, lse_offset, rows
from . import backward_wide, common
from .common import (
    HAVE_GLUON,
    fence_async_shared,
    gl,
    gluon,
    head_descriptor,
    mbarrier,
    store_head_tile,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .forward import _in_sequence, _load_tiles, _receive, _work_item  # (the forward's schedule and loader)

WARPGROUPS = 2  # query warpgroups per program, 64 queries each
# K's ring holds three tiles (V's two): a K tile is read until the next tile's dQ product is done, so with two the
# loader could fetch a tile only as it was needed.
K_STAGES = 3


def block_keys(tile_d: int, tile_dv: int) -> int:
    """Keys per tile: 64, or 32 where Q, dO and the rings of 64-key tiles would overflow shared memory (tiles of 256 for
    both Q and V: 2 x 64 x 512 x 2 bytes of Q and dO, and 5 x 64 x 256 x 2 of K and V, 288 KiB)."""
    return 64 if tile_d + tile_dv <= 384 else 32


if HAVE_GLUON:
    @gluon.jit
    def _dq_warpgroup(args, F: gl.constexpr, D: gl.constexpr, HI: gl.constexpr, HEAD_D: gl.constexpr,
                      HIV: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, KS: gl.constexpr, WGS: gl.constexpr,
                      WG: gl.constexpr):
        """One query warpgroup: per work item, dQ of queries ``m0 + 64 WG ..`` (+64) over every visible key tile, then
        stored. ``args``: what every query warpgroup takes (``_bwd_dq_wide_hopper``). In a tile of 192 (``HI``: 64 for
        Q, K and dQ; ``HIV``: for V and dO) each product with a tile is a pair, and dQ's last 64 columns an accumulator
        of their own."""
        (q_smem, do_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item, item_ready,
         item_free, dq_desc, dq_desc_hi, DQ, dq_stride, LSE2, DELTA, cu_q, cu_k, total_q, total_k, max_q, max_k,
         n_items, n_blocks, WL, R, scale, qk_scale, q_hi, k_hi, v_hi, do_hi) = args
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D - HI, 16])
        dqh_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HI if HI > 0 else D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        N_DQ: gl.constexpr = 2 if HI > 0 else 1  # dQ's products in flight while a tile's S and dP are waited for
        q_w = q_smem.index(WG)
        q_hw = q_hi.index(WG)
        do_w = do_smem.index(WG)
        do_hw = do_hi.index(WG)
        kv = 0  # key tiles consumed so far (ring position)
        qi = 0  # Q blocks consumed so far
        it = 0  # items received so far
        t = _receive(it, item, item_ready, item_free)
        while t < n_items:
            it += 1
            for half in range(2):
                live, b, h, m0, q_row, k_row, Lq, Lk, shift, t_lo, u_lo, u_hi, n_tiles = _work_item(
                    t, half, n_blocks, cu_q, cu_k, total_q, total_k, max_q, max_k, WL, R, H, F.VARLEN, F.BOTTOM_RIGHT,
                    F.HAS_R, F.HAS_WL, BN, 64 * WGS, False)
                r0 = m0 + WG * 64
                if live:
                    rows = r0 + gl.arange(0, 64, layout=row_s)
                    in_rows = _in_sequence(rows, Lq, False)
                    head_row = lse_offset(b, q_row, h, H, total_q, max_q, F.VARLEN)
                    lse2 = gl.load(LSE2 + head_row + rows, mask=in_rows, other=float("inf"))
                    delta = gl.load(DELTA + head_row + rows, mask=in_rows, other=0.0)
                    dq = gl.zeros([64, D - HI], gl.float32, layout=dq_layout)
                    dq_hi = gl.zeros([64, HI], gl.float32, layout=dqh_layout) if HI > 0 else 0
                    if n_tiles > 0:
                        mbarrier.wait(q_ready, qi & 1)
                        ds = gl.zeros([64, BN], dtype, layout=a_layout)
                        # Tile j: S_j and dP_j are issued with dQ += dS_{j-1} K_{j-1} (tile 0: dS is 0 and K_0 stands
                        # for K_{-1}, a product that adds nothing, so that the loop holds one copy of the tile's code).
                        # Every product is waited for within its iteration.
                        for j in range(n_tiles):
                            i = kv + j
                            stage = i % 2
                            k_stage = i % KS
                            ik = (i - (j > 0).to(gl.int32)) % KS  # (the previous tile's K; tile 0's own)
                            mbarrier.wait(k_ready.index(k_stage), (i // KS) & 1)
                            mbarrier.wait(v_ready.index(stage), (i // 2) & 1)
                            s = warpgroup_mma(q_w, k_ring.index(k_stage).permute((1, 0)),
                                              gl.zeros([64, BN], gl.float32, layout=s_layout), use_acc=False,
                                              is_async=True)
                            if HI > 0:
                                s = warpgroup_mma(q_hw, k_hi.index(k_stage).permute((1, 0)), s, is_async=True)
                            dp = warpgroup_mma(do_w, v_ring.index(stage).permute((1, 0)),
                                               gl.zeros([64, BN], gl.float32, layout=s_layout), use_acc=False,
                                               is_async=True)
                            if HIV > 0:
                                dp = warpgroup_mma(do_hw, v_hi.index(stage).permute((1, 0)), dp, is_async=True)
                            dq = warpgroup_mma(ds, k_ring.index(ik), dq, is_async=True)
                            if HI > 0:
                                dq_hi = warpgroup_mma(ds, k_hi.index(ik), dq_hi, is_async=True)
                            s, dp = warpgroup_mma_wait(N_DQ, deps=(s, dp))
                            mbarrier.arrive(v_empty.index(stage))
                            p = gl.exp2(s * qk_scale - lse2[:, None])
                            n0 = t_lo + j * BN
                            if (n0 < u_lo) | (n0 >= u_hi):  # (tiles in [u_lo, u_hi) see every key)
                                cols = n0 + gl.arange(0, BN, layout=col_s)
                                ok = in_band(cols[None, :] < Lk, rows[:, None], cols[None, :], shift, WL, R, F.HAS_R,
                                             F.HAS_WL)
                                p = gl.where(ok, p, 0.0)
                            ds_next = p * (dp - delta[:, None])
                            if HI > 0:
                                dq, dq_hi = warpgroup_mma_wait(0, deps=(dq, dq_hi))
                            else:
                                dq = warpgroup_mma_wait(0, deps=(dq,))
                            if j > 0:
                                mbarrier.arrive(k_empty.index(ik))
                            ds = gl.convert_layout(ds_next.to(dtype), a_layout)
                        last = (kv + n_tiles - 1) % KS
                        dq = warpgroup_mma(ds, k_ring.index(last), dq, is_async=True)
                        if HI > 0:
                            dq_hi = warpgroup_mma(ds, k_hi.index(last), dq_hi, is_async=True)
                            dq, dq_hi = warpgroup_mma_wait(0, deps=(dq, dq_hi))
                        else:
                            dq = warpgroup_mma_wait(0, deps=(dq,))
                        mbarrier.arrive(k_empty.index(last))
                        kv += n_tiles
                        qi += 1
                    out = (dq * scale).to(dtype)
                    if HI > 0:
                        out_hi = (dq_hi * scale).to(dtype)
                    # Staged in this warpgroup's part of Q (only a block that loaded Q: the loader may be filling it
                    # otherwise), or by masked stores at a sequence's first or last rows.
                    if (r0 + 64 <= Lq) & (n_tiles > 0):
                        q_w.store(out)
                        if HI > 0:
                            q_hw.store(out_hi)
                        fence_async_shared()
                        gl.thread_barrier()
                        store_head_tile(dq_desc, q_row + r0, h, q_w, 0, D, HEAD_D)
                        if HI > 0:
                            store_head_tile(dq_desc_hi, q_row + r0, h, q_hw, 0, D, HEAD_D, D - HI)
                        tma.store_wait(0)  # the store has read Q's part: the next block may load
                    else:
                        rows_o = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, dq_layout))
                        cols_o = gl.arange(0, D - HI, layout=gl.SliceLayout(0, dq_layout))
                        ptrs = (DQ + (q_row + rows_o).to(gl.int64)[:, None] * dq_stride + h * HEAD_D +
                                cols_o[None, :])
                        gl.store(ptrs, out, mask=(rows_o < Lq)[:, None] & (cols_o < HEAD_D)[None, :])
                        if HI > 0:
                            rows_h = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, dqh_layout))
                            cols_h = D - HI + gl.arange(0, HI, layout=gl.SliceLayout(0, dqh_layout))
                            ptrs_h = (DQ + (q_row + rows_h).to(gl.int64)[:, None] * dq_stride + h * HEAD_D +
                                      cols_h[None, :])
                            gl.store(ptrs_h, out_hi, mask=(rows_h < Lq)[:, None] & (cols_h < HEAD_D)[None, :])
                    if n_tiles > 0:
                        mbarrier.arrive(q_empty)
            t = _receive(it, item, item_ready, item_free)

    @fast_launch
    @gluon.jit(do_not_specialize=[*common.DATA_DEPENDENT, "n_seqs"])
    def _bwd_dq_wide_hopper(Q: Rows, K: Rows, V: Rows, dO: Rows, dQ: Rows, LSE2, DELTA, seqs: Seqs, total_q, total_k,
                            max_q, max_k, n_seqs, counter, mask: Mask, scale, qk_scale, F: gl.constexpr,
                            D: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr, HEAD_DV: gl.constexpr,
                            H: gl.constexpr, HKV: gl.constexpr, GROUP: gl.constexpr, BN: gl.constexpr,
                            KS: gl.constexpr, WGS: gl.constexpr):
        """Persistent, as ``forward._attn_fwd_hopper``: a grid of at most one program per SM walking the
        ``cdiv(cdiv(max_q, 64 WGS), 2) x H x n_seqs`` work items (``WGS``: two query warpgroups); ``counter``: a zeroed
        int32 (the items' tickets); ``KS``: the K ring's slots.
        Tensors as ``backward_wide._bwd_kv_wide_hopper``'s (heads packed in a row; dense sequences one after another),
        dQ like Q (written); ``LSE2``, ``DELTA``: the preprocess's. Q's, K's and dQ's head dim ``HEAD_D`` in tiles of
        ``D``, V's and dO's ``HEAD_DV`` in tiles of ``DV`` (``common.wide_tile_head_dims``). ``scale``: the softmax
        scale; ``qk_scale``: it times log2(e)."""
        dtype: gl.constexpr = Q.ptr.dtype.element_ty
        HI: gl.constexpr = 64 if D == 192 else 0
        HIV: gl.constexpr = 64 if DV == 192 else 0
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D - HI], dtype)
        do_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DV - HIV], dtype)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D - HI], dtype)
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, DV - HIV], dtype)
        if F.VARLEN:
            q_rows = total_q
            k_rows = total_k
        else:
            q_rows = n_seqs * max_q
            k_rows = n_seqs * max_k
        # One descriptor per tensor over all its rows (the forward's: a tile past a sequence's end reads the next
        # sequence's rows, masked out of P, or computed and never stored). As in the forward, the loader makes the
        # ones it copies through (Q, dO, K, V) and dQ's is made here, as the forward's O.
        dq_desc = head_descriptor(dQ.ptr, q_rows, H, dQ.stride_s, 64, D - HI, D, HEAD_D)
        dq_desc_hi = head_descriptor(dQ.ptr, q_rows, H, dQ.stride_s, 64, HI, D, HEAD_D) if HI > 0 else dq_desc
        q_smem = gl.allocate_shared_memory(dtype, [WGS, 64, D - HI], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [WGS, 64, DV - HIV], do_layout)
        k_ring = gl.allocate_shared_memory(dtype, [KS, BN, D - HI], k_layout)
        v_ring = gl.allocate_shared_memory(dtype, [2, BN, DV - HIV], v_layout)
        # The second parts (the first parts stand in for them where HI or HIV is 0, unused).
        if HI > 0:
            qh_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HI], dtype)
            kh_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HI], dtype)
            q_hi = gl.allocate_shared_memory(dtype, [WGS, 64, HI], qh_layout)
            k_hi = gl.allocate_shared_memory(dtype, [KS, BN, HI], kh_layout)
        else:
            q_hi, k_hi = q_smem, k_ring
        if HIV > 0:
            doh_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HIV], dtype)
            vh_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HIV], dtype)
            do_hi = gl.allocate_shared_memory(dtype, [WGS, 64, HIV], doh_layout)
            v_hi = gl.allocate_shared_memory(dtype, [2, BN, HIV], vh_layout)
        else:
            do_hi, v_hi = do_smem, v_ring
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=WGS)
        for i in gl.static_range(KS):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=WGS)
        for i in gl.static_range(2):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=WGS)
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_free.index(i), count=WGS)

        n_blocks = (max_q + 64 * WGS - 1) // (64 * WGS)
        n_items = (n_blocks + 1) // 2 * H * n_seqs
        wg_args = (q_smem, do_smem, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item,
                   item_ready, item_free, dq_desc, dq_desc_hi, dQ.ptr, dQ.stride_s, LSE2, DELTA, seqs.cu_q, seqs.cu_k,
                   total_q, total_k, max_q, max_k, n_items, n_blocks, mask.window_left, mask.right, scale, qk_scale,
                   q_hi, k_hi, v_hi, do_hi)
        load_args = (Q.ptr, Q.stride_s, K.ptr, K.stride_s, V.ptr, V.stride_s, q_rows, k_rows, q_smem, k_ring, v_ring,
                     q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item, item_ready, item_free, counter,
                     seqs.cu_q, seqs.cu_k, total_q, total_k, max_q, max_k, n_items, n_blocks, mask.window_left,
                     mask.right, q_hi, k_hi, v_hi, dO.ptr, dO.stride_s, do_smem, do_hi)
        gl.static_assert(WGS == 2)
        gl.warp_specialize([(_dq_warpgroup, (wg_args, F, D, HI, HEAD_D, HIV, H, BN, KS, WGS, 0)),
                            (_dq_warpgroup, (wg_args, F, D, HI, HEAD_D, HIV, H, BN, KS, WGS, 1)),
                            (_load_tiles, (load_args, F, D, HI, HEAD_D, DV, HIV, HEAD_DV, H, GROUP, BN, WGS,
                                           False, True, KS))],
                           [4, 1], [common.CONSUMER_REGS, common.LOADER_REGS])
        mbarrier.invalidate(q_ready)
        mbarrier.invalidate(q_empty)
        for i in gl.static_range(KS):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(v_empty.index(i))
            mbarrier.invalidate(item_ready.index(i))
            mbarrier.invalidate(item_free.index(i))


def supports(problem, opts, dtype, bias, alibi, seed) -> bool:
    """Whether the kernel computes this call's dQ (whatever the machine): one ``backward_wide.py`` takes (past 128,
    and deterministic causal calls in tiles of 128), without dropout (:func:`block_keys`)."""
    return seed is None and backward_wide.supports(problem, opts, dtype, bias, alibi, seed)


def applies(problem, opts, q, k, v, dout, bias, alibi, seed) -> bool:
    """Whether the kernel takes this call here: :func:`supports`, on an sm_90 GPU with Gluon, every tensor with its
    heads packed in a row and TMA-aligned, and (dense) its sequences one after another in memory (the kernel's
    descriptors span all rows)."""
    if not (supports(problem, opts, q.dtype, bias, alibi, seed) and common.hopper_layout(q, k, v, dout)):
        return False
    return not problem.dense or common.sequences_adjacent(q, k, v, dout)


def launch(q, k, v, dout, dq, lse2, delta, problem, seq_args, mask, feats, scores) -> None:
    """Run the kernel: ``dq`` (packed heads, like q) written; ``lse2``, ``delta``: the preprocess's; ``mask``,
    ``scores``: the call's ``Mask`` and ``Scores`` bundles."""
    ensure_allocator()  # the kernel builds its TMA descriptors on the device
    dense = problem.dense
    tile_d, tile_dv = common.wide_tile_head_dims(problem.head_dim, problem.head_dim_v)
    items = cdiv(cdiv(problem.max_q, 64 * WARPGROUPS), 2) * problem.heads * problem.batch  # (two blocks each)
    _bwd_dq_wide_hopper[(min(items, sm_count(q.device)),)](
        rows(q, dense), rows(k, dense), rows(v, dense), rows(dout, dense), rows(dq, dense), lse2, delta, **seq_args,
        n_seqs=problem.batch, counter=torch.zeros(1, dtype=torch.int32, device=q.device), mask=mask,
        scale=scores.scale, qk_scale=scores.qk_scale, F=feats, D=tile_d, HEAD_D=problem.head_dim, DV=tile_dv,
        HEAD_DV=problem.head_dim_v, H=problem.heads, HKV=problem.kv_heads, GROUP=problem.group,
        BN=block_keys(tile_d, tile_dv), KS=K_STAGES, WGS=WARPGROUPS, num_warps=4, maxnreg=common.MAX_REGS,
    )
