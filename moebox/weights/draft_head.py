"""Which speculative draft head a checkpoint carries, from its config keys and tensor names alone.

DeepSeek-V4-Flash ships a 1-layer MTP head (`mtp.0.*`: e_proj/h_proj, a sliding-window block, its own HC head).
The 0731 revision ships "DSpark" instead: stages `mtp.0..2` with `main_proj`/`main_norm`, a `markov_head` and a
`confidence_head`, and `dspark_*` config keys (deepseek_v4.md §5). moebox runs MTP heads only. A DSpark head must
never make the main model unusable (the reference setup crashes with a KeyError on `main_norm`): the checkpoint
opens without its head, and asking for speculation says what was found and what to do instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

DSPARK_TENSOR = re.compile(r"^mtp\.\d+\.(main_proj|main_norm|markov_head|confidence_head)(\.|$)")
MTP_TENSOR = re.compile(r"^mtp\.\d+\.")


@dataclass(frozen=True)
class DraftHead:
    kind: str          # "mtp", "dspark" or "none"
    evidence: str      # what was found, quoted in messages

    @property
    def runnable(self) -> bool:
        return self.kind == "mtp"


def inspect_draft_head(raw_config: dict[str, Any], tensor_names: Iterable[str]) -> DraftHead:
    """Classify the head of a checkpoint (official tensor names) by its config.json dict and tensor names."""
    names = sorted(n for n in tensor_names if MTP_TENSOR.match(n))
    dspark_keys = sorted(k for k in raw_config if k.startswith("dspark_"))
    dspark_tensors = [n for n in names if DSPARK_TENSOR.match(n)]
    if dspark_keys or dspark_tensors:
        found = [f"config keys {', '.join(dspark_keys)}"] if dspark_keys else []
        if dspark_tensors:
            more = f" and {len(dspark_tensors) - 2} more" if len(dspark_tensors) > 2 else ""
            found.append(f"tensors {', '.join(dspark_tensors[:2])}{more}")
        return DraftHead("dspark", "a DSpark speculative head (" + "; ".join(found) + ")")
    if names:
        stages = sorted({n.split(".")[1] for n in names}, key=int)
        return DraftHead("mtp", f"an MTP head ({len(stages)} layer(s), {len(names)} tensors)")
    return DraftHead("none", "no draft head (no mtp.* tensors)")
