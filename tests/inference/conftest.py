"""Decoding tests run against BOTH target cache back-ends (runner.py: "dynamic" and "static").

Every test in the modules below that builds a SpeculativeGenerator without naming `cache=` gets the
back-end of its parametrization (ids `[dynamic]` / `[static]`), so new tests there are covered too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.runner import CACHES

BOTH_BACKENDS = {
    "test_generator",
    "test_sampling",
    "test_medusa_drafter",
    "test_draft_model_tree",
    "test_lookahead",
    "test_layer_skip",
    "test_foreign_heads",
    "test_engine",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cache_backend" in metafunc.fixturenames and Path(metafunc.module.__file__).stem in BOTH_BACKENDS:
        metafunc.parametrize("cache_backend", CACHES, indirect=True)


@pytest.fixture(autouse=True)
def cache_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The cache back-end generators of this test use by default."""
    kind = getattr(request, "param", SpeculativeGenerator.default_cache)
    monkeypatch.setattr(SpeculativeGenerator, "default_cache", kind)
    return kind


@pytest.fixture(scope="module")
def positional(tiny_llama, chatml_tokenizer):
    """A target whose argmaxes depend on rotary positions: a small rope_theta and sharp attention (q/k
    weights x8). With the default tiny target, wrong tree position ids still reproduce greedy decoding."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3, rope_theta=10.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer
