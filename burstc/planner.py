"""Communication planner for ring attention: bytes each rank sends, per plan, as sympy formulas.

Symbols: ``B`` batch, ``S`` global sequence length, ``P`` ring size, ``Hq`` query heads, ``Hkv``
key/value heads, ``D`` head dim, ``a`` bytes per activation element (q/k/v/dO dtype).  Everything
accumulated or kept as a softmax statistic travels in fp32 (4 bytes).  ``s = S / P`` tokens per rank.

The formulas describe exactly what ``burstc.ops.ring_attention`` hands to ``isend`` on every rank
(the multi-rank tests compare them with its byte counter):

* total bytes per call (``*_BYTES_PER_CALL``): every tensor of a travelling set is sent P - 1
  times; a travelling gradient accumulator also P - 1 times (P - 2 hops following its block plus
  the last hop home; the owner's own contribution stays home).
* "per step" (``*_BYTES_PER_STEP``, what :class:`AttentionPlan` reports as ``predicted_bytes``)
  is defined as the total per call / (P - 1), i.e. one ring step's share.  The actual sends of the
  backward are staggered (a gradient accumulator trails its block by one step), so an individual
  step may send less or more; the total is exact.

Forward: K, V            -> 2·B·s·Hkv·D·a per step
kv_ring backward: K, V (activation dtype) + dK, dV (fp32)          -> 2·B·s·Hkv·D·(a + 4)
burst backward: Q, dO (activation dtype) + dQ (fp32) + LSE, delta rows (fp32) -> B·s·Hq·(2·D·a + 4·D + 8)

burst/kv_ring = Hq·(2Da + 4D + 8) / (2·Hkv·D·(a + 4)): 0.67 (bf16) and 0.75 (fp32) for MHA at D=128,
so burst wins for MHA and loses as soon as Hq >= 2·Hkv (GQA/MQA; BurstEngine brief §3.2).
"""
from __future__ import annotations

import dataclasses
import functools

import sympy
import torch

from burstc.block_geometry import blocks

B, S, P, Hq, Hkv, D, a = sympy.symbols("B S P Hq Hkv D a", positive=True, integer=True)
FP32_BYTES = 4
_s = S / P  # tokens per rank

FORWARD_BYTES_PER_STEP = 2 * B * _s * Hkv * D * a
KV_RING_BACKWARD_BYTES_PER_STEP = 2 * B * _s * Hkv * D * a + 2 * B * _s * Hkv * D * FP32_BYTES
BURST_BACKWARD_BYTES_PER_STEP = (2 * B * _s * Hq * D * a          # Q, dO
                                 + B * _s * Hq * D * FP32_BYTES    # travelling dQ accumulator
                                 + 2 * B * _s * Hq * FP32_BYTES)   # LSE and delta rows

_STEPS_PER_CALL = P - 1
FORWARD_BYTES_PER_CALL = _STEPS_PER_CALL * FORWARD_BYTES_PER_STEP
KV_RING_BACKWARD_BYTES_PER_CALL = _STEPS_PER_CALL * KV_RING_BACKWARD_BYTES_PER_STEP
BURST_BACKWARD_BYTES_PER_CALL = _STEPS_PER_CALL * BURST_BACKWARD_BYTES_PER_STEP

BACKWARD_BYTES_PER_STEP = {"kv_ring": KV_RING_BACKWARD_BYTES_PER_STEP, "burst": BURST_BACKWARD_BYTES_PER_STEP}
BACKWARD_BYTES_PER_CALL = {"kv_ring": KV_RING_BACKWARD_BYTES_PER_CALL, "burst": BURST_BACKWARD_BYTES_PER_CALL}

_SYMBOLS = (B, S, P, Hq, Hkv, D, a)


def _bytes(expr: sympy.Expr, values: tuple[int, ...]) -> int:
    """Exact integer value of a byte formula (plan_attention is cached, so sympy speed is fine)."""
    value = expr.subs(dict(zip(_SYMBOLS, values)))
    if not value.is_integer:
        raise ValueError(f"{expr} is not a whole number of bytes at {dict(zip(_SYMBOLS, values))}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The planner's decision for one attention call (all byte counts per rank).

    ``predicted_bytes`` / ``alternative_bytes``: ``{"forward", "backward"}`` per ring step
    (= per call / (P - 1); 0 when P = 1).  ``total_bytes`` / ``alternative_total_bytes``: per call.
    ``expressions``: the sympy per-step formulas (``"forward"``, ``"kv_ring"``, ``"burst"``).
    """

    plan: str
    alternative: str
    predicted_bytes: dict[str, int]
    total_bytes: dict[str, int]
    alternative_bytes: dict[str, int]
    alternative_total_bytes: dict[str, int]
    expressions: dict[str, sympy.Expr]

    @property
    def backward_ratio(self) -> float:
        """Chosen / alternative backward bytes (<= 1; nan when nothing is sent)."""
        other = self.alternative_total_bytes["backward"]
        return self.total_bytes["backward"] / other if other else float("nan")


def element_size(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=1024)
def plan_attention(batch: int, seq_len: int, world_size: int, heads_q: int, heads_kv: int, head_dim: int,
                   dtype: torch.dtype | int) -> AttentionPlan:
    """Bytes of each backward plan for one attention call and the cheaper one (ties: kv_ring).

    ``seq_len`` is the global S (S / world_size tokens per rank); ``dtype`` the activation dtype
    or its element size in bytes.
    """
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    if seq_len % world_size:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of world_size ({world_size})")
    values = (batch, seq_len, world_size, heads_q, heads_kv, head_dim, element_size(dtype))
    per_step = {plan: _bytes(expr, values) if world_size > 1 else 0 for plan, expr in BACKWARD_BYTES_PER_STEP.items()}
    per_call = {plan: _bytes(expr, values) for plan, expr in BACKWARD_BYTES_PER_CALL.items()}
    chosen = "burst" if per_call["burst"] < per_call["kv_ring"] else "kv_ring"
    other = "kv_ring" if chosen == "burst" else "burst"
    forward_step = _bytes(FORWARD_BYTES_PER_STEP, values) if world_size > 1 else 0
    forward_call = _bytes(FORWARD_BYTES_PER_CALL, values)
    return AttentionPlan(
        plan=chosen,
        alternative=other,
        predicted_bytes={"forward": forward_step, "backward": per_step[chosen]},
        total_bytes={"forward": forward_call, "backward": per_call[chosen]},
        alternative_bytes={"forward": forward_step, "backward": per_step[other]},
        alternative_total_bytes={"forward": forward_call, "backward": per_call[other]},
        expressions={"forward": FORWARD_BYTES_PER_STEP, **BACKWARD_BYTES_PER_STEP},
    )


@dataclasses.dataclass(frozen=True)
class WorkBalance:
    """Unmasked score entries (per batch row and head) each rank computes in one ring attention call, read
    from :func:`burstc.block_geometry.blocks` (what the op computes and its counters count)."""

    per_rank: tuple[int, ...]

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.per_rank) / len(self.per_rank)
        return max(self.per_rank) / mean if mean else 1.0


@functools.lru_cache(maxsize=256)
def predicted_work(layout: str, mask, seq_len: int, world_size: int) -> WorkBalance:
    """Per-rank attention work for ``mask`` (a :class:`burstc.attention_ir.MaskSpec`) in ``layout``."""
    if seq_len % world_size:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of world_size ({world_size})")
    local_len = seq_len // world_size
    return WorkBalance(tuple(
        sum(block.score_entries for kv_owner in range(world_size)
            for block in blocks(layout, mask, rank, kv_owner, local_len, world_size))
        for rank in range(world_size)))
