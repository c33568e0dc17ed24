"""The CUDA-graph fast path's rules, checked on a CPU: a captured graph replays the SAME kernels on the
SAME memory, so whatever a graph function read from Python at capture time (a length, a position, a
buffer) is baked in. `Replayed` stands in for `GraphedFunction`'s CUDA graph: capturing records every
aten op the call runs (its tensors by identity), a replay re-runs those ops on those tensors and writes
their results into the recorded outputs, as a graph's kernels do. A value read from Python state that
should have come from a device tensor then shows up as wrong tokens here, without a GPU. A host
synchronisation inside a graph (`.item()`, a tensor's truth value) fails, as a CUDA capture does."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spechead.inference.compiling as compiling_module
from spechead.heads import EagleConfig, EagleHead
from spechead.inference.cuda_graphs import Captured, GraphedFunction, copy_outputs
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.generator import SpeculativeGenerator

from .test_generator import OracleDrafter, plain_greedy

TREES = [{"top_k": 4, "depth": 4, "total_tokens": 16}, {"tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}]
SYNCS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            raise RuntimeError(f"a host synchronisation inside a captured graph: {func}")
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(...): a host-to-device copy on CUDA
            raise RuntimeError(f"a tensor made from host values inside a captured graph: {args[0]}")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def _write(recorded, fresh) -> None:
    """A replayed op's results into the recorded outputs (in-place ops and views: the same memory)."""
    if isinstance(recorded, torch.Tensor):
        assert recorded.shape == fresh.shape, "a data-dependent shape inside a captured graph"
        same = recorded.data_ptr() == fresh.data_ptr() and recorded.stride() == fresh.stride()
        if not same:
            recorded.copy_(fresh)
    elif isinstance(recorded, (tuple, list)):
        for r, f in zip(recorded, fresh):
            _write(r, f)


class Replayed(GraphedFunction):
    """GraphedFunction with a recorded op list for a graph (capturing here also runs the call: it is this
    signature's real first run)."""

    def _run_and_capture(self, values, n_args, names):
        static = [v.clone() if isinstance(v, torch.Tensor) else v for v in values]
        recorder = _Recorder()
        with recorder:
            outputs = self.fn(*static[:n_args], **dict(zip(names, static[n_args:])))
        inputs = [v for v in static if isinstance(v, torch.Tensor)]
        return copy_outputs(outputs), Captured(inputs, recorder.ops, outputs)

    replays = 0

    def _replay(self, entry) -> None:
        self.replays += 1
        for func, args, kwargs, out in entry.graph:
            _write(out, func(*args, **kwargs))


@pytest.fixture
def replayed_graphs(monkeypatch):
    """compile=True (and "graphs", which captures the raw functions on CUDA) builds `Replayed` graphs of
    the raw graph functions (what CUDA would capture)."""
    made: list[Replayed] = []
    original = compiling_module.compile_function

    def compile_function(fn, compile, cuda=False, fullgraph=False, state=None):
        if compile not in (True, "graphs"):  # another backend: as it is (the un-replayed reference)
            return original(fn, compile, cuda, fullgraph, state)
        made.append(Replayed(fn, state))
        return made[-1]

    monkeypatch.setattr(compiling_module, "compile_function", compile_function)
    return made


def _eagle(model, **tree) -> EagleDrafter:
    torch.manual_seed(0)  # the same head every time
    head = EagleHead(EagleConfig.from_target(model.config))
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    return EagleDrafter(head.eval(), **tree)


@pytest.mark.parametrize("compile", [True, "graphs"])
@pytest.mark.parametrize("tree", TREES)
def test_replayed_graphs_decode_like_plain_decoding(
    tiny_llama, chatml_tokenizer, replayed_graphs, tree, compile
):
    """Target verify + commit and the EAGLE draft + accept as replayed graphs, several prompts (the graphs
    replay at new committed lengths and new sequences): greedy output equals plain eager decoding."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    gen = SpeculativeGenerator(model, chatml_tokenizer, _eagle(model, **tree), compile=compile)
    for i in range(3):
        prompt = list(range(5 + i, 15 + 2 * i))
        ref = plain.generate(input_ids=prompt, max_new_tokens=20).token_ids
        assert gen.generate(input_ids=prompt, max_new_tokens=20).token_ids == ref, i
    by_name = {g.fn.__name__: g for g in replayed_graphs}  # (the drafter's are made at its first start)
    assert len(replayed_graphs) == 4 and set(by_name) == {
        "_grow",
        "_graph_accept",
        "_graph_verify",
        "_graph_commit",
    }  # draft, accept, runner verify, runner commit
    draft, accept, verify = by_name["_grow"], by_name["_graph_accept"], by_name["_graph_verify"]
    for graph in (draft, accept, verify):  # captured once per shape, then replayed
        assert graph.captures >= 1 and graph.replays > graph.captures, (graph.captures, graph.replays)


def _drafts(
    gen: SpeculativeGenerator, prompts: list[list[int]], depths: list[int] | None = None
) -> list[tuple]:
    """Every proposed tree (tokens, parents) while decoding the prompts greedily (EAGLE-2 depth
    `depths[i]` for prompt i when given)."""
    trees, propose = [], gen.drafter.propose

    def recorded(*args):
        draft = propose(*args)
        tree = draft.tree(0)  # (a batch of one)
        trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return draft

    gen.drafter.propose = recorded
    for i, prompt in enumerate(prompts):
        if depths is not None:
            gen.drafter.depth = depths[i]
        gen.generate(input_ids=prompt, max_new_tokens=20)
    return trees


@pytest.mark.parametrize("tree", TREES)
def test_replayed_draft_graphs_propose_the_traced_graphs_trees(
    tiny_llama, chatml_tokenizer, replayed_graphs, tree
):
    """A drafter's graphs only change WHICH tokens are proposed (decoding stays lossless whatever they
    draft), so they are compared tree by tree: replayed (what CUDA would run) against the same graph
    functions traced without code generation (Python runs every call: nothing baked)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    prompts = [list(range(5 + i, 15 + 2 * i)) for i in range(3)]
    traced = _drafts(
        SpeculativeGenerator(model, chatml_tokenizer, _eagle(model, **tree), compile="eager"), prompts
    )
    replayed = _drafts(
        SpeculativeGenerator(model, chatml_tokenizer, _eagle(model, **tree), compile=True), prompts
    )
    assert replayed == traced and len(replayed) > 20


def test_replayed_graphs_are_captured_again_when_their_state_changes(
    tiny_llama, chatml_tokenizer, replayed_graphs
):
    """A long prompt makes both caches reallocate (new buffers) and a new EAGLE-2 depth changes the draft
    loop: graphs replayed over the old buffers or the old loop would propose other trees."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    model.config.max_position_embeddings = 4096
    prompts = [
        list(range(5, 15)),
        [5 + (7 * i) % 200 for i in range(1100)],
        list(range(8, 20)),
        list(range(6, 16)),
    ]
    depths = [4, 4, 4, 3]
    tree = {"top_k": 4, "depth": 4, "total_tokens": 60}  # every drafted node kept: the depth shows

    def make(compile: bool | str) -> SpeculativeGenerator:
        return SpeculativeGenerator(model, chatml_tokenizer, _eagle(model, **tree), compile=compile)

    traced = _drafts(make("eager"), prompts, depths)
    gen = make(True)
    replayed = _drafts(gen, prompts, depths)
    assert replayed == traced
    assert gen.runner.cache.max_length > 1024  # the long prompt did reallocate


def _oracle_runs(model, tokenizer, n_prompts: int = 4) -> list[tuple[list[int], list[int]]]:
    """(plain greedy, compiled decoding) per prompt with an oracle drafter whose right child is often the
    second sibling: accepted paths skip nodes, so the target's commit graph moves entries."""
    out = []
    for i in range(n_prompts):
        prompt = list(range(5 + i, 12 + 2 * i))
        ref = plain_greedy(model, prompt, 24)
        drafter = OracleDrafter(ref, model.config.vocab_size, depth=4, seed=i)
        gen = SpeculativeGenerator(model, tokenizer, drafter, compile=True)
        out.append((ref, gen.generate(input_ids=prompt, max_new_tokens=24).token_ids))
    return out


def test_replayed_target_graphs_commit_off_path_nodes(tiny_llama, chatml_tokenizer, replayed_graphs):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    model.generation_config.eos_token_id = None
    for ref, got in _oracle_runs(model, chatml_tokenizer):
        assert got == ref
    commits = [g for g in replayed_graphs if g.fn.__name__ == "_graph_commit"]
    assert sum(g.replays for g in commits) > 0  # off-path commits replayed, not just captured


def test_a_python_value_read_inside_a_graph_is_caught(
    tiny_llama, chatml_tokenizer, replayed_graphs, monkeypatch
):
    """The target's commit graph taking its start from the host-side length (a Python int, baked in at
    capture) instead of the device lengths: its replays copy to the capture's slots."""
    from spechead.inference.target.graphs import RowGraphs

    def stale_commit(self, nodes):  # nodes [1, K]: the generator's one row
        cache = self.runner.cache
        start = cache.lengths[0]  # WRONG inside a graph: the capture's length forever
        src, dst = start + nodes[0], start + torch.arange(nodes.shape[1])
        for layer in cache.row_layers:
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))

    monkeypatch.setattr(RowGraphs, "_graph_commit", stale_commit)
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    model.generation_config.eos_token_id = None
    assert any(ref != got for ref, got in _oracle_runs(model, chatml_tokenizer))


def test_a_host_sync_inside_a_graph_fails(replayed_graphs):
    f = Replayed(lambda x: x * int(x.sum()))
    with pytest.raises(RuntimeError, match="host synchronisation inside a captured graph"):
        f(torch.ones(2))


def test_replayed_batch_graphs_decode_like_plain_decoding(tiny_llama, chatml_tokenizer, replayed_graphs):
    """The compiled runner's verify and commit for several rows (target/graphs.py) as replayed graphs: rows of other
    lengths and budgets finish at other passes (their physical rows go idle), accepted paths skip nodes
    (the commit graph moves entries), and a second call replays the first call's captures at new
    lengths; every row equals plain greedy decoding."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    model.generation_config.eos_token_id = None
    p0, p1 = list(range(5, 14)), list(range(20, 24))
    drafter = OracleDrafter(plain_greedy(model, p0, 24), model.config.vocab_size, depth=4, seed=0)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile=True)
    gen.eos = set()
    prompts, budgets = [p0, p1, p0], [24, 17, 10]
    for _ in range(2):
        out = gen.generate_batch(input_ids=prompts, max_new_tokens=budgets, tree_for_batch=False)
        for b, (prompt, n) in enumerate(zip(prompts, budgets)):
            assert out[b].token_ids == plain_greedy(model, prompt, n), b
    names = ("_graph_verify", "_graph_commit")  # of the runner with 4 physical rows (not the batch of one's)
    rows = [g for g in replayed_graphs if g.fn.__name__ in names and g.fn.__self__.runner.capacity == 4]
    commit, verify = sorted(rows, key=lambda g: g.fn.__name__)
    assert verify.replays > verify.captures and commit.replays > 0, (verify.replays, commit.replays)


def _batch_drafts(gen: SpeculativeGenerator, prompts, budgets) -> tuple[list, list]:
    """Every row's output and every proposed batch of trees (tokens, parents) over two generate_batch
    calls (the second replays the first's captures at new lengths)."""
    trees, outputs = [], []
    drafter = gen.drafter
    propose = drafter.propose

    def recorded(*args):
        draft = propose(*args)
        trees.append((draft.tokens.tolist(), draft.parents.tolist()))
        return draft

    drafter.propose = recorded
    for _ in range(2):
        out = gen.generate_batch(input_ids=prompts, max_new_tokens=budgets, tree_for_batch=False)
        outputs.append([r.token_ids for r in out])
        assert drafter._rows is drafter._graphs is not None  # every row drafted by the kept graphs' rows
    return outputs, trees


@pytest.mark.parametrize("tree", TREES)
def test_replayed_batch_draft_graphs_propose_the_traced_trees(
    tiny_llama, chatml_tokenizer, replayed_graphs, tree
):
    """EAGLE's batch draft and accept as replayed graphs (drafters/eagle/graphs.py): rows of other lengths
    and budgets (idle physical rows drafting along once a row stops; 3 rows in 4): the same trees as the
    graph functions traced without code generation, pass by pass, and every row equals plain greedy."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    model.generation_config.eos_token_id = None
    prompts, budgets = [list(range(5, 14)), list(range(20, 24)), list(range(7, 19))], [20, 13, 8]

    def make(compile: bool | str) -> SpeculativeGenerator:
        gen = SpeculativeGenerator(model, chatml_tokenizer, _eagle(model, **tree), compile=compile)
        gen.eos = set()
        gen.drafter.batch_graphs = True  # (a CPU: by default only on CUDA)
        return gen

    traced = _batch_drafts(make("eager"), prompts, budgets)
    replayed = _batch_drafts(make(True), prompts, budgets)
    assert replayed == traced and len(replayed[1]) > 20
    for outputs in replayed[0]:
        for b, (prompt, n) in enumerate(zip(prompts, budgets)):
            assert outputs[b] == plain_greedy(model, prompt, n), b
    draft, accept = (g for g in replayed_graphs if g.fn.__name__ in ("_grow", "_graph_accept"))
    assert draft.replays > draft.captures and accept.replays > accept.captures


def test_replayed_batch_draft_graphs_follow_a_growing_head_cache(
    tiny_llama, chatml_tokenizer, replayed_graphs
):
    """A row decoding past its head cache's end mid-call makes the cache grow (new buffers): the batch
    draft graphs are captured again, not replayed over the old buffers (the same trees as traced)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    model.config.max_position_embeddings = 4096
    model.generation_config.eos_token_id = None
    prompts, budgets = [[5 + (7 * i) % 200 for i in range(860)], list(range(20, 26))], [170, 30]

    def make(compile: bool | str) -> SpeculativeGenerator:
        gen = SpeculativeGenerator(model, chatml_tokenizer, _eagle(model, **TREES[1]), compile=compile)
        gen.eos = set()
        gen.drafter.batch_graphs = True  # (a CPU: by default only on CUDA)
        return gen

    traced = _batch_drafts(make("eager"), prompts, budgets)
    gen = make(True)
    replayed = _batch_drafts(gen, prompts, budgets)
    assert replayed == traced
    (rows,) = gen.drafter._graphs._kept.values()
    assert rows.cache.max_length == 2048  # started at 1024 slots for the 860-token prompt
    for b, (prompt, n) in enumerate(zip(prompts, budgets)):
        assert replayed[0][1][b] == plain_greedy(model, prompt, n), b
