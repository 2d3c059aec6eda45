"""Token ids of a sample, the same for every backend: the context part and the question part.

The model's chat template is applied to one user message, context then question; the token stream is
cut where the question starts, as NVIDIA kvpress's pipeline does (a marker string is put after the
context, the templated text is split at it):

    context part  = template head + context                  (compressed in both settings)
    question part = "\n\n" + question + template tail + answer prefix
                                                              (query-aware: compressed with the context;
                                                               query-agnostic: appended after compression)

The two parts are tokenized separately and concatenated, so both settings and both backends see exactly
the same token ids. ``fit`` picks the largest haystack whose prompt plus the answer budget fits a
target length in the model's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.quality.tasks import TASKS, Sample, make_sample

MARKER = "\u2063QUESTION\u2063"  # never produced by a task


@dataclass(frozen=True)
class Prompt:
    sample: Sample
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]

    @property
    def ids(self) -> list[int]:
        return list(self.context_ids) + list(self.question_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


def template_parts(tokenizer: Any, context: str) -> tuple[str, str]:
    """(template head + context, template tail) for one user message holding ``context``."""
    if getattr(tokenizer, "chat_template", None) is None:
        return (tokenizer.bos_token or "") + context, "\n"
    text = tokenizer.apply_chat_template([{"role": "user", "content": context + MARKER}],
                                         add_generation_prompt=True, tokenize=False)
    head, tail = text.split(MARKER)
    return head, tail


def build(tokenizer: Any, sample: Sample) -> Prompt:
    head, tail = template_parts(tokenizer, sample.context)
    question = "\n\n" + sample.question + tail + sample.answer_prefix
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return Prompt(sample=sample, context_ids=encode(head), question_ids=encode(question))


def fit(tokenizer: Any, task: str, length: int, index: int, seed: int = 0) -> Prompt:
    """The sample of the largest haystack size whose prompt + ``max_new_tokens`` is at most ``length``
    tokens (bisection: prompt length grows with the size). Raises if even the smallest does not fit."""
    spec = TASKS[task]
    budget = length - spec.max_new_tokens

    def at(size: int) -> Prompt:
        return build(tokenizer, make_sample(task, length, index, size, seed))

    low = spec.min_size
    if at(low).num_tokens > budget:
        raise ValueError(f"{task}: even the smallest haystack does not fit in {length} tokens")
    high = low * 2
    while at(high).num_tokens <= budget:
        low, high = high, high * 2
    while high - low > 1:  # invariant: at(low) fits, at(high) does not
        mid = (low + high) // 2
        if at(mid).num_tokens <= budget:
            low = mid
        else:
            high = mid
    return at(low)
