#!/usr/bin/env python
"""Build the shipped demo assets: a chat corpus, a BPE tokenizer and a small Llama target trained on it.

    python scripts/make_demo.py                 # writes data/demo/{chat.jsonl,prompts/,target/,README.md}
    python scripts/make_demo.py --prompts-only  # rewrites only data/demo/prompts/*.jsonl (seconds)

The corpus and prompt generators live beside this script in scripts/demo_corpus/ (demo tooling, not
part of the installed library, which reads only the files written here).

Everything is deterministic given the arguments (seeded corpus, tokenizer and training) and runs
offline on CPU. The target is saved in bfloat16 to keep the repository small.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from demo_corpus import PROMPT_SETS, PROMPTS_PER_SET, make_conversations, prompt_rows
from demo_readme import write_readme
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    get_cosine_schedule_with_warmup,
)

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults build the shipped assets."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "data" / "demo", help="output folder")
    p.add_argument("--num-conversations", type=int, default=12000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.03, help="share of conversations held out")
    p.add_argument(
        "--arch", choices=("llama", "qwen3"), default="llama",
        help="the target's architecture: llama (the shipped demo) or qwen3 (the second target of "
        "scripts/second_target.sh: q/k norms, another family the heads must train on)",
    )  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=100, help="steps between quick validation passes")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--draft", action="store_true",
        help="instead: train a small draft LM with the existing target's tokenizer on the same corpus into "
        "OUT/draft (the assistant model of HF assisted generation in scripts/benchmark.py); use with e.g. "
        "--hidden-size 64 --num-layers 2 --num-heads 2 --num-kv-heads 1 --intermediate-size 192",
    )  # fmt: skip
    p.add_argument(
        "--medium", action="store_true",
        help="instead: train the medium LM of the demo cascade (tiny draft -> medium -> target, the "
        "`cascade` drafter) like --draft, into OUT/medium; use with e.g. --hidden-size 128 --num-layers 3 "
        "--num-heads 4 --num-kv-heads 2 --intermediate-size 320",
    )  # fmt: skip
    p.add_argument(
        "--prompts-only", action="store_true",
        help=f"instead: rewrite only OUT/prompts/NAME.jsonl, the built-in prompt sets ({PROMPTS_PER_SET} each)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.draft + args.medium + args.prompts_only > 1:
        p.error("give at most one of --draft, --medium and --prompts-only")
    return args


def write_corpus(convs: list[dict], path: Path) -> None:
    """One `{"messages": [...]}` JSON object per line (UTF-8, not ASCII-escaped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for conv in convs:
            f.write(json.dumps({"messages": conv["messages"]}, ensure_ascii=False) + "\n")


def write_prompt_sets(out: Path, n: int = PROMPTS_PER_SET) -> None:
    """OUT/prompts/NAME.jsonl for every built-in prompt set: n rows {question_id, category, turns} each."""
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    for name in PROMPT_SETS:
        lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in prompt_rows(name, n)]
        (out / "prompts" / f"{name}.jsonl").write_text("".join(lines), encoding="utf-8")


def train_tokenizer(convs: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on roles and contents, wrapped with the ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # so decode() round-trips the original text
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the pieces the template emits around special tokens, not on the rendered text:
    # the trainer would otherwise learn merges inside "<|im_start|>" etc.
    texts = (f"{m['role']}\n{m['content']}\n" for c in convs for m in c["messages"])
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def pack(tok: PreTrainedTokenizerFast, convs: list[dict], seq_len: int) -> torch.Tensor:
    """Render with the chat template, concatenate and cut into (N, seq_len) blocks (tail dropped)."""
    ids: list[int] = []
    for conv in convs:
        text = tok.apply_chat_template(conv["messages"], tokenize=False)
        ids += tok(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"corpus too small: {len(ids)} tokens < seq_len {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)  # (N, T)


def build_model(args: argparse.Namespace, tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A fresh fp32 model of `--arch` sized by the CLI, with the tokenizer's special ids in its config."""
    torch.manual_seed(args.seed)
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[args.arch]
    cfg = config_class(
        vocab_size=len(tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,  # Qwen3's default (128) is not hidden / heads
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return AutoModelForCausalLM.from_config(cfg)


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int, max_blocks: int | None = None
) -> float:
    """Mean next-token loss over (up to `max_blocks`) blocks, weighted by predicted tokens."""
    model.eval()
    blocks = blocks[:max_blocks] if max_blocks else blocks
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        x = blocks[i : i + batch_size]  # (B, T)
        n = x.numel() - len(x)  # every position but the last predicts a token
        total += model(input_ids=x, labels=x).loss.item() * n
        count += n
    model.train()
    return total / count


def train(
    model: LlamaForCausalLM, train_blocks: torch.Tensor, val_blocks: torch.Tensor, args: argparse.Namespace
) -> dict:
    """AdamW + warmup/cosine on shuffled blocks for `args.steps` steps; returns loss statistics."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup_steps, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    order, pos = torch.randperm(len(train_blocks), generator=gen), 0
    model.train()
    start, recent = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        if pos + args.batch_size > len(order):  # new epoch: reshuffle
            order, pos = torch.randperm(len(train_blocks), generator=gen), 0
        x = train_blocks[order[pos : pos + args.batch_size]]  # (B, T)
        pos += args.batch_size
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            val = evaluate(model, val_blocks, args.batch_size, max_blocks=64)
            train_loss = sum(recent) / len(recent)
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d}/{args.steps}  train {train_loss:.4f}  val(64 blocks) {val:.4f}  "
                f"lr {sched.get_last_lr()[0]:.2e}  {elapsed / step:.2f} s/step  {elapsed:.0f} s",
                flush=True,
            )
            recent = []
    train_time = time.perf_counter() - start
    final_train = evaluate(model, train_blocks, args.batch_size, max_blocks=len(val_blocks))
    final_val = evaluate(model, val_blocks, args.batch_size)
    print(
        f"final: train loss {final_train:.4f}  val loss {final_val:.4f}  ({train_time:.0f} s training)",
        flush=True,
    )
    return {"train_loss": final_train, "val_loss": final_val, "train_time": train_time}


@torch.no_grad()
def show_samples(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, convs: list[dict], n: int = 3
) -> list[str]:
    """Greedy completions of the first user turn of `n` held-out conversations."""
    model.eval()
    shown = []
    for conv in convs[:n]:
        msgs = conv["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        prompt = tok.apply_chat_template(msgs[: first_user + 1], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, P)
        out = model.generate(
            ids,
            max_new_tokens=96,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        text = f"USER: {msgs[first_user]['content']}\nMODEL: {reply}\nREFERENCE: {msgs[first_user + 1]['content']}"
        print(f"--- sample ---\n{text}", flush=True)
        shown.append(text)
    return shown


def save_target(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, path: Path) -> None:
    """Save the model in bfloat16 safetensors with a matching generation config, plus the tokenizer."""
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    # Shards under 5 MB keep every tracked file small (the whole demo folder stays under 20 MB).
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="4MB")
    tok.save_pretrained(path)
    for f in path.iterdir():  # safetensors are written 0600; shipped assets should be readable by all
        f.chmod(0o644)


SMALL_MODELS = {
    "draft": (
        "Demo draft model",
        "the assistant model for the HF assisted-generation baseline of `scripts/benchmark.py` and the "
        "tiny model of the `cascade` drafter",
    ),
    "medium": (
        "Demo medium model",
        "the middle level of the `cascade` drafter (the draft model drafts for it, its verified output "
        "drafts for the target)",
    ),
}


def make_small(args: argparse.Namespace, argv: list[str], name: str) -> None:
    """Train a small LM with the target's tokenizer on the same training split -> OUT/NAME."""
    t0 = time.perf_counter()
    out = args.out.resolve()
    tok = PreTrainedTokenizerFast.from_pretrained(out / "target")
    convs = make_conversations(args.num_conversations, seed=args.seed, with_kind=True)
    n_val = max(1, math.ceil(len(convs) * args.val_fraction))
    train_blocks, val_blocks = (
        pack(tok, convs[:-n_val], args.seq_len),
        pack(tok, convs[-n_val:], args.seq_len),
    )
    model = build_model(args, tok)
    print(f"{name} model: {model.num_parameters():,} parameters", flush=True)
    stats = train(model, train_blocks, val_blocks, args)
    save_target(model, tok, out / name)
    command = "python scripts/make_demo.py" + "".join(f" {shlex.quote(a)}" for a in argv)
    title, role = SMALL_MODELS[name]
    (out / name / "README.md").write_text(
        f"# {title}\n\nA small `LlamaForCausalLM` with the demo target's tokenizer, trained on the same "
        f"demo corpus split: {role}.\n\n```\n{command}\n```\n\n{model.num_parameters():,} parameters; "
        f"{args.steps} steps x batch {args.batch_size} x {args.seq_len} tokens; final train loss "
        f"{stats['train_loss']:.4f}, validation loss {stats['val_loss']:.4f}; "
        f"{(time.perf_counter() - t0) / 60:.1f} min on {args.threads} CPU threads.\n",
        encoding="utf-8",
    )
    (out / name / "README.md").chmod(0o644)
    print(f"done in {time.perf_counter() - t0:.0f} s -> {out / name}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Build corpus, tokenizer and target into `--out` (or, with --draft / --medium, that small model)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.draft or args.medium:
        return make_small(args, argv, "draft" if args.draft else "medium")
    if args.prompts_only:
        return write_prompt_sets(args.out.resolve())
    t0 = time.perf_counter()
    out = args.out.resolve()

    convs = make_conversations(args.num_conversations, seed=args.seed, with_kind=True)
    write_corpus(convs, out / "chat.jsonl")
    n_val = max(1, math.ceil(len(convs) * args.val_fraction))
    train_convs, val_convs = convs[:-n_val], convs[-n_val:]
    print(f"corpus: {len(convs)} conversations ({n_val} held out) -> {out / 'chat.jsonl'}", flush=True)
    write_prompt_sets(out)

    tok = train_tokenizer(train_convs, args.vocab_size)
    train_blocks, val_blocks = pack(tok, train_convs, args.seq_len), pack(tok, val_convs, args.seq_len)
    print(
        f"tokenizer: {len(tok)} tokens; train {train_blocks.numel():,} tokens, val {val_blocks.numel():,}",
        flush=True,
    )

    model = build_model(args, tok)
    n_params = model.num_parameters()
    print(f"model: {n_params:,} parameters", flush=True)
    stats = train(model, train_blocks, val_blocks, args)
    samples = show_samples(model, tok, val_convs)
    save_target(model, tok, out / "target")

    stats.update(
        command="python scripts/make_demo.py" + "".join(f" {shlex.quote(a)}" for a in argv),
        threads=args.threads,
        num_kinds=len({c["kind"] for c in convs}),
        num_val=n_val,
        vocab=tok.get_vocab(),
        num_params=n_params,
        config={k: v for k, v in model.config.to_diff_dict().items() if k not in ("transformers_version",)},
        tokens_seen=args.steps * args.batch_size * args.seq_len,
        train_tokens=train_blocks.numel(),
        val_tokens=val_blocks.numel(),
        samples=samples,
        wall_time=time.perf_counter() - t0,
    )
    write_readme(out, argv, args, stats)
    print(f"done in {stats['wall_time']:.0f} s -> {out}", flush=True)


if __name__ == "__main__":
    main()
