"""The one escaping helper for text from a file that the dashboard shows.

A plan, a timeline or a profile may come from someone else, and Streamlit renders the body
of ``st.error``, ``st.info``, ``st.caption``, ``st.markdown`` and widget labels as Markdown:
a plan whose ``format`` field is ``![x](https://evil.example/t.png)`` made the browser fetch
that URL when the refusal was shown. Every value from a file goes through ``literal`` before
it reaches one of those calls:

* ``printable`` first (control characters, bidi overrides and lone surrogates written as
  ``\\x1b``, ``\\u202e``, ``\\ud800``: a name cannot hide or reorder what is shown);
* then the text becomes one Markdown code span, fenced by more backticks than any run of
  backticks inside it. Nothing inside a code span is markup: no link, image, emphasis, HTML,
  math, Streamlit colour or icon directive. Backslash escapes would not be enough: Streamlit's
  Markdown (remark-gfm) turns ``http://...`` and ``www.`` in the *decoded* text into links,
  escaped or not, while code spans are never linked.

Where the value is shown as plain text (``st.text``, ``st.code``, a dataframe cell, a
selectbox option), ``literal(value, markdown=False)`` applies the first step only.
"""

from __future__ import annotations

import re
from typing import Any

from mpipar.untrusted import printable

_BACKTICKS = re.compile(r"`+")


def literal(value: Any, *, markdown: bool = True) -> str:
    """``value`` as text that renders as itself (see the module docstring)."""
    text = printable(value)
    if not markdown:
        return text
    longest = max((len(m) for m in _BACKTICKS.findall(text)), default=0)
    fence = "`" * (longest + 1)
    # CommonMark strips one space from each side of a code span padded on both: the text stays exact.
    return f"{fence} {text} {fence}"
