"""Speculative decoding settings and the draft head they name, checked before any weight is read.

Users know vLLM's spelling, `--speculative-config '{"method": "deepseek_mtp", "model": DIR,
"num_speculative_tokens": k}'`, so moebox takes the same dict. The head comes from the main checkpoint's
`mtp.0.*` or from `model` (a standalone MTP-head directory sharing the main model's embedding and head). A head
moebox cannot run (DSpark), a missing one, or one whose shapes do not fit the main model is one clear error at
start that says what was found and what to do instead; never a KeyError halfway through loading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from moebox.errors import MoeboxError
from moebox.weights.checkpoint import Checkpoint
from moebox.weights.schema import official_schema

METHODS = ("deepseek_mtp", "mtp")
MAX_SPECULATIVE_TOKENS = 8
OPTIONS = ("run without speculation (leave out the speculative config), or set \"model\" to a directory with a "
           "compatible 1-layer MTP head (mtp.0.* tensors, as in the original DeepSeek-V4-Flash release)")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "deepseek_mtp"
    model: str | None = None
    num_speculative_tokens: int = 1

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> "SpeculativeConfig":
        """From the JSON text of --speculative-config or the same dict; errors name the key and the fix."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise MoeboxError(f"--speculative-config: invalid JSON ({e.msg} at column {e.colno}); e.g. "
                                  f"'{{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 2}}'") from None
        if not isinstance(value, dict):
            raise MoeboxError("--speculative-config: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise MoeboxError(f"--speculative-config: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
        spec = cls(**value)
        if spec.method not in METHODS:
            raise MoeboxError(f"--speculative-config: method {spec.method!r} is not supported; moebox drafts with "
                              f"DeepSeek's MTP head: \"deepseek_mtp\"")
        k = spec.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise MoeboxError(f"--speculative-config: num_speculative_tokens must be an integer from 1 to "
                              f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        return spec


def draft_source(main: Checkpoint, spec: SpeculativeConfig) -> Checkpoint:
    """The checkpoint whose `mtp.0.*` tensors will draft, checked against the main model's shapes (headers only)."""
    src = main if spec.model is None else Checkpoint(Path(spec.model))
    head = src.draft_head
    if not head.runnable:
        raise MoeboxError(f"{src.dir}: found {head.evidence}; moebox drafts with MTP heads only. Options: {OPTIONS}")
    names = set(src.names())
    for name, want in official_schema(replace(main.config, num_mtp_layers=1)).items():
        if not name.startswith("mtp.0."):
            continue
        if name not in names:
            raise MoeboxError(f"{src.dir}: the MTP head is incomplete: {name} is missing. Options: {OPTIONS}")
        got = src.shape(name)
        if tuple(got) != tuple(want.shape):
            raise MoeboxError(f"{src.dir}: the MTP head does not match the main model {main.dir}: {name} is "
                              f"{list(got)}, the main model needs {list(want.shape)}. Options: {OPTIONS}")
    return src
