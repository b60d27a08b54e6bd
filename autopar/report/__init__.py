"""Reading a plan: the text summary, the explanation, comparisons and the notebook view.

Everything here reads a :class:`autopar.Plan` only (a plan loaded from JSON works the
same), and formats SI values for people; nothing is re-estimated.
"""

from .compare import PlanComparison, compare, config_changes
from .explain import explain
from .html import plan_html
from .summary import summarize

__all__ = ["PlanComparison", "compare", "config_changes", "explain", "plan_html", "summarize"]
