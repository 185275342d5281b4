"""Benchmark results: one ``Row`` per measurement, recorded with its provenance, drawn and printed
one way (introduced in Chapter 1; every chapter's benchmark uses it).

``flashbook bench <chapter>`` (``record``) runs a chapter's benchmark on a GPU and writes
``src/flashbook/data/bench/<chapter>/<gpu>.csv`` (one ``Row`` a line) and ``<gpu>.json`` (its
provenance: GPU, driver, versions, date, command, timer). ``recorded`` reads them back as
``Row``s; ``plot`` draws rows (lines against N, or grouped bars) and ``table`` prints them.

Figures about GPU speed in the book come only from these files: a CPU runtime's timings say
nothing about a GPU.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import typing
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes

from .contract import Chapter
from .device import current

DATA_DIR = Path(__file__).resolve().parent / "data" / "bench"
# reference: the chapter's kernel as its benchmark times it (unchecked, the config passed, often
# replayed from a CUDA graph); public: the same problem through the entry point as the book shows
# it (no config, checks on, launched: what a reader's call costs); baseline; variant.
ROLES = ("reference", "public", "baseline", "variant")


@dataclasses.dataclass
class Row:
    """One measurement: one kernel on one problem (one line of ``<chapter>/<gpu>.csv``).

    ``ms`` and the rates derived from it are None when nothing was measured (``note`` says why,
    e.g. "out of memory"); ``peak_mib`` is None when memory was not measured.
    """
    kernel: str
    role: str                 # reference | public | baseline | variant
    B: int
    H_q: int
    H_kv: int
    N_q: int
    N_k: int
    d: int
    dtype: str                # "float16", as torch names it without "torch."
    causal: bool
    ms: float | None          # median time of one forward
    tflops: float | None      # 4 N_q N_k d per head (the two matmuls) / time
    gbps: float | None        # compulsory traffic (read Q, K, V, write O) / time
    pct_peak: float | None    # of the datasheet peak (tensor cores for fp16/bf16)
    peak_mib: float | None = None   # peak extra memory of one call
    note: str = ""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Row {self.kernel!r}: role must be one of {ROLES}, got {self.role!r}")


COLUMNS = tuple(f.name for f in dataclasses.fields(Row))


def problem(row: Row) -> tuple:
    """What a row measured: its kernel and its problem's columns (not its role or figures)."""
    return (row.kernel, row.B, row.H_q, row.H_kv, row.N_q, row.N_k, row.d, row.dtype, row.causal)


def companion(rows: Sequence[Row], i: int) -> Row | None:
    """The ``public`` row of the reference row ``rows[i]``: the row after it when that times
    the same kernel and problem as called (``bench.public_row`` rows follow their reference:
    rows alike in every column, such as Chapter 4's windows, are told apart by order)."""
    after = rows[i + 1] if i + 1 < len(rows) else None
    if rows[i].role == "reference" and after is not None and after.role == "public" and \
            problem(after) == problem(rows[i]):
        return after
    return None


def as_called(rows: Sequence[Row]) -> list[Row]:
    """The rows as a reader's call gets them, for the figures the book quotes: each reference
    row with its time and rates replaced by its measured ``public`` companion's (its role,
    memory and note kept, the note ending ``as called: <the call>``); public rows dropped.
    Without public rows, the rows as they are."""
    rows = list(rows)
    out = []
    for i, r in enumerate(rows):
        if r.role == "public":
            continue
        called = companion(rows, i)
        if called is not None and called.ms is not None:
            r = dataclasses.replace(r, ms=called.ms, tflops=called.tflops, gbps=called.gbps,
                                    pct_peak=called.pct_peak,
                                    note="; ".join(p for p in (r.note, f"as called: {called.note}")
                                                   if p))
        out.append(r)
    return out


def _parsers() -> dict:
    """Column -> function of the CSV text, from Row's field types."""
    def optional_float(text):
        return None if text == "" else float(text)

    def boolean(text):
        if text not in ("True", "False"):
            raise ValueError(f"expected True or False, got {text!r}")
        return text == "True"

    by_type = {int: int, str: str, bool: boolean, float | None: optional_float}
    return {name: by_type[t] for name, t in typing.get_type_hints(Row).items()}


_PARSE = _parsers()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"     # 6 significant digits: far finer than run-to-run noise
    return str(value)


# --------------------------------------------------------------------- files and provenance

# The GPU timing protocol (bench.time_ms times with it; provenance records it with the rows).
# Warm up for 100 ms (clocks settle), then time for 300 ms and keep the median: shorter runs
# (25/100 ms) left kernels of ~0.1 ms with +-30% run-to-run noise on an H200.
GPU_TIMER = dict(warmup=100, rep=300, return_mode="median")
# Replayed from a CUDA graph: a kernel of ~0.05 ms launched from Python can be bound by the
# launch itself (argument checks, Triton's launcher), which then hides the kernel's speed.
GRAPH_TIMER = dict(rep=300, return_mode="median")
# FLASHBOOK_QUICK_BENCH=1 (set by `flashbook selftest`): bench times with a few milliseconds of
# runs (bench.QUICK_GPU_TIMER), enough to show that a benchmark cell runs; ``record`` refuses.
QUICK_ENV = "FLASHBOOK_QUICK_BENCH"


def quick() -> bool:
    return os.environ.get(QUICK_ENV) == "1"


def timer(graph: bool = False) -> str:
    """The GPU timer as a call, for provenance records."""
    name, kw = ("do_bench_cudagraph", GRAPH_TIMER) if graph else ("do_bench", GPU_TIMER)
    return f"triton.testing.{name}(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'Tesla T4' -> 't4'."""
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip())
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").split("-")[0] or "gpu"


def provenance(command: str, graph_timer: bool = False) -> dict:
    """Who measured what, where and how: enough to reproduce or distrust a number.
    ``graph_timer``: the rows were timed replayed from CUDA graphs."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "timer": timer(graph_timer),
    }
    for mod in ("triton", "numba", "numba_cuda", "numpy"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except (ImportError, AttributeError):
            info[mod] = None
    for dist in ("jax", "jaxlib"):            # read without importing: JAX would claim the GPU
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["multiprocessors"] = props.multi_processor_count
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        try:
            lines = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.split()
            info["driver"] = ", ".join(dict.fromkeys(lines)) or None   # a line per GPU
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def write(rows: Sequence[Row], directory: Path, slug: str, provenance: dict) -> Path:
    """Write ``<slug>.csv`` (one line per Row) and ``<slug>.json`` (``provenance``) under
    ``directory``; return the CSV's path. Floats keep 6 significant digits."""
    bad = [type(r).__name__ for r in rows if not isinstance(r, Row)]
    if bad:
        raise ValueError(f"write: rows must be results.Row, got {', '.join(sorted(set(bad)))}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{slug}.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([_cell(getattr(r, c)) for c in COLUMNS])
    (directory / f"{slug}.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return path


def read(path: Path) -> list[Row]:
    """The Rows of a results CSV (empty cells are None); a file that is not one raises
    ValueError naming the line and column."""
    path = Path(path)
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(header) != COLUMNS:
            raise ValueError(f"{path}: columns {header} are not the results columns "
                             f"{list(COLUMNS)}")
        rows = []
        for line, cells in enumerate(reader, start=2):
            if len(cells) != len(COLUMNS):
                raise ValueError(f"{path}, line {line}: {len(cells)} cells, expected "
                                 f"{len(COLUMNS)}")
            values = {}
            for name, text in zip(COLUMNS, cells):
                try:
                    values[name] = _PARSE[name](text)
                except ValueError as e:
                    raise ValueError(f"{path}, line {line}, column {name}: {e}") from None
            rows.append(Row(**values))
    return rows


class Recorded(NamedTuple):
    rows: list[Row]
    provenance: dict


def recorded(chapter: str, gpu: str = "h200") -> Recorded | None:
    """The rows measured on a real GPU and shipped with the package, with their provenance
    (``DATA_DIR/<chapter>/<gpu>.csv`` and ``.json``), or None if there are none."""
    csv_path = DATA_DIR / chapter / f"{gpu}.csv"
    if not csv_path.exists():
        return None
    meta_path = csv_path.with_suffix(".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return Recorded(read(csv_path), meta)


def gpus(chapter: str) -> list[str]:
    """The slugs of the records ``chapter`` has (``<slug>.csv``, e.g. ``h200``; a run on P GPUs
    of one host is ``<slug>x<P>``, its provenance saying ``world_size``), sorted."""
    return sorted(p.stem for p in (DATA_DIR / chapter).glob("*.csv"))


def book_gpu(chapter: str) -> str | None:
    """The slug of the one single-GPU record of ``chapter``, the rows its prose quotes; None if
    it has none. The book quotes one GPU: a second single-GPU record is an error."""
    def world_size(slug):
        meta = DATA_DIR / chapter / f"{slug}.json"
        return json.loads(meta.read_text()).get("world_size", 1) if meta.exists() else 1
    single = [g for g in gpus(chapter) if world_size(g) == 1]
    if len(single) > 1:
        raise ValueError(f"{chapter}: records of several GPUs {single}; the prose quotes one")
    return single[0] if single else None


def one_record(directory: Path, what: str) -> dict | None:
    """The one ``<gpu>.json`` record in ``directory`` of a measurement kept apart from the
    chapters' benchmarks (FP8, the ablations), or None; records of several GPUs are an error,
    as for ``book_gpu``: the prose quotes one."""
    found = sorted(directory.glob("*.json"))
    if len(found) > 1:
        raise ValueError(f"{what}: records of several GPUs {[p.stem for p in found]}; the "
                         "prose quotes one")
    return json.loads(found[0].read_text()) if found else None


def profile_figures(path: Path, patterns: dict, what: str) -> dict:
    """Figures read from a stored Nsight Compute report (``src/flashbook/data/profiles``):
    name -> the number in the first group of ``patterns[name]`` (thousands separators
    dropped), as a float. ValueError naming the report and the figure when one is missing."""
    path = Path(path)
    text = path.read_text()
    out = {}
    for name, pattern in patterns.items():
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"{what}: the profile {path.name} has no {name} figure ({pattern})")
        out[name] = float(m.group(1).replace(",", ""))
    return out


def describe(provenance: dict) -> str:
    """One line of provenance for a caption: 'gpu NVIDIA H200, driver ..., torch ..., date ...'."""
    keys = ("gpu", "driver", "cuda", "torch", "triton", "date")
    # a multi-GPU record made before the driver was deduplicated has a line per GPU
    value = {k: ", ".join(dict.fromkeys(str(provenance[k]).split("\n"))) for k in keys
             if provenance.get(k)}
    return ", ".join(f"{k} {v}" for k, v in value.items())


def record(chapter: Chapter, out_root: Path, command: str) -> Path:
    """Run a chapter's benchmark (its contract's ``benchmark``) on this GPU and write the rows
    and their provenance under ``out_root/<chapter id>/<gpu>.{csv,json}``; return the CSV."""
    return record_benchmark(chapter.id, chapter.benchmark, out_root, command, chapter.graph_timer)


def record_benchmark(chapter_id: str, benchmark: Callable[[], list[Row]] | None, out_root: Path,
                     command: str, graph_timer: bool = False) -> Path:
    """``record`` given what it reads of the contract: the chapter's id, its benchmark and
    whether that times replayed from CUDA graphs (a chapter's own command line calls this)."""
    backend = current()
    if not backend.gpu:
        raise RuntimeError(f"flashbook bench {chapter_id}: records GPU measurements and needs a "
                           "CUDA GPU, but this runtime has none (or FLASHBOOK_FORCE_CPU=1 is set); "
                           "CPU timings are not recorded.")
    if benchmark is None:
        raise ValueError(f"chapter {chapter_id} has no benchmark (its CHAPTER.benchmark is None)")
    if quick():
        raise RuntimeError(f"flashbook bench {chapter_id}: {QUICK_ENV}=1 is set, and its quick "
                           "timings are not measurements: unset it to record")
    rows = benchmark()
    return write(rows, Path(out_root) / chapter_id, gpu_slug(backend.name),
                 provenance(command, graph_timer))


# ------------------------------------------------------------------------------ output

def table(rows: Sequence[Row]) -> str:
    """A fixed-width text table for notebook output."""
    head = f"{'kernel':<18}{'N':>7}{'ms':>10}{'TFLOP/s':>10}{'% peak':>8}{'MiB':>10}  note"
    out = [head, "-" * len(head)]

    def f(x, spec):
        return format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])
    for r in rows:
        out.append(f"{r.kernel:<18}{r.N_q:>7}{f(r.ms, '10.3f')}{f(r.tflops, '10.2f')}"
                   f"{f(r.pct_peak, '8.1f')}{f(r.peak_mib, '10.1f')}  {r.note}")
    return "\n".join(out)


LABELS = {"ms": "time (ms)", "tflops": "TFLOP/s", "gbps": "GB/s",
          "pct_peak": "% of datasheet peak", "peak_mib": "peak extra memory (MiB)",
          "N_q": "sequence length N", "N_k": "key length N_k", "d": "head dimension d",
          "B": "batch B", "H_q": "heads H"}
_SHORT = {"H_q": "H", "N_q": "N"}          # in tick and legend labels: "B=4 H=16 N=4096 d=64"
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8"}


def _key(columns):
    """A row's value of one column, or a tuple of values of several."""
    if isinstance(columns, str):
        return lambda r: getattr(r, columns)
    return lambda r: tuple(getattr(r, c) for c in columns)


def _label(columns, value) -> str:
    """'sdpa_flash' for the kernel; 'N=4096'; 'B=4 H=16\\nN=4096 d=64' for several columns."""
    if isinstance(columns, str):
        return str(value) if columns in ("kernel", "role", "dtype", "note") \
            else f"{_SHORT.get(columns, columns)}={value}"
    parts = [f"{_SHORT.get(c, c)}={v}" for c, v in zip(columns, value)]
    return "\n".join(" ".join(parts[i:i + 2]) for i in range(0, len(parts), 2))


def _ylabel(y: str, rows) -> str:
    dtypes = {r.dtype for r in rows}
    if y in ("tflops", "gbps", "pct_peak") and len(dtypes) == 1:   # rates depend on the dtype
        (dt,) = dtypes
        return f"{LABELS[y]} ({_DTYPES.get(dt, dt)})"
    return LABELS.get(y, y)


def _check_columns(what: str, columns):
    for c in ([columns] if isinstance(columns, str) else columns):
        if c not in COLUMNS:
            raise ValueError(f"plot: {what}={c!r} is not a column; columns: {', '.join(COLUMNS)}")


def plot(rows: Sequence[Row], y: str | Sequence[str] = "tflops", x: str | Sequence[str] = "N_q", *,
         by: str | Sequence[str] = "kernel", kind: str = "line", ax=None, title: str | None = None,
         logx: bool = False, logy: bool = False, values: bool = False):
    """Draw benchmark rows; return the Figure. One panel per column in ``y`` (a name or several).

    ``kind="line"``: ``y`` against the numeric column ``x``, one line per value of ``by``; a
    row that was not measured (``ms`` None, e.g. out of memory) marks its group's first such
    ``x`` with a dashed line and its note.
    ``kind="bar"``: one group of bars per value of ``x`` (a column or several, e.g.
    ``("B", "H_q", "N_q", "d")`` for a shape), one bar per value of ``by`` in each group;
    ``values`` writes each bar's value above it.
    Groups and bars keep the rows' order. ``logx`` (base 2) and ``logy`` set log axes; ``ax``
    draws into given Axes (one per ``y``) instead of a new figure.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("plot: no rows to draw")
    if kind not in ("line", "bar"):
        raise ValueError(f"plot: kind must be 'line' or 'bar', got {kind!r}")
    ys = [y] if isinstance(y, str) else list(y)
    for what, cols in (("y", ys), ("x", x), ("by", by)):
        _check_columns(what, cols)
    if ax is None:
        width = 5.0 * len(ys) if kind == "line" else 8.0
        fig, axes = plt.subplots(1, len(ys), figsize=(width, 3.8), squeeze=False)
        axes = list(axes[0])
    else:
        axes = [ax] if isinstance(ax, Axes) else list(np.ravel(ax))    # one, or plt.subplots
        if len(axes) != len(ys):
            raise ValueError(f"plot: {len(ys)} panels (y={ys}) need {len(ys)} Axes, "
                             f"got {len(axes)}")
        fig = axes[0].figure
    # a public row is its own line or bar: the call as a reader makes it
    group_of = _kernel_name if by == "kernel" else _key(by)
    x_of = _kernel_name if x == "kernel" else _key(x)
    groups = list(dict.fromkeys(group_of(r) for r in rows))
    for panel, col in zip(axes, ys):
        if kind == "line":
            _lines(panel, rows, col, x, groups, group_of, by, logy)
        else:
            _bars(panel, rows, col, x, x_of, groups, group_of, by, values)
        if logx:
            panel.set_xscale("log", base=2)
        if logy:
            panel.set_yscale("log")
        panel.set_ylabel(_ylabel(col, rows))
        panel.grid(True, axis="both" if kind == "line" else "y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        (fig.suptitle if len(axes) > 1 else axes[0].set_title)(title, fontsize=10)
    fig.tight_layout()
    return fig


def _kernel_name(row: Row) -> str:
    return row.kernel + (" (as called)" if row.role == "public" else "")


def _lines(ax, rows, y, x, groups, group_of, by, logy):
    if not isinstance(x, str):
        raise ValueError("plot: a line plot's x is one numeric column, e.g. 'N_q'")
    failed = []
    for i, g in enumerate(groups):
        mine = [r for r in rows if group_of(r) == g]
        pts = sorted((getattr(r, x), getattr(r, y)) for r in mine
                     if getattr(r, y) is not None and not (logy and getattr(r, y) <= 0))
        if pts:
            ax.plot(*zip(*pts), "o-", label=_label(by, g), color=f"C{i}")
        lost = sorted((getattr(r, x), r.note) for r in mine if r.ms is None and r.note)
        if lost:
            failed.append((i, g, *lost[0]))
    # after the lines, so the y limits are final; text at the top of the axes (axes fraction)
    for i, g, at, note in failed:
        ax.axvline(at, color=f"C{i}", ls="--", lw=1, gid="not measured")
        ax.text(at, 0.98, f" {_label(by, g)}: {note}", color=f"C{i}", rotation=90, va="top",
                fontsize=8, transform=ax.get_xaxis_transform())
    ax.set_xlabel(LABELS.get(x, x))


def _bars(ax, rows, y, x, x_of, groups, group_of, by, values):
    cats = list(dict.fromkeys(x_of(r) for r in rows))
    width = 0.8 / len(groups)
    for i, g in enumerate(groups):
        heights = []
        for c in cats:
            hit = [getattr(r, y) for r in rows if group_of(r) == g and x_of(r) == c
                   and getattr(r, y) is not None]
            heights.append(hit[0] if hit else math.nan)    # not measured: no bar
        bars = ax.bar([j + i * width for j in range(len(cats))], heights, width,
                      label=_label(by, g), color=f"C{i}")
        if values:
            ax.bar_label(bars, labels=["" if math.isnan(h) else f"{h:.3g}" for h in heights],
                         fontsize=7, padding=2)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(cats))])
    ax.set_xticklabels([_label(x, c) for c in cats], fontsize=8,
                       rotation=15 if isinstance(x, str) else 0)
