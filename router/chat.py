"""POST /v1/chat/completions (OpenAI chat completions)."""

from __future__ import annotations

from engine.tokenizer import Tokenizer
from router.api_common import APIError, ServingContext, build_specs, respond
from router.chat_template import ChatTemplate, ChatTemplateError
from engine.logs import bind_request_id
from router.logprobs import chat_logprob_entry, vllm_prompt_logprobs
from router.schemas import ChatCompletionRequest, new_request_id
from router.serving import ChoiceDelta


async def create_chat_completion(body: ChatCompletionRequest, ctx: ServingContext,
                                 template: ChatTemplate):
    request_id = new_request_id("chatcmpl")
    bind_request_id(request_id)
    ctx.check_model(body.model)
    ctx.check_num_sequences(1, body.n)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    try:
        text = template.render([{"role": m.role, "content": m.text()} for m in body.messages])
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), "messages") from exc
    prompt = ctx.encode(text, "messages", add_special_tokens=body.add_special_tokens)
    requested = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = ctx.max_tokens_for(prompt, requested, param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    specs = build_specs(body, [prompt], [max_tokens], logprobs, ctx.structured_output(body))
    started: set[int] = set()
    whole = None
    if body.prompt_logprobs is not None:  # vLLM's: beside the choices, not in them
        def whole(choices: list[ChoiceDelta]) -> dict:
            return {"prompt_logprobs": vllm_prompt_logprobs(choices[0].prompt_logprobs or [],
                                                            body.prompt_logprobs,
                                                            ctx.tokenizer)}
    return await respond(ctx, body, request_id, [prompt], specs, "chat.completion",
                         "chat.completion.chunk",
                         lambda delta: _choice(delta, body, ctx.tokenizer, started), whole)


def _choice(delta: ChoiceDelta, body: ChatCompletionRequest, tokenizer: Tokenizer,
            started: set[int]) -> dict:
    """A stream chunk's choice ("delta") or a whole one ("message"). The first of an index
    (not yet in `started`, the indexes seen) carries the role: the first chunk of a streamed
    choice, and every whole one."""
    message = {"content": delta.text}
    if delta.index not in started:
        started.add(delta.index)
        message = {"role": "assistant", **message}
    choice = {"index": delta.index, "delta" if body.stream else "message": message,
              "logprobs": {"content": [chat_logprob_entry(e, tokenizer) for e in delta.logprobs]}
              if body.logprobs else None,
              "finish_reason": delta.finish_reason}
    if body.return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice
