"""Hopper attention forward in Gluon, warp-specialized and persistent: blocks of 128 (or 192) queries of one head.

The plain Triton forward (``triton/forward.py``) waits for each tile's Q·Kᵀ before its softmax, and its
softmax before the next tile's product, so the tensor cores idle while the exponentials run. Here FA3's
forward structure is written out (``../shared/attention-backward-notes.md``), three partitions
(``gl.warp_specialize``):

- a loader warp (24 registers): the 64-row parts of the Q block by TMA, then the K and V tiles of the
  visible key range through two-stage rings (``ready`` / ``empty`` mbarriers; K and V apart, so a K slot
  frees as soon as its product is done while V is still read);
- two query warpgroups of 240 registers (three of 160 at D64 where that pays, :func:`query_warpgroups`), each
  owning 64 of the queries: S = Q Kᵀ from shared memory, the online softmax in registers, P as the register A
  operand of O += P V. Each issues a tile's S = Q Kᵀ together with the previous tile's O += P V, so the softmax of
  this tile runs under the second product; the warpgroups drift apart, so one's softmax also runs under the
  others' products (two at D64 without a causal-like mask or dropout take turns to issue them, :func:`pingpong`).
  With three, each warpgroup takes products with the block's tiles up to its own last visible key only and
  releases the rest (under a causal mask a 192-row block's first warpgroup sees 128 keys fewer than its last,
  :func:`_own_tiles`); one whose 64 rows all lie outside its sequence, or see no key, computes nothing: it releases
  the block's tiles and passes its turns (:func:`_pass_block`). Under a causal-like mask the blocks end at the
  sequence's end, so that a partial block is the lightest, first one (``ALIGN_END``).

One program per SM (168 x 384 registers, or 128 x 512, leave room for one) walks work items (``_work_item``:
two query blocks of a head, the heaviest and the lightest under a causal mask). Each program's first item is its
id; then its loader takes the next unclaimed one from a counter (an atomic ticket) and hands it to the query
warpgroups through shared memory, skipping items past their sequence's end: the programs finish together however
the items weigh (a static every-grid-th-item schedule left the busiest program 1.4-1.5x the mean on mixed-length
batches, and ran a train_llm-like batch at 244 TFLOP/s against 330 this way). The rings, the Q block and the
output's staging tiles carry on from block to block: the loader fetches the next block's Q as soon as all warpgroups
have issued their last product with this one's, and its first K and V tiles as ring slots free, so the next
block starts under this one's last products and its output's TMA store. (With one program per block, every
program's prologue and epilogue idled the tensor cores: 0.69-0.98x this speed at D128, ``bench/NOTES.md``.)

Tiles load through one TMA descriptor per tensor over all its rows (rows x (heads x D), or 3-D over (rows, heads,
head dim) where the head dim is less than the tile's: ``common.head_descriptor``), made once per program: Q's, K's
and V's by the loader that copies through them (``common.sequence_descriptor`` says why), O's before the partitions
(made in each query warpgroup it cost 4.5% at D64: ``bench/NOTES.md``, "Descriptors made by the partitions"). A tile
past a sequence's end reads the next sequence's rows (zeros past the buffer's end): keys there are masked out of the
scores (the last tile is always a masked one), queries there are computed and never stored; their P is exactly 0, so
their V rows add nothing unless they hold inf or NaN (which would turn the row NaN; the Triton kernel's per-sequence
descriptors read zeros there). Query rows before a sequence's start (``ALIGN_END``'s partial first block) read the
last sequence's rows, or zeros before the buffer (TMA takes negative coordinates), and are never stored either. The
output goes through a TMA store where a warpgroup's 64 rows lie in the sequence, by masked stores at its first or
last rows. Scores stay raw (q·k), the scale folded into ``exp2`` (``launch.raw_scores``), as the Triton kernel with
``RAW_SCORES``; the lse is stored in natural log, -inf (and the output 0) where a query sees no key.

Dropout: each query warpgroup draws a tile's keep bits after its softmax (``gluon/dropout.py``: 4 Philox calls per
thread, the mask of ``varlen.attn.dropout`` bit for bit) and zeroes the dropped weights of P before O += P V; the
row sums keep every weight, and the output takes the keep scale with 1 / l.

Scope (:func:`supports`): fp16/bf16, head dims 64, 128, 192 and 256, and multiples of 8 from 40 to 256 in those tiles
(``common.wide_tile_head_dim``: zeros read past the head); a value head dim Dv other than D in a tile of 64 or 128 of
its own (``common.wide_tile_head_dims``: multi-head latent attention's 192 / 128 runs in tiles of 192 and 128, the
rules, :func:`query_warpgroups` and :func:`pingpong`, going by the larger); dense or jagged, no mask, causal (either
alignment) or windows, GQA, dropout (not in tiles past 128); no bias, ALiBi, softcap, prefix, documents or query
positions. In tiles past 128 the keys come in tiles of 64 (:func:`block_keys`: the 64 x 256 float32 O takes 128
registers), but for Q and K in tiles of 192 beside V and O in 128. A tile of 192 is two parts, of 128 and 64 columns
(Triton's tensors have power-of-two shapes): two boxes per tile of Q, K and V, two products for each of S and O, two
accumulators; at 192 for all four, each query warpgroup reads its Q block into registers once, the A operand of every
S = Q Kᵀ, and frees Q's buffer at the block's start (:func:`query_in_registers`). The output leaves through staging
tiles by TMA stores, as at 128: at 192 tiles of its own, at 256 (and at 192 beside V's 128, with 128-key rings) each
warpgroup's part of Q (Q and the rings take 192-208 KiB of shared memory, leaving no room for more:
:func:`output_in_q`), which Q's next block then waits for. From registers (48 or 64 four-byte stores per thread) it had
cost 4-14% of the time without a mask and 10-23% under causal masks (bench/NOTES.md, "The forward past 128").
:func:`applies` adds the machine (sm_90 with Gluon) and the layout (heads packed in a row, TMA-aligned; dense
sequences one after another in memory). It needs an sm_90 GPU (Gluon doesn't run in the
interpreter); the GPU tests cover every variant it accepts.
"""

from __future__ import annotations

import torch

from ..._kernel_math import LN2
from ..._launch import fast_launch
from ...tiling import cdiv, sm_count
from ..triton.launch import ensure_allocator, raw_scores
from ..triton.masks import Mask, band_keys, in_band, tile_stages
from ..triton.program import Rows, Seqs, bounds, lse_offset, rows
from ..triton.scores import Dropout
from . import common
from .common import (
    HAVE_GLUON,
    fence_async_shared,
    gl,
    gluon,
    head_descriptor,
    load_head_tile,
    mbarrier,
    store_head_tile,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .dropout import relu_low, row_dropped_signs, row_keep_words


def block_keys(tile_d: int, tile_dv: int) -> int:
    """Keys per tile in tiles of head dims ``tile_d`` (Q and K) and ``tile_dv`` (V and O): 128 beat 64 at every
    measured shape up to 128 (bench/NOTES.md), where S, O and two P tiles fit in 240 registers. Where O is wider the
    64 x 256 float32 O takes 128 of them, so 64; at 192 for both too (a K and V ring of 128-key tiles would take 192
    KiB of shared memory). Q and K in tiles of 192 beside V and O in 128 (multi-head latent attention's) take 128
    keys, their output staged in Q (:func:`output_in_q`). (The dropout tile of gluon/dropout.py, row_keep_words and
    row_dropped_signs, is written for 128 keys: no dropout in tiles past 128, :func:`supports`.)"""
    return 128 if tile_dv <= 128 and tile_d <= 192 else 64


def output_in_q(tile_d: int, tile_dv: int) -> bool:
    """Whether the output is staged in each query warpgroup's part of Q, for want of shared memory: in tiles of 256
    (Q and the rings take 192 KiB), and in tiles of 192 and 128 of 128-key tiles (208 KiB; O's tile of 128 is
    Q's first part)."""
    return (tile_d, tile_dv) in ((256, 256), (192, 128))


def query_in_registers(tile_d: int, tile_dv: int, wgs: int) -> bool:
    """Whether each query warpgroup reads its Q block into registers once, as the A operand of every S = Q Kᵀ, and
    frees Q's buffer at once (for the next block's Q): in tiles of 192 for Q, K, V and O (with two warpgroups, always
    there). In 64-key tiles two shared-memory operands of a 64 x 64 product read 4 KiB of shared memory per 32 cycles
    of tensor work; from registers Q's half of that is gone (ncu, H100, D192 B4 S4k H10 bf16 at ncu's clocks: 1.38 ->
    1.28 M cycles, cuDNN's 1.29 M; shared-memory bank reads 26 -> 19% of peak, tensor pipe 72 -> 78% active). Replayed
    at the chip's own clocks it gains less: +3-5% at S1k and S4k (causal S4k too), -1% at S1k causal (bench/NOTES.md,
    "Q in registers"). Elsewhere it lost or tied: at 128 (and MLA's 192 / 128) its 32-48 registers make the tile loop
    spill (D128 -1 to -7%), at 64 a tie. The output staged in Q (:func:`output_in_q`) keeps Q's buffer anyway."""
    return wgs == 2 and (tile_d, tile_dv) == (192, 192)


def query_warpgroups(tile_dim: int, right_band: bool, left_band: bool, dropout: bool, max_q: int, mean_q: int,
                     dense_pairs: int | None = None, programs: int | None = None) -> int:
    """Query warpgroups per program, 64 queries each: a block is ``64 x`` this many queries (``tile_dim``: the
    tile head dim, ``common.wide_tile_head_dim``; D64 below stands for tiles of 64). Three at D64 without
    dropout (FA3's 192-query blocks at D64): at D64 a 64 x 128 tile's softmax takes as long as its two products, and
    a third warpgroup keeps the tensor cores fed while two run theirs. Without a right band (a causal or two-sided
    window mask) from 2048 queries; under a causal mask (a right band without a left one) from a mean sequence
    length ``mean_q`` of 4096. H100, forward TFLOP/s two / three (bench/NOTES.md, "Three warpgroups under causal
    masks"): S2k 439-455 / 456-484, S4k 439-445 / 466, S16k 457-460 / 487-494, S1k 418-421 / 419-424 (a tie); causal
    S4k 409-414 / 423-426, S8k 420-424 / 450-453, S16k 432 / 445-446, but S2k 362-369 / 348-350, S1k 298-305 /
    247-264 and train_llm-like jagged batches 233-303 / 216-300. With three, each warpgroup has 160 registers
    (``common.THREE_WG_CONSUMER_REGS``); D128 needs more.

    ``dense_pairs`` (a dense call's batch x heads) and ``programs`` (the grid's): a dense call's work items weigh
    the same, so their last wave leaves programs idle; where 192-query blocks keep the programs' rounds busy 4% less
    than 128-query ones, two (GQA 32/8 B2 S4k causal: 704 items on 132 programs, 89% busy, against 1024, 97%; two /
    three 415-432 / 396-407; and calls of fewer items than programs, whose time is one item's)."""
    long_enough = (not left_band and mean_q >= 4096) if right_band else max_q >= 2048
    if tile_dim != 64 or dropout or not long_enough:
        return 2
    short_wave = dense_pairs is not None and programs and (
        _busy(max_q, 192, dense_pairs, programs) < 0.96 * _busy(max_q, 128, dense_pairs, programs))
    return 2 if short_wave else 3


def _busy(max_q: int, block: int, pairs: int, programs: int) -> float:
    """The share of ``programs``' rounds that hold a work item, for equal items of two ``block``-query blocks of
    ``pairs`` (sequence, head) pairs of ``max_q`` queries."""
    items = cdiv(cdiv(max_q, block), 2) * pairs
    return items / (cdiv(items, programs) * programs) if items else 1.0


def pingpong(tile_dim: int, causal_like: bool, dropout: bool) -> bool:
    """Whether the two warpgroups issue their products in turn (FA3's ping-pong: one's softmax under the other's
    products), in tiles of head dim ``tile_dim`` (``common.wide_tile_head_dim``). H100, bench/NOTES.md: +3-4% at
    D64 without a right band (a causal or two-sided window mask), where a tile's softmax takes as long as its
    products; -1 to -11% under causal masks (not profiled; a guess: the two warpgroups' diagonal tiles differ in
    work, and strict turns make one wait); at D128 within noise (-2 to +2%), -9% causal at S16k. Not with dropout,
    whose draws make each tile's own work the longer part: H200, D64 without a mask, S2k-8k, ping-pong off 175-183
    TFLOP/s against 171-178 on."""
    return tile_dim == 64 and not causal_like and not dropout


if HAVE_GLUON:
    @gluon.jit
    def _work_item(t, half, n_blocks, cu_q, cu_k, total_q, total_k, max_q, max_k, WL, R, H: gl.constexpr,
                   VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, HAS_R: gl.constexpr, HAS_WL: gl.constexpr,
                   BN: gl.constexpr, BM: gl.constexpr, ALIGN_END: gl.constexpr):
        """Half ``half`` (0 or 1) of work item ``t``, as every partition decodes it: ``(live, b, h, m0, q_row, k_row,
        Lq, Lk, shift, t_lo, u_lo, u_hi, n_tiles)``. ``live``: the half is a block of queries of its sequence, rows
        ``[m0, m0 + BM)``; ``q_row``/``k_row``: the sequence's first row in the descriptors' rows; its key tiles:
        masked ``[t_lo, u_lo)``, unmasked ``[u_lo, u_hi)``, masked to ``t_lo + n_tiles BN``.

        ``ALIGN_END``: the blocks end at the sequence's end, so that a sequence of other than a whole number of
        blocks has its partial block first (``m0 < 0``; rows before 0 are no queries): under a causal mask the
        lightest block, where starting at 0 made it the heaviest, with one warpgroup in three computing.

        Item ``t`` of a (sequence, head) pair holds its blocks ``n_blocks - 1 - k`` and ``k``: under a causal mask
        the heaviest and the lightest, so a dense batch's items weigh the same. Items of a pair are consecutive:
        handed out in order (:func:`_claim`), a pair's blocks run together and share its K and V in L2."""
        n_half = (n_blocks + 1) // 2
        k = t % n_half
        pair = t // n_half
        h = pair % H
        b = pair // H
        block = gl.where(half == 0, n_blocks - 1 - k, k)
        q_row, Lq = bounds(cu_q, b, total_q, max_q, VARLEN)
        k_row, Lk = bounds(cu_k, b, total_k, max_k, VARLEN)
        if not VARLEN:  # dense: sequences of max_q / max_k rows one after another (applies() checks the strides)
            q_row += b * max_q
            k_row += b * max_k
        shift = Lk - Lq if BOTTOM_RIGHT else Lk * 0
        m0 = block * BM
        first = m0
        if ALIGN_END:
            m0 -= (BM - Lq % BM) % BM
            first = gl.maximum(m0, 0)
        lo, hi, full_lo, full_hi = band_keys(first, gl.minimum(m0 + BM, Lq) - 1, Lk, shift, WL, R, HAS_R, HAS_WL)
        t_lo, u_lo, u_hi, t_hi = tile_stages(lo, hi, full_lo, full_hi, BN)
        live = (block * BM < Lq) & ((half == 0) | (block != n_blocks - 1 - k))  # (an odd count's middle block once)
        n_tiles = gl.where(live, (t_hi - t_lo + BN - 1) // BN, 0)
        return live, b, h, m0, q_row, k_row, Lq, Lk, shift, t_lo, u_lo, u_hi, n_tiles

    @gluon.jit
    def _claim(t, n_items, n_blocks, counter, cu_q, total_q, max_q, H: gl.constexpr, VARLEN: gl.constexpr,
               BM: gl.constexpr):
        """The first item from ``t`` on with a block of queries (the shorter sequences' items past their end
        have none): ``t`` if it has one, else the next claimed from ``counter``, a ticket per item (items after
        each program's first, which is its program id, are handed out in order as programs ask)."""
        n_half = (n_blocks + 1) // 2
        b = gl.minimum(t, n_items - 1) // n_half // H  # (in range: no offset past the batch is read)
        q_row, Lq = bounds(cu_q, b, total_q, max_q, VARLEN)
        empty = (t < n_items) & ((t % n_half) * BM >= Lq)  # block k, the item's first, is past the end
        while empty:
            t = gl.num_programs(0) + gl.atomic_add(counter, 1)
            b = gl.minimum(t, n_items - 1) // n_half // H
            q_row, Lq = bounds(cu_q, b, total_q, max_q, VARLEN)
            empty = (t < n_items) & ((t % n_half) * BM >= Lq)
        return t

    @gluon.jit
    def _publish(t, it, item, item_ready, item_free):
        """The loader tells the query warpgroups its ``it``-th item (``t >= n_items``: the end) through a
        two-slot ring in shared memory."""
        slot = it % 2
        mbarrier.wait(item_free.index(slot), ((it // 2) & 1) ^ 1)  # (a fresh barrier passes)
        item.index(slot).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
        gl.thread_barrier()
        mbarrier.arrive(item_ready.index(slot))

    @gluon.jit
    def _receive(it, item, item_ready, item_free):
        """A query warpgroup's ``it``-th item, as the loader published it."""
        slot = it % 2
        mbarrier.wait(item_ready.index(slot), (it // 2) & 1)
        t = gl.max(item.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
        gl.thread_barrier()  # every thread has read the slot before it is released
        mbarrier.arrive(item_free.index(slot))
        return t

    @gluon.jit
    def _load_tiles(args, F: gl.constexpr, D: gl.constexpr, HI: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr,
                    HIV: gl.constexpr, HEAD_DV: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, BN: gl.constexpr,
                    WGS: gl.constexpr, ALIGN_END: gl.constexpr, WITH_DO: gl.constexpr = False,
                    K_STAGES: gl.constexpr = 2):
        """The producer warp: per work item, the Q block (``WGS`` parts of 64 rows) once every query warpgroup is
        done with the last one's, then its K and V tiles, each ring slot refilled once every warpgroup released it.
        Ring positions count on across work items, so the next item's first tiles load under this one's last
        products. ``args``: the loader's tensors and values (``_attn_fwd_hopper``; in a tile of 192, ``HI`` = 64 (V's:
        ``HIV``), the last 64 columns through their own descriptors into their own tiles). ``WITH_DO``: the block's dO
        too, with its Q (``gluon/backward_dq.py``: V's head dims); ``K_STAGES``: the K ring's slots (V's: two).
        The loader makes its own descriptors (``common.head_descriptor``: over ``q_rows`` and ``k_rows`` rows), so that
        the fence that makes each one visible to TMA runs in the warp that loads through it."""
        (Q, q_stride, K, k_stride, V, v_stride, q_rows, k_rows, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
         k_empty, v_ready, v_empty, item, item_ready, item_free, counter, cu_q, cu_k, total_q, total_k, max_q, max_k,
         n_items, n_blocks, WL, R, q_hi, k_hi, v_hi, dO, do_stride, do_smem, do_hi) = args
        HKV: gl.constexpr = H // GROUP
        q_desc = head_descriptor(Q, q_rows, H, q_stride, 64, D - HI, D, HEAD_D)
        k_desc = head_descriptor(K, k_rows, HKV, k_stride, BN, D - HI, D, HEAD_D)
        v_desc = head_descriptor(V, k_rows, HKV, v_stride, BN, DV - HIV, DV, HEAD_DV)
        if HI > 0:
            q_desc_hi = head_descriptor(Q, q_rows, H, q_stride, 64, HI, D, HEAD_D)
            k_desc_hi = head_descriptor(K, k_rows, HKV, k_stride, BN, HI, D, HEAD_D)
        else:
            q_desc_hi, k_desc_hi = q_desc, k_desc
        v_desc_hi = head_descriptor(V, k_rows, HKV, v_stride, BN, HIV, DV, HEAD_DV) if HIV > 0 else v_desc
        if WITH_DO:
            do_desc = head_descriptor(dO, q_rows, H, do_stride, 64, DV - HIV, DV, HEAD_DV)
            do_desc_hi = head_descriptor(dO, q_rows, H, do_stride, 64, HIV, DV, HEAD_DV) if HIV > 0 else do_desc
        else:
            do_desc, do_desc_hi = q_desc, q_desc  # (stand-ins, unused)
        dtype: gl.constexpr = q_desc.dtype
        half_bytes: gl.constexpr = 64 * (D + (DV if WITH_DO else 0)) * dtype.primitive_bitwidth // 8
        k_bytes: gl.constexpr = BN * D * dtype.primitive_bitwidth // 8
        v_bytes: gl.constexpr = BN * DV * dtype.primitive_bitwidth // 8
        kv = 0  # key tiles loaded so far (ring position)
        qi = 0  # Q blocks loaded so far
        it = 0  # items published so far
        t = _claim(gl.program_id(0), n_items, n_blocks, counter, cu_q, total_q, max_q, H, F.VARLEN, 64 * WGS)
        while t < n_items:
            _publish(t, it, item, item_ready, item_free)
            it += 1
            for half in range(2):
                live, b, h, m0, q_row, k_row, Lq, Lk, shift, t_lo, u_lo, u_hi, n_tiles = _work_item(
                    t, half, n_blocks, cu_q, cu_k, total_q, total_k, max_q, max_k, WL, R, H, F.VARLEN, F.BOTTOM_RIGHT,
                    F.HAS_R, F.HAS_WL, BN, 64 * WGS, ALIGN_END)
                if n_tiles > 0:
                    mbarrier.wait(q_empty, (qi & 1) ^ 1)  # (a fresh barrier passes)
                    mbarrier.expect(q_ready, WGS * half_bytes)
                    for w in gl.static_range(WGS):
                        load_head_tile(q_desc, q_row + m0 + 64 * w, h, q_ready, q_smem.index(w), D, HEAD_D)
                        if HI > 0:
                            load_head_tile(q_desc_hi, q_row + m0 + 64 * w, h, q_ready, q_hi.index(w), D, HEAD_D, D - HI)
                        if WITH_DO:
                            load_head_tile(do_desc, q_row + m0 + 64 * w, h, q_ready, do_smem.index(w), DV, HEAD_DV)
                            if HIV > 0:
                                load_head_tile(do_desc_hi, q_row + m0 + 64 * w, h, q_ready, do_hi.index(w), DV,
                                               HEAD_DV, DV - HIV)
                    qi += 1
                    hk = h // GROUP
                    for j in range(n_tiles):
                        stage = kv % 2
                        phase = ((kv // 2) & 1) ^ 1
                        k_stage = kv % K_STAGES
                        k_phase = ((kv // K_STAGES) & 1) ^ 1
                        row = k_row + t_lo + j * BN
                        mbarrier.wait(k_empty.index(k_stage), k_phase)
                        mbarrier.expect(k_ready.index(k_stage), k_bytes)
                        load_head_tile(k_desc, row, hk, k_ready.index(k_stage), k_ring.index(k_stage), D, HEAD_D)
                        if HI > 0:
                            load_head_tile(k_desc_hi, row, hk, k_ready.index(k_stage), k_hi.index(k_stage), D, HEAD_D,
                                           D - HI)
                        mbarrier.wait(v_empty.index(stage), phase)
                        mbarrier.expect(v_ready.index(stage), v_bytes)
                        load_head_tile(v_desc, row, hk, v_ready.index(stage), v_ring.index(stage), DV, HEAD_DV)
                        if HIV > 0:
                            load_head_tile(v_desc_hi, row, hk, v_ready.index(stage), v_hi.index(stage), DV, HEAD_DV,
                                           DV - HIV)
                        kv += 1
            t = _claim(gl.num_programs(0) + gl.atomic_add(counter, 1), n_items, n_blocks, counter, cu_q, total_q,
                       max_q, H, F.VARLEN, 64 * WGS)
        _publish(t, it, item, item_ready, item_free)  # the end

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
    def _drop(p, seed, offset_lo, threshold, bh, i0, j0, s_layout: gl.constexpr, dtype: gl.constexpr):
        """``p`` (a ``[64, BN]`` tile in ``s_layout``: queries ``i0 + ..``, keys ``j0 + ..``) in ``dtype``, with the
        weights that stream ``bh``'s dropout mask drops set to 0: their sign bits set (-p), the conversion to
        ``dtype`` clamps them (two instructions per element, where a select on the bit took four)."""
        signs = row_dropped_signs(row_keep_words(seed, offset_lo, threshold, bh, i0, j0, True), s_layout)
        return relu_low((p.to(gl.uint32, bitcast=True) | signs).to(gl.float32, bitcast=True), dtype)

    @gluon.jit
    def _take_turn(turn, n, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until the other warpgroup has issued its products of turn ``n - 1`` (warpgroup 0)
        or ``n`` (warpgroup 1), so that the two issue their products in alternation and one's softmax runs
        under the other's products."""
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (n & 1) ^ (1 - WG))  # (warpgroup 0's first wait: a fresh barrier passes)

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG))

    @gluon.jit
    def _pass_block(q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, kv, qi, n, n_tiles, WG: gl.constexpr,
                    PINGPONG: gl.constexpr):
        """A query warpgroup's part in a block where it takes no product (three warpgroups: its rows all lie outside
        the sequence, in a partial block, or see no key; :func:`_own_tiles`): the block's barriers as
        :func:`_query_warpgroup` meets them, its tiles released and its ping-pong turns passed in the same order,
        without products. Returns the ring position, Q blocks and turns after it."""
        if n_tiles > 0:
            mbarrier.wait(q_ready, qi & 1)
            for j in range(n_tiles + 1):  # turn j: S_j with O += P_{j-1} V_{j-1} (j = n_tiles: the last O only)
                i = kv + j
                if j < n_tiles:
                    mbarrier.wait(k_ready.index(i % 2), (i // 2) & 1)
                if j > 0:
                    mbarrier.wait(v_ready.index((i - 1) % 2), ((i - 1) // 2) & 1)
                _take_turn(turn, n + j, WG, PINGPONG)
                _pass_turn(turn, WG, PINGPONG)
                if j < n_tiles:
                    mbarrier.arrive(k_empty.index(i % 2))
                if j > 0:
                    mbarrier.arrive(v_empty.index((i - 1) % 2))
            mbarrier.arrive(q_empty)
        return kv + n_tiles, qi + (n_tiles > 0).to(gl.int32), n + gl.where(n_tiles > 0, n_tiles + 1, 0)

    @gluon.jit
    def _own_tiles(r0, Lq, Lk, shift, WL, R, t_lo, n_tiles, HAS_R: gl.constexpr, HAS_WL: gl.constexpr,
                   BN: gl.constexpr):
        """A warpgroup's own part of its block's key tiles (three warpgroups): ``(n_own, u_lo, u_hi)``, the block's
        first ``n_own`` tiles hold every key its rows ``[r0, r0 + 64)`` of the sequence see (0 where they are none or
        see none), and ``[u_lo, u_hi)`` is where every one of them sees every key. Under a causal mask a 192-row
        block's first warpgroup sees up to 128 keys fewer than its last: it skips those tiles (only releases them)
        and leaves the mask off tiles the block's last rows need it on."""
        first = gl.maximum(r0, 0)
        last = gl.minimum(r0 + 64, Lq) - 1
        lo, hi, full_lo, full_hi = band_keys(first, last, Lk, shift, WL, R, HAS_R, HAS_WL)
        w_lo, u_lo, u_hi, w_hi = tile_stages(lo, hi, full_lo, full_hi, BN)
        sees = (last >= first) & (w_hi > w_lo)
        n_own = gl.where(sees, gl.minimum((w_hi - t_lo + BN - 1) // BN, n_tiles), 0)
        return n_own, u_lo, u_hi

    @gluon.jit
    def _release_tiles(k_ready, k_empty, v_ready, v_empty, kv, n):
        """Tiles ``kv .. kv + n`` of the rings waited for and released without products (a warpgroup's tiles past
        its last visible key, :func:`_own_tiles`)."""
        for i in range(kv, kv + n):
            mbarrier.wait(k_ready.index(i % 2), (i // 2) & 1)
            mbarrier.arrive(k_empty.index(i % 2))
            mbarrier.wait(v_ready.index(i % 2), (i // 2) & 1)
            mbarrier.arrive(v_empty.index(i % 2))

    @gluon.jit
    def _in_sequence(rows, Lq, ALIGN_END: gl.constexpr):
        """Which of ``rows`` are queries of the sequence: below ``Lq``, and with ALIGN_END (whose partial first block
        starts before row 0) from 0."""
        ok = rows < Lq
        if ALIGN_END:
            ok = ok & (rows >= 0)
        return ok

    @gluon.jit
    def _own_products(q_w, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, q_empty, kv, n_own, o, m_i, l_i, rows,
                      t_lo, u_lo, u_hi, Lk, shift, WL, R, qk_scale, seed, offset_lo, threshold, bh, r0,
                      F: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
                      row_o: gl.constexpr):
        """A query warpgroup's products with the first ``n_own`` tiles of its block (ring positions ``kv ..``), with
        three warpgroups: ``(O, P, m, l)`` before the last tile's O += P V, as :func:`_query_warpgroup`'s loop with two.
        The first tile runs the loop too, where O += 0 V_0 stands for the previous tile's product (it adds nothing:
        the same V rows as tile 0's own product, with P 0 where that one's is). Each partition is a copy of its
        code, and with the first tile's softmax peeled off the three copies outgrew the SM's instruction cache:
        "no instruction" stalls took 30% of the warps' samples on short causal rows (bench/NOTES.md)."""
        dtype: gl.constexpr = q_w.dtype
        p = gl.zeros([64, BN], dtype, layout=p_layout)
        for j in range(n_own):
            i = kv + j
            stage = i % 2
            iv = i - (j > 0).to(gl.int32)  # (tile 0: its own V, already loaded or loading)
            mbarrier.wait(k_ready.index(stage), (i // 2) & 1)
            mbarrier.wait(v_ready.index(iv % 2), (iv // 2) & 1)
            s = warpgroup_mma(q_w, k_ring.index(stage).permute((1, 0)), gl.zeros([64, BN], gl.float32, layout=s_layout),
                              use_acc=False, is_async=True)
            o = warpgroup_mma(p, v_ring.index(iv % 2), o, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(stage))
            if j == n_own - 1:
                mbarrier.arrive(q_empty)  # Q read for the last time: the next block may load
            p_next, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, rows, t_lo + j * BN, u_lo, u_hi, Lk, shift, WL, R,
                                                    qk_scale, F.HAS_R, F.HAS_WL, BN, s_layout)
            if F.DROPOUT:  # (l sums the weights before dropout; O takes the kept ones)
                p_next = _drop(p_next, seed, offset_lo, threshold, bh, r0, t_lo + j * BN, s_layout, dtype)
            o, p = warpgroup_mma_wait(0, deps=(o, p))
            if j > 0:
                mbarrier.arrive(v_empty.index(iv % 2))
            o = o * gl.convert_layout(alpha, row_o)[:, None]
            p = gl.convert_layout(p_next.to(dtype), p_layout)
        return o, p, m_i, l_i

    @gluon.jit
    def _query_warpgroup(args, F: gl.constexpr, D: gl.constexpr, HI: gl.constexpr, DV: gl.constexpr,
                         HIV: gl.constexpr, HEAD_DV: gl.constexpr, H: gl.constexpr, BN: gl.constexpr,
                         PINGPONG: gl.constexpr, WGS: gl.constexpr, ALIGN_END: gl.constexpr, O_IN_Q: gl.constexpr,
                         Q_REGS: gl.constexpr, WG: gl.constexpr):
        """One consumer warpgroup: per work item, queries ``m0 + 64 WG ..`` (+64) against every visible key tile, then
        the output (TMA store through this warpgroup's staging tile; by masked stores where its 64 rows are not all in
        the sequence) and the lse. ``args``: what every query warpgroup takes (``_attn_fwd_hopper``). In a tile of 192
        (``HI`` = 64 for Q and K, ``HIV`` for V and the output, whose tile ``DV`` may be another) each product with
        Q, K or V is a pair, and the output's last 64 columns an accumulator of their own (``o_hi``). (The pairs are
        written out at each product: through a helper, the inlined call's debug ranges moved ptxas's schedule of the
        other tiles' kernels.)"""
        (q_smem, k_ring, v_ring, o_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, item, item_ready,
         item_free, o_desc, O, o_stride, LSE, cu_q, cu_k, total_q, total_k, max_q, max_k, n_items, n_blocks, WL, R,
         scale, qk_scale, seed, offset_lo, threshold, keep_scale, q_hi, k_hi, v_hi, o_desc_hi, o_hi_smem) = args
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DV - HIV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # (The second part's layouts: in tiles of 192 only, where HIV is 64.)
        oh_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HIV if HIV > 0 else DV, 16])
        row_oh: gl.constexpr = gl.SliceLayout(1, oh_layout)
        q_w = q_smem.index(WG)
        q_hw = q_hi.index(WG)
        o_hw = o_hi_smem.index(WG)
        # With O_IN_Q (no room for a staging tile of its own: output_in_q) the output is staged in this warpgroup's part
        # of Q: Q is released once the output's store has read it, not after the block's last S = Q Kᵀ.
        o_w = o_smem.index(WG)
        kv = 0  # key tiles consumed so far (ring position)
        qi = 0  # Q blocks consumed so far
        n = 0  # products issued so far (ping-pong turns)
        it = 0  # items received so far
        t = _receive(it, item, item_ready, item_free)
        while t < n_items:
            it += 1
            for half in range(2):
                live, b, h, m0, q_row, k_row, Lq, Lk, shift, t_lo, u_lo, u_hi, n_tiles = _work_item(
                    t, half, n_blocks, cu_q, cu_k, total_q, total_k, max_q, max_k, WL, R, H, F.VARLEN, F.BOTTOM_RIGHT,
                    F.HAS_R, F.HAS_WL, BN, 64 * WGS, ALIGN_END)
                r0 = m0 + WG * 64
                # With three warpgroups, each takes products with its own tiles only (up to its last visible key) and
                # masks its own edges; one with no row of the sequence or no visible key (a sequence's partial first
                # block often has such) takes none. With two, the branches cost more than they saved (2-3% on dense
                # causal D64 rows for the pass alone: bench/NOTES.md), and every warpgroup takes every tile.
                n_own = n_tiles
                if WGS == 3:
                    n_own, u_lo, u_hi = _own_tiles(r0, Lq, Lk, shift, WL, R, t_lo, n_tiles, F.HAS_R, F.HAS_WL, BN)
                passing = (live & (n_own == 0)) if WGS == 3 else False
                if live:  # (every warpgroup waits for and releases every tile of a block: the ring's slots need each)
                    rows = r0 + gl.arange(0, 64, layout=row_s)
                    m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
                    l_i = gl.zeros([64], gl.float32, layout=row_s)
                    o = gl.zeros([64, DV - HIV], gl.float32, layout=o_layout)
                    o_hi = gl.zeros([64, HIV], gl.float32, layout=oh_layout) if HIV > 0 else 0
                    if passing:
                        kv, qi, n = _pass_block(q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, kv, qi, n,
                                                n_tiles, WG, PINGPONG)
                    elif n_tiles > 0:
                        mbarrier.wait(q_ready, qi & 1)
                        if WGS == 3:  # (one copy of the softmax per partition: see _own_products)
                            o, p, m_i, l_i = _own_products(q_w, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                                                           q_empty, kv, n_own, o, m_i, l_i, rows, t_lo, u_lo, u_hi,
                                                           Lk, shift, WL, R, qk_scale, seed, offset_lo, threshold,
                                                           b * H + h, r0, F, BN, s_layout, p_layout, row_o)
                        else:
                            if Q_REGS:  # (query_in_registers)
                                q_a = q_w.load(q_operand)
                                q_ha = q_hw.load(q_operand)
                                # The loader refills Q's buffer by TMA (the async proxy) once this warpgroup releases
                                # it; without the proxy fence the refill could land under these generic reads (seen
                                # on an H200: wrong rows in up to a quarter of the calls of a test's case; none with
                                # it: bench/NOTES.md, stop 61).
                                fence_async_shared()
                                gl.thread_barrier()  # every thread has read its Q before the loader refills it
                                mbarrier.arrive(q_empty)
                            else:
                                q_a = q_w
                                q_ha = q_hw
                            stage = kv % 2
                            mbarrier.wait(k_ready.index(stage), (kv // 2) & 1)
                            _take_turn(turn, n, WG, PINGPONG)
                            s = warpgroup_mma(q_a, k_ring.index(stage).permute((1, 0)),
                                              gl.zeros([64, BN], gl.float32, layout=s_layout), use_acc=False,
                                              is_async=True)
                            if HI > 0:
                                s = warpgroup_mma(q_ha, k_hi.index(stage).permute((1, 0)), s, is_async=True)
                            _pass_turn(turn, WG, PINGPONG)
                            n += 1
                            s = warpgroup_mma_wait(0, deps=(s,))
                            mbarrier.arrive(k_empty.index(stage))
                            if not O_IN_Q and not Q_REGS and n_own == 1:
                                mbarrier.arrive(q_empty)  # Q read for the last time: the next block may load
                            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, rows, t_lo, u_lo, u_hi, Lk, shift, WL, R,
                                                               qk_scale, F.HAS_R, F.HAS_WL, BN, s_layout)
                            if F.DROPOUT:  # (l sums the weights before dropout; O takes the kept ones)
                                p = _drop(p, seed, offset_lo, threshold, b * H + h, r0, t_lo, s_layout, dtype)
                            p = gl.convert_layout(p.to(dtype), p_layout)  # (with dropout, already in dtype)
                            # Tile j: S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} are issued together; the softmax of S_j
                            # runs while the second product does. Every product is waited for within its iteration
                            # (a product in flight across the loop's back edge makes ptxas serialize every wgmma).
                            for j in range(1, n_own):
                                i = kv + j
                                stage = i % 2
                                prev = (i - 1) % 2
                                mbarrier.wait(k_ready.index(stage), (i // 2) & 1)
                                mbarrier.wait(v_ready.index(prev), ((i - 1) // 2) & 1)
                                _take_turn(turn, n, WG, PINGPONG)
                                s = warpgroup_mma(q_a, k_ring.index(stage).permute((1, 0)),
                                                  gl.zeros([64, BN], gl.float32, layout=s_layout), use_acc=False,
                                                  is_async=True)
                                if HI > 0:
                                    s = warpgroup_mma(q_ha, k_hi.index(stage).permute((1, 0)), s, is_async=True)
                                o = warpgroup_mma(p, v_ring.index(prev), o, is_async=True)
                                if HIV > 0:
                                    o_hi = warpgroup_mma(p, v_hi.index(prev), o_hi, is_async=True)
                                _pass_turn(turn, WG, PINGPONG)
                                n += 1
                                s = warpgroup_mma_wait(2 if HIV > 0 else 1, deps=(s,))  # (O's products in flight)
                                mbarrier.arrive(k_empty.index(stage))
                                if not O_IN_Q and not Q_REGS and j == n_own - 1:
                                    mbarrier.arrive(q_empty)
                                p_next, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, rows, t_lo + j * BN, u_lo, u_hi,
                                                                        Lk, shift, WL, R, qk_scale, F.HAS_R, F.HAS_WL,
                                                                        BN, s_layout)
                                if F.DROPOUT:
                                    p_next = _drop(p_next, seed, offset_lo, threshold, b * H + h, r0, t_lo + j * BN,
                                                   s_layout, dtype)
                                if HIV > 0:
                                    o, o_hi, p = warpgroup_mma_wait(0, deps=(o, o_hi, p))
                                else:
                                    o, p = warpgroup_mma_wait(0, deps=(o, p))
                                mbarrier.arrive(v_empty.index(prev))
                                o = o * gl.convert_layout(alpha, row_o)[:, None]
                                if HIV > 0:
                                    o_hi = o_hi * gl.convert_layout(alpha, row_oh)[:, None]
                                p = gl.convert_layout(p_next.to(dtype), p_layout)
                        last = kv + n_own - 1
                        mbarrier.wait(v_ready.index(last % 2), (last // 2) & 1)
                        _take_turn(turn, n, WG, PINGPONG)
                        o = warpgroup_mma(p, v_ring.index(last % 2), o, is_async=True)
                        if HIV > 0:
                            o_hi = warpgroup_mma(p, v_hi.index(last % 2), o_hi, is_async=True)
                        _pass_turn(turn, WG, PINGPONG)
                        n += 1
                        if HIV > 0:
                            o, o_hi = warpgroup_mma_wait(0, deps=(o, o_hi))
                        else:
                            o = warpgroup_mma_wait(0, deps=(o,))
                        mbarrier.arrive(v_empty.index(last % 2))
                        if WGS == 3:
                            _release_tiles(k_ready, k_empty, v_ready, v_empty, kv + n_own, n_tiles - n_own)
                        kv += n_tiles
                        qi += 1
                    # Rows that saw no key: output 0 and lse -inf.
                    seen = l_i > 0
                    l_safe = gl.where(seen, l_i, 1.0)
                    if F.DROPOUT:  # kept weights scaled by the exact keep probability's inverse (dropout_keep_scale)
                        o = (o * gl.convert_layout(keep_scale / l_safe, row_o)[:, None]).to(dtype)
                    else:
                        o = (o / gl.convert_layout(l_safe, row_o)[:, None]).to(dtype)
                    if HIV > 0:  # (no dropout in tiles past 128: their key tiles are 64)
                        out_hi = (o_hi / gl.convert_layout(l_safe, row_oh)[:, None]).to(dtype)
                    # (With ALIGN_END, rows before 0 are no queries either: a partial first block. Staged in Q, only
                    # a block that loaded Q: the loader may be filling it otherwise.)
                    whole = (r0 + 64 <= Lq) & (r0 >= 0) if ALIGN_END else r0 + 64 <= Lq
                    if O_IN_Q:
                        whole = whole & (n_tiles > 0)
                    if whole:
                        tma.store_wait(0)  # the previous item's store has left the staging tile
                        gl.thread_barrier()
                        o_w.store(o)
                        if HIV > 0:
                            o_hw.store(out_hi)
                        fence_async_shared()
                        gl.thread_barrier()
                        store_head_tile(o_desc, q_row + r0, h, o_w, 0, DV, HEAD_DV)
                        if HIV > 0:
                            store_head_tile(o_desc_hi, q_row + r0, h, o_hw, 0, DV, HEAD_DV, DV - HIV)
                    else:  # a sequence's last (or first) rows, or none: a TMA box would write into its neighbour's
                        rows_o = r0 + gl.arange(0, 64, layout=row_o)
                        cols = gl.arange(0, DV - HIV, layout=gl.SliceLayout(0, o_layout))
                        ptrs = O + (q_row + rows_o).to(gl.int64)[:, None] * o_stride + h * HEAD_DV + cols[None, :]
                        gl.store(ptrs, o, mask=_in_sequence(rows_o, Lq, ALIGN_END)[:, None] & (cols < HEAD_DV)[None, :])
                        if HIV > 0:
                            rows_h = r0 + gl.arange(0, 64, layout=row_oh)
                            cols_h = DV - HIV + gl.arange(0, HIV, layout=gl.SliceLayout(0, oh_layout))
                            ptrs_h = (O + (q_row + rows_h).to(gl.int64)[:, None] * o_stride + h * HEAD_DV +
                                      cols_h[None, :])
                            gl.store(ptrs_h, out_hi,
                                     mask=_in_sequence(rows_h, Lq, ALIGN_END)[:, None] & (cols_h < HEAD_DV)[None, :])
                    if O_IN_Q and n_tiles > 0:
                        if whole:
                            tma.store_wait(0)  # the store has read the output: Q's part may load
                        mbarrier.arrive(q_empty)
                    lse = gl.where(seen, m_i * scale + gl.log2(l_safe) * LN2, float("-inf"))
                    gl.store(LSE + lse_offset(b, q_row, h, H, total_q, max_q, F.VARLEN) + rows, lse,
                             mask=_in_sequence(rows, Lq, ALIGN_END))
            t = _receive(it, item, item_ready, item_free)
        tma.store_wait(0)

    @fast_launch
    @gluon.jit(do_not_specialize=[*common.DATA_DEPENDENT, "n_seqs"])
    def _attn_fwd_hopper(Q: Rows, K: Rows, V: Rows, O: Rows, LSE, seqs: Seqs, total_q, total_k, max_q, max_k,
                         n_seqs, counter, mask: Mask, scale, qk_scale, dropout: Dropout, seed, offset_lo,
                         F: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr, DV: gl.constexpr,
                         HEAD_DV: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr, GROUP: gl.constexpr,
                         BN: gl.constexpr, PINGPONG: gl.constexpr, WGS: gl.constexpr, ALIGN_END: gl.constexpr,
                         O_IN_Q: gl.constexpr, Q_REGS: gl.constexpr):
        """Persistent: a grid of at most one program per SM walking the ``cdiv(cdiv(max_q, 64 WGS), 2) x H x n_seqs``
        work items, each two blocks of ``64 WGS`` queries (``_work_item``); ``counter``: a zeroed int32, the tickets
        of the items after the programs' first (``_claim``). Tensors
        as ``triton.forward._attn_fwd_kernel``'s, each with its heads packed in a row (stride_h = HEAD_D, the tensors'
        head dim: D, the tiles', or less, ``common.head_descriptor``; V's and O's ``HEAD_DV`` in tiles of ``DV``) and,
        dense,
        its sequences one after another (stride_b = S x stride_s). ``scale``: the softmax scale; ``qk_scale``: it
        times log2(e); ``dropout``, ``seed``, ``offset_lo``: as ``triton.scores.dropout_args`` gives them (used where
        ``F.DROPOUT``)."""
        # Three query warpgroups fit only D64's registers, and the ping-pong turns are written for two. The dropout
        # draws take query rows in pairs from an even row (gluon/dropout.py): blocks start at even rows.
        gl.static_assert(WGS == 2 or (WGS == 3 and D == 64 and DV == 64 and not PINGPONG))
        gl.static_assert(not (ALIGN_END and F.DROPOUT))
        gl.static_assert(not (F.DROPOUT and BN != 128))  # (the dropout tile, gluon/dropout.py, is 128 keys wide)
        gl.static_assert(not Q_REGS or (D == 192 and DV == 192 and WGS == 2))  # (query_in_registers: only there)
        dtype: gl.constexpr = Q.ptr.dtype.element_ty
        # A tile of 192 is two parts, 128 and HI = 64 columns (HIV of V and O): tiles, boxes and accumulators of
        # their own.
        HI: gl.constexpr = 64 if D == 192 else 0
        HIV: gl.constexpr = 64 if DV == 192 else 0
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D - HI], dtype)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D - HI], dtype)
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, DV - HIV], dtype)
        o_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DV - HIV], dtype)
        # One descriptor per tensor over all its rows (clipped only at the buffer's end: a tile past a
        # sequence's end reads the next sequence's rows, masked out of the scores; see the module docstring). Q's, K's
        # and V's are made by the loader (_load_tiles), which copies through them; O's here, before the partitions (the
        # module docstring says why).
        if F.VARLEN:
            q_rows = total_q
            k_rows = total_k
        else:
            q_rows = n_seqs * max_q
            k_rows = n_seqs * max_k
        # (With O_IN_Q the output is staged in each warpgroup's part of Q: output_in_q.)
        o_desc = head_descriptor(O.ptr, q_rows, H, O.stride_s, 64, DV - HIV, DV, HEAD_DV)
        o_desc_hi = head_descriptor(O.ptr, q_rows, H, O.stride_s, 64, HIV, DV, HEAD_DV) if HIV > 0 else o_desc
        q_smem = gl.allocate_shared_memory(dtype, [WGS, 64, D - HI], q_layout)
        o_smem = q_smem if O_IN_Q else gl.allocate_shared_memory(dtype, [WGS, 64, DV - HIV], o_smem_layout)
        k_ring = gl.allocate_shared_memory(dtype, [2, BN, D - HI], k_layout)
        v_ring = gl.allocate_shared_memory(dtype, [2, BN, DV - HIV], v_layout)
        # The second parts (the first parts stand in for them where HI or HIV is 0, unused).
        if HI > 0:
            hi_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HI], dtype)
            q_hi = gl.allocate_shared_memory(dtype, [WGS, 64, HI], hi_layout)
            k_hi = gl.allocate_shared_memory(dtype, [2, BN, HI], hi_layout)
        else:
            q_hi, k_hi = q_smem, k_ring
        if HIV > 0:
            hiv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, HIV], dtype)
            v_hi = gl.allocate_shared_memory(dtype, [2, BN, HIV], hiv_layout)
            o_hi_smem = gl.allocate_shared_memory(dtype, [WGS, 64, HIV], hiv_layout)
        else:
            v_hi, o_hi_smem = v_ring, o_smem
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=WGS)  # one arrival per query warpgroup
        for i in gl.static_range(2):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=WGS)
            mbarrier.init(v_empty.index(i), count=WGS)
            mbarrier.init(turn.index(i), count=1)
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_free.index(i), count=WGS)

        n_blocks = (max_q + 64 * WGS - 1) // (64 * WGS)
        n_items = (n_blocks + 1) // 2 * H * n_seqs  # (see _work_item)
        # A partition per query warpgroup, then the loader. (The tuples of their tensors and values hold no constexpr:
        # a tuple assigned to a variable turns its constexprs into tensors.)
        wg_args = (q_smem, k_ring, v_ring, o_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, item,
                   item_ready, item_free, o_desc, O.ptr, O.stride_s, LSE, seqs.cu_q, seqs.cu_k, total_q, total_k,
                   max_q, max_k, n_items, n_blocks, mask.window_left, mask.right, scale, qk_scale, seed, offset_lo,
                   dropout.threshold, dropout.keep_scale, q_hi, k_hi, v_hi, o_desc_hi, o_hi_smem)
        load_args = (Q.ptr, Q.stride_s, K.ptr, K.stride_s, V.ptr, V.stride_s, q_rows, k_rows, q_smem, k_ring, v_ring,
                     q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item, item_ready, item_free, counter,
                     seqs.cu_q, seqs.cu_k, total_q, total_k, max_q, max_k, n_items, n_blocks, mask.window_left,
                     mask.right, q_hi, k_hi, v_hi, Q.ptr, Q.stride_s, q_smem, q_smem)  # (no dO: WITH_DO off, stand-ins)
        if WGS == 3:
            gl.warp_specialize([(_query_warpgroup, (wg_args, F, D, HI, DV, HIV, HEAD_DV, H, BN, PINGPONG, WGS,
                                                    ALIGN_END, O_IN_Q, Q_REGS, 0)),
                                (_query_warpgroup, (wg_args, F, D, HI, DV, HIV, HEAD_DV, H, BN, PINGPONG, WGS,
                                                    ALIGN_END, O_IN_Q, Q_REGS, 1)),
                                (_query_warpgroup, (wg_args, F, D, HI, DV, HIV, HEAD_DV, H, BN, PINGPONG, WGS,
                                                    ALIGN_END, O_IN_Q, Q_REGS, 2)),
                                (_load_tiles, (load_args, F, D, HI, HEAD_D, DV, HIV, HEAD_DV, H, GROUP, BN, WGS,
                                               ALIGN_END))],
                               [4, 4, 1], [common.THREE_WG_CONSUMER_REGS, common.THREE_WG_CONSUMER_REGS,
                                           common.LOADER_REGS])
        else:
            gl.warp_specialize([(_query_warpgroup, (wg_args, F, D, HI, DV, HIV, HEAD_DV, H, BN, PINGPONG, WGS,
                                                    ALIGN_END, O_IN_Q, Q_REGS, 0)),
                                (_query_warpgroup, (wg_args, F, D, HI, DV, HIV, HEAD_DV, H, BN, PINGPONG, WGS,
                                                    ALIGN_END, O_IN_Q, Q_REGS, 1)),
                                (_load_tiles, (load_args, F, D, HI, HEAD_D, DV, HIV, HEAD_DV, H, GROUP, BN, WGS,
                                               ALIGN_END))],
                               [4, 1], [common.CONSUMER_REGS, common.LOADER_REGS])
        mbarrier.invalidate(q_ready)
        mbarrier.invalidate(q_empty)
        for i in gl.static_range(2):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(v_empty.index(i))
            mbarrier.invalidate(turn.index(i))
            mbarrier.invalidate(item_ready.index(i))
            mbarrier.invalidate(item_free.index(i))

else:  # pragma: no cover - depends on the installed Triton
    # (the schedule and loader gluon/backward_dq.py's kernel shares, imported there whatever the Triton)
    _in_sequence = _load_tiles = _receive = _work_item = None


def supports(problem, opts, dtype, bias, alibi, seed) -> bool:
    """Whether the kernel computes this call (whatever the machine): a :func:`common.plain_call` (fp16/bf16,
    head dims in ``common.wide_tile_head_dims``, no score modifier or special mask; dropout allowed, but not in
    tiles past 128, whose key tiles are 64: :func:`block_keys`) whose scores stay raw q.k (``launch.raw_scores``: a
    non-negative scale)."""
    if not common.plain_call(problem, opts, dtype, bias, alibi, common.wide_tile_head_dims):
        return False
    if seed is not None and max(common.wide_tile_head_dims(problem.head_dim, problem.head_dim_v)) > 128:
        # (The dropout tile, gluon/dropout.py, is 128 keys wide, the kernel's static_assert, where these tiles take 64
        # keys; multi-head latent attention's 192 / 128 takes 128, but its dropout was never built or tested.)
        return False
    return raw_scores(opts, bias, alibi)


def applies(problem, opts, q, k, v, bias, alibi, seed) -> bool:
    """Whether the kernel takes this call here: :func:`supports`, on an sm_90 GPU with Gluon, every tensor
    with its heads packed in a row and TMA-aligned, and (dense) its sequences one after another in memory (the
    kernel's descriptors span all rows)."""
    if not (supports(problem, opts, q.dtype, bias, alibi, seed) and common.hopper_layout(q, k, v)):
        return False
    return not problem.dense or common.sequences_adjacent(q, k, v)


def launch(q, k, v, out, lse, problem, seq_args, mask, feats, scores, dropout) -> None:
    """Run the kernel: ``out`` (packed heads, like q) and ``lse`` written; ``mask``, ``scores``: the call's
    ``Mask`` and ``Scores`` bundles (their scale and log2-unit scale); ``dropout``: ``triton.scores.dropout_args``'s
    keyword arguments."""
    ensure_allocator()  # the kernel builds its TMA descriptors on the device
    dense = problem.dense
    mean_q = problem.max_q if dense else q.shape[0] // max(problem.batch, 1)
    programs = sm_count(q.device)
    tile_d, tile_dv = common.wide_tile_head_dims(problem.head_dim, problem.head_dim_v)
    tile_dim = max(tile_d, tile_dv)  # (what the rules go by: the registers' and shared memory's larger tile)
    wgs = query_warpgroups(tile_dim, feats.HAS_R, feats.HAS_WL, feats.DROPOUT, problem.max_q, mean_q,
                           problem.heads * problem.batch if dense else None, programs)
    items = cdiv(cdiv(problem.max_q, 64 * wgs), 2) * problem.heads * problem.batch  # (two blocks each)
    _attn_fwd_hopper[(min(items, programs),)](
        rows(q, dense), rows(k, dense), rows(v, dense), rows(out, dense), lse, **seq_args, n_seqs=problem.batch,
        counter=torch.zeros(1, dtype=torch.int32, device=q.device),
        mask=mask, scale=scores.scale, qk_scale=scores.qk_scale, **dropout, F=feats, D=tile_d,
        HEAD_D=problem.head_dim, DV=tile_dv, HEAD_DV=problem.head_dim_v, H=problem.heads, HKV=problem.kv_heads,
        GROUP=problem.group, BN=block_keys(tile_d, tile_dv), O_IN_Q=output_in_q(tile_d, tile_dv),
        Q_REGS=query_in_registers(tile_d, tile_dv, wgs),
        PINGPONG=wgs == 2 and pingpong(tile_dim, feats.HAS_R, feats.DROPOUT), WGS=wgs,
        # Under a causal-like mask the partial block is the lightest at the start; dropout's draws need even rows.
        ALIGN_END=wgs == 3 and bool(feats.HAS_R) and not feats.DROPOUT,
        num_warps=4, maxnreg=common.MAX_REGS if wgs == 2 else common.THREE_WG_MAX_REGS,
    )
