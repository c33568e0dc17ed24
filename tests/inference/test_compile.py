"""Compiled decoding (compile=...): the target's fixed-shape passes (one graph per tree-size bucket; their
outputs against the eager ones: tests/inference/target/test_graphs.py) and the drafter's, output still
equal to plain greedy decoding; how "auto" resolves."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from spechead.inference import compiling as compiling_module
from spechead.inference import generator as generator_module
from spechead.inference import loading as loading_module
from spechead.inference.compiling import compile_option, resolve_compile
from spechead.inference.cuda_graphs import GraphCaptureError, GraphedFunction
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.eagle.rows import EagleRows
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.tree_inputs import rows_inputs
from spechead.inference.tree import path_to_node, tree_inputs_on_device

from . import test_generator as generator_tests  # the drafters, prompts and reference of the lossless tests
from .drafters.eagle import test_drafter as eagle_tests  # make_head, Stream, the static tree
from .tuning.test_calibrate import ACCURACY, saved_head

setup = generator_tests.setup  # the 2-layer target of the lossless tests (a module-scoped fixture)


def test_static_tree_inputs_are_the_dynamic_ones_padded_with_blocked_slots():
    """After device lengths (one per row): row b's mask is the dynamic one after lengths[b], blocked after."""
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 1, 0, 4]])  # [2, N]
    mask, pos, anc = rows_inputs(None, parents, torch.tensor([5, 2]), 16, torch.float32)  # [2, 1, N, 16]
    assert mask.shape == (2, 1, 6, 16)
    for b, past in enumerate((5, 2)):
        dyn_mask, dyn_pos, dyn_anc = tree_inputs_on_device(parents[b : b + 1], past, torch.float32)
        assert torch.equal(mask[b : b + 1, ..., : past + 6], dyn_mask)
        assert torch.equal(pos[b : b + 1], dyn_pos) and torch.equal(anc[b : b + 1], dyn_anc)
        assert (mask[b, ..., past + 6 :] == torch.finfo(torch.float32).min).all()


def test_the_dynamic_cache_is_refused_in_one_line(setup):
    model, tok = setup
    for compile in (False, "eager"):
        with pytest.raises(ValueError, match="cache='dynamic': the engine's one KV cache is preallocated"):
            SpeculativeGenerator(model, tok, None, cache="dynamic", compile=compile)


def test_compiled_greedy_equals_plain_decoding_with_one_graph_per_bucket(setup):
    """Traced by dynamo (backend "eager": the same graphs inductor would compile, without code generation)."""
    model, tok = setup
    torch._dynamo.reset()
    counters.clear()
    sizes = set()
    for i, prompt in enumerate(generator_tests.prompts(10, model.config.vocab_size)):
        n = 12 + i % 7
        reference = generator_tests.plain_greedy(model, prompt, n, eos=tok.eos_token_id)
        for name, drafter in generator_tests.drafters(model, reference, seed=i):
            gen = SpeculativeGenerator(model, tok, drafter, compile="eager")
            result = gen.generate(input_ids=prompt, max_new_tokens=n)
            assert result.token_ids == reference, f"{name} on prompt {i}"
            sizes.add(gen.runner.cache.max_length)
    # target: one graph per bucket the trees used (1..64), with and without hidden states; EAGLE heads:
    # one per frontier size (dynamic tree: 1 and top_k; static: per depth). Never one per length.
    assert sizes == {1024}
    assert 1 <= counters["stats"]["unique_graphs"] <= 24


def test_inductor_compiled_decoding_equals_eager(tiny_llama, chatml_tokenizer):
    """The real compiler on the CPU (small model: a few seconds per graph)."""
    model = tiny_llama(len(chatml_tokenizer), layers=1, hidden=32, seed=4)
    model.generation_config.eos_token_id = None
    torch._dynamo.reset()
    prompt = generator_tests.prompts(1, model.config.vocab_size)[0]
    reference = generator_tests.plain_greedy(model, prompt, 16)
    for drafter in (None, PromptLookupDrafter(num_draft=3)):
        gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile=True, buckets=(1, 4))
        gen.eos = set()
        assert gen.generate(input_ids=prompt, max_new_tokens=16).token_ids == reference
    # inductor's max-autotune mode (GEMMs benchmarked against generated kernels; about 7 s here)
    gen = SpeculativeGenerator(model, chatml_tokenizer, None, compile="max-autotune", buckets=(1, 4))
    gen.eos = set()
    assert gen.generate(input_ids=prompt, max_new_tokens=16).token_ids == reference


def test_graphs_mode_runs_the_fixed_shape_passes_without_a_compiler(setup):
    """compile="graphs": no torch.compile anywhere (on CUDA the raw passes are captured as our graphs; here
    they run eager with fixed shapes): greedy output equals plain decoding, batch 1 and batch 3."""
    model, tok = setup
    torch._dynamo.reset()
    counters.clear()
    prompts = generator_tests.prompts(3, model.config.vocab_size)
    for name, drafter in generator_tests.drafters(model, [], seed=0):
        if name == "oracle_deep":  # (drafts a given reference: none here)
            continue
        gen = SpeculativeGenerator(model, tok, drafter, compile="graphs")
        gen.eos = set()
        refs = [generator_tests.plain_greedy(model, p, 12) for p in prompts]
        assert [gen.generate(input_ids=p, max_new_tokens=12).token_ids for p in prompts] == refs, name
        assert gen.runner.static_shapes  # the fixed-shape passes
        if hasattr(drafter, "with_tree"):
            rows = gen.generate_batch(input_ids=prompts, max_new_tokens=12, tree_for_batch=False)
            assert [r.token_ids for r in rows] == refs, name
    assert counters["stats"]["unique_graphs"] == 0  # nothing traced, nothing compiled


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_compiled_eagle_drafting_proposes_the_eager_trees(kind, tree, tiny_llama) -> None:
    """The head's fixed-shape cache and whole-buffer draft masks (a batch of one's `GraphRows`): same trees
    as eager drafting, across accept cycles (a wrong committed or speculative column changes the head's
    top-k, and a dynamic tree's nodes are its best cumulative scores)."""
    target = tiny_llama(eagle_tests.V, layers=eagle_tests.L, hidden=eagle_tests.H).requires_grad_(False)
    head = eagle_tests.make_head(target, kind)
    opts = (
        {"tree": "dynamic", "top_k": 3, "depth": 4, "total_tokens": 12}
        if tree == "dynamic"
        else {"tree": eagle_tests.STATIC}
    )
    eager, compiled = EagleDrafter(head, **opts), EagleDrafter(head, **opts)
    compiled.use_compile("eager")
    torch._dynamo.reset()
    counters.clear()
    stream = eagle_tests.Stream(head, 7, seed=0)
    root, pick, accepted_sizes = 5, torch.Generator().manual_seed(1), set()
    for drafter in (eager, compiled):
        drafter.start([stream.tokens], [stream.states], [root])
    assert type(eager._rows) is EagleRows and compiled._rows is compiled._graphs is not None  # (B = 1)
    for _ in range(4):
        mine, ref = (
            compiled.propose([root], [SamplingParams()], [None]).tree(0),
            eager.propose([root], [SamplingParams()], [None]).tree(0),
        )
        assert torch.equal(mine.tokens, ref.tokens) and torch.equal(mine.parents, ref.parents)
        node = int(torch.randint(ref.size, (1,), generator=pick))
        accepted = ref.tokens[path_to_node(ref.parents, node)]
        accepted_sizes.add(accepted.numel())
        next_root = int(torch.randint(eagle_tests.V, (1,), generator=pick))
        hidden = stream.extend(torch.cat([torch.tensor([root]), accepted[1:]]))  # {l: [K, H]}
        states = {layer: h[None] for layer, h in hidden.items()}  # [1, K, H]: a batch of one
        for drafter in (eager, compiled):
            drafter.accept(accepted[None], [accepted.numel()], states, [next_root])
        root = next_root
    cache = compiled._graphs.cache
    assert cache is not None and cache.static_shapes and cache.max_length == 1024
    # the whole draft is ONE graph (fullgraph: no break), whatever the committed length; accepts: one
    # graph per padded size (a power of 2 >= K)
    assert counters["stats"]["unique_graphs"] == 1 + len({1 << (k - 1).bit_length() for k in accepted_sizes})


def test_draft_compile_compiles_the_drafter_only(tiny_llama, chatml_tokenizer) -> None:
    """draft_compile: the drafter's whole draft as a graph, the target's verify eager (the CPU's best)."""
    target = tiny_llama(eagle_tests.V, layers=eagle_tests.L, hidden=eagle_tests.H).requires_grad_(False)
    target.generation_config.eos_token_id = None
    head = eagle_tests.make_head(target, "eagle3")
    prompt = generator_tests.prompts(1, eagle_tests.V)[0]
    reference = generator_tests.plain_greedy(target, prompt, 14)
    torch._dynamo.reset()
    gen = SpeculativeGenerator(
        target, chatml_tokenizer, EagleDrafter(head, tree=eagle_tests.STATIC), draft_compile="eager"
    )
    gen.eos = set()
    assert gen.generate(input_ids=prompt, max_new_tokens=14).token_ids == reference
    assert gen.drafter._compile == "eager" and not gen.runner.static_shapes
    assert gen.drafter._rows is gen.drafter._graphs is not None  # it drafted as graphs
    both = SpeculativeGenerator(
        target, chatml_tokenizer, EagleDrafter(head, tree=eagle_tests.STATIC), compile="eager"
    )
    assert both.drafter._compile == "eager" and both.runner.static_shapes
    off = SpeculativeGenerator(
        target,
        chatml_tokenizer,
        EagleDrafter(head, tree=eagle_tests.STATIC),
        compile="eager",
        draft_compile=False,
    )
    assert off.drafter._compile is False and off.runner.static_shapes


def test_auto_compile_is_graphs_on_cuda_and_off_elsewhere():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile("auto", cpu) is False and resolve_compile("auto", cuda) == "graphs"
    for given in (False, True, "graphs", "max-autotune", "eager"):  # a value given is kept as it is
        assert resolve_compile(given, cuda) is given and resolve_compile(given, cpu) is given
    for bad in ("foo", "Graphs", 3):  # one line, before anything is loaded (the target path is not read)
        with pytest.raises(
            ValueError, match=r"^compile=.* is not a compile mode: use False \(eager\), True, auto"
        ):
            SpeculativeGenerator.from_pretrained("/no/such/target", compile=bad)
    with pytest.raises(ValueError, match=r"^draft_compile='x' is not a compile mode"):
        SpeculativeGenerator.from_pretrained("/no/such/target", draft_compile="x")
    words = ("off", "False", "none", "on", "true", "auto", "graphs", "reduce-overhead")
    assert [compile_option(w) for w in words] == [
        False,
        False,
        False,
        True,
        True,
        "auto",
        "graphs",
        "reduce-overhead",
    ]


def _as_on_cuda(compile, device):
    """resolve_compile as it decides for a target on CUDA (the passes then still run here, on a CPU)."""
    return resolve_compile(compile, torch.device("cuda"))


def test_a_generator_resolves_auto_for_its_targets_device(tiny_llama, chatml_tokenizer, monkeypatch):
    """compile="auto": eager on this CPU; where resolve_compile says "graphs" (CUDA), the target's fixed-shape
    passes and the drafter's graph are made and decode like plain decoding."""
    target = tiny_llama(eagle_tests.V, layers=eagle_tests.L, hidden=eagle_tests.H).requires_grad_(False)
    target.generation_config.eos_token_id = None
    head = eagle_tests.make_head(target, "eagle3")
    prompt = generator_tests.prompts(1, eagle_tests.V)[0]
    reference = generator_tests.plain_greedy(target, prompt, 14)
    here = SpeculativeGenerator(target, chatml_tokenizer, EagleDrafter(head), compile="auto")
    assert here.compile is False and not here.runner.static_shapes and here.drafter._compile is False
    monkeypatch.setattr(generator_module, "resolve_compile", _as_on_cuda)
    gen = SpeculativeGenerator(
        target, chatml_tokenizer, EagleDrafter(head, tree=eagle_tests.STATIC), compile="auto"
    )
    assert gen.compile == "graphs" and gen.draft_compile == "graphs"
    assert gen.runner.static_shapes and gen.drafter._compile == "graphs"
    gen.eos = set()
    assert gen.generate(input_ids=prompt, max_new_tokens=14).token_ids == reference
    assert gen.drafter._rows is gen.drafter._graphs is not None  # it drafted as graphs
    assert SpeculativeGenerator(target, chatml_tokenizer, None).compile is False  # the constructor's default
    alone = SpeculativeGenerator(
        target, chatml_tokenizer, EagleDrafter(head), compile=False, draft_compile="auto"
    )
    assert alone.draft_compile == "graphs" and alone.drafter._compile == "graphs"  # (CUDA's)


def test_from_pretrained_compiles_by_default_where_auto_says_so(tiny_target_dir, tmp_path, monkeypatch):
    """from_pretrained's default compile is "auto", resolved before calibration times the passes: eager on a
    CPU, "graphs" on CUDA (here as resolve_compile decides for CUDA); compile=False stays eager anywhere."""
    assert SpeculativeGenerator.from_pretrained(str(tiny_target_dir)).compile is False  # this CPU
    monkeypatch.setattr(loading_module, "resolve_compile", _as_on_cuda)
    monkeypatch.setattr(generator_module, "resolve_compile", _as_on_cuda)
    saved_head(tiny_target_dir, tmp_path / "head", ACCURACY)
    headed = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"))
    assert headed.compile == "graphs" and headed.calibration["timed_as"]["target"] == "graphs"
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "prompt_lookup")
    assert gen.compile == "graphs" and gen.runner.static_shapes
    plain = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), compile=False)
    assert plain.compile is False and not plain.runner.static_shapes
    gen.eos = plain.eos = set()
    prompt = list(range(5, 25)) * 2
    assert (
        gen.generate(input_ids=prompt, max_new_tokens=16).token_ids
        == plain.generate(input_ids=prompt, max_new_tokens=16).token_ids
    )


class _Uncapturable(GraphedFunction):
    """A graph whose capture fails as a CUDA capture of a host read does (the call itself runs)."""

    def _record(self, call, device):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_auto_falls_back_to_eager_when_its_graphs_cannot_be_captured(tiny_target_dir, tmp_path, monkeypatch):
    """from_pretrained proves the graphs "auto" chose on a short answer (and calibration times them): when
    a capture fails it warns once and decodes eagerly, calibrated eagerly; asked for explicitly, the same
    capture fails in one line (here every graph's capture fails, as on a GPU for a model that reads the host)."""
    monkeypatch.setattr(loading_module, "resolve_compile", _as_on_cuda)
    monkeypatch.setattr(generator_module, "resolve_compile", _as_on_cuda)
    monkeypatch.setattr(
        compiling_module,
        "compile_function",
        lambda fn, compile, cuda=False, fullgraph=False, state=None: _Uncapturable(fn, state),
    )
    why = r"^compile='auto' decodes eagerly: .* runs but cannot be captured as a CUDA graph \(RuntimeError: CUDA error"
    with pytest.warns(RuntimeWarning, match=why):
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "prompt_lookup")
    assert gen.compile is False and not gen.runner.static_shapes
    saved_head(tiny_target_dir, tmp_path / "head", ACCURACY)
    with pytest.warns(RuntimeWarning, match=why):
        headed = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"))
    assert headed.compile is False and headed.drafter._compile is False
    assert headed.calibration["timed_as"] == {"target": False, "draft": False}
    with pytest.warns(RuntimeWarning, match=why):  # not calibrated: the head's own drafter was compiled first
        uncalibrated = SpeculativeGenerator.from_pretrained(
            str(tiny_target_dir), str(tmp_path / "head"), calibrate=False
        )
    assert uncalibrated.drafter._compile is False
    plain = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), compile=False)
    prompt = list(range(5, 25)) * 2
    for g in (gen, headed, plain):
        g.eos = set()
    ref = plain.generate(input_ids=prompt, max_new_tokens=12).token_ids
    assert gen.generate(input_ids=prompt, max_new_tokens=12).token_ids == ref
    assert headed.generate(input_ids=prompt, max_new_tokens=12).token_ids == ref
    assert headed.drafter._graphs is None  # (it drafted eagerly)
    asked = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), compile="graphs")
    with pytest.raises(GraphCaptureError, match=r"compile=False"):
        asked.generate(input_ids=prompt, max_new_tokens=4)
