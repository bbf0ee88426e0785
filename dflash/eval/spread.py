"""The end-of-training evaluation, spread over the ranks that hold the target.

Rank 0 publishes a plan through the ranks' rendezvous store: which ranks judge which of the
--eval-prompts (the i-th of k planned ranks takes prompts i, i+k, ...) and which drafters. Each
planned rank loads a target of its own in the eval dtype, judges its share and publishes the raw
tallies (EvalTally: counts and sums), which rank 0 adds up into the figures one rank would give.
When the main evaluation is not float32, rank 0 adds the exact check meanwhile: the trained
drafter on the first --eval-lossless-prompts in float32, where any difference from greedy is a bug.

The store, not a collective: ranks outside the plan (a target rank that stalled after the last
step, the drafter ranks but 0) take part in nothing, and a planned rank that dies, stops or fails
is named on rank 0 within a bounded time instead of holding every rank.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

from dflash.eval.evaluate import EvalReport, EvalRequest, EvalTally, tally_drafters
from dflash.placement.distributed import RankInfo, rendezvous_store
from dflash.placement.peers import process_states

logger = logging.getLogger(__name__)

KEY = "dflash/final_eval/"
POLL_S = 0.2
LOSSLESS = "trained_float32"  # the exact check's report, beside the drafters' own in eval.json


class FinalEvalError(RuntimeError):
    """A rank of the final evaluation died, stalled or failed; the drafter is exported already."""


def publish_plan(ranks: list[int], request: EvalRequest, drafters: dict[str, Path]) -> list[int]:
    """Rank 0: the ranks that judge a share (no more than there are prompts), published."""
    planned = ranks[:max(1, request.num_prompts)]
    plan = {"ranks": planned, "request": asdict(request), "drafters": {k: str(v) for k, v in drafters.items()}}
    rendezvous_store().set(KEY + "plan", json.dumps(plan))
    logger.info("final evaluation of %d held-out prompts in %s on ranks %s (the i-th of them takes prompts i, i+%d, "
                "...)", request.num_prompts, request.dtype, planned, len(planned))
    return planned


def judge_share(me: RankInfo, timeout_s: float) -> None:
    """A rank that holds the target, but rank 0: wait for the plan and, if it names this rank, judge
    its share and publish the tallies (or what went wrong, before raising it here too)."""
    store = rendezvous_store()
    await_key(store, KEY + "plan", me, 0, timeout_s, "publish the final evaluation's plan")
    plan = json.loads(store.get(KEY + "plan"))
    if me.rank not in plan["ranks"]:
        return
    result = KEY + f"tally/{me.rank}"
    unreadable = [p for p in plan["drafters"].values() if not (Path(p) / "config.json").is_file()]
    if unreadable:  # --output-dir is not on a filesystem this node shares: rank 0 judges these prompts
        store.set(result, json.dumps({"missing": f"{unreadable[0]} is not readable on {socket.gethostname()}"}))
        return
    share = (plan["ranks"].index(me.rank), len(plan["ranks"]))
    try:
        tallies = tally_drafters(EvalRequest(**plan["request"]), plan["drafters"], me.device, share,
                                 on_prompt=lambda: store.add(KEY + f"progress/{me.rank}", 1))
    except BaseException as err:
        store.set(result, json.dumps({"error": f"{type(err).__name__}: {err}"}))
        raise
    store.set(result, json.dumps({name: asdict(t) for name, t in tallies.items()}))


def await_key(store, key: str, me: RankInfo, peer: int, timeout_s: float, what: str) -> None:
    """Until `peer` sets `key`: a peer found gone or stopped on this host ends the wait at once, one
    that shows no progress (its progress counter) for `timeout_s` ends it then."""
    progress, last, deadline = KEY + f"progress/{peer}", None, time.monotonic() + timeout_s
    while not store.check([key]):
        state = process_states(me, [peer]).get(peer)
        if state is not None:
            raise FinalEvalError(f"rank {me.rank}: rank {peer} {state} before it could {what}; see its log")
        seen = store.get(progress) if store.check([progress]) else None
        if seen != last:
            last, deadline = seen, time.monotonic() + timeout_s
        if time.monotonic() > deadline:
            raise FinalEvalError(f"rank {me.rank}: rank {peer} did not {what} within {timeout_s:g} s "
                                 "(--dist-timeout-minutes): it is stalled; see its log")
        time.sleep(POLL_S)


def judge_all(me: RankInfo, holders: list[int], request: EvalRequest, drafters: dict[str, Path],
              lossless_prompts: int, timeout_s: float) -> dict[str, EvalReport]:
    """Rank 0: publish the plan, judge its own share (if planned), run the float32 check, then add up
    every planned rank's tallies. `holders`: the ranks that hold the target."""
    started = time.perf_counter()
    planned = publish_plan(holders, request, drafters)
    tallies: dict[int, dict[str, EvalTally]] = {}
    if 0 in planned:
        tallies[0] = tally_drafters(request, drafters, me.device, (planned.index(0), len(planned)))
    reports = {}
    if request.dtype != "float32" and lossless_prompts > 0:
        check = replace(request, dtype="float32", num_prompts=min(lossless_prompts, request.num_prompts))
        reports[LOSSLESS] = tally_drafters(check, {"trained": drafters["trained"]}, me.device)["trained"].report()
    store = rendezvous_store()
    for peer in planned:
        if peer == 0:
            continue
        await_key(store, KEY + f"tally/{peer}", me, peer, timeout_s, "publish its final evaluation")
        answer = json.loads(store.get(KEY + f"tally/{peer}"))
        if "error" in answer:
            raise FinalEvalError(f"rank {peer} failed in the final evaluation: {answer['error']}")
        if "missing" in answer:
            logger.info("rank %d: %s: rank 0 judges its prompts", peer, answer["missing"])
            tallies[peer] = tally_drafters(request, drafters, me.device, (planned.index(peer), len(planned)))
        else:
            tallies[peer] = {name: EvalTally.from_dict(t) for name, t in answer.items()}
    for name in drafters:
        reports[name] = functools.reduce(operator.add, (tallies[r][name] for r in planned)).report()
        logger.info("eval %s: %s", name, reports[name].summary())
    if LOSSLESS in reports:
        logger.info("eval %s: %s", LOSSLESS, reports[LOSSLESS].summary())
    logger.info("final evaluation on ranks %s (%s prompts) in %.1f s", planned,
                ", ".join(str(tallies[r]["trained"].prompts) for r in planned), time.perf_counter() - started)
    return dict(sorted(reports.items(), key=lambda item: item[0] == LOSSLESS))
