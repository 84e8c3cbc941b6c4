"""Headless Chromium for the UI test (not part of the provider).

Uses Debian's ``chromium`` and ``chromium-driver`` packages, installed with apt-get when
missing and running as root (as devtools.pgbouncer does for PgBouncer): no browser build
is downloaded from anywhere else.
"""

from __future__ import annotations

import os
import shutil
import subprocess

DEBIAN_PACKAGES = ("chromium", "chromium-driver")


class BrowserUnavailableError(RuntimeError):
    """Chromium or its driver is not installed and cannot be installed here."""


def _found() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def find_chromium(install: bool = True) -> tuple[str, str]:
    """Paths of ``chromium`` and ``chromedriver``; installs the Debian packages when missing (as root)."""
    found = _found()
    if found:
        return found
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BrowserUnavailableError("chromium is not installed (Debian: apt-get install -y chromium chromium-driver)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    found = _found()
    if result.returncode != 0 or not found:
        raise BrowserUnavailableError(f"apt-get install {' '.join(DEBIAN_PACKAGES)} failed: {result.stderr[-500:]}")
    return found


def headless_flags(user_data_dir: str, window: str = "1400,700") -> list[str]:
    """Flags for a quiet, sandbox-less headless Chromium with a fresh profile."""
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--window-size={window}",
        f"--user-data-dir={user_data_dir}",
    ]
