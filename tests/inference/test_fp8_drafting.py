"""Drafting with FP8 per-depth layers (`from_pretrained(..., draft_fp8=True)`, heads/fp8.py): the head
really drafts through its e4m3 weights (the fused step's output moves by FP8 rounding), and decoding
stays lossless: greedy output equals the target's own, eager, traced as one graph and at batch 3."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from spechead.heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead
from spechead.heads.fp8 import Fp8Linear
from spechead.inference.drafter_specs import drafter_options
from spechead.inference.generator import SpeculativeGenerator

from .hf_reference import hf_greedy

PROMPTS = [[5, 9, 11, 7], [3, 4, 5, 6, 7, 8, 9], [12, 13]]


@pytest.fixture(scope="module")
def head_dir(tiny_target_dir, tmp_path_factory):
    config = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, config.num_hidden_layers]))
    return head.save_pretrained(tmp_path_factory.mktemp("fp8") / "eagle3")


@pytest.mark.parametrize("compile", [None, "eager"])
def test_fp8_drafting_is_lossless(tiny_target_dir, head_dir, compile):
    path, options = drafter_options(f"{head_dir}@draft_fp8=1,top_k=4,depth=4,total_tokens=16")
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, draft_compile=compile, **options)
    head = gen.drafter.head
    assert isinstance(head.midlayer.self_attn.qkv_proj_fp8, Fp8Linear) and isinstance(
        head.midlayer.mlp.down_proj, Fp8Linear
    )
    gen.eos = set()
    refs = [hf_greedy(tiny_target_dir, p, 16) for p in PROMPTS]
    for prompt, ref in zip(PROMPTS, refs):
        assert gen.generate(input_ids=prompt, max_new_tokens=16).token_ids == ref
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=16, tree_for_batch=False)
    assert [r.token_ids for r in batch] == refs


def test_the_draft_step_runs_the_fp8_weights(tiny_target_dir, head_dir):
    """The drafter's (fused) step on the same inputs: FP8 moves it by rounding, not more."""
    plain = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), calibrate=False)
    fp8 = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), str(head_dir), calibrate=False, draft_fp8=True
    )
    hidden = plain.target.config.hidden_size
    torch.manual_seed(1)
    features, ids = torch.randn(1, 3, hidden), torch.tensor([[5, 6, 7]])
    outs = [g.drafter.head_step(features, ids, None, torch.arange(3)[None], None) for g in (plain, fp8)]
    error = float((outs[1] - outs[0]).norm() / outs[0].norm())
    assert 1e-4 < error < 0.1, error
    assert type(fp8.drafter.head_step).__name__ == "_FusedStep"
    # a drafter made on the FP8 head (a tree picked at load or per batch size) keeps the fused step
    assert type(fp8.drafter.with_tree([[0], [1]]).head_step).__name__ == "_FusedStep"


def test_a_compiled_fp8_step_fuses_its_norms_into_the_quantization(tiny_target_dir, head_dir, monkeypatch):
    """Traced by a compiler (as drafting with compile= runs it), the FP8 step and logits quantize their
    RMSNorms' outputs in one pass each (fp8.norm_quantized: q/k/v's two norms, gate/up's, the lm_head's):
    the same features and logits as run op by op, to e4m3 rounding."""
    import spechead.heads.fused as fused

    gen = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), str(head_dir), calibrate=False, draft_fp8=True
    )
    step, logits = gen.drafter.head_step, gen.drafter.head_logits
    torch.manual_seed(1)
    with torch.no_grad():  # norm weights other than ones (a trained head's): a dropped weight shows
        for module in gen.drafter.head.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 2.0)
    parts: list[int] = []
    real = fused.norm_quantized
    monkeypatch.setattr(fused, "norm_quantized", lambda normed: parts.append(len(normed)) or real(normed))
    features, ids = torch.randn(1, 3, gen.target.config.hidden_size), torch.tensor([[5, 6, 7]])
    positions = torch.arange(3)[None]
    with torch.inference_mode():
        eager = logits(step(features, ids, None, positions, None))
        assert parts == []  # op by op: rms_norm, then the quantization
        draft = torch.compile(
            lambda f, i, p: logits(step(f, i, None, p, None)), backend="eager", fullgraph=True
        )
        traced = draft(features, ids, positions)
    assert parts == [2, 1, 1]
    error = float((traced - eager).norm() / eager.norm())
    assert error < 0.02, error


def test_draft_fp8_needs_an_eagle_head(tiny_target_dir, tmp_path):
    config = AutoConfig.from_pretrained(tiny_target_dir)
    medusa = MedusaHead(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=2,
                                     target_num_layers=config.num_hidden_layers))  # fmt: skip
    path = medusa.save_pretrained(tmp_path / "medusa")
    with pytest.raises(ValueError, match="draft_fp8 needs an EAGLE / EAGLE-3 head"):
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(path), draft_fp8=True)


def test_a_gpu_without_fp8_tensor_cores_is_one_clear_error(monkeypatch):
    from spechead.inference.draft_weights import check_draft_settings

    check_draft_settings(True, False, "cpu")  # emulated on a CPU: allowed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"FP8 tensor cores \(compute capability >= 8.9\); NVIDIA A100"):
        check_draft_settings(True, False, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_draft_settings(True, False, torch.device("cuda"))  # an H100


@pytest.fixture
def fp8_gpu(monkeypatch):
    """torch reports a GPU with FP8 tensor cores (an H100: compute capability 9.0)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_fp8_is_the_default_for_eagle_heads_on_gpus_with_fp8_tensor_cores(
    tiny_llama, medusa_for, fp8_gpu, monkeypatch
):
    """draft_fp8="auto": an EAGLE / EAGLE-3 head on a GPU of compute capability >= 8.9; not a Medusa head
    (no per-depth layers), not a CPU (emulated FP8), not an A100 (8.0), not a head too narrow for FP8."""
    from spechead.heads import EagleConfig, EagleHead
    from spechead.inference.draft_weights import fp8_by_default

    model = tiny_llama(64, layers=4, hidden=32)
    cuda, eagle3 = torch.device("cuda"), Eagle3Head(Eagle3Config.from_target(model.config))
    eagle = EagleHead(EagleConfig.from_target(model.config))
    assert fp8_by_default(eagle3, cuda) and fp8_by_default(eagle, cuda)
    assert not fp8_by_default(medusa_for(model, num_heads=2), cuda)
    assert not fp8_by_default(eagle3, torch.device("cpu"))
    narrow = Eagle3Head(Eagle3Config.from_target(tiny_llama(64, layers=4, hidden=24).config))
    assert not fp8_by_default(narrow, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8_by_default(eagle3, cuda)  # Ada
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not fp8_by_default(eagle3, cuda)


def test_from_pretrained_drafts_in_fp8_by_default_on_such_a_gpu(tiny_target_dir, head_dir, monkeypatch):
    """The default on a GPU with FP8 tensor cores (the CPU put in its place): the head drafts in FP8 and
    decoding stays lossless; draft_fp8=False keeps it as trained, and int8 asked for takes precedence over
    the FP8 default. On a CPU the default leaves it as trained."""
    from spechead.inference import draft_weights

    load = SpeculativeGenerator.from_pretrained
    assert load(str(tiny_target_dir), str(head_dir), calibrate=False).draft_weights is None
    monkeypatch.setattr(draft_weights, "has_fp8_tensor_cores", lambda device: True)
    gen = load(str(tiny_target_dir), str(head_dir), calibrate=False)
    assert gen.draft_weights == "fp8" and isinstance(gen.drafter.head.midlayer.mlp.down_proj, Fp8Linear)
    gen.eos = set()
    assert gen.generate(input_ids=PROMPTS[1], max_new_tokens=16).token_ids == hf_greedy(
        tiny_target_dir, PROMPTS[1], 16
    )
    off = load(str(tiny_target_dir), str(head_dir), calibrate=False, draft_fp8=False)
    assert off.draft_weights is None and type(off.drafter.head.midlayer.mlp.down_proj) is torch.nn.Linear
    int8 = load(str(tiny_target_dir), str(head_dir), calibrate=False, draft_int8=True)
    assert int8.draft_weights == "int8"


def test_as_drafted_is_an_fp8_copy_on_such_a_gpu(tiny_llama, fp8_gpu):
    """What decode evals and tree tuning draft with on a GPU with FP8 tensor cores: a copy of an EAGLE-3
    head with FP8 per-depth layers, sharing the target's modules; the trained head untouched."""
    from spechead.inference.draft_weights import as_drafted

    model = tiny_llama(64, layers=4, hidden=32)
    head = Eagle3Head(Eagle3Config.from_target(model.config))
    head.attach_target_modules(embed_tokens=model.get_input_embeddings())
    drafted = as_drafted(head, torch.device("cuda"))
    assert drafted is not head and isinstance(drafted.midlayer.mlp.down_proj, Fp8Linear)
    assert type(head.midlayer.mlp.down_proj) is torch.nn.Linear  # (the one being trained)
    assert drafted._target_modules["embed_tokens"] is model.get_input_embeddings()  # shared, not copied
    assert as_drafted(head, torch.device("cpu")) is head


def test_a_bad_fp8_setting_is_one_line(tiny_target_dir, head_dir):
    with pytest.raises(ValueError, match="^draft_fp8 takes auto, True or False, got 'yes'$"):
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(head_dir), draft_fp8="yes")
