"""Train a speculative-decoding draft head. `python train.py --help` lists the config groups.

python train.py                                  # the offline demo (EAGLE-3 on the demo target)
accelerate launch train.py head=eagle3 model=llama3-8b-instruct data=ultrachat

The entry point wires inference's decoding into the trainer's decode evaluation
(trainer.decode_eval_every) and end-of-run tree tuning (trainer.tree_tune_prompts): training itself
never imports inference.
"""

from spechead.inference.evaluation.measure import decode_eval_hook
from spechead.inference.tuning.tree_tuning import tune_tree
from spechead.training.cli import main

if __name__ == "__main__":
    main(decode_eval=decode_eval_hook, tune_tree=tune_tree)
