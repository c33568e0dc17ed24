"""Train a speculative-decoding draft head. `python train.py --help` lists the config groups.

python train.py                                  # the offline demo (Medusa on the demo target)
accelerate launch train.py head=medusa model=llama3-8b-instruct data=sharegpt
"""

from spechead.training.cli import main

if __name__ == "__main__":
    main()
