"""End to end: the engine with the Triton kernels forced on gives the torch path's greedy tokens.

On CPU the kernels run in Triton's interpreter, which must be chosen before triton is imported,
so the engine runs in a child process with TRITON_INTERPRET=1 (`_greedy_child.py`); generation
is capped at 8 tokens to keep CI fast. Both backends must produce the same tokens as each other
and as transformers' greedy generate, and logits within 1e-4 of each other (float32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from tests.real_parts import import_real_part

import_real_part("triton", "Triton", "scripts/setup.sh installs it on Linux")

NUM_TOKENS = 8
PROMPTS = ["Once upon a time, there was a little girl", "The dog"]


def test_triton_backend_greedy_tokens_match_torch_and_hf(hf):
    prompts = [hf.encode(text) for text in PROMPTS]
    assert len(prompts[0]) + NUM_TOKENS > 16, "decode should cross a block boundary"
    root = Path(__file__).resolve().parents[2]
    child = Path(__file__).with_name("_greedy_child.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, str(child), json.dumps(prompts), str(NUM_TOKENS)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    expected = [hf.greedy(prompt, NUM_TOKENS) for prompt in prompts]
    assert report["tokens"]["torch"] == expected
    assert report["tokens"]["triton"] == expected
    assert report["max_logit_diff"] <= 1e-4
