"""The plane store and `moebox pack`: resumable, byte-identical, never trusting a stale store, and a warm
start that reads no expert bytes from the checkpoint."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moebox import LLM
from moebox.errors import MoeboxError
from moebox.quant.w2 import from_fp4
from moebox.store.pack import expert_layers, open_store, pack
from moebox.store.plane_store import DATA, SIDECAR
from moebox.weights.checkpoint import Checkpoint
from moebox.weights.synth import write_synthetic


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    """Big enough that packing takes seconds (so it can be interrupted), written once: `small` cut to 4 layers."""
    return write_synthetic(tmp_path_factory.mktemp("small"), "small", seed=0, layers=4, progress=False)


@pytest.fixture(scope="module")
def reference_store(small_ckpt, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("reference") / "store"
    proc = pack_cli(small_ckpt, store)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    return store


def pack_cli(model: Path, store: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moebox.cli", "pack", str(model), "--store", str(store), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def store_bytes(store: Path) -> tuple[bytes, bytes]:
    return (store / DATA).read_bytes(), (store / SIDECAR).read_bytes()


def test_pack_writes_planes_equal_to_the_codec(tiny_ckpt, tmp_path):
    ckpt = Checkpoint(tiny_ckpt)
    store = open_store(ckpt, tmp_path / "store")
    summary = pack(ckpt, store, progress=False)
    assert summary.layers_packed == list(range(store.shape.layers)) and summary.bits_per_weight == 2.25
    assert store.shape.layers == ckpt.config.num_layers + ckpt.config.num_mtp_layers   # MTP experts too
    for layer, prefix in enumerate(expert_layers(ckpt)):
        buf = store.read_layer(layer)
        for e in (0, store.shape.experts - 1):
            for t, planes in zip(("w1", "w3", "w2"), store.expert_planes(buf, e)):
                src = ckpt.get(f"{prefix}{e}.{t}.weight")
                ref = from_fp4(src.data, src.scale)
                assert torch.equal(planes.codes, ref.codes) and torch.equal(planes.scales.view(torch.uint8),
                                                                            ref.scales.view(torch.uint8))
    again = pack(ckpt, open_store(ckpt, tmp_path / "store"), progress=False)
    assert again.layers_packed == [] and again.bytes_written == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_interrupted_pack_resumes_and_ends_byte_identical(small_ckpt, reference_store, tmp_path, sig):
    reference = reference_store
    store = tmp_path / "interrupted"
    proc = pack_cli(small_ckpt, store)
    deadline = time.time() + 120
    while time.time() < deadline:                      # wait until at least one layer is committed
        try:
            done = json.loads((store / SIDECAR).read_text())["layers_complete"]
        except (OSError, ValueError, KeyError):
            done = []
        if done or proc.poll() is not None:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"pack ended before it could be interrupted: {proc.communicate()}"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "run the same command again to resume" in err, (proc.returncode, err[-3000:])
    done = json.loads((store / SIDECAR).read_text())["layers_complete"]
    total = json.loads((reference / SIDECAR).read_text())["shape"]["layers"]
    assert 0 < len(done) < total

    resumed = pack_cli(small_ckpt, store)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"reused {len(done)} complete layer(s)" in out
    assert f"packed {total - len(done)} layer(s)" in out
    assert store_bytes(store) == store_bytes(reference)


def test_stale_store_is_rebuilt_never_trusted(tiny_ckpt, tmp_path, caplog):
    other = write_synthetic(tmp_path / "other", "tiny", seed=1, progress=False)     # same shapes, other weights
    store_dir = tmp_path / "store"
    pack(Checkpoint(tiny_ckpt), open_store(Checkpoint(tiny_ckpt), store_dir), progress=False)

    store = open_store(Checkpoint(other), store_dir)
    assert store.complete_layers == [] and "checkpoint differs" in caplog.text
    pack(Checkpoint(other), store, progress=False)
    fresh = tmp_path / "fresh"
    pack(Checkpoint(other), open_store(Checkpoint(other), fresh), progress=False)
    assert store_bytes(store_dir) == store_bytes(fresh)

    side = json.loads((store_dir / SIDECAR).read_text())
    side["quantizer"]["version"] = 0                   # written by another codec version
    (store_dir / SIDECAR).write_text(json.dumps(side))
    assert open_store(Checkpoint(other), store_dir).complete_layers == []

    pack(Checkpoint(other), open_store(Checkpoint(other), store_dir), progress=False)
    with open(store_dir / DATA, "r+b") as f:           # a data file of the wrong size
        f.truncate(100)
    assert open_store(Checkpoint(other), store_dir).complete_layers == []


def test_one_writer_at_a_time(tiny_ckpt, tmp_path):
    ckpt = Checkpoint(tiny_ckpt)
    with open_store(ckpt, tmp_path / "s").writer():
        with pytest.raises(MoeboxError, match="another process is writing"):
            with open_store(ckpt, tmp_path / "s").writer():
                pass


def overwrite_expert_bytes(model_dir: Path) -> int:
    """Fill every routed-expert tensor's data with 0xFF (FP4 -6, E8M0 NaN): any read of them poisons logits."""
    count = 0
    for shard in model_dir.glob("*.safetensors"):
        with open(shard, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            for name, info in header.items():
                if ".ffn.experts." in name:
                    start, end = info["data_offsets"]
                    f.seek(8 + n + start)
                    f.write(b"\xff" * (end - start))
                    count += 1
    return count


def test_warm_start_reads_no_expert_bytes(tiny_ckpt, tmp_path):
    store = tmp_path / "store"
    ids = list(range(2, 90))
    cold = LLM(tiny_ckpt, experts="w2", store_dir=store, progress=False).logits(ids)
    poisoned = Path(shutil.copytree(tiny_ckpt, tmp_path / "poisoned"))
    assert overwrite_expert_bytes(poisoned) > 0
    with pytest.raises(AssertionError):                # the poison is real: native experts read it
        assert LLM(poisoned, progress=False).logits(ids).isfinite().all()
    warm = LLM(poisoned, experts="w2", store_dir=store, progress=False).logits(ids)
    assert torch.equal(warm, cold)


def test_w2_vs_native_quality_smoke(tiny_ckpt, small_ckpt, tmp_path):
    """Random weights make this a smoke test (the trained model of issue G gives real numbers): report top-1
    agreement and KL of w2 against native experts over a few hundred positions."""
    for name, ckpt in (("tiny", tiny_ckpt), ("small", small_ckpt)):
        native = LLM(ckpt, progress=False, max_model_len=512)
        w2 = LLM(ckpt, experts="w2", store_dir=tmp_path / name, progress=False, max_model_len=512)
        ids = torch.randint(2, native.config.vocab_size, (300,), generator=torch.Generator().manual_seed(5)).tolist()
        ln, lw = native.logits(ids), w2.logits(ids)
        top1 = (ln.argmax(-1) == lw.argmax(-1)).float().mean().item()
        kl = torch.nn.functional.kl_div(lw.log_softmax(-1), ln.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1).mean().item()
        print(f"\n{name}: w2 vs native over 300 positions: top-1 agreement {top1:.3f}, KL(native||w2) {kl:.4f}")
        assert lw.isfinite().all() and kl < 5.0


def test_transformers_layout_experts_pack_from_float(tmp_path):
    """A bf16/fp32 transformers checkpoint has float experts: they go through `from_float`."""
    from moebox.quant.w2 import from_float
    from tests.hf_oracle import DeepseekV4Config, DeepseekV4ForCausalLM, randomize_hidden_paths
    from tests.test_parity import SECOND
    cfg = DeepseekV4Config(**SECOND)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomize_hidden_paths(model, seed=3)
    model.save_pretrained(tmp_path / "hf")
    ckpt = Checkpoint(tmp_path / "hf")
    store = open_store(ckpt, tmp_path / "store")
    pack(ckpt, store, progress=False)
    assert store.shape.layers == ckpt.config.num_layers            # transformers checkpoints carry no MTP block
    w1 = store.expert_planes(store.read_layer(4), 7)[0]
    ref = from_float(ckpt.get("layers.4.ffn.experts.7.w1.weight"))
    assert torch.equal(w1.codes, ref.codes) and torch.equal(w1.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    logits = LLM(tmp_path / "hf", experts="w2", store_dir=tmp_path / "store", progress=False).logits(list(range(40)))
    assert logits.isfinite().all()
