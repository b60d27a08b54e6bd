"""The balanced split of layers into pipeline chunks (cost_model/schedule.balanced_partitions) against the
linear-partition recurrence written out in Python: the same runs, ties broken alike (the first start
reaching the least largest run), on integer costs (exact sums, many ties) and on float ones."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost_model.schedule import balanced_partitions


def _reference(cost: list[float], parts: int) -> list[list[int]]:
    n = len(cost)
    pre = np.concatenate([[0.0], np.cumsum(cost)])
    best = {(0, 0): 0.0}
    start = {}
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            options = [(max(best[(k - 1, i)], pre[j] - pre[i]), i) for i in range(k - 1, j) if (k - 1, i) in best]
            least = min(v for v, _ in options)
            best[(k, j)], start[(k, j)] = least, next(i for v, i in options if v == least)
    runs, j = [], n
    for k in range(parts, 0, -1):
        i = start[(k, j)]
        runs.append(list(range(i, j)))
        j = i
    return runs[::-1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=14) | st.lists(st.floats(0, 1e3), min_size=1, max_size=14),
       st.data())
def test_balanced_partition_is_the_recurrence(cost, data):
    """Each of several costs of one length solved together is its own recurrence's split."""
    parts = data.draw(st.integers(1, len(cost)))
    other = data.draw(st.permutations(cost))   # another cost of the same length, in the same call
    for runs, c in zip(balanced_partitions([tuple(map(float, cost)), tuple(map(float, other))], parts), (cost, other)):
        assert [list(run) for run in runs] == _reference([float(x) for x in c], parts)
        assert [i for run in runs for i in run] == list(range(len(c))) and all(runs)


def test_balanced_partition_minimises_the_largest_run():
    """Against every contiguous split of a small model (the recurrence's optimum is the optimum)."""
    cost = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for parts in range(1, len(cost) + 1):
        least = min(max(sum(cost[a:b]) for a, b in zip((0, *cuts), (*cuts, len(cost))))
                    for cuts in itertools.combinations(range(1, len(cost)), parts - 1))
        assert max(sum(cost[i] for i in run) for run in balanced_partitions([tuple(cost)], parts)[0]) == least
