"""docs/plan-format.md stays true: every key of a real plan's JSON is documented, nothing documented
is gone, and each field's "On read" column says what load_plan really does when the key is missing.

Convention (stated in the page): every field is one row of a markdown table whose first cell is the
key path in backticks and whose other four cells are type, unit, on read and meaning::

    | `stages[].memory.params` | number | bytes | required | ... |

``a[]`` is an element of the list ``a`` (a list of objects); ``<name>`` stands for any key of a
free-form mapping (a parameter name, an input name, a collective); ``{x,y}`` is ``x`` or ``y``
(each may be a path itself, as in ``{config,alternatives[].config}.dp``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re

import pytest

import autopar
from autopar import Cluster, ParallelConfig, Plan
from autopar.conditions import ProfileConditions
from autopar.hardware import CollectiveFit
from autopar.errors import PlanFormatError
from autopar.models import build_mlp, registry
from autopar.plan import SCHEMA_VERSION

DOC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "plan-format.md")
ON_READ = ("required", "optional", "kept")
Path = tuple[str, ...]


# --- the plans ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plans(plan_gpt) -> dict[str, dict]:
    """JSON dictionaries of real plans that together hold every field the format has."""
    model, inputs, _ = plan_gpt
    out = {}
    # an estimate: interleaved pipeline, no search results (optimal null, no alternatives or sharding)
    cfg = ParallelConfig(dp=4, pp=2, schedule="interleaved", virtual_stages=2, zero=1, recompute="selective")
    out["estimate-interleaved"] = autopar.estimate(model, Cluster.from_spec("1x8xA100-80GB"), inputs, cfg,
                                                   global_batch_size=64)
    # a searched plan on two nodes (inter-node links): alternatives, per-op sharding, search stats
    tiny, tiny_inputs = registry.build("gpt-tiny", device="meta")
    searched = autopar.plan(tiny, Cluster.from_spec("2x8xA100-80GB"), tiny_inputs, global_batch_size=64,
                            fixed={"tp": 2})
    assert searched.sharding and searched.alternatives, "the tp=2 plan must carry sharding and alternatives"
    out["plan-2-nodes"] = searched
    # an NVLink domain of two GB200 trays (devices_per_host), a device with fp8 and fp4 peaks
    out["estimate-gb200-domain"] = autopar.estimate(tiny, Cluster.from_spec("1x8xGB200"), tiny_inputs,
                                                    ParallelConfig(dp=8), global_batch_size=64)
    # positional inputs, measured links (Link.collectives) and their conditions, as Cluster.local() writes them
    base = Cluster.from_spec("1x2xcpu")
    fit = {"all_reduce": CollectiveFit(latency=2e-5, bandwidth=3e9), "p2p": CollectiveFit(latency=1e-5, bandwidth=4e9)}
    conditions = ProfileConditions(part="device", device_type="cpu",
                                   measured_at="2026-01-02T03:04:05+00:00", torch_version="2.13.0",
                                   threads=1, cores=2, load_average=0.1, other_load=0.05, own_load=1.0,
                                   wait_fraction=0.002, spread=0.1)
    measured = dataclasses.replace(base, intra_node=dataclasses.replace(base.intra_node, collectives=fit),
                                   inter_node=dataclasses.replace(base.inter_node, collectives=fit),
                                   profile_conditions=(conditions,))
    mlp, mlp_inputs = build_mlp(device="meta")
    out["estimate-measured-links"] = autopar.estimate(mlp, measured, mlp_inputs, ParallelConfig(dp=2),
                                                      global_batch_size=8,
                                                      loss_fn=lambda y, inp: y.float().pow(2).mean())
    return {name: plan.to_dict() for name, plan in out.items()}


# --- key paths ------------------------------------------------------------------------------------
def key_paths(value: dict, prefix: Path = ()) -> list[Path]:
    """Every key path of a JSON object; list elements that are objects add ``[]`` to the list's key."""
    out = []
    for key, child in value.items():
        path = prefix + (key,)
        out.append(path)
        if isinstance(child, dict):
            out += key_paths(child, path)
        elif isinstance(child, list):
            element = path[:-1] + (path[-1] + "[]",)
            for item in child:
                if isinstance(item, dict):
                    out += key_paths(item, element)
    return out


def _segment_matches(pattern: str, key: str) -> bool:
    if pattern.endswith("[]") != key.endswith("[]"):
        return False
    pattern, key = pattern.removesuffix("[]"), key.removesuffix("[]")
    return pattern == key or (pattern.startswith("<") and pattern.endswith(">"))


def matches(pattern: Path, path: Path) -> bool:
    return len(pattern) == len(path) and all(_segment_matches(p, k) for p, k in zip(pattern, path))


def show(path: Path) -> str:
    return ".".join(path)


# --- the page -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def doc_text() -> str:
    with open(DOC) as fh:
        return fh.read()


def _expand(text: str) -> list[str]:
    """``{a,b[].c}.d`` -> ``["a.d", "b[].c.d"]`` (every brace is one choice among its comma-separated parts)."""
    parts = re.split(r"\{([^{}]*)\}", text)   # literal, choices, literal, choices, ..., literal
    options = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


@pytest.fixture(scope="module")
def rows(doc_text) -> dict[Path, list[str]]:
    """Documented pattern (alternatives expanded) -> the row's cells after the first."""
    out: dict[Path, list[str]] = {}
    for line in doc_text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        field = re.fullmatch(r"`([^`]+)`", cells[0])
        if field is None:
            continue
        for text in _expand(field.group(1)):
            pattern = tuple(text.split("."))
            assert pattern not in out, f"{text} is documented twice"
            out[pattern] = cells[1:]
    assert len(out) > 50, "docs/plan-format.md lost its field tables"
    return out


def test_every_field_of_a_plan_is_documented(plans, rows) -> None:
    missing = sorted({show(path) for data in plans.values() for path in key_paths(data)
                      if not any(matches(pattern, path) for pattern in rows)})
    assert not missing, ("plan.to_dict() has fields docs/plan-format.md does not document; add a table row "
                         "| `path` | type | unit | on read | meaning | for each: " + ", ".join(missing))


def test_no_documented_field_is_stale(plans, rows) -> None:
    paths = {path for data in plans.values() for path in key_paths(data)}
    stale = sorted(show(pattern) for pattern in rows if not any(matches(pattern, path) for path in paths))
    assert not stale, ("docs/plan-format.md documents fields no plan has any more (renamed or removed?): "
                       + ", ".join(stale))


def test_every_row_gives_type_unit_and_meaning(rows) -> None:
    bad = [show(p) for p, cells in rows.items()
           if len(cells) != 4 or not all(cells) or cells[2] not in ON_READ]
    assert not bad, (f"these rows need 5 cells (field, type, unit, on read, meaning), 'on read' one of {ON_READ} "
                     "and none empty: " + ", ".join(bad))


def _delete(node: object, pattern: Path) -> int:
    """Delete every key matching ``pattern`` below ``node``; how many were deleted."""
    if not isinstance(node, dict):
        return 0
    head, rest = pattern[0], pattern[1:]
    count = 0
    for key in [k for k in node if _segment_matches(head.removesuffix("[]"), k)]:
        if not rest:
            del node[key]
            count += 1
        elif head.endswith("[]"):
            count += sum(_delete(item, rest) for item in node[key] or [])
        else:
            count += _delete(node[key], rest)
    return count


def test_on_read_column_is_what_load_plan_does(plans, rows) -> None:
    """"required": no plan loads without the key. "optional" / "kept": the reader never says the key is
    missing (a default may still clash with another field and be refused: without config.tp, tp=1
    and sequence_parallel=true do not go together)."""
    wrong = []
    for pattern, cells in rows.items():
        errors = {}
        for name, data in plans.items():
            changed = copy.deepcopy(data)
            if not _delete(changed, pattern):
                continue
            try:
                Plan.from_dict(changed)
                errors[name] = None
            except PlanFormatError as exc:
                errors[name] = str(exc)
        if cells[2] == "required":
            loaded = sorted(name for name, err in errors.items() if err is None)
            if loaded:
                wrong.append(f"{show(pattern)} is documented required, but {loaded} load without it")
        else:
            missing = [err for err in errors.values() if err is not None and "missing" in err]
            if missing:
                wrong.append(f"{show(pattern)} is documented {cells[2]}, but without it: {missing[0]}")
    assert not wrong, "the 'On read' column of docs/plan-format.md is wrong: " + "; ".join(wrong)


def test_documented_schema_version_is_current(doc_text) -> None:
    assert f"The current `schema_version` is {SCHEMA_VERSION}." in doc_text, \
        f"docs/plan-format.md must say 'The current `schema_version` is {SCHEMA_VERSION}.'"
