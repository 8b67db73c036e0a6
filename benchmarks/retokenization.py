"""How often a chat reply, rendered into the next turn's prompt and tokenized again, gives back
the token ids the model generated: the condition for the next turn to reuse the reply's KV
blocks that the decode worker published (kvstore.transport.pool.publish).

    .venv/bin/python benchmarks/retokenization.py [--conversations 32] [--turns 4]
        [--max-tokens 64] [--temperature 0.8]

For each conversation: the gateway's chat path renders the messages with the model's chat
template (router.chat_template; the bundled model has none, so the plain one), tokenizes the
text as /v1/chat/completions does, and the model (transformers, the bundled stories260K)
generates the reply; the reply's text is what the gateway streams (engine.tokenizer's
IncrementalDetokenizer). The next turn appends the reply and a new user message and renders
again. Per turn >= 2 it compares, block by block (16 tokens), the previous turn's prompt +
reply ids (what the decode published: every full block of prompt and reply but its last
token) with the new prompt's ids, and prints

- blocks published: full blocks of the previous prompt + reply;
- blocks reusable: the leading full blocks the new prompt shares with them (the prefix cache
  matches block by block from the start);
- where the first difference falls: in the previous prompt, in the reply, or past it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from pdcluster.engine.config import BUNDLED_MODEL  # noqa: E402
from pdcluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402
from pdcluster.router.chat_template import ChatTemplate  # noqa: E402

BLOCK = 16
OPENERS = ["Tell me a story about a cat.", "What did Tim do at the park?",
           "Write about a red ball.", "Who is Lily?", "Tell me about a big tree.",
           "What happened on the boat?", "Tell me a story about a dog and a bird.",
           "Why was Sue sad?"]
FOLLOW_UPS = ["Then what happened?", "Tell me more.", "What did she say?", "And the end?"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="0: greedy; else sampled with a seed per conversation")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_pretrained(BUNDLED_MODEL)
    template = ChatTemplate.from_model_dir(BUNDLED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    published = reusable = 0
    where = {"prompt": 0, "reply": 0, "after": 0}
    per_turn = []
    for c in range(args.conversations):
        torch.manual_seed(c)
        messages = [{"role": "user", "content": OPENERS[c % len(OPENERS)]}]
        previous: list[int] | None = None
        for t in range(args.turns):
            prompt = tokenizer.encode(template.render(messages), add_special_tokens=False)
            if previous is not None:
                shared = common_prefix(previous, prompt)
                full = len(previous) // BLOCK
                hit = min(shared, len(previous)) // BLOCK
                published, reusable = published + full, reusable + hit
                per_turn.append(hit / full if full else 1.0)
                if shared < len(previous):
                    where["prompt" if shared < previous_prompt_len else "reply"] += 1
                else:
                    where["after"] += 1
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens,
                                     do_sample=args.temperature > 0,
                                     temperature=args.temperature or None, top_k=None,
                                     top_p=None, pad_token_id=0)
            reply = out[0, len(prompt):].tolist()
            detok = IncrementalDetokenizer(tokenizer, prompt)
            text = detok.add(reply, final=True)
            kept = [i for i in reply if not tokenizer.is_special(i)]
            text = text if kept else ""
            previous, previous_prompt_len = prompt + reply[:-1], len(prompt)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    print(f"{args.conversations} conversations x {args.turns} turns, replies of up to "
          f"{args.max_tokens} tokens, temperature {args.temperature}, blocks of {BLOCK}")
    print(f"turns >= 2: blocks published {published}, reusable by the next prompt {reusable} "
          f"({reusable / max(published, 1):.1%}); per turn median "
          f"{statistics.median(per_turn):.1%}")
    print(f"first difference: in the previous prompt {where['prompt']}, in the reply "
          f"{where['reply']}, none within it {where['after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
