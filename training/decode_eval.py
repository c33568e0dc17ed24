"""Real decoding while training: at `trainer.decode_eval_every` steps the head decodes a small prompt set,
and at the end of the run (`trainer.tree_tune_prompts` > 0) its static tree is tuned for this device.

Training never imports inference (see the architecture map): the decoding functions come in from the
entry point (train.py passes `spechead.inference.evaluation.decode_eval_hook` and
`spechead.inference.tuning.tree_tuning.tune_tree`), typed by the protocols below. Only the main process
decodes; the others wait. The final decode eval runs after the tuning, with the tuned tree, so the
speedup a run prints is the one its saved head (HEAD/tree.json) decodes at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from spechead.data.prompt_sets import EvalPrompt, load_prompt_set
from spechead.heads.base import DraftHead
from spechead.training import tracking
from spechead.training.settings import TrainerConfig


class DecodeEval(Protocol):
    """Decode `prompts` with `head` on `target` (with the static tree of `tree`: tree.json fields, when
    given); return (metrics, plot files). See evaluation.measure.decode_eval_hook."""

    def __call__(
        self,
        target: nn.Module,
        tokenizer,
        head: DraftHead,
        prompts: list[EvalPrompt],
        max_new_tokens: int,
        plot_dir: Path | None,
        tree: dict | None = None,
    ) -> tuple[dict[str, float], dict[str, Path]]: ...


class TreeTune(Protocol):
    """The static tree of the best expected speedup on the target's device for `head`, measured on
    `prompts`, as tree.json fields (at least "choices"). See inference/tuning/tree_tuning.py."""

    def __call__(
        self, target: nn.Module, tokenizer, head: DraftHead, prompts: list[EvalPrompt], *, max_new_tokens: int
    ) -> dict: ...


class DecodeEvaluator:
    """Runs the decoding hooks on the main process (decode evals at the configured steps, the tree tuning
    and a last decode eval at the end) and logs what they return."""

    def __init__(
        self,
        hook: DecodeEval | None,
        cfg: TrainerConfig,
        accelerator: Accelerator,
        offline: bool = False,
        tune: TreeTune | None = None,
        hybrid: str = "",
    ) -> None:
        """hybrid: why the target cannot be decoded speculatively ("" = it can): decode evals and tree
        tuning are then skipped with that one line, and the head still trains."""
        self.hook, self.tune_hook, self.cfg, self.accelerator = hook, tune, cfg, accelerator
        self.enabled = hook is not None and cfg.decode_eval_every > 0
        self.tuning = tune is not None and cfg.tree_tune_prompts > 0
        if cfg.decode_eval_every > 0 and hook is None:
            accelerator.print("decode eval: no decoding hook given (train.py wires one in); skipped")
        if cfg.tree_tune_prompts > 0 and tune is None:
            accelerator.print("tree tuning: no tuning hook given (train.py wires one in); skipped")
        skip = (
            "ZeRO-3 shards the target across processes" if _zero3(accelerator)
            else "data.hidden_states=offline loads no full target" if offline
            else hybrid
        )  # fmt: skip
        if skip and (self.enabled or self.tuning):
            accelerator.print(f"decode eval and tree tuning: skipped ({skip})")
            self.enabled = self.tuning = False
        self.prompts = (
            load_prompt_set(cfg.decode_eval_prompt_set, cfg.decode_eval_prompts) if self.enabled else []
        )
        self.tune_prompts = (
            load_prompt_set(cfg.tree_tune_prompt_set, cfg.tree_tune_prompts) if self.tuning else []
        )

    def due(self, step: int, max_steps: int) -> bool:
        """A decode eval inside the loop (the last step's runs in `finish`, after the tree tuning)."""
        return self.enabled and step % self.cfg.decode_eval_every == 0 and step < max_steps

    def tune(self, target: nn.Module, tokenizer, head: DraftHead) -> dict | None:
        """The tuned tree's fields on the main process (None when tuning is off, and on the others)."""
        tree = None
        if self.tuning and self.accelerator.is_main_process:
            assert self.tune_hook is not None  # self.tuning says so
            tree = self.tune_hook(
                target, tokenizer, head, self.tune_prompts, max_new_tokens=self.cfg.decode_eval_max_new_tokens
            )
            tqdm.write(
                f"tree tuned on {len(self.tune_prompts)} prompts ({self.cfg.tree_tune_prompt_set}): "
                f"{len(tree['choices'])} nodes, depth {max(map(len, tree['choices']), default=0)}, measured tau "
                f"{tree.get('measured_tau', float('nan')):.3f}, expected speedup {tree.get('expected_speedup', float('nan')):.2f}x"
            )
        self.accelerator.wait_for_everyone()
        return tree

    def run(
        self, target: nn.Module, tokenizer, head: DraftHead, out: Path, step: int, tree: dict | None = None
    ) -> dict[str, float]:
        """Decode on the main process, log `decode/*` metrics and plots; {} on the other processes."""
        metrics: dict[str, float] = {}
        if self.accelerator.is_main_process:
            assert self.hook is not None  # run only when enabled
            metrics, plots = self.hook(
                target, tokenizer, head, self.prompts, self.cfg.decode_eval_max_new_tokens,
                out / "decode_eval" / f"step-{step}", tree=tree,
            )  # fmt: skip
            metrics = {f"decode/{k}": v for k, v in metrics.items()}
            self.accelerator.log(metrics, step=step)
            tracking.log_images(self.accelerator, {f"decode/{k}": p for k, p in plots.items()}, step)
            tqdm.write(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            if metrics.get("decode/greedy_mismatches"):
                tqdm.write(f"!!! step {step}: decoding with the head changed greedy outputs (not lossless)")
        self.accelerator.wait_for_everyone()
        return metrics


def _zero3(accelerator: Accelerator) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and getattr(plugin, "zero_stage", 0) == 3
