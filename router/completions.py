"""POST /v1/completions (OpenAI legacy completions; vLLM's `return_token_ids` extension)."""

from __future__ import annotations

from dataclasses import replace

from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.api_common import APIError, ServingContext, build_specs, respond
from pdcluster.engine.logs import bind_request_id
from pdcluster.router.logprobs import (TextOffsets, completion_logprobs, echo_logprobs,
                                       vllm_prompt_logprobs)
from pdcluster.router.schemas import CompletionRequest, new_request_id
from pdcluster.router.serving import ChoiceDelta


async def create_completion(body: CompletionRequest, ctx: ServingContext):
    request_id = new_request_id("cmpl")
    bind_request_id(request_id)
    ctx.check_model(body.model)
    candidates = body.candidates()
    ctx.check_num_sequences(body.num_prompts(), candidates)
    prompts = _prompts(body, ctx)
    max_tokens = [ctx.max_tokens_for(p, body.max_tokens, "max_tokens") for p in prompts]
    # best_of ranks candidates by their tokens' logprobs: computed whether shown or not
    logprobs = body.logprobs if candidates == body.n or body.logprobs is not None else 0
    specs = build_specs(ctx, body, prompts, max_tokens, logprobs, ctx.structured_output(body),
                        candidates)
    offsets = [TextOffsets() for _ in specs]  # per choice, carried across its stream chunks
    echoed: set[int] = set()  # choices whose prompt went out (echo)
    texts = _prompt_texts(body, prompts, ctx.tokenizer)
    return await respond(ctx, body, request_id, prompts, specs, "text_completion",
                         "text_completion",
                         lambda delta: _choice(delta, body, ctx.tokenizer, offsets[delta.index],
                                               prompts[delta.index // body.n],
                                               texts[delta.index // body.n], echoed),
                         select=lambda choices: _best(choices, candidates, body.n))


def _best(choices: list[ChoiceDelta], candidates: int, n: int) -> list[ChoiceDelta]:
    """Of each prompt's `candidates` choices, the n with the highest cumulative logprob (vLLM's
    best_of), most likely first, renumbered prompt × n + j."""
    if candidates == n:
        return choices
    best = []
    for p in range(len(choices) // candidates):
        group = choices[p * candidates:(p + 1) * candidates]
        group.sort(key=lambda c: sum(e.logprob for e in c.logprobs), reverse=True)
        best += [replace(c, index=p * n + j) for j, c in enumerate(group[:n])]
    return best


def _prompt_texts(body: CompletionRequest, prompts: list[list[int]],
                  tokenizer: Tokenizer) -> list[str]:
    """What echo shows of each prompt: the text sent, or the ids decoded (also when
    truncated)."""
    if body.truncate_prompt_tokens is not None:
        return [tokenizer.decode(p) for p in prompts]
    if isinstance(body.prompt, str):
        return [body.prompt]
    if isinstance(body.prompt[0], str):
        return list(body.prompt)
    return [tokenizer.decode(p) for p in prompts]


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
    prompts = [ctx.truncated(p, body) for p in prompts]
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
            offsets: TextOffsets, prompt: list[int], prompt_text: str, echoed: set[int]
            ) -> dict:
    """A choice (or stream chunk); the choice's first carries the echoed prompt and the
    prompt's logprobs."""
    first = delta.index not in echoed
    echoed.add(delta.index)
    echo = body.echo and first
    logprobs = None
    if body.logprobs is not None:
        as_ids = bool(body.return_tokens_as_token_ids)
        logprobs = completion_logprobs(delta.logprobs, tokenizer, offsets, as_ids) \
            if not echo else \
            _joined(echo_logprobs(prompt, delta.prompt_logprobs or [], body.logprobs, tokenizer,
                                  offsets, as_ids),
                    completion_logprobs(delta.logprobs, tokenizer, offsets, as_ids))
    choice = {"index": delta.index, "text": prompt_text + delta.text if echo else delta.text,
              "logprobs": logprobs, "finish_reason": delta.finish_reason,
              "stop_reason": delta.stop_reason}
    if body.prompt_logprobs is not None and first:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(delta.prompt_logprobs or [],
                                                         body.prompt_logprobs, tokenizer)
    if body.return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice


def _joined(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}
