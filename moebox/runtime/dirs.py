"""Directory checks that run before any work, so a bad path fails in a second with one line, not after a
14-minute pack with an `OSError` traceback (field_notes.md §2 item 3, §4).

- `check_model_dir(path)`: exists, is a directory, can be listed, has a readable config.json. Read-only is fine
  and normal (a shared model mount): nothing is written there.
- `check_store_dir(path, model_dir, needed_bytes)`: not the model directory nor inside it (resolved paths);
  created if missing and really writable: a probe file is created and removed, because permission bits do not
  stop root and only a read-only mount (or a full disk) does; free space >= `needed_bytes`.
Every failure is a `MoeboxError` naming the path, what is wrong and the fix; no `OSError` escapes.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from moebox.errors import MoeboxError

GiB = 2 ** 30


def _why(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "is on a read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "is not writable (permission denied)"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "is on a full disk (no space left)"
    if e.errno == errno.ENOTDIR:
        return "has a path component that is not a directory"
    return f"cannot be written ({e.strerror or e})"


def check_model_dir(path: str | os.PathLike[str], flag: str = "model directory") -> Path:
    """The resolved model directory; a MoeboxError when it cannot be read."""
    p = Path(path).expanduser()
    fix = "pass the directory that holds config.json and the *.safetensors files"
    try:
        if not p.exists():
            raise MoeboxError(f"{flag} {p} does not exist; {fix}")
        if not p.is_dir():
            raise MoeboxError(f"{flag} {p} is not a directory; {fix}")
        try:
            os.listdir(p)
        except OSError as e:
            raise MoeboxError(f"{flag} {p} cannot be listed ({e.strerror}); make it readable by this user "
                              f"(read-only is fine)") from None
        cfg = p / "config.json"
        if not cfg.is_file():
            raise MoeboxError(f"{flag} {p} has no config.json; {fix}")
        try:
            with open(cfg, "rb") as f:
                f.read(1)
        except OSError as e:
            raise MoeboxError(f"{cfg} cannot be read ({e.strerror}); make it readable by this user "
                              f"(read-only is fine)") from None
        return p.resolve()
    except OSError as e:  # e.g. a stat on a broken mount
        raise MoeboxError(f"{flag} {p} cannot be accessed ({e.strerror or e}); {fix}") from None


def check_store_dir(path: str | os.PathLike[str], model_dir: str | os.PathLike[str], needed_bytes: int,
                    flag: str = "--store") -> Path:
    """The resolved, existing, writable store directory with at least `needed_bytes` free (pass what is still
    to be written); a MoeboxError otherwise. Creates the directory (and parents) when missing."""
    p = Path(path).expanduser()
    fix = "pass a writable directory outside the model directory (the model directory may stay read-only)"
    try:
        store, model = p.resolve(), Path(model_dir).expanduser().resolve()
        if store == model:
            raise MoeboxError(f"{flag} {p} is the model directory; {fix}")
        if store.is_relative_to(model):
            raise MoeboxError(f"{flag} {p} is inside the model directory {model}; {fix}")
        if store.exists() and not store.is_dir():
            raise MoeboxError(f"{flag} {p} exists and is not a directory; {fix}")
        try:
            store.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MoeboxError(f"{flag} {p} cannot be created: it {_why(e)}; {fix}") from None
        probe = store / f".moebox-write-probe-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise MoeboxError(f"{flag} {p} {_why(e)}; {fix}") from None
        finally:
            try:
                probe.unlink()
            except OSError:
                pass
        free = shutil.disk_usage(store).free
        if free < needed_bytes:
            raise MoeboxError(f"{flag} {p} has {free / GiB:.2f} GiB free but the expert planes need "
                              f"{needed_bytes / GiB:.2f} GiB (short by {(needed_bytes - free) / GiB:.2f} GiB); "
                              f"free space there or pass a directory on a larger disk")
        return store
    except OSError as e:
        raise MoeboxError(f"{flag} {p} cannot be used: it {_why(e)}; {fix}") from None
