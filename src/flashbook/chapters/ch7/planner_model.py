"""Chapter 7's resource model of its Gluon Blackwell kernel (``planner`` explains it and
re-exports every name): the configuration (``Config``) and the GPU, what a config costs in shared
memory, tensor memory and registers, whether it fits (``feasible``), the best candidate, and the
stored compile table (``data/ch7_compiled.json``: ``compiled_table``, ``compiled_entry``). Pure
Python: no GPU, no Triton, and no import of the kernel (``gluon_fa4``), which imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from flashbook.aot import read_compiled_table

__all__ = ["Config", "GPU", "B200", "Verdict", "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES",
           "TMEM_COLUMNS", "REGISTERS_PER_SM", "SOFTMAX_REGS", "SINGLE_WARP_REGS",
           "PARTITION_WARPS", "tile_bytes", "smem_buffers", "warp_specialize_buffers", "place",
           "shared_memory_layout", "shared_memory", "tmem_map", "tmem_columns_used",
           "tmem_columns", "partition_warps", "warps", "threads", "register_budget", "feasible",
           "candidates", "best", "COMPILED_PATH", "compiled_table", "compiled_entry",
           "TMEM_MIN_ALLOC", "SETMAXNREG_MIN", "SETMAXNREG_MAX", "MBARRIER_BYTES", "TILE_ALIGN",
           "BARRIER_ALIGN", "CAPTURE_ALIGN", "STATE_ALIGN", "PER_TILE_BARRIERS",
           "PER_SLOT_BARRIERS", "CORRECTION_CHUNK", "TABLE_CONFIGS"]

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = ("float16", "bfloat16")
TMEM_COLUMNS = 512                  # per SM: 512 columns x 128 lanes x 32 bits = 256 KB
TMEM_MIN_ALLOC = 32
REGISTERS_PER_SM = 65536
SETMAXNREG_MIN, SETMAXNREG_MAX = 24, 256
SOFTMAX_REGS = 192                  # what the kernel asks setmaxnreg for, per softmax thread
SINGLE_WARP_REGS = 24               # ... and for the MMA, load and epilogue warps
# (role, warps) of the chapter's kernel: the default partition first, as gl.warp_specialize
# lists them (``partition_warps`` gives a config's)
PARTITION_WARPS = (("correction", 4), ("softmax 0", 4), ("softmax 1", 4), ("mma", 1),
                   ("load", 1), ("epilogue", 1))
MBARRIER_BYTES = 8
TILE_ALIGN, BARRIER_ALIGN, CAPTURE_ALIGN, STATE_ALIGN = 1024, 16, 8, 4
PER_TILE_BARRIERS = ("q_full", "s_ready", "p_ready", "stats", "o_done", "o_ready", "l_ready",
                     "epi_ready")
PER_SLOT_BARRIERS = ("k_full", "k_free", "v_full", "v_free")
CORRECTION_CHUNK = 32               # columns of O the correction holds in registers at once


@dataclass(frozen=True)
class Config:
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

    def for_inputs(self, head_dim: int, dtype: str) -> "Config":
        return replace(self, HEAD_DIM=head_dim, DTYPE=dtype)

    def _need(self) -> tuple[int, int]:
        if self.HEAD_DIM is None or self.DTYPE is None:
            raise ValueError(f"planner: {self} needs HEAD_DIM and DTYPE (Config.for_inputs).")
        return self.HEAD_DIM, 2

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


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    smem_per_block: int            # the most dynamic shared memory one block may use
    tmem_columns: int = TMEM_COLUMNS
    regs_per_sm: int = REGISTERS_PER_SM
    max_threads: int = 1024


# compute capability 10.0: 228 KB of shared memory per SM, at most 227 KB per block
B200 = GPU("B200", sms=148, smem_per_block=232448)


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
    order = ("q_full", "k_full", "k_free", "v_full", "v_free", "s_ready", "p_ready", "stats",
             "o_done", "o_ready", "l_ready", "epi_ready")
    for name in order:
        n = 2 if name in PER_TILE_BARRIERS else s
        bufs.append((name, n * MBARRIER_BYTES, BARRIER_ALIGN))
    return bufs


def _capture_bytes(config: Config) -> int:
    """The worker partitions' captured arguments, packed: 2 tensor-memory descriptors (S, O;
    8 each), 3 shared-memory tile views of rank 4 (8 + 4*4 each), 12 barrier arrays of rank 2
    (8 + 2*4 each), 4 tensor descriptors (8 each), N_K and qk_scale (4 each), and N_Q (4) when
    the workers mask causally."""
    return 2 * 8 + 3 * 24 + 12 * 16 + 4 * 8 + 2 * 4 + (4 if config.CAUSAL else 0)


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


def place(buffers: list) -> list[tuple[str, int, int]]:
    """Triton's placement of buffers that are all live at once: sorted by size, largest first
    (ties keep their order), each at the next multiple of its alignment. ``buffers``:
    ``(name, bytes, alignment)``. Returns ``(name, offset, bytes)``."""
    placed, end = [], 0
    for name, size, align in sorted(buffers, key=lambda b: -b[1]):
        offset = -(-end // align) * align
        placed.append((name, offset, size))
        end = offset + size
    return placed


def shared_memory_layout(config: Config) -> list[tuple[str, int, int]]:
    """``(name, offset, bytes)`` of every buffer, as Triton's allocator places them."""
    return place(smem_buffers(config) + warp_specialize_buffers(config))


def shared_memory(config: Config) -> int:
    """Bytes of dynamic shared memory the compiled kernel needs (its ``metadata.shared``)."""
    return max(offset + size for _, offset, size in shared_memory_layout(config))


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
    """Columns Triton allocates (``metadata.tmem_size``, the ``tcgen05.alloc`` operand): the
    columns used, rounded up to a power of two, at least 32."""
    used = tmem_columns_used(config)
    return max(TMEM_MIN_ALLOC, 1 << (used - 1).bit_length())


# ------------------------------------------------------------------------------ registers
def register_budget(config: Config | None = None) -> dict:
    """Registers per thread: ``launch`` (every thread at the start: ``.maxnreg``, the SM's
    registers shared by the CTA's threads, rounded down to a multiple of 8) and the
    ``setmaxnreg`` budget of each role (multiples of 8 in [24, 256]): the softmax warpgroups' and
    the single-warp roles' warpgroup's are the config's requests, the correction's is what they
    leave, shared by its ``CORRECTION_WARPS`` warps."""
    config = config or Config()
    launch = REGISTERS_PER_SM // threads(config) // 8 * 8
    one_warp_groups = (warps(config) - config.CORRECTION_WARPS - 8) // 4
    softmax, single = config.SOFTMAX_REGS, config.SINGLE_WARP_REGS
    rest = REGISTERS_PER_SM - 128 * (2 * softmax + one_warp_groups * single)
    correction = min(SETMAXNREG_MAX, rest // (32 * config.CORRECTION_WARPS) // 8 * 8)
    return dict(launch=launch, softmax=softmax, correction=correction, single_warp=single,
                total=128 * (2 * softmax + one_warp_groups * single)
                + 32 * config.CORRECTION_WARPS * correction)


# ------------------------------------------------------------------------------ feasibility
@dataclass(frozen=True)
class Verdict:
    ok: bool
    reasons: tuple = field(default_factory=tuple)

    def __bool__(self):
        return self.ok


def feasible(config: Config, gpu: GPU = B200) -> Verdict:
    """Can one CTA of ``config`` run on ``gpu``? Shape rules, shared memory per block, tensor
    memory, registers; ``reasons`` says what fails."""
    d, _ = config._need()
    why = []
    if d not in SUPPORTED_HEAD_DIMS:
        why.append(f"head dim {d} not in {SUPPORTED_HEAD_DIMS}")
    if config.DTYPE not in SUPPORTED_DTYPES:
        why.append(f"dtype {config.DTYPE} not in {SUPPORTED_DTYPES}")
    if config.BLOCK_M != 128:
        why.append(f"BLOCK_M={config.BLOCK_M}: the kernel's Q tiles are tcgen05's 128 rows")
    if config.BLOCK_N not in (64, 128):
        why.append(f"BLOCK_N={config.BLOCK_N}: 64 or 128 keys a tile")
    if config.STAGES < 1:
        why.append(f"STAGES={config.STAGES}: the rings need at least one slot")
    if config.CORRECTION_WARPS < 4 or config.CORRECTION_WARPS % 4:
        why.append(f"CORRECTION_WARPS={config.CORRECTION_WARPS}: setmaxnreg works per "
                   "warpgroup, so the correction takes whole warpgroups")
    for name in ("SOFTMAX_REGS", "SINGLE_WARP_REGS"):
        regs = getattr(config, name)
        if regs % 8 or not SETMAXNREG_MIN <= regs <= SETMAXNREG_MAX:
            why.append(f"{name}={regs}: setmaxnreg takes a multiple of 8 from "
                       f"{SETMAXNREG_MIN} to {SETMAXNREG_MAX}")
    if threads(config) > gpu.max_threads:
        why.append(f"{threads(config)} threads > {gpu.max_threads}")
    cols = tmem_columns_used(config)
    if cols > gpu.tmem_columns:
        why.append(f"tensor memory: 2 x {config.BLOCK_N} (S) + 2 x {d} (O) = {cols} columns > "
                   f"{gpu.tmem_columns}")
    smem = shared_memory(config)
    if smem > gpu.smem_per_block:
        why.append(f"shared memory {smem:,} B > {gpu.smem_per_block:,} B per block on {gpu.name}")
    budget = register_budget(config)
    if budget["total"] > gpu.regs_per_sm:
        why.append(f"registers {budget['total']} > {gpu.regs_per_sm} per SM")
    if budget["correction"] < SETMAXNREG_MIN:
        why.append(f"the correction's threads are left {budget['correction']} registers, "
                   f"fewer than setmaxnreg's {SETMAXNREG_MIN}")
    if config.BLOCK_N + 32 > config.SOFTMAX_REGS:
        why.append(f"a softmax thread holds a row of {config.BLOCK_N} fp32 scores plus ~32 "
                   f"registers of bookkeeping: more than its {config.SOFTMAX_REGS}")
    return Verdict(not why, tuple(why))


def candidates(head_dim: int, dtype: str = "float16", causal: bool = False) -> list[Config]:
    return [Config(BLOCK_N=bn, STAGES=st, CAUSAL=causal).for_inputs(head_dim, dtype)
            for bn in (128, 64) for st in range(1, 9)]


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
COMPILED_PATH = Path(__file__).resolve().parents[2] / "data" / "ch7_compiled.json"
# (d, dtype, BLOCK_N, STAGES, causal): the chapter's config, a 1-slot ring, causal, d = 64
# (tensor memory rounded up), the deepest ring that fits at d = 64
TABLE_CONFIGS = [(128, "float16", 128, 2, False), (128, "bfloat16", 128, 1, True),
                 (64, "float16", 128, 2, False), (64, "bfloat16", 128, 3, True),
                 (64, "float16", 64, 6, False)]


def compiled_table(path: Path | str = COMPILED_PATH) -> dict:
    """``{"provenance": {...}, "configs": [entry, ...]}`` (see ``provenance.fields``)."""
    return read_compiled_table(path)


def _key(d, dtype, bn, stages, causal) -> tuple:
    return (int(d), str(dtype), int(bn), int(stages), bool(causal))


def compiled_entry(config: Config, path: Path | str = COMPILED_PATH) -> dict | None:
    """The stored compile of ``config``, or None (the table holds the kernel's own split of
    warps and registers only)."""
    if not config.is_the_kernels_split():
        return None
    key = _key(config.HEAD_DIM, config.DTYPE, config.BLOCK_N, config.STAGES, config.CAUSAL)
    for e in compiled_table(path)["configs"]:
        if _key(e["d"], e["dtype"], e["BLOCK_N"], e["STAGES"], e["causal"]) == key:
            return e
    return None
