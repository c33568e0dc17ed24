"""SpeculativeGenerator: decode with a target and a drafter, one target pass per drafted tree.

Lossless: greedy keeps only drafts equal to the target's argmax; sampling verifies by the rule matching
how the drafter chose its children (acceptance.py), so the output follows the target's distribution
exactly. One prompt or B, all through the one engine (engine/loop.py).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from spechead.inference.compiling import resolve_compile
from spechead.inference.drafters.base import Drafter
from spechead.inference.drafters.per_row import RowDrafter, rows_drafter
from spechead.inference.engine.loop import Emitted, decode, depth_for
from spechead.inference.engine.rows import Row
from spechead.inference.phase_clock import PhaseClock
from spechead.inference.sampling import SamplingParams, make_generator
from spechead.inference.stats import GenerationResult, GenerationStats
from spechead.inference.stops import eos_ids
from spechead.inference.target.capture import check_tree_attention
from spechead.inference.target.runner import TargetRunner, batch_capacity

# (target, drafter, accuracy [depth, k], batch, compile, draft_compile) -> (the drafter with the tree timed
# best for `batch` rows here with these compile settings, None when plain decoding pays best; what was timed)
BatchTreePicker = Callable[
    [PreTrainedModel, Drafter | RowDrafter, torch.Tensor, int, "bool | str", "bool | str"],
    tuple[Drafter | RowDrafter | None, dict],
]


# What loading.py plugs in on import (spechead.inference imports it first), so the engine imports neither it
# nor tuning (tests/test_import_cycles.py): `from_pretrained`'s loader and the default `batch_tree_picker`.
LOAD: Callable[..., Any]
BATCH_TREE: BatchTreePicker | None = None


class SpeculativeGenerator:
    """A frozen target, its tokenizer and a drafter (None = plain decoding through the same engine).

    cache: "static" only (preallocated KV slots, a row per sequence). max_cache_len: a fixed KV cache
    size, checked against every row's prompt + max_new_tokens; None = sized per call. buckets: pad trees
    to these sizes (None: on CUDA only, where graphs reuse them). compile: the target's verify and commit
    as fixed-shape graphs and the drafter's steps (`compiling.compile_function`'s modes; "auto":
    `compiling.resolve_compile`'s). draft_compile: the drafter only (None = as `compile`): on a CPU the
    eager target verifies faster (a compiled one attends over the whole cache), the draft's many small
    ops gain from one graph. Attributes: `ahead` queues work before the host reads the device (the
    loop's depth; CUDA's default, where the host's work then overlaps the device's); `device_accept`
    accepts on the target's device (an accelerator's default; a CPU walks host lists, cheaper there).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer,
        drafter: Drafter | RowDrafter | None = None,
        *,
        cache: str | None = None,
        max_cache_len: int | None = None,
        buckets: tuple[int, ...] | None = None,
        compile: bool | str = False,
        draft_compile: bool | str | None = None,
    ):
        check_tree_attention(target)  # (first: a hybrid target is refused before any drafter work)
        if cache not in (None, "static"):
            raise ValueError(
                f"cache={cache!r}: the engine's one KV cache is preallocated, use cache='static'"
            )
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.drafter = drafter
        cfg = target.config.get_text_config()
        self.context = getattr(cfg, "max_position_embeddings", None)
        device = next(target.parameters()).device
        compile = resolve_compile(compile, device)
        draft_compile = compile if draft_compile is None else resolve_compile(draft_compile, device)
        if drafter is not None:
            vocab = target.get_output_embeddings().weight.shape[0]
            drafter.check_target(cfg.hidden_size, vocab, cfg.num_hidden_layers)
            if draft_compile:
                drafter.use_compile(draft_compile)
        self.draft_compile = draft_compile  # (the trees picked per batch size compile likewise)
        self.eos = eos_ids(target, tokenizer)
        self.calibration: dict | None = None  # what from_pretrained measured to pick the tree, if it did
        self.draft_weights: str | None = None  # "int8" / "fp8": from_pretrained quantized the head's layers
        self.tree_accuracy: torch.Tensor | None = None  # the head's [depth, k]: trees re-picked per batch
        self.batch_tree_picker: BatchTreePicker | None = BATCH_TREE  # None: the tree stays
        self.batch_calibration: dict[int, dict] = {}  # batch size -> what was measured, the tree chosen
        self._batch_drafters: dict[int, Drafter | RowDrafter | None] = {}  # None: plain decoding pays best
        self.compile = compile
        self.max_cache_len = max_cache_len
        # eager: every batch size's; compiled: a batch of one's (one more per row capacity in `_runners`)
        self.runner = TargetRunner(
            target,
            max_length=max_cache_len,
            buckets=buckets,
            compile=compile,
            capacity=1 if compile else None,
        )
        self._runners: dict[int, TargetRunner] = {}
        self.last_stats: GenerationStats | None = None  # the last stream()'s, when it ran to the end
        self.last_batch_stats: list[GenerationStats] = []  # the last stream_batch()'s rows'
        self.device_accept = device.type != "cpu"
        self.ahead = device.type == "cuda"

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> SpeculativeGenerator:
        """A generator from names: a target and a head, draft model or method (loading.load_generator,
        plugged in by the loading layer: `LOAD`)."""
        return LOAD(cls, *args, **kwargs)  # noqa: F821  (bound by loading.py's import)

    # ---- public API ------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        input_ids: list[int] | torch.Tensor | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> GenerationResult:
        """Generate from a prompt string, chat messages (chat template) or token ids (a generator without
        a tokenizer takes ids only and returns no text)."""
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        given = (prompt, messages, input_ids, max_new_tokens, seed)
        return self._results(*self._batch_passes(*given, one=True, **sampling))[0]

    def generate_batch(
        self,
        prompts: Sequence[str] | None = None,
        *,
        messages: Sequence[list[dict[str, str]]] | None = None,
        input_ids: Sequence[list[int] | torch.Tensor] | None = None,
        max_new_tokens: int | Sequence[int] = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | Sequence[int | None] | None = None,
        tree_for_batch: bool = True,
    ) -> list[GenerationResult]:
        """Generate for B prompts at once (one target forward per pass over all active rows).

        Give exactly one of prompts, messages (one chat per row) or input_ids (one id list per row);
        max_new_tokens and seed: one for all rows or one per row. Each row has its own tree, stop and
        generator seeded with its seed, so result[b] equals `generate(<row b>, seed=seed[b], ...)`: greedy
        token for token, sampling draw for draw. A row's stats: its own tokens and passes, the batch's times.

        tree_for_batch: with the head's accuracy known (`tree_accuracy`), re-pick the static tree for this
        batch size by measuring this device (`batch_tree_picker`, once per size; `batch_calibration`).
        Sampled rows are then exact samples but not the batch-1 draws: pass False to keep those.
        """
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        given = (prompts, messages, input_ids, max_new_tokens, seed, tree_for_batch)
        return self._results(*self._batch_passes(*given, **sampling))

    def stream_batch(self, prompts: Sequence[str] | None = None, **kwargs) -> Iterator[tuple[int, str]]:
        """Yield (row, text) as each row's tokens are accepted (generate_batch's arguments): row b's pieces
        join to its generate_batch text. Afterwards `last_batch_stats` holds each row's GenerationStats."""
        given = inspect.signature(self.generate_batch).bind(prompts, **kwargs)  # (unknown names: TypeError)
        given.apply_defaults()
        stats, passes = self._batch_passes(**given.arguments)
        yield from self._pieces(passes, len(stats))
        self.last_batch_stats = stats

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[str]:
        """Yield text as tokens are accepted (same arguments as generate); afterwards `last_stats` holds
        its GenerationStats."""
        given = inspect.signature(self.generate).bind(prompt, **kwargs)  # (unknown names: TypeError)
        given.apply_defaults()
        stats, passes = self._batch_passes(given.arguments.pop("prompt"), **given.arguments, one=True)
        yield from (piece for _, piece in self._pieces(passes, 1))
        self.last_stats = stats[0]

    # ---- internals -------------------------------------------------------------------------------

    def _results(self, stats: list[GenerationStats], passes: Iterator[Emitted]) -> list[GenerationResult]:
        """Each row's result once the passes ran out."""
        out: list[list[int]] = [[] for _ in stats]
        for emitted in passes:
            for b, ids in emitted:
                out[b].extend(ids)
        return [GenerationResult(text_of(self.tokenizer, o), o, s) for o, s in zip(out, stats)]

    def _pieces(self, passes: Iterator[Emitted], batch: int) -> Iterator[tuple[int, str]]:
        """(row, text) as the passes emit each row's tokens, never half a character; each row's held-back
        rest at the end."""
        texts = [TextStream(self.tokenizer) for _ in range(batch)]
        pushed = ((b, texts[b].push(ids)) for emitted in passes for b, ids in emitted)
        flushed = ((b, text.flush()) for b, text in enumerate(texts))  # what partial characters held back
        yield from ((b, piece) for b, piece in itertools.chain(pushed, flushed) if piece)

    def _batch_passes(
        self, prompts, messages, input_ids, max_new_tokens, seed, tree_for_batch=True, one=False, **sampling
    ) -> tuple[list[GenerationStats], Iterator[Emitted]]:
        """The rows' stats and the engine's passes for generate_batch's arguments, or generate's (`one`: a
        batch of one, its errors naming no row), every row checked first. The passes run without
        gradients, the caller's grad mode between their yields (a stream's consumer runs there)."""
        given = [x is not None for x in (prompts, messages, input_ids)]
        if sum(given) != 1:
            s, listed = ("", "") if one else ("s", " (a list, one per row)")
            raise ValueError(f"pass exactly one of prompt{s}=, messages= or input_ids={listed}")
        i = given.index(True)
        kind, rows_in = ("text", "chat", "ids")[i], (prompts, messages, input_ids)[i]
        if one:
            rows_in = [rows_in]
        elif isinstance(rows_in, str) or len(rows_in) == 0:
            raise ValueError("batch decoding takes a non-empty list of prompts (one per row)")
        batch = len(rows_in)
        max_new = _per_row(max_new_tokens, batch, "max_new_tokens")
        seeds = _per_row(seed, batch, "seed")
        ids = []
        for b, row in enumerate(rows_in):
            try:
                ids.append(self.prompt_ids(row, kind))
                if max_new[b] <= 0:
                    raise ValueError(f"max_new_tokens must be > 0, got {max_new[b]}")
                if self.context and len(ids[b]) + max_new[b] > self.context:
                    raise ValueError(
                        f"prompt ({len(ids[b])} tokens) + max_new_tokens ({max_new[b]}) exceeds the target's "
                        f"context of {self.context} tokens: shorten the prompt or lower max_new_tokens"
                    )
            except ValueError as err:
                raise ValueError(str(err) if one else f"row {b}: {err}") from None
        drafter, accuracy, pick = self.drafter, self.tree_accuracy, self.batch_tree_picker
        # the tree measured best for `batch` rows on this device, once per size (timed as decoded)
        if tree_for_batch and batch > 1 and drafter and drafter.tunes_tree and accuracy is not None and pick:
            if batch not in self.batch_calibration:
                found = pick(self.target, drafter, accuracy, batch, self.compile, self.draft_compile)
                if found[0] is not None and self.draft_compile:
                    found[0].use_compile(self.draft_compile)
                self._batch_drafters[batch], self.batch_calibration[batch] = found
            drafter = self._batch_drafters[batch]
        runner, device = self.runner, self.target.device
        if self.compile and batch > 1:
            capacity = batch_capacity(batch)
            runner = self._runners.get(capacity)  # type: ignore[assignment]
            if runner is None:
                runner = self._runners[capacity] = TargetRunner(
                    self.target, max_length=self.max_cache_len, buckets=self.runner.buckets or None,
                    compile=self.compile, capacity=capacity,
                )  # fmt: skip
        runner.use_layers(tuple(drafter.hidden_layers) if drafter else ())  # (a drafter may be swapped in)
        runner.reserve([len(p) for p in ids], max_new, drafter.max_nodes if drafter else 1)
        rows = [
            Row(b, ids[b], max_new[b], p, make_generator(p.seed, device), GenerationStats())
            for b, p in enumerate(SamplingParams(seed=s, **sampling) for s in seeds)
        ]
        rows_of = rows_drafter(drafter) if drafter is not None else None
        depth = depth_for(runner, rows_of, rows, self.ahead, self.device_accept)
        passes = decode(
            runner, rows_of, rows, self.eos, PhaseClock(device), depth=depth, on_device=self.device_accept
        )
        return [r.stats for r in rows], passes

    def prompt_ids(self, prompt, kind: str = "text") -> torch.Tensor:
        """A prompt's ids [T] as decoded: a string ("text"), chat messages ("chat": the template) or ids."""
        if kind == "chat":
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        elif kind == "text":
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if len(ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        return torch.tensor(ids, dtype=torch.long)


def _per_row(value, batch: int, name: str) -> list:
    """One value per row from a scalar or a list of length `batch` (ValueError otherwise)."""
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise ValueError(f"{name} has {len(value)} values for {batch} prompts")
        return list(value)
    return [value] * batch


class TextStream:
    """The text of one row's ids as they arrive, cut from the decoded text of ALL ids so far (a tokenizer
    spaces tokens in context), so the pieces join to `tokenizer.decode(all ids)`. A piece ending in U+FFFD
    waits: a character split over tokens decodes as that until its last byte arrives."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""  # the text handed out so far

    def push(self, ids: list[int]) -> str:
        """The new text after `ids` ('' while nothing new or a character is incomplete)."""
        self.ids.extend(ids)
        text = text_of(self.tokenizer, self.ids)
        return "" if text.endswith("\ufffd") else self._advance(text)

    def flush(self) -> str:
        """Whatever was held back (a partial character at the end shows as U+FFFD)."""
        return self._advance(text_of(self.tokenizer, self.ids))

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece


def text_of(tokenizer, ids: list[int]) -> str:
    """The text of ids, special tokens skipped ('' without a tokenizer)."""
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""
