"""heads/hub without a training run: the card as pure text (Hub ids, the usage snippet of a revision, the
head table, the measured-decoding rows) and prepare_upload's checks on a saved head (parameter count,
broken weights, base_model, which benchmark rows are this head's)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from spechead.heads import HeadError, MedusaConfig, MedusaHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.hub import card, prepare_upload
from spechead.heads.hub.publish import read_benchmark


def saved_config(**fields) -> dict:
    """A Medusa head's config.json as save_pretrained writes it."""
    config = MedusaConfig(hidden_size=16, vocab_size=32, target_name_or_path="org/tiny", **fields)
    return {**config.to_dict(), "family": "medusa", "spechead_version": "0.1", "format_version": 1}


def render(config: dict, **kw) -> str:
    return card.render_card(config, repo_id="me/head", files=["config.json"], num_parameters=10,
                            run=card.RunInfo(), **kw)  # fmt: skip


def test_a_local_path_is_not_a_hub_id(tmp_path, monkeypatch) -> None:
    """`outputs/head` reads like namespace/name; when it exists on disk it is the local target, and the
    card must not link it as a Hub base_model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "head").mkdir(parents=True)
    assert card.hub_id_or_none("outputs/head") is None
    assert card.hub_id_or_none("org/model") == "org/model"
    assert card.hub_id_or_none("a/b/c") is None and card.hub_id_or_none("") is None


def test_usage_fetches_the_published_revision() -> None:
    """A head published on a branch: from_pretrained's `revision` would pick the TARGET's revision, so the
    snippet fetches the head's revision with snapshot_download and passes the folder."""
    text = render(saved_config(), base_model="org/tiny", revision="v2")
    assert 'snapshot_download("me/head", revision="v2")' in text
    assert 'from_pretrained("org/tiny", head, device="cuda")' in text
    plain = render(saved_config(), base_model="org/tiny")
    assert "snapshot_download" not in plain and 'from_pretrained("org/tiny", "me/head"' in plain


def test_measured_rows_flag_any_greedy_mismatch_and_show_options() -> None:
    """One greedy mismatch is already a failure of losslessness: the row says NO; the drafter options
    after `@` in its spec are shown."""
    rows = [
        {"drafter": "a", "spec": "me/head@top_k=4", "tau": 2.0, "speedup": 1.5, "tokens_per_s": 10.0,
         "greedy_mismatches": 1},
        {"drafter": "b", "spec": "me/head", "tau": 2.0, "speedup": 1.5, "tokens_per_s": 10.0,
         "greedy_mismatches": 0},
    ]  # fmt: skip
    text = render(saved_config(), benchmark=card.BenchmarkInfo(rows=rows))
    assert "| a | `top_k=4` | 2.00 | 1.50x | 10.0 | NO |" in text
    assert "| b | default | 2.00 | 1.50x | 10.0 | yes |" in text


def test_head_table_and_adapter_paragraph_of_a_medusa2_head() -> None:
    """The head table lists the family's own fields (num_heads, num_layers, lora_adapter; empty ones left
    out), and a head carrying a LoRA adapter (Medusa-2) says that its target is adapted."""
    medusa2 = render(saved_config(num_heads=4, lora_adapter="adapter"))
    assert (
        "| family | medusa2 |" in medusa2
        and "| num_heads | 4 |" in medusa2
        and "| num_layers | 1 |" in medusa2
    )
    assert "| lora_adapter | adapter |" in medusa2
    assert "`adapter/` holds a peft LoRA adapter" in medusa2
    medusa = render(saved_config(num_heads=4))
    assert "| family | medusa |" in medusa and "lora_adapter" not in medusa and "LoRA" not in medusa


def test_card_counts_the_floating_weights_only(tiny_llama, tmp_path) -> None:
    """The card's parameter count is the head's trainable weights: an EAGLE-3 head's d2t / t2d vocab maps
    (integer and bool buffers in model.safetensors) are not parameters."""
    target = tiny_llama(48, layers=8, hidden=32)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=20))
    head.save_pretrained(tmp_path / "head")
    upload = prepare_upload(tmp_path / "head", repo_id="me/head", base_model="org/tiny")
    weights = sum(p.numel() for p in head.parameters())
    assert weights < sum(t.numel() for t in head.state_dict().values())  # d2t, t2d are in the file
    assert f"| parameters (head only) | {weights:,} |" in upload.card


def test_benchmark_rows_are_this_heads_by_its_path_tail(tmp_path) -> None:
    """A benchmark row's spec may be a path relative to where the benchmark ran: `run/head` names this
    head (…/run/head), `other/head` another run's head of the same folder name."""
    head_dir = tmp_path / "run" / "head"
    head_dir.mkdir(parents=True)
    rows = [{"drafter": "mine", "spec": "run/head@top_k=2"}, {"drafter": "theirs", "spec": "other/head"}]
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "decoding.json").write_text(json.dumps({"rows": rows}))
    found = read_benchmark(tmp_path / "bench", head_dir).rows
    assert [r["drafter"] for r in found] == ["mine"]


def test_prepare_upload_refuses_a_broken_head_and_a_local_base_model(tmp_path) -> None:
    """Nothing is prepared for a head whose weights do not load against its config.json, nor with a
    base_model that is not a Hub id (the card would link a page that does not exist)."""
    head_dir = MedusaHead(MedusaConfig(hidden_size=16, vocab_size=32)).save_pretrained(tmp_path / "head")
    with pytest.raises(HeadError, match="base model 'outputs/x/y' is not a Hub model id"):
        prepare_upload(head_dir, repo_id="me/head", base_model="outputs/x/y")
    weights = load_file(head_dir / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "heads.0.1.weight"}, head_dir / "model.safetensors")
    with pytest.raises(
        HeadError, match=r"not a loadable spechead head: .*missing weights \['heads.0.1.weight'\]"
    ):
        prepare_upload(head_dir, repo_id="me/head", base_model="org/tiny")
