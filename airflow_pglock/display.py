"""Text that others control, made safe to show on one line of a log or a terminal."""

from __future__ import annotations

import unicodedata

# Controls (C0, C1, DEL: a terminal obeys escape sequences; a newline forges a log line), format
# characters (bidirectional marks, overrides and isolates show text reordered; zero-width spaces,
# joiners and the byte order mark make one name look like another), line and paragraph separators,
# and lone surrogates.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _shown(character: str) -> str:
    if unicodedata.category(character) not in _UNSAFE_CATEGORIES:
        return character
    return character.encode("unicode_escape", "backslashreplace").decode("ascii")


def printable(text: str) -> str:
    """``text`` with every control or invisible formatting character written as its Python escape
    (``\\x1b``, ``\\n``, ``\\u200b``): what a foreign session or a row of the lock database says is
    shown, never obeyed, and two names that differ only in what cannot be seen are told apart."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(_shown(character) for character in text)
