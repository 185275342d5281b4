"""Planning what a warp-specialized Gluon kernel needs before it is compiled: the kit Chapters 6
and 7 configure for their kernels (``fa3_planner``, ``ch7.planner_model``). Pure Python: no
GPU, no Triton.

**Shared memory** (``place``). Triton places every buffer of such a kernel once, because all of
them are live together: sorted by size, largest first (ties keep program order), each at the
next multiple of its alignment. The buffers: the 128-byte-swizzled tiles (alignment 1024), the
mbarrier arrays (8 bytes a barrier, alignment 16 an array), and what ``gl.warp_specialize``
keeps for the worker partitions: their captured arguments, packed (alignment 8;
``capture_bytes``: 8 bytes a pointer, tensor descriptor or tensor-memory descriptor, ``8 + 4 *
rank`` a shared-memory view, 4 an i32 or f32), and one state byte per worker warp (alignment 4).
The end of the last buffer is the kernel's ``metadata.shared``, byte for byte.

**Registers.** 65,536 per SM. A CTA's warps are padded to whole warpgroups (``setmaxnreg``
works per warpgroup). The launch gives every thread the SM's registers over the CTA's threads,
rounded down to a multiple of 8 (``launch_registers``: the PTX's ``.maxnreg``); then
``setmaxnreg`` moves them: the roles that ask for a budget (multiples of 8 in [24, 256],
``is_setmaxnreg``) get it, and the one that does not shares what they leave
(``rest_registers``).

**The compiled table** (``CompiledTable``): a chapter's kernel compiled ahead of time, config by
config, with what each needs and the provenance of the run (``data/chN_compiled.json``, written
by ``aot.write_compiled_table``). A chapter's checks read it instead of compiling in a notebook.

The GPUs' limits (``GPU``, and ``Device`` under the names of
``torch.cuda.get_device_properties``), a planner's ``Verdict`` and the ``Tunables`` every
chapter's ``Config`` shares complete the kit.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

from .aot import read_compiled_table, write_compiled_table

__all__ = ["REGISTERS_PER_SM", "SETMAXNREG_MIN", "SETMAXNREG_MAX", "MBARRIER_BYTES",
           "TILE_ALIGN", "BARRIER_ALIGN", "CAPTURE_ALIGN", "STATE_ALIGN", "TMEM_COLUMNS",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "Tunables", "GPU", "H100", "H200", "B200",
           "Device", "H100_PROPS", "H200_PROPS", "Verdict", "verdict", "input_reasons", "place",
           "end", "capture_bytes", "launch_registers", "rest_registers", "is_setmaxnreg",
           "tmem_alloc", "CompiledTable", "as_bool", "code_names", "forbid_calls"]

REGISTERS_PER_SM = 65536
SETMAXNREG_MIN, SETMAXNREG_MAX = 24, 256
MBARRIER_BYTES = 8                   # one mbarrier: a 64-bit word in shared memory
TILE_ALIGN, BARRIER_ALIGN, CAPTURE_ALIGN, STATE_ALIGN = 1024, 16, 8, 4
TMEM_COLUMNS = 512                   # per sm_100 SM: 512 columns x 128 lanes x 32 bits = 256 KB
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = ("float16", "bfloat16")


class Tunables:
    """What every chapter's frozen ``Config`` dataclass shares: ``HEAD_DIM`` and ``DTYPE`` may
    stay None until the inputs fill them in (``for_inputs``); the planner needs them set."""

    def for_inputs(self, head_dim: int, dtype: str):
        return replace(self, HEAD_DIM=head_dim, DTYPE=dtype)

    def _need(self) -> tuple[int, int]:
        """(d, bytes a value): the book's kernels take 16-bit inputs."""
        if self.HEAD_DIM is None or self.DTYPE is None:
            raise ValueError(f"planner: {self} needs HEAD_DIM and DTYPE (Config.for_inputs).")
        return self.HEAD_DIM, 2


# ------------------------------------------------------------------------------ the GPUs
@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    smem_per_block: int              # the most dynamic shared memory one block may use (bytes)
    clock_ghz: float = 0.0           # the clock the quoted tensor peak assumes
    tmem_columns: int = 0            # tensor-memory columns per SM (sm_100; none before)
    regs_per_sm: int = REGISTERS_PER_SM
    max_threads: int = 1024
    tensor_flop_per_clk: int = 4096  # dense fp16/bf16 FLOP per clock per SM

    @property
    def peak_tflops(self) -> float:
        return self.sms * self.tensor_flop_per_clk * self.clock_ghz * 1e9 / 1e12


# compute capabilities 9.0 and 10.0: 228 KB of shared memory per SM, at most 227 KB per block
H100 = GPU("H100 SXM", sms=132, smem_per_block=232448, clock_ghz=1.83)
H200 = GPU("H200", sms=132, smem_per_block=232448, clock_ghz=1.83)
B200 = GPU("B200", sms=148, smem_per_block=232448, tmem_columns=TMEM_COLUMNS)


@dataclass(frozen=True)
class Device:
    """What a planner needs to know about a GPU, under the names of
    ``torch.cuda.get_device_properties`` (so on a GPU its result can be passed instead)."""
    name: str
    shared_memory_per_block: int             # a block's limit unless the kernel opts in (48 KB)
    shared_memory_per_block_optin: int       # the most one block may use: the SM's total less 1 KB
    shared_memory_per_multiprocessor: int    # the SM's total (the spec sheet's figure)
    regs_per_multiprocessor: int = REGISTERS_PER_SM
    multi_processor_count: int = 132


# compute capability 9.0 (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability"): 228 KB of shared memory per SM, at most 227 KB per block, 1 KB reserved per block
H100_PROPS = Device("NVIDIA H100 80GB HBM3", 48 * 1024, 227 * 1024, 228 * 1024)
H200_PROPS = Device("NVIDIA H200", 48 * 1024, 227 * 1024, 228 * 1024)


# ------------------------------------------------------------------------------ feasibility
@dataclass(frozen=True)
class Verdict:
    ok: bool
    reasons: tuple = field(default_factory=tuple)

    def __bool__(self):
        return self.ok


def verdict(rules: Iterable[tuple[object, str]]) -> Verdict:
    """``rules``: ``(fails, reason)`` pairs in the order a planner reports them."""
    why = tuple(reason for fails, reason in rules if fails)
    return Verdict(not why, why)


def input_reasons(config: Tunables) -> list[tuple[bool, str]]:
    """The rules on the inputs every kernel of the book shares: its head dims and dtypes."""
    d, _ = config._need()
    return [(d not in SUPPORTED_HEAD_DIMS, f"head dim {d} not in {SUPPORTED_HEAD_DIMS}"),
            (config.DTYPE not in SUPPORTED_DTYPES,
             f"dtype {config.DTYPE} not in {SUPPORTED_DTYPES}")]


# ------------------------------------------------------------------------------ shared memory
def place(buffers: list) -> list[tuple[str, int, int]]:
    """Triton's placement of buffers that are all live at once: sorted by size, largest first
    (ties keep their order), each at the next multiple of its alignment. ``buffers``:
    ``(name, bytes, alignment)``. Returns ``(name, offset, bytes)``."""
    placed, top = [], 0
    for name, size, align in sorted(buffers, key=lambda b: -b[1]):
        offset = -(-top // align) * align
        placed.append((name, offset, size))
        top = offset + size
    return placed


def end(placed: list[tuple[str, int, int]]) -> int:
    """The bytes placed buffers span: the kernel's ``metadata.shared``."""
    return max(offset + size for _, offset, size in placed)


def capture_bytes(descriptors: int = 0, views: Iterable[int] = (), scalars: int = 0) -> int:
    """What ``gl.warp_specialize`` packs for the workers' captured arguments: 8 bytes a pointer
    or descriptor, ``8 + 4 * rank`` a shared-memory view (``views``: their ranks), 4 a
    scalar."""
    return 8 * descriptors + sum(8 + 4 * rank for rank in views) + 4 * scalars


# ------------------------------------------------------------------------------ registers
def launch_registers(threads: int) -> int:
    """Registers a thread at launch (``.maxnreg``): the SM's over the CTA's threads, rounded
    down to a multiple of 8 (registers are allocated 8 at a time)."""
    return REGISTERS_PER_SM // threads // 8 * 8


def rest_registers(taken: int, threads: int) -> int:
    """The ``setmaxnreg`` budget of the role that asks for none: what the others took
    (``taken`` registers) leaves, over its ``threads``, a multiple of 8, at most 256."""
    return min(SETMAXNREG_MAX, (REGISTERS_PER_SM - taken) // threads // 8 * 8)


def is_setmaxnreg(regs: int) -> bool:
    return regs % 8 == 0 and SETMAXNREG_MIN <= regs <= SETMAXNREG_MAX


def tmem_alloc(columns: int) -> int:
    """Tensor-memory columns ``tcgen05.alloc`` gives for ``columns`` used (Triton's
    ``metadata.tmem_size``): a power of two, at least 32."""
    return max(32, 1 << (columns - 1).bit_length())


# ------------------------------------------------------------------------------ the compiled table
class CompiledTable:
    """A stored table of a chapter's kernel compiled ahead of time: ``{"provenance": {...},
    "configs": [entry, ...]}``, each entry keyed by the fields ``key`` names."""

    def __init__(self, name: str, key: tuple[str, ...]):
        self.path = Path(__file__).resolve().parent / "data" / name
        self.key = key

    def read(self, path: Path | str | None = None) -> dict:
        return read_compiled_table(path or self.path)

    def entry(self, values: tuple, path: Path | str | None = None) -> dict | None:
        """The entry whose ``key`` fields equal ``values``, or None."""
        values = tuple(values)
        return next((e for e in self.read(path)["configs"]
                     if tuple(e[k] for k in self.key) == values), None)

    def main(self, argv, module: str, description: str, configs: Iterable[tuple],
             compile_entry: Callable[..., dict], provenance: Callable[[str], dict]):
        """Regenerate the table (``--out``, by default the stored one); ``module`` is the
        command recorded in its provenance."""
        p = argparse.ArgumentParser(description=description)
        p.add_argument("--out", default=str(self.path))
        args = p.parse_args(argv)
        write_compiled_table(args.out, module, argv, configs, compile_entry, provenance)


# ------------------------------------------------------------------------------ checks
# (the checks import CheckFailure when they fail: the planners stay free of torch)
def as_bool(value, what: str) -> bool:
    from .compare import CheckFailure
    if isinstance(value, bool) or type(value).__name__ == "bool_":      # numpy's too
        return bool(value)
    raise CheckFailure(f"{what}: returned {value!r}; it should return True or False.")


def code_names(code) -> set:
    """The global and attribute names a code object and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= code_names(const)
    return names


def forbid_calls(fn, what: str, module, answers: tuple[str, ...], given: str,
                 name: str | None = None):
    """Fail a student's function that calls one of ``module``'s ``answers`` (as
    ``module.answer(...)`` or imported under its name): the figures the check compares with.
    ``given`` names what the student may use instead; ``name``, the module as the notebook
    calls it (default: its own name)."""
    code, env = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is None:
        return
    names = code_names(code)
    by_function = {getattr(module, a): a for a in answers}
    used = [by_function[env[n]] for n in names
            if callable(env.get(n)) and env.get(n) in by_function]
    if any(env.get(n) is module for n in names):
        used += [a for a in answers if a in names]
    if used:
        from .compare import CheckFailure
        name = name or module.__name__.rpartition(".")[2]
        raise CheckFailure(f"{what}: calls {name}.{used[0]}, the answer the check compares "
                           f"with; compute it yourself ({given}).")
