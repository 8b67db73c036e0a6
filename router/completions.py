"""POST /v1/completions (OpenAI legacy completions; vLLM's `return_token_ids` extension)."""

from __future__ import annotations

from engine.tokenizer import Tokenizer
from router.api_common import APIError, ServingContext, build_specs, respond
from engine.logs import bind_request_id
from router.logprobs import TextOffsets, completion_logprobs
from router.schemas import CompletionRequest, new_request_id
from router.serving import ChoiceDelta


async def create_completion(body: CompletionRequest, ctx: ServingContext):
    request_id = new_request_id("cmpl")
    bind_request_id(request_id)
    ctx.check_model(body.model)
    ctx.check_num_sequences(body.num_prompts(), body.n)
    prompts = _prompts(body, ctx)
    max_tokens = [ctx.max_tokens_for(p, body.max_tokens, "max_tokens") for p in prompts]
    specs = build_specs(body, prompts, max_tokens, body.logprobs, ctx.structured_output(body))
    offsets = [TextOffsets() for _ in specs]  # per choice, carried across its stream chunks
    return await respond(ctx, body, request_id, prompts, specs, "text_completion",
                         "text_completion",
                         lambda delta: _choice(delta, body, ctx.tokenizer, offsets[delta.index]))


def _prompts(body: CompletionRequest, ctx: ServingContext) -> list[list[int]]:
    """Token ids of each prompt (the schema has checked that none is empty)."""
    prompt = body.prompt

    def encode(text: str) -> list[int]:
        return ctx.encode(text, "prompt", add_special_tokens=body.add_special_tokens)

    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif isinstance(prompt[0], str):
        prompts = [encode(p) for p in prompt]
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    tokenizer = ctx.tokenizer
    for p in prompts:
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        bad = [t for t in p if t >= tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids out of range [0, {tokenizer.vocab_size}): "
                           f"{bad[:5]}", "prompt")
    return prompts


def _choice(delta: ChoiceDelta, body: CompletionRequest, tokenizer: Tokenizer,
            offsets: TextOffsets) -> dict:
    choice = {"index": delta.index, "text": delta.text,
              "logprobs": completion_logprobs(delta.logprobs, tokenizer, offsets)
              if body.logprobs is not None else None,
              "finish_reason": delta.finish_reason}
    if body.return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice
