"""loading.py: a head's drafter options are checked against what its family's drafter takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spechead.heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead, PEagleConfig, PEagleHead
from spechead.inference.drafter_specs import check_spec, drafter_for_head, make_drafter
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.medusa import MedusaDrafter

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(64, layers=2, hidden=32).eval()


def test_a_heads_drafter_options_are_checked_in_one_line(target):
    eagle3 = Eagle3Head(Eagle3Config.from_target(target.config, target_layers=[0, 1, 2]))
    eagle3.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    cfg = target.config
    medusa = MedusaHead(MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=2))
    assert isinstance(drafter_for_head(eagle3, tree=[[0], [0, 0]]), EagleDrafter)
    assert drafter_for_head(medusa, choices=[[0], [0, 0]]).choices == [[0], [0, 0]]
    assert isinstance(drafter_for_head(medusa), MedusaDrafter)
    built = drafter_for_head(medusa)  # a drafter batched itself, given built: taken as it is
    assert make_drafter(built, target, device="cpu", dtype=torch.float32) is built
    # a static tree under either name goes in the family's own option (HEAD/tree.json the same way for all)
    assert drafter_for_head(medusa, tree=[[0], [1]]).choices == [[0], [1]]
    assert drafter_for_head(eagle3, choices=[[0], [0, 0]]).choices == [[0], [0, 0]]
    with pytest.raises(ValueError, match=r"^medusa head: a static tree goes in tree= or choices=, not both$"):
        drafter_for_head(medusa, tree=[[0]], choices=[[0]])
    with pytest.raises(
        ValueError,
        match=r"^eagle3 head: unknown option\(s\) bogus; valid: tree, top_k, depth, total_tokens, rule$",
    ):
        drafter_for_head(eagle3, choices=[[0]], bogus=3)


def test_a_specs_options_are_checked_before_anything_loads(tmp_path, target):
    """check_spec: every kind of spec's options against what its drafter takes, from config.json alone
    (the head directories hold no weights here: a load would fail)."""
    peagle = PEagleHead(
        PEagleConfig.from_target(target.config, target_layers=[0, 1, 2], block_size=4)
    ).save_pretrained(tmp_path / "p")
    medusa = MedusaHead(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=2)).save_pretrained(
        tmp_path / "m"
    )
    for head in (peagle, medusa):
        (head / "model.safetensors").unlink()
    tree = tmp_path / "tree.json"
    tree.write_text('{"choices": [[0], [0, 0]]}')
    for spec in (f"{peagle}@tree={tree}", f"{peagle}@choices={tree}", f"{medusa}@tree={tree}",
                 "prompt_lookup@max_ngram=2", "layer_skip@skip=1+2"):  # fmt: skip
        check_spec(spec)
    for spec, message in [
        (f"{peagle}@bogus=1", r"^peagle head: unknown option\(s\) bogus; valid: choices$"),
        (f"{medusa}@top_k=2", r"^medusa head: unknown option\(s\) top_k; valid: choices$"),
        ("prompt_lookup@depth=2", r"^prompt_lookup: unknown option\(s\) depth; valid: "),
        ("cascade@width=2", r"^cascade drafter: unknown option\(s\) width; valid: num_draft, tiny_draft$"),
        (f"{tmp_path}@bogus=1", r"^draft model .*: unknown option\(s\) bogus; valid: num_draft, "),
    ]:
        with pytest.raises(ValueError, match=message):
            check_spec(spec)


def test_a_target_without_sdpa_loads_eager_and_decodes_exactly(gemma2_target_dir, tiny_target_dir):
    """Our default attention ("spechead_sdpa") on a model class that cannot run sdpa (Gemma-2) falls
    back to eager, which takes tree masks too: greedy decoding equals transformers' own; a Llama keeps
    the default, and an explicit choice is kept as given."""
    import torch

    from spechead.heads.attention import NAME
    from spechead.inference.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(str(gemma2_target_dir), "prompt_lookup")
    assert gen.target.config._attn_implementation == "eager"
    prompt = [5, 9, 14, 20, 5, 9, 14, 30, 5, 9]  # repeats: prompt lookup drafts
    gen.target.generation_config.eos_token_id = None  # both run to max_new_tokens
    reference = gen.target.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    reference = reference[0, len(prompt) :].tolist()
    gen.eos = set()
    assert len(reference) == 12
    result = gen.generate(input_ids=prompt, max_new_tokens=12)
    assert result.token_ids == reference and result.stats.drafted_tokens > 0
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):  # asked for: transformers refuses
        SpeculativeGenerator.from_pretrained(str(gemma2_target_dir), attn_implementation="sdpa")
    llama = SpeculativeGenerator.from_pretrained(str(tiny_target_dir))
    assert llama.target.config._attn_implementation == NAME
    eager = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), attn_implementation="eager")
    assert eager.target.config._attn_implementation == "eager"


def _medusa2_head(target_dir, head_dir):
    """A Medusa-2 head (config `lora_adapter`) saved at `head_dir` with a random (non-zero, as if trained)
    LoRA adapter of the target at `target_dir`; (the base target, the target with the adapter merged)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32), lora)
    cfg = base.config
    head = MedusaHead(MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=2,
                                   lora_adapter="adapter"))  # fmt: skip
    head.save_pretrained(head_dir)
    adapted.save_pretrained(head_dir / "adapter")
    return base, adapted.merge_and_unload().eval()


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft, saving the adapter)
def test_from_pretrained_merges_a_medusa2_heads_adapter(tiny_target_dir, tmp_path):
    """A Medusa-2 head was trained with the target's LoRA: from_pretrained decodes with that adapter merged
    into the target, not the base target (whose logits differ)."""
    from spechead.inference.generator import SpeculativeGenerator

    base, merged = _medusa2_head(tiny_target_dir, tmp_path / "medusa2")
    gen = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), str(tmp_path / "medusa2"), calibrate=False
    )
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(gen.target(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-5)
        assert (gen.target(ids).logits - base(ids).logits).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_a_hub_heads_files_come_from_its_own_branch_not_the_targets_revision(
    tiny_target_dir, tmp_path, monkeypatch
):
    """from_pretrained's `revision` is the target's (heads/hub/card.py): a Hub head's config, weights,
    adapter and tree.json all come from the head repo's default branch, which has no such revision. The
    Hub here: huggingface_hub's two download calls, serving one head repo at its default branch only."""
    import huggingface_hub

    from spechead.inference.generator import SpeculativeGenerator

    head_dir = tmp_path / "snapshot"
    base, merged = _medusa2_head(tiny_target_dir, head_dir)
    (head_dir / "tree.json").write_text('{"choices": [[0], [1], [0, 0]]}')
    asked = []

    def snapshot(repo_id, *, revision=None, **_):
        asked.append((repo_id, revision))
        if revision is not None:
            raise FileNotFoundError(f"{repo_id} has no revision {revision}")
        return str(head_dir)

    def download(repo_id, filename, *, revision=None, **_):
        file = Path(snapshot(repo_id, revision=revision)) / filename
        if not file.is_file():
            raise FileNotFoundError(f"{repo_id} has no {filename}")
        return str(file)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "me/medusa2", revision="target-v2")
    assert asked and {revision for _, revision in asked} == {None}
    assert gen.drafter.choices == [[0], [1], [0, 0]]  # the head's own tree.json
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():  # the adapter merged
        torch.testing.assert_close(gen.target(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-5)
        assert (gen.target(ids).logits - base(ids).logits).abs().max() > 1e-3


def test_drafter_options_parse_every_kind_of_value(tmp_path):
    """`PATH@key=value,...`: integers (negative ones too), the words dynamic / iid / without_replacement /
    deterministic, widths like 4x2x2x1, layers like 2+3+6 or 4-7, and a tree file (tree.json's choices or a
    bare list); an empty item is skipped, a bad value or an item without `=` is a one-line ValueError."""
    from spechead.inference.drafter_specs import drafter_options

    (tmp_path / "tree.json").write_text('{"choices": [[0], [0, 0]]}')
    (tmp_path / "paths.json").write_text("[[0], [1]]")
    spec = (f"h@top_k=8,layer=-2,tree=dynamic,rule=iid,width=4x2x2x1,skip=2+3+6,span=4-7,"
            f"choices={tmp_path / 'tree.json'},paths={tmp_path / 'paths.json'},")  # fmt: skip
    assert drafter_options(spec) == ("h", {
        "top_k": 8, "layer": -2, "tree": "dynamic", "rule": "iid", "width": "4x2x2x1", "skip": "2+3+6",
        "span": "4-7", "choices": [[0], [0, 0]], "paths": [[0], [1]],
    })  # fmt: skip
    assert drafter_options("outputs/head") == ("outputs/head", {})
    with pytest.raises(ValueError, match="^drafter option 'top_k': use key=value"):
        drafter_options("h@top_k")
    with pytest.raises(ValueError, match="^drafter option 'rule=greedy': the value must be an integer"):
        drafter_options("h@rule=greedy")


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])],
)
def test_the_target_loads_straight_onto_its_device(tiny_target_dir, placements, device):
    """from_pretrained places the target's weights on the decoding device as it reads them (device_map),
    not in host memory first: a GPU machine with less host memory than the target still loads it."""
    from spechead.inference.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "prompt_lookup", device=device)
    assert placements == [torch.device(device)]
    assert gen.target.device.type == device
    assert gen.generate(input_ids=[5, 9, 14, 5, 9], max_new_tokens=4).token_ids  # (decodes there)
    # a draft model and a cascade's two models too
    target = str(tiny_target_dir)
    drafted = SpeculativeGenerator.from_pretrained(target, target, device=device)
    cascade = SpeculativeGenerator.from_pretrained(target, f"cascade:{target}+{target}", device=device)
    assert placements[1:] == [torch.device(device)] * 5  # target + draft, target + tiny + medium
    assert drafted.generate(input_ids=[5, 9, 14], max_new_tokens=4).token_ids
    assert cascade.generate(input_ids=[5, 9, 14], max_new_tokens=4).token_ids
