"""Chapter 6's interpret-mode jobs (Exercises 1 and 4): ``flashbook.pallas_interpret``, whose fork
server also imports the chapter's given kernels once; the notebook quotes ``INSTALL``."""
import functools

from ... import pallas_interpret
from ...pallas_interpret import (INSTALL, JAX_VERSION, STALL_S, TIMEOUT_S, Call, Run, unordered,
                                 where)

__all__ = ["INSTALL", "JAX_VERSION", "STALL_S", "TIMEOUT_S", "Call", "Run", "PRELOAD",
           "run_checked", "unordered", "where"]

PRELOAD = (f"{__package__}.ring", f"{__package__}.fa3_pallas")     # the checks' targets' modules
run_checked = functools.partial(pallas_interpret.run_checked, preload=PRELOAD)
