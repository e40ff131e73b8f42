"""Hopper attention forward in Gluon, warp-specialized: 128 queries of one head per program.

The plain Triton forward (``triton/forward.py``) waits for each tile's Q·Kᵀ before its softmax, and its
softmax before the next tile's product, so the tensor cores idle while the exponentials run. Here FA3's
forward structure is written out (``../shared/attention-backward-notes.md``), three partitions
(``gl.warp_specialize``):

- a loader warp (24 registers): the two 64-row halves of the Q block once by TMA, then the K and V tiles of
  the visible key range through two-stage rings (``ready`` / ``empty`` mbarriers; K and V apart, so a K
  slot frees as soon as its product is done while V is still read);
- two query warpgroups (240 registers each), each owning 64 of the queries: S = Q Kᵀ from shared memory,
  the online softmax in registers, P as the register A operand of O += P V. Each issues a tile's S = Q Kᵀ
  together with the previous tile's O += P V, so the softmax of this tile runs under the second product;
  the two warpgroups drift apart, so one's softmax also runs under the other's products.

Sequences and heads as in the Gluon backward: per-sequence TMA descriptors made on the device over
rows x (heads x D) clip loads at the sequence's end (zero rows) and the output store there too. Keys past
the end are masked on the (masked) last tile; query rows past the end compute on zero rows and are never
stored. Scores stay raw (q·k), the scale folded into ``exp2`` (``launch.raw_scores``), as the Triton kernel
with ``RAW_SCORES``; the lse is stored in natural log, -inf (and the output 0) where a query sees no key.

Scope (:func:`supports`): fp16/bf16, head dims 64 and 128 (Dv = D), dense or jagged, no mask, causal
(either alignment) or windows, GQA; no bias, ALiBi, softcap, dropout, prefix, documents or query
positions. :func:`applies` adds the machine (sm_90 with Gluon) and the layout (heads packed in a row,
TMA-aligned). It needs an sm_90 GPU (Gluon doesn't run in the interpreter); the GPU tests cover every
variant it accepts.
"""

from __future__ import annotations

from ..triton.launch import cdiv, ensure_allocator, raw_scores
from ..triton.masks import Mask, in_band, key_stages
from ..triton.program import Rows, Seqs, base, batch, lse_offset, prologue, rows
from ..triton.scores import LN2
from . import common
from .common import (
    HAVE_GLUON,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_M = 128  # queries per program: 64 per warpgroup
# Keys per tile: 128 beat 64 at every measured shape (bench/NOTES.md); S, O and two P tiles fit in 240 registers.
BLOCK_N = 128


if HAVE_GLUON:
    @gluon.jit
    def _load_tiles(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty,
                    m0, h, hk, t_lo, n_tiles, D: gl.constexpr, BN: gl.constexpr):
        """The producer warp: the Q block once, then K and V tile by tile, each slot refilled once both
        warpgroups released it."""
        dtype: gl.constexpr = q_desc.dtype
        half_bytes: gl.constexpr = 64 * D * dtype.primitive_bitwidth // 8
        mbarrier.expect(q_bar, 2 * half_bytes)
        tma.async_copy_global_to_shared(q_desc, [m0, h * D], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [m0 + 64, h * D], q_bar, q_smem.index(1))
        tile_bytes: gl.constexpr = BN * D * dtype.primitive_bitwidth // 8
        for j in range(n_tiles):
            stage = j % 2
            phase = ((j // 2) & 1) ^ 1  # (a fresh barrier passes)
            row = t_lo + j * BN
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), tile_bytes)
            tma.async_copy_global_to_shared(k_desc, [row, hk * D], k_ready.index(stage), k_ring.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), tile_bytes)
            tma.async_copy_global_to_shared(v_desc, [row, hk * D], v_ready.index(stage), v_ring.index(stage))

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, rows, n0, u_lo, u_hi, Lk, shift, WL, R, qk_scale, HAS_R: gl.constexpr,
                      HAS_WL: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr):
        """One tile of the online softmax (log2 units, raw scores): (P, alpha, m, l). Tiles outside the fully
        visible range ``[u_lo, u_hi)`` get the key-padding and band masks."""
        if (n0 < u_lo) | (n0 >= u_hi):
            cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            ok = in_band(cols[None, :] < Lk, rows[:, None], cols[None, :], shift, WL, R, HAS_R, HAS_WL)
            s = gl.where(ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale
        alpha = gl.exp2(m_i * qk_scale - m_sub)
        p = gl.exp2(s * qk_scale - m_sub[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _query_warpgroup(q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, LSE, total_q,
                         max_q, b, q_start, Lq, Lk, shift, WL, R, m0, h, t_lo, u_lo, u_hi, n_tiles, scale, qk_scale,
                         VARLEN: gl.constexpr, HAS_R: gl.constexpr, HAS_WL: gl.constexpr, D: gl.constexpr,
                         H: gl.constexpr, BN: gl.constexpr, WG: gl.constexpr):
        """One consumer warpgroup: queries ``m0 + 64 WG ..`` (+64) against every visible key tile."""
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        q_w = q_smem.index(WG)
        rows = m0 + WG * 64 + gl.arange(0, 64, layout=row_s)
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([64], gl.float32, layout=row_s)
        o = gl.zeros([64, D], gl.float32, layout=o_layout)
        mbarrier.wait(q_bar, 0)
        if n_tiles > 0:
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(q_w, k_ring.index(0).permute((1, 0)), gl.zeros([64, BN], gl.float32, layout=s_layout),
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(0))
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, rows, t_lo, u_lo, u_hi, Lk, shift, WL, R, qk_scale,
                                               HAS_R, HAS_WL, BN, s_layout)
            p = gl.convert_layout(p.to(dtype), p_layout)
            # Tile j: S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} are issued together; the softmax of S_j runs while
            # the second product does. Every product is waited for within its iteration (a product in flight
            # across the loop's back edge makes ptxas serialize every wgmma of the kernel).
            for j in range(1, n_tiles):
                stage = j % 2
                prev = (j - 1) % 2
                mbarrier.wait(k_ready.index(stage), (j // 2) & 1)
                s = warpgroup_mma(q_w, k_ring.index(stage).permute((1, 0)),
                                  gl.zeros([64, BN], gl.float32, layout=s_layout), use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((j - 1) // 2) & 1)
                o = warpgroup_mma(p, v_ring.index(prev), o, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s,))
                mbarrier.arrive(k_empty.index(stage))
                p_next, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, rows, t_lo + j * BN, u_lo, u_hi, Lk, shift, WL,
                                                        R, qk_scale, HAS_R, HAS_WL, BN, s_layout)
                o, p = warpgroup_mma_wait(0, deps=(o, p))
                mbarrier.arrive(v_empty.index(prev))
                o = o * gl.convert_layout(alpha, row_o)[:, None]
                p = gl.convert_layout(p_next.to(dtype), p_layout)
            last = (n_tiles - 1) % 2
            mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // 2) & 1)
            o = warpgroup_mma(p, v_ring.index(last), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
        # Rows that saw no key: output 0 and lse -inf.
        seen = l_i > 0
        l_safe = gl.where(seen, l_i, 1.0)
        o = o / gl.convert_layout(l_safe, row_o)[:, None]
        # The output through this warpgroup's Q tile in shared memory (no reader left), clipped at Lq.
        q_w.store(o.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [m0 + WG * 64, h * D], q_w)
        lse = gl.where(seen, m_i * scale + gl.log2(l_safe) * LN2, float("-inf"))
        gl.store(LSE + lse_offset(b, q_start, h, H, total_q, max_q, VARLEN) + rows, lse, mask=rows < Lq)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=common.DATA_DEPENDENT)
    def _attn_fwd_hopper(Q: Rows, K: Rows, V: Rows, O: Rows, LSE, seqs: Seqs, total_q, total_k, max_q, max_k,
                         mask: Mask, scale, qk_scale, F: gl.constexpr, D: gl.constexpr, H: gl.constexpr,
                         HKV: gl.constexpr, GROUP: gl.constexpr, BN: gl.constexpr):
        """Grid ``(cdiv(max_q, 128), H, B)``; tensors as ``triton.forward._attn_fwd_kernel``'s, each with its
        heads packed in a row (stride_h = D). ``scale``: the softmax scale; ``qk_scale``: it times log2(e)."""
        dtype: gl.constexpr = Q.ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D], dtype)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dtype)

        bt = batch(seqs, total_q, total_k, max_q, max_k)
        block, h, seq, m = prologue(bt, mask, F, F.HAS_R)
        m0 = block * 128
        if m0 >= seq.Lq:
            return
        hk = h // GROUP
        q_desc = tma.make_tensor_descriptor(base(Q, seq.b, seq.q_start, 0), [seq.Lq, H * D], [Q.stride_s, 1],
                                            [64, D], q_layout)
        o_desc = tma.make_tensor_descriptor(base(O, seq.b, seq.q_start, 0), [seq.Lq, H * D], [O.stride_s, 1],
                                            [64, D], q_layout)
        k_desc = tma.make_tensor_descriptor(base(K, seq.b, seq.k_start, 0), [seq.Lk, HKV * D], [K.stride_s, 1],
                                            [BN, D], k_layout)
        v_desc = tma.make_tensor_descriptor(base(V, seq.b, seq.k_start, 0), [seq.Lk, HKV * D], [V.stride_s, 1],
                                            [BN, D], k_layout)

        q_smem = gl.allocate_shared_memory(dtype, [2, 64, D], q_layout)
        k_ring = gl.allocate_shared_memory(dtype, [2, BN, D], k_layout)
        v_ring = gl.allocate_shared_memory(dtype, [2, BN, D], k_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrival per query warpgroup
            mbarrier.init(v_empty.index(i), count=2)

        # The key tiles this block sees: masked [t_lo, u_lo), unmasked [u_lo, u_hi), masked [u_hi, t_hi).
        bounds = key_stages(m0, seq.Lq, seq.Lk, m, F, 128, BN)
        t_lo = bounds[0]
        n_tiles = (bounds[3] - t_lo + BN - 1) // BN
        # (The argument tuples are written out: a tuple assigned to a variable would turn its constexprs
        # into tensors.)
        gl.warp_specialize([
            (_query_warpgroup, (q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, LSE,
                                total_q, max_q, seq.b, seq.q_start, seq.Lq, seq.Lk, m.shift, m.WL, m.R, m0, h, t_lo,
                                bounds[1], bounds[2], n_tiles, scale, qk_scale, F.VARLEN, F.HAS_R, F.HAS_WL, D, H,
                                BN, 0)),
            (_query_warpgroup, (q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, LSE,
                                total_q, max_q, seq.b, seq.q_start, seq.Lq, seq.Lk, m.shift, m.WL, m.R, m0, h, t_lo,
                                bounds[1], bounds[2], n_tiles, scale, qk_scale, F.VARLEN, F.HAS_R, F.HAS_WL, D, H,
                                BN, 1)),
            (_load_tiles, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, k_ready, k_empty, v_ready,
                           v_empty, m0, h, hk, t_lo, n_tiles, D, BN)),
        ], [4, 1], [common.CONSUMER_REGS, common.LOADER_REGS])
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(v_empty.index(i))


def supports(problem, opts, dtype, bias, alibi, seed) -> bool:
    """Whether the kernel computes this call (whatever the machine): a :func:`common.plain_call` (fp16/bf16,
    D = Dv in HEAD_DIMS, no score modifier, dropout or special mask) whose scores stay raw q.k
    (``launch.raw_scores``: a non-negative scale)."""
    return common.plain_call(problem, opts, dtype, bias, alibi, seed) and raw_scores(opts, bias, alibi)


def applies(problem, opts, q, k, v, bias, alibi, seed) -> bool:
    """Whether the kernel takes this call here: :func:`supports`, on an sm_90 GPU with Gluon, every tensor
    with its heads packed in a row and TMA-aligned."""
    return (supports(problem, opts, q.dtype, bias, alibi, seed)
            and common.hopper_layout(problem.head_dim, q, k, v))


def launch(q, k, v, out, lse, problem, seq_args, mask, feats, scores) -> None:
    """Run the kernel: ``out`` (packed heads, like q) and ``lse`` written; ``mask``, ``scores``: the call's
    ``Mask`` and ``Scores`` bundles (their scale and log2-unit scale)."""
    ensure_allocator()  # the kernel builds its TMA descriptors on the device
    dense = problem.dense
    _attn_fwd_hopper[(cdiv(problem.max_q, BLOCK_M), problem.heads, problem.batch)](
        rows(q, dense), rows(k, dense), rows(v, dense), rows(out, dense), lse, **seq_args, mask=mask,
        scale=scores.scale, qk_scale=scores.qk_scale, F=feats, D=problem.head_dim, H=problem.heads,
        HKV=problem.kv_heads, GROUP=problem.group, BN=BLOCK_N, num_warps=4,
        maxnreg=common.MAX_REGS,
    )
