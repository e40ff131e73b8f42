"""New batches must not compile new kernel variants: lengths, totals and maxima stay out of Triton's keys.

On the CPU, ``specialization_probe.py`` computes the specialization key of every launch with Triton's own
binder (no GPU needed); on the GPU the kernels' compile caches are counted around a stream of real batches.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import varlen

PROBE = os.path.join(os.path.dirname(__file__), "specialization_probe.py")


def test_random_batches_reuse_the_warm_up_variants():
    done = subprocess.run([sys.executable, PROBE, "--batches", "50"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    # The probe saw the kernels of attention (forward, backward, dQ kernel) and of the jagged ops.
    assert {"_attn_fwd_kernel", "_bwd_kv_kernel", "_bwd_q_kernel", "_jagged_to_padded_kernel",
            "_segment_sum_kernel", "_softmax_single_kernel", "_grouped_matmul_kernel", "_norm_fwd_kernel",
            "_norm_bwd_kernel", "_norm_sum_parts_kernel", "_swiglu_fwd_kernel", "_swiglu_bwd_kernel",
            "_rotary_kernel", "_cross_entropy_fwd_kernel", "_cross_entropy_bwd_kernel"} <= set(report["kernels"])
    assert report["new_after_warmup"] == {}, json.dumps(report["new_after_warmup"], indent=1)


def _compiled_variants() -> dict[str, int]:
    """Compiled variants per varlen kernel on the current device."""
    import triton.runtime.jit as jit

    import varlen.attn.triton.backend  # noqa: F401  (load every kernel module)
    import varlen.ops._linear_kernels  # noqa: F401
    from varlen._launch import FastLaunch

    counts = {}
    for name, module in sys.modules.items():
        if not name.startswith("varlen"):
            continue
        for attr, value in vars(module).items():
            value = value.kernel if isinstance(value, FastLaunch) else value
            if isinstance(value, jit.JITFunction):
                caches = value.device_caches.get(torch.cuda.current_device())
                counts[f"{name}.{attr}"] = 0 if caches is None else len(caches[0])
    return counts


@pytest.mark.gpu_only
def test_gpu_batch_stream_compiles_nothing_after_warm_up():
    gen = torch.Generator().manual_seed(0)
    layer = varlen.nn.TransformerEncoderLayer(256, 4, 1024, 0.1, causal=True, device="cuda")

    def step():
        lengths = torch.randint(1, 1025, (64,), generator=gen).tolist()
        x = varlen.jagged([torch.randn(n, 256) for n in lengths], device="cuda").requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
            pooled = varlen.mean(varlen.softmax(y, 1), 1)
        # bf16 outside autocast: the ragged-dim softmax forward's 16-bit kernel (shared memory on sm_90)
        probs = varlen.softmax(y.with_values(y.values.to(torch.bfloat16)), 1)
        (pooled.sum() + y.to_padded().sum() + probs.values.float().sum()).backward()

    step()
    torch.cuda.synchronize()
    before = _compiled_variants()
    assert sum(before.values()) > 0, ("the probe found no Triton caches (no compiled variants in any varlen kernel's "
                                      "device_caches after the warm-up step): it can't see new compilations")
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    after = _compiled_variants()
    grown = {name: (before.get(name, 0), n) for name, n in after.items() if n != before.get(name, 0)}
    assert grown == {}, f"kernels that compiled new variants after the warm-up: {grown}"
