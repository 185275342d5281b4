"""flashbook.cpu_child: the load counts of Chapters 4 and 5 (which need the interpreter) run in
a CPU-mode child process when the runtime is a GPU, on the student's kernels shipped as source,
and give the same verdicts there: a right kernel passes with the same report, a known-wrong one
fails for its own reason."""
from pathlib import Path

import pytest

from flashbook import cpu_child, sources
from flashbook.compare import CheckFailure

ROOT = Path(__file__).resolve().parents[1]


def _variant(ch, name):
    v = next(v for v in sources.variants(ch) if v.name == name)
    cells = sources.cells_by_id(sources.read(sources.source(ch, ROOT).path))
    return sources.solution_namespace(ch, ROOT, replace={v.cell: v.apply(cells[v.cell])})


@pytest.mark.parametrize("ch, target, entry, wrong, expect", [
    ("ch4", "flashbook.chapters.ch4.checks:count_masked_loads", "attn_masked_kernel",
     "masked_but_no_skipping", "nothing is skipped"),
    ("ch5", "flashbook.chapters.ch5.checks:count_prefill_loads", "attention_gqa",
     "mfold_repeats_kv_per_query_head", "once per query head"),
])
def test_the_counts_run_in_a_cpu_child_with_the_same_verdicts(ch, target, entry, wrong, expect):
    module, name = target.split(":")
    count = getattr(__import__(module, fromlist=[name]), name)
    right = sources.solution_namespace(ch, ROOT)[entry]
    assert cpu_child.on_cpu(target, {entry: right}, hidden=False) == count(right, hidden=False)
    with pytest.raises(CheckFailure, match=expect):
        cpu_child.on_cpu(target, {entry: _variant(ch, wrong)[entry]}, hidden=False)


def test_on_a_gpu_runtime_the_checks_send_the_counts_to_the_child(monkeypatch):
    """Grading under --device gpu drops no check: the counts go to ``on_cpu``."""
    import types
    from flashbook.chapters.ch4 import checks as ch4_checks
    from flashbook.chapters.ch5 import checks as ch5_checks
    sent = []
    for module in (ch4_checks, ch5_checks):
        monkeypatch.setattr(module, "current", lambda: types.SimpleNamespace(gpu=True))
        monkeypatch.setattr(module, "on_cpu", lambda target, fns, hidden: sent.append(target)
                            or " (counted)")
    assert ch4_checks.count_masked_loads(object()) == " (counted)"
    assert ch5_checks.count_prefill_loads(object()) == " (counted)"
    assert sent == ["flashbook.chapters.ch4.checks:count_masked_loads",
                    "flashbook.chapters.ch5.checks:count_prefill_loads"]
