"""SpeculativeGenerator is lossless: greedy output equals plain greedy decoding token for token, and
sampled output follows the target's exact distribution, for every drafter and several tree shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from spechead.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead, MedusaConfig, MedusaHead
from spechead.inference.drafters.base import Draft
from spechead.inference.drafters.draft_model import DraftModelDrafter
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.generator import SpeculativeGenerator, TextStream
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree

from .distributions import sampling_tv


class OracleDrafter(RowDrafter):
    """Test drafter: proposes the reference continuation with corrupted tokens and wrong siblings."""

    def __init__(self, reference: list[int], vocab: int, depth: int, seed: int):
        self.reference, self.vocab, self.depth = reference, vocab, depth
        self.rng = torch.Generator().manual_seed(seed)
        self.done = 0  # reference tokens emitted so far (the root included)

    def start(self, prompt, hidden, root):
        self.done = 1

    def propose(self, root, sampling, generator):
        tokens, parents = [root], [-1]
        parent = 0
        for d in range(self.depth):
            i = self.done + d
            true = self.reference[i] if i < len(self.reference) else 0
            wrong = (true + 1 + int(torch.randint(0, self.vocab - 1, (1,), generator=self.rng))) % self.vocab
            first, second = (wrong, true) if torch.rand(1, generator=self.rng) < 0.3 else (true, wrong)
            if torch.rand(1, generator=self.rng) < 0.15:
                second = first = wrong  # a step where no sibling is right
            tokens += [first, second]
            parents += [parent, parent]
            parent = len(tokens) - 2 if first == true else len(tokens) - 1
        return Draft(TokenTree(torch.tensor(tokens), torch.tensor(parents)))

    def accept(self, tokens, hidden, next_root):
        self.done += len(tokens)


def plain_greedy(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Hugging Face greedy decoding: the reference every drafter must reproduce (on the model's device)."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(5, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def medusa_drafter(model, choices=None):
    cfg = model.config
    head = MedusaHead(
        MedusaConfig(
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_heads=3,
            target_num_layers=cfg.num_hidden_layers,
        )
    )
    head.init_from_lm_head_(model.lm_head.weight)
    return MedusaDrafter(head, choices)


def eagle_drafter(model, family: str, num_layers: int = 1, **options):
    """An EAGLE-1 or EAGLE-3 drafter with a random head of `num_layers` decoder layers (accepts little, but
    every code path runs)."""
    torch.manual_seed(0)
    if family == "eagle":
        head = EagleHead(EagleConfig.from_target(model.config, num_layers=num_layers))
    else:
        layers = model.config.num_hidden_layers
        fused = [1, layers // 2 + 1, layers]
        head = Eagle3Head(Eagle3Config.from_target(model.config, target_layers=fused, num_layers=num_layers))
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    return EagleDrafter(head.eval(), **options)


def drafters(model, reference, seed):
    yield "plain", None
    yield "prompt_lookup", PromptLookupDrafter(num_draft=4)
    yield "medusa_default", medusa_drafter(model)
    yield "medusa_chain", medusa_drafter(model, [[0], [0, 0], [0, 0, 0]])
    yield (
        "draft_model_self",
        DraftModelDrafter(model, num_draft=4),
    )  # drafts the target's own argmax: all accepted
    yield "oracle_deep", OracleDrafter(reference, model.config.vocab_size, depth=6, seed=seed)
    yield "eagle_dynamic", eagle_drafter(model, "eagle", top_k=4, depth=4, total_tokens=12)
    yield "eagle3_static", eagle_drafter(model, "eagle3", tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])


def test_greedy_equals_plain_decoding(setup):
    model, tok = setup
    for i, prompt in enumerate(prompts(20, model.config.vocab_size)):
        n = 12 + i % 7
        reference = plain_greedy(model, prompt, n, eos=tok.eos_token_id)  # stops at EOS like ours
        for name, drafter in drafters(model, reference, seed=i):
            result = SpeculativeGenerator(model, tok, drafter).generate(input_ids=prompt, max_new_tokens=n)
            assert result.token_ids == reference, f"{name} on prompt {i}"
            assert result.stats.new_tokens == len(reference)
            if name == "draft_model_self":  # the target drafting for itself: every path accepted whole
                assert set(result.stats.accept_lengths[:-1]) <= {5}  # 4 drafts + 1; the last pass may be cut


@pytest.mark.parametrize("compile", [False, "graphs"])
def test_greedy_accepted_on_the_device_equals_plain_decoding(setup, compile):
    """The accelerator's greedy path (`device_accept`: acceptance on the target's device, the path's
    tokens brought back with it, the tree never copied to the host) run on the CPU: the same code but
    for the pinned copies. compile="graphs": the fixed-shape passes, trees padded to buckets."""
    model, tok = setup
    for i, prompt in enumerate(prompts(6, model.config.vocab_size)):
        reference = plain_greedy(model, prompt, 24)
        eos = reference[9 + i % 5]  # an EOS inside a tree: generation stops at its first use
        stop = reference.index(eos)
        for name, drafter in drafters(model, reference, seed=i):
            gen = SpeculativeGenerator(model, tok, drafter, compile=compile)
            gen.device_accept, gen.eos = True, {eos}
            result = gen.generate(input_ids=prompt, max_new_tokens=24)
            assert result.token_ids == reference[: stop + 1], f"{name} on prompt {i}"


@pytest.mark.parametrize("compile", [False, "graphs"])
def test_greedy_through_matmul_attention_equals_plain_decoding(setup, compile, monkeypatch):
    """A target set to "spechead_matmul" (heads/attention.py: its tree passes attend as matmuls, its plain
    steps through sdpa) decodes greedily as plain decoding with sdpa: every drafter, eager and on the
    fixed-shape passes (a whole fixed-size cache behind the mask)."""
    from spechead.heads import attention

    model, tok = setup
    calls = []
    grouped = attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", lambda *a: calls.append(1) or grouped(*a))
    references = [plain_greedy(model, prompt, 16) for prompt in prompts(4, model.config.vocab_size)]
    before = model.config._attn_implementation
    model.set_attn_implementation(attention.MATMUL_NAME)
    try:
        for i, (prompt, reference) in enumerate(zip(prompts(4, model.config.vocab_size), references)):
            for name, drafter in drafters(model, reference, seed=i):
                result = SpeculativeGenerator(model, tok, drafter, compile=compile).generate(
                    input_ids=prompt, max_new_tokens=16
                )
                assert result.token_ids == reference, f"{name} on prompt {i}"
    finally:
        model.set_attn_implementation(before)
    assert calls  # the tree passes did run as matmuls


def test_greedy_equality_depends_on_tree_positions(positional):
    """Long prompts, deep branching trees (node index != depth): tree position ids past_len + depth are
    the only ones that reproduce greedy decoding (node index or an off-by-one breaks this test)."""
    model, tok = positional
    g = torch.Generator().manual_seed(0)
    for i, length in enumerate((8, 30, 50)):
        prompt = torch.randint(5, model.config.vocab_size, (length,), generator=g).tolist()
        reference = plain_greedy(model, prompt, 20)
        for name, drafter in (
            ("oracle_deep", OracleDrafter(reference, model.config.vocab_size, depth=6, seed=i)),
            ("eagle_dynamic", eagle_drafter(model, "eagle", top_k=4, depth=4, total_tokens=12)),
        ):
            gen = SpeculativeGenerator(model, tok, drafter)
            gen.eos = set()
            result = gen.generate(input_ids=prompt, max_new_tokens=20)
            assert result.token_ids == reference, f"{name} on a {length}-token prompt"
            if name == "oracle_deep":
                assert result.stats.tau > 2  # deep paths were accepted, through second siblings too


def test_greedy_stops_at_eos_inside_a_tree(setup):
    model, tok = setup
    for i, prompt in enumerate(prompts(8, model.config.vocab_size)):
        reference = plain_greedy(model, prompt, 30)
        eos = reference[5 + i % 4]  # pretend this token is EOS: generation must stop at its first use
        stop = reference.index(eos)
        for name, drafter in drafters(model, reference, seed=i):
            gen = SpeculativeGenerator(model, tok, drafter)
            gen.eos = {eos}  # (the reference ran without any EOS)
            result = gen.generate(input_ids=prompt, max_new_tokens=30)
            assert result.token_ids == reference[: stop + 1], f"{name} on prompt {i}"


def test_max_new_tokens_inside_a_tree(setup):
    model, tok = setup
    prompt = prompts(1, model.config.vocab_size)[0]
    reference = plain_greedy(model, prompt, 20)
    for n in (1, 2, 3, 5, 7):
        drafter = DraftModelDrafter(model, num_draft=4)  # accepts 4 + 1 per pass, so most n end mid-path
        gen = SpeculativeGenerator(model, tok, drafter)
        gen.eos = set()
        result = gen.generate(input_ids=prompt, max_new_tokens=n)
        assert result.token_ids == reference[:n]


def perturbed(model):
    """A draft model close to the target but not equal (q overlaps p without being p)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(
            0.004 * torch.randn(other.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
        )
    return other


PROMPT = [7, 9, 7, 9, 7]  # repetitive, so prompt lookup drafts too
PARAMS = SamplingParams(temperature=1.3, top_k=3)


def test_sampling_three_tokens_deep(setup):
    """Acceptance below the root (a child's own children, q rows of deeper nodes, leaf bonus)."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, DraftModelDrafter(perturbed(model), num_draft=3))
    tv = sampling_tv(gen, PROMPT, PARAMS, trials=3000, length=3)
    # 27 outcomes, 3000 samples: noise TV is about 0.04.
    assert tv < 0.09, f"TV {tv:.3f}"
    assert (
        sum(
            gen.generate(
                input_ids=PROMPT, max_new_tokens=3, temperature=1.3, top_k=3, seed=s
            ).stats.accepted_tokens
            for s in range(50)
        )
        > 25
    )


@pytest.mark.parametrize(
    "name", ["plain", "medusa", "draft_model", "draft_model_self", "prompt_lookup", "eagle3"]
)
def test_sampling_matches_the_target_distribution(setup, name):
    model, tok = setup
    drafter = {
        "plain": None,
        "medusa": medusa_drafter(model, [[0], [1], [0, 0], [2]]),
        "draft_model": DraftModelDrafter(perturbed(model), num_draft=2),  # rule B with q close to p
        "draft_model_self": DraftModelDrafter(model, num_draft=2),  # q == p: everything accepted
        "prompt_lookup": PromptLookupDrafter(num_draft=2),
        "eagle3": eagle_drafter(model, "eagle3", top_k=3, depth=2, total_tokens=6),
    }[name]
    tv = sampling_tv(SpeculativeGenerator(model, tok, drafter), PROMPT, PARAMS, trials=1500)
    # 9 outcomes, 1500 samples: sampling noise gives TV around 0.03; a biased rule is far above.
    assert tv < 0.07, f"{name}: TV {tv:.3f}"


@pytest.mark.parametrize("name", ["medusa", "eagle3"])
def test_sampling_accepted_on_the_device_matches_the_target_distribution(setup, name, monkeypatch):
    """The accelerator's sampling path (`device_accept`) run on the CPU: rule A over top-k children as
    batched tensor ops over every node's probs (the walk is never called)."""
    import spechead.inference.engine.accept as accept_module

    def no_walk(*args, **kwargs):
        raise AssertionError("the host walk ran on the device path")

    monkeypatch.setattr(accept_module, "sample_accept", no_walk)
    model, tok = setup
    drafter = {
        "medusa": medusa_drafter(model, [[0], [1], [0, 0], [2]]),
        "eagle3": eagle_drafter(model, "eagle3", top_k=3, depth=2, total_tokens=6),
    }[name]
    gen = SpeculativeGenerator(model, tok, drafter)
    gen.device_accept = True
    tv = sampling_tv(gen, PROMPT, PARAMS, trials=1500)
    assert tv < 0.07, f"{name}: TV {tv:.3f}"


SAMPLED = {"temperature": 1.3, "top_k": 3}


def test_sampling_accepted_on_the_device_through_fixed_shape_passes(setup):
    """compile="graphs" (the fixed-shape passes, trees padded to buckets, eager on a CPU) with the device
    acceptance: the same seeds draw the same tokens as the eager passes (the rows it reads are unpadded)."""
    model, tok = setup
    outputs = []
    for compile in (False, "graphs"):
        drafter = eagle_drafter(model, "eagle3", tree=[[0], [1], [0, 0], [0, 0, 0]])
        gen = SpeculativeGenerator(model, tok, drafter, cache="static", compile=compile)
        gen.device_accept, gen.eos = True, set()
        outputs.append(
            [gen.generate(input_ids=PROMPT, max_new_tokens=16, seed=s, **SAMPLED).token_ids for s in range(4)]
        )
    assert outputs[0] == outputs[1]


def test_bad_generation_arguments(setup):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None)
    cases = [
        (dict(input_ids=[]), "^the prompt is empty"),  # (one prompt: no "row 0:" in front)
        (dict(input_ids=[5], max_new_tokens=0), "^max_new_tokens"),
        (dict(input_ids=[5], temperature=-1.0), "temperature"),
        (dict(input_ids=[5], top_p=0.0), "top_p"),
        (dict(input_ids=[5], top_p=1.5), "top_p"),
        (dict(input_ids=[5] * 500, max_new_tokens=20), "^prompt .* context"),
        (dict(), "exactly one of prompt="),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            gen.generate(**kwargs)


def test_head_for_another_target_is_refused(setup):
    model, tok = setup
    head = MedusaHead(MedusaConfig(hidden_size=48, vocab_size=model.config.vocab_size, num_heads=2))
    with pytest.raises(ValueError, match="hidden_size 48"):
        SpeculativeGenerator(model, tok, MedusaDrafter(head))


def test_stream_yields_the_same_text(setup):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, PromptLookupDrafter())
    prompt = "What is the capital of France?"
    text = "".join(gen.stream(prompt, max_new_tokens=15))
    assert text == gen.generate(prompt, max_new_tokens=15).text
    assert gen.last_stats.new_tokens == 15


class GradProbe(PromptLookupDrafter):
    """Records the grad and inference modes whenever the loop asked for a draft."""

    def __init__(self, modes: list[tuple[bool, bool]]) -> None:
        super().__init__(num_draft=4)
        self.record = modes.append  # (grad on, inference mode on) per propose; kept by the rows' deep copies

    def propose(self, root, sampling, generator):
        self.record((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return super().propose(root, sampling, generator)


def test_decoding_runs_in_inference_mode_and_leaves_the_callers_mode(setup):
    """generate (one prompt or a batch) enters inference mode once around its loop, stream around each of
    its steps: the loop never builds a graph nor counts versions, and the caller's mode holds after
    generate and between stream's pieces."""
    model, tok = setup
    modes: list[tuple[bool, bool]] = []
    gen = SpeculativeGenerator(model, tok, GradProbe(modes))
    prompt = "What is the capital of France?"
    with torch.enable_grad():
        gen.generate(prompt, max_new_tokens=12)
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        for _ in gen.stream(prompt, max_new_tokens=12):
            assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()  # the consumer's own
        single = len(modes)
        gen.generate_batch([prompt, "hello"], max_new_tokens=8)
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        assert len(modes) > single + 2
    assert single > 4 and set(modes) == {(False, True)}


class TopChildrenClaimingIid(DraftModelDrafter):
    """A deliberately WRONG drafter: argmax children verified with q-ratios as if sampled from q."""

    def propose(self, root, sampling, generator):
        sampled = super().propose(root, sampling, generator)  # q: the draft model's real distributions
        top = sampled.q.argmax(-1)  # [N]: the children are the argmax, not samples from q
        tokens = torch.cat([sampled.tree.tokens[:1], top[:-1]])
        return Draft(TokenTree(tokens, sampled.tree.parents), rule="iid", q=sampled.q)


def test_a_wrong_rule_fails_the_distribution_check(setup):
    """The check above has teeth: q-ratios on deterministic (argmax) children are biased (TV 0.65 at 500
    samples, where the noise is about 0.05: far above the bar)."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, TopChildrenClaimingIid(perturbed(model), num_draft=2))
    tv = sampling_tv(gen, PROMPT, PARAMS, trials=500)
    assert tv > 0.1, f"the wrong rule went unnoticed (TV {tv:.3f})"


def test_pieces_join_to_the_text_without_half_characters(chatml_tokenizer):
    tok = chatml_tokenizer
    ids = tok("naïve café ✓ 東京 done", add_special_tokens=False)["input_ids"]
    whole = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" in "".join(tok.decode(ids[:i]) for i in range(1, len(ids)))  # some ids split a character
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == whole
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") > 1  # held back while a character was incomplete (and at the flush)


def test_flush_hands_out_what_is_held_back(chatml_tokenizer):
    tok = chatml_tokenizer
    ids = tok("ok ✓", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok)
    shown = stream.push(ids[:-1])  # the check mark's last byte is missing
    assert "\ufffd" not in shown
    # the end as decoded, replacement character and all
    assert shown + stream.flush() == tok.decode(ids[:-1])
    assert TextStream(None).push([1, 2]) == ""  # no tokenizer: ids only, no text


def test_each_new_character_comes_out_at_once(chatml_tokenizer):
    """A push that completes text hands all of it out then, down to a single new character (nothing
    waits for the flush but a partial character)."""
    tok = chatml_tokenizer
    stream = TextStream(tok)
    for i in tok("a b c ✓ x", add_special_tokens=False)["input_ids"]:
        shown = stream.shown
        text = tok.decode(stream.ids + [i], skip_special_tokens=True)
        piece = stream.push([i])
        if not text.endswith("\ufffd"):
            assert shown + piece == text  # everything decoded so far is out
    assert stream.flush() == ""
