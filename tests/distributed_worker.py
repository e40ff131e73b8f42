"""What each spawned rank of tests/test_distributed.py runs: context-parallel attention against
``varlen.attention`` on the whole batch in one process (every rank computes that too and compares its
own rows). A failed check raises in the rank, which fails the spawning test."""

from __future__ import annotations

import gc
import os
import sys
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

import varlen
from utils import rel_err
from varlen.distributed import ContextParallel

# Each case: attention keyword arguments plus test settings (dtype, backend, balance, lse in the loss).
CASES = [
    dict(causal=True, heads=(4, 2), penalty=True),
    dict(causal=False, dims=(8, 12), softcap=3.0),
    dict(window=(5, 2), alibi="BH"),
    dict(causal=True, window=(7, None), alibi="H", prefix=True),
    dict(causal=True, dropout_p=0.3, lse=True),
    dict(causal=True, balance="tokens", lse=True),
    dict(causal=True, deterministic=True, heads=(2, 1)),
    dict(causal=True, window=(6, 3), heads=(6, 3), head_chunks=1, alibi="H"),  # every head in one call
    dict(causal=True, heads=(6, 3), head_chunks=3, lse=True),
]
TRITON_CASES = [dict(causal=True, heads=(4, 2), backend="triton", dtype=torch.float32, lse=True)]
# On GPUs (NCCL): bf16 through the Triton kernels, longer sequences, judged by flash-attn's rule.
NCCL_CASES = [
    dict(causal=True, heads=(8, 2), dims=(64, 64), dtype=torch.bfloat16, backend="triton", lse=True, long=True),
    dict(causal=True, window=(300, None), heads=(4, 4), dims=(128, 128), dtype=torch.bfloat16, backend="triton",
         long=True),
    dict(causal=False, alibi="H", softcap=20.0, heads=(4, 4), dims=(80, 80), dtype=torch.float16,
         backend="triton", long=True),
    dict(causal=True, dropout_p=0.2, heads=(4, 2), dims=(64, 64), dtype=torch.bfloat16, backend="triton",
         long=True, balance="tokens"),
]


def _lengths(world: int, seed: int, long: bool = False) -> list[int]:
    """Random lengths with the edge cases: empty, single rows, shorter than the world, one long."""
    g = torch.Generator().manual_seed(seed)
    if long:
        return [0, 1, max(1, world - 1), 3000, *torch.randint(1, 1500, (5,), generator=g).tolist()]
    return [0, 1, max(1, world - 1), 40 + world * 9, *torch.randint(0, 24, (4,), generator=g).tolist()]


def _check(name, got, want, tol, whole=None):
    """``got`` within ``tol`` of ``want``; with ``whole`` (the one-process result in the same precision, ``want``
    then the float64 one), flash-attn's rule instead: at most twice one process's error, plus ``tol``."""
    # Every value compared must be finite (rel_err skips the non-finite entries that two tensors share, and an
    # infinite error of ``whole`` would allow anything), and an all-zero ``want`` leaves the error relative to
    # 1e-30, not absolute.
    for t in (got, want) if whole is None else (got, want, whole):
        if not bool(torch.isfinite(t).all()):
            raise AssertionError(f"{name}: non-finite values")
    err = rel_err(got, want, floor=1e-30)
    allowed = tol if whole is None else 2 * rel_err(whole, want, floor=1e-30) + tol
    if not err <= allowed:
        raise AssertionError(f"{name}: relative error {err:.3g} > {allowed:.3g}")


def run_case(cp: ContextParallel, case: dict, lengths: list[int], device: torch.device, seed: int):
    dtype = case.get("dtype", torch.float64)
    H, Hkv = case.get("heads", (2, 2))
    D, Dv = case.get("dims", (8, 8))
    B = len(lengths)
    g = torch.Generator().manual_seed(seed)  # the same on every rank: the same global batch
    total = sum(lengths)
    q = torch.randn(total, H, D, generator=g, dtype=torch.float64).to(device, dtype)
    k = torch.randn(total, Hkv, D, generator=g, dtype=torch.float64).to(device, dtype)
    v = torch.randn(total, Hkv, Dv, generator=g, dtype=torch.float64).to(device, dtype)
    dout = torch.randn(total, H, Dv, generator=g, dtype=torch.float64).to(device, dtype)
    dlse = torch.randn(H, total, generator=g, dtype=torch.float64).to(device)
    options = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap", 0.0),
                   dropout_p=case.get("dropout_p", 0.0), deterministic=case.get("deterministic", False))
    if case.get("alibi") == "H":
        options["alibi_slopes"] = torch.rand(H, generator=g, dtype=torch.float64).to(device, dtype)
    elif case.get("alibi") == "BH":
        options["alibi_slopes"] = torch.rand(B, H, generator=g, dtype=torch.float64).to(device, dtype)
    if case.get("prefix"):
        options["prefix_len"] = torch.randint(0, 12, (B,), generator=g).to(device)
    backend = case.get("backend", "torch")

    def loss(out, lse, rows):
        value = (out.double() * dout[rows].double()).sum()
        if case.get("lse"):
            value = value + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse[:, rows]).sum()
        return value

    # The whole batch in one process (and, for low precision, in float64 too).
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0)

    def one_process(dtype, backend):
        leaves = [t.to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        whole = [varlen.JaggedTensor(t, offsets) for t in leaves]
        generator = torch.Generator(device=device).manual_seed(seed) if options["dropout_p"] else None
        opts = {n: o.to(dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                for n, o in options.items()}
        out, lse = varlen.attention(*whole, **opts, generator=generator, return_lse=True, backend=backend)
        loss(out.values, lse, slice(None)).backward()
        return out, lse, leaves

    out, lse, leaves = one_process(dtype, backend)
    low = dtype not in (torch.float64, torch.float32)
    if low:
        out64, lse64, leaves64 = one_process(torch.float64, "torch")
    # This rank's rows, context-parallel.
    rows = cp.local_index.to(device)
    local = [t[rows].clone().requires_grad_(True) for t in (q, k, v)]
    generator = torch.Generator(device=device).manual_seed(seed) if options["dropout_p"] else None
    out_cp, lse_cp = cp.attention(*local, **options, generator=generator, return_lse=True, backend=backend,
                                  head_chunks=case.get("head_chunks"))
    loss(out_cp, lse_cp, rows).backward()
    finite = torch.isfinite(lse[:, rows])
    if not torch.equal(finite, torch.isfinite(lse_cp)):
        raise AssertionError("lse: rows that see no key differ")
    if not low:
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        _check("out", out_cp, out.values[rows], tol)
        _check("lse", lse_cp[finite], lse[:, rows][finite], tol)
        for name, got, whole_leaf in zip(("dq", "dk", "dv"), local, leaves, strict=True):
            _check(name, got.grad, whole_leaf.grad[rows], tol)
        if case.get("penalty"):
            _check_double_backward_raises(cp, local, options, backend, lambda out: loss(out, None, rows))
        return
    _check("out", out_cp, out64.values[rows], 1e-5, whole=out.values[rows])
    _check("lse", lse_cp[finite], lse64[:, rows][finite], 1e-6, whole=lse[:, rows][finite])
    for name, got, whole_leaf, leaf64 in zip(("dq", "dk", "dv"), local, leaves, leaves64, strict=True):
        _check(name, got.grad, leaf64.grad[rows], 1e-5, whole=whole_leaf.grad[rows])


def _check_double_backward_raises(cp, local, options, backend, loss):
    """A gradient penalty (create_graph=True, then the gradient times the input) raises instead of dropping the
    second-order term; every rank raises at the same point, before any collective of the second backward. (After the
    gradient checks: the failed backward may already have added to the leaves' gradients.)"""
    (dq,) = torch.autograd.grad(loss(cp.attention(*local, **options, backend=backend)), local[0], create_graph=True)
    try:
        (dq * local[0]).sum().backward()
    except NotImplementedError as exc:
        if "double backward" not in str(exc):
            raise
    else:
        raise AssertionError("a double backward through context-parallel attention did not raise")


def worker(rank: int, world: int, port: int, suite: str):
    torch.set_num_threads(1)
    nccl = suite == "nccl"
    if nccl:
        torch.cuda.set_device(rank)
    # Our own store, so that it outlives the process group: the exit handshake below runs on it.
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(minutes=5))
    dist.init_process_group("nccl" if nccl else "gloo", store=store, rank=rank, world_size=world)
    try:
        run_suite(rank, world, suite, torch.device("cuda", rank) if nccl else torch.device("cpu"))
        # A gloo group torn down while something still holds it, or while a peer is still connected, aborts the
        # process now and then ("terminate called without an active exception": the world-3 case 2 of 6 runs on a
        # 2-core machine, the world-2 case once in CI with the barrier alone). So the suite's objects go first (a
        # ContextParallel holds the group; what compiled code keeps of it stays, hence the os._exit below), then
        # every rank finishes its collectives before any tears the group down. (Not in `finally`: a rank that
        # failed mid-case would wait there for peers stuck in another collective.)
        gc.collect()
        dist.barrier()
    except BaseException:
        # Printed here: this rank's teardown closes its connections, and a peer failing on that may be the
        # error mp.spawn reports.
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    # The store's host (rank 0) leaves last, once every rank's group is down (bounded by the store's timeout);
    # then no rank runs the interpreter's teardown, where what is left of a gloo group can still abort it.
    store.set(f"group_down_{rank}", "1")
    if rank == 0:
        store.wait([f"group_down_{r}" for r in range(world)])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_suite(rank: int, world: int, suite: str, device: torch.device):
    cases = {"torch": CASES, "triton": TRITON_CASES, "nccl": NCCL_CASES}.get(suite, [])
    for index, case in enumerate(cases):
        seed = zlib.crc32(f"{suite}-{world}-{index}".encode())
        lengths = _lengths(world, seed, case.get("long", False))
        offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
        cp = ContextParallel(offsets, balance=case.get("balance", "causal"))
        try:
            run_case(cp, case, lengths, device, seed)
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}/{world}, case {case}, lengths {lengths}: {exc}") from exc
    if suite == "compile":
        run_compiled(rank, world)
    if suite == "ddp":
        run_ddp(rank, world)


def run_compiled(rank: int, world: int):
    """``torch.compile(fullgraph=True)`` over the context-parallel call gives eager's output and gradients."""
    lengths = _lengths(world, 5)
    cp = ContextParallel(torch.tensor([0, *lengths]).cumsum(0))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(cp.local_rows, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def step(q, k, v):
        return (cp.attention(q, k, v, causal=True) ** 2).sum()

    grads = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        _check("compiled grad", b, a, 1e-12)


def run_ddp(rank: int, world: int):
    """A model under DistributedDataParallel, its attention context-parallel in the same process group: the
    averaged parameter gradients are the whole batch's over the world size."""
    from torch.nn.parallel import DistributedDataParallel

    lengths = _lengths(world, 9)
    cp = ContextParallel(torch.tensor([0, *lengths]).cumsum(0))
    torch.manual_seed(0)
    proj = torch.nn.Linear(6, 3 * 2 * 4, dtype=torch.float64)
    x = torch.randn(sum(lengths), 6, dtype=torch.float64)

    def forward(model, rows, attend):
        qkv = model(x[rows]).view(-1, 3, 2, 4)
        return attend(qkv[:, 0], qkv[:, 1], qkv[:, 2]).pow(2).sum()

    offsets = torch.tensor([0, *lengths]).cumsum(0)
    whole = forward(proj, slice(None), lambda q, k, v: varlen.attention(
        *(varlen.JaggedTensor(t, offsets) for t in (q, k, v)), causal=True).values)
    reference = torch.autograd.grad(whole, list(proj.parameters()))
    model = DistributedDataParallel(proj)
    forward(model, cp.local_index, lambda q, k, v: cp.attention(q, k, v, causal=True)).backward()
    for p, want in zip(model.parameters(), reference, strict=True):
        _check("ddp grad", p.grad * world, want, 1e-10)
    # (DDP's reducer must be gone before the process group, or gloo's threads abort the process: `worker`
    # collects it before the teardown.)
