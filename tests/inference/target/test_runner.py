"""The one TargetRunner on a real tiny Llama, a batch of one and of several rows: the prefill equals a plain
forward (logits, every captured layer); verified tree logits and hidden states equal the plain forward of
each root-to-node path; a commit leaves exactly prefix + path in the cache (equal to a plain run's keys and
values); `keep` drops rows; buckets change nothing; a greedy loop of verify + accept + commit reproduces
plain greedy decoding; the batch of one's remembered tree inputs stay right; hooks are installed once."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from spechead.heads.attention import NAME as TREE_SDPA
from spechead.inference.acceptance import greedy_accept
from spechead.inference.target.runner import TargetRunner
from spechead.inference.target.tree_inputs import TreeInputs
from spechead.inference.tree import TokenTree, path_to_node

from ..test_tree import retrieve_indices
from ..trees import ancestor_mask

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
    """A full forward without a cache: logits [T, V] and every hidden state [1, T, H]."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states


def plain_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values [kv, T, D] of a plain run over `ids`."""
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids]), cache=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def assert_rows_hold(runner: TargetRunner, model, seqs: list[list[int]]) -> None:
    """Row b's committed slots hold exactly a plain run's keys and values over seqs[b], and its length."""
    assert runner.lengths == [len(s) for s in seqs]
    for b, (row, seq) in enumerate(zip(runner.rows, seqs)):
        for mine, (keys, values) in zip(runner.cache.row_layers, plain_kv(model, seq)):
            torch.testing.assert_close(mine.keys[row, :, : len(seq)], keys, atol=1e-5, rtol=0, msg=f"row {b}")
            torch.testing.assert_close(mine.values[row, :, : len(seq)], values, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("buckets", [None, (4, 16, 64)])
def test_verify_equals_plain_paths_and_commit_keeps_exactly_prefix_and_path(model, rows, buckets):
    """Rows of other prompt lengths, trees of other shapes per pass (a one-node step among them), paths
    in place and off the first branch: every node's logits and states equal the plain path's, and after
    each commit every row's cache is a plain run's over its prefix + path."""
    runner = TargetRunner(model, HIDDEN, buckets=buckets)
    seqs = [[3, 9, 27, 17, 51, 25, 8][: 6 - b] for b in range(rows)]
    runner.reserve([len(s) for s in seqs], [40] * rows)
    logits, hiddens = runner.prefill([torch.tensor(s) for s in seqs])
    assert logits.shape == (rows, VOCAB) and logits.dtype == torch.float32
    for b, seq in enumerate(seqs):
        ref_logits, ref_hidden = plain(model, seq)
        torch.testing.assert_close(logits[b], ref_logits[-1], atol=1e-5, rtol=0)
        for k in HIDDEN:
            torch.testing.assert_close(hiddens[b][k], ref_hidden[k][0], atol=1e-5, rtol=0)
    for step, n in enumerate([12, 1, 7, 3, 12]):
        trees = [random_tree(n, 10 * step + b) for b in range(rows)]
        tokens, parents = torch.stack([t.tokens for t in trees]), torch.stack([t.parents for t in trees])
        logits, hidden = runner.verify(tokens, parents)
        assert logits.shape == (rows, n, VOCAB) and all(h.shape[:2] == (rows, n) for h in hidden.values())
        assert runner.last_ancestors.shape == (rows, n, n)
        for b, tree in enumerate(trees):
            assert torch.equal(runner.last_ancestors[b], ancestor_mask(tree.parents))
            for node in range(n):
                ref_logits, ref_hidden = plain(
                    model, seqs[b] + tree.tokens[path_to_node(tree.parents, node)].tolist()
                )
                torch.testing.assert_close(logits[b, node], ref_logits[-1], atol=1e-5, rtol=0)
                for k in HIDDEN:
                    torch.testing.assert_close(hidden[k][b, node], ref_hidden[k][0, -1], atol=1e-5, rtol=0)
        # paths: off the first branch (entries move), a chain's prefix (in place), the root alone
        paths = [
            path_to_node(t.parents, (n - 1 - (step + b) % 2) if n > 1 else 0) for b, t in enumerate(trees)
        ]
        runner.commit([torch.tensor(p) if (step + b) % 2 else p for b, p in enumerate(paths)])
        seqs = [s + t.tokens[p].tolist() for s, t, p in zip(seqs, trees, paths)]
        assert_rows_hold(runner, model, seqs)
    # every row's path in place, host lists (chains' prefixes of other lengths): only the lengths move
    chains = [TokenTree(torch.randint(0, VOCAB, (6,)), torch.arange(-1, 5)) for _ in range(rows)]
    runner.verify(torch.stack([c.tokens for c in chains]), torch.stack([c.parents for c in chains]))
    paths = [list(range(6 - b % 3)) for b in range(rows)]
    runner.commit(paths)
    seqs = [s + c.tokens[p].tolist() for s, c, p in zip(seqs, chains, paths)]
    assert_rows_hold(runner, model, seqs)


@torch.no_grad()
def test_keep_drops_rows_and_the_others_go_on_untouched(model):
    """Three rows, then the middle one leaves, then the first: the kept rows' caches, lengths and next
    passes are theirs (a batch of one again after the last drop)."""
    runner = TargetRunner(model)
    seqs = [[3, 9, 27, 17], [5, 6, 7, 8, 9, 10], [11, 12]]
    runner.prefill([torch.tensor(s) for s in seqs])
    for keep in ([2, 0], [1]):
        tree = random_tree(5, len(keep))
        batch = len(seqs)
        logits, _ = runner.verify(tree.tokens.expand(batch, 5), tree.parents.expand(batch, 5))
        path = path_to_node(tree.parents, 4)
        runner.commit([path] * batch)
        seqs = [s + tree.tokens[path].tolist() for s in seqs]
        runner.keep(keep)
        seqs = [seqs[i] for i in keep]
        assert_rows_hold(runner, model, seqs)
    tree = random_tree(6, 9)
    logits, _ = runner.verify(tree.tokens[None], tree.parents[None])
    for node in range(6):
        ref, _ = plain(model, seqs[0] + tree.tokens[path_to_node(tree.parents, node)].tolist())
        torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 2])
def test_a_verify_left_uncommitted_or_a_length_set_back_is_dropped_by_the_next_verify(model, rows):
    """A verify without a commit (pass timing, calibration) leaves scratch entries: the next verify runs
    after the committed prefix only, as does one after `lengths` was set back past a commit."""
    runner = TargetRunner(model)
    seq = [3, 9, 27, 17, 51, 25]
    runner.reserve([6] * rows, [30] * rows)
    runner.prefill([torch.tensor(seq)] * rows)
    tree = random_tree(6, 1)
    tokens, parents = tree.tokens.expand(rows, 6), tree.parents.expand(rows, 6)
    first, _ = runner.verify(tokens, parents)
    again, _ = runner.verify(tokens, parents)  # no commit in between
    torch.testing.assert_close(again, first, atol=1e-5, rtol=0)
    runner.commit([[0, 1]] * rows)
    runner.lengths = [len(seq)] * rows  # set back: drop that commit too
    again, _ = runner.verify(tokens, parents)
    torch.testing.assert_close(again, first, atol=1e-5, rtol=0)
    for node in range(6):
        ref, _ = plain(model, seq + tree.tokens[path_to_node(tree.parents, node)].tolist())
        torch.testing.assert_close(again[:, node], ref[-1].expand(rows, VOCAB), atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_tree_shape_seen_again_verifies_through_its_kept_mask_at_any_length(model):
    """A static tree's shape repeats every pass: from its second pass on, the mask is a view of a kept
    one over W >= past columns, widened when a later sequence outgrows W (here: 1100 positions)."""
    runner = TargetRunner(model)
    parents = torch.tensor([-1, 0, 1, 1, 2])  # [N]: the same shape every pass
    g = torch.Generator().manual_seed(0)
    for prompt_len, paths in ((6, ([0, 1, 2], [0, 1, 3], [0, 1, 2, 4])), (1100, ([0, 1, 3], [0, 1, 2]))):
        seq = torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist()
        runner.reserve([prompt_len], [20])
        runner.prefill([torch.tensor(seq)])
        for path in paths:
            tokens = torch.randint(0, VOCAB, (5,), generator=g)
            logits, _ = runner.verify(tokens[None], parents[None])
            for node in range(5):
                ref, _ = plain(model, seq + tokens[path_to_node(parents, node)].tolist())
                torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-4, rtol=0)
            runner.commit([path])  # a host list, as the decode loop commits (in place or not)
            seq += tokens[path].tolist()
            assert runner.lengths == [len(seq)] and runner.cache.get_seq_length() == len(seq)
    wide = runner._inputs.wide
    assert len(wide) == 1  # the one shape's kept mask, widened for the long sequence
    assert next(iter(wide.values())).shape[-1] >= 1100 + 5


@pytest.mark.parametrize("inference", [False, True], ids=["normal", "inference_tensor"])
@torch.no_grad()
def test_the_same_parents_tensor_again_reuses_its_structure_unless_written_in_place(model, inference):
    """The decode loop hands a static tree's [1, N] parents as the SAME tensor every pass (the runner
    then skips making its key); written in place in between, the runner must see the new shape. An
    inference tensor (a drafter's buffer made in inference mode) has no version counter to tell."""
    runner = TargetRunner(model)
    with torch.inference_mode(inference):
        parents = torch.tensor([[-1, 0, 1, 1, 2]])  # [1, N], one object throughout
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    runner.reserve([len(seq)], [20])
    runner.prefill([torch.tensor(seq)])
    for new_shape in (None, None, [-1, 0, 0, 2, 1], None):
        if new_shape is not None:
            with torch.inference_mode(inference):
                parents.copy_(torch.tensor([new_shape]))  # the same object, another tree
        tokens = torch.randint(0, VOCAB, (5,), generator=g)
        logits, _ = runner.verify(tokens[None], parents)
        for node in range(5):
            ref, _ = plain(model, seq + tokens[path_to_node(parents[0], node)].tolist())
            torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-4, rtol=0)
        runner.commit([[0]])
        seq.append(int(tokens[0]))


def test_off_the_cpu_a_verify_mask_is_never_a_view_at_an_arbitrary_column():
    """CUDA's memory-efficient attention assumes a 16-element-aligned mask start: a kept mask's view at
    column W - past crashed with 'misaligned address' on an H200. Off the CPU every verify mask is a
    fresh tensor; checked on the meta device (no data, the same code path as CUDA's)."""
    inputs = TreeInputs(torch.float32, torch.device("meta"))
    block = torch.zeros(1, 1, 5, 5, device="meta")  # [1, 1, N, N]
    for past in (3, 7, 21, 7):
        mask = inputs.mask(block, b"one shape", past, 64)  # [1, 1, N, past + N]
        assert mask.shape == (1, 1, 5, past + 5) and mask.storage_offset() == 0 and mask.is_contiguous()
    assert not inputs.wide


@pytest.mark.parametrize("rows", [1, 2])
def test_entry_points_called_directly_run_in_inference_mode(tiny_llama, rows):
    """Called with gradients on (no mode entered by the caller), prefill and verify run in inference
    mode (outputs are inference tensors: no autograd, no version counters) and commit, called outside
    it, still updates the cache they made in it."""
    runner = TargetRunner(tiny_llama(VOCAB, layers=2, hidden=32, seed=0), hidden_layers=(1,))
    ids = torch.randint(0, VOCAB, (rows, 6), generator=torch.Generator().manual_seed(0))
    runner.reserve([6] * rows, [8] * rows)
    logits, hiddens = runner.prefill(list(ids))
    tokens, parents = torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([[-1, 0, 0, 1, 2]])  # [1, N] each
    tree_logits, tree_hidden = runner.verify(tokens.expand(rows, 5), parents.expand(rows, 5))
    runner.commit([[0, 2, 4]] * rows)  # off the first branch: the entries move (in place)
    assert runner.lengths == [6 + 3] * rows
    outputs = [logits, tree_logits, *hiddens[0].values(), *tree_hidden.values()]
    assert all(t.is_inference() and not t.requires_grad for t in outputs) and torch.is_grad_enabled()


def test_the_row_cache_is_preallocated_once_and_kept_for_the_next_sequence(model):
    runner = TargetRunner(model)
    runner.reserve([4], [20])
    runner.prefill([torch.tensor([1, 2, 3, 4])])
    buffers = [layer.keys.data_ptr() for layer in runner.cache.row_layers]
    for step in range(5):
        tree = random_tree(6, step)
        runner.verify(tree.tokens[None], tree.parents[None])
        runner.commit([torch.tensor(path_to_node(tree.parents, 5))])
    runner.reserve([9], [20])  # the next sequence fits: the same buffers
    logits, _ = runner.prefill([torch.arange(9)])  # from slot 0 again, not after the last sequence
    assert [layer.keys.data_ptr() for layer in runner.cache.row_layers] == buffers  # written in place
    torch.testing.assert_close(logits[0], plain(model, list(range(9)))[0][-1], atol=1e-5, rtol=0)


def test_a_cache_too_small_or_a_tree_too_big_is_one_clear_line(model):
    runner = TargetRunner(model, max_length=16)
    with pytest.raises(
        ValueError, match=r"too small for the prompt \(10 tokens\) \+ max_new_tokens \(8\)"
    ) as err:
        runner.reserve([10], [8])
    assert "\n" not in str(err.value) and "raise max_cache_len or lower max_new_tokens" in str(err.value)
    with pytest.raises(
        ValueError, match=r"too small for row 1: prompt \(10 tokens\) \+ max_new_tokens \(7\)"
    ):
        runner.reserve([4, 10], [6, 7])
    with pytest.raises(
        ValueError, match=r"too small for row 1: prompt \(17 tokens\) \+ max_new_tokens \(0\)"
    ):
        runner.prefill([torch.arange(3), torch.arange(17)])
    with pytest.raises(ValueError, match=r"one prompt length and max_new per row, got \[\], \[\]"):
        runner.prefill([])
    runner.reserve([10], [6])
    runner.prefill([torch.arange(10)])
    assert runner.room() == 6
    with pytest.raises(ValueError, match="does not fit: 6 KV slots left"):
        runner.verify(torch.zeros(1, 7, dtype=torch.long), torch.arange(-1, 6)[None])
    with pytest.raises(ValueError, match=r"tokens and parents must be \[B=1, N\]"):
        runner.verify(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="capacity .* needs compile="):
        TargetRunner(model, capacity=2)


def test_hooks_are_installed_once(model):
    layer = model.get_decoder().layers[1]
    before = len(layer._forward_hooks)
    runners = [TargetRunner(model, (2,)) for _ in range(3)]
    assert len(layer._forward_hooks) == before + 1  # one hook for layer index 2, shared by all runners
    for runner in runners:
        runner.reserve([3], [4])
        _, hiddens = runner.prefill([torch.tensor([5, 6, 7])])
        assert hiddens[0][2].shape == (3, 32)
    model(torch.tensor([[1, 2]]))  # a forward outside the runner records nothing
    assert not runners[0]._capture.store


@torch.no_grad()
def test_a_prefill_without_reserve_sizes_its_own_cache_and_an_empty_prompt_is_refused(model):
    runner = TargetRunner(model)  # no reserve(): the prefill makes a cache for the prompt
    seq = [3, 9, 27, 17, 51, 25]
    logits, _ = runner.prefill([torch.tensor(seq)])
    torch.testing.assert_close(logits[0], plain(model, seq)[0][-1], atol=1e-5, rtol=0)
    tree = random_tree(5, 0)
    tree_logits, _ = runner.verify(tree.tokens[None], tree.parents[None])
    for node in range(5):
        ref, _ = plain(model, seq + tree.tokens[path_to_node(tree.parents, node)].tolist())
        torch.testing.assert_close(tree_logits[0, node], ref[-1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"row 0: prompt must be a non-empty 1-D id tensor, got \(0,\)"):
        runner.prefill([torch.zeros(0, dtype=torch.long)])
    with pytest.raises(RuntimeError, match="verify before prefill"):
        TargetRunner(model).verify(tree.tokens[None], tree.parents[None])
    with pytest.raises(ValueError, match="does not exist"):
        TargetRunner(model, (5,))


@torch.no_grad()
def test_prefill_captures_every_layer_of_a_plain_forward(model):
    """Embeddings, every layer's output and the state after the final norm (HF indices, negative ones too)."""
    layers = (0, 1, 3, 4, -1, -2)
    prefix = list(range(5, 12))
    logits, hiddens = TargetRunner(model, layers).prefill([torch.tensor(prefix)])
    ref_logits, ref_hidden = plain(model, prefix)
    torch.testing.assert_close(logits[0], ref_logits[-1], atol=1e-5, rtol=0)
    assert set(hiddens[0]) == set(layers)
    for k in layers:
        torch.testing.assert_close(hiddens[0][k], ref_hidden[k][0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_greedy_tree_loop_reproduces_plain_greedy(model):
    """Verify + greedy_accept + commit over random trees in which one branch carries the true
    continuation (an oracle right at each level with probability 0.8): plain greedy decoding's tokens."""
    prefix, steps = [1, 2, 3, 4], 24
    ids = list(prefix)
    for _ in range(steps):  # plain greedy reference
        ids.append(int(plain(model, ids)[0][-1].argmax()))
    truth = ids[len(prefix) :]
    g = torch.Generator().manual_seed(0)
    runner = TargetRunner(model)
    runner.prefill([torch.tensor(prefix[:-1])])
    out, root, rounds = [], prefix[-1], 0
    while len(out) < steps:
        tree = random_tree(10, int(torch.randint(0, 10_000, (), generator=g)))
        tree.tokens[0] = root
        paths = retrieve_indices(tree.parents)  # [paths, max_depth + 1]
        row = paths[int(torch.randint(0, paths.shape[0], (), generator=g))]
        for d, node in enumerate(row[1:].tolist()):
            if node >= 0 and len(out) + d < steps and torch.rand((), generator=g) < 0.8:
                tree.tokens[node] = truth[len(out) + d]
        logits, _ = runner.verify(tree.tokens[None], tree.parents[None])
        acc = greedy_accept(tree, logits[0])
        runner.commit([acc.path])
        out += tree.tokens[acc.path[1:]].tolist() + [acc.next_token]
        root, rounds = acc.next_token, rounds + 1
    assert rounds < steps * 0.6, "the oracle drafts should make multi-token steps"
    assert out[:steps] == truth
    assert runner.lengths == [len(prefix) - 1 + len(out)]  # every round: its path (root included)


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3", "kernels-community/flash-attn"])
def test_flash_attention_targets_are_refused_for_tree_masks(tiny_llama, impl):
    """Every flash kernel (any name holding "flash") takes no arbitrary 4D mask: refused at once."""
    model = tiny_llama(VOCAB, layers=1, hidden=32, seed=0)
    model.config._attn_implementation = impl  # (set directly: the kernels need a GPU to load)
    with pytest.raises(ValueError, match=r"needs arbitrary 4D masks; attn_implementation '.*flash"):
        TargetRunner(model)


@torch.no_grad()
@pytest.mark.parametrize("compile", [False, "graphs"], ids=["eager", "graphs"])
def test_near_a_fixed_caches_end_buckets_and_commits_stay_within_it(model, compile):
    """A bucket larger than the room left is not taken (the tree runs unpadded), and a compiled commit
    whose power-of-2 padding would copy past the buffer's end stays within it (clamped to the last slot)."""
    runner = TargetRunner(model, max_length=16, buckets=(4, 16, 64), compile=compile)
    runner.reserve([10], [6])
    seq = [3, 9, 27, 17, 51, 25, 7, 11, 13, 2]
    runner.prefill([torch.tensor(seq)])
    tokens, parents = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([-1, 0, 1, 2, 2, 3])  # room: 6
    logits, _ = runner.verify(tokens[None], parents[None])
    assert logits.shape == (1, 6, VOCAB) and runner.last_ancestors.shape == (1, 6, 6)
    for node in range(6):
        ref, _ = plain(model, seq + tokens[path_to_node(parents, node)].tolist())
        torch.testing.assert_close(logits[0, node], ref[-1], atol=1e-4, rtol=0)
    keep = [0, 1, 2, 3, 5]  # K = 5, not in place: padded to 8 it would run past slot 16
    runner.commit([keep])
    assert_rows_hold(runner, model, [seq + tokens[keep].tolist()])


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
