"""Load a Hugging Face checkpoint's weights from safetensors files.

Supports a single `model.safetensors` or a sharded checkpoint described by
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`, the layout
`PreTrainedModel.save_pretrained(max_shard_size=...)` writes).

`CheckpointReader` hands out lazy safetensors slices, so a tensor-parallel rank reads only its
shard's bytes (engine.parallel).
"""

from __future__ import annotations

import json
import pathlib
from contextlib import ExitStack
from typing import Any

import safetensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightsNotFoundError(FileNotFoundError):
    """A model directory holds no loadable safetensors weights (or a shard is missing)."""


class WeightLoadError(ValueError):
    """Checkpoint tensors do not fit the model: missing names, wrong shapes or a bad index."""


class CheckpointReader:
    """Lazy access to a checkpoint's tensors by HF name, for sharded loading. Use as a context
    manager (it keeps the safetensors files open).

    `slice(name)` is a safetensors PySafeSlice: `.get_shape()`, and indexing such as
    `[a:b]` or `[:, a:b]` reads only those bytes into a CPU tensor of the disk dtype.

    Raises WeightsNotFoundError if neither `model.safetensors` nor `model.safetensors.index.json`
    exists (or a shard named by the index is missing); WeightLoadError for a malformed index or a
    tensor the index names but its shard lacks.
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        directory = pathlib.Path(path)
        if (directory / SINGLE_FILE).is_file():
            files = {None: directory / SINGLE_FILE}
            weight_map = None
        elif (directory / INDEX_FILE).is_file():
            try:
                weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise WeightLoadError(f"{directory / INDEX_FILE}: malformed index ({exc})") from exc
            files = {shard: directory / shard for shard in sorted(set(weight_map.values()))}
            for shard, file in files.items():
                if not file.is_file():
                    raise WeightsNotFoundError(f"shard {shard} named by {INDEX_FILE} is missing "
                                               f"from {directory}")
        else:
            present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
            raise WeightsNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {directory} (found: {present or 'nothing'}); "
                "only safetensors checkpoints are supported"
            )
        self._stack = ExitStack()
        self._handles = {key: self._stack.enter_context(safetensors.safe_open(file, "pt"))
                         for key, file in files.items()}
        self._where: dict[str, Any] = {}
        for key, handle in self._handles.items():
            for name in handle.keys():
                self._where[name] = key
        if weight_map is not None:
            missing = sorted(n for n, shard in weight_map.items() if self._where.get(n) != shard)
            if missing:
                self.close()
                raise WeightLoadError(f"{directory}: tensors in {INDEX_FILE} missing from its "
                                      f"shards: {missing[:5]}")

    def names(self) -> list[str]:
        return list(self._where)

    def slice(self, name: str) -> Any:
        return self._handles[self._where[name]].get_slice(name)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
