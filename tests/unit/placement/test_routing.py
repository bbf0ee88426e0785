"""The routing rule on its own (no processes, no clocks): ties, credits, unmeasured targets,
and on a simulated clock a fast and a slow target both kept busy."""

from __future__ import annotations

import heapq

from dflash.placement.transport.routing import RouteView, pick_target


def view(**kw) -> RouteView:
    base = dict(credits=4, in_flight={0: 0, 1: 0}, tokens_in_flight={0: 0, 1: 0})
    return RouteView(**{**base, **kw})


def test_equal_speeds_pick_the_emptier_target_and_break_ties_by_node_then_rank():
    speeds = {0: 1e-3, 1: 1e-3}
    assert pick_target(view(sec_per_token=speeds), 100) == 0
    assert pick_target(view(sec_per_token=speeds, same_node={0: False, 1: True}), 100) == 1
    busy = view(sec_per_token=speeds, in_flight={0: 2, 1: 1}, tokens_in_flight={0: 200, 1: 100})
    assert pick_target(busy, 100) == 1


def test_a_four_times_slower_target_takes_work_only_when_it_finishes_first():
    speeds = {0: 4e-3, 1: 1e-3}
    assert pick_target(view(sec_per_token=speeds, in_flight={0: 0, 1: 2}, tokens_in_flight={0: 0, 1: 200}), 100) == 1
    assert pick_target(view(sec_per_token=speeds, in_flight={0: 0, 1: 4}, tokens_in_flight={0: 0, 1: 500}), 100) == 0
    # the fast target would still finish first, but its credit is used up: wait, route again later
    assert pick_target(view(sec_per_token=speeds, in_flight={0: 0, 1: 4}, tokens_in_flight={0: 0, 1: 200}), 100) is None
    # the backlog other drafters left at the fast target counts too
    assert pick_target(view(sec_per_token=speeds, backlog={1: 1000}), 100) == 0


def test_an_unmeasured_target_gets_one_request_at_a_time():
    v = view(sec_per_token={1: 1e-3}, in_flight={0: 1, 1: 3}, tokens_in_flight={0: 100, 1: 300})
    assert pick_target(v, 100) == 1  # target 0 has one in flight and no measured speed
    assert pick_target(view(in_flight={0: 1, 1: 1}, tokens_in_flight={0: 100, 1: 100}), 100) is None


def simulate(seconds_per_request: dict[int, float], credits: int, steps: int) -> tuple[float, dict[int, int], int]:
    """One drafter consuming in step order from targets that serve FIFO at fixed speeds; the
    drafter itself costs nothing. Returns (steps per simulated second, served per target,
    deepest queue)."""
    tokens = 100
    v = RouteView(credits, {t: 0 for t in seconds_per_request}, {t: 0 for t in seconds_per_request})
    free_at = {t: 0.0 for t in seconds_per_request}
    done: dict[int, tuple[float, int]] = {}  # step -> (finish time, target)
    events: list[tuple[float, int]] = []
    now, sent, served, deepest, first_done = 0.0, 0, {t: 0 for t in seconds_per_request}, 0, None
    for step in range(steps):
        while sent < steps and (target := pick_target(v, tokens)) is not None:
            finish = max(now, free_at[target]) + seconds_per_request[target]
            free_at[target] = finish
            done[sent] = (finish, target)
            heapq.heappush(events, (finish, sent))
            v.in_flight[target] += 1
            v.tokens_in_flight[target] += tokens
            deepest = max(deepest, v.in_flight[target])
            sent += 1
        finish, target = done[step]
        while events and events[0][0] <= max(now, finish):  # credits return as responses arrive
            t_done, s = heapq.heappop(events)
            t = done[s][1]
            v.in_flight[t] -= 1
            v.tokens_in_flight[t] -= tokens
            v.sec_per_token[t] = seconds_per_request[t] / tokens
        now = max(now, finish)
        served[target] += 1
        first_done = first_done if first_done is not None else now
    return (steps - 1) / (now - first_done), served, deepest


def test_simulated_fast_and_slow_targets_are_both_kept_busy_within_credits():
    speeds = {0: 0.080, 1: 0.020}  # rank 0 is 4x slower and would win every tie on rank
    rate, served, deepest = simulate(speeds, credits=4, steps=400)
    bound = sum(1 / s for s in speeds.values())
    assert rate >= 0.9 * bound, (rate, bound, served)
    assert served[0] < served[1] / 2
    assert deepest <= 4
