"""Hopper attention backward in Gluon, warp-specialized: dK, dV and dQ of a key block in one program.

The plain Triton kernel (``triton/backward.py``) leaves the scheduling of its five matmuls to the compiler,
which on sm_90 keeps them synchronous and spills at 128-key tiles. Here FA3's structure is written out
(``../shared/attention-backward-notes.md``): one program per (128-key block, kv head, sequence), or per pair of
blocks (``PAIRS``, below), three partitions (``gl.warp_specialize``):

- a loader warp (24 registers): K and V once per block by TMA, then the (Q, dO) tiles of 64 queries of every head of
  the GQA group through a two-stage ring of shared memory (``ready`` / ``empty`` mbarriers), each stage with its
  tile's lse and delta (loaded by the warp's threads);
- two key warpgroups (240 registers each), each owning 64 of the keys: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ read both
  operands from shared memory; Pᵀ and dSᵀ stay in registers as the A operand of dV += Pᵀ dO and
  dK += dSᵀ Q (no transposes); each writes its dSᵀ into its half of a shared (double-buffered) tile
  (``ds_ready`` / ``ds_free`` mbarriers hand it over), from which dQ = dS K over all 128 keys is computed and
  added into the fp32 dQ accumulator by TMA bulk reduces (``cp.reduce.async.bulk``, which Triton 3.6's Gluon
  has in its IR builder but not in Python: :func:`_tma_reduce_add`): one reduce of a tile's dQ per key
  block, where each warpgroup adding its own keys' part made two. At D64 the warpgroups take turns, tile by
  tile, computing all of it; at D128 (``LEAN``) each computes half its columns every tile, and its Sᵀ and
  dPᵀ products start from -lse and -delta: registers are short there (64x128 fp32 dK and dV accumulators),
  and with both the kernel went from spilling ~200 bytes to ~30-100 and from 0.90-0.98x the Triton kernel
  to 1.04-1.29x (H100, ``bench/NOTES.md``). The band mask is applied on the tiles that cross it only. Every
  matmul is asynchronous, waited where it is used.

Sequences and heads: per-sequence TMA descriptors made on the device, each by the partition that copies through it
(``common.sequence_descriptor``), over rows x (heads x D) (3-D where the head dim is less than the tile's:
``common.head_descriptor``), clip every load at the sequence's last row (zeros beyond), and
every store and reduce there too, so no tile touches another sequence. Rows past the last query get ``lse2 = +inf``
(P = 0); keys past the last key are zero rows of K and V, whose P must be 0 (their score 0 would give P = exp(-lse),
whose dS overflows where the lse lies far below 0, and dS times their zero row of K is then NaN in dQ): the lean form
starts their products at -inf, the other forms zero P on the key block that crosses the end. Their dK/dV rows are
never stored. Dense calls whose lengths are whole numbers of tiles take descriptors made once on the host over all
rows instead (:func:`host_descriptors`): making seven descriptors, each behind a GPU-scope fence, delayed every
program's first loads (H100: 1.06-1.26x at S1k, 1.02-1.07x on causal S4k rows; ``bench/NOTES.md``).

Order: jagged sequences longest first; dense calls under a causal mask with few programs start every (head,
sequence)'s first key block, the heaviest, before any second one (``program.blocks_last``). At D64 under a causal
mask, where programs are many and sequences short, a program takes two key blocks, ``p`` and ``n - 1 - p``, whose
work adds up alike (``PAIRS``, :func:`pairs`). Deterministic calls: a sequence's key blocks last first (``DET``).

Dropout: each warpgroup draws its tile's keep bits before issuing the tile's products (``gluon/dropout.py``: 2
Philox calls per thread, the mask of ``varlen.attn.dropout`` bit for bit) and puts them in Pᵀ's sign bits (-P
where dropped), so no mask stays live: dV takes the kept P from a conversion that clamps at 0 (``relu_low``), and
dSᵀ, made times 2 / keep_scale (dK and dQ take it back at their ends, dV its keep scale), is
(Pᵀ + |Pᵀ|) dPᵀ - |Pᵀ| 2 delta / keep_scale: no select. Each tile's instructions are what bounds it (about twice
the plain tile's), so every one of them counts (``bench/NOTES.md``, "Dropout's instructions").

Bias: the loader brings each tile's bias (its queries x the block's keys, one box per warpgroup) into the ring
stage beside Q and dO; each warpgroup reads its half transposed (``ldmatrix.trans``) into its Sᵀ product's start
(lean) or its exponent. Its gradient, dS, is staged transposed in the warpgroup's dQ buffer (free between dQ
reduces) and leaves by TMA: a store for a full-shape bias, a float32 reduce-add for one broadcast over sequences or
heads (summed there; ``launch_backward`` rounds it to the bias's dtype). Where every sequence visits the same tiles
(dense) and the bias is broadcast over sequences only, the first sequence's programs store their tiles (zeros where
a mask hides a tile) and the others add to them once each tile's flag says its store is complete (``DB`` 3,
:func:`stores_first`): the float32 buffer then takes no zeros, and no add reads zeros back from DRAM (H100, B4 S2048
H16 D128: backward 1.34 -> 1.19 ms; ``bench/NOTES.md``, "The first sequence stores").

Scope (:func:`supports`): fp16/bf16, head dims 64 and 128 (Dv = D), and multiples of 8 from 40 to 128 in those tiles
(``common.tile_head_dim``: zeros read past the head), dense or jagged, no mask, causal (either
alignment) or windows, GQA, dropout (not with ``query_offset``), a bias of the inputs' dtype over whole (query, key)
planes (not with dropout); deterministic calls without a mask or under a causal-like one, without a left window or
a bias (dQ's reduces into each query tile in a fixed order by a warp of their own, ``DET``: :func:`_dq_writer`);
:func:`applies` adds the machine (sm_90 with Gluon) and the layout (heads packed in a row, TMA-aligned; a bias's keys a
multiple of 8). It runs wherever it applies: on an H100 it leads the Triton kernel at every measured shape but one
(D64 S1k, 0.98-1.0x; ``bench/NOTES.md``). It needs an sm_90 GPU (Gluon doesn't run in the interpreter); the GPU
tests cover every variant it accepts, and run the Triton kernel on the same variants.
"""

from __future__ import annotations

import collections

import torch

from ..._kernel_math import LOG2E
from ..._launch import fast_launch
from ...tiling import cdiv, sm_count
from ..triton.launch import ensure_allocator
from ..triton.masks import Mask, in_band, key_blocks_after, query_stages
from ..triton.program import (
    BLOCKS_FIRST,
    Rows,
    Seqs,
    base,
    batch,
    first_blocks_heaviest,
    key_block_grid,
    lse_offset,
    prologue,
    rows,
)
from ..triton.scores import Dropout
from . import common
from .common import (
    HAVE_GLUON,
    TensorDescriptor,
    builtin,
    fence_async_shared,
    gl,
    gluon,
    ir,
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

BLOCK_N = 128  # keys per program: 64 per warpgroup
BLOCK_M = 64   # queries per tile of the ring
NUM_WARPS = 4  # the default partition: one key warpgroup; the other and the loader are workers
# Dense causal calls with fewer programs per SM start every first key block first (program.blocks_last): +10-17%
# at 512-1024 programs; at 2048, 3-12% lost (bench/NOTES.md).
PROGRAMS_PER_SM = 8
# At D64 under a causal mask a program takes two key blocks (pairs) where the call has at least this many pairs per
# SM (where the heaviest-first order above doesn't apply, which measured better below that), on sequences of at most
# this mean length: see pairs().
PAIRS_PER_SM = PROGRAMS_PER_SM // 2
PAIRS_MEAN_KEYS = 4096
# The bias's and its gradient's strides: data-dependent for a jagged batch's (1, H, max_q, max_k) bias.
BIAS_STRIDES = ["bias_sb", "bias_sh", "bias_sq", "dbias_sb", "dbias_sh", "dbias_sq"]

# A program's key blocks (one, or two: pairs): how many (``taken``), and each one's first key, first query tile row,
# tile count and fully visible tile rows [u_lo, u_hi) (masks.query_stages), each a (first block's, second block's)
# pair.
Items = collections.namedtuple("Items", "taken n0 t_lo n_tiles u_lo u_hi")


if HAVE_GLUON:
    @builtin
    def _tma_reduce_add(desc, coord, src, _semantic=None):
        """``desc[coord:] += src`` (a shared-memory tile) by one TMA bulk reduce, clipped at the descriptor's
        bounds; asynchronous like a TMA store (``tma.store_wait`` waits for it)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)

    @gluon.jit
    def _add_dq(dq, dq_buf, dq_desc, m0, col):
        """``dq`` (fp32, scaled) added into the accumulator at rows ``m0..``, column ``col``, through ``dq_buf``
        in shared memory (free: the caller waited for its last reduce) and one TMA bulk reduce."""
        dq_buf.store(dq)
        fence_async_shared()
        gl.thread_barrier()
        _tma_reduce_add(dq_desc, [m0, col], dq_buf)

    # One element per thread of a key warpgroup (four warps) or of the loader (one): vectors through which every
    # thread runs an instruction once, or one thread makes a single access (the other lanes masked off).
    _WARPGROUP_LANES = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
    _WARP_LANES = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))

    @gluon.jit
    def _bulk_writes_done(PENDING: gl.constexpr, WARPS: gl.constexpr):
        """(A key warpgroup, ``WARPS`` 4, or the dQ writer, 1) Waits until at most ``PENDING`` (0, 1 or 2) of the
        calling thread's latest bulk groups are pending and every earlier one is complete, its writes performed
        (``tma.store_wait`` waits only for their reads of shared memory); then fences the async proxy against the
        thread's later accesses."""
        lanes = gl.arange(0, 32 * WARPS, layout=_WARPGROUP_LANES if WARPS == 4 else _WARP_LANES)
        if PENDING == 0:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.b32 $0, $1;",
                                      "=r,r", [lanes], dtype=gl.int32, is_pure=False, pack=1)
        elif PENDING == 1:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 1;\n\tfence.proxy.async.global;\n\tmov.b32 $0, $1;",
                                      "=r,r", [lanes], dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.static_assert(PENDING == 2, "at most two bulk groups left pending")
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 2;\n\tfence.proxy.async.global;\n\tmov.b32 $0, $1;",
                                      "=r,r", [lanes], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _async_after_generic(WARPS: gl.constexpr):
        """(A key warpgroup, ``WARPS`` 4, or the dQ writer, 1) Orders what the calling thread saw before (a tile made
        ready after its flag; a tile's turn) before its later bulk operations."""
        lanes = gl.arange(0, 32 * WARPS, layout=_WARPGROUP_LANES if WARPS == 4 else _WARP_LANES)
        gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.b32 $0, $1;", "=r,r", [lanes], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _wait_turn(turn, target):
        """(The dQ writer, ``DET``) Waits until ``*turn`` (an int32 that only grows) is at least ``target``: its first
        lane reads it with acquire semantics at GPU scope until it is (the others skip the loop); then, after the
        warp's barrier, every lane fences the async proxy, so that the bulk reduces it issues next come after the adds
        the count stands for."""
        lanes = gl.arange(0, 32, layout=_WARP_LANES)
        gl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 v; mov.b32 v, 0; setp.ne.u32 q, $3, 0; @q bra DONE; "
            "SPIN: ld.acquire.gpu.global.b32 v, [$1]; setp.lt.s32 p, v, $2; @p bra SPIN; DONE: mov.b32 $0, v; }",
            "=r,l,r,r", [turn + lanes * 0, lanes * 0 + target, lanes], dtype=gl.int32, is_pure=False, pack=1)
        gl.thread_barrier()
        _async_after_generic(1)

    @gluon.jit
    def _pass_turn(turn, PENDING: gl.constexpr):
        """(The dQ writer, ``DET``) Once its bulk reduces but the latest ``PENDING`` (those of the tile after) are
        complete, their writes performed, adds 1 to ``*turn`` (their tile's count): a release at GPU scope by the
        first lane, after the proxy fence and the warp's barrier."""
        _bulk_writes_done(PENDING, 1)
        lanes = gl.arange(0, 32, layout=_WARP_LANES)
        gl.thread_barrier()
        gl.atomic_add(turn + lanes * 0, gl.full([32], 1, gl.int32, _WARP_LANES), mask=lanes == 0, sem="release",
                      scope="gpu")

    @gluon.jit
    def _hand_dq(dq, dq_buf, dq_full, dq_empty, handed):
        """(A key warpgroup, ``DET``) ``dq`` (fp32, scaled) into ``dq_buf`` for the dQ writer, once the writer has
        read what this warpgroup handed it before (``handed``: how many times)."""
        mbarrier.wait(dq_empty, (handed & 1) ^ 1)  # (a fresh barrier passes)
        dq_buf.store(dq)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(dq_full)

    @gluon.jit
    def _dq_writer(dq_smem, dq_full, dq_empty, dq_src, turns, n_q_tiles, Lq, Lk, shift, R, q_row, hk, items: Items,
                   HAS_R: gl.constexpr, D: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, LEAN: gl.constexpr, DQC: gl.constexpr, HOST: gl.constexpr):
        """(``DET``: one warp) Adds the key warpgroups' dQ tiles into the accumulator, each query tile's in a fixed
        order across the sequence's key blocks: the last visiting block first (``masks.key_blocks_after``; a later
        block starts its tiles two tiles earlier, so it reaches a tile first anyway, and the grid starts it first).
        Per tile it waits until ``turns``' count for it (per head and query tile, ``n_q_tiles`` a head) says the blocks
        after this one have added, issues the tile's reduces (lean: each warpgroup's half of the columns, else the
        whole tile from the warpgroup whose turn it was), frees the buffers once read, and raises the count once the
        reduces are complete: under a band (``HAS_R``) at the next tile's, so that one tile's are in flight while it
        waits for the next turn (a later block reaches a tile two tiles earlier anyway); without one at once, since
        every block of a sequence starts at the first tile behind the block after it, and a count raised a tile late
        holds each block a tile behind the next, which adds up along the sequence (bench/NOTES.md, "Deterministic
        calls without a mask": +15-20%).
        (FA3 writes dQ from a warp of its own too; done by the key warpgroups themselves, the waits and the release
        cost 20-26% of the kernel: bench/NOTES.md, "dQ's adds in a fixed order".) ``dq_src``: where dQ's descriptor
        comes from (:func:`common.sequence_descriptor`)."""
        dq_host, dq_ptr, dq_stride = dq_src
        dq_desc = sequence_descriptor(dq_host, dq_ptr, Lq, H, dq_stride, BM, DQC, D, D, HOST)
        n0 = _item(items.n0, 0)
        t_lo = _item(items.t_lo, 0)
        n_tiles = _item(items.n_tiles, 0)
        REDUCES: gl.constexpr = 2 if LEAN else 1
        count = 0
        prev = -1  # the count of the last tile's reduces, raised once they are complete
        for g in range(GROUP):
            h = hk * GROUP + g
            for j in range(n_tiles):
                m0 = t_lo + j * BM
                tile = h * n_q_tiles + m0 // BM
                _wait_turn(turns + tile, key_blocks_after(n0, m0, Lq, Lk, shift, R, HAS_R, BM, BN))
                if LEAN:
                    for w in gl.static_range(2):
                        mbarrier.wait(dq_full.index(w), count & 1)
                        _tma_reduce_add(dq_desc, [q_row + m0, h * D + w * DQC], dq_smem.index(w))
                    tma.store_wait(0)  # (read: the buffers are free)
                    mbarrier.arrive(dq_empty.index(0))
                    mbarrier.arrive(dq_empty.index(1))
                else:
                    w = count % 2
                    mbarrier.wait(dq_full.index(w), (count // 2) & 1)
                    _tma_reduce_add(dq_desc, [q_row + m0, h * D], dq_smem.index(w))
                    tma.store_wait(0)
                    mbarrier.arrive(dq_empty.index(w))
                if not HAS_R:
                    _pass_turn(turns + tile, 0)
                elif prev >= 0:
                    _pass_turn(turns + prev, REDUCES)
                prev = tile  # (set without a band too: where the loop didn't carry it, Triton 3.6's lowering failed)
                count += 1
        if HAS_R and prev >= 0:
            _pass_turn(turns + prev, 0)

    @gluon.jit
    def _raise_flag(flag):
        """(The loader) ``*flag = 1`` by its first thread, a release at GPU scope: what that thread has seen (its
        barrier waits included) is seen by whoever sees the flag."""
        lanes = gl.arange(0, 32, layout=_WARP_LANES)
        gl.atomic_xchg(flag + lanes * 0, gl.full([32], 1, gl.int32, _WARP_LANES), mask=lanes == 0, sem="release",
                       scope="gpu")

    @gluon.jit
    def _wait_flag(flag):
        """(The loader) Waits until ``*flag`` is raised (:func:`_raise_flag`), read by its first thread with
        acquire semantics at GPU scope."""
        lanes = gl.arange(0, 32, layout=_WARP_LANES)
        up = 0
        while up == 0:
            seen = gl.atomic_add(flag + lanes * 0, gl.zeros([32], gl.int32, _WARP_LANES), mask=lanes == 0,
                                 sem="acquire", scope="gpu")
            up = gl.max(gl.where(lanes == 0, seen, 0), axis=0)

    @gluon.jit
    def _tile_stored(stored, c, LEAN: gl.constexpr, WG: gl.constexpr, MORE: gl.constexpr):
        """(DB 3, the first sequence's key warpgroups) Once tile ``c``'s gradient store is complete, says so on
        ``stored`` (a barrier per parity of ``c``, both warpgroups arriving), for the loader to raise the tile's
        flag. ``MORE``: the warpgroup went on to tile ``c + 1``, so the bulk groups after the store's are at most
        one, a dQ reduce (LEAN: every tile; D64: where ``c % 2 == WG``), or at a key block's end its dK and dV stores
        too (then waited as well): the latest may stay pending. Else everything is waited. The store goes out in
        two halves, from lanes of two warps: each issuing thread waits for its own, and the barrier puts both waits
        before the one thread's arrival (which Gluon's ``arrive`` does not sync for)."""
        if MORE and (LEAN or c % 2 == WG):
            _bulk_writes_done(1, 4)
        else:
            _bulk_writes_done(0, 4)
        gl.thread_barrier()
        mbarrier.arrive(stored.index(c % 2))

    @gluon.jit
    def _zero_unseen_tiles(staging_buf, dbias_desc, dbias_b, dbias_h_step, hk, n0, t_lo, n_tiles, Lq,
                           GROUP: gl.constexpr, BM: gl.constexpr, KEYS: gl.constexpr, WG: gl.constexpr,
                           kq_layout: gl.constexpr):
        """(DB 3, the first sequence's key warpgroups, at a block's start) Zeros, by TMA stores from this
        warpgroup's dQ buffer, the gradient's tiles of its keys that no query of the block's band visits (under a
        mask: above the diagonal, past a window): no program writes them otherwise, and the buffer holds no zeros.
        Every sequence visits the same tiles (dense), so none adds there."""
        tma.store_wait(0)  # (the buffer's last bulk operation has read it)
        staging_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, KEYS], gl.float32)
        staging = staging_buf._reinterpret(gl.float32, [BM, KEYS], staging_layout)
        staging.permute((1, 0)).store(gl.zeros([KEYS, BM], gl.float32, layout=kq_layout))
        fence_async_shared()
        gl.thread_barrier()
        box = staging._reinterpret(gl.float32, [1, 1, BM, KEYS], dbias_desc.layout)
        seen_lo = gl.minimum(t_lo, Lq)
        for g in range(GROUP):
            h = hk * GROUP + g
            for m0 in range(0, seen_lo, BM):
                tma.async_copy_shared_to_global(dbias_desc, [dbias_b, h * dbias_h_step, m0, n0 + WG * KEYS], box)
            for m0 in range(t_lo + n_tiles * BM, Lq, BM):
                tma.async_copy_shared_to_global(dbias_desc, [dbias_b, h * dbias_h_step, m0, n0 + WG * KEYS], box)

    @gluon.jit
    def _blocks_taken(items, ITEMS: gl.constexpr):
        """The program's key block count: ``items.taken``, or a constant 1 where it takes one (a loop of one
        iteration then folds away; a tuple's field would be a runtime value)."""
        return items.taken if ITEMS > 1 else 1

    @gluon.jit
    def _item(pair, item):
        """``pair``'s value for the program's key block ``item`` (0 or 1)."""
        return pair[0] + item * (pair[1] - pair[0])

    @gluon.jit
    def _bias_tile(ring, stage, WG: gl.constexpr, KEYS: gl.constexpr, layout: gl.constexpr):
        """This warpgroup's tile of a ring stage's bias (queries x its keys, as loaded; the ring holds two per stage),
        transposed into ``layout`` (the warpgroup's keys x queries products), in float32. Loaded as a matmul's A
        operand, whose registers hold the same elements as the products' (four ``ldmatrix.trans``, where a load in
        ``layout`` took 32 two-byte loads, and from half of a 128-key tile it took them too)."""
        operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
        tile = ring.index(2 * stage + WG).permute((1, 0)).load(operand)
        return gl.convert_layout(tile, layout).to(gl.float32)

    @gluon.jit
    def _plane(host_desc, ptr, sb, sh, sq, b, b_step, h_step, H, Lq, Lk, BM: gl.constexpr, KEYS: gl.constexpr,
               layout: gl.constexpr, HOST: gl.constexpr):
        """(descriptor, batch coordinate) of a bias-shaped (Bb, Hb, Sq, Sk) tensor (the bias, or its gradient) for
        sequence ``b``, boxes of BM queries x KEYS keys: ``host_desc`` (``HOST``: dense calls; made over (Bb, Hb, Sq,
        Sk), its batch coordinate b where ``b_step``), or one made here over the sequence's (1, Hb, Lq, Lk), clipped
        at its last query. Past its last key such boxes were seen to read and write (the GPU tests' jagged batches
        without a mask: dS of keys past Lk reached the gradient), so the kernel zeroes those keys' P itself. ``sb``:
        0 where the tensor broadcasts over sequences; ``sh``: its heads' stride, or any valid one where it
        broadcasts over them (``h_step`` 0)."""
        if HOST:
            return host_desc, b * b_step
        else:
            return tma.make_tensor_descriptor(ptr + b.to(gl.int64) * sb, [1, h_step * (H - 1) + 1, Lq, Lk],
                                              [sh, sh, sq, 1], [1, 1, BM, KEYS], layout), 0

    @gluon.jit
    def _load_tiles(load_src, bias_src, k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring, delta_ring, kv_bar,
                    ready, empty, LSE2, DELTA, total_q, max_q, b, q_start, Lq, Lk, q_row, k_row, hk, bias_h_step, flags,
                    stored, storer, items: Items, ITEMS: gl.constexpr, VARLEN: gl.constexpr, D: gl.constexpr,
                    HEAD_D: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, BIAS: gl.constexpr, DB: gl.constexpr, HOST: gl.constexpr,
                    HOST_BIAS: gl.constexpr):
        """The producer warp: each key block's K and V at once (one buffer each), then the (Q, dO) tiles of
        every head, block after block, through the two-stage ring, each stage refilled once both warpgroups
        released it; with ``BIAS``, each tile's bias (its queries x the block's keys) in the same stage. Each stage
        also takes the tile's lse (log2 units; +inf past ``Lq``, so that P is 0 there) and delta, loaded by this
        warp's threads and stored beside the tiles. (Loaded by the key warpgroups, their latency stood on the tile's
        path, or took registers to hide a tile ahead; bench/NOTES.md, "lse and delta through the ring".) ``q_row``,
        ``k_row``: the sequence's first rows in the descriptors; ``bias_b``, ``bias_h_step``: the bias descriptor's
        batch coordinate and its head coordinate per head (0 where the bias broadcasts); ``ITEMS``: the most key
        blocks a program takes (:func:`_blocks_taken`). With ``DB`` 3 each tile has a flag in ``flags`` (key
        blocks x heads x query tiles): the first sequence's loader (``storer``) raises it once the key
        warpgroups' gradient stores of the tile are complete (``stored``; checked two tiles later, when the stage
        comes back), and the other sequences' loaders load a tile only once its flag is up. ``load_src``,
        ``bias_src``: where the descriptors come from (:func:`common.sequence_descriptor`, :func:`_plane`; ``HOST``,
        ``HOST_BIAS``: made on the host)."""
        QD, dOD, KD, VD, q_ptr, do_ptr, k_ptr, v_ptr, q_stride, do_stride, k_stride, v_stride = load_src
        HKV: gl.constexpr = H // GROUP
        q_desc = sequence_descriptor(QD, q_ptr, Lq, H, q_stride, BM, D, D, HEAD_D, HOST)
        do_desc = sequence_descriptor(dOD, do_ptr, Lq, H, do_stride, BM, D, D, HEAD_D, HOST)
        k_desc = sequence_descriptor(KD, k_ptr, Lk, HKV, k_stride, BN, D, D, HEAD_D, HOST)
        v_desc = sequence_descriptor(VD, v_ptr, Lk, HKV, v_stride, BN, D, D, HEAD_D, HOST)
        dtype: gl.constexpr = k_desc.dtype
        if BIAS:
            BiasD, Bias, bias_sb, bias_sh, bias_sq, bias_b_step = bias_src
            bias_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BM, BN // 2], dtype)
            bias_desc, bias_b = _plane(BiasD, Bias, bias_sb, bias_sh, bias_sq, b, bias_b_step, bias_h_step, H, Lq, Lk,
                                       BM, BN // 2, bias_layout, HOST_BIAS)
        else:
            bias_desc, bias_b = q_desc, 0  # (a placeholder, unused)
        for item in range(_blocks_taken(items, ITEMS)):
            n0 = _item(items.n0, item)
            mbarrier.expect(kv_bar.index(item), 2 * BN * D * dtype.primitive_bitwidth // 8)
            load_head_tile(k_desc, k_row + n0, hk, kv_bar.index(item), k_smem.index(item), D, HEAD_D)
            load_head_tile(v_desc, k_row + n0, hk, kv_bar.index(item), v_smem.index(item), D, HEAD_D)
        tile_bytes: gl.constexpr = (2 * BM * D + (BM * BN if BIAS else 0)) * dtype.primitive_bitwidth // 8
        count = 0
        n_q_tiles = (max_q + BM - 1) // BM
        flag_1 = 0  # (DB 3, the storer) the flags of the last two tiles, raised once their stores are complete
        flag_2 = 0
        for item in range(_blocks_taken(items, ITEMS)):
            n0 = _item(items.n0, item)
            t_lo = _item(items.t_lo, item)
            for g in range(GROUP):
                head_row = lse_offset(b, q_start, hk * GROUP + g, H, total_q, max_q, VARLEN)  # (of lse2 and delta)
                for j in range(_item(items.n_tiles, item)):
                    stage = count % 2
                    if DB == 3:
                        flag = ((n0 // BN) * H + hk * GROUP + g) * n_q_tiles + (t_lo + j * BM) // BM
                        if storer:
                            if count >= 2:
                                mbarrier.wait(stored.index(stage), ((count - 2) // 2) & 1)
                                _raise_flag(flags + flag_2)
                            flag_2 = flag_1
                            flag_1 = flag
                        else:
                            _wait_flag(flags + flag)
                    mbarrier.wait(empty.index(stage), ((count // 2) & 1) ^ 1)  # (a fresh barrier passes)
                    mbarrier.expect(ready.index(stage), tile_bytes)
                    row = q_row + t_lo + j * BM
                    load_head_tile(q_desc, row, hk * GROUP + g, ready.index(stage), q_ring.index(stage), D, HEAD_D)
                    load_head_tile(do_desc, row, hk * GROUP + g, ready.index(stage), do_ring.index(stage), D,
                                   HEAD_D)
                    if BIAS:  # (the bias's rows and columns are the sequence's own query and key positions)
                        # Each warpgroup's half of the keys in a tile of its own, as the descriptor's 4-D box (the
                        # same bytes, its two leading dims of 1).
                        for half in gl.static_range(2):
                            box = bias_ring.index(2 * stage + half)._reinterpret(dtype, [1, 1, BM, BN // 2],
                                                                                 bias_desc.layout)
                            tma.async_copy_global_to_shared(bias_desc, [bias_b, (hk * GROUP + g) * bias_h_step,
                                                                        t_lo + j * BM, n0 + half * (BN // 2)],
                                                            ready.index(stage), box)
                    # (The stage's second arrival: its lse and delta stored, by every thread of the warp.)
                    lse2_ring.index(stage).store(query_vector(LSE2 + head_row, t_lo + j * BM, Lq, float("inf"), BM))
                    delta_ring.index(stage).store(query_vector(DELTA + head_row, t_lo + j * BM, Lq, 0.0, BM))
                    gl.thread_barrier()
                    mbarrier.arrive(ready.index(stage))
                    count += 1
        if DB == 3 and storer:  # (the storer's last two tiles)
            if count >= 2:
                mbarrier.wait(stored.index(count % 2), ((count - 2) // 2) & 1)
                _raise_flag(flags + flag_2)
            if count >= 1:
                mbarrier.wait(stored.index((count - 1) % 2), ((count - 1) // 2) & 1)
                _raise_flag(flags + flag_1)

    @gluon.jit
    def _key_warpgroup(k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring, delta_ring, ds_smem, dq_smem, kv_bar,
                       ready, empty, ds_ready, ds_free, store_src, dbias_src, dbias_h_step, stored, storer, dq_full,
                       dq_empty, b, Lq, Lk, shift, WL, R, q_row, k_row, hk, items: Items, scale, qk_scale, seed,
                       offset_lo, threshold, keep_scale, ITEMS: gl.constexpr, HAS_R: gl.constexpr,
                       HAS_WL: gl.constexpr, DROPOUT: gl.constexpr, BIAS: gl.constexpr, DB: gl.constexpr,
                       D: gl.constexpr, HEAD_D: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, BM: gl.constexpr,
                       LEAN: gl.constexpr, DQC: gl.constexpr, DET: gl.constexpr, HOST: gl.constexpr,
                       HOST_BIAS: gl.constexpr, WG: gl.constexpr):
        """One consumer warpgroup: keys ``n0 + 64 WG ..`` (+64) of each of the program's key blocks (``items``),
        over every query tile of every head of the group: dK and dV in registers; dQ over the block's 128 keys
        added by TMA reduces: all of it every other tile, or (LEAN) half its columns every tile. Tiles in
        ``[u_lo, u_hi)`` lie wholly inside the band. Each ring stage holds the tile's Q, dO, lse (log2 units, +inf
        past the sequence's last query) and delta. ``q_row``, ``k_row``: the sequence's first rows in the
        descriptors. The ring's, dSᵀ's and dQ's buffers and barriers take turns across the blocks as within one
        (``count``). With ``BIAS`` the scores take the ring stage's bias tile, and with ``DB`` each tile's dS (the
        bias's gradient) goes out through ``dbias_desc``: staged (transposed: queries x keys) in this warpgroup's dQ
        buffer, then stored by TMA (1: a full-shape bias, of its dtype) or added by a TMA reduce (2: float32, a bias
        broadcast over sequences or heads; 3: the same, stored by the first sequence, ``storer``, which also zeroes
        the tiles no query sees, and added by the others once the loader saw the tile's flag: ``_tile_stored``),
        at batch coordinate ``dbias_b`` and head ``h dbias_h_step``. (Written by
        the threads themselves, read back from dSᵀ's shared tile into 16-byte stores or float32 reductions, it
        took the D128 backward to 205 TFLOP/s from 440 without a gradient, H100: the reductions held the memory
        pipe the few spilled registers reload through; bench/NOTES.md.)
        ``DET`` (deterministic mode): the warpgroup hands each dQ tile to the dQ writer (:func:`_dq_writer`) through
        its dQ buffer (``dq_full`` / ``dq_empty``, this warpgroup's), which adds the tiles in a fixed order.
        ``store_src``, ``dbias_src``: where the descriptors of dQ, dK, dV and the bias's gradient come from
        (:func:`common.sequence_descriptor`, :func:`_plane`; ``HOST``, ``HOST_BIAS``: made on the host)."""
        dtype: gl.constexpr = k_smem.dtype
        KEYS: gl.constexpr = 64
        dQD, dKD, dVD, dq_ptr, dk_ptr, dv_ptr, dq_stride, dk_stride, dv_stride = store_src
        HKV: gl.constexpr = H // GROUP
        dq_desc = sequence_descriptor(dQD, dq_ptr, Lq, H, dq_stride, BM, DQC, D, D, HOST)
        dk_desc = sequence_descriptor(dKD, dk_ptr, Lk, HKV, dk_stride, KEYS, D, D, HEAD_D, HOST)
        dv_desc = sequence_descriptor(dVD, dv_ptr, Lk, HKV, dv_stride, KEYS, D, D, HEAD_D, HOST)
        if DB != 0:
            dBiasD, dBias, dbias_sb, dbias_sh, dbias_sq, dbias_b_step = dbias_src
            dbias_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BM, KEYS],
                                                                              dBias.dtype.element_ty)
            dbias_desc, dbias_b = _plane(dBiasD, dBias, dbias_sb, dbias_sh, dbias_sq, b, dbias_b_step, dbias_h_step, H,
                                         Lq, Lk, BM, KEYS, dbias_layout, HOST_BIAS)
        else:
            dbias_desc, dbias_b = dq_desc, 0  # (a placeholder, unused)
        kq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BM, 16])
        kd_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQC, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kd_layout, k_width=2)
        gl.static_assert(DB == 0 or not DROPOUT, "no bias gradient beside dropout (supports)")
        staging_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, KEYS], dbias_desc.dtype)
        inv_qk_scale = 1.0 / qk_scale
        inv_scale = 1.0 / scale  # (a bias in units of S, the lean products' start: supports() takes no zero scale)
        # With dropout the tile's dS is made times 2 / keep_scale (below), which dK and dQ take back at their ends.
        if DROPOUT:
            twice_inv_keep = 2.0 / keep_scale
            dq_scale = scale * keep_scale * 0.5
        else:
            dq_scale = scale
        count = 0
        gl.static_assert(not DET or (ITEMS == 1 and DB == 0 and not HAS_WL),
                         "deterministic: one key block, no bias gradient, no left window (supports)")
        q_axis: gl.constexpr = gl.SliceLayout(0, kq_layout)
        for item in range(_blocks_taken(items, ITEMS)):
            n0 = _item(items.n0, item)
            t_lo = _item(items.t_lo, item)
            n_tiles = _item(items.n_tiles, item)
            u_lo = _item(items.u_lo, item)
            u_hi = _item(items.u_hi, item)
            if DB == 3 and storer:
                _zero_unseen_tiles(dq_smem.index(WG), dbias_desc, dbias_b, dbias_h_step, hk, n0, t_lo, n_tiles, Lq,
                                   GROUP, BM, KEYS, WG, kq_layout)
            k_w = k_smem.index(item).slice(WG * KEYS, KEYS)
            v_w = v_smem.index(item).slice(WG * KEYS, KEYS)
            keys = n0 + WG * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kq_layout))
            dk = gl.zeros([KEYS, D], gl.float32, layout=kd_layout)
            dv = gl.zeros([KEYS, D], gl.float32, layout=kd_layout)
            # Zeros the compiler can't fold (x * 0 is NaN for an infinite x): with them each row of a product's
            # starting value is a value of its own. Equal values would become register copies made after the
            # products' fence, and ptxas then waits for the product in flight before the next one.
            row_zeros = keys.to(gl.float32) * 0.0
            if LEAN and not BIAS:
                # Sᵀ's start (in units of S, before -lse): -inf for keys past the sequence's end, whose P is then 0
                # with no work in the tile loop (+inf where the scale is negative; supports() takes no zero scale).
                row_start = gl.where(keys < Lk, row_zeros, float("-inf") * qk_scale)
            mbarrier.wait(kv_bar.index(item), 0)
            for g in range(GROUP):
                h = hk * GROUP + g
                for j in range(n_tiles):
                    stage = count % 2
                    m0 = t_lo + j * BM
                    if DROPOUT:  # (drawn before the products are issued: drawing while they run spills at D128)
                        words = keep_words(seed, offset_lo, threshold, b * H + h, m0, n0 + WG * KEYS, LEAN)
                    mbarrier.wait(ready.index(stage), (count // 2) & 1)
                    if LEAN:
                        # The products start from -lse (in units of S) and -delta, so that P = exp2(qk_scale Sᵀ) and
                        # dS = P dPᵀ hold no lse or delta registers beside them (16 each per thread), the margin that
                        # keeps the D128 tile from spilling.
                        lse = lse2_ring.index(stage).load(q_axis) * inv_qk_scale
                        if BIAS:  # (the start holds the bias: -lse + bias / scale, in units of S)
                            st = _bias_tile(bias_ring, stage, WG, KEYS, kq_layout) * inv_scale - lse[None, :]
                        else:
                            st = row_start[:, None] - lse[None, :]
                        if not DROPOUT:  # (with dropout, dS needs dP itself: see below)
                            dpt = row_zeros[:, None] - delta_ring.index(stage).load(q_axis)[None, :]
                        q_tile = q_ring.index(stage)
                        do_tile = do_ring.index(stage)
                        st = warpgroup_mma(k_w, q_tile.permute((1, 0)), st, is_async=True)
                        if DROPOUT:
                            dpt = warpgroup_mma(v_w, do_tile.permute((1, 0)),
                                                gl.zeros([KEYS, BM], gl.float32, layout=kq_layout), use_acc=False,
                                                is_async=True)
                        else:
                            dpt = warpgroup_mma(v_w, do_tile.permute((1, 0)), dpt, is_async=True)
                        if DB == 3 and storer and count > 0:  # (the last tile's store, while these products run)
                            _tile_stored(stored, count - 1, LEAN, WG, True)
                        st = warpgroup_mma_wait(1, deps=(st,))
                        pt = gl.exp2(st * qk_scale)
                    else:
                        # (At D64 lse is read once the products are issued: nothing of it is live across them.)
                        q_tile = q_ring.index(stage)
                        do_tile = do_ring.index(stage)
                        # (Accumulators made at their use: zeros kept across the loop would hold registers.)
                        st = warpgroup_mma(k_w, q_tile.permute((1, 0)),
                                           gl.zeros([KEYS, BM], gl.float32, layout=kq_layout), use_acc=False,
                                           is_async=True)
                        dpt = warpgroup_mma(v_w, do_tile.permute((1, 0)),
                                            gl.zeros([KEYS, BM], gl.float32, layout=kq_layout), use_acc=False,
                                            is_async=True)
                        if DB == 3 and storer and count > 0:  # (the last tile's store, while these products run)
                            _tile_stored(stored, count - 1, LEAN, WG, True)
                        lse2 = lse2_ring.index(stage).load(q_axis)
                        if BIAS:  # (log2 units: bias log2(e) - lse2)
                            offset2 = _bias_tile(bias_ring, stage, WG, KEYS, kq_layout) * LOG2E - lse2[None, :]
                            st = warpgroup_mma_wait(1, deps=(st,))
                            pt = gl.exp2(st * qk_scale + offset2)
                        else:
                            st = warpgroup_mma_wait(1, deps=(st,))
                            pt = gl.exp2(st * qk_scale - lse2[None, :])
                    if (HAS_R or HAS_WL) and ((m0 < u_lo) | (m0 >= u_hi)):  # (tiles in [u_lo, u_hi) see every key)
                        queries = m0 + gl.arange(0, BM, layout=q_axis)  # (not kept live)
                        ok = in_band(keys[:, None] < Lk, queries[None, :], keys[:, None], shift, WL, R, HAS_R, HAS_WL)
                        pt = gl.where(ok, pt, 0.0)
                    if not (HAS_R or HAS_WL) and (BIAS or not LEAN) and (n0 + WG * KEYS + KEYS > Lk):
                        # Keys past the sequence's: zero rows of K, whose score 0 gives P = exp(-lse). Where the lse
                        # lies far below 0, their dS overflows its 16-bit form (fp16: an lse below about -11), and
                        # dS times their zero row of K made NaN in dQ (stop 59's GPU fuzz). With a bias
                        # (_plane): their bias (a jagged bias may hold anything there, NaN included) must not count,
                        # and their dS, written through the gradient's box into the row's rest (its keys a multiple
                        # of 8: bias_aligned), must be 0. (Masked calls zero them above; the lean form without a
                        # bias starts their products at -inf: row_start, free where this branch in its tile loop
                        # cost 1-3.5% on jagged D128 and D96 rows, H200.)
                        pt = gl.where(keys[:, None] < Lk, pt, 0.0)
                    if DROPOUT:
                        # Pᵀ carries the keep bit in its sign (P >= 0: -P where dropped); dV takes the kept P (the keep
                        # scale joins dV at the end).
                        pt = (pt.to(gl.uint32, bitcast=True) | dropped_signs(words, kq_layout)).to(gl.float32,
                                                                                                  bitcast=True)
                        pv = relu_low(pt, dtype)
                    else:
                        pv = pt.to(dtype)
                    dv = warpgroup_mma(gl.convert_layout(pv, a_layout), do_tile, dv, is_async=True)
                    if LEAN and not DROPOUT:
                        dpt = warpgroup_mma_wait(1, deps=(dpt,))
                        ds = pt * dpt
                        ds_low = ds.to(dtype)
                    else:
                        delta = delta_ring.index(stage).load(q_axis)
                        dpt = warpgroup_mma_wait(1, deps=(dpt,))
                        if DROPOUT:
                            # dS = P (keep_scale dP - delta) where kept, -P delta where dropped; times 2 / keep_scale,
                            # (Pᵀ + |Pᵀ|) dP - |Pᵀ| 2 delta / keep_scale: three operations per element, no select, and
                            # the kept P (pv) not held until here. (The factor moves dS's range in the low precision by
                            # 2 / keep_scale, 2 (1 - p): within fp16's and bf16's, the tests' p = 0.9 included.)
                            twice_delta = delta * twice_inv_keep
                            ds_low = ((pt + gl.abs(pt)) * dpt - gl.abs(pt) * twice_delta[None, :]).to(dtype)
                        else:
                            ds = pt * (dpt - delta[None, :])
                            ds_low = ds.to(dtype)
                    dk = warpgroup_mma(gl.convert_layout(ds_low, a_layout), q_tile, dk, is_async=True)
                    if DB != 0:
                        # The bias gradient's tile (queries x these keys) in this warpgroup's dQ buffer, once the
                        # last bulk operation from there has read it; sent after the fence below.
                        tma.store_wait(0)
                        staging = dq_smem.index(WG)._reinterpret(dbias_desc.dtype, [BM, KEYS], staging_layout)
                        if DB == 1:
                            staging.permute((1, 0)).store(ds_low)
                        else:
                            staging.permute((1, 0)).store(ds)
                    # dSᵀ of these keys into this tile's half of the shared buffer, once the dQ of the tile that
                    # used the buffer before has read it.
                    buf = count % 2
                    ds_tile = ds_smem.index(buf)
                    mbarrier.wait(ds_free.index(buf), ((count // 2) & 1) ^ 1)  # (a fresh barrier passes)
                    ds_tile.slice(WG * KEYS, KEYS).store(ds_low)
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(ds_ready.index(buf))
                    if DB != 0:
                        box = staging._reinterpret(dbias_desc.dtype, [1, 1, BM, KEYS], dbias_desc.layout)
                        coord = [dbias_b, h * dbias_h_step, m0, n0 + WG * KEYS]
                        if DB == 1:
                            tma.async_copy_shared_to_global(dbias_desc, coord, box)
                        elif DB == 2:
                            _tma_reduce_add(dbias_desc, coord, box)
                        else:
                            # The first sequence's program stores the tile (the buffer holds no zeros); the others add
                            # once its flag says the store is complete.
                            if storer:
                                tma.async_copy_shared_to_global(dbias_desc, coord, box)
                            else:  # (the loader made the tile ready once the store was complete)
                                _async_after_generic(4)
                                _tma_reduce_add(dbias_desc, coord, box)
                    if LEAN:
                        # Every tile, both warpgroups: this warpgroup's DQC columns of the tile's dQ over all the
                        # block's keys, issued before dK and dV are waited: 32 accumulator registers, where a whole
                        # 64x128 dQ every other tile takes 64.
                        mbarrier.wait(ds_ready.index(buf), (count // 2) & 1)
                        dq = warpgroup_mma(ds_tile.permute((1, 0)), k_smem.index(item).slice(WG * DQC, DQC, dim=1),
                                           gl.zeros([BM, DQC], gl.float32, layout=dq_layout), use_acc=False,
                                           is_async=True)
                        dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq))
                        # (Every thread read the stage's lse and delta before dSᵀ's barrier above: this one thread's
                        # release may free it.)
                        mbarrier.arrive(empty.index(stage))
                        mbarrier.arrive(ds_free.index(buf))
                        if DET:  # (the dQ writer adds it, in its turn)
                            _hand_dq(dq * dq_scale, dq_smem.index(WG), dq_full.index(WG), dq_empty.index(WG), count)
                        else:
                            tma.store_wait(0)  # this warpgroup's last reduce has read dq_smem
                            gl.thread_barrier()
                            _add_dq(dq * dq_scale, dq_smem.index(WG), dq_desc, q_row + m0, h * D + WG * DQC)
                    else:
                        # Done with the stage (release it). (Waited here, not under the branch below: a branch can't
                        # turn the asynchronous accumulators into plain tensors.)
                        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
                        mbarrier.arrive(empty.index(stage))  # (lse and delta were read before dSᵀ's barrier)
                        if count % 2 == WG:
                            # This warpgroup's turn: the tile's dQ over all the block's keys (both halves of dSᵀ).
                            # One reduce of the block's dQ per tile, where each warpgroup adding its own keys' part
                            # made two.
                            mbarrier.wait(ds_ready.index(buf), (count // 2) & 1)
                            tma.store_wait(0)  # this warpgroup's last reduce has read dq_smem
                            gl.thread_barrier()
                            dq = warpgroup_mma(ds_tile.permute((1, 0)), k_smem.index(item),
                                               gl.zeros([BM, DQC], gl.float32, layout=dq_layout), use_acc=False,
                                               is_async=True)
                            dq = warpgroup_mma_wait(0, deps=(dq,))
                            mbarrier.arrive(ds_free.index(buf))
                            if DET:  # (the dQ writer adds it, in its turn)
                                _hand_dq(dq * dq_scale, dq_smem.index(WG), dq_full.index(WG), dq_empty.index(WG),
                                         count // 2)
                            else:
                                _add_dq(dq * dq_scale, dq_smem.index(WG), dq_desc, q_row + m0, h * D)
                    count += 1
            # dK, dV through this warpgroup's rows of K and V in shared memory, clipped at Lk, once no reader is left:
            # the dQ of the last two tiles (taking turns: one per warpgroup; LEAN: both) reads all of K.
            if count > 0:
                mbarrier.wait(ds_free.index((count - 1) % 2), ((count - 1) // 2) & 1)
            if count > 1:
                mbarrier.wait(ds_free.index(count % 2), ((count - 2) // 2) & 1)
            tma.store_wait(0)
            k_w.store((dk * dq_scale).to(dtype))
            if DROPOUT:
                dv = dv * keep_scale
            v_w.store(dv.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            store_head_tile(dk_desc, k_row + n0 + WG * KEYS, hk, k_smem.index(item), WG * KEYS, D, HEAD_D)
            store_head_tile(dv_desc, k_row + n0 + WG * KEYS, hk, v_smem.index(item), WG * KEYS, D, HEAD_D)
        # (A block's K and V buffer is not used again: the next block's dQ reduces wait for these stores where they
        # wait for their own staging buffer, and the program waits here before it ends.)
        tma.store_wait(0)
        if DB == 3 and storer and count > 0:  # (the last tile's gradient store)
            _tile_stored(stored, count - 1, LEAN, WG, False)

    @fast_launch
    @gluon.jit(do_not_specialize=[*common.DATA_DEPENDENT, *BIAS_STRIDES])
    def _bwd_kv_hopper(Q: Rows, K: Rows, V: Rows, dO: Rows, dQ: Rows, dK: Rows, dV: Rows, LSE2, DELTA,
                       seqs: Seqs, total_q, total_k, max_q, max_k, ORDER, mask: Mask, scale, qk_scale,
                       dropout: Dropout, seed, offset_lo, QD, dOD, dQD, KD, VD, dKD, dVD, Bias, bias_sb, bias_sh,
                       bias_sq, bias_b_step, bias_h_step, BiasD, dBias, dbias_sb, dbias_sh, dbias_sq,
                       dbias_b_step, dbias_h_step, dBiasD, Flags, Turns,
                       F: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr,
                       GROUP: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, LEAN: gl.constexpr, DQC: gl.constexpr,
                       GRID: gl.constexpr, HOST_DESCS: gl.constexpr, PAIRS: gl.constexpr,
                       HOST_BIAS: gl.constexpr, DB: gl.constexpr, DET: gl.constexpr):
        """Grid ``(cdiv(max_k, BN), Hkv, B)``, or another order of :func:`program.key_block_grid` (``GRID``),
        its blocks axis halved (rounded up) with ``PAIRS``; tensors as
        ``triton.backward._bwd_kv_kernel``'s (dQ: the fp32 accumulator, head dim D), each with its heads packed in a
        row (stride_h = HEAD_D, the tensors' head dim: D, the tiles', or less, ``common.head_descriptor``; dQ's
        accumulator has D columns a head, ``triton.launch.head_block``).
        ``scale``: the softmax scale;
        ``qk_scale``: it times log2(e); ``dropout``, ``seed``, ``offset_lo``: as ``triton.scores.dropout_args``
        gives them (used where ``F.DROPOUT``). LEAN: for D128, where registers are short (see ``_key_warpgroup``); DQC:
        dQ columns per product and reduce (:func:`dq_columns`).
        HOST_DESCS: ``QD``...``dVD`` are the descriptors of q, dO, dQ, K, V, dK and dV, made on the host
        (:func:`host_descriptors`; top-level arguments: Triton 3.6's launcher encodes no descriptor inside a
        tuple); otherwise (all None) each program makes its sequence's.
        PAIRS (:func:`pairs`; not LEAN: shared memory): the blocks axis counts pairs of key blocks; program ``p``
        takes blocks ``p`` and ``n - 1 - p`` of its sequence's ``n`` (one where they meet): under a causal mask
        every pair holds the same work. Each block has its own K and V buffer, loaded at the start.
        Bias (``F.HAS_BIAS``; :func:`plane_arguments`): the (Bb, Hb, Sq, Sk) tensor at ``Bias`` with strides
        ``bias_sb`` (0 where it broadcasts over sequences), ``bias_sh`` (its heads' stride, or any valid one where
        it broadcasts over them) and ``bias_sq``, read through ``BiasD``, a 4-D descriptor made on the host
        (``HOST_BIAS``: dense calls), or else one each program makes over its sequence's (1, Hb, Lq, Lk)
        (:func:`_plane`); ``bias_b_step``, ``bias_h_step``: 1 on the batch and head dims where the
        bias doesn't broadcast over them. ``DB``: its gradient, none (0), stored (1) or added in float32 (2) into
        ``dBias`` (of the bias's shape), its arguments ``dbias_*`` and ``dBiasD`` as the bias's; or (3: dense calls,
        a bias broadcast over sequences only, :func:`stores_first`) stored in float32 by the first sequence's
        programs (zeros where no query of a block sees it) and added by the others', each add after the store of
        its tile (``Flags``: one zeroed int32 per tile, raised once the store is complete), so that ``dBias`` needs
        no zeros and no add reads them from DRAM. (Its adds wait for programs that the grid orders before theirs,
        the first sequence's of the same key block and head, as FA3's deterministic backward relies on block order.)
        ``DET`` (deterministic mode; one key block a program, no bias gradient, the grid's blocks reversed): dQ's
        reduces into each query tile in a fixed order, the last visiting key block first, by a one-warp dQ writer
        (:func:`_dq_writer`), counted in ``Turns``: a zeroed int32 per (sequence, head, query tile of BM),
        :func:`turn_counts`.
        Partitions: the default one and a worker are the two key warpgroups, a one-warp worker loads, and with ``DET``
        another writes dQ."""
        dtype: gl.constexpr = Q.ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dtype)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], dtype)
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, DQC], gl.float32)
        # A bias tile in the ring (one warpgroup's keys).
        bias_tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN // 2], dtype)

        gl.static_assert(not (PAIRS and LEAN), "pairs of key blocks: D64 only (two K and V buffers)")
        bt = batch(seqs, total_q, total_k, max_q, max_k)
        # (DET: a sequence's key blocks last first, each after the ones it waits for: blocks first, reversed.)
        gl.static_assert(not DET or GRID == 0, "deterministic: the (blocks, kv heads, B) grid")
        block, hk, seq, m = prologue(bt, mask, ORDER, F, DET, F.VARLEN, GRID, HKV)
        if PAIRS:
            n_blocks = (seq.Lk + BN - 1) // BN
            if 2 * block >= n_blocks:
                return
            ITEMS: gl.constexpr = 2
            n_items = 1 + (2 * block + 1 < n_blocks).to(gl.int32)
            n0_first = block * BN
            n0_second = (n_blocks - 1 - block) * BN
        else:
            ITEMS: gl.constexpr = 1
            n_items = 1
            n0_first = block * BN
            n0_second = n0_first
            if n0_first >= seq.Lk:
                return
        # Where each partition makes its descriptors from (common.sequence_descriptor, _plane). (Placeholders for what a
        # call doesn't have: a partition's argument can't be None.)
        if HOST_DESCS:
            # Over all B x S rows; no tile crosses a sequence (host_descriptors).
            load_src = (QD, dOD, KD, VD, Q.ptr, dO.ptr, K.ptr, V.ptr, Q.stride_s, dO.stride_s, K.stride_s, V.stride_s)
            store_src = (dQD, dKD, dVD, dQ.ptr, dK.ptr, dV.ptr, dQ.stride_s, dK.stride_s, dV.stride_s)
            q_row = seq.b * max_q
            k_row = seq.b * max_k
        else:
            # One descriptor per tensor and sequence, over its rows x heads (common.head_descriptor): boxes clip at
            # the sequence's end. (dQ's accumulator has heads of D columns whatever HEAD_D: triton.backward's
            # head_block.)
            q_ptr = base(Q, seq.b, seq.q_start, 0)
            k_ptr = base(K, seq.b, seq.k_start, 0)
            load_src = (q_ptr, q_ptr, q_ptr, q_ptr, q_ptr, base(dO, seq.b, seq.q_start, 0), k_ptr,
                        base(V, seq.b, seq.k_start, 0), Q.stride_s, dO.stride_s, K.stride_s, V.stride_s)
            store_src = (q_ptr, q_ptr, q_ptr, base(dQ, seq.b, seq.q_start, 0), base(dK, seq.b, seq.k_start, 0),
                         base(dV, seq.b, seq.k_start, 0), dQ.stride_s, dK.stride_s, dV.stride_s)
            q_row = 0
            k_row = 0
        bias_src = (Q.ptr, )
        dbias_src = (Q.ptr, )
        if F.HAS_BIAS:
            if HOST_BIAS:
                bias_src = (BiasD, Bias, bias_sb, bias_sh, bias_sq, bias_b_step)
            else:
                bias_src = (Bias, Bias, bias_sb, bias_sh, bias_sq, bias_b_step)
        if DB != 0:
            if HOST_BIAS:
                dbias_src = (dBiasD, dBias, dbias_sb, dbias_sh, dbias_sq, dbias_b_step)
            else:
                dbias_src = (dBias, dBias, dbias_sb, dbias_sh, dbias_sq, dbias_b_step)
        # (DB 3) The first sequence's programs store the gradient, the others add (each tile once its flag is up).
        storer = seq.b == 0

        k_smem = gl.allocate_shared_memory(dtype, [ITEMS, BN, D], k_layout)
        v_smem = gl.allocate_shared_memory(dtype, [ITEMS, BN, D], k_layout)
        q_ring = gl.allocate_shared_memory(dtype, [2, BM, D], q_layout)
        do_ring = gl.allocate_shared_memory(dtype, [2, BM, D], q_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BN, BM], ds_layout)  # dSᵀ of a tile, double-buffered
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, DQC], dq_layout)  # one per warpgroup
        # The ring's bias tiles (queries x the block's keys), or a placeholder never read.
        bias_ring = gl.allocate_shared_memory(dtype, [4, BM, BN // 2], bias_tile_layout) if F.HAS_BIAS else q_ring
        # The ring's lse and delta (one tile's queries each).
        vector_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse2_ring = gl.allocate_shared_memory(gl.float32, [2, BM], vector_layout)
        delta_ring = gl.allocate_shared_memory(gl.float32, [2, BM], vector_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [ITEMS, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        stored = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # (DB 3) per tile parity
        # (DET) Each warpgroup's dQ buffer handed to the dQ writer, and given back once read (placeholders else).
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()) if DET else stored
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()) if DET else stored
        for i in gl.static_range(ITEMS):
            mbarrier.init(kv_bar.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=2)  # the tiles' bytes with one arrival; lse and delta stored
            mbarrier.init(empty.index(i), count=2)  # one arrival per key warpgroup
            mbarrier.init(ds_ready.index(i), count=2)  # both halves of dSᵀ written
            mbarrier.init(ds_free.index(i), count=2 if LEAN else 1)  # read by each dQ computing warpgroup
            mbarrier.init(stored.index(i), count=2)  # both warpgroups' gradient stores of a tile complete
            if DET:
                mbarrier.init(dq_full.index(i), count=1)
                mbarrier.init(dq_empty.index(i), count=1)

        # (DET) This sequence's counts of the reduces into each (head, query tile).
        n_q_tiles = (max_q + BM - 1) // BM
        turns = Turns + seq.b.to(gl.int64) * (H * n_q_tiles)
        # The query tiles that see each key block; the band, if any, is applied on those outside [u_lo, u_hi).
        first = query_stages(n0_first, seq.Lq, seq.Lk, m, F, BM, BN)
        second = query_stages(n0_second, seq.Lq, seq.Lk, m, F, BM, BN) if PAIRS else first
        items = Items(n_items, (n0_first, n0_second), (first[0], second[0]),
                      ((first[3] - first[0] + BM - 1) // BM, (second[3] - second[0] + BM - 1) // BM),
                      (first[1], second[1]), (first[2], second[2]))
        # (The argument tuples are written out, in two calls, with the dQ writer and without: a tuple assigned to a
        # variable would turn its constexprs into tensors.)
        if DET:
            gl.warp_specialize([
                (_key_warpgroup, (k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring, delta_ring, ds_smem,
                                  dq_smem, kv_bar, ready, empty, ds_ready, ds_free, store_src, dbias_src,
                                  dbias_h_step, stored, storer, dq_full, dq_empty, seq.b, seq.Lq, seq.Lk, m.shift,
                                  m.WL, m.R, q_row, k_row, hk, items, scale, qk_scale, seed, offset_lo,
                                  dropout.threshold, dropout.keep_scale, ITEMS, F.HAS_R, F.HAS_WL, F.DROPOUT,
                                  F.HAS_BIAS, DB, D, HEAD_D, H, GROUP, BM, LEAN, DQC, DET, HOST_DESCS, HOST_BIAS, 0)),
                (_key_warpgroup, (k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring, delta_ring, ds_smem,
                                  dq_smem, kv_bar, ready, empty, ds_ready, ds_free, store_src, dbias_src,
                                  dbias_h_step, stored, storer, dq_full, dq_empty, seq.b, seq.Lq, seq.Lk, m.shift,
                                  m.WL, m.R, q_row, k_row, hk, items, scale, qk_scale, seed, offset_lo,
                                  dropout.threshold, dropout.keep_scale, ITEMS, F.HAS_R, F.HAS_WL, F.DROPOUT,
                                  F.HAS_BIAS, DB, D, HEAD_D, H, GROUP, BM, LEAN, DQC, DET, HOST_DESCS, HOST_BIAS, 1)),
                (_load_tiles, (load_src, bias_src, k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring,
                               delta_ring, kv_bar, ready, empty, LSE2, DELTA, total_q, max_q, seq.b, seq.q_start,
                               seq.Lq, seq.Lk, q_row, k_row, hk, bias_h_step, Flags, stored, storer, items, ITEMS,
                               F.VARLEN, D, HEAD_D, H, GROUP, BM, BN, F.HAS_BIAS, DB, HOST_DESCS, HOST_BIAS)),
                # (its own warp: the waits for each tile's turn and the releases stay off the key warpgroups'
                # path)
                (_dq_writer, (dq_smem, dq_full, dq_empty, (store_src[0], store_src[3], store_src[6]), turns,
                              n_q_tiles, seq.Lq, seq.Lk, m.shift, m.R, q_row, hk, items, F.HAS_R, D, H, GROUP, BM,
                              BN, LEAN, DQC, HOST_DESCS)),
            ], [4, 1, 1], [common.CONSUMER_REGS, common.LOADER_REGS, common.LOADER_REGS])
        else:
            gl.warp_specialize([
                (_key_warpgroup, (k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring, delta_ring, ds_smem,
                                  dq_smem, kv_bar, ready, empty, ds_ready, ds_free, store_src, dbias_src,
                                  dbias_h_step, stored, storer, dq_full, dq_empty, seq.b, seq.Lq, seq.Lk, m.shift,
                                  m.WL, m.R, q_row, k_row, hk, items, scale, qk_scale, seed, offset_lo,
                                  dropout.threshold, dropout.keep_scale, ITEMS, F.HAS_R, F.HAS_WL, F.DROPOUT,
                                  F.HAS_BIAS, DB, D, HEAD_D, H, GROUP, BM, LEAN, DQC, DET, HOST_DESCS, HOST_BIAS, 0)),
                (_key_warpgroup, (k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring, delta_ring, ds_smem,
                                  dq_smem, kv_bar, ready, empty, ds_ready, ds_free, store_src, dbias_src,
                                  dbias_h_step, stored, storer, dq_full, dq_empty, seq.b, seq.Lq, seq.Lk, m.shift,
                                  m.WL, m.R, q_row, k_row, hk, items, scale, qk_scale, seed, offset_lo,
                                  dropout.threshold, dropout.keep_scale, ITEMS, F.HAS_R, F.HAS_WL, F.DROPOUT,
                                  F.HAS_BIAS, DB, D, HEAD_D, H, GROUP, BM, LEAN, DQC, DET, HOST_DESCS, HOST_BIAS, 1)),
                (_load_tiles, (load_src, bias_src, k_smem, v_smem, q_ring, do_ring, bias_ring, lse2_ring,
                               delta_ring, kv_bar, ready, empty, LSE2, DELTA, total_q, max_q, seq.b, seq.q_start,
                               seq.Lq, seq.Lk, q_row, k_row, hk, bias_h_step, Flags, stored, storer, items, ITEMS,
                               F.VARLEN, D, HEAD_D, H, GROUP, BM, BN, F.HAS_BIAS, DB, HOST_DESCS, HOST_BIAS)),
            ], [4, 1], [common.CONSUMER_REGS, common.LOADER_REGS])
        for i in gl.static_range(ITEMS):
            mbarrier.invalidate(kv_bar.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
            mbarrier.invalidate(ds_ready.index(i))
            mbarrier.invalidate(ds_free.index(i))
            mbarrier.invalidate(stored.index(i))
            if DET:
                mbarrier.invalidate(dq_full.index(i))
                mbarrier.invalidate(dq_empty.index(i))


def supports(problem, opts, dtype, bias, alibi, seed) -> bool:
    """Whether the kernel computes this call (whatever the machine): a :func:`common.plain_call` (fp16/bf16,
    D = Dv with a ``common.tile_head_dim``, no score modifier or special mask; dropout allowed), in the lean form
    (:func:`lean`) with a nonzero scale; or the same with an additive bias (:func:`takes_bias`) and no dropout.
    Deterministic calls too (``DET``: each query tile's dQ reduces in a fixed key block order, :func:`_dq_writer`)
    without a mask or under a causal-like one (the order, last block first, is the one they reach a tile in under a
    causal mask), without a left window, without a bias (its gradient's staging shares the dQ buffers), on at most
    65535 sequences (the grid's third axis)."""
    if not common.plain_call(problem, opts, dtype, None, alibi):
        return False
    if opts.deterministic and (opts.window_left >= 0 or problem.batch > 65535 or bias is not None):
        return False
    # The lean form's products start from -lse in units of S (lse / scale): no zero scale there (its weights would be
    # exp2(-inf x 0), NaN).
    if opts.scale == 0 and lean(common.tile_head_dim(problem.head_dim)):
        return False
    return bias is None or takes_bias(problem, opts, dtype, bias, seed)


def takes_bias(problem, opts, dtype, bias, seed) -> bool:
    """Whether the kernel takes this bias: of the inputs' dtype (its tiles share the ring with Q and dO), over
    whole (query, key) planes (a bias broadcast over queries or keys has no tile for TMA to load; a jagged batch's
    may be larger than its longest sequence), without dropout (no draw beside a bias in the kernel) and with a
    nonzero scale (the lean products start from bias / scale). Broadcast over sequences or heads, it gets its
    gradient by float32 adds."""
    return (bias.dtype == dtype and bias.shape[2] >= problem.max_q and bias.shape[3] >= problem.max_k
            and seed is None and opts.scale != 0)


def bias_aligned(bias) -> bool:
    """Whether TMA can read the bias, and its gradient's rows (contiguous, of the bias's shape) are whole 16-byte
    units: its base and every stride of a dim it doesn't broadcast over (keys contiguous) multiples of 16 bytes,
    and its keys a multiple of 8."""
    if bias.data_ptr() % 16 or bias.stride(-1) != 1 or bias.shape[-1] % 8:
        return False
    return all(n == 1 or stride * bias.element_size() % 16 == 0
               for n, stride in zip(bias.shape[:-1], bias.stride()[:-1], strict=True))


def stores_first(problem, feats, broadcast) -> bool:
    """Whether the kernel writes a broadcast bias's float32 gradient without zeros (``DB`` 3): dense calls, whose
    sequences all visit the same tiles, with a bias broadcast over sequences and not over heads (``broadcast``:
    which of its dims are), so that the first sequence's programs store every tile (zeros where a mask hides it)
    before the others add to it. Under a band mask in tiles of 64 only: the lean D128 kernel with a band and the flags
    spills 160-224 bytes where it spilled 48-96 (H200, (1,H,S,S) B4 S2048 causal: 194 -> 191-192 TFLOP/s; at D64,
    B2 S4096 causal, 107-108 -> 127; bench/NOTES.md)."""
    return (problem.dense and broadcast[0] and not any(broadcast[1:])
            and not ((feats.HAS_R or feats.HAS_WL) and lean(common.tile_head_dim(problem.head_dim))))


def tile_flags(problem, device) -> torch.Tensor:
    """The zeroed flags of ``DB`` 3: one int32 per (key block, head, query tile)."""
    return torch.zeros(cdiv(problem.max_k, BLOCK_N) * problem.heads * cdiv(problem.max_q, BLOCK_M), device=device,
                       dtype=torch.int32)


def turn_counts(problem, device) -> torch.Tensor:
    """The zeroed counts of ``DET``: one int32 per (sequence, head, query tile of BLOCK_M)."""
    return torch.zeros(problem.batch * problem.heads * cdiv(problem.max_q, BLOCK_M), device=device, dtype=torch.int32)


def applies(problem, opts, q, k, v, dout, bias, alibi, seed) -> bool:
    """Whether the kernel takes this call here: :func:`supports`, on an sm_90 GPU with Gluon, every tensor
    with its heads packed in a row and TMA-aligned (a bias: :func:`bias_aligned`)."""
    return (supports(problem, opts, q.dtype, bias, alibi, seed)
            and common.hopper_layout(q, k, v, dout) and (bias is None or bias_aligned(bias)))


def plane_arguments(problem, t, name: str, placeholder) -> dict:
    """The kernel's arguments for a bias-shaped (Bb, Hb, Sq, Sk) tensor ``t`` (the bias, ``name`` "bias", or its
    gradient, "dbias"): the tensor, its strides (0 on the batch dim where it broadcasts over sequences; some valid
    stride on the heads' where it broadcasts over them) and steps (1 on the dims it doesn't broadcast over), and for
    dense calls its descriptor made on the host, over (Bb, Hb, Sq, Sk), boxes of BLOCK_M queries x half a key block
    (its lengths are every sequence's, so its boxes clip where each sequence's do). Without ``t``, placeholders."""
    upper = {"bias": "Bias", "dbias": "dBias"}[name]
    if t is None:
        return {upper: placeholder, f"{name}_sb": 0, f"{name}_sh": 0, f"{name}_sq": 0, f"{name}_b_step": 0,
                f"{name}_h_step": 0, f"{upper}D": None}
    b_step, h_step = (int(n > 1 and stride != 0) for n, stride in zip(t.shape[:2], t.stride()[:2], strict=True))
    sq = t.stride(2)
    sh = t.stride(1) if h_step else sq * t.shape[2]
    sb = t.stride(0) if b_step else 0
    desc = None
    if problem.dense:
        box = [1, 1, BLOCK_M, BLOCK_N // 2]
        desc = TensorDescriptor(t, [t.shape[0] if b_step else 1, t.shape[1] if h_step else 1, t.shape[2], t.shape[3]],
                                [sb if b_step else sh, sh, sq, 1], box, common.shared_layout(tuple(box), t.dtype))
    return {upper: t, f"{name}_sb": sb, f"{name}_sh": sh, f"{name}_sq": sq, f"{name}_b_step": b_step,
            f"{name}_h_step": h_step, f"{upper}D": desc}


def host_descriptor_boxes(problem, q, dout, dq_acc, k, v, dk, dv) -> tuple | None:
    """The boxes of :func:`host_descriptors`' seven descriptors (q, dO, dQ, K, V, dK, dV) where it makes them: dense
    calls whose query and key lengths are whole numbers of query tiles (BLOCK_M) and key blocks (BLOCK_N), with each
    tensor's sequences one after another in memory, so that no tile crosses a sequence. Otherwise None."""
    if not problem.dense or problem.max_q % BLOCK_M or problem.max_k % BLOCK_N:
        return None
    if not common.sequences_adjacent(q, dout, dq_acc, k, v, dk, dv):
        return None
    D = common.tile_head_dim(problem.head_dim)
    return ([BLOCK_M, D], [BLOCK_M, D], [BLOCK_M, dq_columns(D)], [BLOCK_N, D], [BLOCK_N, D], [BLOCK_N // 2, D],
            [BLOCK_N // 2, D])


def host_descriptors(problem, q, dout, dq_acc, k, v, dk, dv) -> tuple | None:
    """The kernel's TMA descriptors (q, dO, dQ, K, V, dK, dV) made once on the host, each over all B x S rows of
    its tensor, where no tile crosses a sequence (:func:`host_descriptor_boxes`). Otherwise None: each program makes
    its own sequence's descriptors, which clip at the sequence's end, and the seven makings, each fenced, delay the
    start of every program's loads."""
    boxes = host_descriptor_boxes(problem, q, dout, dq_acc, k, v, dk, dv)
    if boxes is None:
        return None
    tile_dim = common.tile_head_dim(problem.head_dim)
    return tuple(common.host_head_descriptor(t, *box, tile_dim)
                 for t, box in zip((q, dout, dq_acc, k, v, dk, dv), boxes, strict=True))


def lean(tile_dim: int) -> bool:
    """Whether the kernel takes its lean form (``LEAN``: registers are short at a tile head dim of 128)."""
    return tile_dim > 64


def dq_columns(tile_dim: int) -> int:
    """dQ columns per product and per reduce (``DQC``): half the tile head dim in the lean form, where each
    warpgroup computes half of every tile's dQ, else all of it."""
    return tile_dim // 2 if lean(tile_dim) else tile_dim


def pairs(problem, feats, total_k: int, device) -> bool:
    """Whether each program takes two key blocks (``PAIRS``): blocks ``p`` and ``n - 1 - p`` of a sequence, whose work
    under a causal-like mask (:func:`program.first_blocks_heaviest`) adds up to the same for every program. At D64
    (tiles of 64: the lean form's shared memory has no room for a second K and V), on sequences of a mean length up to
    ``PAIRS_MEAN_KEYS`` (``total_k``: the key rows, B x max_k if dense), where the call has ``PAIRS_PER_SM`` pairs per
    SM or more (counted from the key rows: a jagged batch's grid is sized by its longest sequence), so that halving the
    programs leaves every SM busy. Measured on an H100 and an H200 (bench/NOTES.md, "Two key blocks per program"):
    jagged causal batches +3-7%, dense causal S1k and S4k 0-2.4%; dense causal S16k 0-6% lost, and without a mask
    (blocks alike in work) 2-4% lost."""
    batch, kv_heads = problem.batch, problem.kv_heads
    if problem.dense:
        pairs_per_head = cdiv(cdiv(problem.max_k, BLOCK_N), 2) * batch
    else:  # (each sequence rounds its pairs up by at most one)
        pairs_per_head = cdiv(total_k, 2 * BLOCK_N) + batch
    return (first_blocks_heaviest(feats) and not lean(common.tile_head_dim(problem.head_dim))
            and total_k <= PAIRS_MEAN_KEYS * batch and pairs_per_head * kv_heads >= PAIRS_PER_SM * sm_count(device))


def launch_kv(q, k, v, dout, dq_acc, dk, dv, lse2, delta, problem, seq_args, order, mask, feats, scores,
              dropout, bias=None, dbias=None, dbias_mode=0, adds_across_batch=False, deterministic=False) -> None:
    """Run the kernel: dK, dV written, dQ added into the fp32 ``dq_acc`` (head dim = the tile's, D, whatever the
    inputs': the kernel adds at ``h x D``; zeroed by the Triton backward's preprocess, which runs first); ``order``: the
    sequences longest first (``program.longest_first``); ``mask``, ``scores``: the call's ``Mask`` and
    ``Scores`` bundles (their scale and log2-unit scale); ``dropout``: ``triton.scores.dropout_args``'s keyword
    arguments. ``bias`` (4-D, :func:`takes_bias`) and its gradient ``dbias`` (zeros, contiguous, of the bias's
    shape; None without one), written as ``dbias_mode`` says (1: stored, of the bias's dtype; 2: added, float32;
    3: float32, stored by the first sequence and added by the others, :func:`stores_first`: then ``dbias`` needs no
    zeros, and the tiles' flags are made here, :func:`tile_flags`); ``adds_across_batch``: sequences add into the same
    gradient (``program.heads_last``); ``deterministic``: dQ's adds in a fixed order (``DET``; the counts made here,
    :func:`turn_counts`; one key block a program, a sequence's key blocks started last first)."""
    tile_dim = common.tile_head_dim(problem.head_dim)
    if dq_acc.shape[-1] != tile_dim:  # (the accumulator's width is the Triton backward's head_block)
        raise ValueError(f"dq_acc: head dim {dq_acc.shape[-1]}, the kernel adds dQ in tiles of {tile_dim} columns")
    descs = host_descriptors(problem, q, dout, dq_acc, k, v, dk, dv)
    if descs is None or (bias is not None and not problem.dense):
        ensure_allocator()  # the kernel builds TMA descriptors on the device
    QD, dOD, dQD, KD, VD, dKD, dVD = descs or (None,) * 7
    dense = problem.dense
    blocks = cdiv(problem.max_k, BLOCK_N)
    paired = not deterministic and pairs(problem, feats, problem.batch * problem.max_k if dense else k.shape[0],
                                         q.device)
    # (Paired blocks are alike in work under a causal mask: no heaviest-first order for them. GQA's groups of kv
    # heads still apply: with as many programs as pairs take, a group's are about the first wave that blocks first
    # would run, in another order.)
    if deterministic:  # (a sequence's key blocks start last first: DET)
        grid, grid_order = (blocks, problem.kv_heads, problem.batch), BLOCKS_FIRST
    else:
        grid, grid_order = key_block_grid(problem, feats, cdiv(blocks, 2) if paired else blocks, q.device,
                                          0 if paired else PROGRAMS_PER_SM,
                                          adds_across_batch=adds_across_batch, kv_groups=True)
    _bwd_kv_hopper[grid](
        rows(q, dense), rows(k, dense), rows(v, dense), rows(dout, dense), rows(dq_acc, dense), rows(dk, dense),
        rows(dv, dense), lse2, delta, **seq_args, ORDER=order, mask=mask, scale=scores.scale,
        qk_scale=scores.qk_scale, **dropout, QD=QD, dOD=dOD, dQD=dQD, KD=KD, VD=VD, dKD=dKD, dVD=dVD, F=feats,
        D=tile_dim, HEAD_D=problem.head_dim, H=problem.heads, HKV=problem.kv_heads, GROUP=problem.group, BM=BLOCK_M,
        BN=BLOCK_N, LEAN=lean(tile_dim), DQC=dq_columns(tile_dim), GRID=grid_order,
        HOST_DESCS=descs is not None, PAIRS=paired, **plane_arguments(problem, bias, "bias", q),
        **plane_arguments(problem, dbias, "dbias", q),
        Flags=tile_flags(problem, q.device) if dbias_mode == 3 else lse2,
        Turns=turn_counts(problem, q.device) if deterministic else lse2, HOST_BIAS=problem.dense, DB=dbias_mode,
        DET=deterministic,
        num_warps=NUM_WARPS, maxnreg=common.MAX_REGS,
    )

