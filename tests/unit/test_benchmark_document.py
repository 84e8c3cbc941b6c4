"""A benchmark run rewrites docs/benchmarks.md without dropping what it did not measure."""

from __future__ import annotations

from pathlib import Path

from benchmarks.stats import keep_unmeasured

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_keeps_the_sections_and_parts_it_did_not_measure() -> None:
    old = (
        "# Benchmarks\n\nold intro\n\n## Summary\n\nold rows\n\n"
        "## 1. Overhead\n\nold overhead\n\n### Profile\n\nold profile\n\n"
        "## Pools\n\nmeasured by benchmarks.slots\n\n"
        "## 9. Wake-ups\n\nold wake-ups\n\n### In a real deployment\n\n<!-- block -->\nkept\n<!-- /block -->\n"
    )
    new = (
        "# Benchmarks\n\nnew intro\n\n## Summary\n\nnew rows\n\n"
        "## 1. Overhead\n\nnew overhead\n\n### Profile\n\nnew profile\n\n## 9. Wake-ups\n\nnew wake-ups\n"
    )

    merged = keep_unmeasured(old, new)

    assert "new intro" in merged and "old intro" not in merged
    assert "new rows" in merged and "old rows" not in merged
    assert "new profile" in merged and "old profile" not in merged  # measured again: replaced
    assert merged.count("## Pools") == 1 and "measured by benchmarks.slots" in merged  # not measured: kept
    wakeups = merged.split("## 9. Wake-ups", 1)[1]
    assert wakeups.index("new wake-ups") < wakeups.index("### In a real deployment") < wakeups.index("kept")
    assert "old wake-ups" not in merged


def test_the_real_document_loses_no_heading_to_a_run_of_one_section() -> None:
    document = (ROOT / "docs" / "benchmarks.md").read_text()
    headings = [line for line in document.splitlines() if line.startswith(("## ", "### "))]
    merged = keep_unmeasured(document, "# Benchmarks\n\n## Summary\n\nrows\n")
    assert [line for line in merged.splitlines() if line.startswith(("## ", "### "))] == headings


def test_a_capacity_stage_whose_backends_never_settled_says_so() -> None:
    """doctor's count met a closed session's backend still counted (a stage then reads "differ"): the
    row says the wait for it gave up, and with what count, instead of a bare mismatch."""
    from benchmarks.capacity import CapacityResult, Stage, render, stages_met

    result = CapacityResult(holders=10, processes=1, max_connections=20, reserved=3)
    result.stages = [Stage(10, 12, 12, 17, "OK", "OK"), Stage(10, 12, 13, 17, "OK", "OK", unsettled=12)]
    text = render(result)
    assert "13 (the server still counted 12 client sessions after 10 s, 11 expected before doctor's own)" in text
    assert not stages_met(result)
