"""PyTorch's prototype ``context_parallel`` as a baseline for ``ring_bench`` (run inside its
torchrun processes): SDPA made ring attention over a device mesh, on the same problem; where the
prototype fails, a row whose note says why."""
from __future__ import annotations

import torch
import torch.distributed as dist

_MESH = None                     # one device mesh (and its process groups) for every case

def context_parallel_ms(n: int, causal: bool, reps: int, H: int, D: int, dtype, timer):
    """(ms, note) of PyTorch's prototype ``context_parallel`` (SDPA made ring attention over the
    device mesh, its own load balancing for causal) on the same problem, or (None, why not)."""
    import torch.nn.functional as F
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        global _MESH
        _MESH = _MESH or init_device_mesh("cuda", (dist.get_world_size(),))
        g = torch.Generator(device="cuda").manual_seed(1234)
        q, k, v = (torch.randn(1, H, n, D, device="cuda", dtype=dtype, generator=g)
                   for _ in range(3))
        with context_parallel(_MESH, buffers=(q, k, v), buffer_seq_dims=(2, 2, 2)):
            ms, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                          reps)
        return ms, "torch.distributed.tensor.experimental.context_parallel around SDPA"
    except Exception as e:  # noqa: BLE001 - a prototype: a failure is a noted row
        torch.cuda.synchronize()
        return None, f"not measured: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:140]}"


def cp_row(n, causal, P, ms, note, H, D, peak_tflops):
    from flashbook.reference import attention_flops
    from flashbook.results import Row
    tflops = attention_flops(1, H, n, n, D, causal) / (ms * 1e-3) / 1e12 if ms else None
    pct = 100 * tflops / (peak_tflops * P) if tflops and peak_tflops else None
    return Row(kernel="context_parallel", role="baseline", B=1, H_q=H, H_kv=H, N_q=n, N_k=n, d=D,
               dtype="float16", causal=causal, ms=ms, tflops=tflops, gbps=None, pct_peak=pct,
               note=f"world_size={P}; {note}")

