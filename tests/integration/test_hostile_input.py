"""Input a client should not be able to crash us with gets a 400 that says what is wrong, and
a bug gets OpenAI's 500 body with a request id in the log, never plain text."""

from __future__ import annotations

import logging

import httpx
import pytest

from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.gateway import build_app
from tests.background_server import BackgroundServer

pytestmark = pytest.mark.slow

MODEL = "stories260K"


@pytest.fixture(scope="module")
def http(api_base):
    with httpx.Client(base_url=api_base, timeout=60) as client:
        yield client


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("prompt,says", [
    ("", "prompt is empty"),
    ([], "prompt is an empty list"),
    ([[]], "prompt[0] is an empty token list"),
    ([[5], []], "prompt[1] is an empty token list"),
    (["a", ""], "prompt[1] is empty"),
    ([1, -1], "prompt[1] is -1"),
    ([1, "a"], "prompt[1] is 'a'"),
    (["a", 1], "prompt[1] is integer"),
    ({"text": "a"}, "prompt must be a string, a list of strings"),
    ([True], "prompt[0] is boolean"),
])
def test_empty_and_malformed_prompts_say_what_is_wrong(http, prompt, says):
    error = error_of(http.post("/completions", json={"model": MODEL, "prompt": prompt}))
    assert says in error["message"] and error["param"] == "prompt", error
    assert "prompt.str" not in error["message"]


@pytest.mark.parametrize("endpoint,field,value,says", [
    ("/completions", "stop", 123, "stop: expected a string or a list of strings (got integer)"),
    ("/completions", "stop", ["."] * 17, "stop: at most 16 items are accepted (got 17)"),
    ("/chat/completions", "stop", ["."] * 17, "stop: at most 16 items are accepted (got 17)"),
    ("/completions", "stop", [".", 1], "stop.1: Input should be a valid string"),
    ("/completions", "temperature", "hot", "temperature: Input should be a valid number"),
    ("/completions", "n", "two", "n: Input should be a valid integer"),
    ("/chat/completions", "messages", [{"role": "user", "content": 5}],
     "messages.0.content: expected a string or a list of content parts (got integer)"),
])
def test_type_errors_name_the_field_and_the_expected_type(http, endpoint, field, value, says):
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"prompt": "Hi"} if endpoint == "/completions" else \
        {"messages": [{"role": "user", "content": "Hi"}]}
    error = error_of(http.post(endpoint, json={**base, field: value}))
    assert error["message"].startswith(says), error


@pytest.mark.parametrize("endpoint,body", [
    ("/completions", '{"model": "stories260K", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/completions", '{"model": "stories260K", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/chat/completions", '{"model": "stories260K", "max_tokens": 2, '
                          '"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
])
def test_a_lone_surrogate_is_a_400(http, endpoint, body):
    # JSON's \\uD800 escape is valid JSON and decodes to a str no tokenizer can take
    response = http.post(endpoint, content=body, headers={"content-type": "application/json"})
    error = error_of(response)
    assert "surrogate" in error["message"], error
    assert http.post("/completions", json={"model": MODEL, "prompt": "Hi",
                                           "max_tokens": 2}).status_code == 200


class ExplodingTokenizer(Tokenizer):
    """Injects a bug the real tokenizer cannot be made to have on demand."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("a bug in the tokenizer")


@pytest.mark.server
def test_an_unexpected_exception_is_a_500_with_the_openai_body(cluster, caplog):
    model_dir = cluster.config.engine.model
    real = Tokenizer.from_pretrained(model_dir)
    broken = ExplodingTokenizer(real._tok, real.bos_token_id, real.eos_token_id, True)
    app = build_app(cluster.pipeline, broken, MODEL, 256, ChatTemplate.from_model_dir(model_dir))
    with caplog.at_level(logging.ERROR, logger="pdcluster.router.gateway"), BackgroundServer(app) as srv:
        response = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        error = error_of(response, 500)
        assert error["type"] == "internal_error" and "request cmpl-" in error["message"]
        assert "a bug in the tokenizer" not in error["message"]  # no internals to the client
        request_id = error["message"].split("request ")[1].split(")")[0]
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None
