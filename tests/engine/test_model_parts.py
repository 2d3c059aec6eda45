"""A method that needs a model part the model lacks: criticalkv needs every attention layer's output projection
(``o_proj``), which GPT-2 does not have (its projection is ``c_proj``). The front end has no model, so the
server decides at start-up: a method it reserves (its own, or one in ``request_policies``) has its weights
loaded then, and a model without them refuses to start; a request for a method the server did not reserve
is refused with a 400. A real tiny GPT-2 (random weights), offline, in process."""

from __future__ import annotations

import re
from typing import Iterator

import pytest
from vllm.exceptions import VLLMValidationError

from tests.engine.helpers import Engine, greedy, make_llm, token_prompt
from vllm_evict.testing import build_tiny_gpt2

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2")))


@pytest.fixture(scope="module")
def gpt2_engine(tiny_gpt2: str) -> Iterator[Engine]:
    built = Engine(make_llm(tiny_gpt2, {"policy": "caote+snapkv", "budget": 64, "request_policies": ["h2o"]}))
    yield built
    built.llm.llm_engine.engine_core.shutdown()


def test_the_model_really_has_no_o_proj(gpt2_engine: Engine) -> None:
    model = gpt2_engine.runner.get_model()
    attention = [name for name, _ in model.named_modules() if name.endswith(".attn.attn")]
    assert attention and not [name for name, _ in model.named_modules() if name.endswith("o_proj")]


@pytest.mark.parametrize("spec", ["criticalkv+snapkv", "criticalkv+h2o"])
def test_criticalkv_per_request_is_refused_with_a_400_and_the_engine_goes_on(gpt2_engine: Engine, spec: str) -> None:
    prompt = token_prompt(150)
    expected = gpt2_engine.llm.generate([prompt], greedy(4))[0].outputs[0].token_ids
    escaped = re.escape(spec)
    with pytest.raises(VLLMValidationError, match=rf"{escaped} needs each attention layer's output projection "
                                                  r"\(o_proj\), which this server did not load at start-up; "
                                                  rf"add '{escaped}' to the server's request_policies"):
        gpt2_engine.llm.generate([prompt], greedy(4, kv_eviction=spec))
    # the server's own method and the methods it reserved run as before
    assert gpt2_engine.llm.generate([prompt], greedy(4))[0].outputs[0].token_ids == expected
    assert len(gpt2_engine.llm.generate([prompt], greedy(4, kv_eviction="h2o"))[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("eviction,fragment", [
    ({"policy": "snapkv", "budget": 64, "request_policies": ["criticalkv+snapkv"]},
     "the server reserves it for snapkv, criticalkv+snapkv"),
    ({"policy": "criticalkv+snapkv", "budget": 64}, "choose a policy without criticalkv"),
])
def test_a_server_reserving_criticalkv_on_a_model_without_o_proj_refuses_to_start(tiny_gpt2: str, eviction: dict,
                                                                                  fragment: str) -> None:
    with pytest.raises(Exception) as info:
        make_llm(tiny_gpt2, eviction)
    text = f"{info.value} {info.value.__cause__ or ''}"
    assert "needs the output projection" in text and "has no transformer.h.0.attn.o_proj" in text, text
    assert fragment in text, text
