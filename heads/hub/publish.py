"""Publish a trained head to the Hugging Face Hub: exactly the files loading reads, plus a model card.

    upload = prepare_upload("outputs/eagle3-demo/head", repo_id="me/eagle3-demo")
    upload.write("publish-preview")             # the exact folder that would be uploaded (--dry-run)
    upload_to_hub(upload, "me/eagle3-demo", private=True)   # create the repo if needed, one commit
    publish("outputs/eagle3-demo/head", "me/eagle3-demo")   # both steps at once

Uploaded: config.json, model.safetensors, tree.json (a Medusa static tree, if built), the Medusa-2
LoRA adapter's adapter_config.json + weights, README.md (the card) and the benchmark plots when a
benchmark folder is given. The run's config.yaml / metrics.json are read from the head's parent
directory (a trainer run writes OUTPUT_DIR/{config.yaml, metrics.json, head/}).
"""

from __future__ import annotations

import fnmatch
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from safetensors import safe_open

from spechead.heads.base import load_head
from spechead.heads.directory import CONFIG_NAME, HUB_PATTERNS, WEIGHTS_NAME, loading_files, read_config
from spechead.heads.errors import HeadError
from spechead.heads.hub.card import (
    BENCHMARK_PLOTS,
    BenchmarkInfo,
    RunInfo,
    hub_id_or_none,
    render_card,
)

CARD_NAME = "README.md"


@dataclass
class Upload:
    """The folder to publish: path in repo -> local file, plus the card text (README.md)."""

    files: dict[str, Path]
    card: str
    notes: list[str] = field(default_factory=list)  # things the user should know (skipped files, ...)

    def paths(self) -> list[str]:
        """Every path in the repo this upload writes, sorted."""
        return sorted([*self.files, CARD_NAME])

    def write(self, out_dir: str | Path) -> Path:
        """Materialise the upload in `out_dir` (which must not exist or be empty)."""
        out = Path(out_dir).expanduser()
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise HeadError(
                f"{out} already exists and is not an empty directory: choose another output folder"
            )
        for name, source in self.files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, out / name)
        out.mkdir(parents=True, exist_ok=True)
        (out / CARD_NAME).write_text(self.card)
        return out


def check_repo_id(repo_id: str) -> str:
    """`repo_id` if it is a valid `namespace/name` Hub model id, else HeadError."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise HeadError(
            f"repo id {repo_id!r} is not a valid Hub repo id: {str(err).splitlines()[0]}"
        ) from None
    if repo_id.count("/") != 1:
        raise HeadError(
            f"repo id {repo_id!r} must be NAMESPACE/NAME (your user or organisation, then a name)"
        )
    return repo_id


def head_files(head_dir: str | Path) -> tuple[dict[str, Path], dict, list[str]]:
    """Check that `head_dir` holds a loadable head; return (files loading needs, config.json, skipped)."""
    head = Path(head_dir).expanduser()
    if not head.exists():
        raise HeadError(f"head directory {head} does not exist: pass OUTPUT_DIR/head of a training run")
    if not head.is_dir():
        raise HeadError(f"{head} is a file: pass the head directory that holds {CONFIG_NAME}")
    try:
        load_head(head)  # config and weights must load (and match) before anything is published
        files = loading_files(head)  # and the tree and adapter loading reads beside them
    except HeadError as err:
        raise HeadError(f"{head} is not a loadable spechead head: {err}") from None
    present = {p.relative_to(head).as_posix() for p in head.rglob("*") if p.is_file()}
    return files, read_config(head), sorted(present - set(files))


def read_run(head_dir: str | Path) -> RunInfo:
    """config.yaml and metrics.json of the training run the head came from (its parent directory)."""
    run_dir = Path(head_dir).expanduser().resolve().parent
    info = RunInfo()
    if (run_dir / "config.yaml").is_file():
        info.config = _read(run_dir / "config.yaml", yaml.safe_load) or {}
    if (run_dir / "metrics.json").is_file():
        info.metrics = _read(run_dir / "metrics.json", json.loads)
    return info


def read_benchmark(bench_dir: str | Path, head_dir: str | Path) -> BenchmarkInfo:
    """scripts/benchmark.py's --out folder; `rows` are the drafters that decoded with this head."""
    bench = Path(bench_dir).expanduser()
    md, js = bench / "decoding.md", bench / "decoding.json"
    if not bench.is_dir() or not (md.is_file() or js.is_file()):
        raise HeadError(
            f"benchmark folder {bench} holds no decoding.md / decoding.json: pass the --out folder of scripts/benchmark.py"
        )
    data = _read(js, json.loads) if js.is_file() else {}
    rows = [r for r in data.get("rows", []) if _same_dir(str(r.get("spec", "")).split("@")[0], head_dir)]
    return BenchmarkInfo(
        data=data,
        table=md.read_text() if md.is_file() else "",
        plots=[name for name in BENCHMARK_PLOTS if (bench / name).is_file()],
        rows=rows,
    )


def prepare_upload(
    head_dir: str | Path,
    *,
    repo_id: str,
    benchmark_dir: str | Path | None = None,
    license: str | None = None,
    base_model: str | None = None,
    revision: str | None = None,
) -> Upload:
    """Everything to publish for `head_dir` (nothing is written or sent)."""
    check_repo_id(repo_id)
    files, config, skipped = head_files(head_dir)
    notes = [f"not uploaded (loading does not read them): {', '.join(skipped)}"] if skipped else []
    if base_model is None:
        base_model = hub_id_or_none(str(config.get("target_name_or_path", "")))
        if base_model is None:
            notes.append(
                f"the target {config.get('target_name_or_path')!r} is not a Hub id: the card has no base_model "
                "(pass --base-model HUB_ID of the same weights)"
            )
    elif hub_id_or_none(base_model) is None:
        raise HeadError(f"base model {base_model!r} is not a Hub model id (namespace/name)")
    benchmark = None
    if benchmark_dir is not None:
        benchmark = read_benchmark(benchmark_dir, head_dir)
        files.update({name: Path(benchmark_dir).expanduser() / name for name in benchmark.plots})
        if not benchmark.rows:
            notes.append(
                f"no drafter in {benchmark_dir}/decoding.json used {head_dir}: the card shows the full report only"
            )
    card = render_card(
        config,
        repo_id=repo_id,
        files=sorted([*files, CARD_NAME]),
        num_parameters=_num_parameters(files[WEIGHTS_NAME]),
        run=read_run(head_dir),
        benchmark=benchmark,
        base_model=base_model,
        license=license,
        revision=revision,
    )
    return Upload(files, card, notes)


def publish(
    head_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    **card_options,
) -> str:
    """prepare_upload + upload_to_hub in one call (what `trainer.push_to_hub` needs); the commit URL.

    card_options: benchmark_dir, license, base_model (see prepare_upload).
    """
    upload = prepare_upload(head_dir, repo_id=repo_id, revision=revision, **card_options)
    return upload_to_hub(upload, repo_id, private=private, revision=revision, token=token, endpoint=endpoint)


def preflight(repo_id: str, token: str | None = None) -> str:
    """The token to upload to `repo_id` with; HeadError (before any work) when an upload cannot start."""
    from huggingface_hub import constants, get_token

    check_repo_id(repo_id)
    if constants.is_offline_mode():
        raise HeadError("HF_HUB_OFFLINE is set: unset it to upload (or use --dry-run OUT_DIR)")
    token = token or get_token()
    if not token:
        raise HeadError(
            "no Hugging Face token: run `hf auth login` or set HF_TOKEN (or use --dry-run OUT_DIR to only "
            "write the folder)"
        )
    return token


def upload_to_hub(
    upload: Upload,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str = "Upload a draft head with spechead",
) -> str:
    """Create `repo_id` (and the `revision` branch) if needed and commit `upload` at once; the commit URL.

    Files of an earlier publish that loading would read (heads.base.HUB_PATTERNS) and this upload
    does not replace are deleted in the same commit, so the repo loads exactly this head.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants

    api = HfApi(endpoint=endpoint, token=preflight(repo_id, token))
    try:
        api.create_repo(repo_id, private=private or None, exist_ok=True)  # None: the namespace's default
        if revision and revision != constants.DEFAULT_REVISION:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        existing = api.list_repo_files(repo_id, revision=revision)
        stale = [p for p in existing if p not in upload.paths() and _loading_reads(p)]
        operations = [CommitOperationDelete(path) for path in stale] + [
            CommitOperationAdd(name, str(source)) for name, source in upload.files.items()
        ]
        operations.append(CommitOperationAdd(CARD_NAME, upload.card.encode()))
        info = api.create_commit(repo_id, operations, commit_message=commit_message, revision=revision)
    except Exception as err:  # HTTP status, connection, validation: one line saying what failed
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        status = getattr(getattr(err, "response", None), "status_code", None)
        hint = f"; check that your token may write to {repo_id.split('/')[0]}" if status in (401, 403) else ""
        raise HeadError(f"upload to {repo_id} failed: {type(err).__name__}: {first}{hint}") from err
    return info.commit_url


def _read(path: Path, parse):
    """parse(path's text); a HeadError naming the file when it is not valid."""
    try:
        return parse(path.read_text())
    except (ValueError, yaml.YAMLError) as err:
        raise HeadError(f"{path} is not valid: {str(err).splitlines()[0]}; fix or remove it") from None


def _loading_reads(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in HUB_PATTERNS)


def _num_parameters(weights: Path) -> int:
    """Floating-point weights in a safetensors file (integer/bool buffers such as d2t/t2d not counted)."""
    total = 0
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            tensor = f.get_slice(key)
            if tensor.get_dtype().startswith(("F", "BF")):
                total += math.prod(tensor.get_shape())
    return total


def _same_dir(spec: str, head_dir: str | Path) -> bool:
    """Whether a benchmark drafter spec (a path, maybe relative to where it ran) names `head_dir`."""
    if not spec:
        return False
    head, path = Path(head_dir).expanduser().resolve(), Path(spec).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve() == head
    return head.parts[-len(path.parts) :] == path.parts
