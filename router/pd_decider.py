"""The per-request PD decider: disaggregate a request (prefill instance, then KV transfer to the
decode instance), or prefill it on its decode instance (`local`), colocated style, where that
instance's own prefix cache serves what it holds.

    always       every request is disaggregated (the behaviour without a decider)
    never        every request is prefilled on its decode instance
    threshold:N  local when at most N prompt tokens are not in the decode instance's cache
    cost         local when the cost model predicts it beats disaggregation (the default)

`cost` weighs, for decode instance d running b sequences, with c of the prompt's N tokens in
d's own cache:

    T_local  = T_prefill(N − c, c)                      computed on d, in its steps
    T_remote = TTFT of the prefill plan (queue + load + prefill) + T_transfer(N − c, path pd)

and keeps the request local when

    T_local · (1 + b) ≤ T_remote     and     b = 0 or T_step(b + 1) + T_local ≤ the TBT SLO.

The left side is every delay the local prefill causes: its own time to first token, plus one
stall of T_local in the token stream of each of the b sequences decoding on d (chunked prefill
shares their steps). The second condition keeps the stall from pushing those sequences past
the TBT SLO. A short prompt, or a long one mostly cached on d, stays local while d is lightly
loaded or the prefill instances are queued up; a long uncached one goes to a prefill instance.
llm-d's prefix-based PD decider takes the same decision on uncached tokens alone
(`threshold:N`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.router.admission import SLO
from pdcluster.router.cost_model import PATH_PD
from pdcluster.router.policies.base import DecodeLoad, PrefillPlan, RouteContext

PATHS = ("disaggregated", "local")
MODES = ("always", "never", "cost", "threshold:N")


@dataclass(frozen=True)
class PDDecider:
    """mode: "always", "never", "cost" or "threshold"; threshold: N of `threshold:N`."""

    mode: str = "cost"
    threshold: int = 0

    @classmethod
    def parse(cls, spec: str) -> PDDecider:
        """"always" | "never" | "cost" | "threshold:N" (N >= 0 tokens).

        Raises:
            ValueError: anything else.
        """
        spec = spec.strip()
        if spec in ("always", "never", "cost"):
            return cls(spec)
        name, _, value = spec.partition(":")
        if name == "threshold":
            try:
                n = int(value)
            except ValueError:
                n = -1
            if n >= 0:
                return cls("threshold", n)
        raise ValueError(f"--pd-decider {spec!r}: expected one of {', '.join(MODES)} "
                         "(N >= 0 tokens)")

    def __str__(self) -> str:
        return f"threshold:{self.threshold}" if self.mode == "threshold" else self.mode

    def local(self, ctx: RouteContext, prefill: PrefillPlan, decode: DecodeLoad,
              slo: SLO) -> bool:
        """Whether the request is prefilled on `decode` (see the module docstring)."""
        if self.mode in ("always", "never"):
            return self.mode == "never"
        cached = min(decode.cached_blocks, ctx.max_hit_blocks) * ctx.block_size
        uncached = ctx.num_tokens - cached
        if self.mode == "threshold":
            return uncached <= self.threshold
        cost = ctx.cost
        t_local = cost.t_prefill(uncached, cached)
        t_remote = prefill.ttft_s + cost.t_transfer_tokens(uncached, PATH_PD)
        b = decode.batch_size
        stall_ok = b == 0 or \
            cost.t_step(b + 1, decode.context_tokens + ctx.num_tokens) + t_local <= slo.tbt_s
        return stall_ok and t_local * (1 + b) <= t_remote
