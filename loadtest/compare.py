"""`pdcluster bench compare A.json B.json`: every headline metric of two runs and B/A.

Typical pairs: prefix caching on vs off, colocated vs disaggregated, before vs after a change.
For throughputs and hit ratios a ratio above 1 means B is better; for latencies, below 1.
"""

from __future__ import annotations

import json
from pathlib import Path

# (key, higher is better)
HEADLINE = [
    ("completed", True), ("failed", False), ("dropped", False), ("duration", False),
    ("total_input_tokens", True), ("total_output_tokens", True),
    ("request_throughput", True), ("request_goodput", True), ("output_throughput", True),
    ("total_token_throughput", True), ("max_output_tokens_per_s", True),
    *[(f"{stat}_{name}_ms", False) for name in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p90", "p99")],
    ("prefix_cache_hit_ratio", True), ("offline_prefix_hit_ratio", True),
]


def load_result(path: str | Path) -> dict:
    """A result JSON written by `pdcluster bench run` (or `vllm bench serve`).

    Raises:
        ValueError: the file is not a JSON object.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a benchmark result (expected a JSON object)")
    return data


def compare_rows(a: dict, b: dict) -> list[dict]:
    """One row per headline metric present in either file: key, a, b, ratio (b/a; None when
    either is missing or a is 0), better ("a", "b", "=", or "" when undecidable)."""
    rows = []
    keys = list(HEADLINE)
    tiers = sorted(set(a.get("prefix_cache_hit_ratio_by_tier") or {})
                   | set(b.get("prefix_cache_hit_ratio_by_tier") or {}))
    for tier in tiers:
        keys.append((f"prefix_cache_hit_ratio[{tier}]", True))
    for key, higher_better in keys:
        va, vb = _value(a, key), _value(b, key)
        if va is None and vb is None:
            continue
        ratio = vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) \
            and va != 0 else None
        better = ""
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            better = "=" if va == vb else ("b" if (vb > va) == higher_better else "a")
        rows.append({"metric": key, "a": va, "b": vb, "ratio": ratio, "better": better})
    return rows


def _value(result: dict, key: str):
    if key.startswith("prefix_cache_hit_ratio["):
        tier = key[len("prefix_cache_hit_ratio["):-1]
        return (result.get("prefix_cache_hit_ratio_by_tier") or {}).get(tier)
    value = result.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def format_compare(rows: list[dict], name_a: str, name_b: str) -> str:
    """A Markdown table: metric | A | B | B/A | better."""
    def cell(v) -> str:
        if v is None:
            return "n/a"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = [f"A = {name_a}", f"B = {name_b}", "",
             "| metric | A | B | B/A | better |", "|---|---:|---:|---:|:---:|"]
    for row in rows:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
        lines.append(f"| {row['metric']} | {cell(row['a'])} | {cell(row['b'])} | {ratio} | "
                     f"{row['better']} |")
    return "\n".join(lines)
