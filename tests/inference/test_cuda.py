"""The same engine on CUDA (fp32 and bf16): skipped where there is no GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHead
from spechead.heads.fp8 import to_fp8
from spechead.inference.drafters.draft_model import DraftModelDrafter
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.generator import SpeculativeGenerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _drafters(model):
    cfg = model.config
    medusa = MedusaHead(MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=3,
                                     target_num_layers=cfg.num_hidden_layers))  # fmt: skip
    medusa.init_from_lm_head_(model.lm_head.weight)
    eagle = EagleHead(EagleConfig.from_target(cfg))
    for head in (medusa, eagle):
        head.to(model.device, model.dtype).attach_target_modules(
            lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
        )
    return {"medusa": MedusaDrafter(medusa), "eagle": EagleDrafter(eagle.eval(), top_k=4, depth=4, total_tokens=16),
            "self": DraftModelDrafter(model, num_draft=4)}  # fmt: skip


@pytest.mark.parametrize("compile", [False, "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_on_cuda_equals_plain_decoding_through_the_engine(
    tiny_llama, chatml_tokenizer, dtype, compile
):
    """Eager, and as from_pretrained decodes by default ("auto": "graphs" on CUDA, every drafter)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda", dtype)
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    for name, drafter in _drafters(model).items():
        gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile=compile)
        assert gen.compile == ("graphs" if compile else False)
        for i in range(5):
            prompt = list(range(5 + i, 15 + i))
            ref = plain.generate(input_ids=prompt, max_new_tokens=24).token_ids
            assert gen.generate(input_ids=prompt, max_new_tokens=24).token_ids == ref, f"{name} {dtype} {i}"


def test_seeded_sampling_runs_on_cuda(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    for drafter in _drafters(model).values():
        gen = SpeculativeGenerator(model, chatml_tokenizer, drafter)
        a = gen.generate(input_ids=[5, 6, 7], max_new_tokens=12, temperature=0.9, top_p=0.9, seed=3).token_ids
        assert (
            a
            == gen.generate(
                input_ids=[5, 6, 7], max_new_tokens=12, temperature=0.9, top_p=0.9, seed=3
            ).token_ids
        )


@pytest.mark.parametrize("compile", [False, "graphs"])
def test_plain_decoding_one_step_ahead_on_cuda(tiny_llama, chatml_tokenizer, compile):
    """CUDA's default plain decoding queues each step before reading the last token (engine/loop.py):
    greedy, Hugging Face's tokens; sampled, the token-by-token loop's draws for the same seed (the same
    ops on the device); an EOS stops both at the same token."""
    from .test_generator import plain_greedy

    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    model.generation_config.eos_token_id = None
    ahead = SpeculativeGenerator(model, chatml_tokenizer, None, compile=compile)
    stepwise = SpeculativeGenerator(model, chatml_tokenizer, None, compile=compile)
    stepwise.ahead = False
    assert ahead.ahead
    prompt = list(range(5, 17))
    full = plain_greedy(model, prompt, 30)
    assert ahead.generate(input_ids=prompt, max_new_tokens=30).token_ids == full
    for seed in range(3):
        kw = {"input_ids": prompt, "max_new_tokens": 30, "temperature": 0.9, "top_k": 20, "seed": seed}
        assert ahead.generate(**kw).token_ids == stepwise.generate(**kw).token_ids
    ahead.eos = stepwise.eos = {full[9]}
    stop = full.index(full[9]) + 1
    assert ahead.generate(input_ids=prompt, max_new_tokens=30).token_ids == full[:stop]
    assert stepwise.generate(input_ids=prompt, max_new_tokens=30).token_ids == full[:stop]


@pytest.mark.parametrize("compile", [False, "graphs"])
def test_plain_batch_decoding_one_step_ahead_on_cuda(tiny_llama, chatml_tokenizer, compile):
    """CUDA's default plain batch decoding queues each step before reading the last one's tokens
    (engine/loop.py): greedy rows equal Hugging Face's tokens with per-row max_new_tokens and a row
    stopping at an EOS; sampled rows draw what the token-by-token batch loop draws."""
    from .test_generator import plain_greedy

    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    model.generation_config.eos_token_id = None
    ahead = SpeculativeGenerator(model, chatml_tokenizer, None, compile=compile)
    stepwise = SpeculativeGenerator(model, chatml_tokenizer, None, compile=compile)
    stepwise.ahead = False
    prompts, max_new = [list(range(5, 17)), [40, 41], list(range(60, 90))], [30, 3, 21]
    ahead.eos = stepwise.eos = {plain_greedy(model, prompts[0], 30)[9]}
    out = ahead.generate_batch(input_ids=prompts, max_new_tokens=max_new)
    for b, (prompt, n) in enumerate(zip(prompts, max_new)):
        assert out[b].token_ids == plain_greedy(model, prompt, n, eos=next(iter(ahead.eos))), b
    kw = {"input_ids": prompts, "max_new_tokens": max_new, "temperature": 0.9, "top_k": 20, "seed": [1, 2, 3]}
    assert [r.token_ids for r in ahead.generate_batch(**kw)] == [
        r.token_ids for r in stepwise.generate_batch(**kw)
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ["medusa", "eagle"])
def test_load_time_calibration_measures_on_cuda(tiny_llama, chatml_tokenizer, name, compiled):
    """The tree calibration times the drafter with states on the target's device (a Medusa head on CUDA
    was once fed a CPU state here), eager or as CUDA graphs (what a compiled generator runs); the tree it
    picks decodes like plain decoding."""
    from spechead.inference.tuning.calibrate import EAGER, TimedAs, calibrated_choices

    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    drafter = _drafters(model)[name]
    accuracy = torch.tensor([[0.6, 0.2, 0.1, 0.05]] * 3)  # [depth, k]
    timed_as = TimedAs.of(model.device, True, None) if compiled else EAGER
    choices, info = calibrated_choices(model, drafter, accuracy, max_nodes=16, timed_as=timed_as)
    assert choices and info["step_ms"] > 0 and info["timed_as"]["draft"] == ("graphs" if compiled else False)
    if compiled:  # generate_batch's trees at 4 rows, timed as it compiles them (loading.drafter_for_batch)
        from spechead.inference.loading import drafter_for_batch

        _, batch_info = drafter_for_batch(model, drafter, accuracy, 4, True, None)
        assert batch_info["timed_as"] == info["timed_as"] and batch_info["in_situ"]["pass_ms"]
    tree = drafter.with_tree(choices)
    prompt = list(range(5, 15))
    ref = SpeculativeGenerator(model, chatml_tokenizer, None).generate(input_ids=prompt, max_new_tokens=16)
    out = SpeculativeGenerator(model, chatml_tokenizer, tree).generate(input_ids=prompt, max_new_tokens=16)
    assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("draft_compile", [None, "graphs"])
def test_fp8_drafting_on_cuda_equals_plain_decoding(tiny_llama, chatml_tokenizer, draft_compile):
    """The head's per-depth layers in FP8 (heads/fp8.py: torch._scaled_mm on the GPU), eager and as our
    CUDA graphs, bf16 target: greedy output equals plain decoding (inductor: gpu_checks' bench_gpu, on an FP8 GPU)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda", torch.bfloat16)
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    drafter = _drafters(model)["eagle"]
    assert to_fp8(drafter.head) > 0
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, draft_compile=draft_compile)
    for i in range(4):
        prompt = list(range(5 + i, 15 + 2 * i))
        ref = plain.generate(input_ids=prompt, max_new_tokens=24).token_ids
        assert gen.generate(input_ids=prompt, max_new_tokens=24).token_ids == ref, (draft_compile, i)


def test_stacked_fp8_layers_on_cuda_are_their_rows():
    """q/k/v stacked into one FP8 GEMM (heads/fp8.py) on the GPU: each layer's output as its own GEMM's,
    through `linears` and alone (its rows a view at an offset of the stack's e4m3 weight)."""
    from torch import nn

    from spechead.heads.fp8 import Fp8Linear, linears, stack_fp8

    torch.manual_seed(0)
    parent = nn.Module()
    for name, n in (("q_proj", 256), ("k_proj", 64), ("v_proj", 64)):
        setattr(parent, name, Fp8Linear(nn.Linear(512, n, dtype=torch.bfloat16)))
    parent = parent.to("cuda")
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    alone = [m(x) for m in (parent.q_proj, parent.k_proj, parent.v_proj)]
    assert stack_fp8(parent) == 1
    rows = [parent.q_proj, parent.k_proj, parent.v_proj]
    for out, own, ref in zip(linears(rows, x), [m(x) for m in rows], alone):
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)  # (another GEMM kernel may sum apart)
        torch.testing.assert_close(own, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("compile", "draft_compile"),
    [(True, None), (False, True), ("reduce-overhead", None), (False, "reduce-overhead"), ("graphs", None)],
)
def test_compiled_fast_path_on_cuda_equals_plain_decoding(
    tiny_llama, chatml_tokenizer, compile, draft_compile
):
    """The CUDA fast paths (True: inductor + our own captured CUDA graphs; "reduce-overhead": torch.compile's
    CUDA graphs; "graphs": the eager passes captured as our CUDA graphs, no compiler; all overwrite their
    outputs at every replay): the whole target + draft compiled, and the
    EAGLE draft alone as one graph beside the eager target, each decode greedily like plain eager decoding
    (static and EAGLE-2 dynamic trees; several prompts, so graphs replay at new committed lengths)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    eagle = _drafters(model)["eagle"]
    for drafter in (eagle, eagle.with_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])):
        gen = SpeculativeGenerator(
            model, chatml_tokenizer, drafter, compile=compile, draft_compile=draft_compile
        )
        for i in range(4):
            prompt = list(range(5 + i, 15 + 2 * i))
            ref = plain.generate(input_ids=prompt, max_new_tokens=24).token_ids
            assert gen.generate(input_ids=prompt, max_new_tokens=24).token_ids == ref, (compile, i)


def test_graphed_function_captures_once_and_replays_on_cuda():
    """A real capture: replays read each call's inputs, outputs are copies, a changed state recaptures
    (the graph read the old buffer by address)."""
    from spechead.inference.cuda_graphs import GraphedFunction

    held = {"buf": torch.ones(4, device="cuda"), "generation": 0}

    def fn(x, y):
        return x * held["buf"] + y, (x.sum(),)

    f = GraphedFunction(fn, state=lambda: held["generation"])
    a, (sa,) = f(torch.arange(4.0, device="cuda"), torch.ones(4, device="cuda"))
    b, (sb,) = f(torch.full((4,), 2.0, device="cuda"), torch.zeros(4, device="cuda"))  # a replay
    assert f.captures == 1 and a.tolist() == [1.0, 2.0, 3.0, 4.0] and sa.item() == 6.0
    assert b.tolist() == [2.0] * 4 and sb.item() == 8.0
    held.update(buf=torch.full((4,), 3.0, device="cuda"), generation=1)
    c, _ = f(torch.ones(4, device="cuda"), torch.zeros(4, device="cuda"))
    assert f.captures == 2 and c.tolist() == [3.0] * 4
    d, _ = f(torch.full((4,), 2.0, device="cuda"), torch.ones(4, device="cuda"))
    assert d.tolist() == [7.0] * 4 and a.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_failed_capture_is_one_line_and_cuda_works_after_it():
    """A host read inside a captured call (`.item()`): the first call runs, the capture fails in one line
    naming compile=False, and the device still runs, captures and replays afterwards."""
    from spechead.inference.cuda_graphs import GraphCaptureError, GraphedFunction

    def reads_the_host(x):
        return x * x.sum().item()

    f = GraphedFunction(reads_the_host)
    with pytest.raises(
        GraphCaptureError, match=r"reads_the_host runs but cannot be captured .*compile=False"
    ):
        f(torch.ones(4, device="cuda"))
    g = GraphedFunction(lambda x: x * 3)
    g(torch.ones(4, device="cuda"))
    assert g(torch.full((4,), 2.0, device="cuda")).tolist() == [6.0] * 4 and g.captures == 1
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8.0


def test_from_pretrained_on_cuda_decodes_as_graphs_by_default(tiny_target_dir):
    """compile's default ("auto") on CUDA: "graphs", calibrated as such; the same tokens as eager."""
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "prompt_lookup", device="cuda")
    eager = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), device="cuda", compile=False)
    assert gen.compile == "graphs" and eager.compile is False and gen.runner.static_shapes
    gen.eos = eager.eos = set()
    for prompt in (list(range(5, 25)) * 2, list(range(7, 19))):
        ref = eager.generate(input_ids=prompt, max_new_tokens=24).token_ids
        assert gen.generate(input_ids=prompt, max_new_tokens=24).token_ids == ref


def test_auto_falls_back_to_eager_on_cuda(tiny_target_dir, monkeypatch):
    """A target whose forward reads the host (a hook's `.item()`, as some MoE routers do) cannot be captured:
    with compile's default, from_pretrained warns and decodes it eagerly, as a plain eager load does."""
    from transformers import AutoModelForCausalLM

    from spechead.inference import loading

    class Reading:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            model = AutoModelForCausalLM.from_pretrained(*args, **kwargs)
            model.model.layers[0].register_forward_hook(lambda _m, _a, out: (out[0].sum().item(), None)[1])
            return model

    monkeypatch.setattr(loading, "AutoModelForCausalLM", Reading)
    with pytest.warns(RuntimeWarning, match=r"^compile='auto' decodes eagerly: .* cannot be captured"):
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "prompt_lookup", device="cuda")
    eager = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), device="cuda", compile=False)
    assert gen.compile is False
    gen.eos = eager.eos = set()
    prompt = list(range(5, 25)) * 2
    ref = eager.generate(input_ids=prompt, max_new_tokens=16).token_ids
    assert gen.generate(input_ids=prompt, max_new_tokens=16).token_ids == ref


def test_from_pretrained_on_cuda_loads_the_checkpoints_dtype_by_default(
    tiny_llama, chatml_tokenizer, tmp_path
):
    """dtype="auto" on CUDA: a bf16 checkpoint stays bf16 (on a CPU it would load as float32)."""
    tiny_llama(len(chatml_tokenizer), layers=1, hidden=32).to(torch.bfloat16).save_pretrained(tmp_path / "t")
    chatml_tokenizer.save_pretrained(tmp_path / "t")
    gen = SpeculativeGenerator.from_pretrained(str(tmp_path / "t"), device="cuda")
    assert gen.target.dtype == torch.bfloat16 and gen.target.device.type == "cuda"


def test_grouped_attention_keeps_fp32_scores_on_cuda():
    """bf16 inputs: the scores come out of one GEMM with an fp32 output (heads/attention.py `_scores`), so
    the result is about as close to the fp32 attention as sdpa's own bf16 kernel is (a bf16 product of
    the scores would round them)."""
    import torch.nn.functional as F

    from spechead.heads.attention import grouped_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = 3 * torch.randn(1, 32, 8, 128, device="cuda", generator=g)  # (B, nh, T, D): large scores
    k, v = (torch.randn(1, 8, 600, 128, device="cuda", generator=g) for _ in range(2))  # (B, kv, S, D)
    mask = torch.rand(1, 1, 8, 600, device="cuda", generator=g) > 0.2  # (B, 1, T, S)
    mask[..., 0] = True
    scale = 128**-0.5
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    low = [x.bfloat16() for x in (q, k, v)]
    ours = grouped_attention(*low, mask, scale).float()
    theirs = F.scaled_dot_product_attention(*low, attn_mask=mask, scale=scale, enable_gqa=True).float()
    # (rounded to bf16, scores of this size move by ~0.1 of a logit: errors of ~1e-1, far past this bound)
    assert (ours - ref).abs().max() <= 4 * (theirs - ref).abs().max() + 2e-3


def test_a_dead_generators_graphs_do_not_break_a_capture():
    """A collection during a capture that frees dead graphs invalidated it (an H200 run, 2026-11-28:
    calibration after other tests' generators; CUBLAS_STATUS_EXECUTION_FAILED). GraphedFunction pauses
    automatic collection for the capture: the captured call sees the collector off (the warm-up call sees
    it on). A captured graph in a dead cycle, dropped inside the capture with the first generation's
    threshold at 1, tries to reproduce the failure (whether a collection reaches it there depends on the
    generation it was promoted to)."""
    import gc

    from spechead.inference.cuda_graphs import GraphedFunction

    class Owner:  # a runner holding its graphed method: a cycle only the collector frees
        def __init__(self):
            self.graphed = GraphedFunction(self.step)

        def step(self, x):
            return x * 2

    held = [Owner()]
    held[0].graphed(torch.ones(4, device="cuda"))  # captured; dead once `held` drops it
    collecting = []

    def fn(x):
        collecting.append(gc.isenabled())
        if len(collecting) == 2:  # the capture: the graph's owner dies here
            held.clear()
        return sum([x + i for i in range(8)])  # lists: collections, where allowed

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        f = GraphedFunction(fn)
        f(torch.ones(4, device="cuda"))
        out = f(torch.zeros(4, device="cuda"))  # a replay of the graph captured above
    finally:
        gc.set_threshold(*threshold)
    assert collecting == [True, False] and f.captures == 1 and out.tolist() == [28.0] * 4


@pytest.mark.parametrize("compile", [True, "reduce-overhead", "graphs"])
@pytest.mark.parametrize("name", ["none", "medusa", "eagle"])
def test_compiled_batch_on_cuda_equals_batch1(tiny_llama, chatml_tokenizer, compile, name):
    """generate_batch with the target's batch passes compiled (target/graphs.py; our CUDA graphs and
    torch.compile's) and EAGLE's batch draft and accept too (drafters/eagle/graphs.py): rows of other
    lengths and budgets, twice (the second call replays the first's graphs at new lengths), each row
    equal to plain eager decoding."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    drafter = None if name == "none" else _drafters(model)[name]
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile=compile)
    prompts, budgets = [list(range(5, 15)), list(range(9, 12)), list(range(20, 38))], [24, 9, 17]
    for _ in range(2):
        out = gen.generate_batch(input_ids=prompts, max_new_tokens=budgets, tree_for_batch=False)
        for b, (prompt, n) in enumerate(zip(prompts, budgets)):
            assert out[b].token_ids == plain.generate(input_ids=prompt, max_new_tokens=n).token_ids, (name, b)
    if name == "eagle":
        assert type(gen.drafter._rows).__name__ == "GraphRows" and gen.drafter._rows is gen.drafter._graphs


@pytest.mark.parametrize("draft_compile", [None, "graphs", True])
def test_chunked_topk_on_cuda_drafts_the_trees_of_one_topk(tiny_llama, draft_compile):
    """A draft vocab past 20,000 on CUDA: the EAGLE drafter's default top-k ("auto", drafters/topk.py)
    searches 64-id chunks; eager, as our graphs and inductor's, its trees (every pass's) are one topk's and
    it decodes as plain decoding does."""
    model = tiny_llama(24000, layers=2, hidden=64, seed=1).to("cuda")
    head, trees = _drafters(model)["eagle"].head, {}  # (one head: `_drafters` makes new random ones)
    for chunk in ("auto", None):
        drafter = EagleDrafter(head, top_k=4, depth=4, total_tokens=16)
        drafter.topk_chunk = chunk
        gen = SpeculativeGenerator(model, None, drafter, draft_compile=draft_compile)
        trees[chunk] = []
        for name in ("propose", "propose_queued"):  # (read first, or queued behind the acceptance)
            _record_trees(drafter, name, trees[chunk])
        prompt = list(range(5, 25))
        out = gen.generate(input_ids=prompt, max_new_tokens=24)
        ref = SpeculativeGenerator(model, None, None).generate(input_ids=prompt, max_new_tokens=24)
        assert out.token_ids == ref.token_ids, (chunk, draft_compile)
    assert trees["auto"] == trees[None] and len(trees[None]) > 1


def _record_trees(drafter, name: str, trees: list) -> None:
    """Every batch of trees (tokens, parents) the drafter's method `name` returns is appended to `trees`."""
    call = getattr(drafter, name)

    def recorded(*args):
        draft = call(*args)
        trees.append((draft.tokens.tolist(), draft.parents.tolist()))
        return draft

    setattr(drafter, name, recorded)


@pytest.fixture(scope="module")
def parallel_setup(tiny_llama, chatml_tokenizer):
    """A target and its fitted P-EAGLE and DFlash heads (parallel_heads: fitted on the CPU), on CUDA."""
    from .drafters.parallel_heads import dflash_head, peagle_head
    from .test_batch import PROMPTS

    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    heads = {"peagle": peagle_head(model, PROMPTS), "dflash": dflash_head(model, PROMPTS)}
    model.to("cuda")
    return model, {name: head.to("cuda") for name, head in heads.items()}


@pytest.mark.parametrize("compile", [False, "auto"])
@pytest.mark.parametrize("kind", ["peagle_chain", "peagle_tree", "dflash_chain", "dflash_tree"])
def test_parallel_drafters_on_cuda_equal_plain_decoding(parallel_setup, chatml_tokenizer, kind, compile):
    """P-EAGLE and DFlash on CUDA, eager and as from_pretrained decodes by default ("auto": the target's
    passes and the block draft as our CUDA graphs, one draft ahead, the draft's buffers at the batch's
    capacity of rows): a batch of one and rows of mixed lengths and budgets, twice (the second call
    reuses the first's buffers and graphs), each row equal to plain decoding on CUDA."""
    from .drafters.parallel_heads import parallel_drafter
    from .test_batch import MAX_NEW, PROMPTS

    model, heads = parallel_setup
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    plain.eos = set()
    refs = [plain.generate(input_ids=p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    drafter = parallel_drafter(heads[kind.split("_")[0]], kind)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile=compile)
    gen.eos = set()
    assert gen.compile == ("graphs" if compile else False)
    assert gen.generate(input_ids=PROMPTS[2], max_new_tokens=MAX_NEW[2]).token_ids == refs[2], kind
    for _ in range(2):
        rows = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, tree_for_batch=False)
        assert [r.token_ids for r in rows] == refs, kind
    assert max(max(r.stats.accept_lengths) for r in rows) > 1  # (the fitted head accepts paths)
