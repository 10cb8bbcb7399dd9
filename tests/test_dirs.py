"""Directory checks at start: each failure is one MoeboxError line naming the path and the fix.

Read-only and tiny-disk cases mount inside a private mount namespace (`unshare -m`) only, so nothing outside the
test's own process tree ever sees a mount."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebox.errors import MoeboxError
from moebox.runtime.dirs import check_model_dir, check_store_dir

from tests.mounts import in_namespace as _in_namespace, needs_unshare  # noqa: E402


_CHECK_SNIPPET = """
import sys
from moebox.errors import MoeboxError
from moebox.runtime.dirs import check_model_dir, check_store_dir
try:
    {call}
except MoeboxError as e:
    print("ERR", e)
    sys.exit(3)
print("OK")
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return d


def _err(fn, *args) -> str:
    with pytest.raises(MoeboxError) as ei:
        fn(*args)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- model dir
def test_model_dir_ok(model_dir):
    assert check_model_dir(model_dir) == model_dir.resolve()


def test_model_dir_missing(tmp_path):
    msg = _err(check_model_dir, tmp_path / "nope")
    assert str(tmp_path / "nope") in msg and "does not exist" in msg and "config.json" in msg


def test_model_dir_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a directory" in _err(check_model_dir, f)


def test_model_dir_without_config(tmp_path):
    assert "has no config.json" in _err(check_model_dir, tmp_path)


@needs_unshare
def test_read_only_model_dir_is_fine(model_dir, tmp_path):
    ro = tmp_path / "ro_model"
    ro.mkdir()
    r = _in_namespace(f"mount --bind {model_dir} {ro}\nmount -o remount,bind,ro {ro}\n"
                      f"! touch {ro}/probe 2>/dev/null",
                      _CHECK_SNIPPET.format(call=f"check_model_dir({str(ro)!r})"))
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


# ---------------------------------------------------------------- store dir
def test_store_ok_and_created(model_dir, tmp_path):
    store = tmp_path / "a" / "store"
    assert check_store_dir(store, model_dir, 1) == store.resolve()
    assert store.is_dir() and list(store.iterdir()) == []          # the probe file is gone


def test_store_equal_to_model_dir(model_dir):
    msg = _err(check_store_dir, model_dir, model_dir, 0)
    assert "is the model directory" in msg and "outside the model directory" in msg


def test_store_inside_model_dir(model_dir):
    msg = _err(check_store_dir, model_dir / "planes", model_dir, 0)
    assert "inside the model directory" in msg
    assert not (model_dir / "planes").exists()


def test_store_inside_model_dir_via_symlink(model_dir, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    assert "inside the model directory" in _err(check_store_dir, link / "planes", model_dir, 0)


def test_store_is_a_file(model_dir, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "is not a directory" in _err(check_store_dir, f, model_dir, 0)


def test_store_not_enough_space_by_size_check(model_dir, tmp_path):
    msg = _err(check_store_dir, tmp_path / "s", model_dir, 2 ** 62)
    assert "GiB free but the expert planes need" in msg and "larger disk" in msg


@needs_unshare
def test_read_only_store(model_dir, tmp_path):
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    for target in (ro, ro / "sub"):           # the store itself, and a store that would have to be created
        r = _in_namespace(f"mount --bind {src} {ro}\nmount -o remount,bind,ro {ro}",
                          _CHECK_SNIPPET.format(call=f"check_store_dir({str(target)!r}, {str(model_dir)!r}, 0)"))
        assert r.returncode == 3, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and "read-only file system" in r.stdout, r.stdout
        assert f"--store {target}" in r.stdout and "writable directory" in r.stdout


@needs_unshare
def test_tiny_disk(model_dir, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    r = _in_namespace(f"mount -t tmpfs -o size=1m tmpfs {small}",
                      _CHECK_SNIPPET.format(call=f"check_store_dir({str(small)!r}, {str(model_dir)!r}, 72 * 2**30)"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "GiB free but the expert planes need 72.00 GiB" in r.stdout
    # a store needing less than the tmpfs holds is fine there
    r = _in_namespace(f"mount -t tmpfs -o size=1m tmpfs {small}",
                      _CHECK_SNIPPET.format(call=f"check_store_dir({str(small)!r}, {str(model_dir)!r}, 1000)"))
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
