"""Compile every Triton (and Gluon) kernel a script launches for a GPU target, on a machine without a GPU.

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
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

_seen = {}
_failures = []
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
    with open(path + ".ttgir", "w") as f:
        f.write(kernel.asm["ttgir"])
    with open(path + ".ptx", "w") as f:
        f.write(kernel.asm["ptx"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--smem-limit", type=int, default=232448, help="bytes per block (sm_90: 227 KiB)")
    ap.add_argument("--sass", default=None, help="folder to write each kernel's cubin, SASS, PTX and TTGIR into")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    target = GPUTarget("cuda", a.arch, 32)
    backend = make_backend(target)
    binders = {}

    def run(self, *args, grid, warmup, **kwargs):
        # What JITFunction.run does before compiling, with Triton's own binder: the specialization key,
        # signature (tuples and namedtuples included), constexprs and attributes of this launch.
        if self not in binders:
            binders[self] = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[self](*args, **kwargs)
        key = (self.__name__, compute_cache_key({}, specialization, options))
        if key in _seen:
            return None
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        t0 = time.time()
        try:
            source = (GluonASTSource if self.is_gluon() else ASTSource)(self, signature, constexprs, attrs)
            k = triton.compile(source, target=target, options=options.__dict__)
            _seen[key] = _resources(k) + f" smem {k.metadata.shared}"
            if k.metadata.shared > a.smem_limit:
                raise RuntimeError(f"shared memory {k.metadata.shared} exceeds the limit {a.smem_limit}")
            if a.sass:
                _dump_sass(k, a.sass, self.__name__, len(_seen))
        except Exception as exc:  # report and go on: the point is to see every failure at once
            _seen[key] = "FAILED"
            cause = exc.__cause__ or exc  # the compiler's own error, under the located one
            _failures.append((self.__name__, constexprs, f"{type(cause).__name__}: {str(cause)[-300:]}"))
            print(f"FAILED {self.__name__} {constexprs}\n{exc}", file=sys.stderr)
            traceback.print_exception(cause, file=sys.stderr)  # (Gluon nests the failing partition's error)
            return None
        if a.verbose:
            print(f"compiled {self.__name__} (warps {options.num_warps}, stages {options.num_stages}) in "
                  f"{time.time() - t0:.1f}s: {_seen[key]}", flush=True)
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
