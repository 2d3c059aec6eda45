"""The quality suite's pure parts (benchmarks/quality): generators, prompt fitting, scoring, the results
file and the report's arithmetic. No model runs; the tokenizer is SmolLM2's (a few seconds)."""

from __future__ import annotations

import collections
import json
import re
from typing import Any

import pytest

from benchmarks.quality import methods as M
from benchmarks.quality import prompts as P
from benchmarks.quality import report, tasks
from benchmarks.quality.results import Store, key_of
from benchmarks.quality.scoring import mean_percent, string_match_all


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


# ---- generators ---------------------------------------------------------------------------------
@pytest.mark.parametrize("task", list(tasks.TASKS))
def test_samples_are_reproducible_and_differ_by_index_and_seed(task):
    size = 40
    a = tasks.make_sample(task, 4096, 3, size)
    assert a == tasks.make_sample(task, 4096, 3, size)  # same arguments, same sample, every field
    assert a.context != tasks.make_sample(task, 4096, 4, size).context
    assert a.answers != tasks.make_sample(task, 4096, 3, size, seed=1).answers
    assert a.sample_id == f"{task}/4096/3" and a.max_new_tokens == tasks.TASKS[task].max_new_tokens


def test_sample_text_is_pinned():
    """The generators' output must not drift silently: results files are keyed by (task, length, index)."""
    s = tasks.make_sample("niah_single_prose", 2048, 0, 6)
    assert s.answers == ("2017025",)
    assert s.question == "What is the special magic number for hidden-lumber mentioned in the text above?"
    assert s.context.endswith("One of the special magic numbers for hidden-lumber is: 2017025. In the evening, the "
                              "rope and the knife were left beside the north road. A quiet doctor said that the "
                              "mango looked deep in early spring. It is said that a shy student once discovered a "
                              "stove made of wolf.")


@pytest.mark.parametrize("task", ["passkey", "niah_single_noise", "niah_single_prose", "niah_multikey",
                                  "niah_multivalue", "niah_multiquery"])
def test_every_expected_number_is_in_the_context_once(task):
    s = tasks.make_sample(task, 4096, 5, 60)
    for answer in s.answers:
        assert len(re.findall(rf"(?<!\d){answer}(?!\d)", s.context)) == (2 if task == "passkey" else 1), answer
    numbers = set(re.findall(r"\d+", s.context))  # the haystacks hold no digits
    if task == "niah_multikey":  # three distractor needles with other keys and numbers
        assert len(numbers) == 4 and s.answers[0] in numbers
    else:
        assert numbers == set(s.answers)


def test_needle_depth_follows_the_sample_index():
    depths = [tasks.depth_of(i) for i in range(8)]
    assert all(0.05 <= d <= 0.95 for d in depths) and len(set(depths)) == 8
    for index in (0, 1, 2):
        s = tasks.make_sample("niah_single_noise", 4096, index, 200)
        at = s.context.index("One of the special magic numbers")
        assert at / len(s.context) == pytest.approx(tasks.depth_of(index), abs=0.02)


def test_variable_tracking_chain():
    s = tasks.make_sample("vt", 4096, 2, 80)
    names = list(s.answers)
    assert len(names) == tasks.VT_HOPS + 1 and len(set(names)) == len(names)
    value = re.search(r"the value (\d+)", s.question).group(1)
    first = s.context.index(f"VAR {names[0]} = {value}.")
    hops = [s.context.index(f"VAR {names[k]} = VAR {names[k - 1]}.") for k in range(1, len(names))]
    assert first < hops[0] and hops == sorted(hops)  # the chain appears in order


def test_common_words_are_the_most_common():
    s = tasks.make_sample("cwe", 4096, 1, 120)
    counts = collections.Counter(re.findall(r"\d+\. (\w+)", s.context))
    assert set(s.answers) == {w for w, _ in counts.most_common(tasks.CWE_COMMON)}
    assert min(counts[w] for w in s.answers) == tasks.cwe_common_repeats(4096) == 30
    assert max(c for w, c in counts.items() if w not in s.answers) == tasks.CWE_RARE_REPEATS
    assert tasks.cwe_common_repeats(2048) == 15


def test_frequent_words_follow_zipf_counts():
    s = tasks.make_sample("fwe", 4096, 0, 900)
    counts = collections.Counter(s.context.split("\n\n", 1)[1].split())
    top = [w for w, _ in counts.most_common(3)]
    assert top == list(s.answers)
    assert [counts[w] for w in top] == [900, 225, 100]  # floor(900 / r^2)


# ---- prompts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["passkey", "niah_multiquery", "fwe"])
def test_fit_takes_the_largest_haystack_that_fits(tokenizer, task):
    p = P.fit(tokenizer, task, 1024, 0)
    budget = 1024 - tasks.TASKS[task].max_new_tokens
    assert budget - 120 < p.num_tokens <= budget
    bigger = P.build(tokenizer, tasks.make_sample(task, 1024, 0, p.sample.size + 1))
    assert bigger.num_tokens > budget
    # Lengths are the model's own token counts: the ids are what the tokenizer makes of the parts.
    assert list(p.context_ids) == tokenizer.encode(P.template_parts(tokenizer, p.sample.context)[0],
                                                   add_special_tokens=False)


def test_prompt_parts_split_the_chat_template_at_the_question(tokenizer):
    p = P.fit(tokenizer, "niah_single_noise", 512, 0)
    text = tokenizer.decode(p.ids)
    whole = tokenizer.apply_chat_template([{"role": "user", "content": p.sample.context + "\n\n" + p.sample.question}],
                                          add_generation_prompt=True, tokenize=False) + p.sample.answer_prefix
    assert text == whole
    question = tokenizer.decode(p.question_ids)
    assert question.startswith("\n\n" + p.sample.question) and question.endswith(p.sample.answer_prefix)
    assert p.sample.question not in tokenizer.decode(p.context_ids)


def test_fit_refuses_a_length_too_short(tokenizer):
    with pytest.raises(ValueError, match="cwe: even the smallest haystack does not fit in 300 tokens"):
        P.fit(tokenizer, "cwe", 300, 0)


# ---- scoring --------------------------------------------------------------------------------------
def test_string_match_all():
    assert string_match_all(" 4817263.", ("4817263",)) == 1.0
    assert string_match_all(" 481726.", ("4817263",)) == 0.0
    assert string_match_all("ALPHA, beta", ("alpha", "Beta", "gamma", "delta")) == 0.5
    assert string_match_all("anything", ()) == 0.0
    assert mean_percent([1.0, 0.5, 0.0, 0.5]) == 50.0 and mean_percent([]) is None


def test_kept_tokens_is_kvpress_rule():
    from kvpress.utils import compute_n_kept

    for span in (100, 495, 4037, 4074):
        for ratio in M.RATIOS:
            assert M.kept_tokens(span, ratio) == compute_n_kept(span, ratio)


def test_method_placeholders():
    nacl = M.ALL_METHODS["nacl:proxy=question"]
    assert nacl.options_for(question_tokens=37, span=4000, budget=1000) == {"proxy": 37}
    tenth = M.ALL_METHODS["nacl:proxy=10%"]
    assert tenth.options_for(37, 4000, 1000) == {"proxy": 400}
    assert tenth.options_for(37, 4000, 500) == {"proxy": 248}  # (500 - 4) // 2
    assert set(M.PRESS_TWINS.values()) | {twin for _, twin in M.EXTRA_PAIRS} <= set(M.ALL_METHODS)
    for profile in M.PROFILES.values():
        assert set(profile) <= set(M.ALL_METHODS)


# ---- results file ---------------------------------------------------------------------------------
def record(**fields):
    base = dict(backend="engine", model="m", dtype="bfloat16", setting="aware", length=4096, task="passkey",
                index=0, method="snapkv", ratio=0.5, score=1.0, realised_ratio=0.5, error=None)
    return {**base, **fields}


def test_store_resumes_and_skips_done(tmp_path):
    path = tmp_path / "r.jsonl"
    store = Store(path)
    store.add([record(), record(index=1, score=0.0)])
    store.add([record()])  # already there: not written twice
    again = Store(path)
    assert len(again.records) == 2 and again.done(key_of(record())) and not again.done(key_of(record(index=2)))
    # A run killed while writing leaves a torn last line: it is cut off, and the run goes on after it.
    with path.open("a") as f:
        f.write('{"backend": "eng')
    assert len(report.read(path)) == 2  # a reader skips it
    resumed = Store(path)
    assert len(resumed.records) == 2
    resumed.add([record(index=2)])
    assert [r["index"] for r in Store(path).records] == [0, 1, 2]
    assert all(json.loads(line) for line in path.read_text().splitlines())
    # Anything else that is not a record is an error, not something to skip.
    path.write_text("not json\n" + path.read_text())
    with pytest.raises(ValueError, match="r.jsonl:1: not a JSON record"):
        Store(path)


def test_report_scores_average_tasks_equally_over_common_tasks():
    records = [record(task="passkey", index=0, score=1.0), record(task="passkey", index=1, score=0.0),
               record(task="vt", score=1.0), record(method="tova", task="passkey", score=1.0)]
    table = report.Table(records)
    snap, tova = ("engine", "aware", "snapkv", 0.5), ("engine", "aware", "tova", 0.5)
    assert table.score(snap, ["passkey", "vt"]) == pytest.approx(75.0)  # (50 + 100) / 2
    assert table.tasks([snap, tova]) == ["passkey"]  # only what both have
    assert table.score(snap, table.tasks([snap, tova])) == pytest.approx(50.0)
    errors = report.Table([record(error="refused", score=None)])
    assert errors.errors and not errors.scores


def test_a_sample_in_two_results_files_counts_once():
    """Two runs that share a (method, ratio, task, sample), e.g. a focused run and the full one: the sample
    is scored once, so it does not outweigh the others; different scores for it are listed."""
    rows = [record(task="passkey", index=i, score=s) for i, s in ((0, 1.0), (1, 0.0), (2, 0.0))]
    table = report.Table(rows + [record(task="passkey", index=0, score=1.0)])
    key = ("engine", "aware", "snapkv", 0.5)
    assert table.score(key, ["passkey"]) == pytest.approx(100 / 3) and not table.conflicts
    assert table.spread(key, ["passkey"])[1] == 3
    assert report.Table(rows + [record(task="passkey", index=0, seed=1, score=1.0)]).score(key, ["passkey"]) == 50.0
    changed = report.Table(rows + [record(task="passkey", index=1, score=1.0)])
    assert changed.score(key, ["passkey"]) == pytest.approx(200 / 3)  # the later record wins
    assert changed.conflicts == [(key, "passkey", (0, 1))]


def test_side_by_side_scores_every_row_over_the_same_tasks():
    """The full cache ran on more tasks than a method: its row is scored over the tasks the whole table shares."""
    rows = [record(backend=b, method="full", ratio=0.0, task=t, score=s) for b in ("kvpress", "engine")
            for t, s in (("passkey", 1.0), ("vt", 0.0))]
    rows += [record(backend="kvpress", method="snapkv", task="passkey"), record(method="snapkv", task="passkey")]
    text = report.side_by_side(report.Table(rows), "aware")
    assert text.startswith("Tasks: passkey.\n")
    assert "| full | full | 100.0 / 100.0 (+0.0) | 0.0 | yes |" in text  # not 50.0 over passkey and vt


def test_side_by_side_compares_the_samples_both_backends_ran():
    """The engine ran three samples of the full cache, kvpress one: the cell compares sample 0 with sample 0."""
    rows = [record(backend="kvpress", method="full", ratio=0.0, index=0, score=0.0)]
    rows += [record(method="full", ratio=0.0, index=i, score=s) for i, s in ((0, 0.0), (1, 1.0), (2, 1.0))]
    rows += [record(backend="kvpress", method="snapkv", score=0.0), record(method="snapkv", score=0.0)]
    text = report.side_by_side(report.Table(rows), "aware")
    assert "| full | full | 0.0 / 0.0 (+0.0) | 0.0 | yes | 1 |" in text  # not 0.0 / 66.7; one sample paired
    rows += [record(backend="kvpress", method="full", ratio=0.0, index=1, score=1.0)]
    rows += [record(backend=b, method="snapkv", index=1, score=1.0) for b in ("kvpress", "engine")]
    rows += [record(backend=b, method="snapkv", ratio=0.875, score=1.0) for b in ("kvpress", "engine")]
    text = report.side_by_side(report.Table(rows), "aware")
    assert "| full | full | 50.0 / 50.0 (+0.0) | 50.0 / 50.0 (+0.0) | 0.0 | yes | 2 |" in text
    assert "| snapkv | snapkv | 50.0 / 50.0 (+0.0) | 100.0 / 100.0 (+0.0) | 0.0 | yes | 1-2 |" in text


def test_side_by_side_and_claims_read_the_right_rows():
    rows = [record(backend="kvpress", method="snapkv", score=1.0), record(method="snapkv", score=0.0),
            record(backend="kvpress", method="full", ratio=0.0), record(method="full", ratio=0.0),
            record(method="caote+snapkv", score=1.0), record(method="criticalkv+snapkv", score=0.0)]
    table = report.Table(rows)
    text = report.side_by_side(table, "aware")
    assert "| snapkv | snapkv | 100.0 / 0.0 (-100.0) | 100.0 | no |" in text
    assert "| full | full | 100.0 / 100.0 (+0.0) | 0.0 | yes |" in text
    claims = report.claims(table)
    assert "aware: caote+snapkv >= snapkv: 0.5: 100.0 vs 0.0 holds" in claims
    # two zeros say nothing: never "holds"
    assert "aware: criticalkv+snapkv >= snapkv: 0.5: 0.0 vs 0.0 not measurable on this model (both sides 0)" in claims
    assert "best method at ratio 0.5 within 5 points of the full cache: caote+snapkv 100.0 vs 100.0 holds" in claims
    worse = report.claims(report.Table(rows + [record(method="fastcaote+snapkv", score=0.0),
                                               record(method="snapkv", task="vt", score=1.0),
                                               record(method="fastcaote+snapkv", task="vt", score=0.0)]))
    assert "aware: fastcaote+snapkv >= snapkv: 0.5: 0.0 vs 50.0 fails" in worse


def test_side_by_side_says_why_random_draws_differ_and_claims_check_the_ahakv_bar():
    rows = [record(backend="kvpress", method="random", score=1.0), record(method="random:oneshot", score=0.0),
            record(backend="kvpress", method="snapkv", ratio=0.875, score=1.0)]
    rows += [record(method="snapkv", ratio=0.875, task=t, score=1.0) for t in ("passkey", "vt")]
    rows += [record(method="ahakv", ratio=0.875, task="passkey", score=1.0),
             record(method="ahakv", ratio=0.875, task="vt", score=0.875)]
    table = report.Table(rows)
    assert ("| random | random:oneshot | 100.0 / 0.0 (-100.0) |  | 100.0 | no: another random draw (kvpress: "
            "torch.rand, seed 0; engine: a hash of seed, layer, head, position) |") in report.side_by_side(table, "aware")
    claims = report.claims(table)
    assert "aware: ahakv >= snapkv at the smallest budget (ratio 0.875): 93.8 vs 100.0 fails" in claims
    assert "aware: ahakv >= snapkv - 5 points at ratio 0.875 (this project's bar): 93.8 vs 100.0 - 5 = 95.0 fails" in claims
    close = report.claims(report.Table(rows[:-1] + [record(method="ahakv", ratio=0.875, task="vt", score=0.95)]))
    assert "(this project's bar): 97.5 vs 100.0 - 5 = 95.0 holds" in close
    # a claim compares the samples both sides ran: SnapKV's extra sample 1 (score 0) stays out
    extra = report.claims(report.Table(rows + [record(method="snapkv", ratio=0.875, task=t, index=1, score=0.0)
                                               for t in ("passkey", "vt")]))
    assert "(this project's bar): 93.8 vs 100.0 - 5 = 95.0 fails" in extra


def test_method_table_gives_each_score_its_spread_over_samples():
    """Per cell: the mean over tasks, then its standard deviation over the sample indices every task has."""
    rows = [record(task=t, index=i, score=s) for t, scores in (("passkey", (1.0, 0.0, 1.0)), ("vt", (1.0, 1.0, 0.0)))
            for i, s in enumerate(scores)]
    rows += [record(method="full", ratio=0.0, task=t, index=i) for t in ("passkey", "vt") for i in range(3)]
    text, tasks = report.method_table(report.Table(rows), "engine", "aware")
    assert tasks == ["passkey", "vt"]
    # per sample: (100 + 100) / 2, (0 + 100) / 2, (100 + 0) / 2 = 100, 50, 50: mean 66.7, sd 28.9
    assert "| snapkv | 66.7 ±28.9 (3) | 66.7 |" in text
    assert "| full cache | 100.0 ±0.0 (3) | 100.0 |" in text
    one = report.Table([record(task="passkey")])
    assert one.spread(("engine", "aware", "snapkv", 0.5), ["passkey"]) is None


def test_method_table_scores_every_row_over_the_samples_all_rows_have():
    """The full cache ran three samples, SnapKV one: the table compares sample 0 with sample 0 and says so."""
    rows = [record(method="full", ratio=0.0, index=i, score=s) for i, s in ((0, 0.0), (1, 1.0), (2, 1.0))]
    rows += [record(index=0, score=0.0), record(method="snapkv", ratio=0.875, index=0, score=0.0)]
    table = report.Table(rows)
    text, tasks = report.method_table(table, "engine", "aware")
    assert "| full cache | 0.0 | 0.0 | 0.0 |" in text  # not 66.7 ±57.7 (3)
    assert report.samples_line(table, "engine", "aware", tasks) == "1 sample per task, the ones every row has"
    three = report.Table(rows + [record(index=i, score=1.0) for i in (1, 2)]
                         + [record(method="snapkv", ratio=0.875, index=i, score=1.0) for i in (1, 2)])
    text, _ = report.method_table(three, "engine", "aware")
    assert "| full cache | 66.7 ±57.7 (3) | 66.7 ±57.7 (3) | 66.7 |" in text
    assert report.samples_line(three, "engine", "aware", tasks) == "3 samples per task, the ones every row has"
    assert three.score(("engine", "aware", "full", 0.0), tasks) == pytest.approx(200 / 3)  # the table itself unchanged
    # no sample in common: no score, rather than one over different samples
    snap, tova = ("engine", "aware", "snapkv", 0.5), ("engine", "aware", "tova", 0.5)
    disjoint = report.Table([record(index=0), record(method="tova", index=1)])
    assert disjoint.paired(snap, tova, ["passkey"]) is None
    assert disjoint.common([snap, tova], ["passkey"]).score(snap, ["passkey"]) is None


def test_readings_table_means_each_ratio_over_the_tasks_every_reading_has():
    rows = [record(method="ahakv", task="passkey", ratio=0.875, score=1.0),
            record(method="ahakv", task="vt", ratio=0.875, score=0.0),
            record(method="snapkv", task="passkey", ratio=0.875, score=0.0),
            record(method="snapkv", task="passkey", ratio=0.9375, score=1.0),
            record(method="ahakv", task="passkey", ratio=0.9375, score=1.0)]
    text = report.readings_table(report.Table(rows), "aware", ("snapkv", "ahakv"))
    lines = text.splitlines()
    assert lines[0] == "| reading | mean 0.875 | mean 0.9375 | passkey 0.875 | passkey 0.9375 |"
    assert lines[2] == "| snapkv | 0.0 | 100.0 | 0 | 100 |"
    assert lines[3] == "| ahakv | 100.0 | 100.0 | 100 | 100 |"  # vt: snapkv has none, so no mean counts it


def test_draws_table_places_kvpress_among_the_engine_draws():
    """Random's press against the engine's draws (request seeds 0-3) on the tasks and samples all of them ran."""
    rows = [record(backend="kvpress", method="random", score=0.5, task=t) for t in ("passkey", "vt")]
    draws = {"random:oneshot": (1.0, 1.0), "random:oneshot:seed=1": (0.0, 1.0), "random:oneshot:seed=2": (0.0, 0.0)}
    rows += [record(method=m, task=t, score=v) for m, scores in draws.items() for t, v in zip(("passkey", "vt"), scores)]
    text = report.draws_table(report.Table(rows), "aware")
    assert text.splitlines()[2] == "| 0.5 | 3 | 0.0 - 100.0 (100.0) | 50.0 | yes |"
    two = [r for r in rows if r["method"] != "random:oneshot:seed=2"]
    assert report.draws_table(report.Table(two), "aware").splitlines()[2] == "| 0.5 | 2 | 50.0 - 100.0 (50.0) | 50.0 | yes |"
    out = report.Table([{**r, "score": 1.0} if r["backend"] == "kvpress" else r for r in rows
                        if r["method"] != "random:oneshot"])
    assert report.draws_table(out, "aware").splitlines()[2] == "| 0.5 | 2 | 0.0 - 50.0 (50.0) | 100.0 | no |"
    # a draw that ran passkey only: every draw is scored over passkey (seed 1 then 0, not 50)
    short = report.Table(two + [record(method="random:oneshot:seed=3", task="passkey", score=1.0)])
    assert report.draws_table(short, "aware").splitlines()[2] == "| 0.5 | 3 | 0.0 - 100.0 (100.0) | 50.0 | yes |"
    assert report.draws_table(report.Table(rows[:4]), "aware") is None  # one engine draw: nothing to compare


def test_random_layers_table_compares_one_draw_for_every_layer_with_one_per_layer():
    """Per ratio, each group's mean and range over seeds 0-3, on the tasks every draw ran."""
    same = {"random": 0.0, "random:seed=1": 0.5, "random:seed=2": 0.0, "random:seed=3": 0.5}
    per_layer = {"random:layers": 1.0, "random:layers:seed=1": 0.5, "random:layers:seed=2": 1.0,
                 "random:layers:seed=3": 0.5}
    engine = {"random:oneshot": 1.0, "random:oneshot:seed=1": 1.0, "random:oneshot:seed=2": 0.5,
              "random:oneshot:seed=3": 0.5}
    rows = [record(backend="kvpress", method=m, score=v) for m, v in {**same, **per_layer}.items()]
    rows += [record(method=m, score=v) for m, v in engine.items()]
    rows.append(record(backend="kvpress", method="random", task="vt", score=1.0))  # a task the others lack
    lines = report.random_layers_table(report.Table(rows), "aware").splitlines()
    assert lines[2] == "| 0.5 | 25.0 (0.0 - 50.0) | 75.0 (50.0 - 100.0) | 75.0 (50.0 - 100.0) | +50.0 | 1 |"
    assert report.random_layers_table(report.Table(rows[1:]), "aware") is None  # a draw missing: no table


def test_report_names_only_the_files_it_read_records_from(tmp_path):
    """A bfloat16 report from a folder that also holds float32 files names only the files it used."""
    (tmp_path / "bf16.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        record(method="full", ratio=0.0, model="m"), record(model="m"))))
    (tmp_path / "f32.jsonl").write_text(json.dumps(record(dtype="float32", model="m")) + "\n")
    md = report.write(sorted(tmp_path.glob("*.jsonl")), model="m", dtype="bfloat16", length=4096, out=tmp_path / "out")
    assert "from `bf16.jsonl`. Scores" in md.read_text()


def test_per_layer_random_press_draws_afresh_in_every_layer():
    """random:layers is kvpress's RandomPress with the seed made per layer: layer 0 of seed 0 is kvpress's
    own draw, every other layer (and seed) another one, each repeatable."""
    import torch
    from kvpress import RandomPress

    from benchmarks.quality.layer_random import PerLayerRandomPress, layer_seed

    class Layer:
        def __init__(self, index: int) -> None:
            self.layer_idx = index

    keys = torch.zeros(1, 2, 64, 8)

    def scores(press: Any, layer: int) -> torch.Tensor:
        return press.score(Layer(layer), None, keys, keys, None, {})

    ours, theirs = PerLayerRandomPress(seed=0), RandomPress(seed=0)
    assert torch.equal(scores(ours, 0), scores(theirs, 0))
    assert torch.equal(scores(theirs, 0), scores(theirs, 5))  # kvpress: the same draw in every layer
    draws = [scores(ours, layer) for layer in range(4)] + [scores(PerLayerRandomPress(seed=1), 0)]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1:])
    assert torch.equal(scores(ours, 3), draws[3])
    assert len({layer_seed(s, layer) for s in range(3) for layer in range(100)}) == 300
    presses = M.presses()
    assert presses["random:layers"].twin == "random:oneshot"
    assert presses["random:layers:seed=2"].make().seed == presses["random:seed=2"].make().seed == 2
    assert isinstance(presses["random:layers:seed=2"].make(), PerLayerRandomPress)
    assert type(presses["random:seed=2"].make()) is RandomPress


def test_a_method_not_yet_run_on_every_task_gets_a_table_of_its_own():
    """A run in progress: H2O has reached passkey only. SnapKV's table stays over both tasks the full cache
    ran; H2O is scored beside the full cache on passkey."""
    rows = [record(method="full", ratio=0.0, task=t) for t in ("passkey", "vt")]
    rows += [record(task="passkey", score=1.0), record(task="vt", score=0.0)]
    rows += [record(method="h2o", task="passkey", score=0.0)]
    table = report.Table(rows)
    assert report.split_methods(table, "engine", "aware") == (["full", "snapkv"], ["h2o"])
    text, tasks = report.method_table(table, "engine", "aware", ["full", "snapkv"])
    assert tasks == ["passkey", "vt"] and "| snapkv | 50.0 | 50.0 |" in text and "h2o" not in text
    text, tasks = report.method_table(table, "engine", "aware", ["full", "h2o"])
    assert tasks == ["passkey"] and "| h2o | 0.0 | 0.0 |" in text and "| full cache | 100.0 | 100.0 |" in text
    everything = report.Table(rows + [record(method="h2o", task="vt", score=0.0)])
    assert report.split_methods(everything, "engine", "aware") == (["full", "snapkv", "h2o"], [])


def test_an_extra_draw_with_fewer_samples_does_not_narrow_the_main_table():
    """The defaults have samples 0 and 1, a further random draw (outside the profile) sample 0 only: the
    main table keeps both samples (with their spread) and the draw is scored in the second table; a
    method of the profile that lacks a sample still narrows the main table (every row, the same samples)."""
    draw = M.random_twin(1)
    assert draw not in M.PROFILES["defaults"]
    rows = [record(method="full", ratio=0.0, index=i) for i in (0, 1)]
    rows += [record(index=0, score=1.0), record(index=1, score=0.0)]
    rows += [record(method=draw, index=0, score=1.0)]
    table = report.Table(rows)
    assert report.split_methods(table, "engine", "aware") == (["full", "snapkv"], [draw])
    text, _ = report.method_table(table, "engine", "aware", ["full", "snapkv"])
    assert "| snapkv | 50.0 ±70.7 (2) |" in text
    # the best-method claim reads the main table too, not the draw's one sample
    assert ("aware: best method at ratio 0.5 within 5 points of the full cache: snapkv 50.0 vs 100.0 fails"
            in report.claims(table))
    with_h2o = report.Table(rows + [record(method="h2o", index=0, score=0.0)])
    assert report.split_methods(with_h2o, "engine", "aware") == (["full", "snapkv", "h2o", draw], [])
    text, _ = report.method_table(with_h2o, "engine", "aware", ["full", "snapkv", "h2o", draw])
    assert "| snapkv | 100.0 |" in text
