"""The graded-check harness (introduced in Chapter 1; every chapter's checks are built on it).

Visible checks (in the student notebook) and hidden tests (added by the autograder) both call
chapter checks built from these pieces. A failed check raises ``CheckFailure`` (an
AssertionError, so nbgrader counts the cell as failed) with a message meant to teach: which
case, which positions are wrong, by how much, and a hint about the usual cause.

* ``run_student`` is the one way to call student code: every way it can fail (a stub, a
  rejected launch, an out-of-bounds access, a race, an index past an array) becomes a
  ``CheckFailure`` that says so.
* ``check_attention`` checks any attention implementation on a list of ``AttnCase``: every
  case with every tile config, against the float64 reference, with optional NaN padding and
  canaries around the inputs and (CPU mode) the Triton out-of-bounds guard.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import re
from typing import Callable, Sequence

import numpy as np
import torch

from . import oob
from .cases import AttnCase, check_values, expected, make_inputs, poisoned_outputs
from .compare import TOLERANCES, CheckFailure, assert_close, format_ranges
from .race import RaceError

__all__ = ["CheckFailure", "assert_close", "format_ranges", "TOLERANCES", "run_student",
           "is_stub", "require_implemented", "no_nan", "report", "check_attention",
           "check_argument_errors", "simulated_capture", "HostReadDuringCapture"]

NOT_IMPLEMENTED = "not implemented yet (the stub still raises NotImplementedError)."


def run_student(fn: Callable, *args, what: str, guard: bool = False,
                passthrough: tuple = (), index_hint: str = "", **kwargs):
    """Call student code (``guard``: under the out-of-bounds guard, for Triton kernels) and turn
    each way it can fail into a CheckFailure that says what happened.

    Exceptions in ``passthrough`` propagate unchanged (a check that expects a ValueError);
    others not listed here propagate too: a TypeError in student code fails the cell with its
    own traceback, which is the most useful message.
    """
    try:
        with poisoned_outputs(), check_values():    # NaN outputs; index values checked
            if guard:
                with np.errstate(divide="ignore"):  # log(0) = -inf is intended (empty rows)
                    return oob.call(fn, *args, what=what, **kwargs)
            return fn(*args, **kwargs)
    except passthrough:
        raise
    except RaceError as e:      # a CheckFailure without the case: say which
        raise CheckFailure(f"{what}: {e}") from None
    except CheckFailure:
        raise
    except NotImplementedError as e:
        where = str(e).partition(" (in `")[2].rstrip(")")
        raise CheckFailure(f"{what}: {NOT_IMPLEMENTED}"
                           + (f" Unfinished: `{where}" if where else "")) from None
    except ValueError as e:
        raise CheckFailure(f"{what}: the call was rejected with ValueError: {e}") from None
    except IndexError as e:     # the Numba CUDA simulator checks every index
        raise CheckFailure(f"{what}: the kernel indexed past the end of an array: {e}\n  (tid is "
                           f"the thread, ctaid the block.) {index_hint}".rstrip()) from None
    except Exception as e:      # a stub a GPU's compiler refused ("unsupported AST node: Raise")
        stub = oob.stub_of(e)
        if stub is None:
            raise
        raise CheckFailure(f"{what}: {NOT_IMPLEMENTED}"
                           + (f" Unfinished: `{stub}`." if stub else "")) from None


def _source(obj) -> str:
    fn = _python_function(obj)
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def is_stub(obj) -> bool:
    """True when a function or kernel is still the exercise stub (its body raises
    NotImplementedError). Kernels run in simulators, where a stub would fail obscurely.
    Launchers ask on every call, so the answer is kept per Python function: reading its source
    (``inspect.getsource`` tokenizes the file) costs about 1 ms, more than many launches, and a
    function's source never changes (a redefined one is a new function)."""
    fn = _python_function(obj)
    try:
        return _function_is_stub(fn)
    except TypeError:           # unhashable: ask afresh
        return _source_is_stub(_source(fn))


def _python_function(obj):
    """The Python function under a Numba dispatcher (``py_func``) or a Triton kernel (``fn``)."""
    return getattr(obj, "py_func", getattr(obj, "fn", obj))


@functools.lru_cache(maxsize=256)
def _function_is_stub(fn) -> bool:
    return _source_is_stub(_source(fn))


def _source_is_stub(src: str) -> bool:
    return "raise NotImplementedError" in src and "BEGIN SOLUTION" not in src


def require_implemented(obj, what: str):
    if is_stub(obj):
        raise CheckFailure(f"{what}: {NOT_IMPLEMENTED}")


def as_int(value, what: str) -> int:
    """A student's answer that must be a whole number, as an int (an integral float is accepted,
    a bool is not); anything else raises a ``CheckFailure`` that names ``what``."""
    if isinstance(value, bool):
        raise CheckFailure(f"{what}: {value!r}; it should be a whole number (an int).")
    try:
        return operator.index(value)
    except TypeError:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise CheckFailure(f"{what}: {value!r} ({type(value).__name__}); it should be a whole "
                           "number (an int).") from None


def no_nan(t: torch.Tensor, what: str):
    if torch.isnan(t).any():
        raise CheckFailure(f"{what}: contains NaN. Typical causes: exp(-inf - (-inf)) in a row whose "
                           "running max is still -inf, 0 * NaN from an unmasked load of padding, "
                           "or 0/0 when a row's sum is 0.")


def report(title: str, n: int, extra: str = "", hidden: bool = False):
    """The line a passing check prints; silent for ``hidden`` runs (the book shows the visible
    checks' results only; a failing hidden check still raises)."""
    if not hidden:
        print(f"PASSED {title}: {n}/{n} cases{extra}")


# ------------------------------------------------------------------------- attention

def _unpack(out, returns_lse: bool, what: str):
    if not returns_lse:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise CheckFailure(f"{what}: expected a tuple (O, LSE), got {type(out).__name__}.")
    return out


_HINT = ("scale S = Q K^T by 1/sqrt(d) (or the given scale) before the softmax, and compute the "
         "softmax over keys (the last axis).")
_HINT_MASK = ("masks are aligned bottom-right: query i sees key j iff j <= i + (N_k - N_q) "
              "(and, with a window (left, right), j >= i + N_k - N_q - left); rows that see no key "
              "give O = 0 and LSE = -inf.")
_HINT_LSE = ("LSE is log(sum_j exp(s_ij)) in natural log of the scaled, masked scores: m + log(l). "
             "A row with no visible key has LSE -inf.")


def check_attention(run: Callable, cases: Sequence[AttnCase], *, title: str,
                    configs: Sequence | Callable = (None,), describe_config: Callable | None = None,
                    guard: bool = False, pad: int = 0, returns_lse: bool = True,
                    hint: str = "", lse_hint: str = _HINT_LSE, lse_tol=(1e-4, 1e-4),
                    seed: int = 0, quiet: bool = False) -> int:
    """Check ``run(q, k, v, case, config) -> (O, LSE)`` (or O alone: ``returns_lse=False``).

    For every case: seeded inputs (``pad > 0``: inside NaN padding with canaries), the float64
    reference, then every tile config (``configs``: a list, or a function of the case; None is
    the implementation's default) — O within the dtype's tolerance and in q's dtype, LSE in
    natural log, no NaN, the same result for every config, and the canaries intact.
    ``guard`` runs each call under the out-of-bounds guard (Triton, CPU mode).
    Returns the number of (case, config) runs; prints the PASSED line unless ``quiet``.
    """
    describe_config = describe_config or (lambda cfg: "" if cfg is None else str(cfg))
    n = 0
    for i, case in enumerate(cases):
        q, k, v = make_inputs(case, seed + 100 * i, pad=pad)
        want_o, want_lse = expected(case, q, k, v)
        masked = case.causal or case.window is not None
        outs = []
        for cfg in (configs(case) if callable(configs) else configs):
            tiles = describe_config(cfg)
            what = f"{title}, case {case.describe()}" + (f", {tiles}" if tiles else "")
            o, lse = _unpack(run_student(run, q, k, v, case, cfg, what=what, guard=guard),
                             returns_lse, what)
            if not isinstance(o, torch.Tensor):
                raise CheckFailure(f"{what}: O should be a torch.Tensor, got {type(o).__name__}.")
            no_nan(o, what + ", O")
            dims = ("token", "h", "col") if case.varlen else ("b", "h", "row", "col")
            assert_close(o, want_o, what=f"{what}, output O", dims=dims, dtype=case.dtype,
                         hint=hint or (_HINT_MASK if masked else _HINT))
            if o.dtype != case.dtype:
                raise CheckFailure(f"{what}: O has dtype {o.dtype}, expected {case.dtype}.")
            if lse is not None:
                no_nan(lse, what + ", LSE")
                assert_close(lse, want_lse, what=f"{what}, LSE",
                             dims=("h", "token") if case.varlen else ("b", "h", "row"),
                             dtype=torch.float32, atol=lse_tol[0], rtol=lse_tol[1], hint=lse_hint)
            outs.append((cfg, o))
            n += 1
        tol = TOLERANCES.get(case.dtype, TOLERANCES[torch.float32])[0]
        for (c1, o1), (c2, o2) in itertools.combinations(outs, 2):
            diff = (o1.double() - o2.double()).abs().max().item() if o1.numel() else 0.0
            if diff > tol:
                raise CheckFailure(f"{title}, case {case.describe()}: {describe_config(c1)} and "
                                   f"{describe_config(c2)} differ by {diff:.3g}; the result must "
                                   "not depend on the tile size.")
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            if hasattr(t, "_flashbook_canary") and not oob.canaries_intact(t):
                raise CheckFailure(f"{title}, case {case.describe()}: memory around {name} was "
                                   "overwritten: a store without a mask.")
    if not quiet:
        report(title, n)
    return n


# ------------------------------------------------------------------- argument checks

class HostReadDuringCapture(RuntimeError):
    """A tensor was read on the host while a CUDA graph was (as if) being captured."""


# What reads a tensor's values on the host: each is a device-to-host copy for a GPU tensor,
# which a stream that is capturing a CUDA graph refuses.
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def simulated_capture():
    """Run as if this thread's stream were capturing a CUDA graph, on any machine:
    ``torch.cuda.is_current_stream_capturing()`` (and ``is_initialized()``) say True, and each
    way of reading a tensor on the host (``HOST_READS``) raises ``HostReadDuringCapture``, as
    the copy to the host fails during a real capture."""
    own = vars(torch.Tensor)                          # the rest is inherited from TensorBase
    saved = {name: own[name] for name in HOST_READS if name in own}
    cuda = {name: getattr(torch.cuda, name) for name in ("is_initialized",
                                                         "is_current_stream_capturing")}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise HostReadDuringCapture(f"Tensor.{name}() of a {tuple(self.shape)} "
                                        f"{self.dtype} tensor")
        return read
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        for name in cuda:
            setattr(torch.cuda, name, lambda: True)
        yield
    finally:
        for name in HOST_READS:
            if name in saved:
                setattr(torch.Tensor, name, saved[name])
            else:
                delattr(torch.Tensor, name)
        for name, f in cuda.items():
            setattr(torch.cuda, name, f)


MAX_NAMED = 3      # a message naming more arguments than this does not say which one is wrong


def named_arguments(message: str, call: dict) -> set[str]:
    """The argument names of ``call`` that ``message`` names as whole words ("q" is not named
    by "cu_seqlens_q", nor "k" by "block")."""
    return {name for name in call if re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}"
                                               rf"(?![A-Za-z0-9_])", message)}


def check_argument_errors(validate: Callable, valid, invalid, *, title: str,
                          valid_hint: str = "", consequence: str = "",
                          captured: dict | None = None, capture_hint: str = "") -> int:
    """A wrapper's argument checks (Chapters 4 and 5): ``validate(**call)`` must return for every
    ``(name, call)`` in ``valid`` and raise a ValueError whose message names ``arg`` for every
    ``(name, call, arg)`` in ``invalid``, as a whole word and among at most ``MAX_NAMED`` of the
    call's arguments (one catch-all message naming them all says nothing); any other exception
    is a failure too. ``consequence``
    says what the kernel would do with a bad call that got through. ``captured``: a valid call
    that must also pass while a CUDA graph is captured (``simulated_capture``), reading no
    tensor on the host (``capture_hint`` says how). Returns the number of calls."""
    with check_values():        # the value checks, which a GPU's hot path skips, are graded
        return _argument_errors(validate, valid, invalid, title, valid_hint, consequence,
                                captured, capture_hint)


def _argument_errors(validate, valid, invalid, title, valid_hint, consequence, captured,
                     capture_hint) -> int:
    n = 0
    for name, call in valid:
        try:
            validate(**call)
        except ValueError as e:
            raise CheckFailure(f"{title}, {name}: raised ValueError({e}) for a valid call"
                               f"{' (' + valid_hint + ')' if valid_hint else ''}.") from None
        n += 1
    for name, call, arg in invalid:
        what = f"{title}, bad call: {name}"
        try:
            validate(**call)
        except ValueError as e:
            named = named_arguments(str(e), call)
            if arg not in named:
                raise CheckFailure(f"{what}: the ValueError's message should name `{arg}`, got: "
                                   f"{e}") from None
            if len(named) > MAX_NAMED:
                raise CheckFailure(f"{what}: the ValueError's message names {len(named)} "
                                   f"arguments ({', '.join(sorted(named))}): say which one is "
                                   f"wrong (`{arg}`) and why, got: {e}") from None
        except Exception as e:  # noqa: BLE001 - any other exception is the wrong answer
            raise CheckFailure(f"{what}: raised {type(e).__name__}({e}) instead of a ValueError "
                               f"naming `{arg}`.") from None
        else:
            raise CheckFailure(f"{what}: no ValueError. {consequence}".rstrip())
        n += 1
    if captured is not None:
        what = f"{title}, a valid call while a CUDA graph is captured"
        try:
            with simulated_capture():
                validate(**captured)
        except HostReadDuringCapture as e:
            raise CheckFailure(f"{what}: it read a tensor on the host ({e}), a copy a capturing "
                               "stream refuses, so the wrapper cannot run inside a CUDA graph "
                               f"(the benchmark's timer). {capture_hint}".rstrip()) from None
        except Exception as e:  # noqa: BLE001 - a valid call must pass during capture too
            raise CheckFailure(f"{what}: raised {type(e).__name__}({e}). "
                               f"{capture_hint}".rstrip()) from None
        n += 1
    return n
