"""Shared fixtures: synthetic checkpoints are written once per test session, copied where a test damages one."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moebox.weights.synth import write_synthetic  # noqa: E402

# The test models are tiny: one thread beats two fighting over 2 cores for microsecond-sized ops.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny official-layout checkpoint (seed 0); shared by the session, so treat it as read-only."""
    return write_synthetic(tmp_path_factory.mktemp("tiny"), "tiny", seed=0, progress=False)


@pytest.fixture
def tiny_copy(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may modify."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory):
    """`moebox serve` with no model: the built-in demo model, written to a fresh cache dir on first use."""
    from tests.servers import start_server
    tmp = tmp_path_factory.mktemp("demo-server")
    server = start_server(["--max-num-seqs", "4", "--max-waiting", "256"], tmp / "cache", tmp / "server.log")
    yield server
    server.stop()
