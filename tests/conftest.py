"""Shared test fixtures: transformers as the independent numerical reference.

tests/multinode starts its own multi-node Ray cluster, which cannot share a process with the
session's local Ray: it runs as its own pytest invocation (scripts/test.sh) and is skipped from
collection unless named on the command line.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections import Counter
from pathlib import Path

# pytest puts the repository root first on sys.path (pyproject's `pythonpath`, and `python -m`
# its working directory) so that `tests.*` and `benchmarks.*` import. Its folders would then
# shadow installed top-level packages of the same name, such as Hugging Face's `kernels`, which
# transformers imports: the root goes last, where only names nothing installed holds reach it.
_ROOT = Path(__file__).resolve().parent.parent
_at_root = [p for p in sys.path if Path(os.path.abspath(p or os.curdir)) == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _at_root] + _at_root[:1]

import pytest
import torch

from pdcluster.engine.config import BUNDLED_MODEL
from tests.markers import mark_starts
from tests.real_parts import require_real_part

MULTINODE = Path(__file__).parent / "multinode"
# Seconds a test process may take to exit once its tests are done (Ray's shutdown included).
EXIT_GRACE_S = 180


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if collection_path == MULTINODE:
        named = [Path(a.split("::")[0]).resolve() for a in config.args]
        return not any(p == MULTINODE or MULTINODE in p.parents for p in named) or None
    return None


def pytest_addoption(parser) -> None:
    parser.addoption("--full-matrix", action="store_true", dest="full_matrix",
                     help="serve every model family over every path "
                          "(tests/integration/test_model_families_serve.py), not one path each")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by them
def pytest_collection_modifyitems(config, items) -> None:
    mark_starts(items)  # the ray / server marks of the fixtures each test uses (tests/markers.py)
    # Under pytest-xdist's --dist loadgroup (scripts/test.sh) the tests that start a Ray run in
    # two groups, each in one worker, one test after another: those whose Ray is a subprocess's
    # (`pdcluster serve`, `ray start`), and those on this process's own Ray (the session
    # cluster). More Rays at once on 2 cores starve each other's actors past their timeouts. The
    # other tests go by module (its fixtures built once, in one worker) to any worker.
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_xdist_group(item)))
    if getattr(config.option, "loadgroup", False):  # set on its workers by pytest-xdist
        # the queue in this order (scripts/test.sh turns xdist's own reordering off): the two
        # Ray groups, the longest chains, first; then the modules, most tests first
        size = Counter(map(_xdist_group, items))
        items.sort(key=lambda item: (RAY_GROUPS.get(_xdist_group(item), len(RAY_GROUPS)),
                                     -size[_xdist_group(item)], _xdist_group(item)))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, on the controller
def pytest_xdist_node_collection_finished(node, ids) -> None:
    # under --dist loadgroup each worker suffixes a node id with its group ("…::test@ray"),
    # which is how the controller groups them; a pytest that drops the suffix would spread
    # the Ray tests over every worker without a word
    if node.config.option.dist == "loadgroup" and ids and "@" not in ids[0]:
        pytest.exit(f"pytest-xdist's --dist loadgroup does not group under pytest "
                    f"{pytest.__version__} (pytest-xdist#1386): see pyproject.toml", returncode=4)


#: fixtures that start a Ray in a subprocess (a `pdcluster serve`, a `ray start` head)
SUBPROCESS_RAY = frozenset({"serve_process", "serve", "module_serve", "ray_head"})


#: the Ray groups, in the order they are queued
RAY_GROUPS = {"ray-subprocess": 0, "ray": 1}


def _xdist_group(item) -> str:
    if item.get_closest_marker("ray") is None:
        return item.nodeid.split("::")[0]
    return "ray-subprocess" if SUBPROCESS_RAY & set(item.fixturenames) else "ray"


def pytest_runtest_setup(item) -> None:
    # real_part marks (tests/real_parts.py): skipped here, failed under CI=true
    for mark in item.iter_markers("real_part"):
        require_real_part(*mark.args, **mark.kwargs)


def pytest_unconfigure(config) -> None:
    # A native thread that never returns (a transfer engine's, say) would keep the process
    # from exiting after its tests, and hold CI to its limit with pytest's output unflushed:
    # past the grace, every thread's stack goes to stderr and the process exits with 1.
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.__stderr__)


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
