"""Time the EAGLE authors' engine (`pip install eagle-llm`: EaModel, EAGLE-1 static trees) on given prompts.

Run by scripts/bench_reference.py with the Python of a SEPARATE environment holding eagle-llm and the
transformers 4.x it was written for (its Llama copy does not run on transformers 5); it imports
neither spechead nor anything of ours:

    /path/to/ref-env/bin/python scripts/reference_eagle.py JOB.json OUT.json

JOB.json: {"target": dir, "head": dir (EAGLE-1 layout: scripts/export.py --format eagle), "eos": id,
"max_new_tokens": n, "prompts": [[ids], ...], "trees": {name: choices or null for the engine's default}, "plain": bool,
"device": "cpu" or "cuda" (optional, default cpu)}. OUT.json: per
tree (and "plain": the engine's own `naive_generate`) each prompt's new ids (cut after EOS and at
max_new_tokens), seconds and target passes. One untimed warm-up prompt first.

The one change to the reference: its EaModel asks AutoTokenizer for the target's tokenizer only to
read eos_token_id, and transformers 4.x cannot parse a tokenizer.json written by transformers 5, so
that lookup returns the given EOS id instead. Every tensor it computes is its own.
"""

from __future__ import annotations

import json
import sys
import time
import types
import warnings

import torch


def load(target: str, head: str, eos: int, device: str = "cpu"):
    """The reference EaModel (fp32) for target + head, on `device` (its own loading: device_map)."""
    import eagle.model.ea_model as ea

    ea.AutoTokenizer = types.SimpleNamespace(  # the eos lookup only (see the module doc)
        from_pretrained=lambda _path: types.SimpleNamespace(eos_token_id=eos)
    )
    placed = {} if device == "cpu" else {"device_map": device}
    model = ea.EaModel.from_pretrained(
        base_model_path=target, ea_model_path=head, torch_dtype=torch.float32, **placed
    )
    return model.eval(), ea


def clock(device: str) -> float:
    """perf_counter after the device's queued work is done (CUDA: synchronised)."""
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter()


def count_passes(module) -> list[int]:
    """Count the engine's tree verification passes (`module.tree_decoding`: eagle-llm's and medusa-llm's)."""
    counter = [0]
    inner = module.tree_decoding

    def counted(*args, **kwargs):
        counter[0] += 1
        return inner(*args, **kwargs)

    module.tree_decoding = counted
    return counter


def use_tree(model, choices: list[list[int]]) -> None:
    """Draft `choices` too (the engine's draft tree is fixed at load as mc_sim_7b_63: its init_tree)."""
    import eagle.model.cnets as cnets

    model.ea_layer.tree = choices
    model.ea_layer.tree_buffer = cnets.generate_tree_buffers(
        choices, model.ea_layer.embed_tokens.weight.device
    )


def new_ids(ids: list[int], eos: int, limit: int) -> list[int]:
    """ids cut after the first EOS and at `limit` tokens (the engine may emit past both in its last pass)."""
    if eos in ids:
        ids = ids[: ids.index(eos) + 1]
    return ids[:limit]


def run_tree(model, counter, prompts, choices, eos: int, max_new: int, device: str = "cpu") -> list[dict]:
    use_tree(model, choices)
    out = []
    for ids in [prompts[0], *prompts]:  # the first is an untimed warm-up
        x = torch.tensor([ids], device=device)
        counter[0] = 0
        start = clock(device)
        with torch.inference_mode():
            y = model.eagenerate(x, temperature=0.0, max_new_tokens=max_new, tree_choices=choices)
        seconds = clock(device) - start
        out.append(
            {"ids": new_ids(y[0, len(ids) :].tolist(), eos, max_new), "s": seconds, "passes": counter[0]}
        )
    return out[1:]


def run_plain(model, prompts, eos: int, max_new: int, device: str = "cpu") -> list[dict]:
    out = []
    for ids in [prompts[0], *prompts]:
        x = torch.tensor([ids], device=device)
        start = clock(device)
        y = x
        with torch.inference_mode():
            for y in model.naive_generate(x, temperature=0.0, max_steps=max_new):
                if y.shape[1] - len(ids) >= max_new:
                    break
        seconds = clock(device) - start
        got = new_ids(y[0, len(ids) :].tolist(), eos, max_new)
        out.append({"ids": got, "s": seconds, "passes": max(len(got) - 1, 1)})  # the prefill emits the first
    return out[1:]


def main(job_file: str, out_file: str) -> int:
    warnings.filterwarnings("ignore")
    job = json.loads(open(job_file).read())
    eos, max_new, prompts = int(job["eos"]), int(job["max_new_tokens"]), job["prompts"]
    device = job.get("device", "cpu")
    model, ea = load(job["target"], job["head"], eos, device)
    counter = count_passes(ea)
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "trees": {}, "choices": {}}
    import transformers

    result["transformers"] = transformers.__version__
    for name, choices in job["trees"].items():
        choices = choices or ea.mc_sim_7b_63  # None: the engine's default tree
        result["choices"][name] = choices
        result["trees"][name] = run_tree(model, counter, prompts, choices, eos, max_new, device)
    if job.get("plain"):
        result["plain"] = run_plain(model, prompts, eos, max_new, device)
    with open(out_file, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
