"""Medians with spread, side-by-side (interleaved) timing, and the markdown they render to."""

from __future__ import annotations

import gc
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    """Median and quartiles of ``n`` samples."""

    median: float
    p25: float
    p75: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(
            statistics.median(values) if values else float("nan"),
            percentile(values, 25),
            percentile(values, 75),
            len(values),
        )

    def fmt(self, scale: float = 1.0, unit: str = "", digits: int = 2) -> str:
        """``1.93 ms (p25 1.80, p75 2.10, n 300)``."""
        return (
            f"{self.median * scale:.{digits}f}{unit} (p25 {self.p25 * scale:.{digits}f}, "
            f"p75 {self.p75 * scale:.{digits}f}, n {self.n})"
        )


def interleaved(
    variants: Mapping[str, Callable[[], object]], rounds: int, *, warmup: int = 3
) -> dict[str, list[float]]:
    """Time each variant once per round, round-robin, the order rotated every round.

    On a shared, noisy machine a burst of load then hits every variant alike, instead of
    the one block that happened to run during it. Each call is timed alone
    (``perf_counter``) with the garbage collector paused around it.

    :param variants: name -> one operation (e.g. acquire + release) to time.
    :param rounds: samples per variant.
    :param warmup: untimed rounds first (imports, caches, first connections).
    """
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_no in range(warmup + rounds):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            operation = variants[name]
            gc.disable()
            started = time.perf_counter()
            operation()
            elapsed = time.perf_counter() - started
            gc.enable()
            if round_no >= warmup:
                samples[name].append(elapsed)
    return samples


def paired_ratios(samples: Mapping[str, list[float]], baseline: str) -> dict[str, Summary]:
    """Per-round ratio variant / baseline (same round, so the same load), summarised."""
    base = samples[baseline]
    return {
        name: Summary.of([value / reference for value, reference in zip(values, base, strict=True)])
        for name, values in samples.items()
    }


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def progress(message: str) -> None:
    """One line on stderr, so a long run shows where it is."""
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def write_section(path: Path, heading: str, text: str) -> None:
    """Replace the section ``heading`` in ``path`` (up to the next ``## `` heading) by ``text``, or append it."""
    document = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(heading) + r".*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(document):
        document = pattern.sub(lambda _: text + "\n", document)
    else:
        document = document.rstrip("\n") + "\n\n" + text
    path.write_text(document)


def _split(text: str, level: str) -> tuple[str, list[tuple[str, str]]]:
    """``text`` as (what precedes the first heading, [(heading line, the whole part)]) at ``level`` (``## ``)."""
    parts = re.split(rf"(?m)^(?={re.escape(level)})", text)
    head, rest = parts[0], parts[1:]
    return head, [(part.split("\n", 1)[0].strip(), part) for part in rest]


def keep_unmeasured(old: str, new: str) -> str:
    """``new`` plus what ``old`` has that this run did not measure, so that a run never drops a section.

    A ``## `` section of ``old`` missing from ``new`` is appended in its old order; a ``### ``
    part of a section both have (e.g. the real-deployment measurements of ``benchmarks/triggerer.py``
    under section 9) is appended to the end of the new section.
    """
    new_head, new_sections = _split(new, "## ")
    _, old_sections = _split(old, "## ")
    old_by_heading = dict(old_sections)
    merged = []
    for heading, part in new_sections:
        if heading in old_by_heading:
            _, new_subs = _split(part, "### ")
            _, old_subs = _split(old_by_heading[heading], "### ")
            present = {sub_heading for sub_heading, _ in new_subs}
            extra = [sub for sub_heading, sub in old_subs if sub_heading not in present]
            if extra:
                part = part.rstrip("\n") + "\n\n" + "".join(extra)
        merged.append(part)
    present_headings = {heading for heading, _ in new_sections}
    merged += [part for heading, part in old_sections if heading not in present_headings]
    return new_head + "".join(part if part.endswith("\n") else part + "\n" for part in merged)
