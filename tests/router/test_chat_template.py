"""Chat templates render as transformers' apply_chat_template does, with the request's
template options (add_generation_prompt, continue_final_message, documents and
chat_template_kwargs, vLLM's fields)."""

from __future__ import annotations

import json

import pytest

from pdcluster.router.chat import template_message
from pdcluster.router.chat_template import ChatTemplate, ChatTemplateError
from pdcluster.router.schemas import ChatCompletionRequest

#: A Qwen3-like template: a thinking switch, documents and a generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% if documents %}Docs: {% for d in documents %}[{{ d.title }}] {{ d.text }} "
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")

MESSAGES = [{"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def reference(hf):
    return hf.tokenizer


@pytest.mark.parametrize("options", [
    dict(add_generation_prompt=True),
    dict(add_generation_prompt=False),
    dict(add_generation_prompt=False, continue_final_message=True),
    dict(add_generation_prompt=True, documents=[{"title": "A", "text": "cats"}]),
    dict(add_generation_prompt=True, extra={"enable_thinking": False}),
])
def test_renders_as_transformers(reference, options):
    ours = ChatTemplate(TEMPLATE, reference.bos_token, reference.eos_token)
    options = dict(options)  # the parametrized dict is shared across reruns
    extra = options.pop("extra", {})
    want = reference.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False,
                                         **options, **extra)
    assert ours.render(MESSAGES, options.get("add_generation_prompt", True), None,
                       options.get("continue_final_message", False),
                       options.get("documents"), extra) == want


def test_kwargs_cannot_replace_what_the_server_sets():
    with pytest.raises(ChatTemplateError, match="messages"):
        ChatTemplate(TEMPLATE, "<s>", "</s>").render(MESSAGES, extra={"messages": []})
    with pytest.raises(ChatTemplateError, match="raise_exception"):
        ChatTemplate(TEMPLATE, "<s>", "</s>").render(MESSAGES, extra={"raise_exception": "x"})


def test_a_kwarg_the_template_cannot_use_is_a_template_error():
    """A client's value that breaks the template's own code (here: iterating a number) is the
    request's error, not the server's."""
    template = ChatTemplate("{% for t in custom_tools %}{{ t }}{% endfor %}", "<s>", "</s>")
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES, extra={"custom_tools": 5})


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it():
    body = ChatCompletionRequest(model="m", messages=MESSAGES[:1], reasoning_effort="none")
    assert body.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}
    body = ChatCompletionRequest(model="m", messages=MESSAGES[:1], reasoning_effort="high",
                                 chat_template_kwargs={"enable_thinking": False})
    assert body.template_kwargs() == {"reasoning_effort": "high", "enable_thinking": False}


def test_an_assistant_turns_reasoning_reaches_a_template_that_renders_it(reference):
    """vLLM passes an assistant message's `reasoning` as `reasoning` and
    `reasoning_content` (Qwen3's template re-renders recent thinking); transformers renders
    what it is given."""
    thinking = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>"
                "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")
    body = ChatCompletionRequest(model="m", messages=[
        *MESSAGES[:1], {"role": "assistant", "content": "Once", "reasoning": "Be brief."}])
    ours = ChatTemplate(thinking, reference.bos_token, reference.eos_token)
    rendered = ours.render([template_message(m) for m in body.messages], False)
    want = reference.apply_chat_template(
        [MESSAGES[0], {"role": "assistant", "content": "Once",
                       "reasoning_content": "Be brief."}],
        chat_template=thinking, tokenize=False)
    assert rendered == want and "<think>Be brief.</think>Once" in rendered


def test_a_multimodal_checkpoints_chat_template_json_is_found(tmp_path):
    """Gemma 3's multimodal checkpoints keep the template in the processor's
    chat_template.json; tokenizer_config.json's, where there is one, comes first."""
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    found = ChatTemplate.from_model_dir(tmp_path)
    assert found.render(MESSAGES) == ChatTemplate(TEMPLATE, "", "").render(MESSAGES)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'x' }}"}))
    assert ChatTemplate.from_model_dir(tmp_path).render(MESSAGES) == "x"
