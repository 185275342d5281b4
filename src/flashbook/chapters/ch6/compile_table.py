"""Chapter 6's compiled table (``data/ch6_compiled.json``): reading it and regenerating it.

The table is the chapter's Gluon kernel compiled ahead of time for sm_90a, config by config, with
what each needs (``metadata.shared``, registers, stack, spills) and the provenance of the run;
``planner_checks`` (Exercise 3's check) grades against it and re-exports these names.

``TRITON_DEFAULT_FP_FUSION=1 python -m flashbook.chapters.ch6.planner_checks --out
src/flashbook/data/ch6_compiled.json`` (without ``TRITON_INTERPRET``) regenerates the table
(``python -m flashbook.chapters.ch6.compile_table`` does the same).
"""
from __future__ import annotations

from pathlib import Path

from flashbook.aot import compile_provenance, cubin_resources, read_compiled_table, \
    write_compiled_table

from .planner import Config

__all__ = ["COMPILED_PATH", "TABLE_CONFIGS", "compiled_table", "compiled_entry", "compile_entry",
           "main"]

COMPILED_PATH = Path(__file__).resolve().parents[2] / "data" / "ch6_compiled.json"


def _key(d, dtype, bm, bn, stages) -> tuple:
    return (int(d), str(dtype), int(bm), int(bn), int(stages))


def _config_key(c: Config) -> tuple:
    return _key(c.HEAD_DIM, c.DTYPE, c.BLOCK_M, c.BLOCK_N, c.STAGES)


# ------------------------------------------------------------------------------------------------
# the compiled table (data/ch6_compiled.json)
# ------------------------------------------------------------------------------------------------
def compiled_table(path: Path | str = COMPILED_PATH) -> dict:
    """``{"provenance": {...}, "configs": [entry, ...]}``; an entry: d, dtype, BLOCK_M, BLOCK_N,
    STAGES, shared (``metadata.shared``), n_regs (the launch's register count), stack (local
    bytes per thread, what Triton reports as ``n_spills`` on a GPU), spill_stores and spill_loads
    (STL and LDL instructions in the SASS) and spilled (any of them)."""
    return read_compiled_table(path)


def compiled_entry(config: Config, path: Path | str = COMPILED_PATH) -> dict | None:
    """The compiled table's entry for ``config`` (two consumers, FA3's order), or None."""
    if config.CONSUMERS != 2 or not config.OVERLAP:
        return None
    key = _config_key(config)
    for e in compiled_table(path)["configs"]:
        if _key(e["d"], e["dtype"], e["BLOCK_M"], e["BLOCK_N"], e["STAGES"]) == key:
            return e
    return None


# ------------------------------------------------------------------------------------------------
# regenerating the compiled table (needs triton with Gluon; no GPU)
# ------------------------------------------------------------------------------------------------
TABLE_CONFIGS = [(d, "float16", bm, bn, st) for d in (128, 64) for bm in (64, 128)
                 for bn in (64, 128, 256) for st in (2, 3, 4)] + \
                [(128, "bfloat16", 64, 128, 2), (128, "bfloat16", 128, 64, 2),
                 (64, "bfloat16", 64, 128, 3), (64, "bfloat16", 128, 128, 2)]


def compile_entry(d: int, dtype: str, bm: int, bn: int, stages: int) -> dict:
    """Compile the chapter's kernel (``gluon_fa3.compile_for_sm90``, non-causal, FA3's order)
    for one config and read what it needs: ``metadata.shared``, and from the cubin with
    ``cuobjdump`` (bundled with Triton) the register count, the stack and the spill
    instructions."""
    from . import gluon_fa3
    c = Config(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages).for_inputs(d, dtype)
    k = gluon_fa3.compile_for_sm90(c, causal=False)
    entry = dict(d=d, dtype=dtype, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages,
                 shared=k.metadata.shared)
    entry.update(cubin_resources(k.asm["cubin"], "fa3_kernel")[0])
    entry["spilled"] = bool(entry["spill_stores"] or entry["spill_loads"] or entry["stack"])
    return entry


def _provenance(command: str) -> dict:
    from . import fa3_kernel
    return dict(
        what="Chapter 6's Gluon FA3 kernel (flashbook.chapters.ch6.gluon_fa3.fa3_kernel) "
             "compiled ahead of time, non-causal, OVERLAP=True, two consumer warpgroups, with "
             "the launch options and setmaxnreg budgets of gluon_fa3.kernel_args",
        target="GPUTarget('cuda', 90, 32): sm_90a (H100/H200)",
        **compile_provenance(command, fa3_kernel.__file__),     # the device code's source
        fields=dict(
            shared="metadata.shared: bytes of dynamic shared memory a block needs",
            n_regs="registers a thread at launch (cuobjdump -res-usage REG; what the driver "
                   "reports as the kernel's n_regs): the maxnreg of 168, before setmaxnreg "
                   "moves registers from the producer to the consumers",
            stack="cuobjdump -res-usage STACK: bytes of local memory per thread",
            spill_stores="STL instructions in the SASS (cuobjdump -sass)",
            spill_loads="LDL instructions in the SASS",
            spilled="any of stack, spill_stores, spill_loads"),
        machine="no GPU: compiled on a CPU-only machine",
    )


def main(argv=None, module: str = "flashbook.chapters.ch6.compile_table",
         description: str | None = None):
    """Regenerate the table; ``module`` is the command recorded in its provenance."""
    import argparse
    p = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    p.add_argument("--out", default=str(COMPILED_PATH))
    args = p.parse_args(argv)
    write_compiled_table(args.out, module, argv, TABLE_CONFIGS, compile_entry, _provenance)


if __name__ == "__main__":
    main()
