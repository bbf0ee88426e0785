"""Which target rank gets a drafter's next micro-batch: a pure function of what the drafter
knows, so the rule is tested without processes or clocks.

Responses are consumed in the drafter's own step order, so a plain most-free-credit rule
stalls: a slow target holding as many requests as a fast one sets the pace. A step goes to the
target expected to finish it first, (its tokens + tokens in flight there + backlog) x that
target's measured seconds per token; with equal speeds that is the target with the most free
credit. Ties go to a target on this node, then to the lowest rank. A target that has not
reported its speed yet gets one request at a time: loading it blindly would give a slow target
as much as a fast one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouteView:
    """What a drafter rank knows about its targets when it routes a request."""

    credits: int
    in_flight: dict[int, int]  # requests sent, response not fully arrived, per target
    tokens_in_flight: dict[int, int]  # their tokens, per target
    backlog: dict[int, int] = field(default_factory=dict)  # other drafters' queued tokens, last reported
    sec_per_token: dict[int, float] = field(default_factory=dict)  # measured; absent = not reported yet
    same_node: dict[int, bool] = field(default_factory=dict)


def pick_target(view: RouteView, tokens: int) -> int | None:
    """The target expected to finish a request of `tokens` first, or None while that target has
    no free credit (the request then waits and is routed again with fresher estimates)."""
    targets = sorted(view.in_flight)
    candidates = [t for t in targets if t in view.sec_per_token or view.in_flight[t] == 0]
    known = list(view.sec_per_token.values())
    default = sum(known) / len(known) if known else 1.0  # unmeasured: as fast as the others

    def expected_finish(t: int) -> tuple[float, bool, int]:
        pending = view.backlog.get(t, 0) + view.tokens_in_flight[t] + tokens
        return pending * view.sec_per_token.get(t, default), not view.same_node.get(t, True), t

    best = min(candidates, default=None, key=expected_finish)
    return best if best is not None and view.in_flight[best] < view.credits else None
