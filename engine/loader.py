"""Load a Hugging Face checkpoint's weights from safetensors files.

Supports a single `model.safetensors` or a sharded checkpoint described by
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`, the layout
`PreTrainedModel.save_pretrained(max_shard_size=...)` writes).
"""

from __future__ import annotations

import json
import pathlib

import safetensors.torch
import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightsNotFoundError(FileNotFoundError):
    """A model directory holds no loadable safetensors weights (or a shard is missing)."""


class WeightLoadError(ValueError):
    """Checkpoint tensors do not fit the model: missing names, wrong shapes or a bad index."""


def load_state_dict(path: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in directory `path`, by HF name, as stored (CPU, disk dtype).

    Raises WeightsNotFoundError if neither `model.safetensors` nor `model.safetensors.index.json`
    exists (or a shard named by the index is missing); WeightLoadError for a malformed index or a
    tensor the index names but its shard lacks.
    """
    directory = pathlib.Path(path)
    if (directory / SINGLE_FILE).is_file():
        return safetensors.torch.load_file(directory / SINGLE_FILE)
    if (directory / INDEX_FILE).is_file():
        return _load_sharded(directory)
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise WeightsNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {directory} (found: {present or 'nothing'}); "
        "only safetensors checkpoints are supported"
    )


def _load_sharded(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    try:
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise WeightLoadError(f"{directory / INDEX_FILE}: malformed index ({exc})") from exc
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = directory / shard
        if not shard_path.is_file():
            raise WeightsNotFoundError(f"shard {shard} named by {INDEX_FILE} is missing from {directory}")
        state.update(safetensors.torch.load_file(shard_path))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise WeightLoadError(f"{directory}: tensors in {INDEX_FILE} missing from its shards: {missing[:5]}")
    return state
