"""Budgets per caller: the join token at one address registers a whole roster at once (local mode
puts every node behind loopback), while a node or an operator keeps one caller's budget."""

from __future__ import annotations

from megascale.resilience.driver.api_budget import Budget, CallerBudgets, caller_key
from megascale.resilience.driver.identity import JOIN, NODE, OPERATOR, Principal

ROSTER = 256


def _granted(budgets: CallerBudgets, key: str, requests: int) -> int:
    """How many of `requests` sent at once are let through (bucket and queue both)."""
    return sum(budgets.take(key, 1.0, now=0.0) == 0.0 and budgets.queue(key) for _ in range(requests))


def test_the_join_token_at_one_address_has_the_rosters_budget():
    budgets = CallerBudgets(Budget(per_address=ROSTER))
    join = caller_key(Principal(JOIN), "127.0.0.1")
    assert _granted(budgets, join, ROSTER) == ROSTER  # every node's registration at once


def test_a_node_and_an_operator_keep_one_callers_budget():
    budget = Budget(per_address=ROSTER)
    for who in (Principal(NODE, node="n1"), Principal(OPERATOR)):
        granted = _granted(CallerBudgets(budget), caller_key(who, "127.0.0.1"), ROSTER)
        assert granted == budget.max_pending, who  # the queue cap of one caller


def test_without_a_roster_the_join_token_is_one_caller():
    assert _granted(CallerBudgets(Budget()), caller_key(Principal(JOIN), "127.0.0.1"), ROSTER) == Budget.max_pending
