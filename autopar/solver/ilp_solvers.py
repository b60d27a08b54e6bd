"""The solvers of the sharding ILPs (sharding.py): HiGHS in process, CBC through pulp as the fallback.

sharding.py states each group's ILP as arrays (an :class:`ILPModel`: columns with bounds and integrality,
rows of coefficients with bounds, objectives as column -> coefficient maps); a solver here takes
those arrays and an objective and returns the solution. Both are bounded by :class:`ILPLimits`:
branch-and-bound nodes by default (deterministic work), a wall-clock limit only when asked for.
A model HiGHS has solved before in this process, under a node limit alone, is answered from memory
(``_SOLVED``): planning again (another global batch, cluster, sweep point) meets the same layer groups.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import pulp

from ..errors import ConfigError

NODE_LIMIT = 20_000             # branch-and-bound nodes per solver call by default (deterministic work)


@dataclass
class ILPModel:
    """One group's ILP as arrays: columns (name, binary or continuous; every one in [0, 1]), rows
    (coefficients by column, lower and upper bound), and the linear forms the objectives and bounds
    use, each a column -> coefficient map plus a constant (``time`` in microseconds, ``memory`` in
    megabytes, ``tie`` the second solve's tie-break)."""

    names: list[str] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    s: list[list[int]] = field(default_factory=list)
    time: dict[int, float] = field(default_factory=dict)
    time_constant: float = 0.0
    memory: dict[int, float] = field(default_factory=dict)
    memory_constant: float = 0.0
    tie: dict[int, float] = field(default_factory=dict)
    timed_out: bool = False
    nodes: int = 0      # branch-and-bound nodes of the solves so far (HiGHS reports them; CBC through pulp does not)

    def var(self, name: str, binary: bool = False) -> int:
        """A new column in [0, 1]; its index."""
        self.names.append(name)
        self.binary.append(binary)
        return len(self.names) - 1

    def row(self, coefficients: dict[int, float], low: float, high: float) -> None:
        self.rows.append((coefficients, low, high))

    def column_order(self) -> list[int]:
        """Columns by name: the order the solvers get them in (PuLP's, so layouts did not move)."""
        return sorted(range(len(self.names)), key=self.names.__getitem__)


@dataclass(frozen=True)
class ILPLimits:
    """Limits on every sharding ILP solver call: ``nodes`` branch-and-bound nodes (deterministic:
    the same plan on any machine; None: no limit) and ``time`` seconds of wall clock (None, the
    default: no clock limit; set one only when a bounded solve time matters more than a plan that
    does not depend on how busy the machine is). Past either the best integer solution is used."""

    time: float | None = None
    nodes: int | None = NODE_LIMIT

    def __post_init__(self) -> None:
        if self.time is not None and (isinstance(self.time, bool) or not isinstance(self.time, (int, float))
                                      or not self.time > 0):
            raise ConfigError(f"ilp_time_limit={self.time!r} must be a positive number of seconds (or None for "
                              "no wall-clock limit)")
        if self.nodes is not None and (isinstance(self.nodes, bool) or not isinstance(self.nodes, int)
                                       or self.nodes < 1):
            raise ConfigError(f"ilp_node_limit={self.nodes!r} must be a positive integer (or None for no limit)")


def lp_solvers(limits: ILPLimits = ILPLimits(), gap_abs: float = 0.0, gap_rel: float = 0.0) -> list[tuple[str, Any]]:
    """The solvers to try, in order, as (name, solver): HiGHS when ``highspy`` imports (in process: no
    solver binary to start, no files), then CBC (bundled with pulp). Both stop within an absolute gap
    of ``gap_abs`` (objective units) or a relative one of ``gap_rel`` of the optimum (0: exact), on one
    thread. Almost every group solves in well under a second; the node limit stops a rare hard one
    from stalling the search. A solver's ``solve(model, objective)`` returns ``(status, values,
    nodes)``: status ``"optimal"``, ``"stopped"`` (at a limit, with an integer solution) or what it
    ended with; the column values (None without a solution); the branch-and-bound nodes it took."""
    out: list[tuple[str, Any]] = []
    if _highs_ready():
        out.append(("HiGHS", _HiGHS(limits, gap_abs, gap_rel)))
    cbc = _CBC(limits, gap_abs, gap_rel)
    if cbc.command.available():
        out.append(("CBC", cbc))
    return out


class _HiGHS:
    """HiGHS through ``highspy``, the model passed as arrays in a few calls. (PuLP's HiGHS interface
    adds every column and row in its own Python call and reads back every variable: a third of each
    group's ILP time on small layers, measured. Columns go in name order and rows in order, as PuLP
    passed them, so the solves, and the layouts, are those PuLP's interface gave.)"""

    def __init__(self, limits: ILPLimits, gap_abs: float, gap_rel: float) -> None:
        # no MIP restarts: HiGHS 1.16's restart after root presolve can loop without end and without
        # checking its time limit (found on a hybrid attention/Mamba layer's group by the Hugging
        # Face sweep, bench/hf_coverage.py); without them the node limit bounds every solve
        self.options: dict[str, Any] = {"output_flag": False, "mip_rel_gap": gap_rel, "mip_abs_gap": gap_abs,
                                        "threads": 1, "mip_allow_restart": False}
        if limits.time is not None:
            self.options["time_limit"] = float(limits.time)
        if limits.nodes is not None:
            self.options["mip_max_nodes"] = limits.nodes

    @property
    def timeLimit(self) -> float | None:   # noqa: N802 - the name pulp's solvers give it
        """Seconds of wall clock a call may take (None: none)."""
        return self.options.get("time_limit")

    def solve(self, m: ILPModel, objective: dict[int, float]) -> tuple[str, list[float] | None, int]:
        import highspy
        import numpy as np
        order = m.column_order()
        pos = np.empty(len(order), dtype=np.int32)
        pos[order] = np.arange(len(order), dtype=np.int32)
        n = len(order)
        cost = np.zeros(n)
        for i, c in objective.items():
            cost[pos[i]] += c
        binary = pos[np.flatnonzero(m.binary)].astype(np.int32)
        starts, index, value = [], [], []
        for coefs, _, _ in m.rows:
            starts.append(len(index))
            for i, c in coefs.items():
                if c:
                    index.append(pos[i])
                    value.append(c)
        inf = highspy.kHighsInf
        lower = np.array([max(lo, -inf) for _, lo, _ in m.rows], dtype=float)
        upper = np.array([min(hi, inf) for _, _, hi in m.rows], dtype=float)
        starts, index, value = (np.asarray(starts, dtype=np.int32), np.asarray(index, dtype=np.int32),
                                np.asarray(value, dtype=float))
        key = None
        if "time_limit" not in self.options:   # a clock-limited solve's answer depends on the clock: never reused
            key = _model_key(self.options, n, cost, binary, lower, upper, starts, index, value)
            if key in _SOLVED:
                _SOLVED.move_to_end(key)
                status, values, nodes = _SOLVED[key]
                return status, (None if values is None else [values[p] for p in pos]), nodes
        h = highspy.Highs()
        for k, v in self.options.items():
            h.setOptionValue(k, v)
        h.addVars(n, np.zeros(n), np.ones(n))
        h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
        h.changeColsIntegrality(len(binary), binary, np.full(len(binary), highspy.HighsVarType.kInteger))
        h.addRows(len(m.rows), lower, upper, len(index), starts, index, value)
        h.run()
        status, nodes = h.getModelStatus(), int(h.getInfo().mip_node_count)
        has_solution = h.getInfo().primal_solution_status == 2   # kSolutionStatusFeasible
        if status == highspy.HighsModelStatus.kOptimal:
            outcome, solution = "optimal", list(h.getSolution().col_value)
        elif has_solution and math.isfinite(h.getInfo().objective_function_value):
            # a node, time or iteration limit, with the best integer solution so far
            outcome, solution = "stopped", list(h.getSolution().col_value)
        else:
            outcome, solution = h.modelStatusToString(status), None
        if key is not None:
            _SOLVED[key] = (outcome, solution, nodes)
            if len(_SOLVED) > SOLVED_KEPT:
                _SOLVED.popitem(last=False)
        return outcome, (None if solution is None else [solution[p] for p in pos]), nodes


# Solved models, by content (the arrays HiGHS gets and its options) -> (status, column values in HiGHS's
# order, nodes). One HiGHS thread under a node limit is deterministic: the same model gives the same answer,
# so a model met again (the same layer group priced for another global batch, cluster size or data-parallel
# degree; a sweep; a notebook planning again) is answered without solving. Least recently used first out.
SOLVED_KEPT = 4096
_SOLVED: OrderedDict[bytes, tuple[str, list[float] | None, int]] = OrderedDict()


def solved_models() -> dict[bytes, tuple]:
    """The models answered from memory (a copy): what a second process solved, to send back."""
    return dict(_SOLVED)


def remember(models: Mapping[bytes, tuple]) -> None:
    """Take models another process solved (:func:`solved_models`' entries) into this one's memory."""
    for key, answer in models.items():
        _SOLVED[key] = answer
        _SOLVED.move_to_end(key)
    while len(_SOLVED) > SOLVED_KEPT:
        _SOLVED.popitem(last=False)


def _model_key(options: dict[str, Any], *arrays: Any) -> bytes:
    digest = hashlib.blake2b(repr(sorted(options.items())).encode(), digest_size=20)
    for a in arrays:
        digest.update(a.tobytes() if hasattr(a, "tobytes") else repr(a).encode())
        digest.update(b"|")
    return digest.digest()


class _CBC:
    """CBC, bundled with pulp, on the same arrays rebuilt as a pulp model (the fallback)."""

    def __init__(self, limits: ILPLimits, gap_abs: float, gap_rel: float) -> None:
        with warnings.catch_warnings():  # PuLP 3.3 announces its bundled CBC will move to an extra in 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            self.command = pulp.PULP_CBC_CMD(msg=False, threads=1, timeLimit=limits.time, maxNodes=limits.nodes,
                                             gapRel=gap_rel, gapAbs=gap_abs)

    @property
    def timeLimit(self) -> float | None:   # noqa: N802 - the name pulp's solvers give it
        """Seconds of wall clock a call may take (None: none)."""
        return self.command.timeLimit

    def solve(self, m: ILPModel, objective: dict[int, float]) -> tuple[str, list[float] | None, int]:
        prob = pulp.LpProblem("sharding", pulp.LpMinimize)
        cols = [_var(prob, name, 0, 1, pulp.LpBinary if b else pulp.LpContinuous) for name, b in zip(m.names, m.binary)]
        for n, (coefs, lo, hi) in enumerate(m.rows):
            expr = pulp.LpAffineExpression([(cols[i], c) for i, c in coefs.items() if c])
            if lo == hi:
                prob += expr == lo, f"r{n}"
            else:
                if lo > -math.inf:
                    prob += expr >= lo, f"r{n}_lo"
                if hi < math.inf:
                    prob += expr <= hi, f"r{n}_hi"
        prob.setObjective(pulp.LpAffineExpression([(cols[i], c) for i, c in objective.items()]))
        status = prob.solve(self.command)
        if prob.sol_status == pulp.LpSolutionIntegerFeasible:
            outcome = "stopped"
        elif pulp.LpStatus[status] == "Optimal":
            outcome = "optimal"
        else:
            return pulp.LpStatus[status], None, 0
        return outcome, [v.varValue or 0.0 for v in cols], 0   # CBC through pulp reports no node count


@functools.lru_cache(maxsize=None)
def _highs_ready() -> bool:
    """Whether HiGHS imports. Its first ``Highs()`` prints a banner from C++ to standard output
    whatever the options; that one is made here with the output file descriptor pointed at
    /dev/null, so that a plan's output (a CLI summary, a notebook cell) stays the plan's."""
    try:
        import highspy
    except ImportError:
        return False
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return True


def _var(prob: pulp.LpProblem, name: str, low: float, up: float, cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    """A variable of ``prob`` (PuLP >= 3.3 attaches it to the model; older versions build it apart)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


__all__ = ["NODE_LIMIT", "ILPLimits", "lp_solvers"]
