"""Plain decoding one step ahead: the next step is queued before the host reads a token.

A plain decoding step needs no decision of the host's: its input is the last step's token, which can stay
on the device (the argmax, or a draw with the device's generator) and be written into the next step's
input there. So on a GPU the host queues step t + 1 first and only then waits for token t: token t was
copied to pinned host memory and an event recorded right behind it, so the wait ends as soon as token t
is ready, while step t + 1 runs. The host's work of a token (the loop, stop checks, the runner's
bookkeeping, the launches) then overlaps the device's instead of adding to it. A stop (EOS) is seen one
step late: one step is computed for nothing, its cache entry past the kept ones (a prefill starts over).
Tokens and draws are those of `pick` on the device's logits: the argmax, or `inverse_cdf` of `torch_probs`
with the same generator (one uniform a step, as `sample` takes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
from torch import Tensor

from spechead.inference.phase_clock import PhaseClock
from spechead.inference.runner import TargetRunner
from spechead.inference.sampling import SamplingParams, inverse_cdf, torch_probs


def next_ids(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """The target's own next token of logits [1, V] as ids [1, 1] on their device: the argmax (greedy), or
    one draw of `torch_probs` (V when the probs hold no positive finite mass)."""
    if params.is_greedy:
        return logits.argmax(-1, keepdim=True)
    return inverse_cdf(torch_probs(logits, params), generator)


class HostReads:
    """Device tokens [1, 1] on their way to the host, at most two in flight: copied into pinned memory
    and read after an event recorded behind the copy (CUDA), or at once (elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.slots = torch.empty(2, dtype=torch.long, pin_memory=self.cuda)  # [2]
        self.events = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else None  # one a slot
        self.pending: deque[int] = deque()  # slots in flight, oldest first
        self.free = 0

    def push(self, ids: Tensor) -> None:
        slot, self.free = self.free, self.free ^ 1
        self.slots[slot].copy_(ids.view(()), non_blocking=self.cuda)
        if self.events is not None:
            self.events[slot].record()
        self.pending.append(slot)

    def pop(self) -> int:
        slot = self.pending.popleft()
        if self.events is not None:
            self.events[slot].synchronize()  # token t is on the host; the step queued after it may still run
        return int(self.slots[slot])


def plain_ahead(
    runner: TargetRunner,
    root: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    max_new_tokens: int,
    eos: set[int],
    clock: PhaseClock,
) -> Iterator[int]:
    """The prefill's token `root`, then each next token of plain decoding (one target step each) until an
    EOS or max_new_tokens of them, every step queued one ahead of the host's read (see the module). The
    runner holds the prompt; `root` is not in its cache yet."""
    device = runner.device
    ids = torch.full((1, 1), root, dtype=torch.long, device=device)  # [1, 1] each step's input
    parents = torch.full((1, 1), -1, dtype=torch.long, device=device)  # [1, 1]
    reads = HostReads(device)
    vocab = 0

    def queue() -> None:  # one step: its token on the device, on its way to the host, the next input
        nonlocal vocab
        logits, _ = runner.verify(ids, parents)  # [1, 1, V]
        runner.commit([0])
        drawn = next_ids(logits[0], params, generator)  # [1, 1]
        reads.push(drawn)
        vocab = logits.shape[-1]
        ids.copy_(drawn if params.is_greedy else drawn.clamp_(max=vocab - 1))  # (read as drawn: above)

    yield root
    steps = max_new_tokens - 1  # the prefill gave the first token
    if root in eos or steps <= 0:
        return
    queue()
    for step in range(1, steps + 1):
        clock.mark("other")
        if step < steps:  # the next step first (after an EOS: one computed for nothing)
            queue()
        token = reads.pop()
        clock.mark("verify")
        if token >= vocab:
            raise ValueError("cannot sample from probs without a positive finite mass (NaN or -inf logits)")
        yield token
        if token in eos:
            return
