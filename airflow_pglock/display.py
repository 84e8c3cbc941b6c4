"""Text that others control, made safe to show on one line of a log or a terminal."""

from __future__ import annotations

import re

# C0 and C1 controls and DEL (a terminal obeys escape sequences; a newline forges a log line), the
# line and paragraph separators, and the bidirectional overrides and isolates (text shown reordered).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character written as its Python escape (``\\x1b``, ``\\n``):
    what a foreign session or a row of the lock database says is shown, never obeyed."""
    return _UNSAFE.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)
