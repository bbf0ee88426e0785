"""Train a DFlash drafter for a frozen target LLM: the command behind `dflash-train`,
`python -m dflash.training` and the repository's train_drafter.py, which launchers start.

    dflash-train                                 # demo: the tiny target + data of a clone, CPU or GPU
    dflash-train --target /models/Qwen3-8B --train-data chats.jsonl --output-dir runs/q8b
    deepspeed --num_gpus 8 train_drafter.py ...  # or torchrun / accelerate launch
    dflash-train config.yaml                     # the same flags from a file

`dflash-train --help` lists every flag.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.config import RunConfig, parse_config
from dflash.data.chat_formats import DataError
from dflash.placement.peers import Terminated, process_states
from dflash.placement.topology import TopologyError
from dflash.target.frozen import TargetError
from dflash.training.checkpoint import CheckpointError, latest_checkpoint
from dflash.training.peer_loss import PeerLost, peer_lost
from dflash.training.spike import SkippedStepsError
from dflash.util.cli import ConfigError, user_error
from dflash.util.files import StorageError

if TYPE_CHECKING:
    from dflash.placement.distributed import RankInfo

logger = logging.getLogger("dflash.train")
USER_ERRORS = (ConfigError, DataError, TargetError, TopologyError, CheckpointError, StorageError, SkippedStepsError)
INTERRUPTED = threading.Event()  # set by on_sigint
TERMINATED = threading.Event()  # set by on_sigterm
ENDING = threading.Event()  # this process winds down: a later signal raises nothing
EXIT_INTERRUPTED = 130  # what a shell reports for a command ended by Ctrl-C
EXIT_TERMINATED = 143  # ... and by SIGTERM
RANKS: RankInfo | None = None  # this process's rank, once the process group is up


def on_sigint(signum, frame) -> None:
    """Ctrl-C: KeyboardInterrupt, as Python's default handler raises, but once: a launcher forwards
    the signal again, and the second must not cut the wind-down short. A rank blocked in a
    collective may see the error of a peer that left first; INTERRUPTED tells that apart."""
    if not ENDING.is_set():
        ENDING.set()
        INTERRUPTED.set()
        raise KeyboardInterrupt


def on_sigterm(signum, frame) -> None:
    """SIGTERM: torchrun, deepspeed and accelerate send it to every rank once one has failed (and
    SIGKILL 30 s later). Raised once, as Terminated, with the peers found gone or stopped at this
    moment: the line this rank gives names them."""
    if not ENDING.is_set():
        ENDING.set()
        TERMINATED.set()
        raise Terminated(process_states(RANKS) if RANKS is not None else {})


def how_to_continue(config: RunConfig) -> str:
    newest = latest_checkpoint(config.train.output_dir)
    if newest is None:
        return ("no checkpoint was saved (one is kept every --save-every-minutes M, or --save-every N steps): start "
                "again with the same command plus --overwrite")
    return f"the newest checkpoint is {newest}: resume with the same command plus --resume"


def interrupted_line(config: RunConfig, err: BaseException) -> str:
    """Where an interrupted (Ctrl-C) or terminated (SIGTERM) run stands and how to continue it, in one line."""
    step = getattr(err, "step", None)
    what = "interrupted" if INTERRUPTED.is_set() or not TERMINATED.is_set() else "stopped by SIGTERM"
    at = f"{what} at step {step}" if step is not None else what
    return f"{at}; {how_to_continue(config)}"


def out_of_memory_line(config: RunConfig, rank: int, err: BaseException) -> str:
    """A GPU out-of-memory in one line: the flags that size a step, and how to continue."""
    d, t = config.data, config.train
    positions = d.max_draft_positions if d.max_draft_positions is not None else "set by the memory model"
    sized = (f"--max-tokens {d.max_tokens} (padded tokens per micro-batch), --max-draft-positions {positions} and "
             f"--max-anchors {t.max_anchors}")
    if t.kl_weight > 0:
        sized += f", with --kl-weight {t.kl_weight} (the target's final hidden states travel too)"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"rank {rank}: out of GPU memory ({first}); a step's size is set by {sized}: lower them; {how_to_continue(config)}"


def final_evaluation(config: RunConfig, result, ranks: RankInfo) -> None:
    """Untrained vs trained drafter on held-out prompts, by real speculative decoding, spread over
    the ranks that hold the target (dflash/eval/spread.py); rank 0 writes eval.json."""
    from dflash.eval.evaluate import EvalRequest, check_lossless, resolve_dtype, write_reports
    from dflash.eval.spread import judge_all, judge_share

    timeout_s = config.train.dist_timeout_minutes * 60
    if not ranks.is_main:
        if result.role != "drafter":
            judge_share(ranks, timeout_s)
        return
    request = EvalRequest(config.model.target, config.model.tokenizer, config.data.eval_data, config.train.eval_prompts,
                          config.train.eval_max_new_tokens, resolve_dtype(config.train.eval_dtype, ranks.device),
                          thinking=config.data.thinking)
    holders = result.target_holders if result.targets_finished else [0]  # a stalled target judges nothing
    reports = judge_all(ranks, holders, request, {"untrained": result.initial_drafter_dir, "trained": result.drafter_dir},
                        config.train.eval_lossless_prompts, timeout_s)
    write_reports(reports, Path(config.train.output_dir) / "eval.json")
    if not check_lossless(reports):
        raise RuntimeError("speculative decoding changed the output: this is a bug, please report it")


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except USER_ERRORS as err:
        return user_error(err)
    from dflash.eval.spread import FinalEvalError
    from dflash.placement.distributed import abandon, exit_now, init_distributed, shutdown
    from dflash.training.run import train

    global RANKS
    ranks = RANKS = init_distributed(config.train.device, config.train.dist_timeout_minutes)
    try:
        result = train(config, ranks)
        if config.data.eval_data and config.train.eval_prompts > 0 and config.train.final_eval:
            final_evaluation(config, result, ranks)
    except USER_ERRORS as err:
        ENDING.set()
        logger.error("%s", err)
        abandon(2)
        return 2
    except FinalEvalError as err:
        logger.error("%s; the drafter is exported to %s: judge it again with python -m dflash.eval --target %s "
                     "--drafter %s --prompts %s", err, result.drafter_dir, config.model.target, result.drafter_dir,
                     config.data.eval_data)
        abandon(1)
        return 1
    except BaseException as err:
        import torch  # loaded by the run already

        ENDING.set()
        if isinstance(err, torch.OutOfMemoryError):
            logger.error("%s", out_of_memory_line(config, ranks.rank, err))
            abandon(1)
            return 1
        # a peer lost in the run's phases is a PeerLost already; before them (set-up), it is one now
        lost = err if isinstance(err, PeerLost) else peer_lost(err, ranks, None, getattr(err, "step", None),
                                                               Path(config.train.output_dir))
        if lost is not None and not INTERRUPTED.is_set():  # after Ctrl-C, a peer may leave first
            logger.error("%s; %s", lost, how_to_continue(config))
            abandon(1)
            exit_now(1)
        if isinstance(err, KeyboardInterrupt) or INTERRUPTED.is_set() or TERMINATED.is_set():
            code = EXIT_INTERRUPTED if INTERRUPTED.is_set() else EXIT_TERMINATED
            if ranks.is_main:
                logger.warning("%s", interrupted_line(config, err))
            abandon(code)
            exit_now(code)
        # said before the teardown: with a dead peer, tearing NCCL down may never return
        traceback.print_exc()
        abandon(1)
        return 1
    if not result.targets_finished:  # a stalled target would never reach the final barrier
        abandon(0)
        exit_now(0)
    shutdown()
    return 0


def command() -> int:
    """`main` as a terminal or a launcher runs it (dflash-train, train_drafter.py): `kill -USR1 <pid>`
    prints every thread's stack; Ctrl-C (not where the shell ignores it) and SIGTERM wind the run
    down once."""
    faulthandler.register(signal.SIGUSR1)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return main()
    except KeyboardInterrupt:  # where main() does not handle it: parsing, joining the process group, the end
        return EXIT_TERMINATED if TERMINATED.is_set() else EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(command())
