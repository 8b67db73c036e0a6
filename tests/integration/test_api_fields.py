"""Every request field of /v1/completions and /v1/chat/completions, through the real openai
client, checked against transformers (greedy, logprobs, penalties, logit_bias,
allowed_token_ids, bad_words) or statistically."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from openai import OpenAI

pytestmark = pytest.mark.slow

MODEL = "stories260K"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(api_base) -> OpenAI:
    return OpenAI(base_url=api_base, api_key="unused", max_retries=0)


OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                 "stream", "stream_options", "logprobs", "presence_penalty", "frequency_penalty",
                 "user"}


def complete(client, **kw):
    """client.completions.create; vLLM's extension fields go in extra_body, as users send them."""
    kw.setdefault("model", MODEL)
    kw.setdefault("prompt", PROMPT)
    extra = {"return_token_ids": True} | {k: kw.pop(k) for k in list(kw) if k not in OPENAI_FIELDS}
    return client.completions.create(extra_body=extra, **kw)


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_usage_counts_equal_tokenizer_counts(client, hf):
    out = complete(client, max_tokens=12, temperature=0)
    assert out.usage.prompt_tokens == len(hf.encode(PROMPT))
    assert out.usage.completion_tokens == len(ids_of(out.choices[0])) == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.choices[0].finish_reason == "length"
    chunks = list(complete(client, max_tokens=7, temperature=0, stream=True,
                           stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_forms_and_n(client, hf):
    texts = ["Once upon a time", "The little cat"]
    ids = [hf.encode(t) for t in texts]
    greedy = [hf.greedy(p, 6) for p in ids]
    for prompt in (texts, ids, ids[0], texts[0]):
        out = complete(client, prompt=prompt, max_tokens=6, temperature=0, n=2)
        n_prompts = 2 if isinstance(prompt[0], (str, list)) and not isinstance(prompt, str) else 1
        assert [c.index for c in out.choices] == list(range(2 * n_prompts))
        for c in out.choices:
            assert ids_of(c) == greedy[c.index // 2]
        assert out.usage.prompt_tokens == sum(len(p) for p in ids[:n_prompts])
    sampled = complete(client, max_tokens=10, temperature=1.0, seed=5, n=4)
    assert len(sampled.choices) == 4 and len({tuple(ids_of(c)) for c in sampled.choices}) > 1
    single = complete(client, max_tokens=10, temperature=1.0, seed=5)
    assert ids_of(sampled.choices[0]) == ids_of(single.choices[0])


def test_fixed_seed_reproduces_and_top_k_1_is_greedy(client, hf):
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95, min_p=0.01)
    a, b = complete(client, seed=11, **kw), complete(client, seed=11, **kw)
    assert ids_of(a.choices[0]) == ids_of(b.choices[0])
    others = {tuple(ids_of(complete(client, seed=s, **kw).choices[0])) for s in range(12, 16)}
    assert len(others) > 1
    greedy = hf.greedy(hf.encode(PROMPT), 24)
    for seed in range(3):
        out = complete(client, max_tokens=24, temperature=1.5, top_k=1, seed=seed)
        assert ids_of(out.choices[0]) == greedy


def test_first_token_distribution_matches_hf_softmax(client, hf):
    """Chi-square style check of 320 seeded draws of token 1 at temperature 0.8."""
    prompt = hf.encode("Lily went to the")
    probs = torch.softmax(hf.logits(prompt)[-1] / 0.8, dim=-1)
    counts: Counter = Counter()
    for seed in range(20):
        out = complete(client, prompt=prompt, max_tokens=1, temperature=0.8, n=16,
                       seed=seed * 16)
        counts.update(ids_of(c)[0] for c in out.choices)
    total = sum(counts.values())
    assert total == 320
    for token, p in enumerate(probs.tolist()):
        expected = p * total
        if expected >= 5:
            assert abs(counts[token] - expected) <= 4 * math.sqrt(expected) + 1, token
    assert sum(n for t, n in counts.items() if probs[t] * total < 0.05) <= 3


def test_stop_strings_split_across_tokens(client, hf):
    base = complete(client, max_tokens=40, temperature=0)
    text, ids = base.choices[0].text, ids_of(base.choices[0])
    pieces = [hf.decode_output(hf.encode(PROMPT), ids[:i]) for i in range(len(ids) + 1)]
    # a stop string that starts inside one token and ends inside a later one
    start = next(i for i in range(5, len(text) - 8)
                 if not any(len(p) == i for p in pieces) and "\n" not in text[i:i + 6])
    stop = text[start:start + 6]
    assert text.find(stop) == start
    out = complete(client, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
    assert out.choices[0].text == text[:start]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 40
    streamed = list(complete(client, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:start]
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert streamed[-1].choices[0].model_extra["stop_reason"] == stop
    # vLLM's include_stop_str_in_output: the text ends after the stop string
    for stream in (False, True):
        out = complete(client, max_tokens=40, temperature=0, stop=[stop, "zzzz"],
                       include_stop_str_in_output=True, stream=stream)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == text[:start + len(stop)]
        assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_stop_strings_do_not_end_within_min_tokens(client, hf):
    """vLLM's rule: a stop string must end after the first min_tokens tokens' text."""
    prompt = hf.encode(PROMPT)
    ids = hf.greedy(prompt, 30)
    text = hf.decode_output(prompt, ids)
    stop = " there"  # the second token's text
    protected = len(hf.decode_output(prompt, ids[:4]))
    assert text.find(stop) + len(stop) <= protected
    later = text.find(stop, protected - len(stop) + 1)  # the first one ending past them
    want = text[:later] if later >= 0 else text
    assert want != text[:text.find(stop)]
    out = complete(client, max_tokens=30, temperature=0, stop=[stop], min_tokens=4)
    assert out.choices[0].text == want
    assert complete(client, max_tokens=30, temperature=0, stop=[stop]).choices[0].text == \
        text[:text.find(stop)]


def test_stop_token_ids_min_tokens_and_ignore_eos(client, hf):
    prompt = hf.encode(PROMPT)
    greedy = hf.greedy(prompt, 20)
    stop_id = greedy[3]
    out = complete(client, max_tokens=20, temperature=0, stop_token_ids=[stop_id])
    k = greedy.index(stop_id)
    assert ids_of(out.choices[0]) == greedy[:k + 1]
    assert out.choices[0].finish_reason == "stop"
    # as vLLM: the stop token's text is not output unless include_stop_str_in_output
    assert out.choices[0].model_extra["stop_reason"] == stop_id
    assert out.choices[0].text == hf.decode_output(prompt, greedy[:k])
    out = complete(client, max_tokens=20, temperature=0, stop_token_ids=[stop_id],
                   include_stop_str_in_output=True)
    assert out.choices[0].text == hf.decode_output(prompt, greedy[:k + 1])
    # min_tokens masks the stop id until 6 tokens exist: reference loop on HF logits
    ref = []
    while len(ref) < 20:
        logits = hf.logits(prompt + ref)[-1]
        if len(ref) < 6:
            logits[[stop_id, 2]] = float("-inf")
        ref.append(int(logits.argmax()))
        if ref[-1] in (stop_id, 2):
            break
    out = complete(client, max_tokens=20, temperature=0, stop_token_ids=[stop_id], min_tokens=6)
    assert ids_of(out.choices[0]) == ref
    # ignore_eos is accepted and carried (its effect on EOS is tested at the engine level:
    # the bundled model never emits its EOS id 2)
    out = complete(client, max_tokens=30, temperature=0, ignore_eos=True)
    assert len(ids_of(out.choices[0])) == 30 and out.choices[0].finish_reason == "length"


def test_penalties_match_reference(client, hf):
    prompt = hf.encode(PROMPT)
    want = hf.greedy(prompt, 24, repetition_penalty=1.3)
    out = complete(client, max_tokens=24, temperature=0, repetition_penalty=1.3)
    assert ids_of(out.choices[0]) == want
    ref: list[int] = []
    for _ in range(24):  # OpenAI's definition over generated tokens, on HF logits
        logits = hf.logits(prompt + ref)[-1]
        for token, count in Counter(ref).items():
            logits[token] -= 0.7 * count + 0.4
        ref.append(int(logits.argmax()))
    out = complete(client, max_tokens=24, temperature=0, frequency_penalty=0.7,
                   presence_penalty=0.4, ignore_eos=True)
    assert ids_of(out.choices[0]) == ref


def test_logit_bias_allowed_token_ids_and_bad_words_match_reference(client, hf):
    """Each against transformers' own processor for it: SequenceBias, PrefixConstrained and
    NoBadWords."""
    prompt = hf.encode(PROMPT)
    plain = hf.greedy(prompt, 24)
    bias = {plain[0]: -5.0, plain[1]: -100.0, 100: 2.0}
    want = hf.greedy(prompt, 24, sequence_bias=[[[t], b] for t, b in bias.items()])
    out = complete(client, max_tokens=24, temperature=0,
                   logit_bias={str(t): b for t, b in bias.items()})
    assert ids_of(out.choices[0]) == want != plain

    allowed = sorted(set(plain[::2]))
    want = hf.greedy(prompt, 24, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    out = complete(client, max_tokens=24, temperature=0, allowed_token_ids=allowed)
    assert ids_of(out.choices[0]) == want != plain and set(want) <= set(allowed)
    sampled = complete(client, max_tokens=24, temperature=1.5, seed=3,
                       allowed_token_ids=allowed)
    assert set(ids_of(sampled.choices[0])) <= set(allowed)

    words = ["girl", "Lily"]  # in the plain output; "girl" is three tokens, "Lily" one
    banned: list[list[int]] = []
    for word in words:  # vLLM's tokenization of a bad word (SamplingParams)
        ids = hf.encode(word, add_special_tokens=False)
        spaced = hf.encode(" " + word, add_special_tokens=False)
        banned += [ids] + ([spaced] if spaced[0] != ids[0] and len(spaced) == len(ids) else [])
    assert any(len(ids) > 1 for ids in banned)
    want = hf.greedy(prompt, 24, bad_words_ids=banned)
    for stream in (False, True):
        out = complete(client, max_tokens=24, temperature=0, bad_words=words, stream=stream)
        got = ids_of(out.choices[0]) if not stream else [t for c in out
                                                          for t in ids_of(c.choices[0])]
        assert got == want != plain
    assert not any(word in hf.decode_output(prompt, want) for word in words)


def test_skip_special_tokens_and_eos_text(client, hf):
    """Special tokens' text, as transformers decodes it, only with skip_special_tokens false;
    the EOS that ends a choice shows only with include_stop_str_in_output too (vLLM's)."""
    prompt = hf.encode(PROMPT)

    def special_text(ids: list[int]) -> str:
        whole = hf.tokenizer.decode(prompt + ids, skip_special_tokens=False)
        return whole[len(hf.tokenizer.decode(prompt, skip_special_tokens=False)):]

    bos = {str(hf.tokenizer.bos_token_id): 100}
    out = complete(client, max_tokens=3, temperature=0, logit_bias=bos)
    assert ids_of(out.choices[0]) == [hf.tokenizer.bos_token_id] * 3
    assert out.choices[0].text == ""
    out = complete(client, max_tokens=3, temperature=0, logit_bias=bos,
                   skip_special_tokens=False)
    assert out.choices[0].text == special_text([hf.tokenizer.bos_token_id] * 3) != ""

    eos = hf.tokenizer.eos_token_id
    for include in (False, True):
        out = complete(client, max_tokens=3, temperature=0, logit_bias={str(eos): 100},
                       skip_special_tokens=False, include_stop_str_in_output=include)
        choice = out.choices[0]
        assert ids_of(choice) == [eos] and choice.finish_reason == "stop"
        assert choice.model_extra["stop_reason"] is None  # EOS, not a stop id or string
        assert choice.text == (special_text([eos]) if include else "")


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(client, hf):
    prompt = hf.encode("Once upon a time, there was a little girl named Lily.")
    for side, kept in ((None, prompt[-5:]), ("left", prompt[-5:]), ("right", prompt[:5])):
        out = complete(client, prompt=prompt, max_tokens=8, temperature=0,
                       truncate_prompt_tokens=5, truncation_side=side, echo=True)
        assert out.usage.prompt_tokens == 5
        assert ids_of(out.choices[0]) == hf.greedy(kept, 8)
        assert out.choices[0].text.startswith(hf.tokenizer.decode(kept,
                                                                  skip_special_tokens=True))
    out = complete(client, max_tokens=4, temperature=0, truncate_prompt_tokens=-1)
    assert out.usage.prompt_tokens == len(hf.encode(PROMPT))  # -1: up to max_model_len - 1
    max_model_len = client.models.list().data[0].model_extra["max_model_len"]
    long = (prompt * max_model_len)[:max_model_len + 50]
    out = complete(client, prompt=long, max_tokens=1, temperature=0, truncate_prompt_tokens=-1)
    assert out.usage.prompt_tokens == max_model_len - 1
    assert ids_of(out.choices[0]) == hf.greedy(long[-(max_model_len - 1):], 1)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_return_tokens_as_token_ids_names_every_logprob_token(client):
    """vLLM's return_tokens_as_token_ids: `token_id:N` wherever a logprob entry names a token,
    N the id the choice's token_ids hold."""
    out = complete(client, max_tokens=5, temperature=0, logprobs=2, echo=True,
                   prompt_logprobs=2, return_tokens_as_token_ids=True)
    choice = out.choices[0]
    prompt = out.model_extra["prompt_token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in prompt + ids_of(choice)]
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs[1:]
               for k in top)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == \
        [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(top.token.startswith("token_id:") for e in content for top in e.top_logprobs)


def test_logprobs_equal_hf_log_softmax(client, hf):
    prompt = hf.encode(PROMPT)
    out = complete(client, max_tokens=8, temperature=0, logprobs=3)
    ids = ids_of(out.choices[0])
    lp = out.choices[0].logprobs
    ref = torch.log_softmax(hf.logits(prompt + ids), dim=-1)[len(prompt) - 1:-1]
    for i, token in enumerate(ids):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i, token]), abs=1e-4)
        top = torch.topk(ref[i], 3)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert len(lp.tokens) == len(ids)

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    chat_prompt = hf.encode("<s>User: Tell me a story.\nAssistant:", add_special_tokens=False)
    chat_ids = chat.choices[0].model_extra["token_ids"]
    ref = torch.log_softmax(hf.logits(chat_prompt + chat_ids), dim=-1)[len(chat_prompt) - 1:-1]
    for i, entry in enumerate(chat.choices[0].logprobs.content):
        assert entry.logprob == pytest.approx(float(ref[i, chat_ids[i]]), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            torch.topk(ref[i], 2).values.tolist(), abs=1e-4)


def test_chat_plain_template_stream_and_not(client, hf):
    messages = [{"role": "system", "content": "Stories for kids."},
                {"role": "user", "content": "Tell me about a dog."}]
    rendered = "<s>Stories for kids.\n\nUser: Tell me about a dog.\nAssistant:"
    prompt = hf.encode(rendered, add_special_tokens=False)
    want = hf.greedy(prompt, 20)
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_completion_tokens=20)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == hf.decode_output(prompt, want)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(want)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        out.choices[0].message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
    # with no max tokens, the rest of the context is the limit
    long = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert long.usage.total_tokens == 512 and long.choices[0].finish_reason == "length"


def test_user_is_accepted_and_cache_salt_isolates_prefix_reuse(client, api_base, hf):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def device_hits() -> float:
        text = httpx.get(api_base.removesuffix("/v1") + "/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "pdcluster_prefix_cache_hit_tokens_total")

    prompt = hf.encode("Salted story: a red fox ran into the woods to find his little brother "
                       "who was playing with a ball near the river bank.")
    assert len(prompt) > 32
    greedy = hf.greedy(prompt, 4)

    def run(salt):
        before = device_hits()
        out = complete(client, prompt=prompt, max_tokens=4, temperature=0, user="tenant-x",
                       cache_salt=salt)
        assert ids_of(out.choices[0]) == greedy
        return device_hits() - before

    assert run("tenant-a") == 0        # cold
    assert run("tenant-b") == 0        # another tenant's salt: nothing shared
    assert run("tenant-a") >= 32       # the same salt: the prefix is reused
