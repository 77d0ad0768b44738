"""``CostModel``: what recomputing a cached token costs, as a function of its position.

Prefill of a token at position ``p`` costs a part independent of ``p`` (the projections and
MLP) plus attention over the ``p`` tokens before it, so keeping a deep token saves more compute
than keeping a shallow one. Cost-aware policies (``gdsf``, ``lhd`` with ``cost_aware``) and the
simulator's "prefill compute saved" metric share this model.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvplug_hookspecs import FrozenModel

__all__ = ["CostModel"]


class CostModel(FrozenModel):
    """Cost of prefilling the token at position ``p``: ``linear + quadratic * p``.

    Summed over a prompt of ``n`` tokens this is ``linear * n + quadratic * n (n - 1) / 2``:
    linear plus quadratic in depth. The default ``quadratic = 1/32768`` makes attention cost as
    much as the rest of the layer at a 32k-token context (about right for a 7B dense model:
    ``4 * layers * d_model * p`` attention FLOPs against ``2 * params`` per token).
    """

    linear: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    quadratic: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0 / 32768

    def per_token(self, depth: int, num_tokens: int) -> float:
        """Mean cost per token of ``num_tokens`` tokens starting at position ``depth``."""
        return self.linear + self.quadratic * (depth + (num_tokens - 1) / 2)

    def tokens_cost(self, depth: int, num_tokens: int) -> float:
        """Cost of prefilling ``num_tokens`` tokens starting at position ``depth``."""
        return num_tokens * self.per_token(depth, num_tokens)
