"""Pass ``detect_attention`` (stage dynamo, mesh only): find attention, put it in one normal form (an SDPA node
with ``is_causal`` and no mask), and record one :class:`burstc.attention_ir.AttentionMatch` per attention in
``context.facts.attention`` (consumed by ``shard``).

On one device attention is left to Inductor.

- SDPA calls: a mask that depends only on constants and module buffers (HF's mask built from
  ``arange`` comparisons when no attention_mask is passed, a ``tril`` buffer) is evaluated at
  compile time and classified: *causal* (exactly lower-triangular) becomes ``is_causal=True``, *full*
  (all visible) becomes no mask.  A mask that depends on the inputs, or any other pattern, is left
  in place, and its match carries the refusal (code and reason); the shard pass then refuses the graph.
- The manual pattern ``softmax(q @ k^T * s [+ mask | .masked_fill(mask, -inf)]) @ v`` (nanoGPT's
  fallback) is replaced by the equivalent SDPA node.

Before::

    att = (q @ k.transpose(-2, -1)) * 0.125
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    y = F.softmax(att, dim=-1) @ v

After::

    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125)
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from burstc.attention_ir import AttentionMatch, MaskSpec
from burstc.passes.graph_utils import (NotConstant, ancestors, const_number, eliminate_dead_code, evaluate_constant,
                                       fake_mode_of, is_function, is_method, set_meta, val)
from burstc.refusals import Refusal, register_codes

KIND = "attention"
CODES = register_codes("attention", {
    "mask_runtime": "the mask depends on runtime values (inputs), not only on constants and buffers",
    "mask_not_tensor": "the mask is not a tensor",
    "mask_bias": "an additive mask with values other than 0 / -inf: a bias, not a mask",
    "mask_dense": "a dense mask that is neither causal nor full",
})
SDPA = F.scaled_dot_product_attention
_SOFTMAX = (torch.softmax, F.softmax)
_MATMUL = (operator.matmul, torch.matmul)


def sdpa_kwargs(node: fx.Node) -> dict:
    normalized = normalize_function(SDPA, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    kwargs = dict(normalized.kwargs)
    kwargs.setdefault("attn_mask", None)
    kwargs.setdefault("dropout_p", 0.0)
    kwargs.setdefault("is_causal", False)
    kwargs.setdefault("scale", None)
    kwargs.setdefault("enable_gqa", False)
    return kwargs


def classify_visibility(visible: torch.Tensor) -> str:
    """``visible[..., Sq, Skv]`` (True = may attend) -> ``"causal"``, ``"full"`` or ``"other"``."""
    visible = visible.to(torch.bool)
    sq, skv = visible.shape[-2:]
    if bool(visible.all()):
        return "full"
    if sq == skv:
        causal = torch.ones(sq, skv, dtype=torch.bool, device=visible.device).tril()
        if bool((visible == causal).all()):
            return "causal"
    return "other"


def _visible_from_sdpa_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > float("-inf")


def classify_mask(gm, mask_node, to_visible, consumer) -> tuple[str, Refusal | None]:
    """-> (kind, refusal): kind in causal/full/other/unknown, for the mask as ``consumer`` reads it; the
    refusal (code and reason) is ``None`` for causal and full."""
    try:
        mask = evaluate_constant(gm, mask_node, at=consumer)
    except NotConstant as why:
        return "unknown", Refusal(CODES.mask_runtime, f"mask depends on runtime values ({why})")
    if not isinstance(mask, torch.Tensor):
        return "unknown", Refusal(CODES.mask_not_tensor, "mask is not a tensor")
    if mask.is_floating_point():
        finite = mask[mask > float("-inf")]
        if finite.numel() and bool((finite != 0).any()):
            return "other", Refusal(CODES.mask_bias,
                                    "additive mask with values other than 0 / -inf (a bias, not a mask)")
    kind = classify_visibility(to_visible(mask))
    return kind, None if kind != "other" else Refusal(CODES.mask_dense, "dense mask that is neither causal nor full")


_LAYOUT_METHODS = ("transpose", "contiguous", "permute")


def _unrepeated_kv(node: fx.Node):
    """If ``node`` is ``repeat_kv(x)`` (``x[..., None, ...].expand(...).reshape(...)``, as HF and
    torchtitan write it) followed only by transposes/contiguous, return (x, layout_chain, n_rep):
    replaying the chain on x gives the same tensor with the kv heads not repeated."""
    chain = []
    while is_method(node, *_LAYOUT_METHODS):
        chain.append(node)
        node = node.args[0]
    if not is_method(node, "reshape", "view") or not is_method(node.args[0], "expand"):
        return None
    expand = node.args[0]
    inserted = expand.args[0]
    if not (is_function(inserted, operator.getitem) or is_method(inserted, "unsqueeze")):
        return None
    x = inserted.args[0]
    vx, vi, ve, vr = val(x), val(inserted), val(expand), val(node)
    if any(v is None for v in (vx, vi, ve, vr)) or vi.dim() != vx.dim() + 1:
        return None
    # the inserted size-1 dim j, expanded to n_rep, merged with dim j-1 (the kv-head dim)
    js = [j for j in range(1, vi.dim()) if vi.shape[j] == 1
          and list(vi.shape[:j]) + list(vi.shape[j + 1:]) == list(vx.shape)]
    for j in js:
        n_rep = ve.shape[j]
        merged = list(vx.shape)
        merged[j - 1] *= n_rep
        if list(ve.shape[:j]) + list(ve.shape[j + 1:]) == list(vx.shape) and list(vr.shape) == merged:
            return x, list(reversed(chain)), n_rep
    return None


def _call_method(name):
    return lambda t, *args, **kwargs: getattr(t, name)(*args, **kwargs)


def _replay(graph, x, chain, before, fake_mode):
    """Apply the layout ops of ``chain`` (in order) to ``x``, inserting the new nodes before ``before``."""
    for op in chain:
        args = (x,) + tuple(op.args[1:])
        with graph.inserting_before(before):
            x_next = graph.call_method(op.target, args, dict(op.kwargs))
        set_meta(x_next, _call_method(op.target), args, dict(op.kwargs), fake_mode)
        x = x_next
    return x


def _undo_repeat_kv(gm, node, fake_mode) -> bool:
    """SDPA on repeated K/V heads -> SDPA(enable_gqa=True) on the kv heads, so that a ring sends
    Hkv heads, not Hq."""
    kwargs = sdpa_kwargs(node)
    found_k, found_v = _unrepeated_kv(kwargs["key"]), _unrepeated_kv(kwargs["value"])
    if found_k is None or found_v is None or found_k[2] != found_v[2] or found_k[2] == 1:
        return False
    k_x, k_chain, _ = found_k
    v_x, v_chain, _ = found_v
    new_k = _replay(gm.graph, k_x, k_chain, node, fake_mode)
    new_v = _replay(gm.graph, v_x, v_chain, node, fake_mode)
    if val(new_k) is None or val(new_k).dim() != 4:
        return False
    kwargs.update(key=new_k, value=new_v, enable_gqa=True)
    node.args = (kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value"))
    node.kwargs = kwargs
    return True


def _canonicalize_sdpa(gm, node) -> tuple[str, Refusal | None]:
    """Fold a constant causal/full mask into ``is_causal`` -> (how the mask was found, refusal or None)."""
    kwargs = sdpa_kwargs(node)
    mask = kwargs["attn_mask"]
    if mask is None or kwargs["is_causal"]:  # SDPA itself rejects mask + is_causal
        return "", None
    if isinstance(mask, fx.Node) and val(mask) is not None and val(mask).dtype not in (torch.bool,) \
            and not val(mask).is_floating_point():
        return "", None  # an integer mask SDPA would reject: left for eager to raise
    kind, refusal = classify_mask(gm, mask, _visible_from_sdpa_mask, node)
    if refusal is not None:
        return "", refusal
    node.args = (kwargs["query"], kwargs["key"], kwargs["value"])
    node.kwargs = {"attn_mask": None, "dropout_p": kwargs["dropout_p"], "is_causal": kind == "causal",
                   "scale": kwargs["scale"], "enable_gqa": kwargs["enable_gqa"]}
    return "constant mask folded at compile time", None


def _match_of(node: fx.Node, origin: str, refusal: Refusal | None, notes: tuple[str, ...], source: str
              ) -> AttentionMatch:
    """The attention record of SDPA ``node`` (in normal form unless ``refusal``)."""
    kwargs = sdpa_kwargs(node)
    q, k = kwargs["query"], kwargs["key"]
    q_val, k_val = val(q), val(k)
    mask = MaskSpec.causal() if kwargs["is_causal"] else MaskSpec.full()
    if kwargs["attn_mask"] is not None and refusal is None:
        refusal = Refusal(CODES.mask_dense, "an attention mask")  # one this pass did not classify
    return AttentionMatch(
        node=node, query=q, key=k, value=kwargs["value"], mask=mask, scale=kwargs["scale"],
        heads_q=q_val.shape[1] if q_val is not None and q_val.dim() == 4 else None,
        kv_heads=k_val.shape[1] if k_val is not None and k_val.dim() == 4 else None,
        source=source, mask_origin=origin, notes=notes, refusal=refusal)


def _transposed_key(node):
    """``k.transpose(-2, -1)`` / ``k.transpose(2, 3)`` / ``k.mT`` -> k (for 4-D k), else None."""
    if is_method(node, "transpose") and len(node.args) == 3:
        ndim = val(node.args[0]).dim() if val(node.args[0]) is not None else None
        dims = {d % ndim for d in node.args[1:]} if ndim else set()
        if ndim and dims == {ndim - 2, ndim - 1}:
            return node.args[0]
    if is_function(node, getattr, ) and node.args[1] == "mT":
        return node.args[0]
    return None


def _match_manual(gm, out_node):
    """``out_node = softmax(...) @ v`` -> dict(q, k, v, scale, mask_node, mask_kind, nodes) or None."""
    if not (is_function(out_node, *_MATMUL) and len(out_node.args) == 2):
        return None
    probs, v = out_node.args
    while is_method(probs, "to", "type_as", "float") or (is_function(probs, F.dropout) and not _dropout_active(probs)):
        probs = probs.args[0]
    if is_function(probs, *_SOFTMAX):
        scores, dim = probs.args[0], probs.kwargs.get("dim", probs.args[1] if len(probs.args) > 1 else None)
    elif is_method(probs, "softmax"):
        scores, dim = probs.args[0], probs.kwargs.get("dim", probs.args[1] if len(probs.args) > 1 else None)
    else:
        return None
    if dim not in (-1, 3) or len(probs.users) != 1:
        return None
    scale, mask = 1.0, None
    node = scores
    while True:
        if is_function(node, operator.mul) and const_number(node.args[1]) is not None:
            scale *= node.args[1]
            node = node.args[0]
        elif is_function(node, operator.mul) and const_number(node.args[0]) is not None:
            scale *= node.args[0]
            node = node.args[1]
        elif is_function(node, operator.truediv) and const_number(node.args[1]) is not None:
            scale /= node.args[1]
            node = node.args[0]
        elif is_method(node, "masked_fill") and mask is None and node.args[2] == float("-inf"):
            mask = ("masked_fill", node.args[1])
            node = node.args[0]
        elif is_function(node, operator.add) and mask is None and isinstance(node.args[1], fx.Node):
            mask = ("additive", node.args[1])
            node = node.args[0]
        else:
            break
    if not (is_function(node, *_MATMUL) and len(node.args) == 2):
        return None
    q, kt = node.args
    k = _transposed_key(kt)
    if k is None or any(val(t) is None or val(t).dim() != 4 for t in (q, k, v)):
        return None
    return dict(q=q, k=k, v=v, scale=scale, mask=mask, softmax=probs)


def _manual_mask(gm, out_node, match):
    """-> (reader, mask_node, to_visible) for a matched manual attention with a mask."""
    style, mask_node = match["mask"]
    to_visible = _visible_from_filled if style == "masked_fill" else _visible_from_sdpa_mask
    on_path = set(ancestors(out_node))
    reader = next((n for n in gm.graph.nodes if n in mask_node.users and n in on_path), out_node)
    return reader, mask_node, to_visible


def _visible_from_filled(mask: torch.Tensor) -> torch.Tensor:
    return ~mask.to(torch.bool)


def attention_masks(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, Callable]]:
    """``(reader, mask_node, to_visible)`` for every mask an attention reads: SDPA's ``attn_mask``
    and the manual pattern's additive or ``masked_fill`` mask.  ``to_visible(value)`` maps the
    mask's value to a bool tensor, True where a query may attend to a key."""
    found = []
    for node in gm.graph.nodes:
        if is_function(node, SDPA):
            kwargs = sdpa_kwargs(node)
            if isinstance(kwargs["attn_mask"], fx.Node) and not kwargs["is_causal"]:
                found.append((node, kwargs["attn_mask"], _visible_from_sdpa_mask))
            continue
        match = _match_manual(gm, node)
        if match is not None and match["mask"] is not None:
            found.append(_manual_mask(gm, node, match))
    return found


def _dropout_active(node):
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return bool(training) and p > 0


def detect_attention(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    fake_mode = fake_mode_of(gm)
    folded = manual = unrepeated = 0
    for node in list(gm.graph.nodes):
        if is_function(node, SDPA):
            origin, refusal = _canonicalize_sdpa(gm, node)
            notes = ()
            if _undo_repeat_kv(gm, node, fake_mode):
                notes = ("repeat_kv undone: kv heads travel unrepeated",)
                unrepeated += 1
            match = _match_of(node, origin, refusal, notes, "sdpa")
            context.facts.attention[node] = match
            if origin or notes:
                folded += bool(origin)
                context.rewrite("attention_normal_form", node, {"mask": match.mask_description,
                                                                 "notes": ", ".join(notes) or None})
            continue
        found = _match_manual(gm, node)
        if found is None:
            continue
        is_causal = False
        if found["mask"] is not None:
            reader, mask_node, to_visible = _manual_mask(gm, node, found)
            kind, refusal = classify_mask(gm, mask_node, to_visible, reader)
            if refusal is not None:
                context.skip(KIND, node, f"manual attention with a {refusal.reason}", code=refusal.code)
                continue
            is_causal = kind == "causal"
        with gm.graph.inserting_before(node):
            kwargs = {"is_causal": is_causal, "scale": float(found["scale"])}
            args = (found["q"], found["k"], found["v"])
            sdpa = gm.graph.call_function(SDPA, args, kwargs)
            set_meta(sdpa, SDPA, args, kwargs, fake_mode)
        sdpa.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        node.replace_all_uses_with(sdpa)
        gm.graph.erase_node(node)
        match = _match_of(sdpa, "manual softmax attention canonicalized", None, (), "manual")
        context.facts.attention[sdpa] = match
        context.rewrite("attention_normal_form", sdpa, {"mask": match.mask_description, "source": "manual"})
        manual += 1
    if folded or manual or unrepeated:
        context.note = (f"{folded} constant mask(s) folded into is_causal / no mask, "
                        f"{manual} manual attention(s) canonicalized to SDPA, "
                        f"{unrepeated} repeat_kv undone (enable_gqa); the shard pass rewrites them")
    elif context.facts.attention:
        context.note = f"{len(context.facts.attention)} attention(s) already in normal form"
    eliminate_dead_code(gm.graph)
    return gm
