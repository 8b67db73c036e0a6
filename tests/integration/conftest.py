"""Fixtures for tests that run the real cluster: HF transformers as the independent reference."""

from __future__ import annotations

import pytest
import torch

from engine.config import BUNDLED_MODEL


class HFReference:
    """Greedy generation with transformers' LlamaForCausalLM on the bundled model."""

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
        self.model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
        self.model.eval()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def hf() -> HFReference:
    return HFReference()
