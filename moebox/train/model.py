"""The trainable DeepSeek-V4: the inference model class over float parameters, and its training losses.

Training runs the same `DeepseekV4` code that serves (flat batches without a cache), so what is trained is what
is served: the weights are float `nn.Parameter`s under their official names, initialised like the synthetic
checkpoints (`moebox.weights.synth.initial_values`: activations O(1) through every layer), and exported later
in the official FP8/FP4 layout. Not learned: the hash-routing table (`tid2eid`, fixed at init as in DeepSeek's
design) and the routing bias (DeepSeek adjusts it by load, not by gradient; it stays at its initial value).
The MTP block gets the next-next-token loss: from the main model's final residual at t and token t+1 it predicts
token t+2. The lightning indexer gets no gradient from these losses (its top-k is a selection); DeepSeek trains
it with a KL loss towards the attention scores, which is not built yet.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from moebox.config import ModelConfig
from moebox.model.batch import FlatBatch
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.ops.fuse import fused
from moebox.weights.formats import fp4_round
from moebox.weights.schema import official_schema
from moebox.weights.synth import initial_values, tensor_generator

FROZEN = ("ffn.gate.tid2eid", "ffn.gate.bias")
_fp4_round = fused(fp4_round)


def init_params(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the official schema (MTP included) in fp32; learned ones as Parameters."""
    params: dict[str, torch.Tensor] = {}
    for name, spec in official_schema(cfg).items():
        value = initial_values(spec, cfg, tensor_generator(seed, name)).to(device)
        learned = value.is_floating_point() and not name.endswith(FROZEN)
        params[name] = torch.nn.Parameter(value) if learned else value
    return params


class FP4FakeQuant:
    """A routed expert's trainable weight seen through FP4 (QAT, `--expert-qat`): the forward multiplies by the
    values the export will write (`quant_fp4`, as `train.export` stores FP4 specs: e2m1 codes, one E8M0 scale per
    32 inputs; computed on the weight's device, not through the export's CPU copy), the backward passes the
    gradient straight through to the fp32 parameter. The real V4-Flash experts were trained on this grid, which
    the 2-bit planes are cut from (field_notes.md §3): a demo trained so is closer to what w2 meets in the real
    model. `linear` takes it like any stored format (it has `shape` and `dequantize`). The rounding is compiled
    on CUDA (`fp4_round`, no packing): as eager quant_fp4 + dequant_fp4 (~25 launches per expert matrix) a demo
    training step took twice as long as without QAT (0.91 against 0.47 s on the H200, eighth session); that
    the launches were the cause is not yet measured."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.param
        return (w + (_fp4_round(w.detach()) - w.detach())).to(dtype)


def trainable_model(cfg: ModelConfig, params: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                    expert_qat: bool = False) -> DeepseekV4:
    """The serving model over `params`; with `expert_qat` the tensors the export writes as FP4 (the routed
    experts) are seen through that rounding (FP4FakeQuant)."""
    schema = official_schema(cfg) if expert_qat else {}

    def get(name: str):
        p = params[name]
        return FP4FakeQuant(p) if expert_qat and schema[name].kind == "fp4" else p
    return DeepseekV4(cfg, get, qat=False, dtype=dtype, load_mtp=True)


def losses(model: DeepseekV4, sequences: Sequence[Sequence[int]], device: torch.device | str = "cpu"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP next-next-token loss), mean cross-entropy over all predicted positions of the
    sequences (each one a segment of one flat batch, from position 0)."""
    batch = FlatBatch.build([(i, 0, list(ids)) for i, ids in enumerate(sequences)], device)
    rows = torch.arange(batch.num_tokens, device=batch.tokens.device)
    out = model.forward(batch, None, logits_rows=rows)
    keep = torch.cat([torch.arange(s.offset, s.offset + s.length - 1) for s in batch.segments]).to(rows.device)
    main = F.cross_entropy(out.logits[keep], batch.tokens[keep + 1])
    # MTP: position t of each sequence sees hidden[t] and token t+1, and is scored on token t+2
    mtp_parts = [(i, 0, list(ids[1:-1])) for i, ids in enumerate(sequences) if len(ids) >= 3]
    mtp_batch = FlatBatch.build(mtp_parts, device)
    src = torch.cat([torch.arange(s.offset, s.offset + len(ids) - 2) for s, ids in zip(batch.segments, sequences)
                     if len(ids) >= 3]).to(rows.device)
    mtp = model.mtp_forward(out.hidden[src], mtp_batch, None,
                            logits_rows=torch.arange(mtp_batch.num_tokens, device=rows.device))
    return main, F.cross_entropy(mtp.logits, batch.tokens[src + 2])
