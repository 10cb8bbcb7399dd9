"""The built-in demo model: what moebox runs when no model path is given.

It is the small DeepSeek-V4 trained by `moebox train` (issue G; command and numbers in docs/benchmarks.md),
shipped inside the package in the official checkpoint layout (FP8 dense, FP4 experts, an MTP head), so the
demo exercises the same load, pack and kernel paths as V4-Flash. The package directory is only read: w2 plane
stores go under the cache (`cache_root`), so a read-only install serves.
"""

from __future__ import annotations

import os
from pathlib import Path

from moebox.errors import MoeboxError

DEMO_MODEL = Path(__file__).parent / "demo_model"


def cache_root() -> Path:
    return Path(os.environ.get("MOEBOX_CACHE", Path.home() / ".cache" / "moebox"))


def demo_model_dir() -> Path:
    if not (DEMO_MODEL / "config.json").exists():
        raise MoeboxError(f"the built-in demo model is missing from {DEMO_MODEL} (a broken install?); reinstall "
                          f"moebox or pass a model directory")
    return DEMO_MODEL
