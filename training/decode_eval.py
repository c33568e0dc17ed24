"""Real decoding while training: at `trainer.decode_eval_every` steps the head decodes a small prompt set.

Training never imports inference (see the architecture map): the decoding function comes in from the
entry point (train.py passes `spechead.inference.evaluation.decode_eval_hook`), typed by the protocol
below. Only the main process decodes; the others wait.
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
    """Decode `prompts` with `head` on `target`; return (metrics, plot files). See evaluate_head."""

    def __call__(
        self,
        target: nn.Module,
        tokenizer,
        head: DraftHead,
        prompts: list[EvalPrompt],
        max_new_tokens: int,
        plot_dir: Path | None,
    ) -> tuple[dict[str, float], dict[str, Path]]: ...


class DecodeEvaluator:
    """Runs a DecodeEval hook on the main process at the configured steps and logs what it returns."""

    def __init__(
        self, hook: DecodeEval | None, cfg: TrainerConfig, accelerator: Accelerator, offline: bool = False
    ) -> None:
        self.hook, self.cfg, self.accelerator = hook, cfg, accelerator
        self.enabled = hook is not None and cfg.decode_eval_every > 0
        if cfg.decode_eval_every > 0 and hook is None:
            accelerator.print("decode eval: no decoding hook given (train.py wires one in); skipped")
        skip = "" if not self.enabled else (
            "ZeRO-3 shards the target across processes" if _zero3(accelerator)
            else "data.hidden_states=offline loads no full target" if offline else ""
        )  # fmt: skip
        if skip:
            accelerator.print(f"decode eval: skipped ({skip})")
            self.enabled = False
        self.prompts = (
            load_prompt_set(cfg.decode_eval_prompt_set, cfg.decode_eval_prompts) if self.enabled else []
        )

    def due(self, step: int, max_steps: int) -> bool:
        return self.enabled and (step % self.cfg.decode_eval_every == 0 or step == max_steps)

    def run(self, target: nn.Module, tokenizer, head: DraftHead, out: Path, step: int) -> dict[str, float]:
        """Decode on the main process, log `decode/*` metrics and plots; {} on the other processes."""
        metrics: dict[str, float] = {}
        if self.accelerator.is_main_process:
            metrics, plots = self.hook(
                target, tokenizer, head, self.prompts, self.cfg.decode_eval_max_new_tokens,
                out / "decode_eval" / f"step-{step}",
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
