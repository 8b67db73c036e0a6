"""Request fields that vLLM's or OpenAI's server accepts and this one does not implement.

A client written for vLLM (a load tool, a framework) sends some of these on every request, most
often with a value that asks for nothing (`use_beam_search: false`, `length_penalty: 1`). Such a
value is accepted and the field dropped; any other value is refused with a 400 that names the
feature, never a generic schema error. A field in neither list, nor in the request model, is a
typo and stays refused as an unknown field.

Each entry: field name -> (the values that ask for nothing, what the feature is). The names are
those of vLLM's CompletionRequest / ChatCompletionRequest and OpenAI's API reference.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

_ANY = object()  # every value asks for nothing (an id or a hint this server has no use for)

_COMMON: dict[str, tuple[tuple, str]] = {
    "logprob_token_ids": ((None, []), "logprobs of chosen token ids"),
    "use_beam_search": ((False, None), "beam search"),
    "length_penalty": ((1.0, None), "beam-search length penalty"),
    "spaces_between_special_tokens": ((True, None), "spaces_between_special_tokens=false"),
    "repetition_detection": ((None,), "repetition detection"),
    "thinking_token_budget": ((None, -1), "a thinking-token budget"),
    "watermarking": ((None, False), "watermarking"),
    "stream_interval": ((None, 1), "stream_interval"),
    "kv_transfer_params": ((None,), "kv_transfer_params (KV transfer is the cluster's own)"),
    "ec_transfer_params": ((None,), "encoder-cache transfer"),
    "vllm_xargs": ((None, {}), "vllm_xargs"),
    "return_token_offsets": ((None, False), "return_token_offsets"),
    "return_mm_kwargs": ((None, False), "multimodal inputs"),
    "routed_experts_prompt_start": ((None,), "mixture-of-experts routing data"),
    "request_id": (_ANY, ""),
    "session_id": (_ANY, ""),
    "metadata": (_ANY, ""),
    "store": ((None, False), "stored completions"),
    "service_tier": (_ANY, ""),
    "prompt_cache_key": (_ANY, ""),
    "safety_identifier": (_ANY, ""),
}

COMPLETION_FIELDS: dict[str, tuple[tuple, str]] = {
    **_COMMON,
    "suffix": ((None, ""), "suffix (insertion)"),
    "prompt_embeds": ((None,), "prompt embeddings"),
}

CHAT_FIELDS: dict[str, tuple[tuple, str]] = {
    **_COMMON,
    "chat_template": ((None,), "a per-request chat template"),
    "media_io_kwargs": ((None, {}), "multimodal inputs"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs"),
    "return_prompt_text": ((None, False), "return_prompt_text"),
    "functions": ((None, []), "function calling"),
    "function_call": ((None, "none", "auto"), "function calling"),
    "modalities": ((None, ["text"]), "output modalities other than text"),
    "audio": ((None,), "audio output"),
    "prediction": ((None,), "predicted outputs"),
    "web_search_options": ((None,), "web search"),
}

#: Fields of a /v1/responses request (router.responses) and of its function tools.
RESPONSES_FIELDS: dict[str, tuple[tuple, str]] = {
    "top_logprobs": ((None, 0), "output logprobs"),
    "max_tool_calls": ((None,), "a cap on tool calls"),
    "prompt": ((None,), "stored prompt templates"),
    "conversation": ((None,), "stored conversations"),
    "stream_options": (_ANY, ""),
    "prompt_cache_retention": (_ANY, ""),
    "service_tier": (_ANY, ""),
    "prompt_cache_key": (_ANY, ""),
    "safety_identifier": (_ANY, ""),
    "include": (_ANY, ""),
    "store": (_ANY, ""),  # nothing is stored either way
    "background": ((None, False), "background responses"),
}
RESPONSES_TOOL_FIELDS: dict[str, tuple[tuple, str]] = {
    "defer_loading": ((None, False), "deferred tool loading"),
    "output_schema": (_ANY, ""),
    "allowed_callers": (_ANY, ""),
}

#: Keys of a chat message this server does not use, and the values that ask for nothing.
MESSAGE_FIELDS: dict[str, tuple[tuple, str]] = {
    "function_call": ((None,), "function calls in messages"),
    "reasoning_content": (_ANY, ""),  # vLLM reads `reasoning` only
    "refusal": ((None,), "refusal messages"),
    "audio": ((None,), "audio in messages"),
    "tools": ((None, []), "tool calling"),
    "task": ((None,), "message tasks"),
}

#: Content-part types read as text; any other known type is a modality this server lacks.
TEXT_PART_TYPES = ("text", "input_text", "output_text")


def drop_neutral(data: Any, table: dict[str, tuple[tuple, str]], where: str) -> Any:
    """`data` (a request or message dict before validation) without the fields of `table`
    whose value asks for nothing.

    Raises PydanticCustomError("unsupported_feature") naming the first field whose value asks
    for a feature this server lacks; its ctx `field` is the field's name.
    """
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, (neutral, feature) in table.items():
        if name not in out:
            continue
        value = out.pop(name)
        if neutral is _ANY or any(_same(value, n) for n in neutral):
            continue
        raise PydanticCustomError(
            "unsupported_feature",
            "{where}`{field}` asks for {feature}, which this server does not support; "
            "omit it or send its default",
            {"field": name, "feature": feature, "where": where})
    return out


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):  # bool is an int in Python
        return value is neutral
    if isinstance(neutral, float) and isinstance(value, int):
        return float(value) == neutral
    return type(value) is type(neutral) and value == neutral
