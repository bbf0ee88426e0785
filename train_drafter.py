"""Train a DFlash drafter for a frozen target LLM: the entry point launchers start
(`deepspeed train_drafter.py`, `torchrun train_drafter.py`, `accelerate launch train_drafter.py`),
the same command as `dflash-train`. The code is dflash/training/__main__.py.

    python train_drafter.py                      # demo: shipped tiny target + data, CPU or GPU
    python train_drafter.py --target /models/Qwen3-8B --train-data chats.jsonl --output-dir runs/q8b
    python train_drafter.py config.yaml          # the same flags from a file

`python train_drafter.py --help` lists every flag.
"""

import sys

from dflash.training.__main__ import command

if __name__ == "__main__":
    sys.exit(command())
