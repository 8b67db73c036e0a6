"""POST /v1/completions (OpenAI legacy completions; vLLM's `return_token_ids` extension)."""

from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

from engine.protocol import TokenLogprob
from engine.tokenizer import Tokenizer
from router.api_common import (APIError, ServingContext, build_specs, collect, envelope, sse,
                               start_stream, usage)
from engine.logs import bind_request_id
from router.schemas import CompletionRequest, new_request_id
from router.serving import ChoiceDelta


async def create_completion(body: CompletionRequest, ctx: ServingContext):
    ctx.check_model(body.model)
    prompts = _prompts(body, ctx.tokenizer)
    max_tokens = [ctx.max_tokens_for(p, body.max_tokens, "max_tokens") for p in prompts]
    specs = build_specs(body, prompts, max_tokens, body.logprobs)
    request_id = new_request_id("cmpl")
    bind_request_id(request_id)
    first, rest = await start_stream(ctx, request_id, specs, body.cache_salt)
    head = envelope(request_id, "text_completion", body.model)
    num_prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        offsets = [0] * len(specs)

        def chunk(delta: ChoiceDelta) -> dict:
            choice = _choice(delta, body, ctx.tokenizer, offsets[delta.index])
            offsets[delta.index] += len(delta.text)
            return {**head, "choices": [choice]}

        usage_chunk = (lambda n: {**head, "choices": [], "usage": usage(num_prompt_tokens, n)}) \
            if body.include_usage() else None
        return StreamingResponse(sse(first, rest, chunk, usage_chunk),
                                 media_type="text/event-stream")
    choices = await collect(first, rest, len(specs))
    completion_tokens = sum(len(c.token_ids) for c in choices)
    response = {**head, "choices": [_choice(c, body, ctx.tokenizer, 0) for c in choices],
                "usage": usage(num_prompt_tokens, completion_tokens)}
    if body.return_token_ids:
        response["prompt_token_ids"] = prompts if len(prompts) > 1 else prompts[0]
    return JSONResponse(response)


def _prompts(body: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt)]
    elif isinstance(prompt[0], str):
        prompts = [tokenizer.encode(p) for p in prompt]
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    for p in prompts:
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        bad = [t for t in p if t >= tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids out of range [0, {tokenizer.vocab_size}): "
                           f"{bad[:5]}", "prompt")
    return prompts


def _choice(delta: ChoiceDelta, body: CompletionRequest, tokenizer: Tokenizer,
            text_offset: int) -> dict:
    choice = {"index": delta.index, "text": delta.text,
              "logprobs": _logprobs(delta.logprobs, tokenizer, text_offset)
              if body.logprobs is not None else None,
              "finish_reason": delta.finish_reason}
    if body.return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice


def _logprobs(entries: list[TokenLogprob], tokenizer: Tokenizer, text_offset: int) -> dict:
    """The completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [tokenizer.token_text(e.token_id) for e in entries]
    offsets = []
    for token in tokens:  # vLLM's convention: cumulative length of the token strings
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{tokenizer.token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
