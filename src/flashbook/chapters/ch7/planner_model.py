"""Chapter 7's resource planner for the Gluon Blackwell kernel (``gluon_fa4``), a configuration of
``flashbook.planning``, pure Python (``planner`` re-exports it with Exercise 5's check and the
command that compiles the kernel, which imports this module). Every figure is compared with the
kernel compiled for sm_100a (``data/ch7_compiled.json``, ``compiled_table``).

A config: d (64, 128), a 16-bit dtype, ``BLOCK_M = 128`` rows a Q tile (two a CTA), ``BLOCK_N``
keys a K/V tile, ``STAGES`` slots a ring, causal or not (the workers then capture N_Q too).
Shared memory: ``smem_buffers`` and ``gl.warp_specialize``'s own, placed by ``planning.place``
(d = 128, 2 stages: 197,132 of 232,448 bytes); tensor memory: ``tmem_map``; registers:
``register_budget`` (8 correction warps is a what-if the kernel does not build).
"""
from __future__ import annotations

from dataclasses import dataclass

from flashbook.planning import (B200, BARRIER_ALIGN, CAPTURE_ALIGN, GPU, MBARRIER_BYTES,
                                REGISTERS_PER_SM, SETMAXNREG_MAX, SETMAXNREG_MIN, STATE_ALIGN,
                                TILE_ALIGN, CompiledTable, Tunables, Verdict, capture_bytes, end,
                                input_reasons, is_setmaxnreg, launch_registers, place,
                                rest_registers, tmem_alloc, verdict)

__all__ = ["Config", "B200", "REGISTERS_PER_SM", "SOFTMAX_REGS", "SINGLE_WARP_REGS",
           "PARTITION_WARPS", "tile_bytes", "smem_buffers", "warp_specialize_buffers", "place",
           "shared_memory_layout", "shared_memory", "tmem_map", "tmem_columns_used",
           "tmem_columns", "partition_warps", "warps", "threads", "register_budget", "feasible",
           "best", "compiled_table", "compiled_entry", "TILE_ALIGN", "BARRIER_ALIGN",
           "PER_TILE_BARRIERS", "PER_SLOT_BARRIERS", "BARRIERS", "TABLE", "TABLE_CONFIGS"]

SOFTMAX_REGS = 192                  # what the kernel asks setmaxnreg for, per softmax thread
SINGLE_WARP_REGS = 24               # ... and for the MMA, load and epilogue warps
# (role, warps) of the chapter's kernel: the default partition first, as gl.warp_specialize
# lists them (``partition_warps`` gives a config's)
PARTITION_WARPS = (("correction", 4), ("softmax 0", 4), ("softmax 1", 4), ("mma", 1),
                   ("load", 1), ("epilogue", 1))
PER_TILE_BARRIERS = ("q_full", "s_ready", "p_ready", "stats", "o_done", "o_ready", "l_ready",
                     "epi_ready")
PER_SLOT_BARRIERS = ("k_full", "k_free", "v_full", "v_free")
# every mbarrier array, in the order the kernel (and the simulator's make_barriers) allocates them
BARRIERS = ("q_full", "k_full", "k_free", "v_full", "v_free", "s_ready", "p_ready", "stats",
            "o_done", "o_ready", "l_ready", "epi_ready")


@dataclass(frozen=True)
class Config(Tunables):
    """The kernel's tunables. ``HEAD_DIM`` and ``DTYPE`` may stay None until the inputs fill
    them in (``for_inputs``); the planner needs them set."""
    BLOCK_M: int = 128         # query rows per Q tile (tcgen05's M; two tiles a CTA)
    BLOCK_N: int = 128         # keys per K/V tile
    STAGES: int = 2            # slots in the K ring and in the V ring
    CAUSAL: bool = False
    HEAD_DIM: int | None = None
    DTYPE: str | None = None   # "float16" or "bfloat16"
    SOFTMAX_REGS: int = SOFTMAX_REGS          # setmaxnreg of each softmax warpgroup's threads
    SINGLE_WARP_REGS: int = SINGLE_WARP_REGS  # ... of the MMA, load and epilogue warps
    CORRECTION_WARPS: int = 4                 # the correction partition (the default one)

    def is_the_kernels_split(self) -> bool:
        """True when the warps and register requests are the chapter kernel's defaults."""
        return (self.SOFTMAX_REGS, self.SINGLE_WARP_REGS, self.CORRECTION_WARPS) == \
            (SOFTMAX_REGS, SINGLE_WARP_REGS, PARTITION_WARPS[0][1])

    def describe(self) -> str:
        extra = [f"{name}={getattr(self, name)}" for name in
                 ("CORRECTION_WARPS", "SOFTMAX_REGS", "SINGLE_WARP_REGS")
                 if getattr(self, name) != getattr(Config, name)]
        return (f"d={self.HEAD_DIM} {self.DTYPE}, BLOCK_N={self.BLOCK_N}, STAGES={self.STAGES}"
                + (", causal" if self.CAUSAL else "") + "".join(f", {e}" for e in extra))


# ------------------------------------------------------------------------------ shared memory
def tile_bytes(config: Config, which: str) -> int:
    """Bytes of one tile: "q" (BLOCK_M x d) or "k" / "v" (BLOCK_N x d), 16-bit values."""
    d, e = config._need()
    return (config.BLOCK_M if which == "q" else config.BLOCK_N) * d * e


def smem_buffers(config: Config) -> list[tuple[str, int, int]]:
    """``(name, bytes, alignment)`` of the buffers the kernel allocates, in program order."""
    s = config.STAGES
    bufs = [("q", 2 * tile_bytes(config, "q"), TILE_ALIGN),
            ("k", s * tile_bytes(config, "k"), TILE_ALIGN),
            ("v", s * tile_bytes(config, "v"), TILE_ALIGN)]
    return bufs + [(name, (2 if name in PER_TILE_BARRIERS else s) * MBARRIER_BYTES,
                    BARRIER_ALIGN) for name in BARRIERS]


def _capture_bytes(config: Config) -> int:
    """The worker partitions' captured arguments, packed: 2 tensor-memory descriptors (S, O),
    3 shared-memory tile views of rank 4, 12 barrier arrays of rank 2, 4 tensor descriptors,
    N_K and qk_scale, and N_Q when the workers mask causally."""
    return capture_bytes(descriptors=2 + 4, views=(4,) * 3 + (2,) * 12,
                         scalars=2 + bool(config.CAUSAL))


def partition_warps(config: Config | None = None) -> tuple:
    """(role, warps) of every partition, the default one (the correction) first."""
    n = PARTITION_WARPS[0][1] if config is None else config.CORRECTION_WARPS
    return (("correction", n),) + PARTITION_WARPS[1:]


def warps(config: Config | None = None) -> int:
    """Warps of a CTA: the partitions' (15), padded to whole warpgroups (setmaxnreg works per
    warpgroup): 16."""
    n = sum(w for _, w in partition_warps(config))
    return -(-n // 4) * 4


def threads(config: Config | None = None) -> int:
    return 32 * warps(config)


def warp_specialize_buffers(config: Config) -> list[tuple[str, int, int]]:
    """What Triton adds for ``gl.warp_specialize``: the captured arguments and one state byte
    per worker warp (every warp but the default partition's 4)."""
    return [("captures", _capture_bytes(config), CAPTURE_ALIGN),
            ("warp_states", warps(config) - partition_warps(config)[0][1], STATE_ALIGN)]


def shared_memory_layout(config: Config) -> list[tuple[str, int, int]]:
    """``(name, offset, bytes)`` of every buffer, as Triton's allocator places them."""
    return place(smem_buffers(config) + warp_specialize_buffers(config))


def shared_memory(config: Config) -> int:
    """Bytes of dynamic shared memory the compiled kernel needs (its ``metadata.shared``)."""
    return end(shared_memory_layout(config))


# ------------------------------------------------------------------------------ tensor memory
def tmem_map(config: Config) -> list[tuple[str, int, int, str]]:
    """``(buffer, first column, columns, what)``: the allocations (S0, S1, O0, O1) and what
    lives inside S's columns."""
    d, _ = config._need()
    bn = config.BLOCK_N
    rows = []
    for t in (0, 1):
        s0 = t * bn
        rows += [(f"S{t}", s0, bn, f"Q{t} K^T, fp32 (MMA -> softmax {t})"),
                 (f"P{t}", s0, bn // 2, f"exp2(S{t} - m), 16-bit, two a column: inside S{t} "
                                        f"(softmax {t} -> MMA, the A operand of PV)"),
                 (f"alpha{t}", s0 + bn // 2, 1, f"exp2(m_old - m_new) (softmax {t} -> "
                                                f"correction)"),
                 (f"m{t}, l{t}", s0 + bn // 2 + 1, 2, f"final row max and sum (softmax {t} -> "
                                                      f"correction)")]
    for t in (0, 1):
        rows.append((f"O{t}", 2 * bn + t * d, d, f"P{t} V accumulator, fp32 (MMA, rescaled "
                                                 f"by the correction)"))
    return rows


def tmem_columns_used(config: Config) -> int:
    """Columns the kernel's tensor-memory buffers take: 2 BLOCK_N (S0, S1) + 2 d (O0, O1)."""
    d, _ = config._need()
    return 2 * config.BLOCK_N + 2 * d


def tmem_columns(config: Config) -> int:
    """Columns Triton allocates (``metadata.tmem_size``)."""
    return tmem_alloc(tmem_columns_used(config))


# ------------------------------------------------------------------------------ registers
def register_budget(config: Config | None = None) -> dict:
    """Registers per thread: ``launch`` (every thread at the start: ``.maxnreg``, the SM's
    registers shared by the CTA's threads, rounded down to a multiple of 8) and the
    ``setmaxnreg`` budget of each role (multiples of 8 in [24, 256]): the softmax warpgroups' and
    the single-warp roles' warpgroup's are the config's requests, the correction's is what they
    leave, shared by its ``CORRECTION_WARPS`` warps."""
    config = config or Config()
    one_warp_groups = (warps(config) - config.CORRECTION_WARPS - 8) // 4
    softmax, single = config.SOFTMAX_REGS, config.SINGLE_WARP_REGS
    taken = 128 * (2 * softmax + one_warp_groups * single)
    correction = rest_registers(taken, 32 * config.CORRECTION_WARPS)
    return dict(launch=launch_registers(threads(config)), softmax=softmax, correction=correction,
                single_warp=single, total=taken + 32 * config.CORRECTION_WARPS * correction)


# ------------------------------------------------------------------------------ feasibility
def feasible(config: Config, gpu: GPU = B200) -> Verdict:
    """Can one CTA of ``config`` run on ``gpu``? Shape rules, shared memory per block, tensor
    memory, registers; ``reasons`` says what fails."""
    c, inputs = config, input_reasons(config)
    d, n = c.HEAD_DIM, threads(c)
    cols, smem, budget = tmem_columns_used(c), shared_memory(c), register_budget(c)
    return verdict(inputs + [
        (c.BLOCK_M != 128, f"BLOCK_M={c.BLOCK_M}: the kernel's Q tiles are tcgen05's 128 rows"),
        (c.BLOCK_N not in (64, 128), f"BLOCK_N={c.BLOCK_N}: 64 or 128 keys a tile"),
        (c.STAGES < 1, f"STAGES={c.STAGES}: the rings need at least one slot"),
        (c.CORRECTION_WARPS < 4 or c.CORRECTION_WARPS % 4,
         f"CORRECTION_WARPS={c.CORRECTION_WARPS}: setmaxnreg works per warpgroup, so the "
         "correction takes whole warpgroups")] + [
        (not is_setmaxnreg(getattr(c, name)),
         f"{name}={getattr(c, name)}: setmaxnreg takes a multiple of 8 from {SETMAXNREG_MIN} "
         f"to {SETMAXNREG_MAX}") for name in ("SOFTMAX_REGS", "SINGLE_WARP_REGS")] + [
        (n > gpu.max_threads, f"{n} threads > {gpu.max_threads}"),
        (cols > gpu.tmem_columns, f"tensor memory: 2 x {c.BLOCK_N} (S) + 2 x {d} (O) = {cols} "
                                  f"columns > {gpu.tmem_columns}"),
        (smem > gpu.smem_per_block,
         f"shared memory {smem:,} B > {gpu.smem_per_block:,} B per block on {gpu.name}"),
        (budget["total"] > gpu.regs_per_sm,
         f"registers {budget['total']} > {gpu.regs_per_sm} per SM"),
        (budget["correction"] < SETMAXNREG_MIN,
         f"the correction's threads are left {budget['correction']} registers, fewer than "
         f"setmaxnreg's {SETMAXNREG_MIN}"),
        (c.BLOCK_N + 32 > c.SOFTMAX_REGS,
         f"a softmax thread holds a row of {c.BLOCK_N} fp32 scores plus ~32 registers of "
         f"bookkeeping: more than its {c.SOFTMAX_REGS}")])


def best(head_dim: int, dtype: str = "float16", causal: bool = False) -> Config:
    """The chapter's choice: 128-key tiles (the fewest MMAs and barrier round trips per key),
    and 2 slots a ring: what Exercise 4's model needs to hide the TMA latency, and the most that
    fit at d = 128 (3 need 262,144 bytes of tiles alone)."""
    config = Config(BLOCK_N=128, STAGES=2, CAUSAL=causal).for_inputs(head_dim, dtype)
    if not feasible(config):
        raise ValueError(f"planner: no feasible config for d={head_dim}, {dtype}: "
                         + "; ".join(feasible(config).reasons))
    return config


# ------------------------------------------------------------------------------ the compiled table
TABLE = CompiledTable("ch7_compiled.json", ("d", "dtype", "BLOCK_N", "STAGES", "causal"))
# (d, dtype, BLOCK_N, STAGES, causal): the chapter's config, a 1-slot ring, causal, d = 64
# (tensor memory rounded up), the deepest ring that fits at d = 64
TABLE_CONFIGS = [(128, "float16", 128, 2, False), (128, "bfloat16", 128, 1, True),
                 (64, "float16", 128, 2, False), (64, "bfloat16", 128, 3, True),
                 (64, "float16", 64, 6, False)]


def compiled_table(path=None) -> dict:
    """``{"provenance": {...}, "configs": [entry, ...]}`` (see ``provenance.fields``)."""
    return TABLE.read(path)


def compiled_entry(config: Config, path=None) -> dict | None:
    """The stored compile of ``config``, or None (the table holds the kernel's own split of
    warps and registers only)."""
    if not config.is_the_kernels_split():
        return None
    return TABLE.entry((int(config.HEAD_DIM), str(config.DTYPE), int(config.BLOCK_N),
                        int(config.STAGES), bool(config.CAUSAL)), path)
