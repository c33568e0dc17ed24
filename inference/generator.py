"""SpeculativeGenerator: decode with a target and a drafter, one target pass per drafted tree.

Lossless by construction: greedy decoding keeps only drafts equal to the target's argmax; sampling
uses the rule that matches how the drafter chose its children (see acceptance.py), so the output
distribution is exactly the target's. The target's cache and hidden-state capture live in a
`TargetRunner` (runner.py): cache="static" (preallocated slots, the default) or "dynamic"
(DynamicCache). `generate`/`stream` decode one prompt; `generate_batch`/`stream_batch` decode B prompts
at once (batch_decode.py: one target forward per pass over every active row, static cache).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from spechead.inference.acceptance import Acceptance, greedy_accept_batch, greedy_walk, sample_accept
from spechead.inference.batch_decode import batch_cache_size, batch_passes, collect
from spechead.inference.batch_graphs import CompiledBatchRunner, kept_runner
from spechead.inference.compiling import resolve_compile
from spechead.inference.device_sampling import sample_accept_batch
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.ahead import Ahead, ahead_of
from spechead.inference.drafters.base import Drafter, chain, hears_verified
from spechead.inference.phase_clock import PhaseClock
from spechead.inference.plain_ahead import plain_ahead
from spechead.inference.runner import CUDA_BUCKETS, TargetRunner, check_tree_attention
from spechead.inference.sampling import (
    SamplingParams,
    TargetRows,
    argmax_ids,
    make_generator,
    pick,
    torch_probs,
)
from spechead.inference.spec_ahead import spec_ahead
from spechead.inference.stats import GenerationResult, GenerationStats
from spechead.inference.stops import eos_ids, until_stop
from spechead.inference.text_stream import TextStream
from spechead.inference.tree import TokenTree

# (target, drafter, accuracy [depth, k], batch, compile, draft_compile) -> (the drafter with the static tree
# measured best for `batch` rows on this device, or None when plain batched decoding pays best; what was
# measured), its parts timed as a generator with these compile settings runs them
BatchTreePicker = Callable[
    [PreTrainedModel, Drafter, torch.Tensor, int, "bool | str", "bool | str"], tuple[Drafter | None, dict]
]


@dataclass
class Plugins:
    """What the layer above the engine plugs into it. loading.py sets both when it is imported, which
    spechead.inference does (so before any generator exists): the engine imports neither that layer nor
    the tuning it wires in (tests/test_import_cycles.py)."""

    load: Callable[..., Any] | None = None  # `from_pretrained`: loading.load_generator
    batch_tree: BatchTreePicker | None = None  # a new generator's `batch_tree_picker` (tuning/batch_tree.py)


PLUGINS = Plugins()


class SpeculativeGenerator:
    """A frozen target, its tokenizer and a drafter (None = plain decoding through the same engine).

    cache: "static" (preallocated KV slots) or "dynamic" (DynamicCache); None = `default_cache`.
    max_cache_len: a fixed KV cache size (static), checked against prompt + max_new_tokens; None =
    sized per call. buckets: pad trees to these sizes (None: on CUDA only, where graphs reuse them).
    compile: torch.compile the target's verify pass with fixed shapes (static cache; True = inductor, on
    CUDA with CUDA graphs of our own (cuda_graphs.py); "max-autotune": the same, GEMMs autotuned by
    inductor; "graphs": no compiler, the eager passes captured as our CUDA graphs (ready in seconds);
    "reduce-overhead": torch.compile's CUDA graphs; or a
    torch.compile backend name), one graph per tree-size bucket (see runner.py),
    and the drafter's own steps (`Drafter.use_compile`: EAGLE's whole draft as one graph). "auto"
    (`from_pretrained`'s default): "graphs" on CUDA with the static cache, else False
    (compiling.resolve_compile); `self.compile` holds what it resolved to.
    draft_compile: compile the drafter only (same values as `compile`; None = as `compile`): on a CPU
    the target's eager forward is the faster verifier (a compiled one attends over the whole fixed-size
    cache), while the draft's many small ops per depth gain from one compiled graph.
    Batch decoding (`generate_batch`) compiles the target's batch passes likewise (batch_graphs.py:
    fixed rows, tree buckets) and, with the drafter compiled on CUDA, EAGLE's batch draft and accept
    (drafters/eagle_batch_graphs.py: fixed rows, one graph per pass); other batch drafters run eager.
    Without a drafter on CUDA, each plain step is queued before the last token is read (`plain_ahead`,
    plain_ahead.py); set the attribute False to read every token first. With a compiled EAGLE or a Medusa
    drafter on CUDA, each next draft is queued before the acceptance is read (`spec_ahead`: spec_ahead.py,
    and batch_spec_ahead.py for generate_batch); False reads it first.
    """

    default_cache = "static"

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer,
        drafter: Drafter | None = None,
        *,
        cache: str | None = None,
        max_cache_len: int | None = None,
        buckets: tuple[int, ...] | None = None,
        compile: bool | str = False,
        draft_compile: bool | str | None = None,
    ):
        check_tree_attention(target)  # (first: a hybrid target is refused before any drafter work)
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.drafter = drafter
        cfg = target.config.get_text_config()
        self.context = getattr(cfg, "max_position_embeddings", None)
        device = next(target.parameters()).device
        compile = resolve_compile(compile, device, cache or self.default_cache)
        if draft_compile is not None:  # ("auto" here: "graphs" on CUDA, else eager)
            draft_compile = resolve_compile(draft_compile, device)
        if drafter is not None:
            vocab = target.get_output_embeddings().weight.shape[0]
            drafter.check_target(cfg.hidden_size, vocab, cfg.num_hidden_layers)
            draft_compile = compile if draft_compile is None else draft_compile
            if draft_compile:
                drafter.use_compile(draft_compile)
        self.draft_compile = draft_compile or False  # (the trees picked per batch size compile likewise)
        self.eos = eos_ids(target, tokenizer)
        self.calibration: dict | None = None  # what from_pretrained measured to pick the tree, if it did
        self.draft_weights: str | None = None  # "int8" / "fp8": from_pretrained quantized the head's layers
        # accuracy [depth, k] of the head, when known: generate_batch re-picks the tree per batch size
        self.tree_accuracy: torch.Tensor | None = None
        # what measures that tree (tuning/batch_tree.py, plugged in by loading.py); None: the tree stays
        self.batch_tree_picker: BatchTreePicker | None = PLUGINS.batch_tree
        self.batch_calibration: dict[int, dict] = {}  # batch size -> what was measured, the tree chosen
        self._batch_drafters: dict[int, Drafter | None] = {}  # None: plain decoding pays best
        self.compile = compile
        self._batch_runners: dict[tuple, CompiledBatchRunner] = {}  # compiled: kept with their graphs
        self.last_stats: GenerationStats | None = None  # the last stream()'s, when it ran to the end
        self.last_batch_stats: list[GenerationStats] = []  # the last stream_batch()'s rows'
        if buckets is None and device.type == "cuda":
            buckets = CUDA_BUCKETS
        # greedy acceptance on the target's device, its result and the path's tokens in ONE transfer, the
        # pass's one wait for the device (an accelerator's default; a CPU walks host lists, cheaper there)
        self.device_accept = device.type != "cpu"
        # plain decoding queued one step ahead of the host's reads (plain_ahead.py): on CUDA, where the
        # host's work of a token then overlaps the step; a CPU runs both in turn, nothing to overlap
        self.plain_ahead = device.type == "cuda"
        # EAGLE (compiled) and Medusa on a compiled preallocated target: each next draft queued before the
        # host reads the acceptance (spec_ahead.py); on CUDA, where the host's work then overlaps the draft
        self.spec_ahead = device.type == "cuda"
        layers = tuple(drafter.hidden_layers) if drafter else ()
        self.runner = TargetRunner(
            target, layers, cache=cache or self.default_cache, max_length=max_cache_len, buckets=buckets,
            compile=compile,
        )  # fmt: skip

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> SpeculativeGenerator:
        """A generator from names: a target and a head, draft model or method (loading.load_generator,
        plugged in by the loading layer: `PLUGINS`)."""
        if PLUGINS.load is None:  # (spechead.inference imports loading.py, which plugs it in)
            raise RuntimeError("from_pretrained needs spechead.inference.loading imported")
        return PLUGINS.load(cls, *args, **kwargs)

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
        stats = GenerationStats()
        ids: list[int] = []
        prompt_ids = self._prompt_ids(prompt, messages, input_ids)
        params = SamplingParams(temperature, top_k, top_p, seed)
        with torch.inference_mode():  # once for the whole decode (`_decode` enters it again at every yield)
            for chunk in self._steps(prompt_ids, max_new_tokens, params, stats):
                ids.extend(chunk)
        return GenerationResult(self._text(ids), ids, stats)

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

        Give exactly one of prompts (strings), messages (one chat per row) or input_ids (one id list per
        row). max_new_tokens and seed: one value for all rows or one per row. Each row has its own tree,
        stop and (sampling) generator seeded with its seed, so result[b] equals
        `generate(<row b>, max_new_tokens=..., seed=seed[b])`: greedy token for token, sampling draw for
        draw. Static cache only (`max_cache_len` applies to every row); a row's stats carry its own
        tokens and passes, with the batch's wall/phase times. One row decodes through the
        single-sequence engine (`generate`'s, its fastest), not the batch loop.

        tree_for_batch: when the head's accuracy table is known (`tree_accuracy`, set by
        from_pretrained), the static tree is re-picked for this batch size by measuring this device
        (`batch_tree_picker`: tuning/batch_tree.py's, plugged in by loading.py; once per size;
        `batch_calibration` says what was measured).
        Greedy rows still equal batch 1 token for token; sampled rows are then exact samples of the
        target but not the batch-1 draws (another tree): pass False to keep the batch-1 tree and draws.
        """
        stats, passes = self._batch_passes(
            prompts, messages, input_ids, max_new_tokens, temperature, top_p, top_k, seed, tree_for_batch
        )
        out = collect(passes, len(stats))
        return [GenerationResult(self._text(o), o, s) for o, s in zip(out, stats)]

    def stream_batch(self, prompts: Sequence[str] | None = None, **kwargs) -> Iterator[tuple[int, str]]:
        """Yield (row, text) as each row's tokens are accepted: generate_batch one pass at a time (the same
        arguments; one target forward per pass over all active rows). Row b's pieces join to its
        generate_batch text; a row's pieces stop when it stops while the others go on. Afterwards
        `last_batch_stats` holds each row's GenerationStats."""
        given = inspect.signature(self.generate_batch).bind(prompts, **kwargs)  # (unknown names: TypeError)
        given.apply_defaults()
        stats, passes = self._batch_passes(**given.arguments)
        texts = [TextStream(self.tokenizer) for _ in stats]
        for emitted in passes:
            for b, ids in emitted:
                piece = texts[b].push(ids)
                if piece:
                    yield b, piece
        for b, text in enumerate(texts):
            piece = text.flush()  # whatever was held back for a partial character
            if piece:
                yield b, piece
        self.last_batch_stats = stats

    def _batch_passes(
        self, prompts, messages, input_ids, max_new_tokens, temperature, top_p, top_k, seed, tree_for_batch
    ) -> tuple[list[GenerationStats], Iterator[list[tuple[int, list[int]]]]]:
        """The rows' stats and the iterator of batch passes (batch_decode.batch_passes) for
        generate_batch / stream_batch's arguments, every row checked first (errors name the row)."""
        given = [x is not None for x in (prompts, messages, input_ids)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of prompts=, messages= or input_ids= (a list, one per row)")
        rows_in = next(x for x in (prompts, messages, input_ids) if x is not None)
        if isinstance(rows_in, str) or len(rows_in) == 0:
            raise ValueError("batch decoding takes a non-empty list of prompts (one per row)")
        if self.runner.kind != "static":
            raise ValueError(f"batch decoding needs cache='static', this generator uses {self.runner.kind!r}")
        batch = len(rows_in)
        ids = []
        for b, row in enumerate(rows_in):
            slot = 0 if prompts is not None else 1 if messages is not None else 2
            args: list[object] = [None, None, None]
            args[slot] = row
            try:
                ids.append(self._prompt_ids(*args))
            except ValueError as err:
                raise ValueError(f"row {b}: {err}") from None
        max_new = _per_row(max_new_tokens, batch, "max_new_tokens")
        seeds = _per_row(seed, batch, "seed")
        for b in range(batch):
            try:
                self._check_lengths(len(ids[b]), max_new[b])
            except ValueError as err:
                raise ValueError(f"row {b}: {err}") from None
        params = [SamplingParams(temperature, top_k, top_p, s) for s in seeds]
        stats = [GenerationStats() for _ in range(batch)]
        if batch == 1:  # one row: the single-sequence engine, this row's fastest (the same output)
            return stats, ([(0, chunk)] for chunk in self._decode(ids[0], max_new[0], params[0], stats[0]))
        drafter = self._drafter_for_batch(batch) if tree_for_batch else self.drafter
        runner = None
        need, fixed = max(len(i) + m for i, m in zip(ids, max_new)), self.runner.fixed_length
        if self.compile and (fixed is None or need <= fixed):  # (too small: batch_passes says so)
            # fixed shapes: the target's batch passes as compiled graphs (batch_graphs.py)
            size = fixed if fixed is not None else batch_cache_size(drafter, need, None, 1024)
            layers = tuple(drafter.hidden_layers) if drafter else ()
            runner = kept_runner(self._batch_runners, self.target, layers, batch, size, self.compile)
        passes = batch_passes(
            self.target, drafter, ids, max_new, params, self.eos, stats, fixed, runner, self.device_accept,
            self.plain_ahead, self.spec_ahead,
        )  # fmt: skip
        return stats, passes

    def _drafter_for_batch(self, batch: int) -> Drafter | None:
        """The drafter with the tree measured best for `batch` rows here, once per size (see generate_batch)."""
        drafter, accuracy, pick = self.drafter, self.tree_accuracy, self.batch_tree_picker
        if (
            batch == 1
            or drafter is None
            or accuracy is None
            or pick is None
            or not hasattr(drafter, "with_tree")
        ):
            return drafter
        if batch not in self.batch_calibration:  # (timed as decoded: this generator's compile settings)
            found = pick(self.target, drafter, accuracy, batch, self.compile, self.draft_compile)
            if found[0] is not None and self.draft_compile:
                found[0].use_compile(self.draft_compile)
            self._batch_drafters[batch], self.batch_calibration[batch] = found
        return self._batch_drafters[batch]

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[str]:
        """Yield text as tokens are accepted (same arguments as generate)."""
        stats = GenerationStats()
        params = SamplingParams(
            kwargs.pop("temperature", 0.0),
            kwargs.pop("top_k", 0),
            kwargs.pop("top_p", 1.0),
            kwargs.pop("seed", None),
        )
        max_new = kwargs.pop("max_new_tokens", 128)
        ids = self._prompt_ids(prompt, kwargs.pop("messages", None), kwargs.pop("input_ids", None))
        if kwargs:
            raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
        text = TextStream(self.tokenizer)
        for chunk in self._decode(ids, max_new, params, stats):
            piece = text.push(chunk)
            if piece:
                yield piece
        piece = text.flush()  # whatever was held back for a partial character
        if piece:
            yield piece
        self.last_stats = stats

    # ---- internals -------------------------------------------------------------------------------

    def _ahead(self, params: SamplingParams) -> Ahead | None:
        """The drafter's form for `spec_ahead` where it decodes: asked for (CUDA's default), accepted on
        the device, a drafter of top-k children that drafts from device tensors (drafters/ahead.py:
        compiled EAGLE, Medusa; greedy, or sampled by rule A) and a target that commits as a fixed-shape
        graph."""
        if not (self.spec_ahead and self.device_accept and self.runner.queues_commits):
            return None
        return ahead_of(self.drafter, params.is_greedy)

    def _prompt_ids(self, prompt, messages, input_ids) -> torch.Tensor:
        given = [x is not None for x in (prompt, messages, input_ids)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of prompt=, messages= or input_ids=")
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        elif prompt is not None:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        if len(ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        return torch.tensor(ids, dtype=torch.long)

    def _check_lengths(self, prompt_len: int, max_new_tokens: int) -> None:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if self.context and prompt_len + max_new_tokens > self.context:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                f"context of {self.context} tokens: shorten the prompt or lower max_new_tokens"
            )

    def _decode(
        self, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams, stats: GenerationStats
    ) -> Iterator[list[int]]:
        """`_steps` without gradients while it runs, the caller's grad mode between its yields (a
        stream's consumer runs there)."""
        return torch.inference_mode()(self._steps)(prompt, max_new_tokens, params, stats)

    def _steps(
        self, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams, stats: GenerationStats
    ) -> Iterator[list[int]]:
        """Yield lists of new token ids as they are accepted; fills `stats`. Runs with gradients off:
        `generate` turns them off once around it, `_decode` at every resume."""
        self._check_lengths(len(prompt), max_new_tokens)
        runner, drafter = self.runner, self.drafter
        runner.use_layers(tuple(drafter.hidden_layers) if drafter else ())  # (a drafter may be swapped in)
        runner.reserve(len(prompt), max_new_tokens, getattr(drafter, "max_nodes", 64))
        clock = PhaseClock(self.target.device)
        generator = make_generator(params.seed, self.target.device)  # multinomial needs it on the same device
        logits, hidden = runner.prefill(prompt[None])  # [1, V], {l: [1, T, H]}
        root = pick(logits[0], params, generator)
        if drafter:
            drafter.start(prompt, {k: v[0] for k, v in hidden.items()}, root)
        clock.mark("prefill")
        if drafter is None and self.plain_ahead:  # one step ahead, a pass per token after the root
            for token in plain_ahead(runner, root, params, generator, max_new_tokens, self.eos, clock):
                if stats.new_tokens:  # every token after the prefill's is one pass's
                    stats.accept_lengths.append(1)
                stats.new_tokens += 1
                yield [token]
            stats.take_times(clock.totals())
            return
        ahead = self._ahead(params)  # (None without a drafter)
        if drafter is not None and ahead is not None:  # the next draft queued before each read
            out = until_stop([root], self.eos, max_new_tokens)
            stats.new_tokens += len(out)
            yield out
            clock.mark("other")
            if out[-1] not in self.eos and stats.new_tokens < max_new_tokens:
                first = drafter.propose(root, params, generator).tree
                clock.mark("draft")
                yield from spec_ahead(
                    runner, ahead, root, first, params, generator, max_new_tokens, self.eos, clock, stats
                )
            stats.take_times(clock.totals())
            return
        pending = [root]  # tokens to emit
        # plain decoding's one-node tree and its [1, 1] views: made at its first step, then refilled
        plain: tuple[TokenTree, tuple[torch.Tensor, torch.Tensor]] | None = None
        accepted, checked = None, None  # what the drafter has yet to hear about (accept, verified)
        # whether the drafter reads the verified tree's logits (lookahead's Jacobi guesses; not EAGLE, Medusa)
        hears = drafter is not None and hears_verified(drafter)
        # the last tree's parents [N] (none before the first draft) and their [1, N] view (set with them)
        parents_of: torch.Tensor | None = None
        parents_in: torch.Tensor
        verified = False  # whether `pending` came from a verification pass (the prefill emits the first root)
        while True:
            out = until_stop(pending, self.eos, max_new_tokens - stats.new_tokens)
            stats.new_tokens += len(out)
            if verified:
                stats.accept_lengths.append(len(out))
            yield out
            if len(out) < len(pending) or out[-1] in self.eos or stats.new_tokens >= max_new_tokens:
                break
            clock.mark("other")
            if drafter and accepted is not None:  # only when decoding goes on (no wasted work at the end)
                if checked is not None:  # the whole tree's outputs first
                    drafter.verified(*checked)
                drafter.accept_path(*accepted)
            draft = drafter.propose(root, params, generator) if drafter else None
            if draft is None:  # plain decoding: the one-token inputs [1, 1] are made once and refilled
                if plain is None:
                    one = chain([], root)
                    plain = (one, (one.tokens[None], one.parents[None]))
                tree, inputs = plain
                tree.tokens.fill_(root)
                n = 1
            else:
                tree = draft.tree
                n, room = tree.size, runner.room()
                if room is not None and n > room:  # near a fixed cache's end: keep the first nodes
                    # (a tree's first nodes are a tree: lossless, fewer candidates)
                    tree, n = TokenTree.trusted(tree.tokens[:room], tree.parents[:room]), room
                if tree.parents is not parents_of:  # a static tree's parents repeat: the same [1, N] view
                    parents_of, parents_in = tree.parents, tree.parents[None]  # (a cache key for the runner)
                inputs = (tree.tokens[None], parents_in)  # [1, N] each
            clock.mark("draft")
            logits, hidden = runner.verify(*inputs)  # [1, N, V], {l: [1, N, H]}
            if n == 1:  # plain decoding (or an empty draft): the target's own next token
                acc = Acceptance([0], pick(logits.reshape(-1), params, generator), [root])  # [V]
            elif params.is_greedy and not self.device_accept:  # host = device: a list walk is cheapest
                # (greedy_accept's walk, without its shape checks or a [N, V] view: verify made both)
                acc = greedy_walk(tree.tokens.tolist(), tree.parents.tolist(), argmax_ids(logits)[0])
            elif self.device_accept and (
                params.is_greedy or draft is not None and draft.rule == "deterministic"
            ):
                # on an accelerator, on the device: greedy or rule A as batched tensor ops; the pass's ONE wait
                anc, parents = runner.last_ancestors, runner.last_parents  # [1, N, N], [1, N] there
                assert anc is not None and parents is not None  # verify just set them
                tokens = host_to_device(tree.tokens, anc.device)[None]  # (a drafter's GPU tree: itself)
                if params.is_greedy:
                    acc = greedy_accept_batch(tokens, parents, anc, logits)[0]
                else:  # every node's target probs [1, N, V]: on a GPU about the cost of one row
                    probs = torch_probs(logits, params)
                    acc = sample_accept_batch(tokens, parents, anc, probs, [generator])[0]
            else:
                rule, q = (draft.rule, draft.q) if draft else ("deterministic", None)
                q = q[:n] if q is not None else None  # [N, V]
                acc = sample_accept(tree, TargetRows(logits[0], params), rule, q, generator)  # [N, V]
            runner.commit(acc.path)
            verified = True
            clock.mark("verify")
            stats.drafted_tokens += n - 1
            root = acc.next_token
            if drafter is None:  # plain decoding: nothing to hand on
                pending = [root]
                continue
            host_ids = acc.path_tokens  # the path's tokens, read with the acceptance
            if host_ids is None:  # (a rule that did not read them: from the tree)
                host_ids = [int(t) for t in tree.tokens[acc.path].tolist()]
            pending = [*host_ids[1:], root]
            # the drafter takes the path's rows of the whole tree's states itself (drafters/base.py)
            accepted = (host_ids, hidden, acc.path, root)  # [K], {l: [1, N, H]}, [K]
            if hears:
                checked = (tree, logits[0])  # [N], [N, V]
        stats.take_times(clock.totals())


def _per_row(value, batch: int, name: str) -> list:
    """One value per row from a scalar or a list of length `batch` (ValueError otherwise)."""
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise ValueError(f"{name} has {len(value)} values for {batch} prompts")
        return list(value)
    return [value] * batch
