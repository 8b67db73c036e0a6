"""The gate in front of a worker actor's `inject_fault`: faults act only when the engine config
enables them (tests of a running cluster set `EngineConfig.fault_injection`; serving never does).
"""

from __future__ import annotations

from collections.abc import Collection


def check_fault(enabled: bool, fault: str, known: Collection[str]) -> None:
    """Raises RuntimeError when fault injection is off, ValueError for a fault not in `known`."""
    if not enabled:
        raise RuntimeError("fault injection is off in this worker's engine config "
                           "(EngineConfig.fault_injection)")
    if fault not in known:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(sorted(known))}")
