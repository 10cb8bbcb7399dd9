"""The official DeepSeek-V4 tensor layout, derived from a `ModelConfig`.

One table answers "which tensors must a checkpoint of this config hold, in which shape and storage format":
the synthetic writer generates exactly these, the checkpoint validator checks against them, and the HF name
mapping is tested against them. Keeping it in one place means a layout change cannot drift between the three.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from moebox.config import CSA, HCA, SLIDING, ModelConfig
from moebox.errors import CheckpointError

KINDS = ("fp8", "fp4", "bf16", "fp32", "int")
GROUPS = ("embed", "head", "attn", "compressor", "indexer", "router", "shared", "experts", "norm", "mhc", "mtp")

# safetensors dtype strings of what is stored on disk for each kind (weight, scale)
STORED_DTYPES: dict[str, tuple[str, ...]] = {
    "fp8": ("F8_E4M3",),
    "fp4": ("I8",),
    "bf16": ("BF16",),
    "fp32": ("F32",),
    "int": ("I32", "I64"),
}
SCALE_DTYPE = "F8_E8M0"


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.scale` (the official name of a quantized weight's E8M0 block scales)."""
    return weight_name.removesuffix(".weight") + ".scale"


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor: `shape` is the dequantized shape, `kind` how it is stored."""

    name: str
    shape: tuple[int, ...]
    kind: str
    block: tuple[int, int] = (128, 128)

    @property
    def quantized(self) -> bool:
        return self.kind in ("fp8", "fp4")

    @property
    def scale_name(self) -> str:
        return scale_name(self.name)

    def stored(self) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
        """The on-disk tensors as (name, allowed safetensors dtypes, shape)."""
        if self.kind == "fp8":
            out, inp = self.shape
            sshape = (math.ceil(out / self.block[0]), math.ceil(inp / self.block[1]))
            return [(self.name, STORED_DTYPES["fp8"], self.shape), (self.scale_name, (SCALE_DTYPE,), sshape)]
        if self.kind == "fp4":
            out, inp = self.shape
            return [(self.name, STORED_DTYPES["fp4"], (out, inp // 2)), (self.scale_name, (SCALE_DTYPE,), (out, inp // 32))]
        return [(self.name, STORED_DTYPES[self.kind], self.shape)]

    def stored_nbytes(self) -> int:
        """Bytes on disk (int tensors counted as int32)."""
        size = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}
        return sum(math.prod(shape) * size[dtypes[0]] for _, dtypes, shape in self.stored())


def _block_specs(cfg: ModelConfig, prefix: str, attn_type: str, ratio: int, hash_layer: bool,
                 block: tuple[int, int]) -> list[TensorSpec]:
    H, d, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    expert_kind = cfg.quant.expert_dtype if cfg.quant else "fp4"
    I, E = cfg.moe_intermediate_size, cfg.n_routed_experts
    n_mix = (2 + hc) * hc

    def t(name: str, shape: tuple[int, ...], kind: str) -> TensorSpec:
        return TensorSpec(prefix + name, shape, kind, block)

    specs = [
        t("attn.attn_sink", (cfg.num_heads,), "fp32"),
        t("attn.wq_a.weight", (cfg.q_lora_rank, H), "fp8"),
        t("attn.q_norm.weight", (cfg.q_lora_rank,), "bf16"),
        t("attn.wq_b.weight", (cfg.num_heads * d, cfg.q_lora_rank), "fp8"),
        t("attn.wkv.weight", (d, H), "fp8"),
        t("attn.kv_norm.weight", (d,), "bf16"),
        t("attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, cfg.num_heads * d // cfg.o_groups), "fp8"),
        t("attn.wo_b.weight", (H, cfg.o_groups * cfg.o_lora_rank), "fp8"),
    ]
    if attn_type in (CSA, HCA):
        width = 2 * d if attn_type == CSA else d
        specs += [
            t("attn.compressor.wkv.weight", (width, H), "bf16"),
            t("attn.compressor.wgate.weight", (width, H), "bf16"),
            t("attn.compressor.ape", (ratio, width), "fp32"),
            t("attn.compressor.norm.weight", (d,), "bf16"),
        ]
    if attn_type == CSA:
        di = cfg.index_head_dim
        specs += [
            t("attn.indexer.wq_b.weight", (cfg.index_n_heads * di, cfg.q_lora_rank), "fp8"),
            t("attn.indexer.weights_proj.weight", (cfg.index_n_heads, H), "bf16"),
            t("attn.indexer.compressor.wkv.weight", (2 * di, H), "bf16"),
            t("attn.indexer.compressor.wgate.weight", (2 * di, H), "bf16"),
            t("attn.indexer.compressor.ape", (ratio, 2 * di), "fp32"),
            t("attn.indexer.compressor.norm.weight", (di,), "bf16"),
        ]
    specs.append(t("ffn.gate.weight", (E, H), "bf16"))
    if hash_layer:
        specs.append(t("ffn.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "int"))
    else:
        specs.append(t("ffn.gate.bias", (E,), "fp32"))
    if cfg.n_shared_experts:
        Is = cfg.n_shared_experts * I
        specs += [
            t("ffn.shared_experts.w1.weight", (Is, H), "fp8"),
            t("ffn.shared_experts.w2.weight", (H, Is), "fp8"),
            t("ffn.shared_experts.w3.weight", (Is, H), "fp8"),
        ]
    for e in range(E):
        specs += [
            t(f"ffn.experts.{e}.w1.weight", (I, H), expert_kind),
            t(f"ffn.experts.{e}.w2.weight", (H, I), expert_kind),
            t(f"ffn.experts.{e}.w3.weight", (I, H), expert_kind),
        ]
    specs += [
        t("attn_norm.weight", (H,), "bf16"),
        t("ffn_norm.weight", (H,), "bf16"),
    ]
    for site in ("attn", "ffn"):
        specs += [
            t(f"hc_{site}_fn", (n_mix, hc * H), "fp32"),
            t(f"hc_{site}_base", (n_mix,), "fp32"),
            t(f"hc_{site}_scale", (3,), "fp32"),
        ]
    return specs


def _head_specs(cfg: ModelConfig, prefix: str, block: tuple[int, int]) -> list[TensorSpec]:
    H, hc = cfg.hidden_size, cfg.hc_mult
    return [
        TensorSpec(prefix + "norm.weight", (H,), "bf16", block),
        TensorSpec(prefix + "hc_head_fn", (hc, hc * H), "fp32", block),
        TensorSpec(prefix + "hc_head_base", (hc,), "fp32", block),
        TensorSpec(prefix + "hc_head_scale", (1,), "fp32", block),
    ]


def schema_units(cfg: ModelConfig) -> list[tuple[str, list[TensorSpec]]]:
    """The schema in file order, cut into units that belong together (embed, each layer, final head, each MTP)."""
    block = cfg.quant.weight_block_size if cfg.quant else (128, 128)
    H, V = cfg.hidden_size, cfg.vocab_size
    units: list[tuple[str, list[TensorSpec]]] = [("embed", [TensorSpec("embed.weight", (V, H), "bf16", block)])]
    for i in range(cfg.num_layers):
        units.append((f"layers.{i}", _block_specs(cfg, f"layers.{i}.", cfg.attn_types[i], cfg.compress_ratios[i],
                                                  cfg.hash_layers[i], block)))
    units.append(("head", _head_specs(cfg, "", block) + [TensorSpec("head.weight", (V, H), "bf16", block)]))
    for j in range(cfg.num_mtp_layers):
        p = f"mtp.{j}."
        specs = _block_specs(cfg, p, SLIDING, 0, False, block) + [
            TensorSpec(p + "e_proj.weight", (H, H), "fp8", block),
            TensorSpec(p + "h_proj.weight", (H, H), "fp8", block),
            TensorSpec(p + "enorm.weight", (H,), "bf16", block),
            TensorSpec(p + "hnorm.weight", (H,), "bf16", block),
        ] + _head_specs(cfg, p, block)
        units.append((f"mtp.{j}", specs))
    return units


def official_schema(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every logical tensor of the official checkpoint of `cfg`, by official name (scales are implied)."""
    return {s.name: s for _, specs in schema_units(cfg) for s in specs}


_GROUP_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^embed\.weight$"), "embed"),
    (re.compile(r"^head\.weight$"), "head"),
    (re.compile(r"^(norm\.weight|hc_head_(fn|base|scale))$"), "norm"),
    (re.compile(r"^mtp\.\d+\.(e_proj\.(weight|scale)|h_proj\.(weight|scale)|enorm\.weight|hnorm\.weight|"
                r"norm\.weight|hc_head_(fn|base|scale))$"), "mtp"),
    (re.compile(r"^(layers|mtp)\.\d+\.attn\.indexer\.(wq_b\.(weight|scale)|weights_proj\.weight|"
                r"compressor\.(wkv\.weight|wgate\.weight|ape|norm\.weight))$"), "indexer"),
    (re.compile(r"^(layers|mtp)\.\d+\.attn\.compressor\.(wkv\.weight|wgate\.weight|ape|norm\.weight)$"), "compressor"),
    (re.compile(r"^(layers|mtp)\.\d+\.attn\.(attn_sink|(wq_a|wq_b|wkv|wo_a|wo_b)\.(weight|scale)|"
                r"(q_norm|kv_norm)\.weight)$"), "attn"),
    (re.compile(r"^(layers|mtp)\.\d+\.ffn\.gate\.(weight|bias|tid2eid)$"), "router"),
    (re.compile(r"^(layers|mtp)\.\d+\.ffn\.shared_experts\.w[123]\.(weight|scale)$"), "shared"),
    (re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$"), "experts"),
    (re.compile(r"^(layers|mtp)\.\d+\.(attn_norm|ffn_norm)\.weight$"), "norm"),
    (re.compile(r"^(layers|mtp)\.\d+\.hc_(attn|ffn)_(fn|base|scale)$"), "mhc"),
]


def tensor_group(name: str) -> str:
    """Which part of the model an official tensor name belongs to; an unrecognised name is a CheckpointError."""
    for pattern, group in _GROUP_RULES:
        if pattern.match(name):
            return group
    raise CheckpointError(f"tensor '{name}': unknown tensor group (not a DeepSeek-V4 official tensor name); "
                          f"is this checkpoint for another model or revision?")
