"""TargetRunner on a real tiny Llama, both cache back-ends: verified tree logits/hidden states equal the
plain root-to-node paths, commit leaves a cache equal to a plain run (slot copies included), padding
to buckets changes nothing, device masks equal the Python ones, hooks are installed once."""

from __future__ import annotations

import pytest
import torch

from spechead.heads.attention import NAME as TREE_SDPA
from spechead.inference.acceptance import greedy_accept, greedy_accept_batch
from spechead.inference.kv_cache import SlotCache
from spechead.inference.runner import TargetRunner, compile_function
from spechead.inference.sliding import SlidingLayout, sliding_layout
from spechead.inference.tree import (
    TokenTree,
    ancestor_mask,
    ancestors_on_device,
    depths,
    path_to_node,
    tree_attention_mask,
    tree_inputs_on_device,
)

VOCAB = 64
HIDDEN = (0, 2, -1)


@pytest.fixture(params=["eager", "sdpa", TREE_SDPA])
def model(request, tiny_llama):
    m = tiny_llama(VOCAB, layers=4, hidden=32, seed=0)
    m.set_attn_implementation(request.param)
    return m


def random_tree(n: int, seed: int) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, i - 3), i, (), generator=g)) for i in range(1, n)]
    return TokenTree(torch.randint(0, VOCAB, (n,), generator=g), torch.tensor(parents))


def plain(model, ids: list[int]):
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17, 40])
def test_device_tree_inputs_equal_python_ones(n):
    for seed in range(3):
        parents = random_tree(n, seed).parents
        anc = ancestors_on_device(parents[None])[0]
        assert torch.equal(anc, ancestor_mask(parents))
        mask, positions, _ = tree_inputs_on_device(parents[None], 7, torch.float32)
        assert torch.equal(mask, tree_attention_mask(parents, 7, torch.float32))
        assert torch.equal(positions[0], depths(parents) + 7)


def test_greedy_accept_batch_equals_greedy_accept():
    g = torch.Generator().manual_seed(0)
    for seed in range(30):
        tree = random_tree(1 + seed % 13, seed)
        logits = torch.randn(tree.size, 6, generator=g)
        tree = TokenTree(tree.tokens % 6, tree.parents)
        if seed % 2:  # make many nodes match their parent's argmax
            best = logits.argmax(-1)
            tree = TokenTree(torch.cat([tree.tokens[:1], best[tree.parents[1:]]]), tree.parents)
        anc = ancestors_on_device(tree.parents[None])
        got = greedy_accept_batch(tree.tokens[None], tree.parents[None], anc, logits[None])[0]
        assert got == greedy_accept(tree, logits)
        assert got.path_tokens == tree.tokens[got.path].tolist()  # brought back in the same transfer


@torch.no_grad()
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("buckets", [None, (4, 16, 64)])
def test_verify_equals_plain_paths_and_commit_equals_plain_run(model, cache, buckets):
    runner = TargetRunner(model, HIDDEN, cache=cache, buckets=buckets)
    runner.reserve(6, 40)
    seq = [3, 9, 27, 17, 51, 25]
    logits, hidden = runner.prefill(torch.tensor([seq]))
    ref_logits, ref_hidden = plain(model, seq)
    torch.testing.assert_close(logits[0], ref_logits[-1], atol=1e-5, rtol=0)
    for k in HIDDEN:
        torch.testing.assert_close(hidden[k][0], ref_hidden[k][0], atol=1e-5, rtol=0)
    for step, n in enumerate([12, 1, 7, 3, 12]):
        tree = random_tree(n, step)
        logits, hidden = runner.verify(tree.tokens[None], tree.parents[None])
        assert logits.shape == (1, n, VOCAB) and all(h.shape[:2] == (1, n) for h in hidden.values())
        for node in range(n):
            path = path_to_node(tree.parents, node)
            ref_logits, ref_hidden = plain(model, seq + tree.tokens[path].tolist())
            torch.testing.assert_close(logits[0, node], ref_logits[-1], atol=1e-5, rtol=0)
            for k in HIDDEN:
                torch.testing.assert_close(hidden[k][0, node], ref_hidden[k][0, -1], atol=1e-5, rtol=0)
        keep = path_to_node(tree.parents, n - 1 - step % 2 if n > 1 else 0)  # a non-contiguous path too
        runner.commit(torch.tensor(keep))
        seq += tree.tokens[keep].tolist()
        assert runner.length == len(seq) == runner.cache.get_seq_length()
    if cache == "static":  # the committed slots hold exactly a plain run's keys/values
        assert isinstance(runner.cache, SlotCache)
        fresh = TargetRunner(model, cache="dynamic")
        fresh.prefill(torch.tensor([seq]))
        for mine, ref in zip(runner.cache.layers, fresh.cache.layers):
            torch.testing.assert_close(mine.keys[:, :, : len(seq)], ref.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(mine.values[:, :, : len(seq)], ref.values, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_verify_left_uncommitted_or_a_length_set_back_is_dropped_by_the_next_verify(model, cache):
    """A verify without a commit (pass timing, calibration) leaves scratch entries: the next verify runs
    after the committed prefix only, as does one after `runner.length` was set back past a commit."""
    runner = TargetRunner(model, cache=cache)
    runner.reserve(6, 30)
    seq = [3, 9, 27, 17, 51, 25]
    runner.prefill(torch.tensor([seq]))
    tree = random_tree(6, 1)
    first, _ = runner.verify(tree.tokens[None], tree.parents[None])
    again, _ = runner.verify(tree.tokens[None], tree.parents[None])  # no commit in between
    torch.testing.assert_close(again, first, atol=1e-5, rtol=0)
    runner.commit([0, 1])
    runner.length = len(seq)  # set back: drop that commit too
    again, _ = runner.verify(tree.tokens[None], tree.parents[None])
    torch.testing.assert_close(again, first, atol=1e-5, rtol=0)
    for node in range(6):
        ref, _ = plain(model, seq + tree.tokens[path_to_node(tree.parents, node)].tolist())
        torch.testing.assert_close(again[0, node], ref[-1], atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_tree_shape_seen_again_verifies_through_its_kept_mask_at_any_length(model, cache):
    """A static tree's shape repeats every pass: from its second pass on, the mask is a view of a kept
    one over W >= past columns, widened when a later sequence outgrows W (here: 1100 positions)."""
    runner = TargetRunner(model, cache=cache)
    parents = torch.tensor([-1, 0, 1, 1, 2])  # [N]: the same shape every pass
    g = torch.Generator().manual_seed(0)
    for prompt_len, paths in ((6, ([0, 1, 2], [0, 1, 3], [0, 1, 2, 4])), (1100, ([0, 1, 3], [0, 1, 2]))):
        seq = torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist()
        runner.reserve(prompt_len, 20)
        runner.prefill(torch.tensor([seq]))
        for path in paths:
            tokens = torch.randint(0, VOCAB, (5,), generator=g)
            logits, _ = runner.verify(tokens[None], parents[None])
            for node in range(5):
                ref, _ = plain(model, seq + tokens[path_to_node(parents, node)].tolist())
                torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-4, rtol=0)
            runner.commit(path)  # a host list, as the generator commits (contiguous or not)
            seq += tokens[path].tolist()
            assert runner.length == len(seq) == runner.cache.get_seq_length()
    assert len(runner._wide) == 1  # the one shape's kept mask, widened for the long sequence
    assert next(iter(runner._wide.values())).shape[-1] >= 1100 + 5


@pytest.mark.parametrize("inference", [False, True], ids=["normal", "inference_tensor"])
@torch.no_grad()
def test_the_same_parents_tensor_again_reuses_its_structure_unless_written_in_place(model, inference):
    """The generator hands a static tree's [1, N] parents as the SAME tensor every pass (the runner
    then skips making its key); written in place in between, the runner must see the new shape. An
    inference tensor (a drafter's buffer made in inference mode) has no version counter to tell."""
    runner = TargetRunner(model, cache="static")
    with torch.inference_mode(inference):
        parents = torch.tensor([[-1, 0, 1, 1, 2]])  # [1, N], one object throughout
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    runner.reserve(len(seq), 20)
    runner.prefill(torch.tensor([seq]))
    for new_shape in (None, None, [-1, 0, 0, 2, 1], None):
        if new_shape is not None:
            with torch.inference_mode(inference):
                parents.copy_(torch.tensor([new_shape]))  # the same object, another tree
        tokens = torch.randint(0, VOCAB, (5,), generator=g)
        logits, _ = runner.verify(tokens[None], parents)
        for node in range(5):
            ref, _ = plain(model, seq + tokens[path_to_node(parents[0], node)].tolist())
            torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-4, rtol=0)
        runner.commit([0])
        seq.append(int(tokens[0]))


def test_off_the_cpu_a_verify_mask_is_never_a_view_at_an_arbitrary_column(model):
    """CUDA's memory-efficient attention assumes a 16-element-aligned mask start: a kept mask's view at
    column W - past crashed with 'misaligned address' on an H200. Off the CPU every verify mask is a
    fresh tensor; checked on the meta device (no data, the same code path as CUDA's)."""
    runner = TargetRunner(model, cache="static")
    runner.device = torch.device("meta")
    block = torch.zeros(1, 1, 5, 5, device="meta")  # [1, 1, N, N]
    for past in (3, 7, 21, 7):
        runner.length = past
        mask = runner._tree_mask(block, key=b"one shape")  # [1, 1, N, past + N]
        assert mask.shape == (1, 1, 5, past + 5) and mask.storage_offset() == 0 and mask.is_contiguous()
    assert not runner._wide


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_entry_points_called_directly_run_in_inference_mode(tiny_llama, cache):
    """Called with gradients on (no mode entered by the caller), prefill and verify run in inference
    mode (outputs are inference tensors: no autograd, no version counters) and commit, called outside
    it, still updates the cache they made in it."""
    runner = TargetRunner(tiny_llama(VOCAB, layers=2, hidden=32, seed=0), hidden_layers=(1,), cache=cache)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    runner.reserve(6, 8)
    logits, hidden = runner.prefill(ids)
    tokens, parents = torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([[-1, 0, 0, 1, 2]])  # [1, N] each
    tree_logits, tree_hidden = runner.verify(tokens, parents)
    runner.commit([0, 2, 4])  # off the first branch: the entries move (in place)
    assert runner.length == 6 + 3
    outputs = [logits, tree_logits, *hidden.values(), *tree_hidden.values()]
    assert all(t.is_inference() and not t.requires_grad for t in outputs) and torch.is_grad_enabled()


def test_static_cache_is_preallocated_once(model):
    runner = TargetRunner(model, cache="static")
    runner.reserve(4, 20)
    runner.prefill(torch.tensor([[1, 2, 3, 4]]))
    buffers = [layer.keys.data_ptr() for layer in runner.cache.layers]
    for step in range(5):
        tree = random_tree(6, step)
        runner.verify(tree.tokens[None], tree.parents[None])
        runner.commit(torch.tensor(path_to_node(tree.parents, 5)))
    assert [layer.keys.data_ptr() for layer in runner.cache.layers] == buffers  # written in place


def test_cache_too_small_is_one_clear_line(model):
    runner = TargetRunner(model, cache="static", max_length=16)
    with pytest.raises(
        ValueError, match=r"too small for the prompt \(10 tokens\) \+ max_new_tokens \(8\)"
    ) as err:
        runner.reserve(10, 8)
    assert "\n" not in str(err.value)
    runner.reserve(10, 6)
    runner.prefill(torch.arange(10)[None])
    with pytest.raises(ValueError, match="does not fit"):
        runner.verify(torch.zeros(1, 7, dtype=torch.long), torch.arange(-1, 6)[None])
    with pytest.raises(ValueError, match="cache must be one of"):
        TargetRunner(model, cache="paged")


def test_hooks_are_installed_once(model):
    layer = model.get_decoder().layers[1]
    before = len(layer._forward_hooks)
    runners = [TargetRunner(model, (2,), cache=c) for c in ("dynamic", "static", "dynamic")]
    assert len(layer._forward_hooks) == before + 1  # one hook for layer index 2, shared by all runners
    for runner in runners:
        runner.reserve(3, 4)
        _, hidden = runner.prefill(torch.tensor([[5, 6, 7]]))
        assert hidden[2].shape == (1, 3, 32)
    model(torch.tensor([[1, 2]]))  # a forward outside the runner records nothing
    assert not runners[0]._capture.store


def test_a_fixed_cache_cuts_trees_near_its_end_losslessly(model, chatml_tokenizer):
    from spechead.inference.drafters.draft_model import DraftModelDrafter
    from spechead.inference.generator import SpeculativeGenerator

    prompt, n = [3, 9, 27, 17], 14
    reference = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    drafter = DraftModelDrafter(model, num_draft=6)  # the target drafting for itself: long accepted paths
    gen = SpeculativeGenerator(
        model, chatml_tokenizer, drafter, cache="static", max_cache_len=len(prompt) + n
    )
    gen.eos = set()
    assert gen.generate(input_ids=prompt, max_new_tokens=n).token_ids == reference
    with pytest.raises(ValueError, match="too small"):
        gen.generate(input_ids=prompt, max_new_tokens=n + 1)


def test_cuda_wrapper_returns_copies_of_every_output():
    """A CUDA graph overwrites its outputs at the next replay; the draft loop keeps each depth's output
    for the next call. The wrapper must copy (checked here with a function whose outputs ARE a kept buffer,
    as a graph's are)."""
    buffer = torch.zeros(3)

    def fn(x):
        buffer.copy_(x)
        return buffer, (buffer, 1)

    f = compile_function(fn, "eager", cuda=True)  # the CUDA wrapper, eager backend: runs on a CPU
    out, (nested, one) = f(torch.ones(3))
    assert one == 1 and out is not buffer and nested is not buffer
    f(torch.full((3,), 2.0))
    assert out.tolist() == [1.0, 1.0, 1.0] and nested.tolist() == [1.0, 1.0, 1.0]


def _sliding(kind: str, window: int):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    if kind == "mistral":  # one window for every layer, no per-layer types
        return MistralForCausalLM(MistralConfig(sliding_window=window, **shape)).eval()
    # Qwen2: only layers past max_window_layers slide
    config = Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=1, **shape)
    return Qwen2ForCausalLM(config).eval()


def test_sliding_layout_finds_sliding_layers(tiny_llama):
    """A window without layer types slides every layer (one mask); with types, a dict per type."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert sliding_layout(tiny_llama(VOCAB)) is None
    assert sliding_layout(_sliding("mistral", 24)) == SlidingLayout(24, None)
    assert sliding_layout(_sliding("qwen2", 20)) == SlidingLayout(20, ("full_attention", "sliding_attention"))
    full = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, sliding_window=20,
                       use_sliding_window=True, max_window_layers=2)  # fmt: skip
    assert full.sliding_window == 20 and "sliding_attention" not in full.layer_types
    assert sliding_layout(Qwen2ForCausalLM(full)) is None  # a window set but no layer uses it


@torch.no_grad()
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sliding_window_tree_passes_equal_plain_forwards_past_the_window(kind, cache):
    """Tree passes on a window of 8 over a prefix that outgrows it: every node's logits equal the plain
    forward of its root-to-node path (the model's own sliding masks), pass after pass."""
    model = _sliding(kind, 8)
    runner = TargetRunner(model, cache=cache)
    runner.reserve(6, 24)
    seq = [3, 9, 27, 17, 51, 25]
    runner.prefill(torch.tensor([seq]))
    for step, n in enumerate([5, 7, 4, 6, 1]):
        tree = random_tree(n, step)
        logits, _ = runner.verify(tree.tokens[None], tree.parents[None])
        for node in range(n):
            ref = plain(model, seq + tree.tokens[path_to_node(tree.parents, node)].tolist())[0]
            torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-5, rtol=0)
        keep = path_to_node(tree.parents, n - 1)
        runner.commit(torch.tensor(keep))
        seq += tree.tokens[keep].tolist()
    assert len(seq) > 16  # two windows


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3", "kernels-community/flash-attn"])
def test_flash_attention_targets_are_refused_for_tree_masks(tiny_llama, impl):
    """Every flash kernel (any name holding "flash") takes no arbitrary 4D mask: refused at once."""
    model = tiny_llama(VOCAB, layers=1, hidden=32, seed=0)
    model.config._attn_implementation = impl  # (set directly: the kernels need a GPU to load)
    with pytest.raises(ValueError, match=r"needs arbitrary 4D masks; attn_implementation '.*flash"):
        TargetRunner(model, cache="dynamic")


@torch.no_grad()
def test_a_static_prefill_without_reserve_sizes_its_own_cache_and_an_empty_prompt_is_refused(model):
    runner = TargetRunner(model, cache="static")  # no reserve(): the prefill makes a cache for the prompt
    seq = [3, 9, 27, 17, 51, 25]
    logits, _ = runner.prefill(torch.tensor([seq]))
    torch.testing.assert_close(logits[0], plain(model, seq)[0][-1], atol=1e-5, rtol=0)
    tree = random_tree(5, 0)
    tree_logits, _ = runner.verify(tree.tokens[None], tree.parents[None])
    for node in range(5):
        ref, _ = plain(model, seq + tree.tokens[path_to_node(tree.parents, node)].tolist())
        torch.testing.assert_close(tree_logits[0, node], ref[-1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"T >= 1, got \(1, 0\)"):
        runner.prefill(torch.zeros(1, 0, dtype=torch.long))


@torch.no_grad()
@pytest.mark.parametrize("compile", [False, "graphs"], ids=["eager", "graphs"])
def test_near_a_fixed_caches_end_buckets_and_compiled_commits_stay_within_it(model, compile):
    """A bucket larger than the room left is not taken (the tree runs unpadded), and a compiled commit
    whose power-of-2 padding would copy past the buffer's end falls back to the eager copy."""
    runner = TargetRunner(model, cache="static", max_length=16, buckets=(4, 16, 64), compile=compile)
    runner.reserve(10, 6)
    seq = [3, 9, 27, 17, 51, 25, 7, 11, 13, 2]
    runner.prefill(torch.tensor([seq]))
    tokens, parents = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([-1, 0, 1, 2, 2, 3])  # room: 6
    logits, _ = runner.verify(tokens[None], parents[None])
    assert logits.shape == (1, 6, VOCAB) and runner.last_ancestors.shape == (1, 6, 6)
    for node in range(6):
        ref, _ = plain(model, seq + tokens[path_to_node(parents, node)].tolist())
        torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-4, rtol=0)
    keep = [0, 1, 2, 3, 5]  # K = 5, not in place: padded to 8 it would run past slot 16
    runner.commit(keep)
    seq += tokens[keep].tolist()
    fresh = TargetRunner(model, cache="dynamic")
    fresh.prefill(torch.tensor([seq]))
    for mine, ref in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys[:, :, : len(seq)], ref.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(mine.values[:, :, : len(seq)], ref.values, atol=1e-5, rtol=0)
