"""The synthetic long-context tasks: seeded generators, written for this project after the shape of
RULER's offline tasks (needle retrieval in several haystacks, multi-key / multi-value / multi-query
needles, variable tracking, common-word and frequent-word extraction) plus the project's passkey.

A task turns (seed, haystack size) into a ``Sample``: the *context* (instructions + haystack, the part
a query-agnostic run compresses before the question arrives), the *question*, an *answer prefix* (the
start of the assistant's answer, part of the prompt, as in RULER) and the expected strings. The size
is a count of haystack units (lines, sentences, list entries); ``prompts.fit`` picks the largest size
whose prompt fits a token length under the model's own tokenizer.

Everything random comes from ``random.Random(seed)`` with a string seed (hashed with SHA-512 by Python,
so it does not depend on PYTHONHASHSEED): the same (task, length, index, seed) always gives the same
sample. Needle depths depend only on the sample index (``depth_of``), so samples spread over the
context whatever their number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from benchmarks.quality import words

GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # target length in tokens (the prompt plus the answer budget fits in it)
    index: int
    context: str  # instructions + haystack: what a query-agnostic run compresses
    question: str  # asked after the context
    answer_prefix: str  # the start of the answer, part of the prompt
    answers: tuple[str, ...]  # every expected string (scoring: see scoring.py)
    max_new_tokens: int
    size: int = 0  # haystack units used

    @property
    def sample_id(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


@dataclass(frozen=True)
class Parts:
    """What a generator returns for one size: the sample without its bookkeeping."""

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random, int, float, int], Parts]  # (rng, size, depth, length) -> Parts
    max_new_tokens: int
    description: str
    min_size: int = 1


def depth_of(index: int) -> float:
    """Needle depth of sample ``index`` in [0.05, 0.95]: a low-discrepancy sequence, so any number of
    samples covers the context evenly and sample i's depth never changes."""
    return 0.05 + 0.9 * ((0.5 + index * GOLDEN) % 1.0)


def spread(depth: float, count: int) -> list[float]:
    """``count`` depths evenly spaced around the unit circle from ``depth``, kept inside [0.02, 0.98]."""
    return [min(0.98, max(0.02, (depth + k / count) % 1.0)) for k in range(count)]


def insert(units: list[str], needles: list[tuple[float, str]]) -> list[str]:
    """``units`` with each needle placed before the unit at its depth (ties keep the needles' order)."""
    out = list(units)
    at = sorted(((round(d * len(units)), k, text) for k, (d, text) in enumerate(needles)), reverse=True)
    for position, _, text in at:
        out.insert(position, text)
    return out


def seven_digits(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def distinct(rng: random.Random, draw: Callable[[random.Random], str], count: int) -> list[str]:
    seen: list[str] = []
    while len(seen) < count:
        item = draw(rng)
        if item not in seen:
            seen.append(item)
    return seen


def key_word(rng: random.Random) -> str:
    return f"{rng.choice(words.ADJECTIVES)}-{rng.choice(words.WORDS)}"


def noise(size: int) -> list[str]:
    return [words.NOISE] * size


def prose(seed: random.Random, size: int) -> list[str]:
    stream = words.prose(random.Random(seed.random()))
    return [next(stream) for _ in range(size)]


NIAH_HEADER = ("A few special magic numbers are hidden in the long text below. Read it carefully and "
               "remember them: you will be asked about them at the end.\n\n")


def needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def joined(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


# ---- the tasks ----------------------------------------------------------------------------------

def make_passkey(rng: random.Random, size: int, depth: float, length: int) -> Parts:
    key = str(rng.randint(10_000, 99_999))
    text = f"The pass key is {key}. Remember it. {key} is the pass key."
    units = insert(noise(size), [(depth, text)])
    return Parts(context="There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
                 + " ".join(units), question="What is the pass key?", answer_prefix="The pass key is",
                 answers=(key,))


def _single(haystack: str) -> Callable[[random.Random, int, float, int], Parts]:
    def make(rng: random.Random, size: int, depth: float, length: int) -> Parts:
        key, value = key_word(rng), seven_digits(rng)
        units = noise(size) if haystack == "noise" else prose(rng, size)
        body = " ".join(insert(units, [(depth, needle(key, value))]))
        return Parts(context=NIAH_HEADER + body,
                     question=f"What is the special magic number for {key} mentioned in the text above?",
                     answer_prefix=f"The special magic number for {key} mentioned in the text above is",
                     answers=(value,))
    return make


def make_multikey(rng: random.Random, size: int, depth: float, length: int) -> Parts:
    keys = distinct(rng, key_word, 4)
    values = distinct(rng, seven_digits, 4)
    depths = spread(depth, 4)
    body = " ".join(insert(prose(rng, size), [(d, needle(k, v)) for d, k, v in zip(depths, keys, values)]))
    asked = keys[0]  # the needle at the sample's own depth; the other three are distractors
    return Parts(context=NIAH_HEADER + body,
                 question=f"What is the special magic number for {asked} mentioned in the text above?",
                 answer_prefix=f"The special magic number for {asked} mentioned in the text above is",
                 answers=(values[0],))


def make_multivalue(rng: random.Random, size: int, depth: float, length: int) -> Parts:
    key = key_word(rng)
    values = distinct(rng, seven_digits, 4)
    body = " ".join(insert(prose(rng, size), [(d, needle(key, v)) for d, v in zip(spread(depth, 4), values)]))
    return Parts(context=NIAH_HEADER + body,
                 question=f"What are all the special magic numbers for {key} mentioned in the text above?",
                 answer_prefix=f"The special magic numbers for {key} mentioned in the text above are",
                 answers=tuple(values))


def make_multiquery(rng: random.Random, size: int, depth: float, length: int) -> Parts:
    keys = distinct(rng, key_word, 4)
    values = distinct(rng, seven_digits, 4)
    needles = [(d, needle(k, v)) for d, k, v in zip(spread(depth, 4), keys, values)]
    body = " ".join(insert(prose(rng, size), needles))
    return Parts(context=NIAH_HEADER + body,
                 question=f"What are the special magic numbers for {joined(keys)} mentioned in the text above?",
                 answer_prefix=f"The special magic numbers for {joined(keys)} mentioned in the text above are",
                 answers=tuple(values))


def variable_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


VT_HOPS = 4


def make_variable_tracking(rng: random.Random, size: int, depth: float, length: int) -> Parts:
    names = distinct(rng, variable_name, VT_HOPS + 1)
    value = str(rng.randint(10_000, 99_999))
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[k]} = VAR {names[k - 1]}." for k in range(1, len(names))]
    # The chain's lines in order, from the sample's depth over the next 80% of the text.
    depths = [min(0.98, depth * 0.2 + 0.8 * k / len(lines) + 0.05) for k in range(len(lines))]
    body = " ".join(insert(noise(size), list(zip(depths, lines))))
    return Parts(context="Memorize and track the chain of variable assignments hidden in the text below.\n\n" + body,
                 question=f"Find all variables that are assigned the value {value} in the text above.",
                 answer_prefix=(f"According to the chain of variable assignments in the text above, "
                                f"{len(names)} variables are assigned the value {value}, they are:"),
                 answers=tuple(names))


CWE_COMMON = 10
CWE_RARE_REPEATS = 3


def cwe_common_repeats(length: int) -> int:
    """How often each common word appears: 30 at 4k tokens, in proportion to the length (15 at 2k)."""
    return max(6, round(30 * length / 4096))


def make_common_words(rng: random.Random, size: int, depth: float, length: int) -> Parts:
    pool = list(words.WORDS)
    rng.shuffle(pool)
    common, rare = pool[:CWE_COMMON], pool[CWE_COMMON:CWE_COMMON + size]
    entries = common * cwe_common_repeats(length) + rare * CWE_RARE_REPEATS
    rng.shuffle(entries)
    listing = " ".join(f"{k + 1}. {word}" for k, word in enumerate(entries))
    return Parts(context=("Below is a numbered list of words. Some words appear more often than others. "
                          "Memorize the ones that appear most often.\n" + listing),
                 question=f"What are the {CWE_COMMON} most common words in the list above?",
                 answer_prefix=f"The {CWE_COMMON} words that appear most often in the list are:",
                 answers=tuple(common))


FWE_ALPHA = 2.0


def make_frequent_words(rng: random.Random, size: int, depth: float, length: int) -> Parts:
    """Coded words with Zipf counts: the word of rank r appears floor(size / r^2) times."""
    counts = []
    while (c := int(size / (len(counts) + 1) ** FWE_ALPHA)) >= 1:
        counts.append(c)
    vocab = distinct(rng, words.coded_word, len(counts))
    entries = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(entries)
    return Parts(context=("Read the coded text below and keep track of how often each coded word occurs.\n\n"
                          + " ".join(entries)),
                 question="What are the three most frequent coded words in the text above?",
                 answer_prefix="The three most frequent coded words in the text above are:",
                 answers=tuple(vocab[:3]))


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("passkey", make_passkey, 12, "a 5-digit pass key in repeated filler (the project's passkey recipe)"),
    Task("niah_single_noise", _single("noise"), 16, "one needle (key word -> 7-digit number) in repeated filler"),
    Task("niah_single_prose", _single("prose"), 16, "one needle in generated prose"),
    Task("niah_multikey", make_multikey, 16, "four needles with different keys in prose; one is asked"),
    Task("niah_multivalue", make_multivalue, 48, "four values under one key in prose; all are asked"),
    Task("niah_multiquery", make_multiquery, 48, "four needles in prose; all four keys are asked"),
    Task("vt", make_variable_tracking, 32, f"a chain of {VT_HOPS} variable assignments in filler; name every variable"),
    Task("cwe", make_common_words, 64, f"the {CWE_COMMON} most common words of a numbered list", min_size=5),
    Task("fwe", make_frequent_words, 32, "the 3 most frequent coded words (Zipf counts, alpha 2)", min_size=9),
)}


def sample_rng(task: str, length: int, index: int, seed: int) -> random.Random:
    return random.Random(f"{task}:{length}:{index}:{seed}")


def make_sample(task: str, length: int, index: int, size: int, seed: int = 0) -> Sample:
    """Sample ``index`` of ``task`` at haystack ``size`` (``prompts.fit`` chooses the size)."""
    spec = TASKS[task]
    parts = spec.make(sample_rng(task, length, index, seed), size, depth_of(index), length)
    return Sample(task=task, length=length, index=index, context=parts.context, question=parts.question,
                  answer_prefix=parts.answer_prefix, answers=parts.answers, max_new_tokens=spec.max_new_tokens,
                  size=size)
