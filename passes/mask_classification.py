"""Helper of ``detect_attention`` (not a pass): turn a constant attention mask into the exact :class:`MaskSpec`.

A mask is evaluated at compile time (``graph_utils.evaluate_constant``) and read in one of three styles:

- ``"visible"``: SDPA's ``attn_mask`` (bool: True = may attend; float: added to the scores);
- ``"additive"``: added to the scores (the manual ``scores + mask``); must be float;
- ``"filled"``: ``scores.masked_fill(mask, very_negative)`` (bool: True = hidden).

A float mask is a *mask* when every entry is 0 or ``<= finfo(dtype).min / 2`` (HF's eager masks use
``finfo.min``, not ``-inf``): ``exp`` of such a score underflows to exactly 0, as with ``-inf``, as long as
every row keeps a visible entry (true of every spec below: the diagonal is visible).  Finite nonzero values
on the visible entries are a *bias*: accepted only as ALiBi (``slope_h * (j - i)`` plus a per-row constant,
which the softmax ignores), else refused.

The visibility must equal ``MaskSpec.visible(arange(S), arange(S))`` entry for entry (every broadcast
batch/head slice alike) for one of: full, causal, ``Causal & SlidingWindow(w, None)``, a band
``SlidingWindow(l, r)``.  Anything else (chunked/block-diagonal masks included: ``MaskSpec`` has no term
for them) is refused with ``attention.mask_dense``; never a nearby spec.
"""
from __future__ import annotations

import torch

from burstc.attention_ir import Alibi, Causal, MaskSpec, SlidingWindow
from burstc.passes.graph_utils import NotConstant, evaluate_constant
from burstc.refusals import Refusal, register_codes

CODES = register_codes("attention", {
    "mask_runtime": "the mask depends on runtime values (inputs), not only on constants and buffers",
    "mask_not_tensor": "the mask is not a tensor",
    "mask_bias": "an additive mask with values other than 0 / -inf / <= finfo.min/2 that is not ALiBi: "
                 "a bias, not a mask",
    "mask_dense": "a dense mask that is not exactly full, causal, a sliding window or a band",
    "mask_dtype": "an additive mask whose dtype differs from the scores': SDPA can't take it as attn_mask",
})


def spec_of_visibility(visible: torch.Tensor) -> MaskSpec | None:
    """``visible[..., Sq, Skv]`` (True = may attend) -> the exact static MaskSpec, or None."""
    visible = visible.to(torch.bool)
    if visible.dim() < 2:
        return None
    sq, skv = visible.shape[-2:]
    flat = visible.reshape(-1, sq, skv)
    if not bool((flat == flat[:1]).all()):
        return None  # batch / head slices differ: not one static spec
    v = flat[0]
    if bool(v.all()):
        return MaskSpec.full()
    if sq != skv or not bool(v.any()):
        return None
    pos = torch.arange(sq)
    offset = pos.unsqueeze(0) - pos.unsqueeze(1)          # j - i
    right = int(offset[v].max())                           # farthest visible key ahead of the query
    left = int((-offset)[v].max())                         # farthest visible key behind the query
    if right < 0 or left < 0:
        return None
    terms = []
    if right == 0:
        terms.append(Causal())
    left_bound = None if left >= sq - 1 else left
    right_bound = None if (right == 0 or right >= sq - 1) else right
    if left_bound is not None or right_bound is not None:
        terms.append(SlidingWindow(left_bound, right_bound))
    spec = MaskSpec(tuple(terms))
    return spec if bool((spec.visible(pos, pos) == v).all()) else None


def _alibi(bias: torch.Tensor, visible: torch.Tensor, heads: int | None) -> Alibi | None:
    """``bias[..., H or 1, S, S]`` on the ``visible`` entries == ``slope_h * (j - i) + c_{h,i}`` -> Alibi."""
    if bias.dim() == 2:
        bias, visible = bias[None], visible[None]
    if bias.shape[-1] != bias.shape[-2]:
        return None
    s = bias.shape[-1]
    b = bias.to(torch.float64).reshape(-1, *bias.shape[-3:])
    if not bool((b == b[:1]).all()):
        return None  # differs over the batch
    b = b[0]
    vis = visible.reshape(-1, *visible.shape[-2:])[0]
    offset = (torch.arange(s).unsqueeze(0) - torch.arange(s).unsqueeze(1)).to(torch.float64)
    row = int(vis.sum(-1).argmax())                        # the row with the widest span fits the slope best
    cols = vis[row].nonzero().flatten()
    if cols.numel() < 2:
        return None
    lo, hi = int(cols.min()), int(cols.max())
    slopes = []
    for h in range(b.shape[0]):
        slope = float((b[h, row, hi] - b[h, row, lo]) / (hi - lo))
        residual = torch.where(vis, b[h] - slope * offset, torch.nan)
        row_const = residual.nanmean(-1, keepdim=True)     # softmax ignores a per-row constant
        scale = 1.0 + float(b[h][vis].abs().max())
        if not bool(((residual - row_const).abs()[vis] <= 1e-5 * scale).all()):
            return None
        slopes.append(slope)
    if not any(slopes):
        return None
    if len(slopes) == 1 and heads:
        slopes = slopes * heads                           # one bias broadcast over every head
    elif heads and len(slopes) != heads:
        return None
    return Alibi(tuple(slopes))


def spec_of_value(mask, style: str, *, heads: int | None = None) -> tuple[MaskSpec | None, Refusal | None]:
    """The evaluated ``mask`` read in ``style`` -> (exact MaskSpec, None) or (None, refusal)."""
    if not isinstance(mask, torch.Tensor):
        return None, Refusal(CODES.mask_not_tensor, "mask is not a tensor")
    alibi = None
    if mask.is_floating_point() and style in ("visible", "additive"):
        masked = mask <= torch.finfo(mask.dtype).min / 2   # -inf included
        visible = ~masked
        kept = mask[visible]
        if not bool(torch.isfinite(kept).all()):
            return None, Refusal(CODES.mask_bias, "additive mask with non-finite visible entries")
        if bool((kept != 0).any()):
            ok_range = bool((kept > torch.finfo(mask.dtype).min / 2).all())
            alibi = _alibi(mask, visible, heads) if ok_range else None
            if alibi is None:
                return None, Refusal(CODES.mask_bias, "additive mask with values other than 0 and <= finfo.min/2, "
                                                      "not linear in j - i per head (a bias, not a mask)")
    elif mask.dtype == torch.bool and style == "visible":
        visible = mask
    elif mask.dtype == torch.bool and style == "filled":
        visible = ~mask
    else:
        return None, Refusal(CODES.mask_bias, f"a {mask.dtype} mask read as {style}: a bias, not a mask")
    spec = spec_of_visibility(visible)
    if spec is None:
        return None, Refusal(CODES.mask_dense, "dense mask that is not exactly full, causal, "
                                               "a sliding window or a band")
    return (spec & alibi if alibi is not None else spec), None


def classify_mask(gm, mask_node, style: str, consumer, *, heads: int | None = None
                  ) -> tuple[MaskSpec | None, Refusal | None]:
    """The mask ``consumer`` reads -> (exact MaskSpec, None) or (None, refusal with its code)."""
    try:
        mask = evaluate_constant(gm, mask_node, at=consumer)
    except NotConstant as why:
        return None, Refusal(CODES.mask_runtime, f"mask depends on runtime values ({why})")
    return spec_of_value(mask, style, heads=heads)
