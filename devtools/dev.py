#!/usr/bin/env python3
"""Set up and run airflow-pglock's commands with nothing but Python 3.11+.

    python3 devtools/dev.py demo    # two "deployments" run a guarded DAG at once
    python3 devtools/dev.py test    # the whole test suite (extra args go to pytest)
    python3 devtools/dev.py matrix  # the entry-point suite (pytest -m matrix) on one Airflow line / Python
    python3 devtools/dev.py lint    # ruff check, ruff format --check, mypy, the import layers (lint-imports)
    python3 devtools/dev.py bench   # benchmarks -> docs/benchmarks.md (about 21 minutes on 2 cores; needs redis-server)
    python3 devtools/dev.py constraints   # re-resolve constraints/airflow-<line>[-py<X.Y>].txt in a fresh venv
    python3 devtools/dev.py versions-doc  # matrix-results/*.json -> the table in docs/airflow-versions.md
    python3 devtools/dev.py architecture-doc  # pyproject's import layers + the code -> docs/architecture.md's tables
    python3 devtools/dev.py campaign [--minutes M] [--seed S] [--out DIR]   # the randomized fault campaign
    python3 devtools/dev.py blue-green    # two deployments on different lines / Pythons share one lock database
    python3 devtools/dev.py venv          # only build (or reuse) the venv of PGLOCK_AIRFLOW / PGLOCK_PYTHON

Which Airflow and which Python (any command):

    PGLOCK_AIRFLOW=2.11|3.0|3.1|3.2|3.3|3.4   the Airflow line (default 3.3; 3.4 is its pre-release)
    PGLOCK_PYTHON=3.10|3.11|3.12|3.13     the interpreter (default: the python3 running this script),
                                          found as pythonX.Y under $PYENV_ROOT/versions or on PATH

The default (3.3, this python3) lives in .venv, every other combination in its own
.venv-<line>[-py<X.Y>], installed (editable, by uv; by pip where uv cannot) with the pinned
versions of constraints/airflow-<line>-py<X.Y>.txt if that file exists, else constraints/airflow-<line>.txt.
A venv is reinstalled when pyproject.toml or its constraints change. With
PGLOCK_MATRIX_RESULTS=matrix-results (as .ci/run sets it), a whole `test` run and a `matrix`
run record which feature passed there (read by versions-doc); without it nothing in the
checkout is written.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LINE = "3.3"
#: The Airflow release each line is tested on (the newest patch; `pip index versions apache-airflow`).
RELEASES = {"2.11": "2.11.2", "3.0": "3.0.6", "3.1": "3.1.8", "3.2": "3.2.2", "3.3": "3.3.2", "3.4": "3.4.0b2"}
#: Pins the resolver needs help with when `constraints` re-resolves a line, and why.
RESOLVER_PINS: dict[str, tuple[str, ...]] = {
    # Airflow 3.0.6 resolved alone takes fastapi 0.165 / cadwyn 9 / pydantic 2.14, and every
    # task fails in the execution API ("Remote server returned validation error": the body
    # "should be a valid dictionary"). The FastAPI stack of its time runs it.
    "3.0": ("fastapi[standard]==0.116.1", "cadwyn==5.4.4", "pydantic==2.11.7", "svcs==25.1.0"),
    # Airflow 3.2.2 resolved alone takes fastapi 0.165 (every task fails: "PydanticUserError:
    # Model 'TITerminalStatePayload' needs a discriminator field", with any pydantic 2.11 - 2.14)
    # and svcs 26 (its lifespan never sets app.state.svcs_registry: "KeyError: 'svcs_registry'").
    "3.2": ("fastapi==0.150.0", "svcs==25.1.0"),
}
#: The Pythons the package admits (pyproject's requires-python and classifiers).
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
AIRFLOW_LINE = os.environ.get("PGLOCK_AIRFLOW", DEFAULT_LINE)
PYTHON_VERSION = os.environ.get("PGLOCK_PYTHON") or f"{sys.version_info.major}.{sys.version_info.minor}"
OWN_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}" == PYTHON_VERSION
_SUFFIX = ("" if AIRFLOW_LINE == DEFAULT_LINE else f"-{AIRFLOW_LINE}") + ("" if OWN_PYTHON else f"-py{PYTHON_VERSION}")
VENV = Path(os.environ.get("PGLOCK_VENV", ROOT / f".venv{_SUFFIX}"))
LINE_CONSTRAINTS = ROOT / "constraints" / f"airflow-{AIRFLOW_LINE}.txt"
PYTHON_CONSTRAINTS = ROOT / "constraints" / f"airflow-{AIRFLOW_LINE}-py{PYTHON_VERSION}.txt"
CONSTRAINTS = PYTHON_CONSTRAINTS if PYTHON_CONSTRAINTS.exists() else LINE_CONSTRAINTS
RESULTS = ROOT / "matrix-results"
VERSIONS_DOC = ROOT / "docs" / "airflow-versions.md"
#: The import layers are a property of the code, not of the Airflow line: import-linter (the
#: `lint` extra) goes into the default environment only (2.11's rich pin and Python 3.10 refuse it).
EXTRAS = "test,docs,lint,newer-postgres" if AIRFLOW_LINE == DEFAULT_LINE and OWN_PYTHON else "test,docs"
# The benchmark's extra packages (pyproject's `bench` extra), pinned for reproducible numbers.
BENCH_PINS = ("PALs==0.4.0", "python-redis-lock==4.0.1", "redis==6.4.0", "pyinstrument==5.1.3")
#: The campaign's timeline picture (docs/safety.md): matplotlib, a dev-only dependency.
CAMPAIGN_PINS = ("matplotlib==3.10.8",)
#: The installer: uv puts a pinned Airflow environment in place in ~5 s where pip takes ~45 s
#: (measured here, each into a fresh venv). pip stays the fallback: uv does not read pip's
#: configuration, so an index or find-links set only there reaches pip alone.
UV_PIN = "uv==0.13.9"
#: Compile the installed modules to bytecode, as pip does and uv does not by default. Python
#: then never compiles them at import, which matters where PYTHONDONTWRITEBYTECODE is set
#: (as on these machines): every Airflow process would compile Airflow again (measured: 3.0 s
#: to import the scheduler's modules instead of 1.3 s; a fresh venv with it: 11.6 s, lint included).
UV_OPTIONS = ("--compile-bytecode",)
#: The slowest tests at the end of every run: where CI's time goes.
DURATIONS = ("--durations=25",)
#: A whole `test` run is these two parts at once, each its own pytest process with its own
#: throwaway PostgreSQL cluster (or database, with PGLOCK_TEST_DSN), Airflow home and ports: the
#: first mostly waits on the Airflow processes it starts, the second on PostgreSQL. A part lists
#: directories of tests/ and single files; a file listed in one part is left out of its
#: directory in the others, and every test file runs in exactly one part (checked before the
#: run). tests/celery and the lock-scope deployments are in the second to even them out: in a
#: dry run of .ci/run with them in the first, the first took 1,040 s and the second 768 s (the
#: scope deployments alone: 134 s); with them in the second (and a few new tests there), 985 s
#: and 1,066 s: the whole suite took as long, within these machines' noise.
SUITE_PARTS: tuple[tuple[str, ...], ...] = (
    ("tests/airflow", "tests/e2e"),
    (
        "tests/celery",
        "tests/e2e/test_scope_deployments.py",
        "tests/faults",
        "tests/integration",
        "tests/packaging",
        "tests/unit",
    ),
)
#: The blue/green pairs (tests/e2e/test_blue_green.py): (old line, old Python), (new line, new
#: Python); None = the Python running this script. Upgrades of the Airflow line, then of Python.
BLUE_GREEN_PAIRS: tuple[tuple[tuple[str, str | None], tuple[str, str | None]], ...] = (
    (("2.11", None), ("3.3", None)),
    (("3.3", None), ("3.4", None)),
    (("3.3", "3.10"), ("3.3", "3.13")),
)


#: How long a command interrupted by Ctrl-C gets to clean up (its clusters, its Airflow processes)
#: before it is terminated.
CLEAN_UP_SECONDS = 120


def _call(args: list[str], **popen: object) -> int:
    """Run a command and wait for it; on Ctrl-C (which reaches it as well, as the terminal's
    whole process group) keep waiting while it cleans up (``subprocess.call`` would kill it
    within a quarter of a second, leaving its PostgreSQL running)."""
    with subprocess.Popen(args, **popen) as child:  # type: ignore[call-overload]
        try:
            return int(child.wait())
        except KeyboardInterrupt:
            print(f"[dev] interrupted: waiting up to {CLEAN_UP_SECONDS} s while it cleans up", flush=True)
            try:
                child.wait(timeout=CLEAN_UP_SECONDS)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                child.terminate()
                child.wait()
            raise


def find_interpreter() -> Path:
    """The interpreter for PGLOCK_PYTHON: this one, a pyenv version, or pythonX.Y on PATH."""
    if PYTHON_VERSION not in PYTHONS:
        if os.environ.get("PGLOCK_PYTHON"):
            sys.exit(f"PGLOCK_PYTHON={PYTHON_VERSION}: airflow-pglock supports Python {', '.join(PYTHONS)}")
        sys.exit(
            f"devtools/dev.py runs on Python {PYTHON_VERSION}, and the development venv is made with the Python "
            f"that runs it: airflow-pglock supports Python {', '.join(PYTHONS)}. Run it with one of those (for "
            f"instance python3.12 devtools/dev.py ...), or name one installed with PGLOCK_PYTHON=3.12"
        )
    if OWN_PYTHON:
        return Path(sys.executable)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    pattern = pyenv_root / "versions" / f"{PYTHON_VERSION}.*" / "bin" / f"python{PYTHON_VERSION}"
    candidates = sorted(glob.glob(str(pattern)))
    on_path = shutil.which(f"python{PYTHON_VERSION}")
    for candidate in [*reversed(candidates), *([on_path] if on_path else [])]:
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
        )
        if probe.returncode == 0 and probe.stdout.strip() == PYTHON_VERSION:
            return Path(candidate)
    sys.exit(
        f"PGLOCK_PYTHON={PYTHON_VERSION}: no working python{PYTHON_VERSION} found (looked in "
        f"{pyenv_root}/versions/{PYTHON_VERSION}.*/bin and on PATH); install it (e.g. `pyenv install {PYTHON_VERSION}`)"
    )


def _python() -> Path:
    return VENV / "bin" / "python"


def _stamp(interpreter: Path) -> str:
    digest = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", CONSTRAINTS):
        digest.update(path.read_bytes())
    digest.update(str(interpreter).encode())
    return digest.hexdigest()


def _create_venv(interpreter: Path, where: Path) -> Path:
    print(f"[dev] creating {where} (Python {PYTHON_VERSION})", flush=True)
    subprocess.run([str(interpreter), "-m", "venv", str(where)], check=True)
    python = where / "bin" / "python"
    subprocess.run([*_pip_install(python), "--upgrade", "pip"], check=True)
    return python


def _pip_install(python: Path) -> list[str]:
    return [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]


def _install(python: Path, *requirements: str) -> None:
    """`pip install` the requirements into python's venv: with uv where it installs and works, else pip."""
    pip = _pip_install(python)
    uv = python.parent / "uv"
    if not uv.exists():
        subprocess.run([*pip, UV_PIN], cwd=ROOT)
    if uv.exists():
        installed = subprocess.run(
            [str(uv), "pip", "install", "-q", *UV_OPTIONS, "--python", str(python), *requirements], cwd=ROOT
        )
        if installed.returncode == 0:
            return
        print("[dev] uv could not install them; installing with pip instead", flush=True)
    subprocess.run([*pip, *requirements], check=True, cwd=ROOT)


def ensure_environment() -> Path:
    if sys.version_info < (3, 11):
        sys.exit(f"devtools/dev.py needs Python 3.11 or newer to run; this is {sys.version.split()[0]}")
    if AIRFLOW_LINE not in RELEASES:
        sys.exit(f"PGLOCK_AIRFLOW={AIRFLOW_LINE!r}: expected one of {', '.join(RELEASES)}")
    if not CONSTRAINTS.exists():
        sys.exit(
            f"no constraints file for Airflow {AIRFLOW_LINE}: {CONSTRAINTS.relative_to(ROOT)} "
            f"(make it with `PGLOCK_AIRFLOW={AIRFLOW_LINE} python3 devtools/dev.py constraints`)"
        )
    interpreter = find_interpreter()
    stamp_file = VENV / ".pglock-installed"
    # .ci/run's streams (and blue-green, which reuses their venvs) may ask for one venv at once:
    # the second waits for the first to finish it, then finds it stamped.
    with open(VENV.parent / f"{VENV.name}.lock", "w") as building:
        fcntl.flock(building, fcntl.LOCK_EX)
        if stamp_file.exists() and stamp_file.read_text() == _stamp(interpreter) and _python().exists():
            return _python()
        if not _python().exists():
            _create_venv(interpreter, VENV)
        print(
            f"[dev] installing airflow-provider-pglock[{EXTRAS}] with {CONSTRAINTS.name} (first run only)", flush=True
        )
        _install(_python(), "-c", str(CONSTRAINTS), "-e", f"{ROOT}[{EXTRAS}]")
        stamp_file.write_text(_stamp(interpreter))
        return _python()


def regenerate_constraints() -> int:
    """Resolve the line's newest Airflow + the provider's extras in a fresh venv and freeze it."""
    if AIRFLOW_LINE not in RELEASES:
        sys.exit(f"PGLOCK_AIRFLOW={AIRFLOW_LINE!r}: expected one of {', '.join(RELEASES)}")
    interpreter = find_interpreter()
    with tempfile.TemporaryDirectory(prefix="pglock-constraints-") as scratch:
        python = _create_venv(interpreter, Path(scratch) / "venv")
        pins = (f"apache-airflow=={RELEASES[AIRFLOW_LINE]}", *RESOLVER_PINS.get(AIRFLOW_LINE, ()))
        print(f"[dev] resolving {', '.join(pins)} + airflow-provider-pglock[{EXTRAS}] (unconstrained)", flush=True)
        subprocess.run([*_pip_install(python), *pins, "-e", f"{ROOT}[{EXTRAS}]"], check=True, cwd=ROOT)
        frozen = subprocess.run(
            [str(python), "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
        ).stdout
    lines = sorted(
        (line for line in frozen.splitlines() if line and not line.lower().startswith("airflow-provider-pglock")),
        key=str.lower,
    )
    text = "\n".join(lines) + "\n"
    target = LINE_CONSTRAINTS if OWN_PYTHON else PYTHON_CONSTRAINTS
    if target == PYTHON_CONSTRAINTS and LINE_CONSTRAINTS.exists() and LINE_CONSTRAINTS.read_text() == text:
        print(f"[dev] Python {PYTHON_VERSION} resolves the same pins as {LINE_CONSTRAINTS.name}: no separate file")
        PYTHON_CONSTRAINTS.unlink(missing_ok=True)
        return 0
    target.write_text(text)
    print(f"[dev] wrote {target.relative_to(ROOT)} ({len(lines)} pins); run the tests on it before committing")
    return 0


def _cell(features: dict[str, dict[str, str]], feature: str) -> str:
    result = features.get(feature)
    if result is None:
        return "not run"
    outcome = result["outcome"]
    return {"passed": "✅ works", "absent": f"— {result.get('detail', 'absent')}", "failed": "❌ fails"}.get(
        outcome, f"skipped ({result.get('detail', '')})"
    )


def render_versions_doc() -> int:
    """The feature x (Airflow, Python) table in docs/airflow-versions.md, from matrix-results/*.json."""
    runs = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))]
    if not runs:
        sys.exit(f"no results in {RESULTS.relative_to(ROOT)}/: run `python3 devtools/dev.py matrix` (or test) first")

    def numbers(version: str) -> list[int]:  # "3.4.0b2" -> [3, 4, 0, 2]: a pre-release sorts by its parts
        return [int(part) for part in re.findall(r"\d+", version)]

    runs.sort(key=lambda run: (numbers(run["airflow"]), numbers(run["python"])))
    labels: dict[str, str] = {}
    for run in sorted(runs, key=lambda run: run["recorded"]):  # the newest run's wording wins
        labels.update({feature: result["label"] for feature, result in run["features"].items()})

    def row(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    header = ["feature", *(f"Airflow {run['airflow']}<br>Python {run['python']}" for run in runs)]
    rows = [
        row(header),
        "|" + "---|" * len(header),
        *(row([label, *(_cell(run["features"], feature) for run in runs)]) for feature, label in labels.items()),
        row(["suite", *(f"{run['suite']}: {run['passed']} passed, {run['failed']} failed" for run in runs)]),
        row(["recorded", *(f"{run['recorded']} ({run['duration_s']} s)" for run in runs)]),
    ]
    start, end = "<!-- matrix:start -->", "<!-- matrix:end -->"
    doc = VERSIONS_DOC.read_text()
    if start not in doc or end not in doc:
        sys.exit(f"{VERSIONS_DOC.relative_to(ROOT)} has no {start} ... {end} markers")
    head, rest = doc.split(start, 1)
    tail = rest.split(end, 1)[1]
    note = "<!-- generated by `python3 devtools/dev.py versions-doc` from matrix-results/: do not edit -->"
    generated = "\n".join(["", note, *rows, ""])
    VERSIONS_DOC.write_text(f"{head}{start}{generated}{end}{tail}")
    print(f"[dev] {VERSIONS_DOC.relative_to(ROOT)}: {len(labels)} features x {len(runs)} runs")
    return 0


def _venv_of(line: str, python: str | None) -> str:
    """The interpreter of the venv of ``line`` on ``python`` (built or reused by ``dev.py venv``)."""
    env = {**os.environ, "PGLOCK_AIRFLOW": line}
    env.pop("PGLOCK_VENV", None)
    env.pop("PGLOCK_PYTHON", None)
    if python is not None:
        env["PGLOCK_PYTHON"] = python
    built = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "venv"], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    *progress, path = built.stdout.strip().splitlines() or [""]
    if progress:  # what `venv` printed while it built: the path comes last
        print("\n".join(progress), flush=True)
    if built.returncode != 0:
        sys.exit(f"[dev] could not build the venv of Airflow {line} on Python {python or PYTHON_VERSION}")
    return path


def run_blue_green(harness: str, rest: list[str]) -> int:
    """Each pair of BLUE_GREEN_PAIRS in turn: both venvs, then tests/e2e/test_blue_green.py with their paths."""
    failed = []
    for old, new in BLUE_GREEN_PAIRS:
        label = " -> ".join(f"Airflow {line} on Python {python or PYTHON_VERSION}" for line, python in (old, new))
        env = {**os.environ, "PGLOCK_BG_OLD_PYTHON": _venv_of(*old), "PGLOCK_BG_NEW_PYTHON": _venv_of(*new)}
        print(f"[dev] blue/green {label}", flush=True)
        started = time.monotonic()
        test = [harness, "-m", "pytest", "-m", "", "-p", "no:cacheprovider", "tests/e2e/test_blue_green.py", *rest]
        code = _call(test, cwd=ROOT, env=env)
        outcome = "passed" if code == 0 else f"FAILED (exit {code})"
        print(f"[dev] blue/green {label}: {outcome} in {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(label)
    for label in failed:
        print(f"[dev] blue/green failed: {label}", flush=True)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    commands = {
        "demo",
        "test",
        "matrix",
        "lint",
        "bench",
        "constraints",
        "versions-doc",
        "architecture-doc",
        "campaign",
        "blue-green",
        "venv",
    }
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "constraints":
        return regenerate_constraints()
    if command == "versions-doc":
        return render_versions_doc()
    python = str(ensure_environment())
    if command == "venv":
        print(python)
        return 0
    if command == "blue-green":
        return run_blue_green(python, rest)
    if command == "campaign":
        if (
            "--no-plot" not in rest
            and subprocess.run([python, "-c", "import matplotlib"], capture_output=True).returncode
        ):
            print(f"[dev] installing the campaign's picture package: {', '.join(CAMPAIGN_PINS)}", flush=True)
            _install(Path(python), "-c", str(CONSTRAINTS), *CAMPAIGN_PINS)
        return _call([python, "-m", "devtools.campaign.run", *rest], cwd=ROOT)
    if command == "architecture-doc":  # grimp (import-linter's) reads the imports: the venv's Python
        return _call([python, str(ROOT / "devtools" / "architecture.py")], cwd=ROOT)
    env = dict(os.environ)
    if command == "demo":
        return _call([python, str(ROOT / "devtools" / "demo.py"), *rest], cwd=ROOT, env=env)
    if command == "bench":
        installed = subprocess.run([python, "-c", "import pals, redis_lock, redis, pyinstrument"], capture_output=True)
        if installed.returncode != 0:
            print(f"[dev] installing the benchmark's packages: {', '.join(BENCH_PINS)}", flush=True)
            _install(Path(python), "-c", str(CONSTRAINTS), *BENCH_PINS)
        env["PGLOCK_BENCH_COMMAND"] = " ".join(["python3 devtools/dev.py bench", *rest])
        return _call([python, "-m", "benchmarks.run", *rest], cwd=ROOT, env=env)
    if command == "lint":
        linted = ["airflow_pglock", "tests", "devtools", "dags", "benchmarks"]
        ruff = _call([python, "-m", "ruff", "check", *linted], cwd=ROOT)
        layout = _call([python, "-m", "ruff", "format", "--check", *linted], cwd=ROOT)
        mypy = _call([python, "-m", "mypy"], cwd=ROOT)
        layers = _call([str(Path(python).parent / "lint-imports")], cwd=ROOT)  # [tool.importlinter]
        return ruff or layout or mypy or layers
    if command == "matrix":
        return _call(
            [python, "-m", "pytest", "-m", "matrix", *DURATIONS, *rest], cwd=ROOT, env=pytest_env(command, rest)
        )
    # -m "": the whole suite, the slow tests too (a bare `pytest` leaves them out; a -m in rest wins)
    if not rest:
        return run_suite_in_parts(python)
    return _call([python, "-m", "pytest", "-m", "", *DURATIONS, *rest], cwd=ROOT, env=pytest_env(command, rest))


def suite_part_arguments(part: tuple[str, ...]) -> list[str]:
    """pytest's arguments for one of SUITE_PARTS: its entries, and an ``--ignore`` for each file
    another part lists from one of its directories."""
    elsewhere = {entry for other in SUITE_PARTS if other != part for entry in other if entry.endswith(".py")}
    return [*part, *(f"--ignore={path}" for path in sorted(elsewhere) if str(Path(path).parent) in part)]


def suite_parts_problem() -> str | None:
    """Why SUITE_PARTS would not run every test file exactly once (None when it would)."""
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("*/test_*.py"))
    directories = {str(Path(file).parent) for file in files}
    unknown = sorted(entry for part in SUITE_PARTS for entry in part if entry not in directories and entry not in files)
    runs = dict.fromkeys(files, 0)
    for part in SUITE_PARTS:
        ignored = set(suite_part_arguments(part))
        for file in files:
            if file in part or (str(Path(file).parent) in part and f"--ignore={file}" not in ignored):
                runs[file] += 1
    missing = [file for file, count in runs.items() if count == 0]
    twice = [file for file, count in runs.items() if count > 1]
    if unknown or missing or twice:
        return (
            f"SUITE_PARTS names what is not a test directory or file {unknown}, leaves out {missing}"
            f" and runs twice {twice}"
        )
    return None


def run_suite_in_parts(python: str) -> int:
    """The whole suite as SUITE_PARTS, at once; part 1's output live, the others' when they end."""
    problem = suite_parts_problem()
    if problem is not None:
        sys.exit(f"[dev] {problem}: every test file runs in exactly one part")
    started = time.monotonic()
    print(f"[dev] the whole suite in {len(SUITE_PARTS)} parts at once:", flush=True)
    for number, part in enumerate(SUITE_PARTS, 1):
        shown = "shown live" if number == 1 else "printed when it ends"
        print(f"[dev]   part {number}: {' '.join(part)} ({shown})", flush=True)
    processes = []
    with tempfile.TemporaryDirectory(prefix="pglock-suite-") as logs:
        for number, part in enumerate(SUITE_PARTS, 1):
            env = pytest_env("test", [])
            env["PGLOCK_SUITE_PART"] = f"{number}/{len(SUITE_PARTS)}"
            env["PGLOCK_SUITE_STARTED"] = str(time.time())
            env["PGLOCK_TEST_DATABASE"] = f"pglock_tests_{number}"  # apart on a shared PGLOCK_TEST_DSN server
            argv = [python, "-m", "pytest", "-m", "", *DURATIONS, *suite_part_arguments(part)]
            output = None if number == 1 else open(Path(logs) / f"part{number}.log", "w")  # noqa: SIM115
            processes.append((number, subprocess.Popen(argv, cwd=ROOT, env=env, stdout=output, stderr=output), output))
        codes = {}
        for number, process, output in processes:
            codes[number] = process.wait()
            if output is not None:
                output.close()
                print(f"\n[dev] part {number} ({' '.join(SUITE_PARTS[number - 1])}):", flush=True)
                print((Path(logs) / f"part{number}.log").read_text(), flush=True)
    for number, code in codes.items():
        print(f"[dev] part {number}: {'passed' if code == 0 else f'FAILED (exit {code})'}", flush=True)
    print(f"[dev] the whole suite took {time.monotonic() - started:.0f} s", flush=True)
    return 0 if all(code == 0 for code in codes.values()) else 1


def pytest_env(command: str, rest: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of `test` / `matrix`'s pytest: it records results only when asked.

    Recording writes matrix-results/*.json, tracked files: a plain `dev.py test` must leave the
    checkout as it was. It records when PGLOCK_MATRIX_RESULTS names a directory (`.ci/run` sets
    it to matrix-results/), for a `matrix` run and a whole `test` run; a `test <args>` run is
    partial and never records, whatever the environment says.
    """
    env = dict(os.environ if environ is None else environ)
    partial = command == "test" and bool(rest)
    if partial or not env.get("PGLOCK_MATRIX_RESULTS"):
        env.pop("PGLOCK_MATRIX_RESULTS", None)
        env.pop("PGLOCK_MATRIX_SUITE", None)
        return env
    env["PGLOCK_MATRIX_SUITE"] = "matrix" if command == "matrix" else "full suite"
    if command == "test" and env.get("PGLOCK_LINE_INDEPENDENT_ONCE") == "1":
        env["PGLOCK_MATRIX_SUITE"] = "full suite (the fault tests that touch no Airflow: on the default line)"
    return env


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # the command it ran has cleaned up (_call) and said so
        sys.exit(130)
