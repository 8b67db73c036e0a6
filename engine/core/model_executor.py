"""The runner's side of a step (vLLM v1's ``execute_model``): a SchedulerOutput's rows and
chunks as one forward, then the grammar masks and the sampler over the rows that sample; the
prompt logprobs a request asks for, from every position's logits, beside them."""

from __future__ import annotations

from collections.abc import Callable, Set

import torch

from pdcluster.engine.core.kv_connector import KVConnector
from pdcluster.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from pdcluster.engine.core.request import Request
from pdcluster.engine.core.structured_output import StructuredOutputManager, apply_bitmask
from pdcluster.engine.runner import ModelRunner, SequenceChunk
from pdcluster.engine.sampler import SampleInput, prompt_logprobs, sample


class ModelExecutor:
    """Runs one step's forward and sampling on ``runner``.

    Args:
        runner: the model runner.
        connector: the engine's KV connector, whose worker side sees each step's metadata
            before the forward and finishes its saves after it.
        eos_token_ids: the model's EOS ids (the sampler masks them under min_tokens).
        structured: the engine's grammar manager, once a request made one (None before).
    """

    def __init__(self, runner: ModelRunner, connector: KVConnector, eos_token_ids: Set[int],
                 structured: Callable[[], StructuredOutputManager | None]) -> None:
        self.runner, self.connector = runner, connector
        self.eos_token_ids, self._structured = eos_token_ids, structured

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward: the last token of every decode row, then each chunk; samples the next
        token of every decode row and of each prompt this step completes. Requests' state is
        read, not changed (update_from_output applies the result); a request's prompt
        logprobs are appended to it. Raises what the forward raises (StepCancelled: a
        connector's layer hook cancelled a request that runs alone)."""
        decoding, chunks = output.decoding, output.chunks
        lora = self.runner.lora_slot
        batch = [SequenceChunk((r.output_ids[-1],), r.num_tokens - 1, r.block_table,
                               lora(r.sampling.lora_name))
                 for r in decoding]
        for request, n in chunks:
            start = request.num_computed_tokens
            batch.append(SequenceChunk(tuple(request.token_ids[start:start + n]), start,
                                       request.block_table, lora(request.sampling.lora_name)))
        self.connector.bind_connector_metadata(output.kv_connector_metadata)
        scored = [(row, r, n) for row, (r, n) in enumerate(chunks, len(decoding))
                  if r.wants_prompt_logprobs]
        if scored:
            logits = self._score_prompts(self.runner.execute(batch, all_logits=True), batch,
                                         scored)
        else:
            logits = self.runner.execute(batch)
        self.connector.wait_for_save()
        # a prompt's last chunk samples its output token 0
        done = [(row, r) for row, (r, n) in enumerate(chunks, len(decoding))
                if r.num_computed_tokens + n == r.num_tokens]
        sampling = decoding + [r for _, r in done]
        if not sampling:
            return ModelRunnerOutput()
        rows = [*range(len(decoding)), *(row for row, _ in done)]
        inputs = [SampleInput(r.sampling, r.seed, r.prompt_token_ids, r.output_ids,
                              r.token_edits) for r in sampling]
        sampled = sample(self._constrained(logits[rows], sampling), inputs, self.eos_token_ids)
        return ModelRunnerOutput([(r, token, logprob)
                                  for r, (token, logprob) in zip(sampling, sampled)])

    def _score_prompts(self, logits: torch.Tensor, batch: list[SequenceChunk],
                       scored: list[tuple[int, Request, int]]) -> torch.Tensor:
        """From every position's logits [tokens, vocab] of the step: the prompt logprobs of
        each scored chunk (row i of a chunk predicts its token i + 1), and the last
        position's logits of each chunk, as a plain step returns them."""
        ends = torch.tensor([len(c.token_ids) for c in batch]).cumsum(0)
        for row, request, n in scored:
            start = request.num_computed_tokens
            first = int(ends[row]) - n
            targets = request.prompt_token_ids[start + 1:min(start + n + 1,
                                                             request.num_prompt_tokens)]
            if targets:
                request.prompt_logprobs += prompt_logprobs(
                    logits[first:first + len(targets)], targets, request.sampling.prompt_logprobs)
        return logits[ends - 1]

    def _constrained(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """``logits`` [rows, vocab] (a copy) with each grammar's disallowed tokens at -inf."""
        structured = self._structured()
        if structured is not None and any(r.grammar_on for r in requests):
            mask = structured.bitmask([r.grammar if r.grammar_on else None for r in requests])
            if mask is not None:
                apply_bitmask(logits, mask)
        return logits
