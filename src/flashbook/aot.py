"""Ahead-of-time compiles of the chapters' Gluon kernels, shared by Chapters 6 and 7: Gluon's
AST source class across the Triton versions the book runs (3.6 on GPU images, 3.9 in CI), and
the writer of a stored table of what compiling reported (``src/flashbook/data/ch*_compiled.json``,
with its provenance), which a chapter's checks read instead of compiling in a notebook."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable


def gluon_ast_source():
    """``GluonASTSource``: exported by ``triton.experimental.gluon`` in triton 3.9, kept in its
    ``_runtime`` module in 3.6."""
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:
        from triton.experimental.gluon._runtime import GluonASTSource
    return GluonASTSource


def write_compiled_table(out: str | Path, module: str, argv: list[str] | None,
                         configs: Iterable[tuple], compile_entry: Callable[..., dict],
                         provenance: Callable[[str], dict]) -> None:
    """Compile every config (``compile_entry(*config)`` -> one row), printing each row and its
    time, and write ``{"provenance": ..., "configs": [...]}`` to ``out``, one config a line.
    ``module`` and ``argv`` make the exact command recorded in the provenance."""
    fusion = os.environ.get("TRITON_DEFAULT_FP_FUSION")
    command = ((f"TRITON_DEFAULT_FP_FUSION={fusion} " if fusion else "")
               + f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv))
    rows = []
    for cfg in configs:
        t = time.time()
        rows.append(compile_entry(*cfg))
        print(json.dumps(rows[-1]), f"{time.time() - t:.1f} s", flush=True)
    prov = json.dumps(provenance(command.strip()), indent=1).replace("\n", "\n ")
    lines = ",\n  ".join(json.dumps(r) for r in rows)
    Path(out).write_text(f'{{\n "provenance": {prov},\n "configs": [\n  {lines}\n ]\n}}\n')
    print("wrote", out)
