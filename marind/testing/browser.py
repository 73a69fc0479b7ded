"""Debian's chromium, headless, driven by its own flags: the DOM after the page's script ran, a screenshot.

Its own flags (``--dump-dom``, ``--screenshot``) rather than Playwright: the system browser is
all the tests and ``bench/page_bench.py`` need (no driver to install from PyPI, nothing fetched
at test time), and ``--virtual-time-budget`` lets the page's polling script run before the DOM
is dumped. Without a budget the DOM is dumped at the page's load, in real time (what the bench
times).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from marind.testing.procs import kill_group, spawn

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = "no chromium on this machine: `make setup` installs Debian's chromium (as root)"


def _run(args: list[str], profile: Path, timeout: float) -> str:
    if CHROMIUM is None:
        raise RuntimeError(SKIP_REASON)
    profile.mkdir(parents=True, exist_ok=True)
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)       # the browser's helper processes too
    return out or ""


def dump_dom(url: str, profile: Path, budget_ms: int | None = 5000, timeout: float = 90) -> str:
    """The page's DOM once its scripts had ``budget_ms`` of (virtual) time; ``None``: at its load, in real time."""
    budget = [] if budget_ms is None else [f"--virtual-time-budget={budget_ms}"]
    return _run([*budget, "--dump-dom", url], profile, timeout)


def screenshot(url: str, path: Path, profile: Path, size: tuple[int, int] = (1000, 1500),
               timeout: float = 90) -> Path:
    """A PNG of the page at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _run([f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=3000", f"--screenshot={path}", url],
         profile, timeout)
    return path
