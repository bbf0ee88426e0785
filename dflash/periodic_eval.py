"""Exact tau while training: every --eval-every steps, the drafter is scored on the held-out
prompts' greedy continuations (computed once, at start) with one teacher-forced forward per
prompt, and the chain decoding would walk gives tau (dflash.eval.teacher_forced). No decoding
loop, so it costs a few forwards; it needs the target on the rank, i.e. colocated placement.
"""

from __future__ import annotations

import logging
import time

from dflash.eval import continuation, eos_token_ids, load_prompts, teacher_forced
from dflash.speculative import Decoder, resolve_decoder
from dflash.target import FrozenTarget

logger = logging.getLogger(__name__)


class TauProbe:
    def __init__(self, target: FrozenTarget, tokenizer, prompts_path: str, num_prompts: int, max_new_tokens: int,
                 block_size: int):
        started = time.perf_counter()
        eos = eos_token_ids(tokenizer, target)
        prompts = load_prompts(prompts_path, tokenizer, num_prompts)
        self.target = target
        decoder = Decoder(target, None, max(map(len, prompts)) + max_new_tokens + block_size,
                          resolve_decoder("auto", target))
        self.sequences = [(p, *continuation(decoder, p, max_new_tokens, eos, block_size)) for p in prompts]
        logger.info("periodic eval: greedy continuations of %d held-out prompts computed in %.1f s",
                    len(self.sequences), time.perf_counter() - started)

    def measure(self, drafter) -> dict:
        """tau (exact, teacher-forced) and acceptance by position, and what it cost."""
        started = time.perf_counter()
        training = drafter.training
        drafter.eval()
        result = teacher_forced(self.target, drafter, self.sequences)
        drafter.train(training)
        return {"tau": result.tau, "acceptance": [round(a, 4) for a in result.acceptance],
                "eval_seconds": time.perf_counter() - started}
