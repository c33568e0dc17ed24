"""heads/hub (publish, card) after a real training run: the exact upload folder, its model card, a real upload through huggingface_hub to
a local fake Hub, and loading the published head back (from the folder and by Hub id) unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard, constants

from spechead.heads import load_head
from spechead.heads.errors import HeadError
from spechead.heads.hub import prepare_upload, upload_to_hub
from spechead.training.trainer import train

REPO = "me/tiny-medusa2"
TREE = {"choices": [[0], [1], [0, 0]], "expected_accept_length": 1.5}
UPLOADED = {
    "README.md",
    "config.json",
    "model.safetensors",
    "tree.json",
    "adapter/adapter_config.json",
    "adapter/adapter_model.safetensors",
    "speedup_by_category.png",
    "acceptance_by_depth.png",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_target_dir, chat_file, training_kit):
    """A 2-step Medusa-2 run (heads + LoRA adapter) with a static tree and a benchmark folder beside it."""
    out = tmp_path_factory.mktemp("publish") / "run"
    extra = {"head": "medusa2", "trainer.max_steps": 2, "trainer.eval_every": 2, "trainer.save_every": 2}
    result = train(training_kit.settings(training_kit.overrides(tiny_target_dir, chat_file, out, **extra)))
    (result.head_dir / "tree.json").write_text(json.dumps(TREE))
    bench = out.parent / "bench"
    bench.mkdir()
    rows = [
        {"drafter": "m2", "spec": str(result.head_dir), "tau": 2.25, "speedup": 1.31, "tokens_per_s": 99.0},
        {"drafter": "lookup", "spec": "prompt_lookup", "tau": 1.1, "speedup": 0.9, "tokens_per_s": 80.0},
    ]
    settings = {"device": "cpu", "dtype": "float32", "prompt_set": "demo", "prompts": 2, "max_new_tokens": 8}
    (bench / "decoding.json").write_text(json.dumps({"rows": rows, "settings": settings}))
    (bench / "decoding.md").write_text("| drafter | tau |\n|---|---:|\n| m2 | 2.25 |\n")
    for name in ("speedup_by_category.png", "acceptance_by_depth.png", "other.png"):
        (bench / name).write_bytes(b"\x89PNG fake " + name.encode())
    return result, bench


def _prepare(run, **kw):
    result, bench = run
    options = {"benchmark_dir": bench, "license": "apache-2.0", "base_model": "me/tiny-target", **kw}
    return prepare_upload(result.head_dir, repo_id=REPO, **options)


def test_dry_run_folder_holds_exactly_what_loading_needs(run, tmp_path):
    upload = _prepare(run)
    out = upload.write(tmp_path / "preview")
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert written == set(upload.paths()) == UPLOADED  # peft's adapter/README.md and other.png stay out
    head_dir = run[0].head_dir
    for name in UPLOADED - {"README.md", "speedup_by_category.png", "acceptance_by_depth.png"}:
        assert (out / name).read_bytes() == (head_dir / name).read_bytes(), name
    assert any("adapter/README.md" in note for note in upload.notes)
    with pytest.raises(HeadError, match="not an empty directory"):
        upload.write(out)  # never writes into (or over) an existing folder


def test_card_metadata_and_body(run, tmp_path):
    upload = _prepare(run)
    card = ModelCard.load(upload.write(tmp_path / "preview") / "README.md")
    assert card.data.base_model == "me/tiny-target"
    assert card.data.library_name == "spechead" and card.data.license == "apache-2.0"
    assert {"spechead", "speculative-decoding", "medusa-2", "lora"} <= set(card.data.tags)
    text = card.text
    assert f"Simulated tau = **{run[0].metrics['tau']:.3f}**" in text
    assert "| m2 | default | 2.25 | 1.31x | 99.0 |" in text  # this head's benchmark row, not the other one
    assert "| lookup |" not in text.split("<details><summary>Full benchmark")[0]
    assert 'SpeculativeGenerator.from_pretrained("me/tiny-target", "me/tiny-medusa2", device="cuda")' in text
    assert "![speedup by category](speedup_by_category.png)" in text
    assert "max_steps: 2" in text  # the run's resolved config.yaml


def test_local_target_has_no_base_model_and_no_license(run, tmp_path):
    upload = _prepare(run, base_model=None, license=None, benchmark_dir=None)
    card = ModelCard.load(upload.write(tmp_path / "preview") / "README.md")
    assert card.data.base_model is None and card.data.license is None  # a local path is not a Hub id
    assert any("not a Hub id" in note for note in upload.notes)
    assert set(upload.paths()) == UPLOADED - {"speedup_by_category.png", "acceptance_by_depth.png"}


def test_dry_run_folder_loads_the_same_head_tree_and_adapter(run, tmp_path, tiny_target_dir):
    from spechead.inference import SpeculativeGenerator

    out = _prepare(run).write(tmp_path / "preview")
    original, published = load_head(run[0].head_dir), load_head(out)
    assert original.state_dict().keys() == published.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(value, published.state_dict()[key]), key
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(out))
    ref = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(run[0].head_dir))
    assert gen.drafter.tree.size == ref.drafter.tree.size == len(TREE["choices"]) + 1  # tree.json used
    ids = torch.tensor([[1, 5, 9, 20, 33]])
    with torch.no_grad():
        torch.testing.assert_close(
            gen.target(ids).logits, ref.target(ids).logits, rtol=0, atol=0
        )  # adapter merged
    assert (
        gen.generate(input_ids=ids[0], max_new_tokens=8).token_ids
        == ref.generate(input_ids=ids[0], max_new_tokens=8).token_ids
    )


@pytest.fixture
def online(monkeypatch):
    """The test session is offline (tests/conftest.py); these tests talk to a local fake Hub only."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def test_upload_commits_exactly_the_folder(run, fake_hub, online, tmp_path):
    upload = _prepare(run)
    url = upload_to_hub(upload, REPO, private=True, token="hf_fake_token", endpoint=fake_hub.url)
    (commit,) = fake_hub.commits
    assert url.startswith(f"{fake_hub.url}/{REPO}/commit/")
    assert fake_hub.repos[REPO].private
    assert commit["revision"] == "main" and commit["deleted"] == []
    assert set(commit["files"]) == UPLOADED
    preview = upload.write(tmp_path / "preview")
    for name, data in commit["files"].items():
        assert data == (preview / name).read_bytes(), name
    posts = [headers for method, path, headers in fake_hub.requests if method == "POST"]
    assert posts and all(h.get("authorization") == "Bearer hf_fake_token" for h in posts)

    # Publishing again without the tree deletes the stale tree.json (loading would read it) in one commit.
    head = tmp_path / "head"
    shutil.copytree(run[0].head_dir, head)
    (head / "tree.json").unlink()
    again = prepare_upload(head, repo_id=REPO, base_model="me/tiny-target")
    upload_to_hub(again, REPO, token="hf_fake_token", endpoint=fake_hub.url)
    assert fake_hub.commits[-1]["deleted"] == ["tree.json"]
    repo = fake_hub.repos[REPO]
    kept = {".gitattributes", *commit["files"], *again.paths()} - {
        "tree.json"
    }  # plots stay: loading ignores them
    assert set(repo.files("main")) == kept


def test_upload_to_a_new_branch(run, fake_hub, online):
    upload_to_hub(_prepare(run, benchmark_dir=None), REPO, revision="v1", token="t", endpoint=fake_hub.url)
    assert fake_hub.commits[-1]["revision"] == "v1"
    assert "config.json" in fake_hub.repos[REPO].files("v1") and "config.json" not in fake_hub.repos[
        REPO
    ].files("main")


def test_head_loads_by_hub_id_with_tree_and_adapter(run, fake_hub, online, tmp_path, tiny_target_dir):
    """A fresh process with HF_ENDPOINT at the fake Hub loads 'me/tiny-medusa2' like the local folder."""
    upload_to_hub(_prepare(run, benchmark_dir=None), REPO, token="t", endpoint=fake_hub.url)
    script = textwrap.dedent(f"""
        import json, torch
        from spechead.inference import SpeculativeGenerator
        gen = SpeculativeGenerator.from_pretrained({str(tiny_target_dir)!r}, {REPO!r})
        ids = torch.tensor([1, 5, 9, 20, 33])
        with torch.no_grad():
            logits = gen.target(ids[None]).logits
        print(json.dumps({{"tree": gen.drafter.tree.size, "logits": logits.sum().item(),
                           "ids": gen.generate(input_ids=ids, max_new_tokens=8).token_ids,
                           "weights": sum(v.double().sum().item() for v in gen.drafter.head.state_dict().values())}}))
    """)
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    from spechead.inference import SpeculativeGenerator

    ref = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(run[0].head_dir))
    ids = torch.tensor([1, 5, 9, 20, 33])
    with torch.no_grad():
        logits = ref.target(ids[None]).logits.sum().item()
    assert got["tree"] == len(TREE["choices"]) + 1  # tree.json was fetched with the head
    assert got["logits"] == pytest.approx(logits, rel=1e-6)  # the adapter was fetched and merged
    assert got["ids"] == ref.generate(input_ids=ids, max_new_tokens=8).token_ids
    weights = sum(v.double().sum().item() for v in ref.drafter.head.state_dict().values())
    assert got["weights"] == pytest.approx(weights, rel=1e-12)
    downloaded = [path for method, path, _ in fake_hub.requests if method == "GET" and "/resolve/" in path]
    assert not any(path.endswith(("README.md", ".png", ".gitattributes")) for path in downloaded)


@pytest.mark.parametrize(
    ("head", "repo_id", "message"),
    [
        ("missing", REPO, "does not exist"),
        ("file", REPO, "is a file"),
        ("empty", REPO, "not a loadable spechead head"),
        ("target", REPO, "not a loadable spechead head"),
        ("head", "no-namespace", "NAMESPACE/NAME"),
        ("head", "me/bad name!", "not a valid Hub repo id"),
    ],
)
def test_bad_input_is_one_clear_error(run, tmp_path, tiny_target_dir, head, repo_id, message):
    paths = {"missing": tmp_path / "nope", "file": tmp_path / "f.txt", "empty": tmp_path / "empty",
             "target": tiny_target_dir, "head": run[0].head_dir}  # fmt: skip
    paths["file"].write_text("x")
    paths["empty"].mkdir()
    with pytest.raises(HeadError, match=message) as err:
        prepare_upload(paths[head], repo_id=repo_id)
    assert "\n" not in str(err.value)


def test_upload_problems_are_one_clear_error(run, online, monkeypatch, fake_hub):
    upload = _prepare(run, benchmark_dir=None)
    with pytest.raises(HeadError, match="no Hugging Face token"):
        upload_to_hub(upload, REPO, endpoint=fake_hub.url)
    fake_hub.token = "the-right-token"
    with pytest.raises(HeadError, match=r"failed: .*401.*token may write to me$") as rejected:
        upload_to_hub(upload, REPO, token="a-wrong-token", endpoint=fake_hub.url)
    with pytest.raises(HeadError, match="upload to me/tiny-medusa2 failed: ConnectError") as unreachable:
        upload_to_hub(upload, REPO, token="t", endpoint="http://127.0.0.1:9")
    assert "\n" not in str(rejected.value) + str(unreachable.value) and not fake_hub.commits
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HeadError, match="HF_HUB_OFFLINE"):
        upload_to_hub(upload, REPO, token="t", endpoint=fake_hub.url)
