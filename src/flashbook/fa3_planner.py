"""Chapter 6's config planner for the Gluon FA3 kernel (``fa3_launch``), a configuration of the
toolkit's ``flashbook.planning``: what a config costs in shared memory and registers, whether an
H100/H200 runs it, which feasible config a simple model expects fastest (``chapters.ch6``
re-exports it as ``planner``). Pure Python.

A config: head dim d, dtype (2 bytes), BLOCK_M query rows per consumer warpgroup, BLOCK_N keys
per K/V tile, STAGES ring slots, two consumer warpgroups (or three: ``three_consumers``) plus a
producer warp padded to one.

**Shared memory** (``shared_memory``, byte-exact with the compiled kernel's ``metadata.shared``,
tests/test_ch6.py): Q ``2*BLOCK_M*d*2`` (one tile per consumer, reused for O), K and V
``STAGES*BLOCK_N*d*2`` each, the mbarriers (``q_bars[2]``, K/V full and empty per stage,
``sched[2]``), ``gl.warp_specialize``'s 220 bytes of captured arguments and a state byte per
extra warp: d=128, 64/128, 2 stages is 163840 + 224 + 96 + 8 = 164168 bytes. A persistent
kernel adds O's own tiles (``2*BLOCK_M*d*2``: Q is freed after the last QK^T, so O cannot use
it) and two ``q_free`` barriers.

**Registers** (``register_budget``): 384 threads launch with 168 each; the producer drops to 24
and each consumer takes the rest, 240 (2*128*240 + 128*24 = 64,512); with three consumers 512
threads launch with 128 and the consumers take 160 (3*128*160 + 128*24 = 64,512). ``consumer_registers``
estimates a consumer thread's live registers: O ``BLOCK_M*d/128`` fp32, S
``BLOCK_M*BLOCK_N/128``, P ``BLOCK_M*BLOCK_N/256``, plus 32 (calibrated against ptxas' spills).

**Speed model** (``predict``), cycles per SM at 1.83 GHz: a consumer's tile costs
``g = 4*BLOCK_M*BLOCK_N*d / 4096 / 0.726`` tensor-core cycles (4,096 fp16 FLOP a clock, 72.6%
sustained by 64-row wgmma) and ``s = 0.12*BLOCK_M*BLOCK_N + 2.1*BLOCK_M`` of softmax (per score
an FMA, a MUFU exp2, max, sum, the pack; per row the shuffles). With the ping-pong a CTA's tile
takes ``max(2g, g + s) + 520`` (barrier handshakes), plus ``1000 - (STAGES-1)*tile`` where the
ring cannot cover an L2 round trip (~1000 cycles); a CTA pays ``1000 + g + s + 500`` to fill and
drain. One CTA per SM; causal CTAs are summed over the SMs (a persistent kernel's, ``PERSISTENT``:
its static schedule, ``work_tiles``, CTA by CTA: the slowest sets the time). The constants were
fitted to H200 measurements (fp16, triton 3.6): non-causal within 4%, causal over by up to 13% at
N=4096 (the masked diagonal tiles are not modelled), BLOCK_N=128 ranked first for both head dims,
as measured.

**The choice** (``best``): the model ranks the tile configs (``rank``); whether the kernel runs
persistent is a rule measured on an H100 (``prefers_persistent``: causal with N_q <= 4096,
non-causal up to 4096 rows at d = 128 and 1024 at d = 64), since the model, balancing causal
CTAs perfectly, cannot see the uneven waves a persistent schedule evens out, nor the Q load and
O store a short grid CTA waits for (the comment above ``best`` says why).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from flashbook.planning import (BARRIER_ALIGN, CAPTURE_ALIGN, GPU, H100, H200, MBARRIER_BYTES,
                                REGISTERS_PER_SM, SETMAXNREG_MAX, SETMAXNREG_MIN, STATE_ALIGN,
                                SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, TILE_ALIGN, Tunables,
                                Verdict, capture_bytes, end, input_reasons, is_setmaxnreg,
                                launch_registers, place, rest_registers, verdict)

__all__ = ["Config", "GPU", "H100", "H200", "Verdict", "shared_memory",
           "shared_memory_layout", "register_budget", "consumer_registers", "feasible", "predict",
           "rank", "best", "prefers_persistent", "candidates", "three_consumers", "kv_tiles",
           "cta_tiles",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "REGISTERS_PER_SM", "SETMAXNREG_MIN",
           "SETMAXNREG_MAX"]

PRODUCER_REGS = 24
# the worker partitions' captured arguments: 3 smem tiles of rank 4, 6 barrier arrays of rank
# 2, 4 tensor descriptors and the LSE pointer, N_Q, N_K and qk_scale: 220 bytes
CAPTURE_BYTES = capture_bytes(descriptors=5, views=(4,) * 3 + (2,) * 6, scalars=3)
# persistent: O's tiles and q_free, and B*H read off two descriptors
PERSISTENT_CAPTURE = capture_bytes(views=(4, 2), scalars=2)


@dataclass(frozen=True)
class Config(Tunables):
    """The kernel's tunables; ``HEAD_DIM`` and ``DTYPE`` may stay None for ``attention_fa3``
    (``for_inputs`` fills them), not for the planner."""
    BLOCK_M: int = 64          # query rows per consumer warpgroup (wgmma's M is 64 a warpgroup)
    BLOCK_N: int = 128         # keys per K/V tile
    STAGES: int = 2            # slots in the K/V shared-memory ring
    OVERLAP: bool = True       # FA3's intra-warpgroup order (QK^T waited before PV)
    CONSUMERS: int = 2         # consumer warpgroups: 2, or 3 (FA3's d = 64)
    PERSISTENT: bool = False   # one CTA per SM looping over work tiles (``work_tiles``)
    GROUP: int = 1             # persistent: heads per section of the schedule (0: all heads)
    HEAD_DIM: int | None = None
    DTYPE: str | None = None   # "float16" or "bfloat16"

    @property
    def rows_per_cta(self) -> int:
        return self.BLOCK_M * self.CONSUMERS

    @property
    def threads(self) -> int:
        return 128 * (self.CONSUMERS + 1)



# ---------------------------- the kernel's tile counts (fa3_roles.kv_tiles / cta_tiles, in Python)
def kv_tiles(row0: int, n_q: int, n_k: int, block_m: int, block_n: int,
             causal: bool) -> tuple[int, int]:
    """For the query rows [row0, row0 + block_m): (the K/V tiles they read, how many of the first
    need no mask); causal bottom-right."""
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


def work_tile(t: int, n_m: int, n_bh: int, group: int) -> tuple[int, int]:
    """(m_block, bh) of a persistent CTA's work tile t (``fa3_roles.work_tile``, in Python):
    heads in sections of ``group`` (0: all), each section's last query blocks first."""
    group = n_bh if group == 0 else min(n_bh, group)
    section, r = divmod(t, n_m * group)
    base = section * group
    g = min(group, n_bh - base)
    return n_m - 1 - r // g, base + r % g


def work_tiles(config: Config, B: int, H: int, N_q: int, sms: int) -> list[list[tuple]]:
    """Each persistent CTA's work tiles in order (``fa3_roles.work_index``): one a round, rounds
    in alternate directions (grid = sms, or fewer where there are fewer tiles)."""
    n_m = -(-N_q // config.rows_per_cta)
    total = n_m * B * H
    grid = min(sms, total)
    rounds = [[i * grid + (grid - 1 - pid if i % 2 else pid) for i in range(-(-total // grid))]
              for pid in range(grid)]
    return [[work_tile(t, n_m, B * H, config.GROUP) for t in ts if t < total] for ts in rounds]


# ------------------------------------------------------------------ shared memory and registers
def shared_memory_layout(config: Config) -> list[tuple[str, int, int]]:
    """``(name, offset, size)`` of every buffer, as Triton's allocator places them."""
    d, e = config._need()
    s, n = config.STAGES, config.CONSUMERS
    barriers = [("q_bars", n), ("k_full", s), ("k_empty", s), ("v_full", s), ("v_empty", s),
                ("sched", n)] + [("q_free", n)] * config.PERSISTENT
    kv = s * config.BLOCK_N * d * e
    return place(  # program order (the kernel's allocations), then the warp-specialize scratch
        [("q", n * config.BLOCK_M * d * e, TILE_ALIGN), ("k", kv, TILE_ALIGN),
         ("v", kv, TILE_ALIGN)]
        + [("o", n * config.BLOCK_M * d * e, TILE_ALIGN)] * config.PERSISTENT
        + [(name, MBARRIER_BYTES * k, BARRIER_ALIGN) for name, k in barriers]
        + [("warp_states", 4 * n, STATE_ALIGN),
           ("captures", CAPTURE_BYTES + PERSISTENT_CAPTURE * config.PERSISTENT, CAPTURE_ALIGN)])


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
    """Can ``gpu`` run ``config`` (shape rules, shared memory, registers, threads)? ``reasons``
    says what fails."""
    c, inputs = config, input_reasons(config)
    smem, budget, need = shared_memory(c), register_budget(c), consumer_registers(c)
    return verdict(inputs + [
        (c.BLOCK_M % 64 or c.BLOCK_M < 64,
         f"BLOCK_M={c.BLOCK_M}: a warpgroup's wgmma covers 64-row multiples"),
        (c.BLOCK_N not in (16, 32, 64, 128, 256),
         f"BLOCK_N={c.BLOCK_N}: a power of two from 16 to 256 (wgmma N <= 256)"),
        (c.STAGES < 2, f"STAGES={c.STAGES}: the ring needs 2 slots to overlap loads"),
        (c.CONSUMERS not in (2, 3), f"CONSUMERS={c.CONSUMERS}: the kernel forks two or three "
                                    "consumer warpgroups"),
        (c.GROUP < 0, f"GROUP={c.GROUP}: heads per section of the schedule, 0 for all"),
        (c.threads > gpu.max_threads, f"{c.threads} threads > {gpu.max_threads}"),
        (smem > gpu.smem_per_block,
         f"shared memory {smem} B > {gpu.smem_per_block} B per block on {gpu.name}"),
        (budget["total"] > gpu.regs_per_sm,
         f"registers {budget['total']} > {gpu.regs_per_sm} per SM"),
        (not is_setmaxnreg(budget["consumer"]),
         f"consumer budget {budget['consumer']} is not a setmaxnreg value"),
        (need > budget["consumer"],
         f"a consumer thread needs ~{need} registers > its {budget['consumer']} (spills)")])


# --------------------------------------------------------------- the speed model and the ranking
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
    """The model's time (ms) and TFLOP/s for one problem (causal with N_q == N_k: half the
    FLOPs)."""
    d, _ = config._need()
    N_k = N_q if N_k is None else N_k
    g, s, tile = _tile_cycles(config)
    rows = config.rows_per_cta
    m_blocks = -(-N_q // rows)
    fill = L2_LATENCY + g + s + EPILOGUE

    def tiles(mb):
        return cta_tiles(mb, N_q, N_k, config.BLOCK_M, config.BLOCK_N, causal, config.CONSUMERS)

    per_cta = [fill + tiles(mb) * tile for mb in range(m_blocks)]
    if config.PERSISTENT:         # the static schedule, CTA by CTA; each tile still fills/drains
        cycles = max(sum(per_cta[mb] for mb, _ in cta)
                     for cta in work_tiles(config, B, H, N_q, gpu.sms))
    elif causal:
        cycles = max(sum(per_cta) * B * H / gpu.sms, max(per_cta))
    else:
        cycles = math.ceil(m_blocks * B * H / gpu.sms) * per_cta[0]
    ms = cycles / (gpu.clock_ghz * 1e9) * 1e3
    flops = 4 * B * H * N_q * N_k * d * (0.5 if causal and N_q == N_k else 1.0)
    return dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, tile_cycles=tile, g=g, s=s)


def candidates(head_dim: int, dtype: str = "float16") -> list[Config]:
    """The configs the kernel supports with two consumers, for one head dim and dtype (Exercise
    3's candidates and the compiled table's)."""
    return [Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=st, OVERLAP=ov, HEAD_DIM=head_dim, DTYPE=dtype)
            for bm in (64, 128) for bn in (64, 128, 256) for st in (2, 3, 4)
            for ov in (True, False)]


def three_consumers(head_dim: int, dtype: str = "float16") -> list[Config]:
    """The three-consumer configs, for d = 64 only (FA3's tiles there: 3 x 64 rows a CTA): the
    softmax of a 64 x 128 tile is long beside its GEMMs at d = 64, and two other consumers' GEMMs
    cover it where one cannot. 384 consumer threads keep 160 registers each; at d = 128 only
    64 x 64 tiles fit, and they measured slower than two consumers (556 against 582 TFLOP/s at
    (4, 16, 4096, 128) on an H100)."""
    if head_dim != 64:
        return []
    return [Config(BLOCK_M=64, BLOCK_N=bn, STAGES=st, CONSUMERS=3, HEAD_DIM=head_dim, DTYPE=dtype)
            for bn in (64, 128) for st in (2, 3)]


def rank(head_dim: int, dtype: str = "float16", *, B: int = 1, H: int = 16, N_q: int = 16384,
         N_k: int | None = None, causal: bool = False, gpu: GPU = H100,
         configs: list[Config] | None = None) -> list[tuple[Config, dict]]:
    """Feasible configs, fastest first by ``predict``; ties to the smaller BLOCK_M (more CTAs),
    then the smaller shared memory, then OVERLAP."""
    out = []
    for c in configs or candidates(head_dim, dtype):
        c = c if c.HEAD_DIM else c.for_inputs(head_dim, dtype)
        if feasible(c, gpu):
            out.append((c, predict(c, B, H, N_q, N_k, causal, gpu)))
    out.sort(key=lambda cp: (round(cp[1]["ms"], 9), cp[0].BLOCK_M, shared_memory(cp[0]),
                             not cp[0].OVERLAP))
    return out


# Persistent or not is a measured rule, not the model's. On an H100 (fp16, triton 3.6) the
# persistent kernel with GROUP=1 beat the default grid by 7-9% at every causal problem measured
# with N_q <= 4096 (d = 64 and 128, 1,024 to 4,096 rows) and lost by 30% at causal N_q = 16384.
# With causal masking a CTA's work grows with its query block, and a short problem's grid is
# only a few waves on 132 SMs; the snake schedule pairs long tiles with short ones and evens the
# waves out. At long N the many short waves already balance and the persistent kernel only adds
# its per-tile fills and drains. ``predict`` balances causal CTAs over the SMs perfectly, so it
# cannot see the uneven waves: it ranks the tiles, this rule chooses the grid. Since a
# persistent consumer frees its Q tile after its last QK^T and stores O from a tile of its own
# (the next tile's Q loads during the epilogue), it also wins short non-causal problems, where a
# grid CTA of a few K/V tiles waits for its Q at the start and for its O store at the end: 480
# against 410 TFLOP/s at (64, 16, 512, 128), 560 against 542 at (16, 16, 2048, 128), 574
# against 544 at (8, 16, 4096, 128); at d = 64, 359 against the three-consumer grid's 308 at
# 512 rows and 393 against 367 at 1,024, but 412 against 426 at 2,048 (the same H100, one run,
# 2026-12-06). At causal N_q <= 512 the persistent kernel takes 64-key tiles in four stages: half
# the keys a diagonal tile masks, and 311 against 263 TFLOP/s at (64, 16, 512, 128), 219 against
# 195 at d = 64. The persistent kernel also runs three consumers (192 query rows a work tile, as
# the three-consumer grid), and no short problem gained from them more than the run's noise: at
# most 2.3 % (446 against the grid's 438 at (16, 16, 2048, 64); 397 against 388 causal at 4,096,
# where the two-consumer launch read 397 too when given its config), and causal they are far
# slower, 115 against 218 TFLOP/s at (64, 16, 512, 64): all three consumers take a turn at every
# K/V tile the longest rows of their 192 read (the same H100, one run, 2026-12-06:
# data/fa3_persistent_rule/h100_three_consumers).
PERSISTENT_MAX_N = {(True, 64): 4096, (True, 128): 4096, (False, 64): 1024, (False, 128): 4096}
PERSISTENT_TILES = dict(BLOCK_M=64, BLOCK_N=128, STAGES=2)       # the tiles measured persistent
SHORT_CAUSAL_N = 512
SHORT_CAUSAL_TILES = dict(BLOCK_M=64, BLOCK_N=64, STAGES=4)


def prefers_persistent(N_q: int, causal: bool, head_dim: int = 128) -> bool:
    """Does ``best`` launch this problem persistent (GROUP=1)? Up to ``PERSISTENT_MAX_N`` query
    rows: 4,096 causal, and non-causal 4,096 at d = 128, 1,024 at d = 64."""
    return N_q <= PERSISTENT_MAX_N.get((bool(causal), head_dim), 0)


def best(head_dim: int, dtype: str = "float16", **problem) -> Config:
    """The fastest feasible config by the model (``rank``'s first, of ``candidates`` and
    ``three_consumers``); where ``prefers_persistent``, the persistent kernel (two consumers,
    GROUP=1) with the tiles measured there: ``PERSISTENT_TILES``, or ``SHORT_CAUSAL_TILES`` at
    causal N_q <= ``SHORT_CAUSAL_N``."""
    configs = candidates(head_dim, dtype) + three_consumers(head_dim, dtype)
    ranked = rank(head_dim, dtype, configs=configs, **problem)
    if not ranked:
        raise ValueError(f"planner: no feasible config for d={head_dim}, {dtype}.")
    N_q, causal = problem.get("N_q", 16384), problem.get("causal", False)
    if prefers_persistent(N_q, causal, head_dim):
        tiles = SHORT_CAUSAL_TILES if causal and N_q <= SHORT_CAUSAL_N else PERSISTENT_TILES
        persistent = Config(**tiles, PERSISTENT=True, GROUP=1).for_inputs(head_dim, dtype)
        if feasible(persistent, problem.get("gpu", H100)):
            return persistent
    return ranked[0][0]
