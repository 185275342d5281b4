"""``flashbook bench <chapter>``: run a chapter's kernels and baselines on one GPU and record
the results with their provenance under ``book/data/bench/<chapter>/<gpu>.{csv,json}``."""
from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib
import json
import platform
import re
import subprocess
from pathlib import Path

import torch

from ..bench import COLUMNS, Measurement, timer

CHAPTERS = {
    "ch1": "flashbook.benchmarks.ch1",
    "ch3": "flashbook.benchmarks.ch3",
    "ch2": "flashbook.benchmarks.ch2",
}


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'Tesla T4' -> 't4'."""
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip())
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").split("-")[0] or "gpu"


def provenance(command: str, graph_timer: bool = False) -> dict:
    """Who measured what, where and how: enough to reproduce or distrust a number."""
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
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["multiprocessors"] = props.multi_processor_count
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def write_results(rows: list[Measurement], directory: Path, slug: str, command: str,
                  graph_timer: bool = False):
    """Write <slug>.csv (one row per measurement) and <slug>.json (provenance)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{slug}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        for r in rows:
            d = dataclasses.asdict(r)
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in d.items()})
    (directory / f"{slug}.json").write_text(json.dumps(provenance(command, graph_timer), indent=2) + "\n")


def read_results(path: Path) -> list[dict]:
    """Rows of a results CSV with numbers parsed (empty cells become None)."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            parsed = {}
            for k, v in row.items():
                if k in ("kernel", "role", "dtype", "note"):
                    parsed[k] = v
                elif k == "causal":
                    parsed[k] = v == "True"
                elif v == "":
                    parsed[k] = None
                elif k in ("B", "H_q", "H_kv", "N_q", "N_k", "d"):
                    parsed[k] = int(v)
                else:
                    parsed[k] = float(v)
            out.append(parsed)
    return out


def run(chapter: str, out_root: Path, command: str) -> Path:
    if chapter not in CHAPTERS:
        raise ValueError(f"no benchmark for {chapter!r}; known: {', '.join(CHAPTERS)}")
    if not torch.cuda.is_available():
        raise RuntimeError("flashbook bench records GPU measurements and needs a CUDA GPU.")
    module = importlib.import_module(CHAPTERS[chapter])
    rows = module.run()
    slug = gpu_slug(torch.cuda.get_device_name(0))
    directory = out_root / chapter
    # a chapter module's GRAPH_TIMER says its rows were timed from CUDA graphs
    write_results(rows, directory, slug, command, getattr(module, "GRAPH_TIMER", False))
    return directory / f"{slug}.csv"


DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "bench"


def recorded(chapter: str, gpu: str = "h200"):
    """(rows, provenance) measured on a real GPU and shipped with the package, or None."""
    csv_path = DATA_DIR / chapter / f"{gpu}.csv"
    if not csv_path.exists():
        return None
    meta_path = csv_path.with_suffix(".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return read_results(csv_path), meta


def describe(meta: dict) -> str:
    """One line of provenance for a plot caption."""
    keys = ("gpu", "driver", "cuda", "torch", "triton", "date")
    return ", ".join(f"{k} {meta[k]}" for k in keys if meta.get(k))
