"""make_demo.py's data/demo/README.md: what the demo assets are and exactly how they were produced."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from demo_corpus import PROMPTS_PER_SET


def _size(path: Path) -> str:
    """Human-readable file size."""
    n = path.stat().st_size
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n} B"


def write_readme(out: Path, argv: list[str], args: argparse.Namespace, stats: dict) -> None:
    """Document what the assets are and exactly how they were produced."""
    files = "\n".join(
        f"| `{f.relative_to(out)}` | {_size(f)} |"
        for f in sorted([out / "chat.jsonl", *sorted((out / "target").iterdir())])
    )
    cfg = json.dumps(stats["config"], indent=2)
    text = f"""# Demo assets

Built by `scripts/make_demo.py`; do not edit by hand, rerun the script instead.

- `chat.jsonl`: {args.num_conversations} synthetic chat conversations (OpenAI `messages` format) from
  `make_conversations(n={args.num_conversations}, seed={args.seed})` (scripts/demo_corpus): {stats["num_kinds"]} task kinds
  (arithmetic, unit conversions, capitals, recipes, emails, summaries, Python snippets, ...).
- `prompts/`: the built-in prompt sets of `spechead.data.prompt_sets` (demo, demo-mt, demo-kinds,
  demo-tune; {PROMPTS_PER_SET} prompts each), drawn from held-out conversations (other seeds) by
  scripts/demo_corpus/prompts.py; `--prompts-only` rewrites just these.
- `target/`: a small `{stats["config"].get("architectures", ["LlamaForCausalLM"])[0]}` trained from scratch on that corpus (rendered with the ChatML
  chat template), saved in bfloat16 safetensors with its byte-level BPE tokenizer (vocab {len(stats["vocab"])}).
  It is the frozen demo target that the draft heads are trained against.
- `draft/` (made by `--draft`) and `medium/` (made by `--medium`): smaller Llamas with the target's
  tokenizer trained on the same split, the HF assisted-generation baseline's draft model and the
  tiny and medium levels of the `cascade` drafter; their READMEs record their commands and losses.

## Command

```
{stats["command"]}
```

Seed {args.seed}; {stats["threads"]} CPU threads; wall time {stats["wall_time"] / 60:.1f} min
(training {stats["train_time"] / 60:.1f} min). The tokenizer is trained on the training split only.

## Model

- parameters: {stats["num_params"]:,}
- hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads} heads ({args.num_kv_heads} KV heads),
  intermediate {args.intermediate_size}, max positions {args.max_position_embeddings}, untied embeddings
- special tokens: bos `<s>` = {stats["vocab"]["<s>"]}, eos `<|im_end|>` = {stats["vocab"]["<|im_end|>"]},
  pad `<pad>` = {stats["vocab"]["<pad>"]}

```json
{cfg}
```

## Training

- {args.steps} steps x batch {args.batch_size} x {args.seq_len} tokens = {stats["tokens_seen"]:,} tokens seen
  (train set {stats["train_tokens"]:,} tokens, {stats["tokens_seen"] / stats["train_tokens"]:.1f} epochs;
  validation {stats["val_tokens"]:,} tokens from {stats["num_val"]} held-out conversations, the last ones in `chat.jsonl`)
- AdamW (lr {args.lr}, betas 0.9/0.95, weight decay {args.weight_decay}), {args.warmup_steps} warmup steps then cosine,
  grad clip 1.0, fp32
- final train loss {stats["train_loss"]:.4f} (on as many training blocks as there are validation blocks),
  final validation loss {stats["val_loss"]:.4f} (nats/token, every token of the rendered chats)

Greedy completions of held-out prompts after training:

```
{chr(10).join(stats["samples"])}
```

## Files

| file | size |
|---|---|
{files}
"""
    (out / "README.md").write_text(text, encoding="utf-8")
