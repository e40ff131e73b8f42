"""The attention dropout mask: its definition, a PyTorch implementation, and how to get a call's mask.

Definition. The keep bit of attention weight ``(b, h, i, j)`` (batch index b, query head h in
``[0, H)``, query position i and key position j within sequence b) is a pure function of the call's
Philox key ``(seed, offset)`` (64-bit ints, see ``options.DropoutSeed``) and ``dropout_p``:

- one Philox4x32-7 call (Random123's Philox4x32 with 7 rounds) per pair of query rows ``i >> 1`` and group
  of 8 keys ``j >> 3``, with all words uint32 and arithmetic mod 2**32::

      counter = (i >> 1, j >> 3, b * H + h, offset & 0xFFFFFFFF)
      key     = (seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)

  each of the 7 rounds: ``(hi0, lo0) = mulhilo(0xD2511F53, c0)``, ``(hi1, lo1) = mulhilo(0xCD9E8D57,
  c2)``, ``c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)``, then ``k0 += 0x9E3779B9``, ``k1 += 0xBB67AE85``;
- its 16 bytes serve the 16 weights of the two rows and 8 keys: ``word = out[j & 3]``, ``byte = 2 * (i & 1) +
  ((j >> 2) & 1)``, ``r8 = (word >> (8 * byte)) & 0xFF``;
- keep iff ``r8 >= dropout_threshold(dropout_p)`` (``t = min(round(p * 256), 255)``): the keep probability is
  exactly ``(256 - t) / 256``, ``1 - p`` rounded to a multiple of 2**-8; kept weights are scaled by its inverse,
  ``dropout_keep_scale(dropout_p) = 256 / (256 - t)`` (not ``1 / (1 - p)``), so that the expected output is
  exact for every p. A call asking for p = 0.1 drops 26 / 256 = 0.1016 of the weights.

These are FlashAttention 2's parameters (Philox4x32-7, 8-bit thresholds, one call for 16 weights), not its bit
layout: its masks are other bits. Random123 finds 7 rounds Crush-resistant (TestU01's BigCrush passes). In the
Gluon kernels the draw takes about a third of the integer work of the earlier 10-round, 16-bit, 8-weights-per-call
one, which is what bounded the dropout backward on Hopper (``bench/NOTES.md``, "FlashAttention 2's draw"). A p
up to 1/512 rounds to 0: nothing is dropped.

In Triton this is ``tl.philox(seed ^ ((offset >> 32) << 32), i >> 1, j >> 3, b * H + h, offset & 0xFFFFFFFF,
n_rounds=7)`` (which keys Philox with the seed's low and high words). The Triton kernels and the Gluon forward
and backward (``attn/gluon/dropout.py``) compute exactly this mask, bit for bit, so the PyTorch backend, the
reference and the kernels agree on every element.
"""

from __future__ import annotations

import sys

import torch

from .._checks import capturing, check_generator, check_int, check_probability
from ..jagged import as_jagged
from .options import DropoutSeed

_U32 = 0xFFFFFFFF
_U64_LIMIT = 2**64
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_BUMP_A, _BUMP_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 7
KEYS_PER_CALL = 8  # per query row: a call's 4 words of 32 bits serve two rows, 8 bits per weight
THRESHOLD_LEVELS = 256  # 8-bit random numbers


def dropout_threshold(dropout_p: float) -> int:
    """The 8-bit threshold: a weight is kept iff its random 8-bit number is ``>=`` this.

    ``min(round(p * 256), 255)`` with Python's ``round`` (half to even); 0 (any p up to 1/512) keeps everything.
    Kernels receive this host int rather than recomputing it, so every implementation agrees.
    """
    return min(round(dropout_p * THRESHOLD_LEVELS), THRESHOLD_LEVELS - 1)


def dropout_keep_scale(dropout_p: float) -> float:
    """The factor kept weights are scaled by: the inverse of the exact keep probability of the 8-bit test,
    ``256 / (256 - dropout_threshold(dropout_p))``, ``1 / (1 - p)`` for p a multiple of 2**-8."""
    return THRESHOLD_LEVELS / (THRESHOLD_LEVELS - dropout_threshold(dropout_p))


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
               rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 (Random123) on int64 tensors holding uint32 values; broadcasts its inputs.

    Args:
        counter: four int64 tensors or Python ints with values in ``[0, 2**32)``, at least one a tensor.
        key: two Python ints or two 0-dim int64 tensors (a key drawn on the counters' device stays there), with
            values in ``[0, 2**32)``.
        rounds: 7 for the mask's Philox4x32-7, 10 for Random123's default Philox4x32-10.

    Returns:
        The four output words, int64 tensors with values in ``[0, 2**32)``.

    This runs on every weight of a CPU call with dropout (once per 16 weights, per 8 with a query offset), twice: in
    the forward and in the backward, so it is written for few tensor ops. Each round multiplies two words (c0 and
    c2) by 32-bit constants; their 64-bit products are taken from int64 multiplies, which wrap modulo 2**64 and so
    keep every bit (the high word is the arithmetic shift by 32, masked). After the first round, which runs on the
    counters' own broadcast shapes, the two multiplied words share one tensor ``x`` and their partners (c1 beside
    c0, c3 beside c2) one tensor ``y``: a round is one multiply, one shift, two XORs (the partners, flipped, then
    the round's key words from one table) and one mask over both. A round swaps which multiplied word sits first, so
    the multipliers and key words alternate with it. The known-answer and Triton tests check it bit for bit.
    """
    like = next(t for t in (*counter, *key) if isinstance(t, torch.Tensor))
    c0, c1, c2, c3 = counter
    # The multiplied words must be tensors (their products are split below); the others may stay Python ints, as
    # keep_mask_block passes them: a tensor made from one here would be a host-to-device copy on a GPU.
    c0, c2 = (t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=torch.int64, device=like.device)
              for t in (c0, c2))
    k0, k1 = key
    if rounds == 0:
        return torch.broadcast_tensors(*(torch.as_tensor(t, device=like.device) for t in (c0, c1, c2, c3)))
    # Round 1 on the inputs' shapes. y keeps the products whole: their high bits go with the next round's mask.
    p0, p2 = c0 * _ROUND_A, c2 * _ROUND_B
    x = (((p0 >> 32) ^ c3 ^ k1) & _U32, ((p2 >> 32) ^ c1 ^ k0) & _U32)  # the new (c2, c0)
    y = (p0, p2)  # the new (c3, c1): the low words of the products
    shape = torch.broadcast_shapes(*(t.shape for t in (*x, *y)))
    x = torch.stack([t.expand(shape) for t in x])
    y = torch.stack([t.expand(shape) for t in y])
    # While x holds (c2, c0) its multipliers are (B, A) and its key words (k0, k1); while it holds (c0, c2), (A, B)
    # and (k1, k0). One table of the rounds' key words: from Python ints one copy to the device, from a key drawn on
    # the device made there.
    ones = (1,) * len(shape)
    # (Filled on the device, not copied from the host: a copy can't be captured in a CUDA graph.)
    multipliers = torch.full((2, 2), _ROUND_A, dtype=torch.int64, device=like.device)
    multipliers.diagonal().fill_(_ROUND_B)  # [[B, A], [A, B]]
    multipliers = multipliers.view((2, 2) + ones)
    if isinstance(k0, torch.Tensor):
        r = torch.arange(1, rounds, dtype=torch.int64, device=like.device)
        words = ((k0.to(like.device) + r * _BUMP_A) & _U32, (k1.to(like.device) + r * _BUMP_B) & _U32)
        odd = r % 2 == 1
        round_keys = torch.stack([torch.where(odd, words[0], words[1]), torch.where(odd, words[1], words[0])], 1)
    else:
        round_keys = [((k0 + r * _BUMP_A) & _U32, (k1 + r * _BUMP_B) & _U32) for r in range(1, rounds)]
        round_keys = torch.tensor([pair if r % 2 == 1 else pair[::-1] for r, pair in enumerate(round_keys, 1)],
                                  dtype=torch.int64, device=like.device)
    round_keys = round_keys.view((rounds - 1, 2) + ones)
    for r in range(1, rounds):
        products = x * multipliers[0 if r % 2 == 1 else 1]
        x = products >> 32
        # new c0 = hi(c2) ^ c1 ^ k0 and new c2 = hi(c0) ^ c3 ^ k1: each high word meets the other pair's partner.
        x ^= y.flip(0)
        x ^= round_keys[r - 1]
        x &= _U32
        y = products
    y = y & _U32
    if rounds % 2 == 1:  # x holds (c2, c0)
        return x[1], y[1], x[0], y[0]
    return x[0], y[0], x[1], y[1]


def keep_mask_block(seed: int | torch.Tensor, offset: int, batch: int, heads: int, rows: tuple[int, int], max_k: int,
                    dropout_p: float, device=None, row_offset: torch.Tensor | None = None,
                    sequences: torch.Tensor | None = None) -> torch.Tensor:
    """Keep bits ``(batch, heads, rows[1] - rows[0], max_k)`` for query rows ``[rows[0], rows[1])``; ``seed`` an int
    or a one-element int64 tensor on ``device`` (a key drawn there, ``options.DropoutSeed``).

    The backends' entry point (they build the mask one block of query rows at a time); no checks.
    ``row_offset`` ``(batch,)``: sequence b's rows start there (``query_offset``); ``sequences`` ``(batch,)``:
    the sequence index each one's mask is drawn for (default: its own).
    """
    i0, i1 = rows
    groups = -(-max_k // KEYS_PER_CALL)
    ar = lambda n: torch.arange(n, dtype=torch.int64, device=device)
    if row_offset is None:  # one call per pair of rows, the pairs covering [i0, i1)
        first_pair = i0 >> 1
        rows_abs = None
        c0 = (ar(((i1 + 1) >> 1) - first_pair) + first_pair).view(1, 1, -1, 1)
    else:  # rows shifted per sequence, so pairs differ between them: one call per row
        rows_abs = ((ar(i1 - i0) + i0).view(1, 1, -1, 1) + row_offset.to(torch.int64).view(-1, 1, 1, 1)) & _U32
        c0 = rows_abs >> 1
    c1 = ar(groups).view(1, 1, 1, -1)
    b = ar(batch) if sequences is None else sequences.to(torch.int64)
    c2 = (b.view(-1, 1, 1, 1) * heads + ar(heads).view(1, -1, 1, 1)) & _U32
    # The per-call words stay Python ints: a tensor built from them would be a host-to-device copy. (A key drawn on
    # the device, a one-element tensor, stays there: its words are 0-dim tensors.)
    if isinstance(seed, torch.Tensor):
        seed = seed.reshape(())
    c3, k0, k1 = offset & _U32, seed & _U32, ((seed >> 32) ^ (offset >> 32)) & _U32
    out = philox4x32((c0, c1, c2, c3), (k0, k1))
    # The words' low 32 bits side by side, (batch, heads, calls, groups, 4), and their bytes as a uint8 view (no
    # shifts): byte b of word w at 4 w + b.
    words = torch.empty((*out[0].shape, 4), dtype=torch.int32, device=out[0].device)  # (the four share a shape)
    for w, word in enumerate(out):
        words[..., w] = word
    octets = words.view(torch.uint8).unflatten(-1, (4, 4))
    if sys.byteorder == "big":
        octets = octets.flip(-1)
    # Byte 2 e + t2 of word w is row 2 pair + e, key 8 group + 4 t2 + w: each byte compared where it lands in
    # (batch, heads, calls, e, groups, t2, w), whose flattening is (rows, keys) (a permutation of the compared
    # bytes instead, with w innermost moving out, took 40x a contiguous copy's time).
    threshold = dropout_threshold(dropout_p)
    keep = torch.stack([torch.stack([octets[..., 2 * e + t2] >= threshold for t2 in (0, 1)], dim=-2)
                        for e in (0, 1)], dim=3)
    if rows_abs is None:
        start = i0 - 2 * first_pair
        keep = keep.flatten(-3).flatten(2, 3)[:, :, start:start + i1 - i0]
    else:
        odd = (rows_abs & 1).bool().view(*rows_abs.shape, 1, 1)  # (batch, 1, rows, 1, 1, 1)
        keep = torch.where(odd, keep[:, :, :, 1], keep[:, :, :, 0]).flatten(-3)
    return keep[..., :max_k]


def dropout_keep_mask(batch: int, heads: int, max_q: int, max_k: int, dropout_p: float, *, seed: int,
                      offset: int, device=None) -> torch.Tensor:
    """The keep mask of attention dropout for one Philox key, as a bool tensor.

    Args:
        batch, heads: B and the number of query heads H.
        max_q, max_k: how many query and key positions per sequence to cover.
        dropout_p: the drop probability, in ``[0, 1)``.
        seed, offset: the call's Philox key, ints in ``[0, 2**64)``.
        device: where to build the mask (default: the CPU).

    Returns:
        ``(B, H, max_q, max_k)`` bool, True where the attention weight is kept (then scaled by
        ``dropout_keep_scale(dropout_p)``). Entry ``[b, h, i, j]`` is query i, key j of sequence b; entries past
        a sequence's lengths are defined but unused. See the module docstring for the definition.

    Raises:
        TypeError / ValueError: a size, ``seed`` or ``offset`` is not a non-negative int (seed and
        offset below 2**64), or ``dropout_p`` is outside ``[0, 1)``.
    """
    batch, heads, max_q, max_k, seed, offset = (
        check_int(name, value, minimum=0) for name, value in (("batch", batch), ("heads", heads), ("max_q", max_q),
                                                              ("max_k", max_k), ("seed", seed), ("offset", offset)))
    for name, value in (("seed", seed), ("offset", offset)):
        if value >= _U64_LIMIT:
            raise ValueError(f"{name}: got {value}; must be below 2**64")
    dropout_p = check_probability("dropout_p", dropout_p)
    return keep_mask_block(seed, offset, batch, heads, (0, max_q), max_k, dropout_p, device).contiguous()


def attention_dropout_mask(q, k, dropout_p: float, *, generator: torch.Generator | None = None
                           ) -> torch.Tensor:
    """The dropout keep mask that ``varlen.attention`` will use for its next call, without drawing it.

    Reads the Philox key exactly as ``varlen.attention`` would draw it from ``generator`` (torch's
    default generator for q's device when None) and leaves the generator's state unchanged, so the
    next ``varlen.attention(q, k, v, dropout_p=dropout_p, generator=generator)`` applies this mask::

        g = torch.Generator(device=q.device).manual_seed(0)
        keep = varlen.attention_dropout_mask(q, k, 0.1, generator=g)   # g is not advanced
        out = varlen.attention(q, k, v, dropout_p=0.1, generator=g)    # uses `keep`
        ref, _ = attention_reference(q, k, v, dropout_mask=keep, dropout_p=0.1)  # same math

    Nothing else may draw from the generator in between (with the default generator: no other random
    op). The mask is ``(B, H, max_q, max_k)``: meant for debugging at small sizes. Calls inside a captured CUDA graph
    or a compiled graph draw their key on the device (``varlen.attention``'s ``dropout_p``): their masks can't be
    read ahead, and inside a capture this raises a ValueError.

    Args:
        q: dense ``(B, Sq, H, D)`` or jagged ``(B, j, H, D)``, as passed to ``varlen.attention``.
        k: dense ``(B, Sk, Hkv, D)`` or jagged, as passed to ``varlen.attention``.
        dropout_p: the drop probability, in ``[0, 1)``; 0 gives an all-True mask.
        generator: the generator the attention call will use.

    Returns:
        ``(B, H, max_q, max_k)`` bool on q's device (dense: ``max_q = Sq``, ``max_k = Sk``); entry
        ``[b, h, i, j]`` is query i, key j of sequence b.

    Raises:
        TypeError / ValueError: q or k is not a 4-dim tensor or a jagged tensor of 3-dim values,
        ``dropout_p`` is outside ``[0, 1)``, ``generator`` is not a ``torch.Generator``, or a CUDA graph is being
        captured.
    """
    dropout_p = check_probability("dropout_p", dropout_p)
    check_generator("generator", generator)
    batch, max_q, heads, device = _shape(q, "q")
    _, max_k, _, _ = _shape(k, "k")
    if dropout_p == 0.0:
        return torch.ones(batch, heads, max_q, max_k, dtype=torch.bool, device=device)
    if capturing(device):
        raise ValueError(f"dropout_p: {dropout_p} while a CUDA graph is being captured; a captured call draws its "
                         "dropout key on the GPU at each replay, so no mask can be read ahead of it: read masks "
                         "outside the capture (they are those of eager calls)")
    generator = generator if generator is not None else default_generator(device)
    state = generator.get_state()
    try:
        drawn = draw_dropout_seed(generator, device)
    finally:
        generator.set_state(state)
    return keep_mask_block(drawn.seed, drawn.offset, batch, heads, (0, max_q), max_k, dropout_p,
                           device).contiguous()


def _shape(x, name: str) -> tuple[int, int, int, torch.device]:
    """(batch, max_len, heads, device) of a dense ``(B, S, H, D)`` or jagged ``(B, j, H, D)`` input."""
    if isinstance(x, torch.Tensor) and not x.is_nested:
        if x.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, seq, heads, dim), got shape {tuple(x.shape)}")
        return x.shape[0], x.shape[1], x.shape[2], x.device
    xj = as_jagged(x, name)
    if xj.values.dim() != 3:
        raise ValueError(f"{name}: expected a jagged tensor of logical shape (B, j, heads, dim), got "
                         f"values of shape {tuple(xj.values.shape)}")
    return xj.batch_size, xj.max_len, xj.values.shape[1], xj.device


# Seeds lie in [0, SEED_LIMIT): 63 bits, eager or drawn inside a compiled graph.
SEED_LIMIT = 2**63 - 1


def draw_dropout_seed(generator: torch.Generator | None, device: torch.device) -> DropoutSeed:
    """The Philox key of one call with dropout, drawn from ``generator`` on the host (no device sync).

    A CUDA generator gives its seed and current offset, then advances the offset, as PyTorch's own
    dropout does; a CPU generator gives a random 63-bit seed. Either way the generator's state moves,
    so consecutive calls get different masks and a restored state replays the same one.
    """
    if generator is None:
        generator = default_generator(device)
    if generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + 4)
        return DropoutSeed(seed=generator.initial_seed() & SEED_LIMIT, offset=offset)
    seed = int(torch.randint(0, SEED_LIMIT, (1,), generator=generator, dtype=torch.int64))
    return DropoutSeed(seed=seed, offset=0)


def default_generator(device: torch.device) -> torch.Generator:
    """Torch's default generator for ``device`` (the one ``varlen.attention`` draws from by default)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator
