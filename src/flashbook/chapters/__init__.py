"""The chapters' own code: one package per chapter, each with a ``CHAPTER`` contract
(``flashbook.contract.Chapter``) and whatever is truly its own (launch wrappers, chapter checks,
figures, its benchmark). Generic pieces live in the toolkit (the package's top level)."""
from __future__ import annotations

import importlib

from ..contract import Chapter

IDS = ("ch1", "ch2", "ch3", "ch4", "ch5", "ch6", "ch7", "ch8", "ch9")


def contract(chapter_id: str) -> Chapter:
    """The ``CHAPTER`` of ``flashbook.chapters.<chapter_id>`` (imported on demand: a chapter
    imports its own kernel toolchain, Numba or Triton)."""
    if chapter_id not in IDS:
        raise ValueError(f"no chapter {chapter_id!r}; known: {', '.join(IDS)}")
    return importlib.import_module(f"{__name__}.{chapter_id}").CHAPTER


def contracts() -> list[Chapter]:
    return [contract(c) for c in IDS]
