"""Chapter 6's config planner for the Gluon FlashAttention-3 kernel (``gluon_fa3``), a
configuration of the toolkit's kit (``flashbook.planning``, which says how Triton places shared
memory and how ``setmaxnreg`` moves registers): what a config costs in shared memory and
registers, whether an H100/H200 can run it, and which feasible config a simple model expects to
be fastest. Pure Python: no GPU, no Triton.

A config fixes the head dim d, the dtype (2 bytes), BLOCK_M query rows per consumer warpgroup,
BLOCK_N keys per K/V tile, STAGES slots in the K/V ring and the number of consumer warpgroups
(the kernel has 2, plus one producer warp padded to a warpgroup).

**Shared memory** (``shared_memory``) is byte-exact against the compiled kernel's
``metadata.shared`` (``tests/test_ch6.py`` compiles it for sm_90a and compares). The buffers:
the tiles Q ``2*BLOCK_M*d*2`` (one tile per consumer, reused for O), K and V
``STAGES*BLOCK_N*d*2`` each; the mbarriers ``q_bars[2]``, ``k_full``, ``k_empty``, ``v_full``,
``v_empty`` (``STAGES`` each) and the ping-pong ``sched[2]``; ``gl.warp_specialize``'s 220 bytes
of captured arguments and one state byte per extra warp (``4*CONSUMERS``: the producer warp is
padded to a full warpgroup). So d=128, 64/128, 2 stages: 163840 bytes of tiles + 224 + 96 + 8 =
164168 bytes.

**Registers** (``register_budget``): with ``(CONSUMERS + 1) * 128`` threads the launch gives
each 168 (384 threads); then the producer warpgroup drops to 24 (the minimum) and each consumer
takes the rest, 240 for two consumers (2*128*240 + 128*24 = 64,512). Triton emits the
setmaxnreg calls from the per-partition requests the launcher passes (``CONSUMER_REGS``,
``PRODUCER_REGS``). ``consumer_registers`` estimates what one consumer thread keeps live: the O
accumulator ``BLOCK_M*d/128`` fp32 registers, S ``BLOCK_M*BLOCK_N/128``, P in 16 bits
``BLOCK_M*BLOCK_N/256``, plus 32 for addresses, counters, row statistics and masks (calibrated
against ptxas: 64/128/128 uses no spill, 64/256 at d=64 and 128-row consumers spill).

**Speed model** (``predict``), per SM, in clock cycles at the 1.83 GHz the quoted peak assumes.
One consumer's tile costs ``g = 4*BLOCK_M*BLOCK_N*d / 4096 / 0.726`` cycles of tensor cores
(QK^T and PV; an SM does 4,096 dense fp16 FLOP a clock, of which wgmma with 64-row warpgroup
tiles sustained 72.6% here) and ``s = 0.12*BLOCK_M*BLOCK_N + 2.1*BLOCK_M`` cycles of softmax
(per score: an FMA, an exp2 on the 16 MUFU lanes, max, sum, the 16-bit pack; per row: the
shuffles and the statistics). With the ping-pong the tensor cores alternate between the
consumers, so a tile of the CTA takes ``max(CONSUMERS*g, g + s) + 520`` (520: the barrier
handshakes, the token and the bar.syncs of a tile). A CTA also pays ``1000 + g + s + 500`` to
fill and drain the pipeline (a TMA round trip to L2 ~1000 cycles) and stalls
``1000 - (STAGES-1)*tile`` more per tile when the ring cannot cover that latency. CTAs run one
per SM (registers); causal CTAs are summed over the SMs (the kernel starts the longest first).
The four constants 0.726, 0.12, 2.1 and 520 were fitted to H200 measurements (fp16, triton 3.6;
d=128 at 64x128 and 64x64, d=64 at 64x128 and 128x64): non-causal within 4%, causal
over-estimated by up to 13% at N=4096 (the masked diagonal tiles are not modelled), and
BLOCK_N=128 ranked first for both head dims, as measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from flashbook.planning import (BARRIER_ALIGN, CAPTURE_ALIGN, GPU, H100, H200, MBARRIER_BYTES,
                                REGISTERS_PER_SM, SETMAXNREG_MAX, SETMAXNREG_MIN, STATE_ALIGN,
                                SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, TILE_ALIGN, Tunables,
                                Verdict, capture_bytes, end, input_reasons, is_setmaxnreg,
                                launch_registers, place, rest_registers, verdict)

__all__ = ["Config", "GPU", "H100", "H200", "GPUS", "Verdict", "shared_memory",
           "shared_memory_layout", "register_budget", "consumer_registers", "feasible", "predict",
           "rank", "best", "candidates", "kv_tiles", "cta_tiles", "SUPPORTED_HEAD_DIMS",
           "SUPPORTED_DTYPES", "REGISTERS_PER_SM", "SETMAXNREG_MIN", "SETMAXNREG_MAX"]

PRODUCER_REGS = 24
# the worker partitions' captured arguments: 3 smem tiles of rank 4, 6 barrier arrays of rank
# 2, 4 tensor descriptors and the LSE pointer, N_Q, N_K and qk_scale: 220 bytes
CAPTURE_BYTES = capture_bytes(descriptors=5, views=(4,) * 3 + (2,) * 6, scalars=3)


@dataclass(frozen=True)
class Config(Tunables):
    """The kernel's tunables. ``HEAD_DIM`` and ``DTYPE`` may stay None in a config handed to
    ``attention_fa3`` (the inputs fill them in, ``for_inputs``); the planner needs them set."""
    BLOCK_M: int = 64          # query rows per consumer warpgroup (wgmma's M is 64 a warpgroup)
    BLOCK_N: int = 128         # keys per K/V tile
    STAGES: int = 2            # slots in the K/V shared-memory ring
    OVERLAP: bool = True       # FA3's intra-warpgroup order (QK^T waited before PV)
    CONSUMERS: int = 2         # consumer warpgroups (the kernel has exactly 2)
    HEAD_DIM: int | None = None
    DTYPE: str | None = None   # "float16" or "bfloat16"

    @property
    def rows_per_cta(self) -> int:
        return self.BLOCK_M * self.CONSUMERS

    @property
    def threads(self) -> int:
        return 128 * (self.CONSUMERS + 1)


GPUS = {"h100": H100, "h200": H200}


# ------------------------------------------------------------------------------------------------
# the kernel's tile counts (the same integer arithmetic as fa3_kernel._kv_tiles / _cta_tiles)
# ------------------------------------------------------------------------------------------------
def kv_tiles(row0: int, n_q: int, n_k: int, block_m: int, block_n: int,
             causal: bool) -> tuple[int, int]:
    """For the query rows [row0, row0 + block_m): (tiles, full) — the K/V tiles they read, and
    how many of the first ones need no mask. Causal is bottom-right: key j is visible to query
    i when j <= i + n_k - n_q."""
    if causal:
        off = n_k - n_q
        hi = max(min(row0 + block_m + off, n_k), 0)
        lo = max(min(row0 + off + 1, n_k), 0)
        return -(-hi // block_n), lo // block_n
    return -(-n_k // block_n), n_k // block_n


def cta_tiles(m_block: int, n_q: int, n_k: int, block_m: int, block_n: int, causal: bool,
              consumers: int = 2) -> int:
    """The K/V tiles the producer streams for one CTA: the most any of its consumers reads."""
    rows = consumers * block_m
    return max(kv_tiles(m_block * rows + w * block_m, n_q, n_k, block_m, block_n, causal)[0]
               for w in range(consumers))


# ------------------------------------------------------------------------------------------------
# shared memory and registers
# ------------------------------------------------------------------------------------------------
def shared_memory_layout(config: Config) -> list[tuple[str, int, int]]:
    """``(name, offset, size)`` of every buffer, as Triton's allocator places them."""
    d, e = config._need()
    s, n = config.STAGES, config.CONSUMERS
    barriers = [("q_bars", n), ("k_full", s), ("k_empty", s), ("v_full", s), ("v_empty", s),
                ("sched", n)]
    kv = s * config.BLOCK_N * d * e
    return place(  # program order (the kernel's allocations), then the warp-specialize scratch
        [("q", n * config.BLOCK_M * d * e, TILE_ALIGN), ("k", kv, TILE_ALIGN),
         ("v", kv, TILE_ALIGN)]
        + [(name, MBARRIER_BYTES * k, BARRIER_ALIGN) for name, k in barriers]
        + [("warp_states", 4 * n, STATE_ALIGN), ("captures", CAPTURE_BYTES, CAPTURE_ALIGN)])


def shared_memory(config: Config) -> int:
    """Bytes of shared memory the compiled kernel allocates (its ``metadata.shared``)."""
    return end(shared_memory_layout(config))


def register_budget(config: Config) -> dict:
    """Registers per thread for each role (setmaxnreg budgets: multiples of 8 in [24, 256])."""
    consumer = rest_registers(128 * PRODUCER_REGS, 128 * config.CONSUMERS)
    return dict(launch=launch_registers(config.threads), consumer=consumer,
                producer=PRODUCER_REGS,
                total=128 * (config.CONSUMERS * consumer + PRODUCER_REGS))


def consumer_registers(config: Config) -> int:
    """Estimated registers one consumer thread keeps live (see the module docstring)."""
    d, _ = config._need()
    o = config.BLOCK_M * d // 128
    s = config.BLOCK_M * config.BLOCK_N // 128
    p = config.BLOCK_M * config.BLOCK_N // 256
    return o + s + p + 32


def feasible(config: Config, gpu: GPU = H100) -> Verdict:
    """Can ``gpu`` run ``config``? Checks the kernel's shape rules, the shared memory per block,
    the register budgets and the threads; ``reasons`` says what fails."""
    c, inputs = config, input_reasons(config)
    smem, budget, need = shared_memory(c), register_budget(c), consumer_registers(c)
    return verdict(inputs + [
        (c.BLOCK_M % 64 or c.BLOCK_M < 64,
         f"BLOCK_M={c.BLOCK_M}: a warpgroup's wgmma covers 64-row multiples"),
        (c.BLOCK_N not in (16, 32, 64, 128, 256),
         f"BLOCK_N={c.BLOCK_N}: a power of two from 16 to 256 (wgmma N <= 256)"),
        (c.STAGES < 2, f"STAGES={c.STAGES}: the ring needs 2 slots to overlap loads"),
        (c.CONSUMERS < 1, "at least one consumer warpgroup"),
        (c.threads > gpu.max_threads, f"{c.threads} threads > {gpu.max_threads}"),
        (smem > gpu.smem_per_block,
         f"shared memory {smem} B > {gpu.smem_per_block} B per block on {gpu.name}"),
        (budget["total"] > gpu.regs_per_sm,
         f"registers {budget['total']} > {gpu.regs_per_sm} per SM"),
        (not is_setmaxnreg(budget["consumer"]),
         f"consumer budget {budget['consumer']} is not a setmaxnreg value"),
        (need > budget["consumer"],
         f"a consumer thread needs ~{need} registers > its {budget['consumer']} (spills)")])


# ------------------------------------------------------------------------------------------------
# the speed model and the ranking
# ------------------------------------------------------------------------------------------------
L2_LATENCY, TILE_SYNC, EPILOGUE, WGMMA_EFFICIENCY = 1000, 520, 500, 0.726
SOFTMAX_PER_SCORE, SOFTMAX_PER_ROW = 0.12, 2.1


def _tile_cycles(config: Config) -> tuple[float, float, float]:
    d, _ = config._need()
    g = 4 * config.BLOCK_M * config.BLOCK_N * d / 4096 / WGMMA_EFFICIENCY
    s = SOFTMAX_PER_SCORE * config.BLOCK_M * config.BLOCK_N + SOFTMAX_PER_ROW * config.BLOCK_M
    tile = max(config.CONSUMERS * g, g + s) + TILE_SYNC
    tile += max(0.0, L2_LATENCY - (config.STAGES - 1) * tile)
    return g, s, tile


def predict(config: Config, B: int, H: int, N_q: int, N_k: int | None = None,
            causal: bool = False, gpu: GPU = H100) -> dict:
    """The model's time (ms) and TFLOP/s for one problem (FLOPs: 4*N_q*N_k*d per head, half
    of it for causal with N_q == N_k)."""
    d, _ = config._need()
    N_k = N_q if N_k is None else N_k
    g, s, tile = _tile_cycles(config)
    rows = config.rows_per_cta
    m_blocks = -(-N_q // rows)
    fill = L2_LATENCY + g + s + EPILOGUE

    def tiles(mb):
        return cta_tiles(mb, N_q, N_k, config.BLOCK_M, config.BLOCK_N, causal, config.CONSUMERS)

    per_cta = [fill + tiles(mb) * tile for mb in range(m_blocks)]
    if causal:
        cycles = max(sum(per_cta) * B * H / gpu.sms, max(per_cta))
    else:
        cycles = math.ceil(m_blocks * B * H / gpu.sms) * per_cta[0]
    ms = cycles / (gpu.clock_ghz * 1e9) * 1e3
    flops = 4 * B * H * N_q * N_k * d * (0.5 if causal and N_q == N_k else 1.0)
    return dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, tile_cycles=tile, g=g, s=s)


def candidates(head_dim: int, dtype: str = "float16") -> list[Config]:
    """The configs the kernel supports (two consumers) for one head dim and dtype."""
    return [Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=st, OVERLAP=ov, HEAD_DIM=head_dim, DTYPE=dtype)
            for bm in (64, 128) for bn in (64, 128, 256) for st in (2, 3, 4)
            for ov in (True, False)]


def rank(head_dim: int, dtype: str = "float16", *, B: int = 1, H: int = 16, N_q: int = 16384,
         N_k: int | None = None, causal: bool = False, gpu: GPU = H100,
         configs: list[Config] | None = None) -> list[tuple[Config, dict]]:
    """Feasible configs, fastest first by ``predict``; ties go to the smaller BLOCK_M (more CTAs
    to balance), then the smaller shared memory, then OVERLAP (FA3's order)."""
    out = []
    for c in configs or candidates(head_dim, dtype):
        c = c if c.HEAD_DIM else c.for_inputs(head_dim, dtype)
        if feasible(c, gpu):
            out.append((c, predict(c, B, H, N_q, N_k, causal, gpu)))
    out.sort(key=lambda cp: (round(cp[1]["ms"], 9), cp[0].BLOCK_M, shared_memory(cp[0]),
                             not cp[0].OVERLAP))
    return out


def best(head_dim: int, dtype: str = "float16", **problem) -> Config:
    """The fastest feasible config by the model (``rank``'s first)."""
    ranked = rank(head_dim, dtype, **problem)
    if not ranked:
        raise ValueError(f"planner: no feasible config for d={head_dim}, {dtype}.")
    return ranked[0][0]
