"""Chat templates: the model's own (Hugging Face `chat_template`), or a documented plain one.

Lookup order (as transformers does): `chat_template.jinja` in the model directory, then
`tokenizer_config.json`'s `chat_template` (a string, or a list of {name, template} where the
one named "default" is used), then `chat_template.json`'s, where a multimodal checkpoint's
processor keeps it (Gemma 3). Rendered in jinja2's sandbox, with `messages`, `bos_token`,
`eos_token`, `tools`, `documents`, `add_generation_prompt` (True unless the request says) and
the request's `chat_template_kwargs`; the result is tokenized without adding special tokens
again (transformers' apply_chat_template(tokenize=True) does the same).

PLAIN_CHAT_TEMPLATE, for models without one (the bundled stories260K), renders

    <s>{system content}\\n\\n        (each system/developer message, if any)
    User: {content}\\n               (each user message; other roles likewise, capitalized)
    Assistant: {content}\\n
    Assistant:                     (the generation prompt)

with the tools' names, when a request has tools, as a `Tools: a, b` line first (a small
model's context has no room for their schemas), and an assistant's calls as
`<tool_call>{"name", "arguments"}</tool_call>` after its content.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}Tools: {{ tools | map(attribute='function.name') | join(', ') }}"
    "{{ '\\n\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role in ['system', 'developer'] %}{{ m.content }}\n\n"
    "{% else %}{{ m.role | capitalize }}: {{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


#: what the server itself sets in a template's context
RESERVED_VARIABLES = ("messages", "bos_token", "eos_token", "tools", "documents",
                      "add_generation_prompt", "raise_exception")


class ChatTemplateError(ValueError):
    """The template failed to render these messages (e.g. it raised on a role order)."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson  # transformers': no HTML escaping, as templates expect
        self._template = env.from_string(source)
        self._bos, self._eos = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ChatTemplate":
        path = Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = None
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):
            named = {t.get("name"): t.get("template") for t in config["chat_template"]}
            source = named.get("default")
        elif (path / "chat_template.json").is_file():
            source = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        return cls(source or PLAIN_CHAT_TEMPLATE, _token(config, "bos_token"),
                   _token(config, "eos_token"))

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, continue_final_message: bool = False,
               documents: list[dict] | None = None, extra: dict | None = None) -> str:
        """messages: [{"role", "content"}] with text content (an assistant's may hold
        `tool_calls`, a tool's `tool_call_id`); tools: OpenAI function tools, as transformers
        passes them; documents: for retrieval templates; extra: more template variables
        (vLLM's chat_template_kwargs), never one of those above.
        continue_final_message: the text ends with the last message's content, which the
        model continues (transformers' apply_chat_template cuts the render there).
        Raises ChatTemplateError."""
        reserved = set(extra or ()) & set(RESERVED_VARIABLES)
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(reserved)}")
        try:
            text = self._template.render(**(extra or {}), messages=messages,
                                         bos_token=self._bos, eos_token=self._eos,
                                         tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 — client values reach the template's code
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if not continue_final_message:
            return text
        final = messages[-1]["content"] or ""
        for piece in (final, final.strip()):
            end = text.rfind(piece)
            if piece and end >= 0:
                return text[:end + len(piece)]
        raise ChatTemplateError("continue_final_message: the last message's content is not in "
                                "the rendered chat")


def _token(config: dict, name: str) -> str:
    value = config.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else value


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
