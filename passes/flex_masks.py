"""Helper of ``detect_attention`` (not a pass): FlexAttention calls -> :class:`AttentionMatch`.

``torch.compile`` records ``flex_attention(q, k, v, block_mask=..., score_mod=...)`` as the higher-order op
``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers)``;
the block mask tuple ends with the ``mask_mod`` subgraph ``(b, h, q_idx, kv_idx, *mask_mod_buffers) -> bool``.
The block tensors (``kv_num_blocks``...) only say which 128-blocks to skip: the ``mask_mod`` alone decides
visibility, so it is what burstc reads.

The ``mask_mod`` is evaluated on broadcast index tensors (``q_idx`` ``[1, 1, S, 1]``, ``kv_idx``
``[1, 1, 1, S]``, ``b`` / ``h`` over the batch and heads; at two shorter probe lengths when ``[B, H, S, S]``
is too large, as for other masks) and must be exactly one :class:`MaskSpec`:

- buffers that are constants (module buffers, constants): a static spec (causal, windows, bands);
- one buffer of integers ``[S]`` or ``[B, S]`` compared as document ids (torchtitan's ``block_causal``:
  ``doc[b, q] == doc[b, kv]``), a graph input or a value the model computes from its token inputs alone
  (torchtitan's ids from the EOS tokens; never from parameters or float inputs, and the shard pass checks it
  stays replicated): ``static & Documents(its name, ids=True)`` when probes with sorted, unsorted and
  one-token documents all agree; the ring op gets the ids every call.

The ``score_mod`` is recognized the same way, on random scores: the identity (none given), a soft-cap
``c * tanh(s / c)`` (:class:`SoftCap`) or an ALiBi bias ``s + slope_h * (kv - q)`` (:class:`Alibi`).  Any
other ``score_mod``, and a returned LSE, are refused with codes: the attention then stays FlexAttention (no
sequence parallelism).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from burstc.attention_ir import AttentionMatch, Documents, MaskSpec, SoftCap
from burstc.passes import graph_utils
from burstc.passes.graph_utils import NotConstant, TooLarge, evaluate_constant, evaluation_order, in_place_writes, \
    input_dependency, numeric_constants, placeholder_kind, val
from burstc.passes.mask_classification import alibi_of, probe_lengths, spec_of_visibility
from burstc.refusals import Refusal, register_codes

FLEX_ATTENTION = getattr(torch.ops.higher_order, "flex_attention", None)

CODES = register_codes("attention", {
    "flex_score_mod": "a FlexAttention score_mod other than the identity, a soft-cap or an ALiBi bias (the "
                      "ring op executes those, not arbitrary score functions)",
    "flex_outputs": "FlexAttention's logsumexp / max scores are used (the ring op returns the output only)",
    "flex_mask": "the FlexAttention mask_mod is not exactly one supported mask (causal, windows, bands, "
                 "document ids: one integer input, or one value computed from the token inputs)",
})

_PROBE_SEED = 20261205


@dataclass(frozen=True)
class FlexCall:
    node: fx.Node                    # the higher-order op
    output: fx.Node | None           # its ``getitem(_, 0)``: the attention output, what the match is keyed by
    query: fx.Node
    key: fx.Node
    value: fx.Node
    scale: float
    score_mod: fx.GraphModule | None
    mask_mod: fx.GraphModule | None
    mask_buffers: tuple
    score_buffers: tuple
    other_outputs_used: bool


def is_flex_attention(node) -> bool:
    return FLEX_ATTENTION is not None and isinstance(node, fx.Node) and node.op == "call_function" \
        and node.target is FLEX_ATTENTION


def _submodule(gm, node):
    return getattr(gm, node.target, None) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def flex_call(gm: fx.GraphModule, node: fx.Node) -> FlexCall:
    q, k, v, score_mod, block_mask, scale = node.args[:6]
    score_buffers = tuple(node.args[7]) if len(node.args) > 7 else ()
    mask_buffers = tuple(node.args[8]) if len(node.args) > 8 else ()
    outputs = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    output = next((u for u in outputs if u.args[1] == 0), None)
    others = any(u is not output for u in node.users)
    mask_mod = _submodule(gm, block_mask[-1]) if isinstance(block_mask, (tuple, list)) and block_mask else None
    return FlexCall(node, output, q, k, v, float(scale), _submodule(gm, score_mod), mask_mod, mask_buffers,
                    score_buffers, others)


def _is_identity(score_mod: fx.GraphModule | None) -> bool:
    """``score_mod(score, b, h, q_idx, kv_idx) -> score`` (flex's default when none is given)."""
    if score_mod is None:
        return True
    placeholders = [n for n in score_mod.graph.nodes if n.op == "placeholder"]
    output = next(n for n in score_mod.graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return bool(placeholders) and result is placeholders[0]


def _constant_buffers(gm, buffers) -> list | None:
    """The values of ``buffers`` when they are all compile-time constants, else None."""
    if any(isinstance(b, fx.Node) and input_dependency(gm, b) is not None for b in buffers):
        return None
    try:
        return [evaluate_constant(gm, b) if isinstance(b, fx.Node) else b for b in buffers]
    except NotConstant:
        return None


def classify_score_mod(gm: fx.GraphModule, call: FlexCall) -> tuple[tuple, Refusal | None]:
    """The ``score_mod`` of ``call`` -> (score modifications, None): none for the identity, :class:`SoftCap`
    for ``c * tanh(s / c)``, :class:`Alibi` for ``s + slope_h * (kv - q)`` (plus a per-row constant, which
    the softmax ignores); verified on random scores at the lengths the mask uses; else (None, refusal)."""
    if _is_identity(call.score_mod):
        return (), None
    refuse = Refusal(CODES.flex_score_mod, "a FlexAttention score_mod that is not the identity, a soft-cap "
                                           "c * tanh(s / c) or an ALiBi bias slope_h * (kv - q)")
    values = _constant_buffers(gm, call.score_buffers)
    if values is None:
        return None, refuse
    q = val(call.query)
    batch, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    try:
        lengths = _evaluation_lengths(call.score_mod, batch, heads, seq)
    except TooLarge:
        return None, refuse
    found = []
    for length in lengths:
        try:
            mods = _score_mods_at(call.score_mod, values, batch, heads, length)
        except Exception:  # noqa: BLE001 - a score_mod the probes can't run: not recognized
            mods = None
        if mods is None or (found and mods != found[0]):
            return None, refuse
        found.append(mods)
    return found[0], None


def _score_mods_at(score_mod, values, batch, heads, seq) -> tuple | None:
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    b, h, q_idx, kv_idx = _indices(batch, heads, seq)

    def modified(scores):
        out = score_mod(scores, b, h, q_idx, kv_idx, *values)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.to(torch.float64).expand(batch, heads, seq, seq)

    scores = [(torch.randn(batch, heads, seq, seq, generator=gen) * 8).to(torch.float64) for _ in range(2)]
    outs = [modified(s.to(torch.float32)) for s in scores]
    bias = modified(torch.zeros(1, 1, 1, 1))
    # additive (up to fp32 rounding of s + bias): an ALiBi bias?
    if all(bool(torch.allclose(o - s, bias, rtol=0, atol=1e-5 * (1 + float(o.abs().max())))) for o, s in zip(outs, scores)):
        alibi = alibi_of(bias, torch.ones(seq, seq, dtype=torch.bool)[None], heads)
        return (alibi,) if alibi is not None else None
    cap = float(modified(torch.full((1, 1, 1, 1), 1e4)).flatten()[0])  # tanh saturates: the output is c
    if not cap > 0:
        return None
    for s, o in zip(scores, outs):
        want = cap * torch.tanh(s.to(torch.float32).to(torch.float64) / cap)
        if not bool(torch.allclose(o, want, rtol=1e-5, atol=1e-5 * cap)):
            return None
    return (SoftCap(cap),)


def _evaluation_lengths(module: fx.GraphModule, batch: int, heads: int, seq: int) -> list[int]:
    """The lengths to evaluate a ``mask_mod`` / ``score_mod`` at: the sequence's when ``[B, H, S, S]`` fits the
    compile-time limit, else two shorter probe lengths (``TooLarge`` when there are none)."""
    if batch * heads * seq * seq <= graph_utils.FULL_EVALUATION_LIMIT:
        return [seq]
    return list(probe_lengths(numeric_constants(module, module.graph.nodes), seq))


def _indices(batch, heads, seq):
    """Broadcast index tensors for ``mask_mod(b, h, q_idx, kv_idx)`` (int32, as flex passes them)."""
    i = torch.arange(seq, dtype=torch.int32)
    return (torch.arange(batch, dtype=torch.int32).view(batch, 1, 1, 1),
            torch.arange(heads, dtype=torch.int32).view(1, heads, 1, 1), i.view(1, 1, seq, 1), i.view(1, 1, 1, seq))


def _visible(mask_mod, batch, heads, seq, buffers) -> torch.Tensor:
    out = mask_mod(*_indices(batch, heads, seq), *buffers)
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        raise TypeError(f"mask_mod returned {type(out).__name__} {getattr(out, 'dtype', '')}, not a bool tensor")
    return out.expand(batch, heads, seq, seq)


def _doc_probes(seq: int, shape_of, gen) -> list[torch.Tensor]:
    """Document-id probes (int64 ``[S]``): one document, sorted random segments, unsorted ids, one token each."""
    segments = torch.cumsum((torch.rand(seq, generator=gen) < 0.2).to(torch.int64), 0)
    unsorted = torch.randint(0, 3, (seq,), generator=gen)
    probes = [torch.zeros(seq, dtype=torch.int64), segments, unsorted, torch.arange(seq)]
    return [shape_of(p) for p in probes]


def classify_flex_mask(gm: fx.GraphModule, call: FlexCall) -> tuple[MaskSpec | None, Refusal | None]:
    """The ``mask_mod`` of ``call`` -> (exact MaskSpec, None) or (None, refusal)."""
    if call.mask_mod is None:
        return None, Refusal(CODES.flex_mask, "no mask_mod subgraph found in the block mask")
    q, k = val(call.query), val(call.key)
    batch, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    if k.shape[2] != seq:
        return None, Refusal(CODES.flex_mask, f"query length {seq} != key length {k.shape[2]}")
    constants, runtime = [], []
    for buffer in call.mask_buffers:
        if not isinstance(buffer, fx.Node) or input_dependency(gm, buffer) is None:
            constants.append(buffer)
        else:
            runtime.append(buffer)
    if len(runtime) > 1:
        return None, Refusal(CODES.flex_mask, "the mask_mod reads several values computed from the inputs "
                                              f"({', '.join(f'`{b.name}`' for b in runtime)}): only one tensor of "
                                              "document ids is recognized")
    docs = runtime[0] if runtime else None
    if docs is not None:
        refusal = _document_ids_refusal(gm, call, docs, batch, seq)
        if refusal is not None:
            return None, refusal
    try:
        values = [evaluate_constant(gm, b) if isinstance(b, fx.Node) else b for b in constants]
    except NotConstant as why:
        return None, Refusal(CODES.flex_mask, f"a mask_mod buffer can't be evaluated ({why})")
    try:
        lengths = _evaluation_lengths(call.mask_mod, batch, heads, seq)
    except TooLarge as why:
        return None, Refusal(CODES.flex_mask, str(why))
    if lengths != [seq] and any(isinstance(x, torch.Tensor) and seq in x.shape for x in values):
        return None, Refusal(CODES.flex_mask, "the mask_mod reads a constant tensor as long as the sequence, "
                                              "too large to evaluate at compile time")
    specs = []
    for length in lengths:
        try:
            spec = _spec_at(call, docs, values, batch, heads, length)
        except Exception as why:  # noqa: BLE001 - a mask_mod the probes can't run: not recognized
            return None, Refusal(CODES.flex_mask, f"evaluating the mask_mod failed ({type(why).__name__}: {why})")
        if spec is None or (specs and spec != specs[0]):
            return None, Refusal(CODES.flex_mask, "the mask_mod is not exactly causal, a window, a band, or "
                                                  "those with document ids from one input")
        specs.append(spec)
    return specs[0], None


def _document_ids_refusal(gm: fx.GraphModule, call: FlexCall, docs: fx.Node, batch: int, seq: int
                          ) -> Refusal | None:
    """Why the mask_mod buffer ``docs`` can't be the :class:`Documents` ids, or None: integer ``[S]`` / ``[B, S]``,
    an input of the model or a value it computes from its token inputs alone (torchtitan's ids from the EOS
    tokens: replicated on every rank, as the shard pass keeps token-index values; its attention rule checks the
    placement too), written in place only before this call (the ring op reads the ids once)."""
    v = val(docs)
    what = "input" if docs.op == "placeholder" else "value"
    if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.is_complex() \
            or tuple(v.shape) not in ((seq,), (batch, seq)):
        shape, dtype = tuple(getattr(v, "shape", ())), getattr(v, "dtype", type(v).__name__)
        return Refusal(CODES.flex_mask, f"the mask_mod reads {what} `{docs.name}` {shape} {dtype}, not integer "
                                        "document ids [S] / [B, S]")
    if docs.op == "placeholder":
        return None if placeholder_kind(docs) == "input" else \
            Refusal(CODES.flex_mask, f"the mask_mod reads {placeholder_kind(docs)} `{docs.name}` as document ids")
    for source in evaluation_order(gm, docs, call.node):
        if source.op == "placeholder" and placeholder_kind(source) != "buffer" and (
                placeholder_kind(source) == "parameter"
                or isinstance(val(source), torch.Tensor) and val(source).is_floating_point()):
            return Refusal(CODES.flex_mask, f"the mask_mod reads `{docs.name}`, computed from "
                                            f"{placeholder_kind(source)} `{source.name}`: a value of the activations "
                                            "(sharded over the sequence), not of the token inputs alone")
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    if any(docs in aliases and position[op] > position[call.node] for op, aliases in in_place_writes(gm.graph)):
        return Refusal(CODES.flex_mask, f"the mask_mod's document ids `{docs.name}` are written in place after "
                                        "the attention reads them")
    return None


def _spec_at(call, docs, values, batch, heads, seq) -> MaskSpec | None:
    if docs is None:
        return spec_of_visibility(_visible(call.mask_mod, batch, heads, seq, values))
    per_row = val(docs).dim() == 2
    dtype = val(docs).dtype

    def shaped(ids_S):
        return (ids_S.expand(batch, seq) if per_row else ids_S).to(dtype)

    gen = torch.Generator().manual_seed(_PROBE_SEED)
    probes = _doc_probes(seq, shaped, gen)
    at = list(call.mask_buffers).index(docs)  # ``values`` are the other buffers, in order

    def visible(ids):
        return _visible(call.mask_mod, batch, heads, seq, [*values[:at], ids, *values[at:]])

    static = spec_of_visibility(visible(probes[0]))
    if static is None or static.score_mods:
        return None
    spec = static & Documents(docs.name, ids=True)
    i = torch.arange(seq)
    for ids in probes[1:]:
        ids_BS = ids.expand(batch, seq).to(torch.int64)
        want = spec.visible(i, i, q_docs=ids_BS, kv_docs=ids_BS)          # [B, S, S]
        if not bool((visible(ids) == want[:, None]).all()):
            return None
    return spec


def flex_match(gm: fx.GraphModule, call: FlexCall) -> AttentionMatch:
    """The record of one FlexAttention call, keyed by its output ``getitem(_, 0)``; a refusal keeps it as is."""
    refusal = None
    spec = MaskSpec.full()
    score_mods, refusal = classify_score_mod(gm, call)
    if refusal is None and (call.other_outputs_used or call.output is None):
        refusal = Refusal(CODES.flex_outputs, "FlexAttention's logsumexp / max scores are used")
    if refusal is None:
        classified, refusal = classify_flex_mask(gm, call)
        spec = classified if classified is not None else spec
        for mod in score_mods if refusal is None else ():
            spec = spec & mod
    q, k = val(call.query), val(call.key)
    return AttentionMatch(node=call.output if call.output is not None else call.node, query=call.query,
                          key=call.key, value=call.value, mask=spec, scale=call.scale, heads_q=q.shape[1],
                          kv_heads=k.shape[1], source="flex", mask_origin="FlexAttention mask_mod", refusal=refusal)
