"""The one line that refuses unknown keywords of the Python API (``fit``, ``Averager``).

Invariant: the line names each unknown keyword as the caller spelt it, the closest
accepted name when there is one (``difflib``'s match), and every name accepted, so
a typo is bad input (``InputError``, exit status 2) with its remedy, never a raw
``TypeError``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["unknown_keywords"]


def unknown_keywords(caller: str, unknown: Iterable[str], accepted: Iterable[str]) -> str:
    """The message for keywords ``caller`` does not take.

    Args:
        caller: the call as the user wrote it, e.g. ``"fit()"``, ``"Averager()"``.
        unknown: the keywords it does not take (any order; sorted in the line).
        accepted: every keyword it takes (sorted in the line).

    Returns:
        ``"<caller> got unknown option(s) windw (did you mean window?); the options it
        takes by name are a, b, ..."``.
    """
    names = sorted(set(accepted))
    words = []
    for u in sorted(set(unknown)):
        close = difflib.get_close_matches(u, names, n=1)
        words.append(u + (f" (did you mean {close[0]}?)" if close else ""))
    return f"{caller} got unknown option(s) {', '.join(words)}; the options it takes by name are {', '.join(names)}"
