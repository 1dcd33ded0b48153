"""Pass ``detect_attention`` (stage dynamo, mesh only): find attention, put it in one normal form (an SDPA node
with ``is_causal`` and no mask), and record one :class:`burstc.attention_ir.AttentionMatch` per attention in
``context.facts.attention`` (consumed by ``shard``).

On one device attention is left to Inductor.

- SDPA calls: a mask that depends only on constants and module buffers (HF's mask built from
  ``arange`` comparisons when no attention_mask is passed, a ``tril`` buffer) is evaluated at
  compile time and turned into its exact :class:`MaskSpec` by ``passes/mask_classification.py``
  (full, causal, ``Causal & SlidingWindow(w)``, a band ``SlidingWindow(l, r)``, ALiBi; bool masks and
  additive float masks of 0 and ``-inf`` / ``finfo.min``).  Full and causal are folded into
  ``is_causal`` / no mask; any other spec keeps its ``attn_mask`` on the node (so the node stays exact
  when the shard pass refuses) and the match carries the spec.  A mask that depends on the inputs, or
  anything else (a chunked mask, a bias), is left in place and its match carries the refusal (code and
  reason); the shard pass then refuses the graph.
- The manual pattern ``softmax(q @ k^T * s [+ mask | .masked_fill(mask, -inf or finfo.min)]) @ v``
  (nanoGPT's fallback, HF's ``eager_attention_forward`` with its fp32 softmax, inactive dropout and
  ``repeat_kv``) is replaced by the equivalent SDPA node (``attn_mask`` = the mask for a window or ALiBi).
- FlexAttention (``flex_attention`` with a block mask): its ``mask_mod`` is evaluated into a MaskSpec
  (``passes/flex_masks.py``: causal, windows, document ids from an input); the call is left as written and
  its match, keyed by the output, is replaced whole by the ring op in the shard pass.
- Gemma-2's soft-capped scores (``c * tanh(s / c)``) have no SDPA normal form: the manual attention is
  left as written (no graph ever loses the cap) and its match, keyed by ``probs @ v``, carries the mask
  with the :class:`SoftCap`; the shard pass replaces the whole manual attention by the ring op
  (:func:`manual_interior` lists the nodes that then die).

Matches are keyed by their SDPA node (by the manual ``probs @ v`` node when left as written).

Before::

    att = (q @ k.transpose(-2, -1)) * 0.125
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    y = F.softmax(att, dim=-1) @ v

After::

    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125)
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from burstc.attention_ir import Alibi, AttentionMatch, KeyPadding, MaskSpec, SoftCap
from burstc.passes.graph_utils import (ancestors, const_number, dtype_name, eliminate_dead_code, fake_mode_of,
                                       in_place_writes, is_function, is_method, set_meta, val)
from burstc.passes.flex_masks import flex_call, flex_match, is_flex_attention
from burstc.passes.mask_classification import CODES, classify_mask, hidden_fill  # noqa: F401  (CODES: attention.*)
from burstc.refusals import Refusal

KIND = "attention"
SDPA = F.scaled_dot_product_attention
_SOFTMAX = (torch.softmax, F.softmax)
_MATMUL = (operator.matmul, torch.matmul)
_TANH = (torch.tanh, F.tanh)


def sdpa_kwargs(node: fx.Node) -> dict:
    normalized = normalize_function(SDPA, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    kwargs = dict(normalized.kwargs)
    kwargs.setdefault("attn_mask", None)
    kwargs.setdefault("dropout_p", 0.0)
    kwargs.setdefault("is_causal", False)
    kwargs.setdefault("scale", None)
    kwargs.setdefault("enable_gqa", False)
    return kwargs


@dataclass(frozen=True)
class AttentionCall:
    """The operands of one attention as the graph holds them now: an SDPA node's arguments, or a manual
    attention's (from its match); ``attn_mask`` is the mask an SDPA node keeps (None for manual ones)."""

    query: fx.Node
    key: fx.Node
    value: fx.Node
    scale: float | None
    dropout_p: float
    attn_mask: fx.Node | None


def attention_call(node: fx.Node, match: AttentionMatch | None) -> AttentionCall:
    if is_function(node, SDPA):
        kw = sdpa_kwargs(node)
        return AttentionCall(kw["query"], kw["key"], kw["value"], kw["scale"], kw["dropout_p"], kw["attn_mask"])
    if match is None:
        raise ValueError(f"`{node.name}` is neither an SDPA call nor a recorded manual attention")
    return AttentionCall(match.query, match.key, match.value, match.scale, 0.0, None)


def manual_interior(match: AttentionMatch) -> set[fx.Node] | None:
    """The nodes of a manual attention left as written (scores, soft-cap, mask add, softmax, casts) strictly
    between its q/k/v and its output ``probs @ v``: what replacing the output by one op makes dead.  None
    when one of them is used outside the attention (e.g. the probabilities returned): then it can't be replaced."""
    output = match.node
    upstream = set(ancestors(output))
    interior, stack = set(), [match.query, match.key, match.value]
    while stack:
        for user in stack.pop().users:
            if user is not output and user in upstream and user not in interior:
                interior.add(user)
                stack.append(user)
    interior -= {match.query, match.key, match.value}
    if any(u not in interior and u is not output for n in interior for u in n.users):
        return None
    return interior


def _heads(node) -> int | None:
    v = val(node)
    return v.shape[1] if v is not None and v.dim() == 4 else None


_LAYOUT_METHODS = ("transpose", "contiguous", "permute")
# between repeat_kv and the attention: layout ops, and the dtype cast autocast's inputs get (_cast_in_graph)
_HEAD_PRESERVING_METHODS = _LAYOUT_METHODS + ("to",)


def _unrepeated_kv(node: fx.Node):
    """If ``node`` is ``repeat_kv(x)`` (``x[..., None, ...].expand(...).reshape(...)``, as HF and
    torchtitan write it) followed only by transposes/contiguous/dtype casts, return (x, layout_chain, n_rep):
    replaying the chain on x gives the same tensor with the kv heads not repeated."""
    chain = []
    while is_method(node, *_HEAD_PRESERVING_METHODS):
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


def _cast_in_graph(gm, tensors, dtype, fake_mode) -> list:
    """Float ``tensors`` cast to ``dtype`` where they differ (each cast right after its tensor).  Under
    ``torch.autocast`` a matmul (and SDPA) casts its fp32 inputs to the autocast dtype; written out here, the
    attention's q, k, v (and a float mask) are what its kernel computes on, so that the ring op runs in bf16 as
    eager does and sends bf16 rows."""
    cast = []
    for t in tensors:  # float tensors only: a bool mask keeps its meaning (cast, it would become a 0/1 bias)
        if isinstance(t, fx.Node) and val(t) is not None and val(t).is_floating_point() and val(t).dtype != dtype:
            with gm.graph.inserting_after(t):
                t_cast = gm.graph.call_method("to", (t, dtype))
            set_meta(t_cast, _call_method("to"), (t, dtype), {}, fake_mode)
            t = t_cast
        cast.append(t)
    return cast


def _autocast_dtype(node: fx.Node, inputs) -> torch.dtype | None:
    """The autocast dtype an attention ran in: its output's low-precision float dtype where some of its
    float ``inputs`` are fp32 (only autocast mixes them in a matmul or SDPA) -> None otherwise (a bool mask
    among the inputs is no evidence either way)."""
    out = val(node)
    floats = [val(t) for t in inputs if isinstance(t, fx.Node) and val(t) is not None and val(t).is_floating_point()]
    dtypes = {t.dtype for t in floats}
    if out is None or out.dtype not in (torch.bfloat16, torch.float16) or not dtypes - {out.dtype}:
        return None
    return out.dtype if dtypes <= {out.dtype, torch.float32} else None


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


_FOLDED = "constant mask folded at compile time"


def _canonicalize_sdpa(gm, node, memo: dict) -> tuple[str, MaskSpec | None, Refusal | None]:
    """Classify SDPA's constant mask -> (how it was found, its exact MaskSpec, refusal).  Full and causal
    are folded into ``is_causal`` / no mask; any other static spec (a window, a band, ALiBi) keeps its
    ``attn_mask`` so that the node stays exact however the shard pass decides."""
    kwargs = sdpa_kwargs(node)
    mask = kwargs["attn_mask"]
    if mask is None or kwargs["is_causal"]:  # SDPA itself rejects mask + is_causal
        return "", None, None
    if isinstance(mask, fx.Node) and val(mask) is not None and val(mask).dtype not in (torch.bool,) \
            and not val(mask).is_floating_point():
        return "", None, None  # an integer mask SDPA would reject: left for eager to raise
    spec, refusal = classify_mask(gm, mask, "visible", node, heads=_heads(kwargs["query"]), memo=memo)
    if refusal is not None:
        return "", None, refusal
    if not (spec.is_full or spec.is_causal):
        origin = "built from the inputs, runtime data for the op" if spec.runtime_sources else \
            "constant mask recognized, kept as attn_mask"
        return origin, spec, None
    node.args = (kwargs["query"], kwargs["key"], kwargs["value"])
    node.kwargs = {"attn_mask": None, "dropout_p": kwargs["dropout_p"], "is_causal": spec.is_causal,
                   "scale": kwargs["scale"], "enable_gqa": kwargs["enable_gqa"]}
    return _FOLDED, spec, None


def _match_of(node: fx.Node, origin: str, refusal: Refusal | None, notes: tuple[str, ...], source: str,
              spec: MaskSpec | None = None) -> AttentionMatch:
    """The attention record of SDPA ``node``: ``spec`` is its exact mask when detection classified one
    (then an ``attn_mask`` left on the node computes exactly that spec)."""
    kwargs = sdpa_kwargs(node)
    q, k = kwargs["query"], kwargs["key"]
    if spec is None:
        spec = MaskSpec.causal() if kwargs["is_causal"] else MaskSpec.full()
        if kwargs["attn_mask"] is not None and refusal is None:
            refusal = Refusal(CODES.mask_dense, "an attention mask")  # one this pass did not classify
    return AttentionMatch(
        node=node, query=q, key=k, value=kwargs["value"], mask=spec, scale=kwargs["scale"],
        heads_q=_heads(q), kv_heads=_heads(k), source=source, mask_origin=origin, notes=notes, refusal=refusal)


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


def _softcap_of(node):
    """``(x / c).tanh() * c`` (Gemma-2) -> (x, c), else None."""
    for c, t in ((node.args[1], node.args[0]), (node.args[0], node.args[1])) if is_function(node, operator.mul) else ():
        if const_number(c) is None or not (is_function(t, *_TANH) or is_method(t, "tanh")):
            continue
        inner = t.args[0]
        if is_function(inner, operator.truediv) and inner.args[1] == c and c > 0 and len(t.users) == 1:
            return inner.args[0], float(c)
    return None


def _fill_value_masks(node) -> bool:
    """``masked_fill``'s value hides a score: ``-inf`` or ``<= finfo(scores).min / 2`` (HF's ``finfo.min``)."""
    value, scores = const_number(node.args[2]), val(node.args[0])
    if value is None or scores is None or not scores.is_floating_point():
        return False
    return value == float("-inf") or value <= torch.finfo(scores.dtype).min / 2


def _match_manual(gm, out_node):
    """``out_node = softmax(...) @ v`` -> dict(q, k, v, scale, mask, softcap, softmax) or None.

    Accepts HF's ``eager_attention_forward``: ``softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)`` and
    an inactive dropout.  For fp32 models that is exactly SDPA; for bf16/fp16 the eager scores are rounded
    to bf16 before the fp32 softmax and SDPA keeps them in fp32 inside the kernel: the same math, equal up to
    bf16 rounding (not bitwise), as for every SDPA backend."""
    if not (is_function(out_node, *_MATMUL) and len(out_node.args) == 2):
        return None
    probs, v = out_node.args
    while is_method(probs, "to", "type", "type_as", "float") or (is_function(probs, F.dropout) and not _dropout_active(probs)):
        probs = probs.args[0]
    sink_sliced = _drops_the_sink(probs)  # gpt-oss: softmax(cat([scores, sinks], -1))[..., :-1]
    if sink_sliced is not None:
        probs = sink_sliced
    if is_function(probs, *_SOFTMAX) or is_method(probs, "softmax"):
        scores, dim = probs.args[0], probs.kwargs.get("dim", probs.args[1] if len(probs.args) > 1 else None)
    else:
        return None
    sink = None
    if sink_sliced is not None:
        scores, sink = _sink_logits(scores)
        if sink is None:
            return None
    dtype = probs.kwargs.get("dtype", probs.args[2] if len(probs.args) > 2 else None)
    if dim not in (-1, 3) or len(probs.users) != 1 or dtype not in (None, torch.float32, torch.float64):
        return None  # a softmax in a narrower dtype than fp32 would not be what SDPA computes
    # masking_node: the node that applies the mask to the scores (its masked_fill, or the add of an additive one)
    scale, mask, softcap, fill, bias, masking_node = 1.0, None, None, None, None, None
    node = scores
    upcast = is_method(node, "to") and torch.float32 in (*node.args[1:], node.kwargs.get("dtype"))
    if upcast or is_method(node, "float"):
        node = node.args[0]  # MPT's softmax(scores.float()): the same upcast as dtype=torch.float32
    while True:
        capped = _softcap_of(node) if softcap is None else None
        if capped is not None:
            if scale != 1.0:
                return None  # a scale applied after the cap: not c * tanh(s / c) on the scaled scores
            node, softcap = capped
        elif is_function(node, operator.mul) and const_number(node.args[1]) is not None:
            scale *= node.args[1]
            node = node.args[0]
        elif is_function(node, operator.mul) and const_number(node.args[0]) is not None:
            scale *= node.args[0]
            node = node.args[1]
        elif is_function(node, operator.truediv) and const_number(node.args[1]) is not None:
            scale /= node.args[1]
            node = node.args[0]
        elif is_method(node, "masked_fill") and mask is None and softcap is None and _fill_value_masks(node):
            mask = ("filled", node.args[1])
            fill, masking_node = const_number(node.args[2]), node
            node = node.args[0]
            if scale != 1.0:
                return None  # scores scaled after the mask (a bias would be scaled too): not SDPA's order
        elif is_function(node, operator.add) and mask is None and softcap is None and isinstance(node.args[1], fx.Node):
            mask = ("additive", node.args[1])
            masking_node = node
            node = node.args[0]
            if scale != 1.0:
                return None
        elif is_function(node, operator.add) and mask is not None and bias is None and softcap is None \
                and isinstance(node.args[1], fx.Node):
            # MPT: (scores + alibi).masked_fill(hidden, finfo.min), a bias the fill then replaces where hidden;
            # or (scores + alibi) + mask, two additive terms: either way one additive mask (_with_bias_folded)
            bias = node.args[1]
            node = node.args[0]
            if scale != 1.0:
                return None
        else:
            break
    if not (is_function(node, *_MATMUL) and len(node.args) == 2):
        return None
    q, kt = node.args
    k = _transposed_key(kt)
    if k is None or any(val(t) is None or val(t).dim() != 4 for t in (q, k, v)):
        return None
    autocast = _autocast_dtype(out_node, (q, k, v))
    if autocast is not None and val(node).dtype != autocast:
        return None  # scores in another precision than autocast's matmul would give
    if autocast is None and len({val(t).dtype for t in (q, k, v, out_node)}) != 1:
        return None  # SDPA returns q's dtype: only when the manual attention does too
    if sink is not None and (softcap is not None or val(sink).shape != (1, val(q).shape[1], 1, 1)):
        return None
    return dict(q=q, k=k, v=v, scale=scale, mask=mask, softcap=softcap, softmax=probs, fill=fill, bias=bias,
                masking_node=masking_node, sink=sink, autocast=autocast, scores=node, key_transposed=kt)


def _drops_the_sink(node):
    """``probs[..., :-1]`` of a softmax (the sink's column dropped) -> the softmax node, else None."""
    if not is_function(node, operator.getitem) or not isinstance(node.args[0], fx.Node):
        return None
    index = node.args[1]
    if index == (Ellipsis, slice(None, -1, None)) and len(node.args[0].users) == 1:
        return node.args[0]
    return None


def _sink_logits(node):
    """``cat([scores, sinks.reshape(1, H, 1, 1).expand(B, -1, S, -1)], -1)``, maybe stabilized as ``x -
    x.max(-1, keepdim=True).values`` (a no-op under softmax) -> (scores, the [1, H, 1, 1] sinks), else (node, None)."""
    if is_function(node, operator.sub) and isinstance(node.args[1], fx.Node):
        top = node.args[1]
        if is_function(top, operator.getitem) and top.args[1] == 0 and (
                is_method(top.args[0], "max") or is_function(top.args[0], torch.max)) \
                and top.args[0].args[0] is node.args[0]:
            node = node.args[0]
        elif (is_method(top, "amax") or is_function(top, torch.amax)) and top.args[0] is node.args[0]:
            node = node.args[0]
    if not is_function(node, torch.cat) or len(node.args[0]) != 2:
        return node, None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    scores, sinks = node.args[0]
    if dim not in (-1, 3) or len(node.users) > 2:
        return node, None
    while is_method(sinks, "expand", "to", "type") or is_function(sinks, torch.broadcast_to):
        sinks = sinks.args[0]
    if val(sinks) is None or val(sinks).dim() != 4 or tuple(val(sinks).shape)[::2] != (1, 1) \
            or val(sinks).shape[3] != 1:
        return node, None
    return scores, sinks


def _manual_mask(gm, out_node, match):
    """-> (reader, mask_node, style) for a matched manual attention with a mask."""
    style, mask_node = match["mask"]
    on_path = set(ancestors(out_node))
    reader = next((n for n in gm.graph.nodes if n in mask_node.users and n in on_path), out_node)
    return reader, mask_node, style


def attention_masks(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, str]]:
    """``(reader, mask_node, style)`` for every mask an attention reads: SDPA's ``attn_mask``
    (``"visible"``) and the manual pattern's ``"additive"`` or ``"filled"`` (masked_fill) mask;
    ``mask_classification.classify_mask`` reads the mask in that style."""
    found = []
    for node in gm.graph.nodes:
        if is_function(node, SDPA):
            kwargs = sdpa_kwargs(node)
            if isinstance(kwargs["attn_mask"], fx.Node) and not kwargs["is_causal"]:
                found.append((node, kwargs["attn_mask"], "visible"))
            continue
        match = _match_manual(gm, node)
        if match is not None and match["mask"] is not None:
            found.append(_manual_mask(gm, node, match))
    return found


def _dropout_active(node):
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return bool(training) and p > 0


def _written_between(gm, mask_node, start, end) -> bool:
    """Is ``mask_node`` (or an alias) written in place between nodes ``start`` and ``end``?"""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    return any(position[start] <= position[op] < position[end] and mask_node in aliases
               for op, aliases in in_place_writes(gm.graph))


def _manual_sdpa_mask(gm, node, found, spec, fake_mode):
    """-> (SDPA keyword arguments computing ``spec`` exactly, refusal or None) for a manual attention."""
    if spec.is_full or spec.is_causal:
        return {"is_causal": spec.is_causal}, None
    reader, mask_node, style = _manual_mask(gm, node, found)
    if _written_between(gm, mask_node, reader, node):
        return None, Refusal(CODES.mask_dense, "the mask is written in place between its use and the attention")
    if style == "additive":  # SDPA adds a float attn_mask to the scaled scores, as the manual graph did
        q_dtype = val(found["q"]).dtype
        if val(mask_node).is_floating_point() and val(mask_node).dtype != q_dtype:
            # a model in fp32 run under autocast builds its mask in fp32, added to bf16 scores (in fp32, by type
            # promotion); SDPA takes a float mask in q's dtype (under autocast SDPA casts it so itself): the
            # visible entries' 0 is exact, a bias rounds as the scores did; fp32's finfo.min becomes bf16's
            # -inf, harmless here: every spec this path takes (no KeyPadding) shows each query its own key
            mask_node, = _cast_in_graph(gm, [mask_node], q_dtype, fake_mode)
        if val(mask_node).dtype != q_dtype:
            return None, Refusal(CODES.mask_dtype, f"the additive mask is {val(mask_node).dtype}, "
                                                   f"the scores {val(found['q']).dtype}")
        return {"attn_mask": mask_node}, None
    with gm.graph.inserting_before(node):  # masked_fill hides True: SDPA's bool mask shows True
        shown = gm.graph.call_function(torch.logical_not, (mask_node,))
    set_meta(shown, torch.logical_not, (mask_node,), {}, fake_mode)
    return {"attn_mask": shown}, None


def _manual_match(node, found, spec, refusal) -> AttentionMatch:
    """The record of a manual attention left as written (``node`` is its ``probs @ v``)."""
    q, k = found["q"], found["k"]
    return AttentionMatch(node=node, query=q, key=k, value=found["v"], mask=spec or MaskSpec.full(),
                          scale=float(found["scale"]), heads_q=_heads(q), kv_heads=_heads(k), source="manual",
                          mask_origin="manual softmax attention left as written", refusal=refusal)


def _with_bias_folded(gm, node, found, fake_mode) -> dict:
    """``(scores + bias).masked_fill(hidden, fill)`` -> the same attention with one additive mask,
    ``where(hidden, fill, bias)`` (a graph node before this attention's masked_fill), which the hidden entries
    replace: ``replaced`` stays True (no gradient reaches the scores there).  ``(scores + bias) + mask`` -> one
    additive mask ``bias + mask`` (before the second add): where the mask is 0 the same sum, where it hides
    (``-inf`` / ``finfo.min``) a value that absorbs the scores either way."""
    if found["mask"][0] == "additive":
        args = (found["bias"], found["mask"][1])
        with gm.graph.inserting_before(found["masking_node"]):
            combined = gm.graph.call_function(operator.add, args)
        set_meta(combined, operator.add, args, {}, fake_mode)
        return {**found, "mask": ("additive", combined), "bias": None}
    args = (found["mask"][1], float(found["fill"]), found["bias"])
    with gm.graph.inserting_before(found["masking_node"]):
        combined = gm.graph.call_function(torch.where, args)
    set_meta(combined, torch.where, args, {}, fake_mode)
    return {**found, "mask": ("additive", combined), "bias": None, "replaced": True}


def _cast_manual_inputs(gm, node, found, fake_mode) -> dict:
    """A manual attention whose matmuls ran under ``torch.autocast``: its q, k, v cast to autocast's dtype in
    the graph, read by its two matmuls (which autocast would have cast them for: the same values), so that the
    attention as written and any op replacing it (SDPA, the ring) start from the same low-precision q, k, v."""
    q, k, v = found["q"], found["k"], found["v"]
    q_cast, k_cast, v_cast = _cast_in_graph(gm, [q, k, v], found["autocast"], fake_mode)
    scores, key_transposed = found["scores"], found["key_transposed"]
    scores.replace_input_with(q, q_cast)
    key_transposed.replace_input_with(k, k_cast)
    node.replace_input_with(v, v_cast)
    fn = _call_method(key_transposed.target) if key_transposed.op == "call_method" else key_transposed.target
    set_meta(key_transposed, fn, key_transposed.args, dict(key_transposed.kwargs), fake_mode)
    return {**found, "q": q_cast, "k": k_cast, "v": v_cast}


def _detect_manual(gm, node, found, context, fake_mode, memo: dict) -> AttentionMatch | None:
    """Record the manual attention ``node``; when exact, canonicalize it to SDPA -> the SDPA's match or None."""
    spec, fill = MaskSpec.full(), None
    if found["autocast"] is not None:
        found = _cast_manual_inputs(gm, node, found, fake_mode)
    if found["bias"] is not None:
        found = _with_bias_folded(gm, node, found, fake_mode)
    if found["mask"] is not None:
        reader, mask_node, style = _manual_mask(gm, node, found)
        spec, refusal = classify_mask(gm, mask_node, style, reader, heads=_heads(found["q"]), memo=memo)
        if refusal is None and found["softcap"] is not None and any(isinstance(m, Alibi) for m in spec.score_mods):
            # the model adds the bias to the capped scores; MaskSpec applies ALiBi before the cap (found by the
            # fuzzer: c*tanh((s + b)/c) != c*tanh(s/c) + b)
            refusal = Refusal(CODES.mask_bias, "an ALiBi bias added after a soft-cap (burstc applies ALiBi to the "
                                               "scores before the cap)")
        if refusal is not None:
            context.facts.attention[node] = _manual_match(node, found, None, refusal)
            context.skip(KIND, node, f"manual attention: {refusal.reason}", code=refusal.code)
            return None
    # a manual mask hides scores with a float (added, or filled in): a query row whose every key is hidden
    # (only key padding can do that: left padding) gets eager's uniform average over all keys (finfo.min) or
    # NaN (-inf), which SDPA (0 for such rows) does not compute: the attention stays as written
    float_fill = spec.term(KeyPadding) is not None
    if float_fill:  # masked_fill's value, or the one value an additive mask hides with
        fill = found["fill"] if style == "filled" else hidden_fill(gm, mask_node, reader, spec)
    if found["sink"] is not None:
        context.facts.attention[node] = dataclasses.replace(_manual_match(node, found, spec, None),
                                                            sink=found["sink"], notes=("attention sinks",))
        return None
    if found["softcap"] is not None or float_fill:
        # SDPA can't express a score mod (nor a float fill's hidden rows): dropping the cap would be wrong
        # wherever the shard pass refuses the graph, so the manual nodes stay as written; the match (on
        # ``probs @ v``) carries the spec, and the shard pass replaces the whole manual attention by the ring op
        if found["softcap"] is not None:
            spec = spec & SoftCap(found["softcap"])
        context.facts.attention[node] = dataclasses.replace(_manual_match(node, found, spec, None),
                                                            float_fill=float_fill, hidden_fill=fill,
                                                            fill_replaces=float_fill and (
                                                                style == "filled" or found.get("replaced", False)))
        return None
    mask_kwargs, refusal = _manual_sdpa_mask(gm, node, found, spec, fake_mode)
    if refusal is not None:
        context.facts.attention[node] = _manual_match(node, found, spec, refusal)
        context.skip(KIND, node, f"manual attention: {refusal.reason}", code=refusal.code)
        return None
    with gm.graph.inserting_before(node):
        kwargs = {**mask_kwargs, "scale": float(found["scale"])}
        args = (found["q"], found["k"], found["v"])
        sdpa = gm.graph.call_function(SDPA, args, kwargs)
        set_meta(sdpa, SDPA, args, kwargs, fake_mode)
    sdpa.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    node.replace_all_uses_with(sdpa)
    gm.graph.erase_node(node)
    notes = ("repeat_kv undone: kv heads travel unrepeated",) if _undo_repeat_kv(gm, sdpa, fake_mode) else ()
    match = _match_of(sdpa, "manual softmax attention canonicalized", None, notes, "manual", spec)
    context.facts.attention[sdpa] = match
    context.rewrite("attention_normal_form", sdpa, {"mask": match.mask_description, "source": "manual",
                                                     "notes": ", ".join(notes) or None})
    return match


def _reshaped_from_heads(node, batch: int, heads: int):
    """``x4.reshape(B * H, S, D)`` (or ``view``) of a ``[B, H, S, D]`` x4 -> x4, else None."""
    if not (is_method(node, "reshape", "view") and isinstance(node.args[0], fx.Node)):
        return None
    x4, x3 = val(node.args[0]), val(node)
    if x4 is None or x3 is None or x4.dim() != 4 or x3.dim() != 3 or tuple(x4.shape[:2]) != (batch, heads) \
            or tuple(x3.shape) != (batch * heads, *x4.shape[2:]):
        return None
    return node.args[0]


def _unbatch_heads(gm, out_node, fake_mode):
    """BLOOM's attention over ``[B * H, S, D]``: ``bmm(view(dropout(softmax(view(alibi.baddbmm(q3, k3ᵀ, beta,
    alpha), B, H, S, S) + mask)), B*H, S, S), v3)`` with ``q3 = q4.reshape(B * H, S, D)`` (k, v alike) ->
    rewritten in the 4-D manual form ``softmax(q4 @ k4ᵀ * alpha + (beta * alibi.view(B, H, ., S) + mask)) @ v4``
    (then reshaped back), the same math, which the manual pattern reads; returns its ``@ v4`` node, or None."""
    if not (is_function(out_node, torch.bmm) and len(out_node.args) == 2):
        return None
    probs3, v3 = out_node.args
    if not is_method(probs3, "view", "reshape") or val(probs3.args[0]) is None or val(probs3.args[0]).dim() != 4:
        return None
    probs4 = probs3.args[0]
    batch, heads = val(probs4).shape[:2]
    v4 = _reshaped_from_heads(v3, batch, heads)
    add = probs4
    while add is not None and not is_function(add, operator.add):
        add = add.args[0] if add.op in ("call_method", "call_function") and add.args and \
            isinstance(add.args[0], fx.Node) else None
    if v4 is None or add is None or len(add.args) != 2 or not isinstance(add.args[1], fx.Node):
        return None
    scores_view, mask = add.args
    if not (is_method(scores_view, "view", "reshape") and is_method(scores_view.args[0], "baddbmm")):
        return None
    baddbmm = scores_view.args[0]
    alibi = baddbmm.args[0]
    kw = dict(zip(("batch1", "batch2", "beta", "alpha"), baddbmm.args[1:]), **baddbmm.kwargs)
    beta, alpha = const_number(kw.get("beta", 1.0)), const_number(kw.get("alpha", 1.0))
    k3 = _transposed_key(kw.get("batch2")) if isinstance(kw.get("batch2"), fx.Node) else None
    q4 = _reshaped_from_heads(kw.get("batch1"), batch, heads) if isinstance(kw.get("batch1"), fx.Node) else None
    k4 = _reshaped_from_heads(k3, batch, heads) if k3 is not None else None
    if None in (q4, k4, beta, alpha) or val(alibi) is None or val(alibi).dim() != 3:
        return None
    graph = gm.graph

    def emit(fn, *args, method=False):
        node = graph.call_method(fn, args) if method else graph.call_function(fn, args)
        set_meta(node, (lambda t, *a: getattr(t, fn)(*a)) if method else fn, args, {}, fake_mode)
        return node

    with graph.inserting_before(add):
        scores = emit(operator.mul, emit(torch.matmul, q4, emit("transpose", k4, -2, -1, method=True)), alpha)
        bias = emit("view", alibi, batch, heads, val(alibi).shape[1], val(alibi).shape[2], method=True)
        if beta != 1.0:
            bias = emit(operator.mul, bias, beta)
        new_add = emit(operator.add, scores, emit(operator.add, bias, mask))
    add.replace_all_uses_with(new_add)
    with graph.inserting_before(out_node):
        out4 = emit(torch.matmul, probs4, v4)
        out3 = emit("reshape", out4, batch * heads, *val(out4).shape[2:], method=True)
    out_node.replace_all_uses_with(out3)
    for dead in (out_node, probs3, add, scores_view, baddbmm):
        if not dead.users:
            graph.erase_node(dead)
    return out4


def detect_attention(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    fake_mode = fake_mode_of(gm)
    memo = {}  # one mask read by every layer is classified once
    folded = manual = unrepeated = 0
    for node in list(gm.graph.nodes):
        if is_function(node, SDPA):
            origin, spec, refusal = _canonicalize_sdpa(gm, node, memo)
            kwargs = sdpa_kwargs(node)
            operands = [kwargs["query"], kwargs["key"], kwargs["value"], kwargs["attn_mask"]]
            autocast = _autocast_dtype(node, operands)
            if autocast is not None:  # SDPA under torch.autocast: its inputs cast as autocast would
                q, k, v, mask = _cast_in_graph(gm, operands, autocast, fake_mode)
                kwargs.update(attn_mask=mask)
                node.args = (q, k, v)
                node.kwargs = {name: value for name, value in kwargs.items() if name not in ("query", "key", "value")}
            notes = ()
            if _undo_repeat_kv(gm, node, fake_mode):
                notes = ("repeat_kv undone: kv heads travel unrepeated",)
                unrepeated += 1
            match = dataclasses.replace(_match_of(node, origin, refusal, notes, "sdpa", spec), cast_to=autocast)
            mask = sdpa_kwargs(node)["attn_mask"]
            if spec is not None and spec.term(KeyPadding) is not None and isinstance(mask, fx.Node) \
                    and val(mask) is not None and val(mask).is_floating_point():
                # an additive finfo.min / -inf mask: no hidden_fill, so no ring mode (calls whose data hide a whole
                # query row run unsharded), as SDPA's kernels differ on such a row's gradient (CPU's recomputes the
                # probabilities from an LSE the fill absorbs too: S times the softmax's that "uniform" mirrors)
                match = dataclasses.replace(match, float_fill=True)
            context.facts.attention[node] = match
            if origin == _FOLDED or notes or autocast:  # the node changed (a kept attn_mask: in the match only)
                folded += origin == _FOLDED
                context.rewrite("attention_normal_form", node, {"mask": match.mask_description,
                                                                 "notes": ", ".join(notes) or None,
                                                                 "cast_to": dtype_name(autocast)})
            continue
        if is_flex_attention(node):
            match = flex_match(gm, flex_call(gm, node))
            context.facts.attention[match.node] = match
            if match.refusal is not None:
                context.skip(KIND, node, f"FlexAttention: {match.refusal.reason}", code=match.refusal.code)
            continue
        if getattr(node, "_erased", False):
            continue  # erased by a rewrite above
        if is_function(node, torch.bmm):  # BLOOM: attention over [B * H, S, D]
            node = _unbatch_heads(gm, node, fake_mode) or node
        found = _match_manual(gm, node)
        match = _detect_manual(gm, node, found, context, fake_mode, memo) if found is not None else None
        if found is not None and found["autocast"] is not None:  # recorded under the SDPA or the node as written
            recorded = match.node if match is not None else node
            if recorded in context.facts.attention:
                context.facts.attention[recorded] = dataclasses.replace(context.facts.attention[recorded],
                                                                        cast_to=found["autocast"])
        if match is not None:
            manual += 1
            unrepeated += bool(match.notes)
    if folded or manual or unrepeated:
        context.note = (f"{folded} constant mask(s) folded into is_causal / no mask, "
                        f"{manual} manual attention(s) canonicalized to SDPA, "
                        f"{unrepeated} repeat_kv undone (enable_gqa); the shard pass rewrites them")
    elif context.facts.attention:
        context.note = f"{len(context.facts.attention)} attention(s) recorded, none rewritten"
    eliminate_dead_code(gm.graph)
    return gm
