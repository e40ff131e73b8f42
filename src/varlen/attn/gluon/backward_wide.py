"""Hopper attention backward in Gluon past a head dim of 128: a key block's dK and dV in tiles of 192 or 256,
warp-specialized.

``backward.py``'s kernel gives each of its two warpgroups 64 keys and all their dK and dV columns: at a head dim of
256 those 64 x 256 float32 accumulators alone would take 256 registers per thread. Here the two warpgroups share one
block of 64 keys and split the work by product instead:

- the **score** warpgroup computes Sᵀ = K Qᵀ (from -lse, in units of S), Pᵀ = exp2(qk_scale Sᵀ), hands Pᵀ over in
  float32 through shared memory, and adds dV += Pᵀ dO (Pᵀ from its registers);
- the **gradient** warpgroup computes dPᵀ = V dOᵀ (from -delta), takes Pᵀ, and adds dK += dSᵀ Q with
  dSᵀ = Pᵀ dPᵀ (from its registers).

Each holds one 64 x 256 float32 accumulator (128 registers; in a tile of 192 two, of 128 and 64 columns, since Triton's
tensors have power-of-two shapes, as the tile's Q, K, V and dO are two boxes each) and does two of the four products, as
many FLOPs as the other; only Pᵀ crosses between them, one way (``p_ready`` / ``p_free``, double-buffered). A loader
warp brings K and V once and the (Q, dO) tiles of 64 queries of every head of the GQA group through a two-stage ring,
each stage with its tile's lse and delta, as ``backward.py``'s does. dQ is not computed here: the shared memory (K, V,
the ring and Pᵀ: 224 KiB) has no room for its float32 staging, and its product would need a third accumulator; the
Gluon dQ kernel (``backward_dq.py``; with dropout the Triton one, ``triton/backward.py``'s ``_bwd_q_kernel``, in its
tuned tiles, ``configs.HEAD256_SWEEP``) computes it after, which also makes the backward deterministic (dK and dV are
stored, not added).

Sequences and heads as in ``backward.py``: per-sequence TMA descriptors made on the device (boxes clip at the last
row: queries past ``Lq`` get ``lse2 = +inf``, so P = 0; keys past ``Lk`` are zero rows whose dK and dV are never
stored), or, for dense calls whose lengths are whole numbers of tiles, descriptors made once on the host. Head dims
below their tile's (136-184 in tiles of 192, 200-248 in tiles of 256, multiples of 8: ``common.wide_tile_head_dim``)
are read through 3-D descriptors, zeros past the head, and stored clipped there.

Dropout: the score warpgroup draws each tile's keep bits before issuing its product (``gluon/dropout.py``'s
backward tile, the mask of ``varlen.attn.dropout`` bit for bit) and puts them in Pᵀ's sign bits, as ``backward.py``
does: dV takes the kept P, and the gradient warpgroup makes dSᵀ from the signed Pᵀ without a select.

Scope (:func:`supports`): fp16/bf16, head dims 136-256 (multiples of 8), Dv = D or a value head dim in a tile of 64 or
128 of its own (``common.wide_tile_head_dims``: V, dO and dV in it, e.g. multi-head latent attention's 192 / 128 in
tiles of 192 and 128), dense or jagged, no mask, causal (either alignment) or windows, GQA, dropout, deterministic or
not; no bias, ALiBi, softcap, prefix, documents or query positions. :func:`applies` adds the machine (sm_90 with Gluon)
and the layout (heads packed in a row, TMA-aligned). It runs wherever it applies (H100 and H200: 1.5-3.2x the Triton
kernels it replaces, 0.99-1.35x cuDNN; ``bench/NOTES.md``, "The Gluon backward in tiles of 256"). Gluon doesn't run in
the interpreter: the GPU tests cover every variant it accepts.
"""

from __future__ import annotations

from ..._launch import fast_launch
from ...tiling import cdiv
from ..triton.launch import ensure_allocator
from ..triton.masks import Mask, in_band, query_stages
from ..triton.program import Rows, Seqs, base, batch, key_block_grid, lse_offset, prologue, rows
from ..triton.scores import Dropout
from . import common
from .common import (
    HAVE_GLUON,
    fence_async_shared,
    gl,
    gluon,
    load_head_tile,
    mbarrier,
    query_vector,
    sequence_descriptor,
    store_head_tile,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .dropout import dropped_signs, keep_words, relu_low

BLOCK_N = 64   # keys per program (both warpgroups)
BLOCK_M = 64   # queries per tile of the ring
NUM_WARPS = 4  # the default partition: the score warpgroup; the gradient warpgroup and the loader are workers
# Dense causal calls with fewer programs than this per SM start every first key block first (program.blocks_last),
# as backward.py's kernel does (not measured at this tile).
PROGRAMS_PER_SM = 8


if HAVE_GLUON:
    @gluon.jit
    def _parts(host, host_hi, ptr, rows, heads, row_stride, BOX_ROWS: gl.constexpr, D: gl.constexpr,
               HI: gl.constexpr, HEAD_D: gl.constexpr, HOST: gl.constexpr):
        """A tile's two descriptors (``common.sequence_descriptor``: ``host`` and ``host_hi`` where ``HOST``), of its
        first ``D - HI`` columns and, where ``HI`` is 64, of its last 64 (else the first's again, unused)."""
        desc = sequence_descriptor(host, ptr, rows, heads, row_stride, BOX_ROWS, D - HI, D, HEAD_D, HOST)
        desc_hi = sequence_descriptor(host_hi, ptr, rows, heads, row_stride, BOX_ROWS, HI, D, HEAD_D,
                                      HOST) if HI > 0 else desc
        return desc, desc_hi

    @gluon.jit
    def _load_tiles(load_src, k_smem, v_smem, q_ring, do_ring, lse2_ring, delta_ring, kv_bar, ready, empty, LSE2,
                    DELTA, total_q, max_q, b, q_start, Lq, Lk, q_row, k_row, hk, n0, t_lo, n_tiles, his,
                    VARLEN: gl.constexpr, D: gl.constexpr, HI: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr,
                    HIV: gl.constexpr, HEAD_DV: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr,
                    BM: gl.constexpr, BN: gl.constexpr, HOST: gl.constexpr):
        """The producer warp: the block's K and V at once, then the (Q, dO) tiles of every head of the group through
        the two-stage ring, each stage refilled once both warpgroups released it, with the tile's lse (log2 units;
        +inf past ``Lq``) and delta, loaded by this warp's threads. ``q_row``, ``k_row``: the sequence's first rows in
        the descriptors. ``his``: the second parts' tiles (``_bwd_kv_wide_hopper``), loaded where ``HI`` (Q's and
        K's) or ``HIV`` (V's and dO's) is 64. ``load_src``: where the descriptors come from (:func:`_parts`)."""
        (KD, VD, QD, dOD, KH, VH, QH, dOH, k_ptr, v_ptr, q_ptr, do_ptr, k_stride, v_stride, q_stride,
         do_stride) = load_src
        k_hi, v_hi, q_hi, do_hi = his
        HKV: gl.constexpr = H // GROUP
        k_desc, k_desc_hi = _parts(KD, KH, k_ptr, Lk, HKV, k_stride, BN, D, HI, HEAD_D, HOST)
        v_desc, v_desc_hi = _parts(VD, VH, v_ptr, Lk, HKV, v_stride, BN, DV, HIV, HEAD_DV, HOST)
        q_desc, q_desc_hi = _parts(QD, QH, q_ptr, Lq, H, q_stride, BM, D, HI, HEAD_D, HOST)
        do_desc, do_desc_hi = _parts(dOD, dOH, do_ptr, Lq, H, do_stride, BM, DV, HIV, HEAD_DV, HOST)
        dtype: gl.constexpr = k_desc.dtype
        mbarrier.expect(kv_bar.index(0), BN * (D + DV) * dtype.primitive_bitwidth // 8)
        load_head_tile(k_desc, k_row + n0, hk, kv_bar.index(0), k_smem, D, HEAD_D)
        if HI > 0:
            load_head_tile(k_desc_hi, k_row + n0, hk, kv_bar.index(0), k_hi, D, HEAD_D, D - HI)
        load_head_tile(v_desc, k_row + n0, hk, kv_bar.index(0), v_smem, DV, HEAD_DV)
        if HIV > 0:
            load_head_tile(v_desc_hi, k_row + n0, hk, kv_bar.index(0), v_hi, DV, HEAD_DV, DV - HIV)
        tile_bytes: gl.constexpr = BM * (D + DV) * dtype.primitive_bitwidth // 8
        count = 0
        for g in range(GROUP):
            h = hk * GROUP + g
            head_row = lse_offset(b, q_start, h, H, total_q, max_q, VARLEN)  # (of lse2 and delta)
            for j in range(n_tiles):
                stage = count % 2
                mbarrier.wait(empty.index(stage), ((count // 2) & 1) ^ 1)  # (a fresh barrier passes)
                mbarrier.expect(ready.index(stage), tile_bytes)
                row = q_row + t_lo + j * BM
                load_head_tile(q_desc, row, h, ready.index(stage), q_ring.index(stage), D, HEAD_D)
                if HI > 0:
                    load_head_tile(q_desc_hi, row, h, ready.index(stage), q_hi.index(stage), D, HEAD_D, D - HI)
                load_head_tile(do_desc, row, h, ready.index(stage), do_ring.index(stage), DV, HEAD_DV)
                if HIV > 0:
                    load_head_tile(do_desc_hi, row, h, ready.index(stage), do_hi.index(stage), DV, HEAD_DV, DV - HIV)
                # (The stage's second arrival: its lse and delta stored, by every thread of the warp.)
                lse2_ring.index(stage).store(query_vector(LSE2 + head_row, t_lo + j * BM, Lq, float("inf"), BM))
                delta_ring.index(stage).store(query_vector(DELTA + head_row, t_lo + j * BM, Lq, 0.0, BM))
                gl.thread_barrier()
                mbarrier.arrive(ready.index(stage))
                count += 1

    @gluon.jit
    def _score_warpgroup(k_smem, v_smem, q_ring, do_ring, lse2_ring, p_smem, kv_bar, ready, empty, p_ready, p_free,
                         dv_src, b, Lk, shift, WL, R, k_row, hk, n0, t_lo, n_tiles, u_lo, u_hi, qk_scale, seed,
                         offset_lo, threshold, keep_scale, his, HAS_R: gl.constexpr, HAS_WL: gl.constexpr,
                         DROPOUT: gl.constexpr, HI: gl.constexpr, DV: gl.constexpr, HIV: gl.constexpr,
                         HEAD_DV: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr,
                         BN: gl.constexpr, kq_layout: gl.constexpr, HOST: gl.constexpr):
        """Sᵀ = K Qᵀ, Pᵀ (the band applied on the tiles outside ``[u_lo, u_hi)``), handed to the gradient warpgroup,
        and dV += Pᵀ dO over every query tile of every head of the group; then dV out through V's buffer, once the
        gradient warpgroup's last product has read V. With ``DROPOUT`` the tile's keep bits are drawn before its
        product is issued (``backward.py``'s draw, of its 64-key tiles) and ride in Pᵀ's sign bits (-P where
        dropped): dV takes the kept P (``relu_low``; the keep scale at the end), and the gradient warpgroup the
        signed Pᵀ. In a tile of 192 (``HI``, ``HIV``: 64) Sᵀ is two products, and dV two accumulators (128 and 64
        columns). ``dv_src``: where dV's descriptors come from (:func:`_parts`)."""
        k_hi, v_hi, q_hi, do_hi = his
        dVD, dVH, dv_ptr, dv_stride = dv_src
        dv_desc, dv_desc_hi = _parts(dVD, dVH, dv_ptr, Lk, H // GROUP, dv_stride, BN, DV, HIV, HEAD_DV, HOST)
        dtype: gl.constexpr = k_smem.dtype
        q_axis: gl.constexpr = gl.SliceLayout(0, kq_layout)
        kdv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, DV - HIV, 16])
        kdvh_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, HIV if HIV > 0 else DV, 16])
        inv_qk_scale = 1.0 / qk_scale
        keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, kq_layout))
        # Zeros the compiler can't fold (backward.py's row_zeros): each row of the product's start a value of its own.
        row_zeros = keys.to(gl.float32) * 0.0
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kdv_layout, k_width=2)
        dv = gl.zeros([BN, DV - HIV], gl.float32, layout=kdv_layout)
        dv_hi = gl.zeros([BN, HIV], gl.float32, layout=kdvh_layout) if HIV > 0 else 0
        mbarrier.wait(kv_bar.index(0), 0)
        count = 0
        for g in range(GROUP):
            for j in range(n_tiles):
                stage = count % 2
                m0 = t_lo + j * BM
                if DROPOUT:
                    words = keep_words(seed, offset_lo, threshold, b * H + hk * GROUP + g, m0, n0, False)
                mbarrier.wait(ready.index(stage), (count // 2) & 1)
                # The product starts from -lse (in units of S), so that P = exp2(qk_scale Sᵀ).
                lse = lse2_ring.index(stage).load(q_axis) * inv_qk_scale
                st = warpgroup_mma(k_smem, q_ring.index(stage).permute((1, 0)), row_zeros[:, None] - lse[None, :],
                                   is_async=True)
                if HI > 0:
                    st = warpgroup_mma(k_hi, q_hi.index(stage).permute((1, 0)), st, is_async=True)
                st = warpgroup_mma_wait(0, deps=(st,))
                pt = gl.exp2(st * qk_scale)
                if (HAS_R or HAS_WL) and ((m0 < u_lo) | (m0 >= u_hi)):  # (tiles in [u_lo, u_hi) see every key)
                    queries = m0 + gl.arange(0, BM, layout=q_axis)
                    ok = in_band(keys[:, None] < Lk, queries[None, :], keys[:, None], shift, WL, R, HAS_R, HAS_WL)
                    pt = gl.where(ok, pt, 0.0)
                if DROPOUT:
                    pt = (pt.to(gl.uint32, bitcast=True) | dropped_signs(words, kq_layout)).to(gl.float32,
                                                                                              bitcast=True)
                    pv = relu_low(pt, dtype)
                else:
                    pv = pt.to(dtype)
                buf = count % 2
                mbarrier.wait(p_free.index(buf), ((count // 2) & 1) ^ 1)  # (a fresh barrier passes)
                p_smem.index(buf).store(pt)
                gl.thread_barrier()
                mbarrier.arrive(p_ready.index(buf))
                pa = gl.convert_layout(pv, a_layout)
                dv = warpgroup_mma(pa, do_ring.index(stage), dv, is_async=True)
                if HIV > 0:
                    dv_hi = warpgroup_mma(pa, do_hi.index(stage), dv_hi, is_async=True)
                    dv, dv_hi = warpgroup_mma_wait(0, deps=(dv, dv_hi))
                else:
                    dv = warpgroup_mma_wait(0, deps=(dv,))
                mbarrier.arrive(empty.index(stage))
                count += 1
        # The gradient warpgroup frees a Pᵀ buffer after its dPᵀ product, the last reader of V, is complete.
        if count > 0:
            mbarrier.wait(p_free.index((count - 1) % 2), ((count - 1) // 2) & 1)
        if DROPOUT:
            dv = dv * keep_scale
            if HIV > 0:
                dv_hi = dv_hi * keep_scale
        v_smem.store(dv.to(dtype))
        if HIV > 0:
            v_hi.store(dv_hi.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        store_head_tile(dv_desc, k_row + n0, hk, v_smem, 0, DV, HEAD_DV)
        if HIV > 0:
            store_head_tile(dv_desc_hi, k_row + n0, hk, v_hi, 0, DV, HEAD_DV, DV - HIV)
        tma.store_wait(0)

    @gluon.jit
    def _gradient_warpgroup(k_smem, v_smem, q_ring, do_ring, delta_ring, p_smem, kv_bar, ready, empty, p_ready,
                            p_free, dk_src, Lk, k_row, hk, n0, n_tiles, scale, keep_scale, his, DROPOUT: gl.constexpr,
                            D: gl.constexpr, HI: gl.constexpr, HEAD_D: gl.constexpr, HIV: gl.constexpr,
                            H: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                            kq_layout: gl.constexpr, HOST: gl.constexpr):
        """dPᵀ = V dOᵀ, dSᵀ = Pᵀ (dPᵀ - delta) with the score warpgroup's Pᵀ, and dK += dSᵀ Q over every query tile
        of every head of the group; then dK (times the softmax scale) out through K's buffer, once the score
        warpgroup's last product has read K (before it made its last Pᵀ ready). With ``DROPOUT`` (Pᵀ signed where
        dropped), dSᵀ as ``backward.py`` makes it, times 2 / keep_scale: (Pᵀ + |Pᵀ|) dPᵀ - |Pᵀ| 2 delta / keep_scale;
        dK takes the factor back at the end. In a tile of 192 (``HI``, ``HIV``: 64) dPᵀ is two products, and dK two
        accumulators (128 and 64 columns). ``dk_src``: where dK's descriptors come from (:func:`_parts`)."""
        k_hi, v_hi, q_hi, do_hi = his
        dKD, dKH, dk_ptr, dk_stride = dk_src
        dk_desc, dk_desc_hi = _parts(dKD, dKH, dk_ptr, Lk, H // GROUP, dk_stride, BN, D, HI, HEAD_D, HOST)
        dtype: gl.constexpr = k_smem.dtype
        kd_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D - HI, 16])
        kdh_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HI if HI > 0 else D, 16])
        q_axis: gl.constexpr = gl.SliceLayout(0, kq_layout)
        keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, kq_layout))
        row_zeros = keys.to(gl.float32) * 0.0
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kd_layout, k_width=2)
        dk = gl.zeros([BN, D - HI], gl.float32, layout=kd_layout)
        dk_hi = gl.zeros([BN, HI], gl.float32, layout=kdh_layout) if HI > 0 else 0
        if DROPOUT:
            twice_inv_keep = 2.0 / keep_scale
            dk_scale = scale * keep_scale * 0.5
        else:
            dk_scale = scale
        mbarrier.wait(kv_bar.index(0), 0)
        for count in range(GROUP * n_tiles):  # (the query tiles of every head of the group, as the loader brings them)
            stage = count % 2
            mbarrier.wait(ready.index(stage), (count // 2) & 1)
            delta = delta_ring.index(stage).load(q_axis)
            if DROPOUT:  # (dS needs dP itself)
                dpt = warpgroup_mma(v_smem, do_ring.index(stage).permute((1, 0)),
                                    gl.zeros([BN, BM], gl.float32, layout=kq_layout), use_acc=False, is_async=True)
            else:  # (the product starts from -delta, so that dSᵀ = Pᵀ dPᵀ)
                dpt = warpgroup_mma(v_smem, do_ring.index(stage).permute((1, 0)), row_zeros[:, None] - delta[None, :],
                                    is_async=True)
            if HIV > 0:
                dpt = warpgroup_mma(v_hi, do_hi.index(stage).permute((1, 0)), dpt, is_async=True)
            dpt = warpgroup_mma_wait(0, deps=(dpt,))
            buf = count % 2
            mbarrier.wait(p_ready.index(buf), (count // 2) & 1)
            pt = p_smem.index(buf).load(kq_layout)
            gl.thread_barrier()
            mbarrier.arrive(p_free.index(buf))
            if DROPOUT:
                twice_delta = delta * twice_inv_keep
                ds = ((pt + gl.abs(pt)) * dpt - gl.abs(pt) * twice_delta[None, :]).to(dtype)
            else:
                ds = (pt * dpt).to(dtype)
            dsa = gl.convert_layout(ds, a_layout)
            dk = warpgroup_mma(dsa, q_ring.index(stage), dk, is_async=True)
            if HI > 0:
                dk_hi = warpgroup_mma(dsa, q_hi.index(stage), dk_hi, is_async=True)
                dk, dk_hi = warpgroup_mma_wait(0, deps=(dk, dk_hi))
            else:
                dk = warpgroup_mma_wait(0, deps=(dk,))
            mbarrier.arrive(empty.index(stage))
        k_smem.store((dk * dk_scale).to(dtype))
        if HI > 0:
            k_hi.store((dk_hi * dk_scale).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        store_head_tile(dk_desc, k_row + n0, hk, k_smem, 0, D, HEAD_D)
        if HI > 0:
            store_head_tile(dk_desc_hi, k_row + n0, hk, k_hi, 0, D, HEAD_D, D - HI)
        tma.store_wait(0)

    @fast_launch
    @gluon.jit(do_not_specialize=common.DATA_DEPENDENT)
    def _bwd_kv_wide_hopper(Q: Rows, K: Rows, V: Rows, dO: Rows, dK: Rows, dV: Rows, LSE2, DELTA, seqs: Seqs,
                            total_q, total_k, max_q, max_k, ORDER, mask: Mask, scale, qk_scale, dropout: Dropout,
                            seed, offset_lo, QD, dOD, KD, VD, dKD, dVD, QH, dOH, KH, VH, dKH, dVH, F: gl.constexpr,
                            D: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr, HEAD_DV: gl.constexpr,
                            H: gl.constexpr, HKV: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                            GRID: gl.constexpr, HOST_DESCS: gl.constexpr):
        """Grid ``(cdiv(max_k, BN), Hkv, B)``, or another order of :func:`program.key_block_grid` (``GRID``); tensors
        as ``backward._bwd_kv_hopper``'s, without dQ; Q's and K's head dim ``HEAD_D`` in tiles of ``D``, V's and dO's
        ``HEAD_DV`` in tiles of ``DV`` (``common.wide_tile_head_dims``). ``scale``: the softmax scale; ``qk_scale``: it
        times log2(e); ``dropout``, ``seed``, ``offset_lo``: as ``triton.scores.dropout_args`` gives them (used where
        ``F.DROPOUT``).
        HOST_DESCS: ``QD``...``dVD`` are the descriptors of q, dO, K, V, dK and dV made on the host
        (:func:`host_descriptors`), and in a tile of 192 ``QH``...``dVH`` those of their last 64 columns; otherwise (all
        None) each program makes its sequence's. Partitions: the default one is the score warpgroup; workers: the
        gradient warpgroup and the one-warp loader."""
        dtype: gl.constexpr = Q.ptr.dtype.element_ty
        # A tile of 192 is two parts, 128 and HI = 64 columns (HIV of V, dO and dV): tiles, boxes and accumulators of
        # their own.
        HI: gl.constexpr = 64 if D == 192 else 0
        HIV: gl.constexpr = 64 if DV == 192 else 0
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D - HI], dtype)
        value_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, DV - HIV], dtype)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], gl.float32)
        # Both warpgroups' products: keys x queries (Sᵀ, Pᵀ, dPᵀ, dSᵀ); each warpgroup's accumulators (dV, dK) take
        # their own layouts.
        kq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BM, 16])
        gl.static_assert(BM == BN, "one shared layout for the query and key tiles")

        bt = batch(seqs, total_q, total_k, max_q, max_k)
        block, hk, seq, m = prologue(bt, mask, ORDER, F, False, F.VARLEN, GRID, HKV)
        n0 = block * BN
        if n0 >= seq.Lk:
            return
        # Where each partition makes its descriptors from (_parts). (Placeholders for what a call doesn't have: a
        # partition's argument can't be None.)
        if HOST_DESCS:
            # Over all B x S rows; no tile crosses a sequence (host_descriptors).
            q_ptr, do_ptr, k_ptr, v_ptr, dk_ptr, dv_ptr = Q.ptr, dO.ptr, K.ptr, V.ptr, dK.ptr, dV.ptr
            q_host, do_host, k_host, v_host, dk_host, dv_host = QD, dOD, KD, VD, dKD, dVD
            q_host_hi, k_host_hi, dk_host_hi = (QH, KH, dKH) if HI > 0 else (QD, KD, dKD)
            do_host_hi, v_host_hi, dv_host_hi = (dOH, VH, dVH) if HIV > 0 else (dOD, VD, dVD)
            q_row = seq.b * max_q
            k_row = seq.b * max_k
        else:
            # One descriptor per tensor and sequence (common.head_descriptor): boxes clip at the sequence's end.
            q_ptr = base(Q, seq.b, seq.q_start, 0)
            do_ptr = base(dO, seq.b, seq.q_start, 0)
            k_ptr = base(K, seq.b, seq.k_start, 0)
            v_ptr = base(V, seq.b, seq.k_start, 0)
            dk_ptr = base(dK, seq.b, seq.k_start, 0)
            dv_ptr = base(dV, seq.b, seq.k_start, 0)
            unused = q_ptr  # (in place of the host descriptors)
            q_host, do_host, k_host, v_host, dk_host, dv_host = unused, unused, unused, unused, unused, unused
            q_host_hi, do_host_hi, k_host_hi, v_host_hi, dk_host_hi, dv_host_hi = (unused, unused, unused, unused,
                                                                                  unused, unused)
            q_row = 0
            k_row = 0
        load_src = (k_host, v_host, q_host, do_host, k_host_hi, v_host_hi, q_host_hi, do_host_hi, k_ptr, v_ptr, q_ptr,
                    do_ptr, K.stride_s, V.stride_s, Q.stride_s, dO.stride_s)

        k_smem = gl.allocate_shared_memory(dtype, [BN, D - HI], tile_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BN, DV - HIV], value_layout)
        q_ring = gl.allocate_shared_memory(dtype, [2, BM, D - HI], tile_layout)
        do_ring = gl.allocate_shared_memory(dtype, [2, BM, DV - HIV], value_layout)
        if HI > 0:
            hi_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HI], dtype)
            k_hi = gl.allocate_shared_memory(dtype, [BN, HI], hi_layout)
            q_hi = gl.allocate_shared_memory(dtype, [2, BM, HI], hi_layout)
        else:
            k_hi, q_hi = k_smem, q_ring
        if HIV > 0:
            hiv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HIV], dtype)
            v_hi = gl.allocate_shared_memory(dtype, [BN, HIV], hiv_layout)
            do_hi = gl.allocate_shared_memory(dtype, [2, BM, HIV], hiv_layout)
        else:
            v_hi, do_hi = v_smem, do_ring
        his = (k_hi, v_hi, q_hi, do_hi)
        p_smem = gl.allocate_shared_memory(gl.float32, [2, BN, BM], p_layout)  # Pᵀ of a tile, double-buffered
        vector_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse2_ring = gl.allocate_shared_memory(gl.float32, [2, BM], vector_layout)
        delta_ring = gl.allocate_shared_memory(gl.float32, [2, BM], vector_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar.index(0), count=1)
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=2)  # the tiles' bytes with one arrival; lse and delta stored
            mbarrier.init(empty.index(i), count=2)  # one arrival per warpgroup
            mbarrier.init(p_ready.index(i), count=1)  # the score warpgroup's Pᵀ written
            mbarrier.init(p_free.index(i), count=1)  # the gradient warpgroup's Pᵀ read

        # The query tiles that see the key block; the band, if any, is applied on those outside [u_lo, u_hi).
        t_lo, u_lo, u_hi, t_hi = query_stages(n0, seq.Lq, seq.Lk, m, F, BM, BN)
        n_tiles = (t_hi - t_lo + BM - 1) // BM
        gl.warp_specialize([
            (_score_warpgroup, (k_smem, v_smem, q_ring, do_ring, lse2_ring, p_smem, kv_bar, ready, empty, p_ready,
                                p_free, (dv_host, dv_host_hi, dv_ptr, dV.stride_s), seq.b, seq.Lk, m.shift, m.WL, m.R,
                                k_row, hk, n0, t_lo, n_tiles, u_lo, u_hi, qk_scale, seed, offset_lo, dropout.threshold,
                                dropout.keep_scale, his, F.HAS_R, F.HAS_WL, F.DROPOUT, HI, DV, HIV, HEAD_DV, H, GROUP,
                                BM, BN, kq_layout, HOST_DESCS)),
            (_gradient_warpgroup, (k_smem, v_smem, q_ring, do_ring, delta_ring, p_smem, kv_bar, ready, empty, p_ready,
                                   p_free, (dk_host, dk_host_hi, dk_ptr, dK.stride_s), seq.Lk, k_row, hk, n0, n_tiles,
                                   scale, dropout.keep_scale, his, F.DROPOUT, D, HI, HEAD_D, HIV, H, GROUP, BM, BN,
                                   kq_layout, HOST_DESCS)),
            (_load_tiles, (load_src, k_smem, v_smem, q_ring, do_ring, lse2_ring, delta_ring, kv_bar, ready, empty,
                           LSE2, DELTA, total_q, max_q, seq.b, seq.q_start, seq.Lq, seq.Lk, q_row, k_row, hk, n0, t_lo,
                           n_tiles, his, F.VARLEN, D, HI, HEAD_D, DV, HIV, HEAD_DV, H, GROUP, BM, BN, HOST_DESCS)),
        ], [4, 1], [common.CONSUMER_REGS, common.LOADER_REGS])
        mbarrier.invalidate(kv_bar.index(0))
        for i in gl.static_range(2):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
            mbarrier.invalidate(p_ready.index(i))
            mbarrier.invalidate(p_free.index(i))


def supports(problem, opts, dtype, bias, alibi, seed) -> bool:
    """Whether the kernel computes this call (whatever the machine): a :func:`common.plain_call` in tiles of 192 or 256
    (``common.wide_tile_head_dims``: head dims 136-256, multiples of 8, Dv in them or in a tile of its own; dropout
    allowed), deterministic or not (it adds nothing), with a nonzero scale (the products start from -lse in units of
    S, lse / scale). In tiles of 64 and 128, of the calls ``backward.py``'s kernel leaves (deterministic ones with a
    left window: its ordered dQ adds need none), those with a causal mask in tiles of 128 (D = Dv), where this kernel
    and the Gluon dQ kernel measured faster than the Triton kernels (H100, D128 S4k and S16k causal 1.14x; without a
    mask 0.92x, at D64 0.88-0.95x: bench/NOTES.md, "Past 128 in the backward"). (Where both take a call,
    ``backward.py``'s runs: ``triton.backward.launch_backward``.)"""
    tiles = common.wide_tile_head_dims(problem.head_dim, problem.head_dim_v)
    if tiles is None or opts.scale == 0:
        return False
    if tiles[0] <= common.TILE_HEAD_DIMS[-1] and not (opts.deterministic and opts.causal and tiles == (128, 128)
                                                      and problem.head_dim == problem.head_dim_v):
        return False
    return common.plain_call(problem, opts, dtype, bias, alibi, common.wide_tile_head_dims)


def applies(problem, opts, q, k, v, dout, bias, alibi, seed) -> bool:
    """Whether the kernel takes this call here: :func:`supports`, on an sm_90 GPU with Gluon, every tensor with its
    heads packed in a row and TMA-aligned."""
    return supports(problem, opts, q.dtype, bias, alibi, seed) and common.hopper_layout(q, k, v, dout)


def host_descriptors(problem, q, dout, k, v, dk, dv) -> tuple | None:
    """The kernel's TMA descriptors made once on the host over all B x S rows of each tensor, where no tile crosses a
    sequence: dense calls whose lengths are whole numbers of tiles, each tensor's sequences one after another in
    memory. Otherwise None (each program makes its sequence's, clipped at its end). Twelve: q, dO, K, V, dK and dV,
    then the same for the last 64 columns of a tile of 192 (None where the tile has no such part)."""
    if not problem.dense or problem.max_q % BLOCK_M or problem.max_k % BLOCK_N:
        return None
    if not common.sequences_adjacent(q, dout, k, v, dk, dv):
        return None
    tile_d, tile_dv = common.wide_tile_head_dims(problem.head_dim, problem.head_dim_v)
    tiles = ((q, BLOCK_M, tile_d), (dout, BLOCK_M, tile_dv), (k, BLOCK_N, tile_d), (v, BLOCK_N, tile_dv),
             (dk, BLOCK_N, tile_d), (dv, BLOCK_N, tile_dv))
    # (A tile of 192 is two boxes, of 128 and 64 columns: the kernel's HI and HIV.)
    return (*(common.host_head_descriptor(t, rows, tile - _second_part(tile), tile) for t, rows, tile in tiles),
            *(common.host_head_descriptor(t, rows, 64, tile) if _second_part(tile) else None
              for t, rows, tile in tiles))


def _second_part(tile: int) -> int:
    """The columns of a tile's second part: 64 in a tile of 192 (the kernel's HI and HIV), else none."""
    return 64 if tile == 192 else 0


def launch_kv(q, k, v, dout, dk, dv, lse2, delta, problem, seq_args, order, mask, feats, scores, dropout) -> None:
    """Run the kernel: dK and dV written (dQ is a dQ kernel's); ``lse2``, ``delta``: the preprocess's;
    ``order``: the sequences longest first (``program.longest_first``); ``mask``, ``scores``: the call's ``Mask`` and
    ``Scores`` bundles; ``dropout``: ``triton.scores.dropout_args``'s keyword arguments."""
    descs = host_descriptors(problem, q, dout, k, v, dk, dv)
    if descs is None:
        ensure_allocator()  # the kernel builds TMA descriptors on the device
    QD, dOD, KD, VD, dKD, dVD, QH, dOH, KH, VH, dKH, dVH = descs or (None,) * 12
    dense = problem.dense
    tile_d, tile_dv = common.wide_tile_head_dims(problem.head_dim, problem.head_dim_v)
    grid, grid_order = key_block_grid(problem, feats, cdiv(problem.max_k, BLOCK_N), q.device, PROGRAMS_PER_SM,
                                      kv_groups=True)
    _bwd_kv_wide_hopper[grid](
        rows(q, dense), rows(k, dense), rows(v, dense), rows(dout, dense), rows(dk, dense), rows(dv, dense), lse2,
        delta, **seq_args, ORDER=order, mask=mask, scale=scores.scale, qk_scale=scores.qk_scale, **dropout, QD=QD,
        dOD=dOD, KD=KD, VD=VD, dKD=dKD, dVD=dVD, QH=QH, dOH=dOH, KH=KH, VH=VH, dKH=dKH, dVH=dVH, F=feats, D=tile_d,
        HEAD_D=problem.head_dim, DV=tile_dv, HEAD_DV=problem.head_dim_v, H=problem.heads, HKV=problem.kv_heads,
        GROUP=problem.group, BM=BLOCK_M, BN=BLOCK_N, GRID=grid_order,
        HOST_DESCS=descs is not None, num_warps=NUM_WARPS, maxnreg=common.MAX_REGS,
    )

