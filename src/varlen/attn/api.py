"""``varlen.attention``: validate once, pick a backend, run the autograd function."""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .. import _amp
from .._checks import (
    FLOAT_DTYPES,
    INT32_MAX,
    check_bool,
    check_choice,
    check_dtype,
    check_generator,
    check_int,
    check_probability,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    checks_metadata,
    is_int,
)
from .._tensor_cache import TensorCache
from ..jagged import JaggedTensor, as_jagged, check_same_offsets
from ..tiling import last_dim_contiguous
from . import backends
from .function import attention_function, dropout_seed
from .op_checks import check_alibi, check_bias
from .options import AttentionOptions, Problem

ALIGNS = ("top_left", "bottom_right")


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    align: str = "top_left",
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    deterministic: bool = False,
    prefix_len: int | torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    query_offset: int | torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Fused scaled-dot-product attention over dense or jagged batches, with its backward.

    Args:
        q: dense ``(B, Sq, H, D)`` tensor, or a JaggedTensor (or ``torch.nested`` jagged tensor) of
            logical shape ``(B, j, H, D)``.
        k: ``(B, Sk, Hkv, D)``, or jagged ``(B, j, Hkv, D)`` with the batch size of q (its lengths may
            differ from q's). ``H`` must be a multiple of ``Hkv`` (GQA/MQA).
        v: ``(B, Sk, Hkv, Dv)``, or jagged with the offsets of k. ``Dv`` may differ from ``D``.
        causal: query i sees key j only if ``j <= i + shift``.
        window: ``(left, right)``; query i sees key j only if ``i + shift - left <= j <= i + shift + right``.
            None or -1 leaves a side unbounded. Combines with ``causal`` by intersection.
        align: ``"top_left"`` (shift = 0) or ``"bottom_right"`` (shift = Lk - Lq), per sequence.
        scale: multiplies ``q.k``, nonzero; default ``D ** -0.5``.
        bias: additive score bias broadcastable to ``(B, H, Sq, Sk)``; for jagged inputs
            ``(B, H, max_Lq, max_Lk)`` (entries past a sequence's lengths are ignored). Float (gets a
            gradient of its own shape and dtype when it requires grad) or bool (True keeps).
        alibi_slopes: ``(H,)`` or ``(B, H)``: adds ``-slope * |i + shift - j|`` to the scores.
        softcap: when > 0, scores become ``softcap * tanh(s / softcap)`` before bias and masking.
        dropout_p: probability of dropping an attention weight (training); the kept ones are scaled by ``1 / (1 -
            dropout_p)`` (dropout_p rounded to a multiple of 2**-8, as FlashAttention 2 draws it: 0.1 drops 26 /
            256, and up to 1/512 nothing; see ``varlen.attn.dropout``). The mask is a function of a seed and offset
            drawn from ``generator`` (torch's default when None): the same generator state gives the same mask, and
            the backward replays it. Inside a captured CUDA graph the seed is drawn on the GPU, anew on each
            replay (``generator``: None, or a CUDA generator registered with the graph). Pass 0.0 in evaluation.
        deterministic: bitwise-reproducible gradients (also on when
            ``torch.are_deterministic_algorithms_enabled()``).
        prefix_len: an int or an integer tensor ``(B,)``: the first ``prefix_len[b]`` keys of sequence b
            are visible to all its queries, whatever the other masks say. With ``causal=True`` this is a
            prefix-LM: bidirectional inside the prefix, causal after it.
        document_ids: dense self-attention over packed rows (``Sq == Sk``): an integer tensor ``(B, S)``;
            a query sees only keys of its own document, a document being a run of equal ids along the
            row (positions for causal masks, windows and ALiBi stay the row's). For transformers-style
            packed batches without ``cu_seqlens``: no host sync, one launch. (Jagged inputs express
            documents as sequences instead.)
        query_offset: an int or an integer tensor ``(B,)``, instead of ``align``: query i of sequence b sits
            at key position ``query_offset[b] + i`` (shift = query_offset[b]) for the masks, ALiBi and the
            dropout mask's rows. For queries that are a slice of a longer sequence whose keys are all given
            (chunked prefill, context parallelism): the result is that slice's rows of the whole. At most 2**29
            (the kernels' positions are int32; larger unchecked GPU values are cut to it).
        return_lse: also return the logsumexp of the scores (natural log; float32, float64 for float64 inputs):
            ``(B, H, Sq)`` dense, ``(H, total_q)`` jagged; -inf for a query that sees no key.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"torch"``; None (the
            default) takes the choice of the enclosing ``varlen.use_backend`` block, ``"auto"`` outside one.
            What each backend runs is declared in its ``CAPABILITIES`` (``varlen.capabilities``); asking
            for one that can't take the call raises ValueError listing why.

    Under ``torch.autocast`` q, k, v and a float bias are cast to the autocast dtype first, as torch's
    ``scaled_dot_product_attention`` is; gradients flow back to the uncast tensors in their dtypes.

    Returns:
        The output in q's layout with head dim ``Dv`` (a JaggedTensor for jagged inputs), and the lse
        when ``return_lse``. A query that sees no key gets output 0, lse -inf and zero gradient.
    """
    check_bool("return_lse", return_lse)
    call = prepare(q, k, v, causal=causal, window=window, align=align, scale=scale, bias=bias,
                    alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, generator=generator,
                    deterministic=deterministic, prefix_len=prefix_len, document_ids=document_ids, backend=backend,
                    query_offset=query_offset)
    return run(call, return_lse)


def run(call: _Call, return_lse: bool):
    """Run a prepared call: the output in q's layout (and the lse)."""
    out, lse = attention_function(*call.args)
    if not call.problem.dense:
        out = JaggedTensor._trusted(out, call.q_jagged.offsets, call.q_jagged.max_len,
                                    call.q_jagged._host_offsets)
    return (out, lse) if return_lse else out


class _Call:
    __slots__ = ("args", "problem", "q_jagged")

    def __init__(self, args, problem, q_jagged):
        self.args = args
        self.problem = problem
        self.q_jagged = q_jagged


def _is_jagged(x) -> bool:
    return isinstance(x, JaggedTensor) or (isinstance(x, torch.Tensor) and x.is_nested)


def prepare(q, k, v, *, causal, window, align, scale, bias, alibi_slopes, softcap, dropout_p, generator,
            deterministic, backend, prefix_len=None, document_ids=None, query_offset=None,
            dropout_sequences=None) -> _Call:
    """Validate a call once (``varlen.attention``'s arguments; ``dropout_sequences``: see ``AttentionOptions``,
    for ``varlen.distributed``) into what :func:`run` runs."""
    kinds = [_is_jagged(t) for t in (q, k, v)]
    if any(kinds) and not all(kinds):
        raise TypeError("q, k, v: mix dense tensors and jagged tensors; pass all three dense "
                        "(B, S, H, D) or all three jagged (JaggedTensor / torch.nested)")
    jagged = kinds[0]
    q_jagged = None
    if jagged:
        qj, kj, vj = as_jagged(q, "q"), as_jagged(k, "k"), as_jagged(v, "v")
        if kj.batch_size != qj.batch_size:
            raise ValueError(f"k: batch size {kj.batch_size} differs from q's {qj.batch_size}")
        check_same_offsets("v", vj, "k", kj)
        qt, kt, vt = qj.values, kj.values, vj.values
        for name, t in (("q", qt), ("k", kt), ("v", vt)):
            if t.dim() != 3:
                raise ValueError(f"{name}: expected a jagged tensor of logical shape (B, j, heads, dim), "
                                 f"got values of shape {tuple(t.shape)}")
        B, max_q, max_k = qj.batch_size, qj.max_len, kj.max_len
        q_jagged = qj
    else:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t)
            if t.dim() != 4:
                raise ValueError(f"{name}: expected 4 dims (batch, seq, heads, dim), got shape "
                                 f"{tuple(t.shape)}")
        qt, kt, vt = q, k, v
        B, max_q, max_k = q.shape[0], q.shape[1], k.shape[1]
        if k.shape[0] != B or v.shape[0] != B:
            raise ValueError(f"k, v: batch sizes {k.shape[0]}, {v.shape[0]} must equal q's {B}")
        if v.shape[1] != max_k:
            raise ValueError(f"v: sequence length {v.shape[1]} differs from k's {max_k}")
    if bias is not None:
        check_tensor("bias", bias)
    # Under torch.autocast, attention runs in the autocast dtype, as torch's scaled_dot_product_attention.
    qt, kt, vt, bias = _amp.cast(_amp.LOWER_PRECISION, qt.device, qt, kt, vt, bias)
    # Backends walk the head dim with stride 1 (options.py); torch's fused CPU kernel reads a strided one wrong, and
    # out of bounds.
    qt, kt, vt = (last_dim_contiguous(t) for t in (qt, kt, vt))
    H, D = qt.shape[-2], qt.shape[-1]
    Hkv, Dk, Dv = kt.shape[-2], kt.shape[-1], vt.shape[-1]
    if Dk != D:
        raise ValueError(f"k: head dim {Dk} differs from q's {D}")
    if vt.shape[-2] != Hkv:
        raise ValueError(f"v: {vt.shape[-2]} heads differ from k's {Hkv}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q: {H} heads are not a multiple of k/v's {Hkv} heads (GQA/MQA needs "
                         "H % Hkv == 0)")
    if D == 0 or Dv == 0:
        raise ValueError(f"q, k, v: head dims must be >= 1, got D = {D}, Dv = {Dv}")
    for name, t in (("q", qt), ("k", kt), ("v", vt)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_same_dtype([("q", qt), ("k", kt), ("v", vt)])
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes)
    check_same_device([("q", qt), ("k", kt), ("v", vt), ("bias", bias), ("alibi_slopes", alibi_slopes)])

    check_bool("causal", causal)
    check_choice("align", align, ALIGNS)
    if query_offset is not None and align != "top_left":
        raise ValueError(f"query_offset: replaces align (query i of sequence b at key position query_offset[b] + "
                         f"i); got align={align!r} too: leave align at 'top_left'")
    window_left, window_right = parse_window(window)
    scale = D ** -0.5 if scale is None else check_scale("scale", scale)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
            0 <= softcap < math.inf):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 disables it), got {softcap!r}")
    dropout_p = check_probability("dropout_p", dropout_p)
    check_generator("generator", generator)
    check_bool("deterministic", deterministic)
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()

    if jagged:
        cu_q = _int32_offsets(q_jagged, "q")
        cu_k = cu_q if kj.offsets is qj.offsets else _int32_offsets(kj, "k")
    else:
        cu_q = cu_k = None
    problem = Problem(batch=B, heads=H, kv_heads=Hkv, head_dim=D, head_dim_v=Dv, max_q=max_q, max_k=max_k,
                      dense=not jagged, cu_q=cu_q, cu_k=cu_k)
    window_left, window_right = _reach(window_left, window_right, problem)
    opts = AttentionOptions(scale=float(scale), causal=causal, window_left=window_left,
                            window_right=window_right, bottom_right=align == "bottom_right",
                            softcap=float(softcap), dropout_p=float(dropout_p), deterministic=deterministic,
                            prefix_len=_per_sequence("prefix_len", prefix_len, problem, qt.device),
                            documents=_documents(document_ids, problem, qt.device),
                            query_offset=_per_sequence("query_offset", query_offset, problem, qt.device,
                                                       largest=LARGEST_QUERY_OFFSET),
                            dropout_sequences=dropout_sequences)
    bias = check_bias(bias, problem, qt.dtype)
    alibi = check_alibi(alibi_slopes, problem, qt.dtype)

    impl = backends.select(backend, qt, bias, alibi, problem, opts)
    seed = dropout_seed(opts, generator, qt.device)
    return _Call((qt, kt, vt, bias, alibi, problem, opts, impl, seed), problem, q_jagged)


def parse_window(window) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected None or (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            side = -1
        if not is_int(side) or side < -1:
            raise ValueError(f"window: {name} = {side!r}; allowed: an int >= 0, or None / -1 for unbounded")
        sides.append(check_int(f"window's {name}", side))
    return sides[0], sides[1]


# int64 -> int32 conversions of CPU offsets. A few are kept: a model's self- and cross-attention layers pass
# different offsets.
_cpu_conversions = TensorCache(4)


def _int32_offsets(x: JaggedTensor, name: str) -> torch.Tensor:
    """The offsets as int32, which is what the kernels index rows with. int64 offsets on the CPU are converted
    once while the same tensor comes back unchanged: every layer of a model passes its batch's offsets, and the
    fused CPU path keeps its plan per offsets tensor (``cpu_fused``), so a new copy per call rebuilt the plan for
    every layer. (On a GPU each call converts: a cached copy would have to be kept alive for CUDA graphs and
    across streams.)"""
    if not isinstance(x.total, int):
        # A total that torch.compile holds unbacked (torch._dynamo.mark_unbacked on the values' rows, so that batches of
        # 0 or 1 rows compile no graph of their own) can't be compared here: it is checked when the graph runs.
        torch._check(x.total <= INT32_MAX, lambda: f"{name}: the rows overflow the int32 offsets the attention kernels "
                     f"use (at most {INT32_MAX} rows)")
    if guard_or_false(x.total > INT32_MAX):
        raise ValueError(f"{name}: {x.total} rows overflow the int32 offsets the attention kernels use "
                         f"(at most {INT32_MAX} rows)")
    offsets = x.offsets
    if offsets.dtype == torch.int32:
        return offsets
    if offsets.device.type != "cpu" or torch.compiler.is_compiling():
        return offsets.to(torch.int32)
    return _cpu_conversions.get((offsets,), None, lambda: offsets.to(torch.int32))


# The kernels compute key positions (``i + shift``, a window's edges) in int32. For sequences shorter than 2**28 none
# overflows while query_offset is at most 2**29 and a window side of 2**29 or more is cut as _reach cuts it (host
# constants: nothing here guards on a compiled call's symbolic lengths).
LARGEST_QUERY_OFFSET = 2**29


def _reach(window_left: int, window_right: int, problem: Problem) -> tuple[int, int]:
    """The window's sides, those of ``LARGEST_QUERY_OFFSET`` or more cut to a reach that still sees every key from any
    shift (the same mask): on the right ``max_q + max_k`` (shifts are at least -max_q), on the left
    ``LARGEST_QUERY_OFFSET + max_q`` (shifts are at most ``LARGEST_QUERY_OFFSET``, or max_k)."""
    if window_right >= LARGEST_QUERY_OFFSET:
        window_right = min(window_right, problem.max_q + problem.max_k)
    if window_left >= LARGEST_QUERY_OFFSET:
        window_left = min(window_left, LARGEST_QUERY_OFFSET + problem.max_q)
    return window_left, window_right


def _per_sequence(name: str, value, problem: Problem, device: torch.device,
                  largest: int | None = None) -> torch.Tensor | None:
    """An int or an integer ``(B,)`` tensor (``prefix_len``, ``query_offset``: non-negative) as an int32 ``(B,)``
    tensor on ``device``; values checked where that costs no sync, clamped into range elsewhere. ``largest``: values
    above it raise (``query_offset``); None: values above ``INT32_MAX`` are cut to it (``prefix_len``: a prefix past
    every key is the same mask)."""
    if value is None:
        return None
    top = INT32_MAX if largest is None else largest
    if is_int(value):
        value = check_int(name, value)
        if value < 0 or (largest is not None and value > largest):
            raise ValueError(f"{name}: got {value}; must be in [0, {top}]")
        return torch.full((problem.batch,), min(value, top), dtype=torch.int32, device=device)
    check_tensor(name, value, kind="an int or an integer tensor of shape (B,)")
    check_dtype(name, value, (torch.int32, torch.int64))
    if tuple(value.shape) != (problem.batch,):
        raise ValueError(f"{name}: expected shape ({problem.batch},) (one per sequence), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name}: on device {value.device}, but q is on {device}")
    if checks_metadata(device):
        outside = (value < 0) if largest is None else (value < 0) | (value > largest)
        if bool(outside.any()):
            raise ValueError(f"{name}: got {value.tolist()}; each must be in [0, {top}]")
    return value.clamp(min=0, max=top).to(torch.int32)


def _documents(document_ids, problem: Problem, device: torch.device) -> torch.Tensor | None:
    """``(2, B, S)`` int32: for each token the first row of its document and one past its last (documents
    are runs of equal ids along a row). Built on the device: no sync."""
    if document_ids is None:
        return None
    check_tensor("document_ids", document_ids)
    if not problem.dense:
        raise ValueError("document_ids: only for dense inputs (packed rows); jagged inputs express documents as "
                         "their sequences")
    if problem.max_q != problem.max_k:
        raise ValueError(f"document_ids: needs self-attention over packed rows (Sq == Sk), got Sq = "
                         f"{problem.max_q}, Sk = {problem.max_k}")
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex:
        raise TypeError(f"document_ids: expected an integer or bool tensor, got {document_ids.dtype}")
    if tuple(document_ids.shape) != (problem.batch, problem.max_q):
        raise ValueError(f"document_ids: expected shape (B, S) = ({problem.batch}, {problem.max_q}), got "
                         f"{tuple(document_ids.shape)}")
    if document_ids.device != device:
        raise ValueError(f"document_ids: on device {document_ids.device}, but q is on {device}")
    S = problem.max_q
    pos = torch.arange(S, device=device)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    first = torch.where(starts, pos, 0).cummax(dim=1).values
    last = torch.where(ends, pos + 1, S).flip(1).cummin(dim=1).values.flip(1)
    return torch.stack([first, last]).to(torch.int32)
