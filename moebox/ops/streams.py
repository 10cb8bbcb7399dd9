"""`Branch`: a piece of a decode step that runs on a side CUDA stream, next to what follows it.

A decode step at batch 1-16 is a chain of small kernels, most of them too small to fill the GPU; some links of
the chain do not depend on each other (a block's shared expert and its routed experts; attention's key path,
which stores this step's keys and pools the compressors' entries, and its query path, whose product reads
40 MB of weights; an mHC site's post/comb coefficients, which only its hc_post needs, and the sub-block). On
two streams the small kernels of one run in the gaps of the other, and a CUDA graph captures both as parallel
branches. `MOEBOX_OVERLAP=0` runs everything on one stream (to measure the gain); `MOEBOX_OVERLAP=moe` (or
`attention`, `mhc`, `pack`, or a comma list) only the branches of those names.

Side streams have a higher priority than the main stream (for the branches and token counts `side_priority`
names), and a CUDA graph keeps it: stream capture copies a stream's priority into its kernel nodes, and torch
instantiates graphs with cudaGraphInstantiateFlagUseNodePriority. Why: in a batch-1 V4-Flash step (the twentieth
session's timeline, H200, PDL on) attention's key branch started its first product 13 us after the fork, as the main stream's wq_b
product (20 us) began its last programs, and the main stream then waited for the branch 12 us a CSA layer and 8 us
in the others (~0.43 ms a step); the shared expert's last product also started as the routed experts' down kernel
ended, after it. The block scheduler seems to hand free SM slots to the earlier-launched kernel's queued programs
first; with priority a branch's programs get them.
The switch is read as a branch picks its side stream (one stream per device, purpose and priority).

The tensors the branch reads from the main stream are passed as `reads`: the branch holds them until `join`.
The caching allocator hands a freed block to the next allocation on the stream that allocated it, so a tensor
that the caller drops (rebinding its name, say) while the branch still reads it would be overwritten by the
main stream's next tensors: in a CUDA graph, where both branches really run side by side, that is a wrong
result every replay (the tiny model's separate key projection did exactly that).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

_side_streams: dict[tuple[int, str, int], torch.cuda.Stream] = {}


def _switched_on(t: torch.Tensor, name: str) -> bool:
    """Whether the branch `name` on t's device may run on its side stream: CUDA tensors, and MOEBOX_OVERLAP
    (default 1) is 1 or a comma list that names the branch (0: none)."""
    value = os.environ.get("MOEBOX_OVERLAP", "1")
    return t.is_cuda and (value == "1" or name in value.split(","))


def side_priority(tokens: int, name: str = "") -> int:
    """The priority of the side stream of branch `name` for a step of `tokens` rows: -1 (lower numbers come
    first) for every branch but the shared expert's ("moe") at 2-7 tokens, which keeps the main stream's 0;
    MOEBOX_SIDE_PRIORITY=1 / 0: always / never -1, a comma list of branch names: -1 for those. Why: on the H200
    (V4-Flash, 4K context, twenty-second session) each branch alone gained or tied at batch 1, 2 and 16 (attention
    5.24 -> 5.16 ms at batch 1, 19.43 -> 19.02 at 16) except the shared expert's at batch 2 (6.75 -> 7.06: its
    products then run beside the main stream's and slow them; not understood further)."""
    value = os.environ.get("MOEBOX_SIDE_PRIORITY")
    if value is None:
        on = name != "moe" or tokens == 1 or tokens >= 8
    else:
        on = value == "1" or name in value.split(",")
    return -1 if on else 0


def _side_stream(device: torch.device, purpose: str, priority: int) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, purpose, priority) not in _side_streams:
        _side_streams[index, purpose, priority] = torch.cuda.Stream(index, priority=priority)
    return _side_streams[index, purpose, priority]


class Branch:
    """`with Branch(x, name, reads) as b:` runs its body on the side stream of x's device, after everything queued
    so far on the current stream; `b.join()` makes the current stream wait for the body's work. Entered again
    (`with b:`), the branch goes on after what the current stream queued since: a branch can start on what it
    needs first and wait for the rest only where it needs it. Off CUDA, with MOEBOX_OVERLAP=0 (or a list without
    `name`), or when `enabled` is false, the body runs in place and `join` does nothing. `purpose`: the side
    stream (one per purpose and device), so that branches of different kinds do not queue behind each other."""

    def __init__(self, t: torch.Tensor, name: str, reads: Sequence[torch.Tensor | None] = (),
                 enabled: bool = True, purpose: str = "branch") -> None:
        self.on = enabled and _switched_on(t, name)
        self._reads = reads if self.on else ()
        if self.on:
            self.main = torch.cuda.current_stream(t.device)
            self.side = _side_stream(t.device, purpose, side_priority(t.shape[0], name))

    def __enter__(self) -> Branch:
        if self.on:
            self.side.wait_stream(self.main)
            self._context = torch.cuda.stream(self.side)
            self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self._context.__exit__(*exc)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Add tensors that the body read (scratch allocated on the main stream) to those held until `join`."""
        if self.on:
            self._reads = (*self._reads, *tensors)

    def join(self) -> None:
        if self.on:
            self.main.wait_stream(self.side)
            self._reads = ()

