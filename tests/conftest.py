"""Shared fixtures: tiny tokenizers with two different chat templates and a tiny Llama target.

Everything is built from configs in a temporary directory; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository
# scripts/demo_corpus (the demo-asset generators, not in the installed package) imports as `demo_corpus`,
# as it does for the scripts beside it
sys.path.insert(0, str(ROOT / "scripts"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models: one thread avoids thread-pool overhead that dominates at these sizes (and a busy CI box).
torch.set_num_threads(1)
# A private Hugging Face home: tests never read or write the user's caches (datasets, hub).
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="spechead-tests-hf-")


def load_path(name: str, path: Path):
    """The module in file `path`, loaded afresh as `name` (tests and scripts are not packages); in
    sys.modules under that name before it runs, as an import would put it (dataclasses look it up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_xdist_auto_num_workers(config) -> int:
    """`pytest -n auto`: one worker per usable CPU (tests/workers.py). xdist's own count is psutil's
    physical cores of the host (psutil comes with accelerate), which is 1 on a 2-thread SMT VM and the
    host's cores in a container limited to a few."""
    return load_path("spechead_test_workers", Path(__file__).with_name("workers.py")).usable_cpus()


CHATML_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-3 style: headers with special tokens, no newline after end-of-turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = [
    "<pad>",
    "<s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Please add 12 and 30. 12 plus 30 is 42.",
    "Translate hello into Spanish: hola. Thanks! You are welcome.",
    "user assistant system Write a short poem about the sea and the sky.",
]


def build_tokenizer(template: str, eos: str):
    """A byte-level BPE tokenizer (vocab <= 384) with `template` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token=eos,
        pad_token="<pad>",
        chat_template=template,
    )


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_tokenizer(CHATML_TEMPLATE, "<|im_end|>")


@pytest.fixture(scope="session")
def llama3_tokenizer():
    return build_tokenizer(LLAMA3_TEMPLATE, "<|eot_id|>")


def build_tiny_llama(vocab_size: int, *, layers: int = 4, hidden: int = 32, seed: int = 0, **config):
    """A tiny LlamaForCausalLM from a config (random weights, for unit tests only); extra keyword
    arguments go to LlamaConfig (e.g. rope_theta)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **config,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory fixture: `tiny_llama(vocab_size, layers=..., hidden=..., seed=...)` (see build_tiny_llama)."""
    return build_tiny_llama


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, chatml_tokenizer) -> Path:
    """A saved tiny Llama target + ChatML tokenizer directory, loadable with from_pretrained."""
    path = tmp_path_factory.mktemp("tiny_target")
    model = build_tiny_llama(len(chatml_tokenizer))
    model.config.eos_token_id = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.bos_token_id = chatml_tokenizer.bos_token_id
    model.config.pad_token_id = chatml_tokenizer.pad_token_id
    model.save_pretrained(path)
    chatml_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gemma2_target_dir(tmp_path_factory, chatml_tokenizer) -> Path:
    """A saved tiny Gemma-2 target (soft-capped attention: transformers refuses sdpa for it) + ChatML
    tokenizer directory."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = tmp_path_factory.mktemp("gemma2_target")
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(chatml_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    Gemma2ForCausalLM(config).save_pretrained(path)
    chatml_tokenizer.save_pretrained(path)
    return path


QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Please add 12 and 30.", "12 plus 30 is 42."),
    ("Translate hello into Spanish.", "Hello in Spanish is hola."),
    ("Write a short poem about the sea.", "The sea is wide, the sky is blue, the waves come in and out."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("Please add 2 and 3.", "2 plus 3 is 5."),
]


def write_chats(path: Path, n: int = 48) -> Path:
    """`n` short conversations (some multi-turn, some with a system prompt) as messages JSONL."""
    with path.open("w") as f:
        for i in range(n):
            q, a = QUESTIONS[i % len(QUESTIONS)]
            msgs = [{"role": "system", "content": "You are brief."}] if i % 5 == 0 else []
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if i % 3 == 0:
                q2, a2 = QUESTIONS[(i + 1) % len(QUESTIONS)]
                msgs += [{"role": "user", "content": "Thanks! " + q2}, {"role": "assistant", "content": a2}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


@pytest.fixture
def fake_hub():
    """A local in-memory Hugging Face Hub (tests/fake_hub.py) serving on `fake_hub.url` for the test."""
    name = "spechead_tests_fake_hub"  # loaded once
    module = sys.modules.get(name) or load_path(name, Path(__file__).with_name("fake_hub.py"))
    with module.FakeHub() as hub:
        yield hub


@pytest.fixture(scope="session")
def script():
    """`script("benchmark")`: scripts/benchmark.py loaded as a fresh module (scripts are not a package)."""

    def load(name: str):
        return load_path(f"{name}_script", ROOT / "scripts" / f"{name}.py")

    return load


@pytest.fixture(scope="session")
def workers():
    """tests/workers.py, as `pytest -n auto` loads it."""
    return load_path("spechead_test_workers", Path(__file__).with_name("workers.py"))


@pytest.fixture
def placements(monkeypatch) -> list:
    """The `device_map` of every AutoModelForCausalLM.from_pretrained call in the test (None when not
    given); the real loader runs."""
    from transformers import AutoModelForCausalLM

    real, seen = AutoModelForCausalLM.from_pretrained.__func__, []

    def recorded(cls, *args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recorded))
    return seen


@pytest.fixture
def int8_cpu(monkeypatch):
    """This CPU reports the kernels the int8 draft default is on for (AVX512: draft_weights.INT8_AUTO_CPUS),
    whatever the machine running the tests has (the kernel itself runs on any)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")


@pytest.fixture
def reregistered(monkeypatch):
    """Replace a registered family's fields for one test."""

    import dataclasses

    from spechead.heads.families import _FAMILIES, family_named

    def replace(name: str, **fields):
        fam = dataclasses.replace(family_named(name), **fields)
        monkeypatch.setitem(_FAMILIES, name, fam)
        return fam

    return replace


def _medusa_for(model, num_heads: int = 3):
    """Medusa heads sized for `model` whose projections start as its lm_head (head k guesses what the
    target would say one position earlier: a weak but real drafter)."""
    from spechead.heads import MedusaConfig, MedusaHead

    cfg = model.config
    head = MedusaHead(
        MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=num_heads,
                     target_num_layers=cfg.num_hidden_layers)
    )  # fmt: skip
    return head.init_from_lm_head_(model.lm_head.weight)


@pytest.fixture(scope="session")
def medusa_for():
    """`medusa_for(model, num_heads=3)`: a MedusaHead for that target (see _medusa_for)."""
    return _medusa_for
