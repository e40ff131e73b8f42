"""float32 at full accuracy on bf16 tensor cores: each operand as three bf16 parts, each product as six.

A float32 x is exactly the sum of three bf16 parts: the nearest bf16, then the nearest bf16 of each remainder
(its 24 bits in three 8-bit pieces). The six products of two such operands whose terms reach 2**-16 of the whole
give float32's accuracy (the three left out stay below 2**-23), and cost what three TF32 ones do (bf16 runs at
twice TF32's rate); unlike 32-bit wgmma, bf16 wgmma reads either operand transposed from shared memory, so no
tile goes through registers to be transposed. Triton's own ``tf32x3`` dots split both operands of every dot in
registers instead, and spill (bench/NOTES.md).

The loaded operands (Q, K, V, dO) are split once per call, in one launch (:func:`split_bf16`), and their parts
load through TMA like the operands (:func:`part_descs`, :func:`load_parts`); the computed ones (P, dS) are split
in registers per tile (:func:`bf16_parts`). ``configs.splits_bf16`` says where this runs.
"""

import torch

from ..._launch import fast_launch
from ..._triton import tl, triton
from ...tiling import cdiv
from .configs import splits_bf16
from .launch import head_block
from .program import Rows, base, rows
from .tiles import load_rows, rows_desc, store_rows


@triton.jit
def bf16_parts(x):
    """fp32 ``x`` as three bfloat16 parts ``(x0, x1, x2)``, each the nearest bf16 to what the ones before it
    leave of x (remainders exact in fp32): x's 24 bits in three 8-bit pieces, whose sum is x. The same rule as
    :func:`split_bf16`."""
    x0 = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    r = x - x0.to(tl.float32)
    x1 = r.to(tl.bfloat16, fp_downcast_rounding="rtne")
    return x0, x1, (r - x1.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def trans3(x):
    """Each of three parts transposed."""
    return tl.trans(x[0]), tl.trans(x[1]), tl.trans(x[2])


@triton.jit
def dot6(a, b):
    """``a @ b`` to float32's accuracy from operands given as three bf16 parts each (:func:`bf16_parts`): the six
    products whose terms reach 2**-16 of the whole, smallest first, summed from zero. Callers add the result to
    their running sums in float32: the tensor cores truncate what they add into an accumulator, and a sum run
    there over a long sequence (dK and dV over 2048 queries) came out 15-30x less accurate than PyTorch's own
    float32 math (H100, bench/NOTES.md); added this way, as Triton's tf32x3 dots do, it is more accurate."""
    acc = tl.dot(a[2], b[0])
    acc = tl.dot(a[1], b[1], acc)
    acc = tl.dot(a[0], b[2], acc)
    acc = tl.dot(a[1], b[0], acc)
    acc = tl.dot(a[0], b[1], acc)
    return tl.dot(a[0], b[0], acc)


@triton.constexpr_function
def part_width(cols):
    """Columns from one bf16 part of a split row to the next (:func:`split_bf16`): the head dim rounded up to a
    multiple of 8, so that every part starts on a 16-byte boundary, as TMA needs. (Callable from Python and, on
    constexpr head dims, from the kernels.)"""
    return (cols + 7) // 8 * 8


@triton.jit
def part_descs(X: Rows, X_FIRST: Rows, X_LAST: Rows, seq_b, start, h, n_rows, COLS: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr):
    """Descriptors (or pointers) of a sequence's rows of X as the kernel loads them: X itself, or under
    ``SPLIT`` its three bf16 parts (:func:`split_bf16`): the first two in each row of ``X_FIRST``, the second
    :func:`part_width` columns after the first, the third in ``X_LAST``. Without ``SPLIT``, X_FIRST and X_LAST
    are None. The parts load through TMA only (:func:`load_parts` reads X's row stride)."""
    if SPLIT:
        tl.static_assert(TMA, "the split operands load through TMA")
        p = base(X_FIRST, seq_b, start, h)
        return (rows_desc(p, n_rows, X_FIRST.stride_s, COLS, BLOCK_R, BLOCK_C, TMA),
                rows_desc(p + part_width(COLS), n_rows, X_FIRST.stride_s, COLS, BLOCK_R, BLOCK_C, TMA),
                rows_desc(base(X_LAST, seq_b, start, h), n_rows, X_LAST.stride_s, COLS, BLOCK_R, BLOCK_C, TMA))
    else:
        return (rows_desc(base(X, seq_b, start, h), n_rows, X.stride_s, COLS, BLOCK_R, BLOCK_C, TMA),)


@triton.jit
def load_parts(descs, r0, n_rows, row_stride, COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               MASK_ROWS: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr):
    """Rows ``[r0, r0 + BLOCK_R)`` of each of :func:`part_descs`'s descriptors: a tuple of one tile, or of three
    parts. ``row_stride`` is X's, which only pointer loads use: the parts load through TMA only."""
    first = load_rows(descs[0], r0, n_rows, row_stride, COLS, BLOCK_R, BLOCK_C, MASK_ROWS, TMA)
    if SPLIT:
        return (first, load_rows(descs[1], r0, n_rows, row_stride, COLS, BLOCK_R, BLOCK_C, MASK_ROWS, TMA),
                load_rows(descs[2], r0, n_rows, row_stride, COLS, BLOCK_R, BLOCK_C, MASK_ROWS, TMA))
    else:
        return (first,)


@triton.jit
def _split_rows(X: Rows, FIRST: Rows, LAST: Rows, b, h, r0, n_rows, D: tl.constexpr, BLOCK_D: tl.constexpr,
                ROWS: tl.constexpr):
    """Rows ``[r0, r0 + ROWS)`` of head h of batch b of ``X`` (``n_rows`` per batch) as their three bf16 parts:
    the first two in ``FIRST``'s rows, :func:`part_width` columns apart, the third in ``LAST``'s."""
    zero = b * 0  # (a tensor zero: the rows' start within the batch)
    x = load_rows(base(X, b, zero, h), r0, n_rows, X.stride_s, D, ROWS, BLOCK_D, True, False)
    x0, x1, x2 = bf16_parts(x)
    first = base(FIRST, b, zero, h)
    store_rows(first, r0, n_rows, FIRST.stride_s, x0, D, ROWS, BLOCK_D)
    store_rows(first + part_width(D), r0, n_rows, FIRST.stride_s, x1, D, ROWS, BLOCK_D)
    store_rows(base(LAST, b, zero, h), r0, n_rows, LAST.stride_s, x2, D, ROWS, BLOCK_D)


@fast_launch
@triton.jit(do_not_specialize=["q_rows", "k_rows"])
def _split_bf16_kernel(Q: Rows, Q_FIRST: Rows, Q_LAST: Rows, dO: Rows, dO_FIRST: Rows, dO_LAST: Rows, K: Rows,
                       K_FIRST: Rows, K_LAST: Rows, V: Rows, V_FIRST: Rows, V_LAST: Rows, q_rows, k_rows, heads,
                       kv_heads, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       HAS_DO: tl.constexpr, ROWS: tl.constexpr):
    """Grid ``(cdiv(max(q_rows, k_rows), ROWS), max(heads, kv_heads), B)``: rows ``[i * ROWS, +ROWS)`` of head h
    of batch b of Q and dO (``q_rows`` per batch, ``heads``; dO only if ``HAS_DO``, else None) and of K and V
    (``k_rows``, ``kv_heads``), each as its three bf16 parts (:func:`_split_rows`). One launch for all: each
    launch costs host time, which short calls feel."""
    r0 = tl.program_id(0) * ROWS
    h = tl.program_id(1)
    b = tl.program_id(2)
    if (r0 < q_rows) & (h < heads):
        _split_rows(Q, Q_FIRST, Q_LAST, b, h, r0, q_rows, D, BLOCK_D, ROWS)
        if HAS_DO:
            _split_rows(dO, dO_FIRST, dO_LAST, b, h, r0, q_rows, DV, BLOCK_DV, ROWS)
    if (r0 < k_rows) & (h < kv_heads):
        _split_rows(K, K_FIRST, K_LAST, b, h, r0, k_rows, D, BLOCK_D, ROWS)
        _split_rows(V, V_FIRST, V_LAST, b, h, r0, k_rows, DV, BLOCK_DV, ROWS)


def runs_split(dtype: torch.dtype, problem, tma: bool, num_stages: int) -> bool:
    """Whether a launch with ``num_stages`` computes from bf16 parts: where ``configs.splits_bf16`` says so, never
    with one stage. Triton 3.6 miscompiles the backward's split kernel without pipelined loads (H100: GPU tests
    crashed with one stage; on a variant with dK and dV transposed, compute-sanitizer found an out-of-bounds
    shared-memory read at 16x64 tiles and dK and dV came out wrong at 32x64; every tile right with two stages):
    such tiles take Triton's tf32x3 dots (the forward keeps the same rule)."""
    return splits_bf16(dtype, problem, tma) and num_stages > 1


def _part_buffers(x: torch.Tensor, buffer: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where :func:`split_bf16` puts x's parts: ``(first, last)`` views."""
    D = x.shape[-1]
    width = part_width(D)
    if buffer is not None and width == D:
        return buffer.view(torch.bfloat16), torch.empty(x.shape, device=x.device, dtype=torch.bfloat16)
    parts = torch.empty(*x.shape[:-1], 3 * width, device=x.device, dtype=torch.bfloat16)
    return parts[..., :2 * width], parts[..., 2 * width:2 * width + D]


def split_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None,
               dk: torch.Tensor | None = None, dv: torch.Tensor | None = None) -> tuple[tuple[torch.Tensor, ...], ...]:
    """The float32 attention operands (``(B, S, H, D)`` or ``(T, H, D)``, last dim contiguous; q and dout alike
    but for the head dim, k and v alike) as their three bfloat16 parts each, in one launch (:func:`bf16_parts`
    per element): the nearest bf16, then the nearest bf16 of each remainder (exact in float32): x's 24 bits in
    three 8-bit pieces, whose sum is x. Returns ``(first, last)`` for q, k, v (and dout, if given): the first two
    parts in each row of ``first``, ``(..., 2 * part_width(D))``, the second from column ``part_width(D)``; the
    third in ``last``, ``(..., D)``; by default views of one ``(..., 3 * part_width(D))`` tensor. With ``dk`` /
    ``dv`` given (contiguous float32 tensors shaped like k / v), k's / v's first two parts go in their memory
    where they fit (head dims that are multiples of 8). (Triton's interpreter truncates float32 to bf16 whatever
    rounding is asked for: there the parts still add up to x but are not the nearest, and the kernels never
    split.)"""
    parts = _part_buffers(q, None), _part_buffers(k, dk), _part_buffers(v, dv)
    (q_first, q_last), (k_first, k_last), (v_first, v_last) = parts
    dense = q.dim() == 4
    batch, q_rows, k_rows = (q.shape[0], q.shape[1], k.shape[1]) if dense else (1, q.shape[0], k.shape[0])
    heads, kv_heads = q.shape[-2], k.shape[-2]
    block_rows = 32  # (not tuned: a memory-bound pass, small next to the kernels that read the parts)
    D, DV = q.shape[-1], v.shape[-1]
    if dout is not None:
        parts += (_part_buffers(dout, None),)
        do_rows = tuple(rows(t, dense) for t in (dout, *parts[3]))
    else:
        do_rows = (None,) * 3
    _split_bf16_kernel[(cdiv(max(q_rows, k_rows), block_rows), max(heads, kv_heads), batch)](
        rows(q, dense), rows(q_first, dense), rows(q_last, dense), *do_rows, rows(k, dense), rows(k_first, dense),
        rows(k_last, dense), rows(v, dense), rows(v_first, dense), rows(v_last, dense), q_rows, k_rows, heads,
        kv_heads, D=D, DV=DV, BLOCK_D=head_block(D), BLOCK_DV=head_block(DV), HAS_DO=dout is not None,
        ROWS=block_rows)
    return parts


def part_args(names: tuple[str, ...], parts: tuple | None, dense: bool) -> dict:
    """The kernels' part arguments ``<NAME>_FIRST`` and ``<NAME>_LAST`` for each of ``names``, from
    :func:`split_bf16`'s ``parts`` (in the same order), or all None without a split (``parts`` None)."""
    if parts is None:
        return {f"{name}_{which}": None for name in names for which in ("FIRST", "LAST")}
    args = {}
    for name, (first, last) in zip(names, parts, strict=True):
        args[f"{name}_FIRST"], args[f"{name}_LAST"] = rows(first, dense), rows(last, dense)
    return args
