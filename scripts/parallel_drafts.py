"""Draft time of the parallel drafters (P-EAGLE, DFlash: ONE head forward per pass) beside EAGLE-3's depth-D
draft, at one target's shape; bench_gpu.py and bench_heads.py use it (a sibling module, found as
`python scripts/bench_gpu.py` finds its others).

Heads get random weights of the target's width and dtype (times are real, accepted lengths are not). A
P-EAGLE pass is timed as decoding runs it: the ACCEPTED positions committed since the last pass are
written to its cache in the same forward as the block of K - 1 futures (its `propose`); a DFlash pass is
the block forward alone (its accept injects the accepted positions' context K/V: timed as accept). Each
draft runs eager or compiled as decoding would run it (`use_compile`: bench_gpu times it as "graphs", the
CUDA default, beside its compiled EAGLE-3 draft).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.heads.dflash import DFlashConfig, DFlashHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.peagle import PEagleConfig, PEagleHead
from spechead.inference.drafters.dflash import DFlashDrafter
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.peagle import PEagleDrafter
from spechead.inference.evaluation.profiling import Timer
from spechead.inference.sampling import SamplingParams

BLOCKS = (8, 16)
ACCEPTED = 5  # positions a pass commits (about tau), as bench_gpu's accept


def _attached(head, model):
    """`head` in the target's dtype on its device, sharing its lm_head and embedding, in eval mode."""
    weight = model.get_input_embeddings().weight
    head = head.to(weight.device, weight.dtype).eval()
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    return head


def parallel_heads(
    model, draft_vocab: int, blocks: Sequence[int], dflash_layers: int, peagle_layers: int = 1
) -> dict[str, object]:
    """Random-weight heads of `model`'s width: {"peagle-K": PEagleHead of `peagle_layers` decoder layers,
    "dflash-K": DFlashHead of `dflash_layers`} per K."""
    cfg, heads = model.config, {}
    vocab = min(draft_vocab, cfg.vocab_size)
    with torch.device(model.get_input_embeddings().weight.device):
        for k in blocks:
            heads[f"peagle-{k}"] = _attached(
                PEagleHead(
                    PEagleConfig.from_target(
                        cfg, draft_vocab_size=vocab, block_size=k, num_layers=peagle_layers
                    )
                ),
                model,
            )
            heads[f"dflash-{k}"] = _attached(
                DFlashHead(DFlashConfig.from_target(cfg, block_size=k, num_layers=dflash_layers)), model
            )
    return heads


def time_peagle(
    head: PEagleHead,
    prompt: Tensor,
    hidden: dict[int, Tensor],
    root: int,
    timer: Timer,
    compile: bool | str = False,
    fused: bool = True,
) -> dict:
    """{draft_ms, accept_ms, drafts, nodes}: one pass (ACCEPTED new positions + the block) after the prompt,
    the draft compiled by `compile` (`use_compile`; False: eager); fused=False: through the head's modules
    instead of heads/fused.py's chain (an A/B: bench_fused_drafts.py)."""
    drafter, sampling = PEagleDrafter(head), [SamplingParams()]
    if not fused:
        drafter.head_step, drafter.head_logits = head.step, head.logits
    drafter.use_compile(compile)
    drafter.start([prompt], [hidden], [root])
    drafter.propose([root], sampling, [None])  # the whole prompt written
    tokens = prompt[None, :ACCEPTED].to(head.fc.weight.device)
    states = {layer: h[None, -ACCEPTED:] for layer, h in hidden.items()}
    drafter.accept(tokens, [ACCEPTED], states, [root])  # ACCEPTED positions pending
    # every timed pass writes those positions after the same prefix (a propose again redoes the last pass)
    draft = timer.ms(lambda: drafter.propose([root], sampling, [None]))
    accept = timer.ms(lambda: drafter.accept(tokens, [ACCEPTED], states, [root]))
    return {"draft_ms": draft, "accept_ms": accept, "drafts": head.block_size, "nodes": head.block_size + 1}


def time_dflash(
    head: DFlashHead,
    prompt: Tensor,
    hidden: dict[int, Tensor],
    root: int,
    timer: Timer,
    compile: bool | str = False,
    fused: bool = True,
) -> dict:
    """{draft_ms, accept_ms, drafts, nodes}: the block forward after the prompt (compiled by `compile`; fused
    as `time_peagle`'s); an accept of ACCEPTED."""
    drafter, sampling = DFlashDrafter(head), [SamplingParams()]
    if not fused:
        drafter.head_forward, drafter.head_inject = head, head.inject
    drafter.use_compile(compile)
    drafter.start([prompt], [hidden], [root])
    committed = drafter.lengths[0]
    draft = timer.ms(lambda: drafter.propose([root], sampling, [None]))
    tokens = prompt[None, :ACCEPTED]
    states = {layer: h[None, -ACCEPTED:] for layer, h in hidden.items()}
    lengths_t = drafter.lengths_t

    def restart() -> None:  # every accept after the prompt (host and device lengths)
        drafter.cache.set_lengths([committed])
        drafter.lengths_t = lengths_t

    accept = timer.ms(lambda: drafter.accept(tokens, [ACCEPTED], states, [root]), setup=restart)
    size = head.config.block_size
    return {"draft_ms": draft, "accept_ms": accept, "drafts": size - 1, "nodes": size}


def measure_parallel(
    heads: dict,
    prompt: Tensor,
    hidden: dict[int, Tensor],
    root: int,
    timer: Timer,
    compile: bool | str = False,
) -> dict:
    """{name: time_peagle / time_dflash row} for `parallel_heads`' heads; prompt [T], hidden {layer: [T, H]};
    each draft compiled by `compile`, or eager where that fails (the row's `draft_compile` says which)."""
    rows = {}
    for name, head in heads.items():
        layers = {layer: hidden[layer] for layer in head.config.target_layers}
        timed = time_peagle if isinstance(head, PEagleHead) else time_dflash
        try:
            rows[name] = {
                **timed(head, prompt, layers, root, timer, compile),
                "draft_compile": compile or "eager",
            }
        except Exception as err:  # noqa: BLE001 - a draft that fails to compile still gives eager numbers
            if not compile:
                raise
            failed = f"{compile} FAILED ({type(err).__name__}: {str(err).splitlines()[0][:120]}); eager"
            rows[name] = {**timed(head, prompt, layers, root, timer), "draft_compile": failed}
    return rows


def eagle3_draft_ms(
    model,
    prompt: Tensor,
    hidden: dict[int, Tensor],
    root: int,
    timer: Timer,
    depth: int = 7,
    draft_vocab: int = 32000,
) -> float:
    """EAGLE-3's depth-`depth` draft (EAGLE-2 dynamic tree, top-k 8, 64 nodes: bench_gpu's defaults), random
    weights: the propose alone, as bench_gpu times it."""
    cfg = model.config
    with torch.device(model.get_input_embeddings().weight.device):
        head_cfg = Eagle3Config.from_target(cfg, draft_vocab_size=min(draft_vocab, cfg.vocab_size))
        head = _attached(Eagle3Head(head_cfg), model)
    drafter = EagleDrafter(
        head, tree="dynamic", top_k=min(8, head_cfg.draft_vocab_size), depth=depth, total_tokens=64
    )
    layers = {layer: hidden[layer] for layer in head_cfg.target_layers}
    drafter.start([prompt], [layers], [root])
    return timer.ms(lambda: drafter.propose([root], [SamplingParams()], [None]))


def target_states(model, prompt: Tensor) -> tuple[dict[int, Tensor], int]:
    """The prompt [T]'s HF hidden states {index: [T, H]} (every index) and the target's greedy next token."""
    device = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        out = model(prompt[None].to(device), output_hidden_states=True)
    hidden = {i: h[0].clone() for i, h in enumerate(out.hidden_states)}
    return hidden, int(out.logits[0, -1].argmax())


def draft_table(
    model,
    timer: Timer,
    context: int,
    blocks: Sequence[int],
    dflash_layers: int,
    depth: int = 7,
    peagle_layers: int = 1,
) -> list[dict]:
    """Rows {drafter, drafts, forwards, draft_ms, x_eagle3}: EAGLE-3 depth `depth`, then each parallel head,
    after a random prompt of `context` tokens (bench_heads' table at its target's shape)."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=generator)
    hidden, root = target_states(model, prompt)
    eagle = eagle3_draft_ms(model, prompt, hidden, root, timer, depth)
    # (EAGLE-3's propose: depth 1 is the root's top-k from the accepted feature, each further depth a head call)
    rows = [{"drafter": f"eagle3 depth {depth}", "drafts": depth, "forwards": depth - 1, "draft_ms": eagle}]
    heads = parallel_heads(model, 32000, blocks, dflash_layers, peagle_layers)
    for name, row in measure_parallel(heads, prompt, hidden, root, timer).items():
        depth_of = heads[name].config.num_layers  # the head's own, as built
        label = (
            name.replace("-", " K=") + (f" ({depth_of} layers)" if depth_of > 1 else "")
            if name.startswith("peagle")
            else f"{name.replace('-', ' block ')} ({dflash_layers} layers)"
        )
        rows.append({"drafter": label, "drafts": row["drafts"], "forwards": 1, "draft_ms": row["draft_ms"]})
    return [{**row, "x_eagle3": row["draft_ms"] / eagle} for row in rows]


def chain_parents(nodes: int, device: torch.device) -> Tensor:
    """A chain's parents [1, nodes]: -1, 0, 1, ..."""
    return torch.arange(-1, nodes - 1, device=device)[None]


def project_parallel(
    rows: dict, runner, step_ms: float, commit_ms: float, timer: Timer, taus: Sequence[float]
) -> dict:
    """Each row with the target's verify of its chain (`runner`: bench_gpu's TargetRunner after its context)
    and the speedup projected as bench_gpu projects EAGLE-3's: tau * t_step / (t_verify(chain) + t_commit +
    t_draft + t_accept); None where tau exceeds what the chain can accept (drafts + 1)."""
    device = runner.model.get_input_embeddings().weight.device
    ids = torch.randint(0, runner.model.config.vocab_size, (1, 1 + max(r["nodes"] for r in rows.values())))
    ids, verify = ids.to(device), {}
    out = {}
    for name, row in rows.items():
        n = row["nodes"]
        if n not in verify:
            parents = chain_parents(n, device)
            verify[n] = timer.ms(lambda n=n, parents=parents: runner.verify(ids[:, :n], parents))
        pass_ms = verify[n] + commit_ms + row["draft_ms"] + row["accept_ms"]
        speedup = {str(t): (t * step_ms / pass_ms if t <= row["drafts"] + 1 else None) for t in taus}
        out[name] = {**row, "verify_ms": verify[n], "pass_ms": pass_ms, "draft_x_step": row["draft_ms"] / step_ms,
                     "projected_speedup": speedup}  # fmt: skip
    return out
