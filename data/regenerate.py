"""Self-distillation: replace a dataset's assistant turns by the target's own answers.

Draft heads trained on what the target itself writes accept more of its tokens at decoding time.
Every conversation keeps its system and user turns; each assistant turn is replaced by the target's
generation given the conversation so far (with the earlier answers already regenerated), rendered with
the tokenizer's chat template. Conversations are batched (left padding, Hugging Face `generate`).

Sampling draws every token from a generator seeded by (seed, conversation index, answer number), so an
answer does not depend on which conversations share its batch or where a run resumed; the only
remaining dependence is floating-point noise of different padding (bit-identical for the same batches).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import datasets
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spechead.data.chat import require_chat_template
from spechead.data.errors import DataError
from spechead.data.resumable_jsonl import EMPTY_DIGEST, ResumableJsonl, chain_digest

Messages = list[dict[str, str]]
TURN_POLICIES = ("all", "first")
# Config entries that vary with how a model was loaded or saved, not with what it computes.
VOLATILE_CONFIG = ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "use_cache")


@dataclass
class RegenerateSettings:
    """How the target answers. temperature 0 = greedy; top_k 0 and top_p 1 = off.

    turns: "all" replaces every assistant turn; "first" keeps the conversation up to its first answer
    and drops what follows. answer_last_user: a conversation ending with a user turn gets an answer
    appended (prompt-only data).
    """

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    batch_size: int = 8
    turns: str = "all"
    answer_last_user: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be at least 1"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"),
            (self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 = off)"),
            (self.batch_size >= 1, f"batch_size={self.batch_size} must be at least 1"),
            (self.turns in TURN_POLICIES, f"turns={self.turns!r} must be one of {list(TURN_POLICIES)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DataError(message)

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0

    def output_key(self) -> dict[str, Any]:
        """The settings that change the output (batch_size only changes float noise, not answers)."""
        key = asdict(self)
        del key["batch_size"]
        return key


@dataclass
class RegenerateStats:
    """Counts over the conversations processed so far."""

    conversations: int = 0
    answers: int = 0  # assistant turns written by the target
    new_tokens: int = 0  # tokens generated (stop tokens excluded)
    unfinished: int = 0  # answers cut by max_new_tokens or the context before an end-of-turn token
    cut: int = 0  # conversations ended early: a prompt left no room in the target's context

    def add(self, other: RegenerateStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"{self.conversations} conversations, {self.answers} answers, {self.new_tokens} tokens "
            f"({self.unfinished} answers hit max_new_tokens, {self.cut} conversations cut at the context)"
        )


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Ids that end an answer: the model's and tokenizer's eos, and the template's end-of-turn token."""
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids.update([value] if isinstance(value, int) else (value or []))
    require_chat_template(tokenizer)
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "xq7Answer"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template with its own role rules: the eos ids above must do
        text = ""
    # The first special token after an answer's text closes the turn (<|im_end|>, <|eot_id|>, ...).
    after = text.split("xq7Answer", 1)[-1] if "xq7Answer" in text else ""
    specials = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    closing = [t for t in tokenizer(after, add_special_tokens=False)["input_ids"] if t in specials]
    ids.update(closing[:1])
    if not ids:
        raise DataError("the tokenizer has no eos token and its chat template no end-of-turn token")
    return sorted(ids)


def answer_slots(messages: Messages, settings: RegenerateSettings) -> list[int]:
    """Indices of the turns the target (re)writes; len(messages) means "append an answer"."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if settings.answer_last_user and messages and messages[-1]["role"] == "user":
        slots.append(len(messages))
    return slots[:1] if settings.turns == "first" else slots


def conversation_seed(seed: int, index: int, answer: int) -> int:
    """The sampling seed of answer `answer` of conversation `index` (stable across runs and batches)."""
    digest = hashlib.sha256(f"{seed}:{index}:{answer}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class _SeededRowSampler(LogitsProcessor):
    """Samples each row with its own generator and leaves only that token, so greedy picks it."""

    def __init__(self, settings: RegenerateSettings, seeds: list[int], device: torch.device):
        warpers = [TemperatureLogitsWarper(settings.temperature)]
        if settings.top_k > 0:
            warpers.append(TopKLogitsWarper(settings.top_k))
        if settings.top_p < 1:
            warpers.append(TopPLogitsWarper(settings.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)  # (B, V)
        picks = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, picks[:, None], 0.0)  # (B, V)


class _RowBudget(StoppingCriteria):
    """Stops row b once it has generated budgets[b] tokens (the context limit of each prompt)."""

    def __init__(self, prompt_width: int, budgets: list[int], device: torch.device):
        self.prompt_width = prompt_width
        self.budgets = torch.tensor(budgets, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.budgets  # (B,) bool


@torch.no_grad()
def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    seeds: list[int],
    budgets: list[int],
    settings: RegenerateSettings,
    stop_ids: list[int],
) -> list[tuple[list[int], bool]]:
    """One batched `generate` over token-id prompts; per row (answer ids without the stop token, finished)."""
    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (B, T)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, T)
    config = GenerationConfig(
        max_new_tokens=max(budgets), do_sample=False, eos_token_id=stop_ids, pad_token_id=pad
    )
    processors = [_SeededRowSampler(settings, seeds, device)] if settings.do_sample else []
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        generation_config=config,
        logits_processor=LogitsProcessorList(processors),
        stopping_criteria=StoppingCriteriaList([_RowBudget(width, budgets, device)]),
    )  # (B, T + new)
    answers = []
    for row, budget in zip(out[:, width:].tolist(), budgets):
        row = row[:budget]
        stop = next((i for i, t in enumerate(row) if t in stop_ids), None)
        answers.append((row[:stop], True) if stop is not None else (row, False))
    return answers


def regenerate_conversations(
    model: Any,
    tokenizer: Any,
    conversations: list[Messages],
    first_index: int,
    settings: RegenerateSettings,
    stop_ids: list[int] | None = None,
) -> tuple[list[Messages], RegenerateStats]:
    """Regenerate one batch of conversations (dataset indices first_index, first_index + 1, ...).

    Answers are generated round by round: round r writes the r-th answer of every conversation that
    has one, in one batched `generate`, after the answers of earlier rounds are in place.
    """
    stop_ids = stop_ids or stop_token_ids(model, tokenizer)
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    slots = [answer_slots(c, settings) for c in conversations]
    out: list[Messages] = [[] for _ in conversations]
    copied = [0] * len(conversations)  # source turns consumed so far
    cut = [False] * len(conversations)
    stats = RegenerateStats(conversations=len(conversations))
    for r in range(max(map(len, slots), default=0)):
        rows, prompts, budgets = [], [], []
        for c, conv in enumerate(conversations):
            if r >= len(slots[c]) or cut[c]:
                continue
            out[c] += conv[copied[c] : slots[c][r]]
            copied[c] = slots[c][r] + 1
            ids = _render_prompt(tokenizer, out[c], first_index + c)
            budget = min(settings.max_new_tokens, context - len(ids)) if context else settings.max_new_tokens
            if budget < 1:  # the prompt fills the context: the conversation ends before this answer
                cut[c] = True
                stats.cut += 1
                continue
            rows.append(c)
            prompts.append(ids)
            budgets.append(budget)
        if not rows:
            continue
        seeds = [conversation_seed(settings.seed, first_index + c, r) for c in rows]
        answers = generate_answers(model, tokenizer, prompts, seeds, budgets, settings, stop_ids)
        for c, (tokens, finished) in zip(rows, answers):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            # A cut answer may end inside a multi-byte character: drop the undecodable tail.
            out[c].append({"role": "assistant", "content": text if finished else text.rstrip("\ufffd")})
            stats.answers += 1
            stats.new_tokens += len(tokens)
            stats.unfinished += not finished
    for c, conv in enumerate(conversations):
        if not cut[c] and not (settings.turns == "first" and slots[c]):
            out[c] += conv[copied[c] :]
    return out, stats


def _render_prompt(tokenizer: Any, messages: Messages, index: int) -> list[int]:
    """Token ids of `messages` plus the template's generation prompt."""
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    except Exception as e:  # jinja raise_exception(...) from the template, e.g. role-order rules
        roles = "/".join(m["role"] for m in messages)
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise DataError(
            f"conversation {index}: the chat template rejected roles {roles} ({reason}): fix the data or the template"
        ) from e


def run_key(target: str, config: Any, tokenizer: Any, dtype: str, data: dict, settings: RegenerateSettings):
    """What an output file depends on: target (path, config, chat template, dtype), data source, settings."""
    cfg = {k: v for k, v in config.to_dict().items() if k not in VOLATILE_CONFIG}
    return {
        "version": 1,
        "target": {
            "path": target,
            "config_sha256": _sha256(json.dumps(cfg, sort_keys=True, default=str)),
            "chat_template_sha256": _sha256(str(tokenizer.chat_template)),
            "dtype": dtype,
        },
        "data": data,
        "generation": settings.output_key(),
    }


def regenerate_into(
    writer: ResumableJsonl,
    model: Any,
    tokenizer: Any,
    conversations: datasets.Dataset | Sequence[Messages],
    settings: RegenerateSettings,
    *,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> RegenerateStats:
    """Regenerate conversations writer.rows .. limit-1 into `writer`, one fsynced chunk per batch.

    `conversations`: a Dataset with a `messages` column (see load_conversations) or a list of message
    lists. Checks that the rows already written came from the same first conversations. Returns the
    stats of every row in the file, earlier runs included; `progress(n)` after each batch.
    """
    total = len(conversations) if limit is None else min(limit, len(conversations))
    digest = _inputs_digest(conversations, writer.rows)
    if writer.info.get("inputs_sha256", EMPTY_DIGEST) != digest:
        raise DataError(
            f"the first {writer.rows} conversations of the data differ from those {writer.path} was "
            "written from: choose a new --out, or pass --overwrite to start over"
        )
    stats = RegenerateStats(**writer.info.get("stats", {}))
    stop_ids = stop_token_ids(model, tokenizer)
    for start in range(writer.rows, total, settings.batch_size):
        batch = _slice(conversations, start, min(start + settings.batch_size, total))
        out, batch_stats = regenerate_conversations(model, tokenizer, batch, start, settings, stop_ids)
        stats.add(batch_stats)
        for conv in batch:
            digest = chain_digest(digest, conv)
        writer.append([{"messages": m} for m in out], {"inputs_sha256": digest, "stats": asdict(stats)})
        if progress:
            progress(len(batch))
    return stats


def _slice(conversations: datasets.Dataset | Sequence[Messages], start: int, stop: int) -> list[Messages]:
    if isinstance(conversations, datasets.Dataset):
        return conversations[start:stop]["messages"]
    return [list(c) for c in conversations[start:stop]]


def _inputs_digest(conversations: datasets.Dataset | Sequence[Messages], rows: int) -> str:
    """chain_digest over the first `rows` conversations."""
    if rows > len(conversations):
        raise DataError(
            f"the output already has {rows} conversations but the data has only {len(conversations)}: "
            "choose a new --out, or pass --overwrite to start over"
        )
    digest = EMPTY_DIGEST
    for start in range(0, rows, 1000):
        for conv in _slice(conversations, start, min(start + 1000, rows)):
            digest = chain_digest(digest, conv)
    return digest


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
