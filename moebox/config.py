"""DeepSeek-V4 model configuration, read from either config.json dialect.

Two dialects exist in the wild and both must load to the same `ModelConfig`:
- the official DeepSeek release (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`,
  `quantization_config`, `num_nextn_predict_layers`), and
- what transformers' `DeepseekV4Config.save_pretrained` writes (`layer_types`, `mlp_layer_types`,
  `compress_rates`, `partial_rotary_factor`, nested `rope_parameters`).
Extra keys are ignored (real configs carry many), but a value we do not understand, or two keys that
disagree, is a `ConfigError` naming the key: guessing here would silently compute a different model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any

from moebox.errors import ConfigError

SLIDING, CSA, HCA = "sliding", "csa", "hca"
ATTN_TYPES = (SLIDING, CSA, HCA)
_HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
_HF_MLP_TYPES = {"hash_moe": True, "moe": False}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation used by the compressed (CSA/HCA) layers' RoPE."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """How the official checkpoint stores weights (FP8 block-scaled dense, FP4 or FP8 experts)."""

    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    attn_types: tuple[str, ...]          # per main layer: sliding | csa | hca
    compress_ratios: tuple[int, ...]     # per main layer; 0 for sliding layers
    hash_layers: tuple[bool, ...]        # per main layer: route by token id (tid2eid)
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 1048576
    num_mtp_layers: int = 0
    bos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    quant: QuantConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived facts the model code asks for ----
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def mtp_layer_id(self) -> int:
        """The MTP block's layer id (it continues the main layers' numbering)."""
        return self.num_layers

    def layer_rope(self, attn_type: str) -> tuple[float, YarnScaling | None]:
        """(theta, yarn) for a layer kind: sliding layers use plain RoPE, compressed ones YaRN."""
        if attn_type == SLIDING:
            return self.rope_theta, None
        return self.compress_rope_theta, self.rope_scaling

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def _need(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw:
        raise ConfigError(f"{source}: required key '{key}' is missing")
    return raw[key]


def _pick(raw: dict[str, Any], source: str, *keys: str, default: Any = None) -> Any:
    """First present key among aliases; two aliases with different values is a contradiction."""
    found = [(k, raw[k]) for k in keys if k in raw and raw[k] is not None]
    if not found:
        return default
    first_key, first = found[0]
    for k, v in found[1:]:
        if v != first:
            raise ConfigError(f"{source}: '{first_key}'={first!r} contradicts '{k}'={v!r}")
    return first


def _positive_int(value: Any, key: str, source: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ConfigError(f"{source}: '{key}' must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")
    return value


def _attn_schedule(raw: dict[str, Any], n_layers: int, source: str) -> tuple[list[str], list[int], str | None]:
    """Per-layer attention kinds and compress ratios from `compress_ratios` and/or `layer_types`.

    Returns (kinds, ratios, mtp_kind). Official `compress_ratios` has one entry per layer plus one per MTP
    layer: 0 = sliding, 4 = CSA (overlapping windows + indexer), any other positive value = HCA at that rate.
    """
    rates_raw = raw.get("compress_rates") or {}
    if not isinstance(rates_raw, dict):
        raise ConfigError(f"{source}: 'compress_rates' must be an object, got {rates_raw!r}")
    for k in rates_raw:
        if k not in _HF_LAYER_TYPES or k == "sliding_attention":
            raise ConfigError(f"{source}: 'compress_rates' has unknown attention type {k!r}; "
                              f"expected compressed_sparse_attention or heavily_compressed_attention")
    csa_rate = _positive_int(rates_raw.get("compressed_sparse_attention", raw.get("compress_rate_csa", 4)),
                             "compress_rates.compressed_sparse_attention", source)
    hca_rate = _positive_int(rates_raw.get("heavily_compressed_attention", raw.get("compress_rate_hca", 128)),
                             "compress_rates.heavily_compressed_attention", source)

    kinds_from_ratios: list[str] | None = None
    ratios: list[int] | None = None
    mtp_kind = None
    if raw.get("compress_ratios") is not None:
        cr = raw["compress_ratios"]
        if not isinstance(cr, list) or len(cr) < n_layers:
            raise ConfigError(f"{source}: 'compress_ratios' must list at least num_hidden_layers={n_layers} "
                              f"integers, got {cr!r}")
        for i, r in enumerate(cr):
            _positive_int(r, f"compress_ratios[{i}]", source, allow_zero=True)
        kinds_all = [SLIDING if r == 0 else CSA if r == 4 else HCA for r in cr]
        kinds_from_ratios, ratios = kinds_all[:n_layers], list(cr[:n_layers])
        if len(cr) > n_layers:
            mtp_kind = kinds_all[n_layers]

    kinds_from_types: list[str] | None = None
    if raw.get("layer_types") is not None:
        lt = raw["layer_types"]
        if not isinstance(lt, list):
            raise ConfigError(f"{source}: 'layer_types' must be a list, got {lt!r}")
        bad = [t for t in lt if t not in _HF_LAYER_TYPES]
        if bad:
            raise ConfigError(f"{source}: 'layer_types' has unknown attention type {bad[0]!r}; expected one of "
                              f"{sorted(_HF_LAYER_TYPES)}")
        if len(lt) < n_layers:
            raise ConfigError(f"{source}: 'layer_types' has {len(lt)} entries but num_hidden_layers is {n_layers}")
        kinds_from_types = [_HF_LAYER_TYPES[t] for t in lt[:n_layers]]

    if kinds_from_ratios is not None and kinds_from_types is not None and kinds_from_ratios != kinds_from_types:
        raise ConfigError(f"{source}: 'compress_ratios' and 'layer_types' describe different layer schedules")
    if kinds_from_ratios is not None:
        kinds = kinds_from_ratios
    elif kinds_from_types is not None:
        kinds = kinds_from_types
        ratios = [0 if k == SLIDING else csa_rate if k == CSA else hca_rate for k in kinds]
    else:
        raise ConfigError(f"{source}: neither 'compress_ratios' nor 'layer_types' is given, so the attention "
                          f"schedule is unknown (transformers would silently assume the V4-Pro schedule)")
    assert ratios is not None
    return kinds, ratios, mtp_kind


def _hash_schedule(raw: dict[str, Any], n_layers: int, source: str) -> list[bool]:
    from_count = None
    if raw.get("num_hash_layers") is not None:
        n_hash = _positive_int(raw["num_hash_layers"], "num_hash_layers", source, allow_zero=True)
        from_count = [i < n_hash for i in range(n_layers)]
    from_types = None
    if raw.get("mlp_layer_types") is not None:
        mt = raw["mlp_layer_types"]
        if not isinstance(mt, list) or len(mt) < n_layers:
            raise ConfigError(f"{source}: 'mlp_layer_types' must list num_hidden_layers={n_layers} entries")
        bad = [t for t in mt if t not in _HF_MLP_TYPES]
        if bad:
            raise ConfigError(f"{source}: 'mlp_layer_types' has unknown MoE type {bad[0]!r}; expected hash_moe or moe")
        from_types = [_HF_MLP_TYPES[t] for t in mt[:n_layers]]
    if from_count is not None and from_types is not None and from_count != from_types:
        raise ConfigError(f"{source}: 'num_hash_layers' and 'mlp_layer_types' disagree")
    if from_types is not None:
        return from_types
    if from_count is not None:
        return from_count
    return [i < 3 for i in range(n_layers)]


def _rope(raw: dict[str, Any], head_dim: int, source: str) -> tuple[int, float, float, YarnScaling | None]:
    """(rope_head_dim, rope_theta, compress_rope_theta, yarn) from either dialect."""
    rope_dim_legacy = raw.get("qk_rope_head_dim")
    prf = raw.get("partial_rotary_factor")
    if rope_dim_legacy is not None:
        rope_dim = _positive_int(rope_dim_legacy, "qk_rope_head_dim", source)
        if prf is not None and abs(prf * head_dim - rope_dim) > 1e-6:
            raise ConfigError(f"{source}: 'qk_rope_head_dim'={rope_dim} contradicts "
                              f"'partial_rotary_factor'={prf} x head_dim={head_dim}")
    elif prf is not None:
        rope_dim = int(round(prf * head_dim))
    else:
        rope_dim = 64 if head_dim >= 64 else head_dim
    if rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"{source}: rope head dim {rope_dim} must be even and <= head_dim {head_dim}")

    theta = float(raw.get("rope_theta", 10000.0))
    ctheta = float(raw.get("compress_rope_theta", 160000.0))
    scaling: dict[str, Any] | None = raw.get("rope_scaling")
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp.get("main") or {}, rp["compress"]
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: 'rope_parameters.main.rope_type'={main.get('rope_type')!r} is not supported "
                              f"(sliding layers use plain RoPE)")
        theta = float(main.get("rope_theta", theta))
        ctheta = float(comp.get("rope_theta", ctheta))
        scaling_from_params = comp if comp.get("rope_type", "default") != "default" else None
    elif isinstance(rp, dict) and rp:
        scaling_from_params = rp if rp.get("rope_type", rp.get("type", "default")) != "default" else None
    else:
        scaling_from_params = None
    if scaling is not None and scaling_from_params is not None:
        for k in ("factor", "original_max_position_embeddings"):
            if k in scaling and k in scaling_from_params and scaling[k] != scaling_from_params[k]:
                raise ConfigError(f"{source}: 'rope_scaling.{k}' contradicts 'rope_parameters' ({scaling[k]} vs "
                                  f"{scaling_from_params[k]})")
    scaling = scaling if scaling is not None else scaling_from_params
    yarn = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "yarn":
            try:
                yarn = YarnScaling(
                    factor=float(scaling["factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                    beta_fast=float(scaling.get("beta_fast", 32.0)),
                    beta_slow=float(scaling.get("beta_slow", 1.0)),
                )
            except KeyError as e:
                raise ConfigError(f"{source}: yarn rope scaling needs key {e.args[0]!r}") from None
            if scaling.get("attention_factor", 1.0) != 1.0 or scaling.get("mscale", 1.0) not in (1, 1.0, 0):
                raise ConfigError(f"{source}: yarn 'attention_factor'/'mscale' other than 1.0 is not supported "
                                  f"(DeepSeek-V4 applies no mscale)")
        elif kind != "default":
            raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported; DeepSeek-V4 uses 'yarn'")
    return rope_dim, theta, ctheta, yarn


def _quant(raw: dict[str, Any], source: str) -> QuantConfig | None:
    qc = raw.get("quantization_config")
    expert_dtype = raw.get("expert_dtype")
    if qc is None:
        return QuantConfig(expert_dtype=expert_dtype) if expert_dtype else None
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: 'quantization_config' must be an object")
    method = qc.get("quant_method", "fp8")
    if method != "fp8":
        raise ConfigError(f"{source}: 'quantization_config.quant_method'={method!r} is not supported; expected 'fp8'")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: 'quantization_config.fmt'={fmt!r} is not supported; expected 'e4m3'")
    block = tuple(qc.get("weight_block_size", (128, 128)))
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise ConfigError(f"{source}: 'quantization_config.weight_block_size' must be two positive ints, got {block!r}")
    scale_fmt = qc.get("scale_fmt", "ue8m0")
    if scale_fmt not in ("ue8m0", None):
        raise ConfigError(f"{source}: 'quantization_config.scale_fmt'={scale_fmt!r} is not supported; expected 'ue8m0'")
    qe = qc.get("expert_dtype")
    if expert_dtype is not None and qe is not None and qe != expert_dtype:
        raise ConfigError(f"{source}: 'expert_dtype'={expert_dtype!r} contradicts "
                          f"'quantization_config.expert_dtype'={qe!r}")
    ed = qe or expert_dtype or "fp4"
    if ed not in ("fp4", "fp8"):
        raise ConfigError(f"{source}: 'expert_dtype'={ed!r} is not supported; expected 'fp4' or 'fp8'")
    return QuantConfig(fmt=fmt, weight_block_size=(int(block[0]), int(block[1])), scale_fmt="ue8m0", expert_dtype=ed)


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a config.json dict of either dialect; `source` names it in errors."""
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"{source}: 'model_type'={model_type!r} is not supported; moebox runs 'deepseek_v4'")
    n_layers = _positive_int(_need(raw, "num_hidden_layers", source), "num_hidden_layers", source)
    hidden = _positive_int(_need(raw, "hidden_size", source), "hidden_size", source)
    heads = _positive_int(_need(raw, "num_attention_heads", source), "num_attention_heads", source)
    head_dim = _positive_int(raw.get("head_dim", 512), "head_dim", source)
    kv_heads = raw.get("num_key_value_heads", 1)
    if kv_heads != 1:
        raise ConfigError(f"{source}: 'num_key_value_heads'={kv_heads!r}; DeepSeek-V4 has one shared K=V head")
    kinds, ratios, mtp_kind = _attn_schedule(raw, n_layers, source)
    hash_layers = _hash_schedule(raw, n_layers, source)
    rope_dim, theta, ctheta, yarn = _rope(raw, head_dim, source)
    n_experts = _positive_int(_pick(raw, source, "n_routed_experts", "num_local_experts", default=256),
                              "n_routed_experts", source)
    top_k = _positive_int(raw.get("num_experts_per_tok", 6), "num_experts_per_tok", source)
    if top_k > n_experts:
        raise ConfigError(f"{source}: 'num_experts_per_tok'={top_k} exceeds 'n_routed_experts'={n_experts}")
    o_groups = _positive_int(raw.get("o_groups", 8), "o_groups", source)
    if heads % o_groups:
        raise ConfigError(f"{source}: 'o_groups'={o_groups} must divide 'num_attention_heads'={heads}")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"{source}: 'scoring_func'={scoring!r} is not supported; expected one of {SCORING_FUNCS}")
    topk_method = raw.get("topk_method", "noaux_tc")
    if topk_method not in ("noaux_tc", "greedy"):
        raise ConfigError(f"{source}: 'topk_method'={topk_method!r} is not supported (no group-limited routing)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: 'hidden_act'={act!r} is not supported; DeepSeek-V4 uses 'silu'")
    if raw.get("tie_word_embeddings", False):
        raise ConfigError(f"{source}: 'tie_word_embeddings' is true; DeepSeek-V4 has a separate lm head")
    if mtp_kind not in (None, SLIDING):
        raise ConfigError(f"{source}: 'compress_ratios[{n_layers}]' (the MTP layer) must be 0 (sliding); "
                          f"got {ratios and raw['compress_ratios'][n_layers]!r}")
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
    sw = _positive_int(raw.get("sliding_window", 128), "sliding_window", source)
    cfg = ModelConfig(
        vocab_size=_positive_int(_need(raw, "vocab_size", source), "vocab_size", source),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=_positive_int(raw.get("q_lora_rank", 1024), "q_lora_rank", source),
        o_groups=o_groups,
        o_lora_rank=_positive_int(raw.get("o_lora_rank", 1024), "o_lora_rank", source),
        n_routed_experts=n_experts,
        n_shared_experts=_positive_int(raw.get("n_shared_experts", 1), "n_shared_experts", source, allow_zero=True),
        num_experts_per_tok=top_k,
        moe_intermediate_size=_positive_int(_pick(raw, source, "moe_intermediate_size", "intermediate_size",
                                                  default=2048), "moe_intermediate_size", source),
        attn_types=tuple(kinds),
        compress_ratios=tuple(ratios),
        hash_layers=tuple(hash_layers),
        sliding_window=sw,
        index_n_heads=_positive_int(raw.get("index_n_heads", 64), "index_n_heads", source),
        index_head_dim=_positive_int(raw.get("index_head_dim", 128), "index_head_dim", source),
        index_topk=_positive_int(raw.get("index_topk", 512), "index_topk", source),
        scoring_func=scoring,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0) or 0.0),
        hc_mult=_positive_int(raw.get("hc_mult", 4), "hc_mult", source),
        hc_sinkhorn_iters=_positive_int(raw.get("hc_sinkhorn_iters", 20), "hc_sinkhorn_iters", source),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        compress_rope_theta=ctheta,
        rope_scaling=yarn,
        max_position_embeddings=_positive_int(raw.get("max_position_embeddings", 1048576),
                                              "max_position_embeddings", source),
        num_mtp_layers=_positive_int(raw.get("num_nextn_predict_layers", 0), "num_nextn_predict_layers", source,
                                     allow_zero=True),
        bos_token_id=int(raw.get("bos_token_id", 0) if raw.get("bos_token_id") is not None else 0),
        eos_token_ids=eos_ids,
        quant=_quant(raw, source),
        extra={k: v for k, v in raw.items() if k.startswith("dspark_")},
    )
    if cfg.index_head_dim < cfg.rope_head_dim:
        raise ConfigError(f"{source}: 'index_head_dim'={cfg.index_head_dim} is smaller than the rope dim {rope_dim}")
    if math.log2(cfg.index_head_dim) % 1:
        raise ConfigError(f"{source}: 'index_head_dim'={cfg.index_head_dim} must be a power of two (Hadamard)")
    return cfg


def load_config(model_dir: str | Path) -> ModelConfig:
    return parse_config(read_raw_config(model_dir), source=str(Path(model_dir) / "config.json"))


def read_raw_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict, or a ConfigError that names the file and what is wrong."""
    path = Path(model_dir) / "config.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found; point moebox at a model directory that contains config.json") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw
