"""Rule-based scorers: a response text (and optionally a reference answer) -> a float reward.

Each is reported as the component `reward/<name>`. Add a scorer by adding it to SCORERS; its description
goes into the reward server's config reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from embedded.task import negative_fraction, positive_fraction, response_words


@dataclass(frozen=True)
class RuleScorer:
    """`score(response, label)`: `response` is the response alone (prompt removed, special tokens skipped);
    `label` is the sample's reference answer, or None when the request carries no labels."""

    score: Callable[[str, str | None], float]
    description: str
    needs_labels: bool = False


def exact_match(response: str, label: str | None) -> float:
    """1.0 if the response equals the reference answer (both stripped of surrounding whitespace), else 0.0."""
    assert label is not None
    return float(response.strip() == label.strip())


def no_negative(response: str, label: str | None = None) -> float:
    """1 - negative_fraction(response): 1.0 for a response without negative words, and 0.0 for a response
    without any words, so an empty answer earns nothing."""
    if not response_words(response):
        return 0.0
    return 1.0 - negative_fraction(response)


SCORERS: dict[str, RuleScorer] = {
    "positive_fraction": RuleScorer(
        lambda response, label: positive_fraction(response),
        "the embedded task's ground truth: the fraction of response words that are positive",
    ),
    "no_negative": RuleScorer(
        no_negative,
        "1 - the fraction of response words that are negative, with positive_fraction's word rules; 0.0 for "
        "a response without words",
    ),
    "exact_match": RuleScorer(
        exact_match,
        "1.0 when the response equals the label, both stripped of surrounding whitespace, else 0.0; requests "
        "must carry labels",
        needs_labels=True,
    ),
}


def describe_scorers() -> str:
    """Every scorer with its description, for the config reference and --help."""
    return "; ".join(f"{name} ({scorer.description})" for name, scorer in SCORERS.items())


def component_name(scorer: str) -> str:
    return f"reward/{scorer}"
