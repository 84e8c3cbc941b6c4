"""Text that others control is shown escaped (airflow_pglock.display)."""

from __future__ import annotations

import io

import pytest

from airflow_pglock.cli.common import LONGEST_CELL, table
from airflow_pglock.display import printable


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain ascii: dag/task #3", "plain ascii: dag/task #3"),
        ("kéy ü 東京", "kéy ü 東京"),
        ("a\x1b[2Kb", r"a\x1b[2Kb"),
        ("one\ntwo\rthree\tfour", r"one\ntwo\rthree\tfour"),
        ("nul\x00 del\x7f c1\x9b", r"nul\x00 del\x7f c1\x9b"),
        ("line\u2028sep", r"line\u2028sep"),
        ("abc\u202edcba\u2066x\u2069", r"abc\u202edcba\u2066x\u2069"),
        ("zero\u200bwidth\u200c\u200d\ufeff", r"zero\u200bwidth\u200c\u200d\ufeff"),
        ("marks\u200e\u200f\u061c", r"marks\u200e\u200f\u061c"),
        ("soft\u00adhyphen", r"soft\xadhyphen"),
        ("lone\ud800surrogate", r"lone\ud800surrogate"),
    ],
)
def test_printable_escapes_control_characters_and_keeps_the_rest(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_a_table_escapes_and_cuts_its_cells() -> None:
    out = io.StringIO()
    table(["KEY", "HOLDER"], [["a\x1b[2Kb", "x" * 500], ["short", "y"]], out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[1].startswith(r"a\x1b[2Kb")
    assert "x" * (LONGEST_CELL - 1) + "~" in lines[1] and "x" * LONGEST_CELL not in lines[1]
    assert len(lines[2]) < LONGEST_CELL + 20
