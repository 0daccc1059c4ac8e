"""Rule-based scorers: a response text (and optionally a reference answer) -> a float reward.

Each is reported as the component `reward/<name>`. Add a scorer by adding it to SCORERS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from embedded.task import positive_fraction


@dataclass(frozen=True)
class RuleScorer:
    """`score(response, label)`: `response` is the response alone (prompt removed, special tokens skipped);
    `label` is the sample's reference answer, or None when the request carries no labels."""

    score: Callable[[str, str | None], float]
    needs_labels: bool = False


def exact_match(response: str, label: str | None) -> float:
    """1.0 if the response equals the reference answer (both stripped of surrounding whitespace), else 0.0."""
    assert label is not None
    return float(response.strip() == label.strip())


SCORERS: dict[str, RuleScorer] = {
    # Ground truth of the embedded task: the fraction of response words that are positive.
    "positive_fraction": RuleScorer(lambda response, label: positive_fraction(response)),
    "exact_match": RuleScorer(exact_match, needs_labels=True),
}


def component_name(scorer: str) -> str:
    return f"reward/{scorer}"
