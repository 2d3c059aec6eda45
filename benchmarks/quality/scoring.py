"""Scoring by exact match of the expected strings, RULER's ``string_match_all`` rule for every task.

A sample scores the fraction of its expected strings that occur in the model's answer, compared
case-insensitively as plain substrings: 1.0 when every one is there. Single-answer tasks (passkey, the
single and multi-key needles) are therefore right or wrong; multi-value, multi-query, variable tracking,
common and frequent words earn partial credit per string found. A task's score is the mean over its
samples, times 100.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def string_match_all(answer: str, expected: Sequence[str]) -> float:
    """Fraction of ``expected`` found in ``answer`` (case-insensitive substrings); 0.0 for no strings."""
    if not expected:
        return 0.0
    text = answer.lower()
    return sum(item.lower() in text for item in expected) / len(expected)


def mean_percent(scores: Iterable[float]) -> float | None:
    """100 x the mean of per-sample scores in [0, 1]; None when there are none."""
    values = list(scores)
    return 100.0 * sum(values) / len(values) if values else None
