"""The measured figures a chapter's prose quotes, pasted in by the book with myst-nb's glue.

The prose never types a measured number: it writes a role, ``{glue:text}`ch6_fwd_tflops:.0f```
(the key, then a format spec), and a hidden cell of the notebook (tagged ``remove-cell``)
glues every key from the recorded data::

    from flashbook import quoted
    quoted.glue(ch6.CHAPTER)

``Chapter.figures`` computes the values from the chapter's one single-GPU record
(``results.book_gpu``: the H200's today), so the data is the one source of each figure. The book renders each role as its value formatted; a notebook opened
outside the book (Colab) shows the role as written, and there gluing does nothing.
``tests/test_chapters.py`` checks that every key the prose pastes is glued and that the values
follow the data.
"""
from __future__ import annotations

import re

from . import results

# {glue:text}`key:fmt` (myst-nb's role; the format spec is optional)
ROLE = re.compile(r"\{glue:text\}`([^`:]+)(?::([^`]*))?`")


def values(chapter) -> dict[str, float | int | str]:
    """Key -> value of every figure ``chapter`` quotes, from its recorded GPU rows; plain
    Python numbers, so the text the book pastes is their repr (not ``np.float64(...)``)."""
    gpu = results.book_gpu(chapter.id)
    found = gpu and results.recorded(chapter.id, gpu)
    if not found:
        raise ValueError(f"{chapter.id} quotes figures but has no recorded GPU data")
    out = {}
    for key, v in chapter.figures(found.rows).items():
        if not key.startswith(chapter.id + "_"):
            raise ValueError(f"glue key {key!r} must start with {chapter.id}_")
        out[key] = v if isinstance(v, str) else int(v) if isinstance(v, int) else float(v)
    return out


def glue(chapter) -> None:
    """Glue every figure of ``chapter`` for the book (hidden: ``display=False``). Outside a
    Jupyter kernel, or without myst-nb (Colab), it does nothing: only the book reads glue."""
    try:
        from IPython import get_ipython
        from myst_nb import glue as myst_glue
    except ImportError:
        return
    if get_ipython() is None:
        return
    for key, value in values(chapter).items():
        myst_glue(key, value, display=False)


def roles(text: str) -> list[tuple[str, str]]:
    """The (key, format spec) of every ``{glue:text}`` role in ``text``, in order."""
    return [(m.group(1), m.group(2) or "") for m in ROLE.finditer(text)]


def render(text: str, figures: dict) -> str:
    """``text`` with every role replaced by its value formatted as the book formats it (myst-nb's
    own ``format_plain_text`` of the value's repr). KeyError for a key not in ``figures``."""
    from myst_nb.core.variables import format_plain_text
    return ROLE.sub(lambda m: format_plain_text(repr(figures[m.group(1)]), m.group(2) or ""),
                    text)
