"""benchmarks/slots.py runs end to end in its quick form (no timing asserted): every case,
one round trip per take."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_slots_benchmark_takes_each_slot_in_one_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.slots", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    text = out.read_text()
    assert "## Pools of slots: taking one slot" in text
    for case in ("| mutex (try_lock) | 0 |", "| pool of 8 | 7 |", "| pool of 64 | 32 |", "| pool of 64 | 63 |"):
        assert case in text
    assert "Round trips per take, in every case: 1." in text
