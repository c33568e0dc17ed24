"""On CUDA a decoding pass waits for the device ONCE (the acceptance's transfer): the drafted tree stays on
the GPU, host values go over without blocking copies. Counted with PyTorch's sync debug mode (every
synchronising call warns). Skipped where there is no GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHead
from spechead.inference.drafters.base import Drafter
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.drafters.per_row import RowDrafter, rows_drafter
from spechead.inference.evaluation.profiling import count_syncs
from spechead.inference.generator import SpeculativeGenerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def syncs_and_passes(
    gen: SpeculativeGenerator, prompt: list[int], n: int, **sampling
) -> tuple[int, int, list[int]]:
    """(host waits for the GPU, target passes, tokens) of one generate."""
    result, syncs = count_syncs(
        torch.device("cuda"), lambda: gen.generate(input_ids=prompt, max_new_tokens=n, **sampling)
    )
    return syncs, result.stats.target_passes, result.token_ids


def test_host_to_device_neither_waits_nor_reads_the_source_late():
    from spechead.inference.devices import host_to_device

    x = torch.arange(1000)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # work queued on the stream: a blocking copy would wait for all of it
        big = big @ big.T / 4096
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = host_to_device(x, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    x.zero_()  # the source changes before the copy has run: the copy read its own pinned buffer
    assert y.device.type == "cuda" and y.cpu().tolist() == list(range(1000))
    # an expanded view (stride 0: Medusa's batch parents, one tree for every row) copies as its values
    rows = host_to_device(torch.arange(4).expand(3, 4), torch.device("cuda"))
    assert rows.cpu().tolist() == [[0, 1, 2, 3]] * 3


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("tree", ["dynamic", "static", "medusa", "peagle", "dflash"])
def test_one_wait_for_the_gpu_per_pass(tiny_llama, chatml_tokenizer, tree, sampled):
    """The fast path (target and draft as CUDA graphs, compile="graphs": captured in seconds; inductor's
    kernels change nothing on the host; Medusa's heads eager; P-EAGLE's and DFlash's block forward as a
    graph), each next draft queued before the
    acceptance is read (engine/loop.py). Eager, transformers' own forward may wait too: not counted.
    Sampled (temperature and top-k; top-p reads its two flags back once a guess): rule A as batched
    tensor ops (queued_acceptance.py), whose packed result is the pass's one wait as greedy's is."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    if tree == "medusa":
        cfg = model.config
        medusa = MedusaHead(
            MedusaConfig(
                hidden_size=cfg.hidden_size,
                vocab_size=cfg.vocab_size,
                num_heads=3,
                target_num_layers=cfg.num_hidden_layers,
            )
        )
        drafter: Drafter | RowDrafter = MedusaDrafter(medusa.to("cuda"), choices)
    elif tree in ("peagle", "dflash"):  # one block forward a pass (random heads: the waits are the point)
        from .drafters.parallel_heads import dflash_head, parallel_drafter, peagle_head

        head = (peagle_head if tree == "peagle" else dflash_head)(model, None)
        drafter = parallel_drafter(head.to("cuda"), f"{tree}_tree")
    else:
        head = EagleHead(EagleConfig.from_target(model.config)).to("cuda")
        head.attach_target_modules(
            lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
        )
        options = {"top_k": 4, "depth": 4, "total_tokens": 16} if tree == "dynamic" else {}
        drafter = EagleDrafter(head.eval(), tree="dynamic" if tree == "dynamic" else choices, **options)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile="graphs")
    # (CUDA's default: the next draft queued first, a batch of one too: Medusa's and the compiled EAGLE
    # drafter's own queued forms; sampled: rule A over their deterministic children)
    assert (
        gen.ahead
        and rows_drafter(drafter).queues(1)
        and getattr(drafter, "rule", "deterministic") == "deterministic"
    )
    gen.eos = set()
    prompt = list(range(5, 17))
    reference = SpeculativeGenerator(model, chatml_tokenizer, None)
    reference.eos = set()  # (both run to max_new_tokens)
    plain = reference.generate(input_ids=prompt, max_new_tokens=40)
    sampling = {"temperature": 0.9, "top_k": 20, "seed": 3} if sampled else {}
    gen.generate(input_ids=prompt, max_new_tokens=40, **sampling)  # warm-up: graphs captured, buffers
    short = syncs_and_passes(gen, prompt, 10, **sampling)
    long = syncs_and_passes(gen, prompt, 40, **sampling)
    if not sampled:
        assert long[2] == plain.token_ids  # (and lossless)
    per_pass = (long[0] - short[0]) / (long[1] - short[1])  # the prefill's and the end's waits cancel out
    assert per_pass <= 1.0, (
        f"{per_pass:.2f} waits a pass ({long[0]} in {long[1]} passes, {short[0]} in {short[1]})"
    )


def test_one_wait_for_the_gpu_per_batch_pass(tiny_llama, chatml_tokenizer):
    """Batch decoding's fast path (the target's batch passes and every row's EAGLE draft as CUDA graphs,
    each next draft queued before the acceptance is read: engine/loop.py): the trees stay on the
    GPU, the acceptance's transfer is the pass's one wait."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda")
    head = EagleHead(EagleConfig.from_target(model.config)).to("cuda")
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    drafter = EagleDrafter(head.eval(), tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile="graphs")
    gen.eos = set()
    prompts = [list(range(5, 17)), list(range(20, 27))]
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    plain.eos = set()  # (both run to max_new_tokens)

    def run(n: int) -> tuple[int, int, list[list[int]]]:
        def decode():
            return gen.generate_batch(input_ids=prompts, max_new_tokens=n, tree_for_batch=False)

        results, syncs = count_syncs(torch.device("cuda"), decode)
        return syncs, results[0].stats.target_passes, [r.token_ids for r in results]

    run(40)  # warm-up: graphs captured, buffers allocated
    short, long = run(10), run(40)
    assert long[2] == [plain.generate(input_ids=p, max_new_tokens=40).token_ids for p in prompts]
    per_pass = (long[0] - short[0]) / (long[1] - short[1])
    assert per_pass <= 1.0, (
        f"{per_pass:.2f} waits a pass ({long[0]} in {long[1]} passes, {short[0]} in {short[1]})"
    )
