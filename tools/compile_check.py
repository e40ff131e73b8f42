"""Compile every Triton kernel a script launches for a GPU target, on a machine without a GPU.

    python tools/compile_check.py --arch 90 SCRIPT [ARGS...]

Runs SCRIPT with CPU tensors; each kernel launch is compiled ahead of time for the target (cuda:90 =
Hopper) instead of being run, and reported once per distinct specialization. Catches what the
interpreter accepts but the compiler rejects (constexpr misuse, layout or type errors), and prints
registers/spills/shared memory, without spending device time. Outputs of launched kernels stay
unwritten, so the script's numbers are meaningless here; only compilation is checked.
"""

import argparse
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "u1",
           torch.int16: "i16"}
_seen = {}
_failures = []


def _signature(fn, args, kwargs):
    bound = fn.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for p in fn.params:
        v = bound.arguments[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif type(v).__name__ == "TensorDescriptor":
            signature[p.name] = f"tensordesc<{_DTYPES[v.base.dtype]}[{', '.join(map(str, v.block_shape))}]>"
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _DTYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "u1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        elif v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = None
        else:
            raise TypeError(f"{fn.__name__}: can't type argument {p.name}={v!r}")
    return signature, constexprs


_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _resources(kernel) -> str:
    """Registers, stack and spill bytes from the cubin (cuobjdump ships with Triton)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return f"regs {m[1]} stack {m[2]} local {m[4]}" if m else "resources: ?"


def _dump_sass(kernel, folder, name, n):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{n:03d}_{name}")
    with open(path + ".cubin", "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-sass", path + ".cubin"],
                          capture_output=True, text=True).stdout
    with open(path + ".sass", "w") as f:
        f.write(sass)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--smem-limit", type=int, default=232448, help="bytes per block (sm_90: 227 KiB)")
    ap.add_argument("--sass", default=None, help="folder to write each kernel's cubin and SASS into")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    target = GPUTarget("cuda", a.arch, 32)

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kwargs}
        signature, constexprs = _signature(self, args, kwargs)
        key = (self.__name__, tuple(signature.items()), tuple((k, str(v)) for k, v in constexprs.items()),
               tuple(sorted(options.items())))
        if key in _seen:
            return None
        t0 = time.time()
        try:
            k = triton.compile(ASTSource(self, signature, constexprs), target=target, options=options)
            _seen[key] = _resources(k) + f" smem {k.metadata.shared}"
            if k.metadata.shared > a.smem_limit:
                raise RuntimeError(f"shared memory {k.metadata.shared} exceeds the limit {a.smem_limit}")
            if a.sass:
                _dump_sass(k, a.sass, self.__name__, len(_seen))
        except Exception as exc:  # report and go on: the point is to see every failure at once
            _seen[key] = "FAILED"
            _failures.append((self.__name__, constexprs, options, str(exc).splitlines()[-1][:300]))
            print(f"FAILED {self.__name__} {options} {constexprs}\n{exc}", file=sys.stderr)
            return None
        if a.verbose:
            print(f"compiled {self.__name__} {options} in {time.time() - t0:.1f}s: {_seen[key]}", flush=True)
        return None

    JITFunction.run = run
    sys.argv = [a.script, *a.args]
    try:
        runpy.run_path(a.script, run_name="__main__")
    finally:
        print(f"{len(_seen)} kernel specializations compiled for sm_{a.arch}, {len(_failures)} failed")
        for f in _failures:
            print("FAILED", f)
    sys.exit(1 if _failures else 0)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main()
