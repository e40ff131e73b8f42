"""Score modifiers of the attention kernels, each in one block below with its backward rule.

Scores are kept in log2 units (the kernels use ``exp2``): with ``LOG2E = log2(e)``,
``s2 = LOG2E * (softcap * tanh(scale * qk / softcap) + bias + alibi)`` (or ``LOG2E * scale * qk``
without softcap), then -inf where the pair is hidden (``masks.visible``). ``rows``/``cols`` are
broadcastable tiles of in-sequence query and key positions, in either orientation (the dK/dV kernel works
on transposed, keys x queries, tiles). Each modifier is switched on by a flag of the ``Features``
constexpr:

- softcap (``SOFTCAP``): ``c * tanh(s / c)``; backward: ``ds * (1 - tanh**2)``.
- bias (``HAS_BIAS``): ``+ bias[b, h, i, j]``; backward: the bias gradient is ``ds`` (:func:`bias_grad`).
- ALiBi (``HAS_ALIBI``): ``- slope[b, h] * |i + shift - j|``; backward: nothing (slopes get no gradient).
- dropout (``DROPOUT``): the probabilities are multiplied by ``keep * dropout_keep_scale(p)`` after the softmax
  (:func:`keep_tile`, the definition in ``varlen.attn.dropout``); backward: ``dP`` likewise.

Host side, :func:`score_args` and :func:`dropout_args` pack their runtime values into bundles.
"""

import collections

import torch

from ..._kernel_math import LOG2E
from ..._triton import tl, triton
from ..dropout import PHILOX_ROUNDS, dropout_keep_scale, dropout_threshold
from .masks import SeqMask, visible

_PHILOX_ROUNDS = tl.constexpr(PHILOX_ROUNDS)

# Runtime values (host bundles); placeholders where a modifier is off. Strides are fields of their own, not a
# nested tuple: Triton 3.6 loses the value of a stride specialized to 1 two tuples deep.
Scores = collections.namedtuple("Scores", "scale qk_scale softcap_scale softcap2 bias bias_sb bias_sh bias_sq "
                                          "bias_sk alibi alibi_sb alibi_sh")
# Dropout's key (seed, offset_lo) changes per call: top-level kernel arguments (see program.py).
Dropout = collections.namedtuple("Dropout", "threshold keep_scale sequences")
# Per (sequence, head), in-kernel.
HeadScores = collections.namedtuple("HeadScores", "scale qk_scale softcap_scale softcap2 bias stride_bq stride_bk "
                                                  "slope2")
HeadDropout = collections.namedtuple("HeadDropout", "seed offset_lo threshold keep_scale bh row0")


def broadcast_strides(t) -> tuple[int, ...]:
    """Strides with 0 on size-1 dims, so a broadcast dim indexed by b, h, i or j reads one element."""
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride(), strict=True))


def score_args(bias, alibi, opts, placeholder) -> Scores:
    """The ``Scores`` bundle of a call."""
    cap = opts.softcap if opts.softcap > 0 else 1.0
    return Scores(opts.scale, opts.scale * LOG2E.value, opts.scale / cap, cap * LOG2E.value,
                  placeholder if bias is None else bias, *((0,) * 4 if bias is None else broadcast_strides(bias)),
                  placeholder if alibi is None else alibi, *((0,) * 2 if alibi is None else broadcast_strides(alibi)))


def dropout_args(seed, opts, problem, placeholder) -> dict:
    """The ``dropout`` bundle and the key of a call, as kernel keyword arguments: Philox keyed with the seed's
    two words, the offset's high word folded into the second; the offset's low word passed as an int32 with
    the same bits. A key drawn on the device (``DropoutSeed``) is passed as its one-element tensor, which the
    kernels load (:func:`philox_key`), with offset 0. With ``query_offset`` (``POSITIONS``), each sequence's mask
    is that of its ``dropout_sequences`` entry (its own index when None)."""
    if seed is None:
        return dict(dropout=Dropout(0, 1.0, placeholder), seed=0, offset_lo=0)
    sequences = placeholder
    if opts.query_offset is not None:
        sequences = opts.dropout_sequences
        if sequences is None:
            sequences = torch.arange(problem.batch, dtype=torch.int32, device=opts.query_offset.device)
    bundle = Dropout(dropout_threshold(opts.dropout_p), dropout_keep_scale(opts.dropout_p), sequences)
    if isinstance(seed.seed, torch.Tensor):
        return dict(dropout=bundle, seed=seed.seed, offset_lo=0)
    key = seed.seed ^ ((seed.offset >> 32) << 32)
    offset_lo = seed.offset & 0xFFFFFFFF
    offset_lo = offset_lo - 2**32 if offset_lo >= 2**31 else offset_lo
    return dict(dropout=bundle, seed=key, offset_lo=offset_lo)


@triton.jit
def head_scores(s: Scores, b, h, F: tl.constexpr):
    """The score modifiers' values for sequence b, query head h."""
    bias = s.bias + b.to(tl.int64) * s.bias_sb + h * s.bias_sh
    slope2 = 0.0
    if F.HAS_ALIBI:
        slope2 = tl.load(s.alibi + b * s.alibi_sb + h * s.alibi_sh) * LOG2E
    return HeadScores(s.scale, s.qk_scale, s.softcap_scale, s.softcap2, bias, s.bias_sq, s.bias_sk, slope2)


@triton.jit
def philox_key(seed):
    """The call's Philox key: ``seed`` itself, or the int64 it points to (a key drawn on the device,
    ``dropout_args``). Which one is known when the kernel compiles (a pointer is another variant)."""
    if seed.dtype.is_ptr():
        return tl.load(seed)
    else:
        return seed


@triton.jit
def head_dropout(d: Dropout, seed, offset_lo, b, h, heads, m: SeqMask, F: tl.constexpr):
    """Sequence b, head h's dropout stream. With ``POSITIONS`` its rows are the queries' key positions
    (``m.shift + i``) and its sequence is ``d.sequences[b]``: the mask a whole batch draws for this part."""
    seed = philox_key(seed)
    if F.POSITIONS:
        return HeadDropout(seed, offset_lo, d.threshold, d.keep_scale, tl.load(d.sequences + b) * heads + h,
                           m.shift)
    else:
        return HeadDropout(seed, offset_lo, d.threshold, d.keep_scale, b * heads + h, 0)


# ------------------------------------------------------------------------------------- softcap
@triton.jit
def tanh(x, EXACT: tl.constexpr):
    """tanh without a tanh instruction (there is none in Triton's interpreter, nor in every build), through
    ``1 - 2 / (exp(2x) + 1)``: relative error within 3 float32 epsilons (3 * 2**-23) for |x| >= 0.625 and exact at
    the tails, but near 0 only its absolute error stays bounded (2**-22): it returns 0 below |x| ~ 3e-8 and is off
    by 7e-4 of tanh at 1e-4, so a softcap moved float32 outputs by 3x PyTorch's own error. ``EXACT`` (float32 at
    full accuracy): below |x| = 0.625, an odd polynomial ``x + x z P(z)`` with ``z = x**2`` instead, P a
    least-squares fit of ``(tanh(x) / x - 1) / z`` on ``[0, 0.625]`` in relative error (numpy, Chebyshev nodes);
    above, the same form on |x| with x's sign: within 2 epsilons everywhere (tests/test_attention.py measures both
    forms, under the interpreter and on the GPU). It costs 5-13% of a bf16 softcap call (H100), whose rounding
    the fast form's error never reaches: only full float32 pays it."""
    if EXACT:
        a = tl.abs(x)
        near = a < 0.625
        xn = tl.where(near, x, 0.0)  # (the polynomial never sees an infinity)
        z = xn * xn
        p = (((-0.00571868 * z + 0.020652883) * z - 0.053744588) * z + 0.13331512) * z - 0.33333287
        far = 1.0 - 2.0 / (tl.exp2(a * (2.0 * LOG2E)) + 1.0)
        return tl.where(near, xn + xn * z * p, tl.where(x < 0, -far, far))
    else:
        return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def softcap_grad(ds, t, F: tl.constexpr):
    """The softcap's backward rule: ``ds`` through ``c * tanh(x / c)`` (``t`` the forward's tanh)."""
    if F.SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


# ---------------------------------------------------------------------------------------- bias
@triton.jit
def add_bias(s, rows, cols, Lq, Lk, hs: HeadScores, MASKED: tl.constexpr):
    """``s + LOG2E * bias``; entries past Lq/Lk are not read (a jagged bias may hold anything there).

    Unmasked tiles (``MASKED`` false) lie inside the sequence along the keys (``masks.tile_stages``), so only
    the queries are checked there: a mask on the key axis, whose bound Lk is a runtime value of unknown
    divisibility (``launch.DATA_DEPENDENT``), would make every load along it a 2-byte scalar one."""
    if MASKED:
        in_seq = (rows < Lq) & (cols < Lk)
    else:
        in_seq = rows < Lq
    bias = tl.load(hs.bias + rows.to(tl.int64) * hs.stride_bq + cols.to(tl.int64) * hs.stride_bk, mask=in_seq,
                   other=0.0)
    return s + bias.to(tl.float32) * LOG2E


@triton.jit
def bias_grad(ds, dbias_bh, q_idx, k_idx, Lq, Lk, stride_dbq, stride_dbk, DB: tl.constexpr, MASKED: tl.constexpr):
    """The bias's backward rule: its gradient is dS. Writes a keys x queries tile of dS (natural units) into
    the bias gradient at ``dbias_bh`` (``q_idx``/``k_idx``: the tile's in-sequence positions, 1-D).

    ``DB.MODE`` 1: a full-shape bias, each element written once. 2: a broadcast bias, tile sums over its
    broadcast axes (``DB.BQ``, ``DB.BK``) added atomically in fp32. Unmasked tiles are checked along the
    queries only, as in :func:`add_bias`.
    """
    rows = q_idx[None, :]
    cols = k_idx[:, None]
    if MASKED:
        in_seq = (rows < Lq) & (cols < Lk)
    else:
        in_seq = rows < Lq
    if DB.MODE == 1:
        ptrs = dbias_bh + rows.to(tl.int64) * stride_dbq + cols.to(tl.int64) * stride_dbk
        tl.store(ptrs, ds.to(dbias_bh.dtype.element_ty), mask=in_seq)
    else:
        # Masked and out-of-sequence entries of dS are exact zeros, so tile sums need no mask.
        if DB.BQ and DB.BK:
            tl.atomic_add(dbias_bh, tl.sum(tl.sum(ds, 1), 0), sem="relaxed")
        elif DB.BQ:
            tl.atomic_add(dbias_bh + k_idx.to(tl.int64) * stride_dbk, tl.sum(ds, 1), mask=k_idx < Lk, sem="relaxed")
        elif DB.BK:
            tl.atomic_add(dbias_bh + q_idx.to(tl.int64) * stride_dbq, tl.sum(ds, 0), mask=q_idx < Lq, sem="relaxed")
        else:
            ptrs = dbias_bh + rows.to(tl.int64) * stride_dbq + cols.to(tl.int64) * stride_dbk
            tl.atomic_add(ptrs, ds, mask=in_seq, sem="relaxed")


# --------------------------------------------------------------------------------------- ALiBi
@triton.jit
def add_alibi(s, rows, cols, shift, hs: HeadScores):
    """``s - LOG2E * slope * |i + shift - j|``."""
    return s - hs.slope2 * tl.abs(rows + shift - cols).to(tl.float32)


# ------------------------------------------------------------------------------------ all of them
@triton.jit
def score_tile(qk, rows, cols, Lq, Lk, m: SeqMask, hs: HeadScores, F: tl.constexpr, MASKED: tl.constexpr,
               RAW: tl.constexpr, EXACT: tl.constexpr):
    """(log2-unit scores, tanh values) of a tile of raw ``qk`` products. The tanh values feed
    :func:`softcap_grad` in the backward; without softcap the second result is unused. ``RAW`` (the
    forward with ``F.RAW_SCORES``): the products themselves, masked, for the caller to scale. ``EXACT``: float32
    at full accuracy (the ``"tf32x3"`` dot precision; :func:`tanh`)."""
    if F.SOFTCAP:
        t = tanh(qk * hs.softcap_scale, EXACT)
        s = t * hs.softcap2
    elif RAW:
        t = qk
        s = qk
    else:
        t = qk
        s = qk * hs.qk_scale
    if F.HAS_BIAS:
        s = add_bias(s, rows, cols, Lq, Lk, hs, MASKED)
    if F.HAS_ALIBI:
        s = add_alibi(s, rows, cols, m.shift, hs)
    if MASKED:
        s = tl.where(visible(rows, cols, Lq, Lk, m, F), s, float("-inf"))
    return s, t


# ------------------------------------------------------------------------------------- dropout
@triton.jit
def keep_tile(d: HeadDropout, m0, n0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ODD_ROWS: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` dropout keep bits of queries ``m0 + i`` and keys ``n0 + j`` (n0 a multiple
    of 8; rows counted from ``d.row0``): the definition in ``varlen.attn.dropout``.

    One Philox4x32-7 call per pair of query rows and 8 keys gives four 32-bit words, sixteen bytes:
    row ``2 p + e``, key ``8 g + 4 t2 + w`` takes byte ``2 e + t2`` of word ``w``. Without ``ODD_ROWS`` the
    tile's first row ``d.row0 + m0`` must be even (so it is without a query offset: ``row0`` is 0 and ``m0`` a
    multiple of the even ``BLOCK_M``): each pair's call is made once and both its rows take their bytes, 7 rounds
    per 16 weights. ``ODD_ROWS`` (rows counted from a query offset, which may be odd): each row makes its pair's
    call and keeps its own half of the bytes, 7 rounds per 8 weights.
    """
    G: tl.constexpr = BLOCK_N // 8
    g = n0 // 8 + tl.arange(0, G)[None, :]
    if ODD_ROWS:
        i = d.row0 + m0 + tl.arange(0, BLOCK_M)[:, None]
        pair = i.to(tl.uint32, bitcast=True) >> 1  # (rows past 2**31, from a query offset, are uint32 too)
    else:
        pair = ((d.row0 + m0) // 2 + tl.arange(0, BLOCK_M // 2)[:, None]).to(tl.uint32, bitcast=True)
    zero = tl.zeros([pair.shape[0], G], dtype=tl.int32)
    r0, r1, r2, r3 = tl.philox(d.seed, pair + zero, g + zero, d.bh + zero, d.offset_lo + zero, n_rounds=_PHILOX_ROUNDS)
    # join(join(r0, r2), join(r1, r3))[..., a, c] is word 2a + c (w, innermost of the key); t2 goes outside it.
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    if ODD_ROWS:
        # The row's two bytes of each word (byte 2 e + t2): e = i & 1 picks the half.
        halves = words >> (16 * (i & 1)).to(tl.uint32)[:, :, None, None]
        bytes = tl.join(halves & 0xFF, (halves >> 8) & 0xFF)  # [BLOCK_M, G, a, c, t2]
        bytes = tl.permute(bytes, (0, 1, 4, 2, 3))
    else:
        halves = tl.join(words, words >> 16)  # [P, G, a, c, e]: row 2 p + e's half
        bytes = tl.join(halves & 0xFF, (halves >> 8) & 0xFF)  # [P, G, a, c, e, t2]
        bytes = tl.permute(bytes, (0, 4, 1, 5, 2, 3))
    return tl.reshape(bytes, [BLOCK_M, BLOCK_N]) >= d.threshold
