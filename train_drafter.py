"""Train a DFlash drafter for a frozen target LLM.

    python train_drafter.py                      # demo: shipped tiny target + data, CPU or GPU
    python train_drafter.py --target /models/Qwen3-8B --train-data chats.jsonl --output-dir runs/q8b
    deepspeed --num_gpus 8 train_drafter.py ...  # or torchrun / accelerate launch
    python train_drafter.py config.yaml          # the same flags from a file

`python train_drafter.py --help` lists every flag.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import traceback
from pathlib import Path

from dflash.checkpoint import CheckpointError
from dflash.config import ConfigError, parse_config
from dflash.data import DataError
from dflash.files import StorageError
from dflash.target import TargetError
from dflash.topology import TopologyError

logger = logging.getLogger("train_drafter")
USER_ERRORS = (ConfigError, DataError, TargetError, TopologyError, CheckpointError, StorageError)


def final_evaluation(config, result, device) -> None:
    """Untrained vs trained drafter on held-out prompts, by real speculative decoding."""
    import torch

    from dflash.eval import check_lossless, evaluate_drafters, write_reports

    reports = evaluate_drafters(
        config.model.target, config.model.tokenizer,
        {"untrained": result.initial_drafter_dir, "trained": result.drafter_dir},
        config.data.eval_data, config.train.eval_prompts, config.train.eval_max_new_tokens, device,
        getattr(torch, config.train.eval_dtype),
    )
    write_reports(reports, Path(config.train.output_dir) / "eval.json")
    if not check_lossless(reports):
        raise RuntimeError("speculative decoding changed the output: this is a bug, please report it")


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from dflash.distributed import abandon, init_distributed, shutdown
    from dflash.train import train

    ranks = init_distributed(config.train.device, config.train.dist_timeout_minutes)
    try:
        result = train(config, ranks)
        if ranks.is_main and config.data.eval_data and config.train.eval_prompts > 0:
            final_evaluation(config, result, ranks.device)
    except USER_ERRORS as err:
        logger.error("%s", err)
        abandon(2)
        return 2
    except BaseException:
        # said before the teardown: with a dead peer, tearing NCCL down may never return
        traceback.print_exc()
        abandon(1)
        return 1
    shutdown()
    return 0


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    sys.exit(main())
