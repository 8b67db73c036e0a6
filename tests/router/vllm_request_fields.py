"""Field names that vLLM's OpenAI-compatible server accepts on its request models.

These are facts (names only) taken from vLLM's source. No code or prose was copied.
Read on 2026-11-24 from the stored index of github.com/vllm-project/vllm:

- CompletionRequest: vllm/entrypoints/openai/completion/protocol.py
  at commit 002032ee2b18e1f7bd924ec47b62504ba3866063
- ChatCompletionRequest: vllm/entrypoints/openai/chat_completion/protocol.py
  at commit 002032ee2b18e1f7bd924ec47b62504ba3866063
- StreamOptions: vllm/entrypoints/generate/base/protocol.py
  at commit 022e555dbb75a9a96363a04933bfdd1f0b5b123d (this version of the file
  is the one the index had). Older versions had it in
  vllm/entrypoints/openai/engine/protocol.py, with the same two fields.
- Chat message keys and content-part types: vllm/entrypoints/chat_utils.py
  at commit 001eadcf295d90aa0664963cd6a9d93f38a2f3da. That file gives
  CustomChatCompletionMessageParam, ConversationMessage and MM_PARSER_MAP; the
  union also uses the openai package's ChatCompletionMessageParam TypedDicts.

Both request models inherit from OpenAIBaseModel, which declares no fields of its own
(only a ClassVar cache). It uses pydantic extra="allow", so vLLM accepts an unknown
top-level key, logs it as ignored and otherwise leaves it unused. The sets below
list only the declared fields. None of the request fields have aliases.

The index holds several vLLM versions. The commit above is the newest that matches
the upstream layout (vllm/entrypoints/...). A parallel restructured copy under
vllm/frontend/entrypoints/openai/ (commit 055e47c28003156421365af985d676fc921cb075)
differs slightly. It lacks `watermarking` and `return_mm_kwargs`, and its chat
request adds `return_assistant_tokens_mask`. Earlier versions, such as the
pre-split vllm/entrypoints/openai/protocol.py, also had `logits_processors`, and
some had `guided_*` fields. The version read here has neither.
"""

from __future__ import annotations

VLLM_COMPLETION_FIELDS: frozenset[str] = frozenset(
    {
        "add_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "cache_salt",
        "ec_transfer_params",
        "echo",
        "frequency_penalty",
        "ignore_eos",
        "include_stop_str_in_output",
        "kv_transfer_params",
        "length_penalty",
        "logit_bias",
        "logprob_token_ids",
        "logprobs",
        "max_tokens",
        "min_p",
        "min_tokens",
        "model",
        "n",
        "presence_penalty",
        "priority",
        "prompt",
        "prompt_embeds",
        "prompt_logprobs",
        "repetition_detection",
        "repetition_penalty",
        "request_id",
        "response_format",
        "return_mm_kwargs",
        "return_token_ids",
        "return_token_offsets",
        "return_tokens_as_token_ids",
        "routed_experts_prompt_start",
        "seed",
        "session_id",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_interval",
        "stream_options",
        "structured_outputs",
        "suffix",
        "temperature",
        "thinking_token_budget",
        "top_k",
        "top_p",
        "truncate_prompt_tokens",
        "truncation_side",
        "use_beam_search",
        "user",
        "vllm_xargs",
        "watermarking",
    }
)

VLLM_CHAT_COMPLETION_FIELDS: frozenset[str] = frozenset(
    {
        "add_generation_prompt",
        "add_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "cache_salt",
        "chat_template",
        "chat_template_kwargs",
        "continue_final_message",
        "documents",
        "ec_transfer_params",
        "echo",
        "frequency_penalty",
        "ignore_eos",
        "include_reasoning",
        "include_stop_str_in_output",
        "kv_transfer_params",
        "length_penalty",
        "logit_bias",
        "logprob_token_ids",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "media_io_kwargs",
        "messages",
        "min_p",
        "min_tokens",
        "mm_processor_kwargs",
        "model",
        "n",
        "parallel_tool_calls",
        "presence_penalty",
        "priority",
        "prompt_logprobs",
        "reasoning_effort",
        "repetition_detection",
        "repetition_penalty",
        "request_id",
        "response_format",
        "return_mm_kwargs",
        "return_prompt_text",
        "return_token_ids",
        "return_token_offsets",
        "return_tokens_as_token_ids",
        "routed_experts_prompt_start",
        "seed",
        "session_id",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_interval",
        "stream_options",
        "structured_outputs",
        "temperature",
        "thinking_token_budget",
        "tool_choice",
        "tools",
        "top_k",
        "top_logprobs",
        "top_p",
        "truncate_prompt_tokens",
        "truncation_side",
        "use_beam_search",
        "user",
        "vllm_xargs",
        "watermarking",
    }
)

VLLM_STREAM_OPTIONS_FIELDS: frozenset[str] = frozenset(
    {
        "continuous_usage_stats",
        "include_usage",
    }
)

# Keys one entry of `messages` may have. This is the union of the openai package's
# per-role message TypedDicts and vLLM's CustomChatCompletionMessageParam.
# `reasoning_content` is a deprecated spelling: a before-validator renames it to
# `reasoning`. `tools` is read only for the developer role. `task` is a marker
# passed through for DeepSeek V4. openai-harmony Message objects are also
# accepted; their fields are not listed here.
VLLM_CHAT_MESSAGE_FIELDS: frozenset[str] = frozenset(
    {
        "audio",
        "content",
        "function_call",
        "name",
        "reasoning",
        "reasoning_content",
        "refusal",
        "role",
        "task",
        "tool_call_id",
        "tool_calls",
        "tools",
    }
)

# The `type` values that vLLM's content-part parser handles: the MM_PARSER_MAP keys.
# Any other type, including OpenAI's "file", is rejected as an unsupported content
# part type. A part with no `type` is still accepted when it carries image_url,
# image_pil, image_embeds, audio_embeds, prompt_embeds, audio_url, input_audio,
# video_url or tool_reference. A bare string in the list is taken as text.
VLLM_CONTENT_PART_TYPES: frozenset[str] = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "input_image",
        "input_text",
        "output_text",
        "prompt_embeds",
        "refusal",
        "text",
        "thinking",
        "tool_reference",
        "video_url",
    }
)
