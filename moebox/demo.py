"""The built-in demo model: what moebox runs when no model path is given.

Until a trained small model ships with the package, the demo is the synthetic `tiny` checkpoint (random
weights: it runs every code path but writes gibberish), written once to a cache directory. It is written to
a temporary sibling and renamed into place, so an interrupted first run never leaves a half-written model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from moebox.errors import MoeboxError

log = logging.getLogger("moebox")
DEMO_PRESET, DEMO_SEED = "tiny", 0


def cache_root() -> Path:
    return Path(os.environ.get("MOEBOX_CACHE", Path.home() / ".cache" / "moebox"))


def demo_model_dir() -> Path:
    from moebox.weights.synth import write_synthetic

    target = cache_root() / f"demo-{DEMO_PRESET}-seed{DEMO_SEED}"
    if (target / "config.json").exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    except OSError as e:
        raise MoeboxError(f"cannot create the demo model cache in {target.parent} ({e.strerror}); "
                          f"set MOEBOX_CACHE to a writable directory") from None
    try:
        log.info("writing the built-in demo model (synthetic %s) to %s", DEMO_PRESET, target)
        write_synthetic(tmp, DEMO_PRESET, seed=DEMO_SEED, progress=False)
        os.replace(tmp, target)
    except OSError as e:
        if (target / "config.json").exists():      # another process won the race
            return target
        raise MoeboxError(f"cannot write the demo model to {target} ({e.strerror}); remove that directory or set "
                          f"MOEBOX_CACHE to a writable directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
