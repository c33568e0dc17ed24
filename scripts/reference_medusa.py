"""Time the Medusa authors' engine (`pip install medusa-llm`: MedusaModel.medusa_generate) on given prompts.

Run by scripts/bench_reference_medusa.py with the Python of a SEPARATE environment holding medusa-llm
(0.1, the release on PyPI: cartesian trees `medusa_choices` such as [1, 7, 6]) and the transformers 4.x
it was written for (its Llama copy does not run on transformers 5); it imports nothing of ours:

    /path/to/ref-env/bin/python scripts/reference_medusa.py JOB.json OUT.json

JOB.json: {"head": dir (FasterDecoding layout: scripts/export.py --format fasterdecoding, its
base_model_name_or_path the target), "eos": id, "max_new_tokens": n, "prompts": [[ids], ...],
"trees": {name: [1, k1, k2, ...]}, "device": "cpu" or "cuda" (optional)}. OUT.json: per tree each
prompt's new ids (cut after EOS and at max_new_tokens), seconds and target passes. One untimed warm-up
prompt first.

The one change to the reference: MedusaModel asks AutoTokenizer for the target's tokenizer, which
transformers 4.x cannot parse when transformers 5 wrote it, and decodes the whole answer to text after
every pass. Here the tokenizer is a stand-in that holds the given EOS id and, for that decode, keeps a
reference to the ids it is handed (no text, no copy): those are the engine's new ids. Every tensor it
computes is its own.
"""

from __future__ import annotations

import json
import sys
import types
import warnings

import torch
from reference_eagle import clock, count_passes, new_ids  # (beside this file: its folder is on sys.path)


class IdsTokenizer:
    """The engine's tokenizer stand-in: its EOS id, and `decode` keeping the ids it was given."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id = eos
        self.last = None

    def decode(self, ids, **_kwargs) -> str:
        self.last = ids  # input_ids[0, input_len:] of this pass (a view: no copy, no sync)
        return ""


def load(head: str, eos: int, device: str = "cpu"):
    """The reference MedusaModel (fp32) for the exported head (its config names the target)."""
    import medusa.model.medusa_model as mm

    tokenizer = IdsTokenizer(eos)
    mm.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda _path: tokenizer)
    placed = {} if device == "cpu" else {"device_map": device}
    model = mm.MedusaModel.from_pretrained(head, torch_dtype=torch.float32, **placed)
    return model.eval(), mm, tokenizer


def run_tree(model, counter, tokenizer, prompts, choices, eos: int, max_new: int, device: str) -> list[dict]:
    out = []
    for ids in [prompts[0], *prompts]:  # the first is an untimed warm-up
        x = torch.tensor([ids], device=device)
        counter[0], tokenizer.last = 0, None
        start = clock(device)
        with torch.inference_mode():
            for _ in model.medusa_generate(x, temperature=0.0, max_steps=max_new, medusa_choices=choices):
                if tokenizer.last.shape[-1] >= max_new:  # (the engine stops at its EOS itself)
                    break
        seconds = clock(device) - start
        got = new_ids(tokenizer.last.tolist(), eos, max_new)
        out.append({"ids": got, "s": seconds, "passes": counter[0]})
    return out[1:]


def main(job_file: str, out_file: str) -> int:
    warnings.filterwarnings("ignore")
    job = json.loads(open(job_file).read())
    eos, max_new, prompts = int(job["eos"]), int(job["max_new_tokens"]), job["prompts"]
    device = job.get("device", "cpu")
    model, mm, tokenizer = load(job["head"], eos, device)
    counter = count_passes(mm)
    import transformers

    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "threads": torch.get_num_threads(), "trees": {}}  # fmt: skip
    for name, choices in job["trees"].items():
        result["trees"][name] = run_tree(model, counter, tokenizer, prompts, choices, eos, max_new, device)
    with open(out_file, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
