"""Attention dropout's keep bits in Gluon, laid out as a warpgroup's wgmma accumulator holds them.

The mask is ``varlen.attn.dropout``'s definition, bit for bit: one Philox4x32-7 call per pair of queries
(2 p, 2 p + 1) and group of 8 keys gives sixteen 8-bit numbers, query ``2 p + e``, key ``8 g + 4 t2 + w`` taking
byte ``2 e + t2`` of word ``w``. In a wgmma accumulator the weights of a call are spread over several lanes of a
warp, so computing each element's call where it is used would repeat every call. Instead each thread makes a few
calls, compares all four bytes of a word with the threshold at once (:func:`_dropped_bits`), packs the calls'
16 bits into words, and a layout conversion inside each warp hands every lane the words it needs. Two tiles:

- the backward's (keys x queries) tile of a key warpgroup, whose group of 8 keys lies in 8 lanes: 2 calls per
  thread (4 of its queries), one word, every lane getting the 8 words of its 8-lane set; each element takes its
  bit as a float sign (:func:`keep_words` draws, :func:`dropped_signs` unpacks);
- the forward's (queries x keys) tile of a query warpgroup, whose group lies in the 4 lanes of a quad: 4 calls per
  thread (groups 4 j + c of a pair of queries), the quad swapping the words; each element takes its bit as a
  float sign too (:func:`row_keep_words`, :func:`row_dropped_signs`).

A weight whose sign bit is set (-P) is a dropped one: :func:`relu_low`, the conversion to the products' precision
with a clamp at 0, drops it for free; the backward's dS uses the sign itself.
"""

from __future__ import annotations

from ..dropout import PHILOX_ROUNDS
from .common import HAVE_GLUON, gl, gluon

TILE = gl.constexpr(64) if HAVE_GLUON else 64  # keys and queries of the tile (:func:`dropped_signs`)

if HAVE_GLUON:
    _ROUNDS = gl.constexpr(PHILOX_ROUNDS)
    # The accumulator layout of a 64x64 wgmma tile of 4 warps (instr_shape [16, 64, 16]) viewed as 6 dims
    # (g, t, n2, nlo, c, e): key = 8 g + t, query = 16 n2 + 8 nlo + 2 c + e. Each thread holds keys t = lane / 4
    # (and + 8: g's low bit), queries 2 c + e (c = lane % 4) and + 8, 16, 32; warps take 16 keys each. Bases in
    # the accumulator's own register order, so the reshaped tile needs no conversion.
    _TILE6 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0],
                   [0, 0, 2, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 2, 0], [0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0],
                    [0, 4, 0, 0, 0, 0]],
        warp_bases=[[2, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]],
        block_bases=[],
        shape=[8, 8, 4, 2, 4, 2],
    ))
    # The packed words (g, n2, c): each lane holds those of its 8-lane set (t left out, so lanes share them).
    _WORDS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(5, _TILE6.value))))
    # Where the words are made: one per thread, a warp's two groups of keys in its own lanes.
    _MAKE = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 1], threads_per_warp=[2, 4, 4],
                                          warps_per_cta=[4, 1, 1], order=[2, 1, 0]))

    @gluon.jit
    def _philox(c0, c1, c2, c3, k0, k1):
        """Philox4x32-7 on uint32 values (Random123; ``varlen.attn.dropout.philox4x32``, same constants)."""
        for _ in gl.static_range(_ROUNDS):
            pa = c2.to(gl.uint64) * 0xCD9E8D57
            pb = c0.to(gl.uint64) * 0xD2511F53
            c0 = (pa >> 32).to(gl.uint32) ^ c1 ^ k0
            c2 = (pb >> 32).to(gl.uint32) ^ c3 ^ k1
            c1 = pa.to(gl.uint32)
            c3 = pb.to(gl.uint32)
            k0 = gl.add(k0, 0x9E3779B9, sanitize_overflow=False)
            k1 = gl.add(k1, 0xBB67AE85, sanitize_overflow=False)
        return c0, c1, c2, c3

    @gluon.jit
    def _dropped_bits(w0, w1, w2, w3, thresholds, thresholds_low7):
        """The 16 drop bits of one call's words: bit ``8 b + 7 - w`` is set where byte b of word w is below the
        threshold. Byte x < t exactly when (255 - x) + t carries out of 8 bits, so the four bytes of a word are
        compared at once: their low 7 bits are added without crossing bytes (``thresholds`` is t in every byte,
        ``thresholds_low7`` the same with each byte's top bit cleared), and the carry out of each byte is the
        majority of the two top bits and the carry into them, in bit 7."""
        nw0 = ~w0
        nw1 = ~w1
        nw2 = ~w2
        nw3 = ~w3
        c0 = (nw0 & thresholds) | ((nw0 | thresholds) & ((nw0 & 0x7F7F7F7F) + thresholds_low7))
        c1 = (nw1 & thresholds) | ((nw1 | thresholds) & ((nw1 & 0x7F7F7F7F) + thresholds_low7))
        c2 = (nw2 & thresholds) | ((nw2 | thresholds) & ((nw2 & 0x7F7F7F7F) + thresholds_low7))
        c3 = (nw3 & thresholds) | ((nw3 | thresholds) & ((nw3 & 0x7F7F7F7F) + thresholds_low7))
        return ((c0 & 0x80808080) | ((c1 >> 1) & 0x40404040) | ((c2 >> 2) & 0x20202020)
                | ((c3 >> 3) & 0x10101010))

    @gluon.jit
    def _call_bits(c0, c1, c2, c3, k0, k1, thresholds, thresholds_low7):
        """The 16 drop bits (:func:`_dropped_bits`) of the Philox call on counter (c0, c1, c2, c3)."""
        w0, w1, w2, w3 = _philox(c0, c1, c2, c3, k0, k1)
        return _dropped_bits(w0, w1, w2, w3, thresholds, thresholds_low7)

    @gluon.jit
    def _thresholds(threshold):
        """The 8-bit threshold in every byte of a word, and the same with each byte's top bit cleared."""
        # (A threshold of 1 arrives as a constant: Triton specializes integers equal to 1, in tuples too.)
        thresholds = gl.to_tensor(threshold).to(gl.uint32, bitcast=True) * 0x01010101
        return thresholds, thresholds & 0x7F7F7F7F

    @gluon.jit
    def _key(seed, i0, FRESH: gl.constexpr):
        """The Philox key's two words from ``seed`` (an int64, or a pointer to the one drawn on the device, loaded
        here: where used, not held across the caller's loop). ``FRESH``: made from a value the compiler can't fold
        (``i0``, a tile's first query, is >= 0), so that a loop around the caller computes the round keys anew
        for each tile instead of holding them across the loop: at D128 the backward spilled them around its
        products' issue (stack 200-224 -> 144-152 bytes; backward 309 -> 347 TFLOP/s, H200; the forward's causal
        D128 tile 280 -> 292; the backward's D64 tile, which doesn't spill, lost 2%)."""
        if seed.dtype.is_ptr():
            seed = gl.load(seed)
        seed64 = seed.to(gl.uint64)
        k0 = (seed64 & 0xFFFFFFFF).to(gl.uint32)
        k1 = ((seed64 >> 32) & 0xFFFFFFFF).to(gl.uint32)
        if FRESH:
            fresh = (i0 >> 31).to(gl.uint32, bitcast=True)  # 0
            k0 = k0 ^ fresh
            k1 = k1 ^ fresh
        return k0, k1

    @gluon.jit
    def keep_words(seed, offset_lo, threshold, bh, i0, j0, FRESH_KEYS: gl.constexpr):
        """The packed drop bits of a ``[64 keys, 64 queries]`` tile: keys ``j0 + ..`` (j0 a multiple of 8), query
        rows ``i0 + ..`` (i0 even), stream ``bh`` (``b * H + h``) of the Philox key (``seed``: the key's two words
        as one int64; ``offset_lo``: the counter's fourth word, int32 bits), as ``triton.scores.keep_tile`` draws
        them. Each lane gets the 8 words of its 8-lane set (8 registers); :func:`dropped_signs` unpacks them.
        ``FRESH_KEYS``: the Philox round keys made anew for each tile rather than held across the caller's loop
        (:func:`_key`)."""
        thresholds, thresholds_low7 = _thresholds(threshold)
        k0, k1 = _key(seed, i0, FRESH_KEYS)
        g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, _MAKE)))[:, None, None]
        n2 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MAKE)))[None, :, None]
        c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _MAKE)))[None, None, :]
        group = ((j0 // 8 + g) + n2 * 0 + c * 0).to(gl.uint32, bitcast=True)
        # The thread's queries 16 n2 + 2 c + 8 nlo + e: the pairs (i0 + 16 n2 + 2 c) / 2 + 4 nlo.
        first_pair = i0 // 2 + 8 * n2 + c + g * 0
        bh = bh.to(gl.uint32, bitcast=True)
        offset_lo = offset_lo.to(gl.uint32, bitcast=True)
        words = gl.zeros([8, 4, 4], gl.uint32, layout=_MAKE)
        for nlo in gl.static_range(2):
            pair = (first_pair + 4 * nlo).to(gl.uint32, bitcast=True)
            # Bit 16 e + 8 t2 + 7 - w - 4 nlo: query 8 nlo + e, key 4 t2 + w of the group.
            words |= _call_bits(pair, group, bh, offset_lo, k0, k1, thresholds, thresholds_low7) >> (4 * nlo)
        return gl.convert_layout(words, _WORDS)

    @gluon.jit
    def dropped_signs(words, layout: gl.constexpr):
        """``[64 keys, 64 queries]`` uint32 in ``layout`` (a 4-warp wgmma accumulator of instr_shape
        [16, 64, 16]): the float sign bit (``0x80000000``) where the weight is dropped, 0 where it is kept, from
        :func:`keep_words`. The bit positions are one shift per lane (the key t = 4 t2 + w of the group) and
        constants per register (the query 8 nlo + e): no per-element index arithmetic."""
        t = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
            4, gl.SliceLayout(5, _TILE6))))))[None, :, None, None, None, None]
        nlo = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            4, gl.SliceLayout(5, _TILE6))))))[None, None, None, :, None, None]
        e = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, gl.SliceLayout(4, _TILE6))))))[None, None, None, None, None, :]
        # Bit 16 e + 8 t2 + 7 - w - 4 nlo: down by 8 t2 + 3 - w per lane leaves it at 16 e + 4 - 4 nlo.
        lane_shift = (8 * (t >> 2) + 3 - (t & 3)).to(gl.uint32)
        lane_words = gl.expand_dims(gl.expand_dims(gl.expand_dims(words, 1), 3), 5) >> lane_shift
        signs = (lane_words << (27 - 16 * e + 4 * nlo).to(gl.uint32)) & 0x80000000
        signs = gl.reshape(signs.broadcast_to([8, 8, 4, 2, 4, 2]), [TILE, TILE])
        return gl.convert_layout(signs, layout, assert_trivial=True)

    # The forward's S tile: a [64 queries, 128 keys] wgmma accumulator of 4 warps (instr_shape [16, 128, 16]) viewed
    # as 5 dims (r, j, ck, c, e): key = 32 j + 8 ck + 2 c + e, so its Philox call is that of key group 4 j + ck and
    # the query's pair, and its key within the group is 2 c + e. Each thread holds queries lane / 4 (and + 8), key
    # pairs 2 c + e with c = lane % 4, all 16 groups; warps take 16 queries each. Bases in the accumulator's
    # register order (no conversion).
    _ROWS5 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [8, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 1, 0, 0, 0],
                   [0, 2, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]],
        block_bases=[],
        shape=[64, 4, 4, 4, 2],
    ))
    # The packed words (r, ck), word ck holding groups 4 j + ck: every lane of a quad holds its queries' 8.
    # (Sliced so that the lane's axis c comes back first: :func:`row_dropped_signs` shifts each word once per lane.)
    _ROW_WORDS = gl.constexpr(gl.SliceLayout(2, gl.SliceLayout(1, gl.SliceLayout(4, _ROWS5.value))))
    # Where they are made, (pair, e, ck): lane c of a quad makes the words of groups 4 j + c for its pair of queries
    # 2 pair + e, both in its registers.
    _ROW_MAKE = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0]], lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[8, 0, 0], [16, 0, 0]], block_bases=[], shape=[32, 2, 4]))

    @gluon.jit
    def row_keep_words(seed, offset_lo, threshold, bh, i0, j0, FRESH_KEYS: gl.constexpr):
        """The packed drop bits of a ``[64 queries, 128 keys]`` forward tile: query rows ``i0 + ..`` (i0 even), keys
        ``j0 + ..`` (j0 a multiple of 8), stream ``bh`` (arguments as :func:`keep_words`). Each thread makes 4 Philox
        calls; every lane gets its two queries' 8 words (8 registers); :func:`row_dropped_signs` unpacks them."""
        thresholds, thresholds_low7 = _thresholds(threshold)
        k0, k1 = _key(seed, i0, FRESH_KEYS)
        calls: gl.constexpr = gl.SliceLayout(1, _ROW_MAKE)
        pair = gl.arange(0, 32, layout=gl.SliceLayout(1, calls))[:, None]
        ck = gl.arange(0, 4, layout=gl.SliceLayout(0, calls))[None, :]
        counter = (i0 // 2 + pair + ck * 0).to(gl.uint32, bitcast=True)
        bh = bh.to(gl.uint32, bitcast=True)
        offset_lo = offset_lo.to(gl.uint32, bitcast=True)
        group = (j0 // 8 + ck + pair * 0).to(gl.uint32, bitcast=True)
        bits0 = _call_bits(counter, group, bh, offset_lo, k0, k1, thresholds, thresholds_low7)
        bits1 = _call_bits(counter, group + 4, bh, offset_lo, k0, k1, thresholds, thresholds_low7)
        bits2 = _call_bits(counter, group + 8, bh, offset_lo, k0, k1, thresholds, thresholds_low7)
        bits3 = _call_bits(counter, group + 12, bh, offset_lo, k0, k1, thresholds, thresholds_low7)
        # Bit 16 e + 8 t2 + 7 - w of group 4 j + ck's call is query e, key 4 t2 + w of the group. Groups j = 1, 3
        # go 4 lower (between j = 0's and 2's bits), then j = 2, 3 into the high half of query e's word.
        low = bits0 | (bits1 >> 4)
        high = bits2 | (bits3 >> 4)
        even = gl.expand_dims((low & 0xFFFF) | (high << 16), 1)
        odd = gl.expand_dims((low >> 16) | (high & 0xFFFF0000), 1)
        e = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, _ROW_MAKE)))[None, :, None]
        words = gl.reshape(gl.where(e == 0, even, odd), [64, 4])
        return gl.convert_layout(words, _ROW_WORDS)

    @gluon.jit
    def row_dropped_signs(words, layout: gl.constexpr):
        """``[64 queries, 128 keys]`` uint32 in ``layout`` (a 4-warp wgmma accumulator of instr_shape [16, 128, 16]):
        the float sign bit (``0x80000000``) where the weight is dropped, 0 where it is kept, from
        :func:`row_keep_words`. Key 32 j + 8 ck + 2 c + e is bit 16 (j >> 1) - 4 (j & 1) + 8 (c >> 1) + 7 - 2 (c & 1)
        - e of word ck: each word is shifted once per lane (by c's part), then each element takes its bit with a
        constant shift."""
        c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(1, gl.SliceLayout(
            4, _ROWS5)))))[None, None, :]
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
            4, _ROWS5)))))[None, :, None, None, None]
        e = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, _ROWS5)))))[None, None, None, None, :]
        # Down by 8 (c >> 1) + 2 - 2 (c & 1) per lane leaves the bit at 16 (j >> 1) - 4 (j & 1) + 5 - e.
        lane_words = gl.expand_dims(words, 2) >> (8 * (c >> 1) + 2 - 2 * (c & 1)).to(gl.uint32)
        lane_words = gl.expand_dims(gl.expand_dims(lane_words, 1), 4)
        signs = (lane_words << (26 - 16 * (j >> 1) + 4 * (j & 1) + e).to(gl.uint32)) & 0x80000000
        signs = gl.reshape(signs.broadcast_to([64, 4, 4, 4, 2]), [64, 128])
        return gl.convert_layout(signs, layout, assert_trivial=True)

    @gluon.jit
    def relu_low(x, dtype: gl.constexpr):
        """``max(x, 0)`` rounded to ``dtype`` (bf16 or fp16), two elements per instruction (``cvt.rn.relu``): with
        the dropped weights' sign bits set, the conversion to the products' precision drops them for free."""
        if dtype == gl.bfloat16:
            low = gl.inline_asm_elementwise("cvt.rn.relu.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                            is_pure=True, pack=2)
        else:
            low = gl.inline_asm_elementwise("cvt.rn.relu.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                            is_pure=True, pack=2)
        return low
else:  # pragma: no cover - depends on the installed Triton
    # (the kernels that call them are defined only with Gluon too)
    keep_words = dropped_signs = row_keep_words = row_dropped_signs = relu_low = None
