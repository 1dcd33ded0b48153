"""Specialize attention masks built from an all-ones ``attention_mask`` input, behind a runtime check.

HF models are usually called with the tokenizer's ``attention_mask``; in a training batch without
padding it is all ones, and then the mask HF builds from it (``causal & attention_mask[b, kv]``)
is plain causal.  But it is an *input*, so at compile time the mask depends on runtime values and
the shard pass would have to refuse the graph.  This pass (mesh > 1 only) finds the integer/bool
graph inputs that attention masks depend on, and if every such mask is one the ring op executes
(``MaskSpec.ring_supported``: causal or full today) when those inputs are all ones, it substitutes ``torch.ones`` for them in the graph: detect_attention then
folds the masks into ``is_causal`` and the shard pass can lower the graph.  Every other reader of
the input (OPT's ``cumsum`` positions, say) sees the same ones, which is exact whenever the input
really is all ones.

The pass records the inputs it assumed (``context.facts.all_ones_inputs``, placeholder
positions); the backend checks them on every call (one ``.all()`` per input, a host sync on GPU)
and runs an unspecialized (unsharded, replicated) graph for a call where they are not all ones,
noting it in the report.  A padded batch therefore gets the single-device result, never a wrong one.

Before::

    attention_mask = l_kwargs_attention_mask_.to(dtype=torch.bool)
    padding = attention_mask[batch_indices, kv_indices]
    mask = causal & padding                         # depends on the input: refused

After::

    ones = torch.ones((1, 64), dtype=torch.int64)   # guarded: the input must be all ones
    attention_mask = ones.to(dtype=torch.bool)      # ... -> a constant causal mask
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from burstc.passes.detect_attention import attention_masks
from burstc.passes.mask_classification import classify_mask, classify_runtime_mask
from burstc.refusals import register_codes
from burstc.passes.graph_utils import (ancestors, eliminate_dead_code, fake_mode_of, input_dependency, placeholder_example, placeholder_kind, set_meta, val)

KIND = "unpadded_mask"
CODES = register_codes("unpadded_mask", {
    "not_assumable": "the mask depends on inputs that can't be assumed all ones (not integer/bool token inputs, "
                     "or not all ones in the call being compiled)",
    "not_causal_when_ones": "the mask is neither causal nor full even with the input assumed all ones",
})


def _input_dependencies(mask_node: fx.Node) -> list[fx.Node]:
    return [n for n in ancestors(mask_node) if n.op == "placeholder" and placeholder_kind(n) == "input"]


def _assumable(node: fx.Node) -> str:
    """Why ``node`` can't be assumed all ones, or "" if it can."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        return "not a tensor"
    if v.is_floating_point() or v.is_complex():
        return f"a {v.dtype} tensor, not an integer/bool mask"
    if not all(isinstance(s, int) for s in v.shape):
        return "its shape is dynamic"
    # specialize on what the compiling call passed, as Dynamo does on ints: token ids (a document
    # mask made from EOS positions) or a padded first batch would only ever miss the check
    example = placeholder_example(node)
    if isinstance(example, torch.Tensor) and not isinstance(example, FakeTensor) and not bool(example.all()):
        return "not all ones in the call being compiled"
    return ""


def _substitute_ones(gm, placeholder, fake_mode) -> fx.Node:
    v = val(placeholder)
    first_user = next(n for n in gm.graph.nodes if n in placeholder.users)
    kwargs = {"dtype": v.dtype, "device": v.device}
    with gm.graph.inserting_before(first_user):
        ones = gm.graph.call_function(torch.ones, (tuple(v.shape),), kwargs)
    set_meta(ones, torch.ones, (tuple(v.shape),), kwargs, fake_mode)
    placeholder.replace_all_uses_with(ones)
    return ones


def assume_unpadded(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    if context.world_size <= 1:
        context.note = "single device: masks are left to the attention kernels"
        return gm
    masks = attention_masks(gm)
    runtime_masks, candidates, reported = [], {}, set()
    for reader, mask_node, style in masks:
        if input_dependency(gm, mask_node, at=reader) is None:
            continue  # constant already: detect_attention folds it
        inputs = _input_dependencies(mask_node)
        refusals = {n: _assumable(n) for n in inputs}
        if not inputs or any(refusals.values()):
            why = "; ".join(f"`{n.name}` is {r}" for n, r in refusals.items() if r) or "no input"
            if why not in reported:
                reported.add(why)
                context.skip(KIND, reader, f"mask depends on runtime values that can't be assumed all ones ({why})",
                             code=CODES.not_assumable)
            continue
        runtime_masks.append((reader, mask_node, style))
        for n in inputs:
            candidates[n] = candidates.get(n, 0) + 1  # how many masks read it
    if not candidates:
        if not masks:
            context.note = "no attention mask found"
        return gm
    # masks recognized as runtime data (key padding, packed documents) need no specialization: the ring op
    # takes this call's values, so one graph serves padded and unpadded batches alike
    memo = {}  # one mask read by every layer is probed once
    as_data = [classify_runtime_mask(gm, mask_node, style, reader, memo=memo)
               for reader, mask_node, style in runtime_masks]
    if all(spec is not None and spec.ring_supported for spec in as_data):
        context.note = (f"{len(runtime_masks)} mask(s) built from the inputs are runtime data for the ring op "
                        f"({', '.join(sorted({spec.kind for spec in as_data}))}): nothing to specialize")
        return gm

    fake_mode = fake_mode_of(gm)
    substitutes = {p: _substitute_ones(gm, p, fake_mode) for p in candidates}
    memo = {}  # a fresh one: the graph changed (ones substituted)
    verdicts = [classify_mask(gm, mask_node, style, reader, memo=memo) for reader, mask_node, style in runtime_masks]
    # specialize only where it pays for its per-call check: masks the ring op executes (full, causal today)
    if any(spec is None or not spec.ring_supported for spec, _ in verdicts):
        for placeholder, ones in substitutes.items():  # undo: assuming ones would not make them causal
            ones.replace_all_uses_with(placeholder)
            gm.graph.erase_node(ones)
        reasons = sorted({refusal.reason if refusal else f"{spec.kind}, which the ring op does not execute"
                          for spec, refusal in verdicts if spec is None or not spec.ring_supported})
        for placeholder in candidates:
            context.skip(KIND, placeholder, "the attention mask is not causal even when this input is all ones "
                                            f"({'; '.join(reasons)})", code=CODES.not_causal_when_ones)
        return gm

    positions = [i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if n in candidates]
    context.facts.all_ones_inputs = tuple(positions)
    for placeholder in candidates:
        context.rewrite(KIND, placeholder, {
            "input": placeholder.name, "shape": tuple(val(placeholder).shape),
            "masks": candidates[placeholder],
            "guard": "all ones at runtime, else the unsharded graph runs"}, module="")
    context.note = (f"{len(runtime_masks)} mask(s) are causal/full when {len(candidates)} input(s) are all ones; "
                    "specialized, checked on every call")
    eliminate_dead_code(gm.graph)
    return gm
