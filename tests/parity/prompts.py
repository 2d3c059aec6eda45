"""The prompts of the parity tests: real text of a few hundred tokens each, written for this project.

Three kinds, so that keys and attention patterns differ: a passkey haystack (the project's passkey
recipe, ~540 tokens), a prose question in SmolLM2's chat template, and a code-review request.
"""

from __future__ import annotations

from typing import Any

from tests.engine.test_quality_passkey import passkey_prompts
from vllm_evict.reference import prompt_token_ids

LIGHTHOUSES = (
    "Before electric lamps, a lighthouse keeper's night was a sequence of small chores repeated until dawn. "
    "The wick had to be trimmed every few hours, because a charred wick smoked and dimmed the flame. The "
    "lens, often a stack of glass prisms taller than the keeper, had to be polished so that salt and soot "
    "did not scatter the beam. In towers with a rotating light, a clockwork drive was wound by hand, and a "
    "weight slowly descended through the middle of the tower as the mechanism turned. If the keeper fell "
    "asleep and the weight reached the floor, the light stopped turning, and a fixed light could be "
    "mistaken by a passing ship for a different station along the coast.\n\n"
    "Keepers kept a log: the weather at set hours, the times the lamp was lit and put out, the oil burned, "
    "and every ship that passed close enough to be named. Inspectors read these logs on their visits and "
    "compared the oil consumption with the hours of darkness, which made it hard to hide a lamp that had "
    "been left unlit. Families often lived at the station, and children on remote rocks were taught by "
    "their parents or by a teacher who travelled from one station to the next by boat.\n\n"
    "Fog was the hardest condition. A light that could be seen for twenty miles on a clear night might "
    "vanish at a few hundred yards, so many stations added a fog signal: first bells struck by hand, later "
    "horns driven by compressed air. Sounding the horn through a long fog could take days without rest, "
    "and the logs of some stations record keepers working for more than seventy hours straight.\n\n"
    "Question: According to the text, why did a stopped clockwork drive matter to ships, and how did "
    "inspectors check that the lamp had really been lit?"
)

CODE_REVIEW = '''Review the following Python function and list every bug you find, with a one-line fix for each.

def merge_intervals(intervals):
    """Merge overlapping closed intervals given as (start, end) pairs."""
    if not intervals:
        return intervals
    intervals.sort()
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        last_start, last_end = merged[-1]
        if start < last_end:
            merged[-1] = (last_start, end)
        else:
            merged.append((start, end))
    return merged


def total_covered(intervals):
    """Total length covered by a list of closed intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))


if __name__ == "__main__":
    print(merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)]))
    print(merge_intervals([(1, 4), (4, 5)]))
    print(merge_intervals([(1, 10), (2, 3)]))
    print(total_covered([(0, 2), (1, 5), (7, 9)]))

Answer with a numbered list. For each bug, give the input that shows it, the wrong output, and the
expected output.'''


def parity_prompts(tokenizer: Any) -> dict[str, list[int]]:
    """name -> prompt token ids (537, 388 and 312 tokens with SmolLM2's tokenizer)."""
    return {
        "passkey": prompt_token_ids(tokenizer, passkey_prompts()[2][0]),  # the needle at depth 0.35
        "lighthouses-chat": prompt_token_ids(tokenizer, LIGHTHOUSES, chat=True),
        "code-review": prompt_token_ids(tokenizer, CODE_REVIEW),
    }
