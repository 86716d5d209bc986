"""Rows for ``st.dataframe`` that Arrow can always convert, whatever the sizes in the plan.

Arrow stores integer columns as int64: a shape-only plan with a 2^40 x 2^40 tensor has byte
counts near 2^82, and converting them raises "int too large" in the middle of the page. A
column holding any integer outside int64 (directly or inside a shape tuple) is therefore shown
as text, integers written out exactly with thousands separators; other columns are left as they
are so small plans keep sortable numeric columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _too_wide(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not _INT64_MIN <= value <= _INT64_MAX
    if isinstance(value, tuple | list):
        return any(_too_wide(v) for v in value)
    return False


def as_text(value: Any) -> str:
    """Exact text for a table cell: ``1,099,511,627,776``; shapes as ``a x b``."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, tuple | list):
        return " x ".join(as_text(v) for v in value) or "scalar"
    return str(value)


def arrow_safe(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with every column that holds an integer beyond int64 turned into exact text."""
    out = [dict(r) for r in rows]
    wide = {k for r in out for k, v in r.items() if _too_wide(v)}
    for r in out:
        for k in wide:
            if k in r:
                r[k] = as_text(r[k])
    return out
