"""Messages between the gateway, the prefill worker and the decode worker.

These travel over Ray's control plane (trusted cluster). They carry token ids, sampling
parameters and the connectors' opaque ``kv_transfer_params`` (handles, never KV tensors); KV
bytes go over the data plane, through the KV connectors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A grammar the output must match (vLLM's ``StructuredOutputsParams``, one kind each).

    kind: "json" (spec: a JSON schema, as JSON text), "regex", "choice" (a JSON list of
    strings), "grammar" (Lark or GBNF/EBNF, as llguidance reads them) or "structural_tag"
    (vLLM's: a JSON object with "structures" and "triggers").
    whitespace_pattern: for "json", a regex of the whitespace allowed between tokens (vLLM's
        field); None: none (compact JSON).
    Raises ValueError on an unknown kind.
    """

    kind: str
    spec: str
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_OUTPUT_KINDS}, "
                             f"got {self.kind!r}")


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, with vLLM's meanings and order of application
    (vllm/v1/sample/sampler.py): allowed_token_ids → bad words → min_tokens masking →
    logit_bias → penalties → temperature → min_p → top_k → top_p → draw.

    max_tokens: tokens to generate (>= 1), counting the first (prefill) token.
    temperature: 0 means greedy (argmax after penalties); otherwise logits are divided by it.
    top_p: nucleus mass in (0, 1]; top_k: keep the k most likely (0 or -1 = all);
    min_p: drop tokens whose probability is below min_p × the top probability.
    seed: the random stream for output token t is derived from (seed, t) only, so a request's
        text does not depend on which requests share its batches. None draws a seed.
    stop_token_ids: ids that end the request in addition to the model's EOS ids.
    ignore_eos: keep generating past EOS until max_tokens.
    min_tokens: EOS and stop ids are masked until this many tokens were generated.
    presence_penalty, frequency_penalty: OpenAI's, over the generated tokens, in [-2, 2].
    repetition_penalty: CTRL's (Keskar et al. 2019) as vLLM applies it over prompt and output
        tokens: a logit > 0 is divided by it, otherwise multiplied; 1 = off.
    logprobs: None = none; k >= 0 = the sampled token's logprob plus the top k, computed from
        the raw model logits (vLLM's default "raw_logprobs").
    output_offset: a migrated request (router.pipeline.resumed_request): the last
        output_offset tokens of its prompt are output tokens generated before it moved. The
        sampler draws this request's token t from the (seed, output_offset + t) stream and counts
        those tokens as output for presence/frequency penalties; max_tokens and min_tokens then
        count only the tokens still to generate. 0 for every request that did not move.
    structured_output: the grammar every output token is sampled under (None: free text);
        the request stops when the grammar is complete.
    prompt_logprobs: None = none; k >= 0 = each prompt token's logprob (after the first) plus
        the top k, from the raw logits of the forward that computes the prompt (vLLM's); the
        prompt is then computed whole, never served by the prefix cache.
    logit_bias: (token_id, bias) pairs added to the logits, bias in [-100, 100] (OpenAI's).
    allowed_token_ids: None = every token; else only these ids can be sampled (non-empty).
    bad_words_token_ids: token-id sequences the output must not contain: a sequence's last id
        is masked whenever the output so far ends with the rest of it (vLLM's bad_words,
        tokenized by the gateway). Ids past the model's vocabulary are ignored in all three.
    reasoning_end_token_ids: with structured_output, the grammar holds only for the output
        after these ids first appear in it (a reasoning model's end of thinking: vLLM starts
        structured outputs when the reasoning ends); () = from the first token.
    priority: the request's scheduling priority, lower first (vLLM's request `priority`); the
        workers' schedulers and the gateway's queue read it under `--scheduling-policy
        priority` only. It lives here because these params travel with the request everywhere
        it goes (prefill, decode, migration).
    lora_name: the LoRA adapter (`--lora-modules`, engine.lora) the request runs with; None:
        the base model. Its KV blocks are keyed apart (engine.core.hashing.make_namespace).
    Raises ValueError on out-of-range values.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    output_offset: int = 0
    structured_output: StructuredOutputSpec | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    reasoning_end_token_ids: tuple[int, ...] = ()
    priority: int = 0
    lora_name: str | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.output_offset >= 0, f"output_offset must be >= 0, got {self.output_offset}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            # no values in these messages: the tuples can be as long as the vocabulary
            (all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias needs token ids >= 0 and biases in [-100, 100]"),
            (self.allowed_token_ids is None
             or (len(self.allowed_token_ids) > 0 and min(self.allowed_token_ids) >= 0),
             "allowed_token_ids must hold at least one id, every id >= 0"),
            (all(len(w) > 0 and min(w) >= 0 for w in self.bad_words_token_ids),
             "bad_words_token_ids must be non-empty sequences of ids >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def needs_history(self) -> bool:
        """Whether sampling looks at the prompt/output tokens (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def edits_logits(self) -> bool:
        """Whether sampling changes logits before temperature (penalties, logit_bias,
        allowed_token_ids, bad words); min_tokens masking is judged per step."""
        return bool(self.needs_history or self.logit_bias or self.bad_words_token_ids
                    or self.allowed_token_ids is not None)


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of a generated token under the raw model distribution, and the top entries.

    top: (token_id, logprob) pairs, most likely first; len = the request's `logprobs`.
    rank: 1 + how many tokens were more likely (prompt logprobs; None where not computed).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


class FinishReason(str, enum.Enum):
    """OpenAI's finish_reason values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


#: The opaque hand-off between KV connectors (vLLM v1's ``kv_transfer_params``): string keys
#: that the connectors of both ends agree on (kvstore.handoff), values the control
#: plane carries. The engine passes these dicts along and never reads them.
KVTransferParams = dict[str, object]


@dataclass(frozen=True)
class PrefillRequest:
    """What the gateway sends a prefill worker.

    prompt_token_ids: the tokenized prompt (BOS included when the tokenizer adds one).
    cache_salt: optional per-tenant salt mixed into block keys.
    kv_transfer_params: what the gateway asks of the prefill's connectors (where to push,
        which cached prefix to load); None: nothing.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None


@dataclass(frozen=True)
class FirstToken:
    """What a prefill worker streams first, as soon as it is sampled: output token 0 (the
    gateway sends it to the client while the prompt's KV is still being published).

    logprob: its logprob entry when the request asked for logprobs.
    num_cached_tokens: prompt tokens whose KV came from the prefix cache (any tier), not
        computed; what OpenAI's `usage.prompt_tokens_details.cached_tokens` reports.
    prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per prompt token after the
        first.
    """

    request_id: str
    token: int
    logprob: TokenLogprob | None
    prefill_worker_id: str
    prefill_pid: int
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker returns: the first token, and what its connectors tell the
    decode's about where the prompt's KV now lives.

    first_token: token sampled from the last prompt position (output token 0);
    first_logprob: its logprob entry when the request asked for logprobs.
    num_cached_tokens: prompt tokens whose KV came from the prefix cache, not computed.
    prefill_worker_id / prefill_pid: which actor and process computed it (for tests and tracing).
    kv_transfer_params: the prefill connectors' hand-off to the decode's connectors.
    extra: diagnostics: ``compute_end_s``, time.time() when the last chunk's forward ended,
        and with layer streaming ``layer_compute_end_s``, when each layer of it did.
    """

    request_id: str
    first_token: int
    num_cached_tokens: int
    prefill_worker_id: str
    prefill_pid: int
    first_logprob: TokenLogprob | None = None
    kv_transfer_params: KVTransferParams = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeRequest:
    """What the gateway sends a decode worker: after prefill, with its result; or, colocated,
    with prefill None — the decode worker prefills the prompt itself, with no KV transfer."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    prefill: PrefillResult | None = None
    #: the tenant's prefix-cache salt (PrefillRequest.cache_salt): the namespace of the keys
    #: under which a decode worker publishes the sequence's blocks
    cache_salt: str | None = None


#: TokenDelta.error_code of a KV load that failed under the ``fail`` policy
KV_LOAD_FAILED = "kv_load_failed"


@dataclass(frozen=True)
class TokenDelta:
    """One streamed item from a decode worker: the new tokens since the last item.

    finish_reason is set on the last item; num_forward_tokens counts the tokens this decode
    worker ran through the model for the request (the prompt is never recomputed, so it is
    generated − 1 on a normal finish); error carries a message when finish_reason is ERROR,
    and error_code what kind of error when a caller must tell it apart (KV_LOAD_FAILED: the
    request's KV load failed under the ``fail`` policy, which no retry should paper over).
    num_cached_tokens: on the first item of a request, the prompt tokens the prefix cache
    served (FirstToken.num_cached_tokens); None on the others.
    prompt_logprobs: on the first item of a request that asked for them, one entry per prompt
    token after the first (SamplingParams.prompt_logprobs); None on the others.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    num_forward_tokens: int = 0
    decode_worker_id: str = ""
    decode_pid: int = 0
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    extra: dict = field(default_factory=dict)
    error_code: str | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
