"""Number formats, schema, the lazy Checkpoint over both layouts, the HF mapping, and the tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moebox.weights.checkpoint as checkpoint_mod
from moebox.config import parse_config
from moebox.errors import CheckpointError, ConfigError
from moebox.weights.checkpoint import Checkpoint
from moebox.weights.formats import QuantTensor, fp4_round, quant_fp4, quant_fp8_block
from moebox.weights.hf import hf_config_dict, hf_to_official_state, official_to_hf_name, official_to_hf_state
from moebox.weights.schema import official_schema, tensor_group
from moebox.weights.tokenizer import BOS, EOS, SPECIAL_TOKENS, build_tokenizer, save_tokenizer


# ------------------------------------------------------------------ formats, checked against the doc's definitions
def _e4m3_by_hand(byte: int) -> float:
    """OCP FP8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 0:
        return sign * (man / 8) * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


_FP4_BY_HAND = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_fp8_block_scale_and_values_by_hand() -> None:
    w = torch.zeros(130, 260)
    w[0, 0], w[5, 7] = 56.0, -0.125          # block (0,0): amax 56 -> e = ceil(log2(56/448)) = -3 -> byte 124
    w[129, 259] = 448.0 * 4                  # block (1,2): amax 1792 -> e = 2 -> byte 129
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 3)
    sb = s.view(torch.uint8)
    assert sb[0, 0].item() == 124 and sb[1, 2].item() == 129
    assert sb[0, 1].item() == 0              # all-zero block: exponent clamps to -127
    qb = q.view(torch.uint8)

    def by_hand(i: int, j: int) -> float:
        return _e4m3_by_hand(int(qb[i, j])) * 2.0 ** (int(sb[i // 128, j // 128]) - 127)

    assert by_hand(0, 0) == 56.0 and by_hand(5, 7) == -0.125 and by_hand(129, 259) == 1792.0
    assert QuantTensor("fp8", q, s).dequantize()[5, 7].item() == -0.125


def test_fp4_nibble_order_and_scale_by_hand() -> None:
    row = torch.zeros(1, 64)
    row[0, :4] = torch.tensor([0.5, 1.0, -6.0, 3.0])   # block 0: amax 6 -> e = ceil(log2(6/6)) = 0 -> byte 127
    row[0, 32:34] = torch.tensor([24.0, -8.0])          # block 1: amax 24 -> e = 2 -> byte 129; values 6, -2
    packed, scale = quant_fp4(row)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (1, 32) and tuple(scale.shape) == (1, 2)
    b = packed.view(torch.uint8)[0]
    # logical col 2c = low nibble of byte c; code = sign bit 3 | index into {0,.5,1,1.5,2,3,4,6}
    assert b[0].item() == (1 | 2 << 4)                  # 0.5 -> 1 (low), 1.0 -> 2 (high)
    assert b[1].item() == ((8 | 7) | 5 << 4)            # -6 -> 0b1111 (low), 3 -> 5 (high)
    assert b[16].item() == (7 | (8 | 4) << 4)           # 6 -> 7 (low), -2 -> 0b1100 (high)
    assert scale.view(torch.uint8)[0].tolist() == [127, 129]

    def by_hand(j: int) -> float:
        nib = (int(b[j // 2]) >> (4 * (j % 2))) & 0xF
        v = _FP4_BY_HAND[nib & 7] * (-1.0 if nib & 8 else 1.0)
        return v * 2.0 ** (int(scale.view(torch.uint8)[0, j // 32]) - 127)

    expect = row[0].tolist()
    assert [by_hand(j) for j in range(64)] == expect
    assert QuantTensor("fp4", packed, scale).dequantize()[0].tolist() == expect


def test_quant_round_trips_are_stable() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 320, generator=g) * 0.05
    q8 = QuantTensor("fp8", *quant_fp8_block(w))
    d8 = q8.dequantize()
    assert (d8 - w).abs().max() <= w.abs().max() * 2 ** -3      # e4m3: 3 mantissa bits
    assert torch.equal(QuantTensor("fp8", *quant_fp8_block(d8)).dequantize(), d8)   # representable -> exact
    q4 = QuantTensor("fp4", *quant_fp4(w))
    assert q4.shape == w.shape
    d4 = q4.dequantize()
    assert torch.equal(QuantTensor("fp4", *quant_fp4(d4)).dequantize(), d4)
    # QAT's unpacked rounding gives the exported values, bit for bit (signed zeros, tiny and huge blocks too)
    w[0, :7] = torch.tensor([0.0, -0.0, 1e-39, -3e-38, 2.5e-3, 7e30, -1e-45])
    assert torch.equal(fp4_round(w), QuantTensor("fp4", *quant_fp4(w)).dequantize())


# ------------------------------------------------------------------ schema
def test_schema_tiny(tiny_ckpt: Path) -> None:
    cfg = Checkpoint(tiny_ckpt).config
    schema = official_schema(cfg)
    assert schema["layers.1.attn.compressor.ape"].shape == (4, 128)          # CSA: [ratio, 2*head_dim]
    assert schema["layers.2.attn.compressor.ape"].shape == (8, 64)           # HCA: [ratio, head_dim]
    assert schema["layers.1.attn.indexer.compressor.ape"].shape == (4, 64)
    assert schema["layers.0.ffn.gate.tid2eid"].shape == (320, 2) and "layers.0.ffn.gate.bias" not in schema
    assert "layers.2.ffn.gate.bias" in schema and "layers.2.attn.indexer.wq_b.weight" not in schema
    assert schema["layers.3.ffn.experts.7.w2.weight"].stored()[0][2] == (64, 16)
    assert schema["layers.0.attn.wo_a.weight"].shape == (32, 128)
    assert schema["mtp.0.e_proj.weight"].kind == "fp8" and "mtp.0.attn.compressor.ape" not in schema
    assert schema["mtp.0.ffn.gate.bias"].kind == "fp32"
    assert {tensor_group(n) for n in schema} == {"embed", "head", "attn", "compressor", "indexer", "router",
                                                 "shared", "experts", "norm", "mhc", "mtp"}
    fp8_experts = replace(cfg, quant=replace(cfg.quant, expert_dtype="fp8"))
    assert official_schema(fp8_experts)["layers.0.ffn.experts.0.w1.weight"].kind == "fp8"
    with pytest.raises(CheckpointError, match="unknown tensor group"):
        tensor_group("layers.0.attn.rotary.inv_freq")


# ------------------------------------------------------------------ Checkpoint (official layout)
def test_checkpoint_is_lazy_and_valid(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real = checkpoint_mod.safe_open
    monkeypatch.setattr(checkpoint_mod, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    ckpt = Checkpoint(tiny_ckpt)
    assert ckpt.layout == "official"
    names = ckpt.names()
    ckpt.validate()
    assert opened == []                                   # only headers were read
    assert set(names) == set(official_schema(ckpt.config))
    w = ckpt.get("layers.1.attn.wq_a.weight")
    assert isinstance(w, QuantTensor) and w.kind == "fp8" and w.shape == (32, 64)
    assert len(opened) == 2                               # weight + its scale, nothing else
    e = ckpt.get("layers.3.ffn.experts.5.w2.weight")
    assert isinstance(e, QuantTensor) and e.kind == "fp4" and e.shape == (64, 32)
    assert ckpt.get("embed.weight").dtype == torch.bfloat16
    assert ckpt.get("layers.0.attn.attn_sink").dtype == torch.float32
    with pytest.raises(CheckpointError, match="layers.9.attn.wq_a.weight"):
        ckpt.get("layers.9.attn.wq_a.weight")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tid2eid_decoded_by_value(tiny_copy: Path, dtype: torch.dtype) -> None:
    name = "layers.1.ffn.gate.tid2eid"
    index = json.loads((tiny_copy / "model.safetensors.index.json").read_text())
    shard = tiny_copy / index["weight_map"][name]
    tensors = load_file(shard)
    expect = tensors[name].long()
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    ckpt = Checkpoint(tiny_copy)
    ckpt.validate()
    got = ckpt.get(name)
    assert got.dtype == torch.int64 and torch.equal(got, expect)
    assert all(len(set(r)) == len(r) for r in got.tolist())          # distinct experts per token


# ------------------------------------------------------------------ HF mapping, both layouts
def _dequantized(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    out = {}
    for name in ckpt.names():
        t = ckpt.get(name)
        t = t.dequantize() if isinstance(t, QuantTensor) else t
        out[name] = t if name.endswith("tid2eid") else t.float()
    return out


@pytest.fixture(scope="session")
def hf_dirs(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """The tiny checkpoint put into transformers and saved in both of its formats; also its logits on 48 tokens."""
    transformers = pytest.importorskip("transformers")
    ckpt = Checkpoint(tiny_ckpt)
    hf_cfg = transformers.DeepseekV4Config(**hf_config_dict(ckpt.config), attn_implementation="eager")
    model = transformers.DeepseekV4ForCausalLM(hf_cfg).float().eval()
    result = model.load_state_dict(official_to_hf_state(_dequantized(ckpt), ckpt.config), strict=False)
    assert not result.unexpected_keys
    non_persistent = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    assert set(result.missing_keys) <= non_persistent
    base = tmp_path_factory.mktemp("hf")
    model.save_pretrained(base / "original_format")                       # transformers' default
    model.save_pretrained(base / "module_names", save_original_format=False)
    with torch.no_grad():
        logits = model(torch.arange(48).remainder(ckpt.config.vocab_size)[None]).logits
    return base / "original_format", base / "module_names", logits


def test_hf_model_runs_on_synthetic_weights(hf_dirs: tuple[Path, Path, torch.Tensor]) -> None:
    logits = hf_dirs[2]
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 30                                 # neither degenerate nor exploding
    assert logits[0].argmax(-1).unique().numel() > 3


@pytest.mark.parametrize("which", [0, 1], ids=["save_original_format", "module_names"])
def test_hf_layout_serves_official_names(tiny_ckpt: Path, hf_dirs: tuple[Path, Path, torch.Tensor],
                                         which: int) -> None:
    official = Checkpoint(tiny_ckpt)
    hf = Checkpoint(hf_dirs[which])
    assert hf.layout == "hf"
    hf.validate()
    expect = _dequantized(official)
    main_names = {n for n in expect if not n.startswith("mtp.")}
    assert set(hf.names()) == main_names                                 # HF drops the MTP block
    for name in sorted(main_names):
        got = hf.get(name)
        assert torch.equal(got.to(expect[name].dtype), expect[name]), name
    # HF config.json parses back to the same model; it keeps num_nextn_predict_layers but drops quantization_config
    raw = json.loads((hf_dirs[which] / "config.json").read_text())
    assert parse_config(raw) == replace(official.config, quant=None)


def test_hf_names_and_config_dict(tiny_ckpt: Path) -> None:
    cfg = Checkpoint(tiny_ckpt).config
    assert parse_config(hf_config_dict(cfg)) == replace(cfg, quant=None)
    assert official_to_hf_name("layers.3.attn.wq_b.scale") == "model.layers.3.self_attn.q_b_proj.weight_scale_inv"
    assert official_to_hf_name("layers.1.attn.indexer.compressor.ape") == \
        "model.layers.1.self_attn.compressor.indexer.position_bias"
    assert official_to_hf_name("mtp.0.e_proj.weight") is None
    state = {n: torch.zeros(s.shape) for n, s in official_schema(cfg).items()}
    back = hf_to_official_state(official_to_hf_state(state, cfg), cfg)
    assert set(back) == {n for n in state if not n.startswith("mtp.")}
    mixed = replace(cfg, compress_ratios=(0, 4, 8, 4, 16, 0))
    with pytest.raises(ConfigError, match="one compress rate"):
        hf_config_dict(mixed)


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_round_trip_and_special_ids(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    tok = build_tokenizer(320)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    assert [tok.token_to_id(t) for t, _ in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    text = (f"{BOS}<｜User｜>你好，世界！ naïve café 😀\n\ttabs<｜Assistant｜><think>想一想</think>"
            f"<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">{EOS}")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-1] == 1 and max(ids) < 320
    assert tok.decode(ids, skip_special_tokens=False) == text
    save_tokenizer(tmp_path, tok)
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text, add_special_tokens=False).ids == ids
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.bos_token_id == 0 and hf_tok.eos_token_id == 1
    assert hf_tok.encode(text, add_special_tokens=False) == ids
    assert hf_tok.decode(ids, skip_special_tokens=False) == text
    assert "<think>" in hf_tok.decode(ids, skip_special_tokens=True)      # think tags are not special
    with pytest.raises(ConfigError, match="vocab_size=100"):
        build_tokenizer(100)
