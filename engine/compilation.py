"""The compiled forward: the model's forward through torch.compile (Inductor), with the token
count dynamic, no padding.

What the graph holds: embedding, RMSNorms and residual adds, RoPE, SiLU-and-mul (the torch
references, which Inductor fuses into C++/OpenMP loops on CPU and Triton on CUDA) and the GEMMs
(oneDNN-packed CPU weights through the custom op `pdcluster::packed_linear`, dense ones as
`mm`). What stays outside it: each layer's attention, an opaque custom op
(`pdcluster::unified_attention`, engine.attention_layer) that stores K/V, attends with the
device's paged kernels and runs the KV connector's per-layer hooks, which is where vLLM splits
its graphs too; and the whole forward of a tensor-parallel instance (TP > 1), whose gloo
all-reduces run eager.

Compiling happens once per process, when the runner warms up (one forward of a few tokens
whose K/V are not stored). Inductor's FX graph cache (TORCHINDUCTOR_CACHE_DIR, by default under
the system temp directory) makes a warm start skip code generation; Dynamo's trace is paid per
process. Where compiling cannot work (no C++ compiler for Inductor on CPU, no Triton on CUDA)
or fails, the engine warns once and runs eager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from pdcluster.kernels import cpu_extension

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Dynamo's cache entries allowed per code object and in all, at least (see CompiledForward)
RECOMPILE_LIMIT = 1024
ACCUMULATED_RECOMPILE_LIMIT = 4096


def compile_unsupported(device: torch.device, tp_size: int) -> str | None:
    """Why the forward cannot be compiled for `device` at TP size `tp_size` here, or None."""
    if tp_size > 1:
        return "tensor parallel forwards run eager (gloo all-reduces are not traced)"
    if device.type == "cpu" and not cpu_extension.has_cxx_compiler():
        return "no C++ compiler for Inductor's CPU code"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "no triton for Inductor's CUDA code"
    elif device.type != "cpu":
        return f"Inductor does not target {device.type}"
    return None


class CompiledForward:
    """`model(input_ids, positions)` through torch.compile with the token count dynamic.

    The count is marked unbacked, so a batch of one token does not specialize a second graph;
    one graph serves every step. `fullgraph`: a graph break would be a bug, not a slow path."""

    def __init__(self, model: nn.Module) -> None:
        # Dynamo caches graphs per code object: every model this process compiles adds entries
        # under the one shared `forward`, so past the default limit (8) the next model would
        # fail to compile (a hard error under fullgraph) and run eager. vLLM raises the limits
        # around its compilation for the same reason.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit,
                                                 ACCUMULATED_RECOMPILE_LIMIT)
        self._compiled = torch.compile(model, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        return self._compiled(input_ids, positions)


def select_forward(model: nn.Module, device: torch.device, tp_size: int, enforce_eager: bool,
                   warm_up: Callable[[Forward], None]) -> tuple[Forward, str]:
    """(the forward to run, "compiled" | "eager"): the compiled forward, warmed up (compiled)
    by `warm_up(forward)`, unless `enforce_eager`, unsupported here (one warning), or the
    compile failed (one warning with the error; the eager forward then runs)."""
    if enforce_eager:
        return model, "eager"
    reason = compile_unsupported(device, tp_size)
    if reason is not None:
        log.warning("running the model eager: %s", reason)
        return model, "eager"
    forward = CompiledForward(model)
    try:
        warm_up(forward)
    except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager path
        log.warning("compiling the model failed, running it eager: %s: %s",
                    type(exc).__name__, exc)
        return model, "eager"
    return forward, "compiled"
