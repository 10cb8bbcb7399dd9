"""Run commands inside a private mount namespace (`unshare -m`), where a test may mount a read-only bind or a
tiny tmpfs without anything outside its own process tree ever seeing the mount."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _unshare_ok() -> str | None:
    """None when `unshare -m` with a bind mount works here, else why not."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>&1 || "
                            "mount -t tmpfs -o size=64k tmpfs /tmp 2>&1"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -m failed: {e}"
    if r.returncode != 0:
        return f"unshare -m / mount not permitted here: {(r.stderr or r.stdout).strip()[:200]}"
    return None


UNSHARE_SKIP = _unshare_ok()
needs_unshare = pytest.mark.skipif(UNSHARE_SKIP is not None, reason=UNSHARE_SKIP or "")


def in_namespace(mounts: str, python: str) -> subprocess.CompletedProcess:
    """Run shell `mounts`, then `python`, inside a new private mount namespace."""
    script = f"set -e\n{mounts}\nexec {shlex.quote(sys.executable)} -c {shlex.quote(textwrap.dedent(python))}"
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


