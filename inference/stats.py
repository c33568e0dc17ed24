"""What a decode did: `GenerationStats` (tokens, passes, accept lengths, phase times), `GenerationResult`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

TAU = (
    "emitted tokens per target pass (accepted drafts + 1), POOLED over all passes: total tokens / total "
    "passes, as vLLM and SGLang count it (not a mean of per-prompt taus)"
)


def pooled_tau(accept_lengths: Sequence[int]) -> float:
    """tau (`TAU`) from each pass's accept length."""
    return sum(accept_lengths) / max(len(accept_lengths), 1)


@dataclass
class GenerationStats:
    """What one generate() call did."""

    drafted_tokens: int = 0
    # tokens each verification pass emitted (accepted drafts + 1, the last cut at EOS / max_new_tokens);
    # sum(accept_lengths) == new_tokens - 1 (the prefill emits the first token)
    accept_lengths: list[int] = field(default_factory=list)
    new_tokens: int = 0
    wall_time: float = 0.0
    prefill_time: float = 0.0  # the prompt's target pass
    draft_time: float = 0.0  # drafter propose + accept
    verify_time: float = 0.0  # target tree passes, acceptance and cache compaction

    def take_times(self, spent: dict[str, float]) -> None:
        """The times of a decode's phases, seconds by name (`PhaseClock.totals`), at its end."""
        self.prefill_time, self.draft_time, self.verify_time = (
            spent[k] for k in ("prefill", "draft", "verify")
        )
        self.wall_time = sum(spent.values())

    @property
    def target_passes(self) -> int:
        """Verification passes (the prefill not counted)."""
        return len(self.accept_lengths)

    @property
    def accepted_tokens(self) -> int:
        """Drafted tokens the target accepted."""
        return sum(self.accept_lengths) - len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return pooled_tau(self.accept_lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.wall_time, 1e-9)

    def as_dict(self) -> dict:
        """The derived numbers (tau, target_passes, accepted_tokens, tokens_per_s), then the fields."""
        derived = ("tau", "target_passes", "accepted_tokens", "tokens_per_s")
        return {**{k: getattr(self, k) for k in derived}, **asdict(self)}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids only
    stats: GenerationStats
