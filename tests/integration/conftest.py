"""Fixtures for tests that run the real cluster: one local Ray cluster per test session with
the gateway served over real HTTP by uvicorn, and HF transformers as the independent reference."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import uvicorn

from deploy.config import ServeConfig
from deploy.launcher import Cluster
from deploy.serve import gateway_app
from engine.config import BUNDLED_MODEL


class HFReference:
    """transformers' LlamaForCausalLM and tokenizer on the bundled model."""

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
        self.model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
        self.model.eval()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode_output(self, prompt_ids: list[int], output_ids: list[int]) -> str:
        """The OpenAI text of output_ids: decode(prompt + output)[len(decode(prompt)):]."""
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        full = self.tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
        return full[len(prompt_text):]

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32 logits of a full forward pass."""
        return self.model(torch.tensor([ids])).logits[0].float()

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
        ids = torch.tensor([prompt_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
        return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def hf() -> HFReference:
    return HFReference()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cluster():
    """Local Ray with one KV store, one prefill and one decode actor (default ServeConfig)."""
    with Cluster(ServeConfig(ray_num_cpus=4)) as c:
        yield c


@pytest.fixture(scope="session")
def api_base(cluster) -> str:
    """Base URL (http://127.0.0.1:PORT/v1) of the gateway `pdcluster serve` would run."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gateway_app(cluster.config, cluster),
                                           host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)
