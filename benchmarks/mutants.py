"""Planted-bug (mutation) testing: does what CI runs notice a realistic bug in the compiler?

Each :class:`Mutant` is one small textual patch (``old`` -> ``new`` in one file) standing for a bug this
field has seen: a wrong LSE-merge sign, an off-by-one in block skipping, a wrong zigzag inverse, a missing
dK/dV return hop, a dropped window, the local instead of the global token count, a mask treated as causal,
a gradient reduced twice...  ``old`` must occur exactly once in the file: after a refactor the mutant fails
loudly ("failed to apply") instead of silently planting nothing.

Mutants are planted one at a time in a COPY of the repository (never the checkout this script lives in):
the tracked and untracked-but-not-ignored files are copied to ``--workdir``, ``burstc/passes`` and
``burstc/kernels`` are linked to ``passes/`` and ``kernels/`` there (the package-dir mapping of
pyproject.toml), and pytest runs in the copy with ``PYTHONPATH`` pointing at it, which the path finder
searches before the editable install's finder (checked before the first run: ``burstc.passes`` must import
from the copy).  Between mutants the patched file gets its original bytes back.

Each mutant runs its own test selection (the files that should kill it, ``-x``, a timeout); a mutant is
``killed`` (first failing test named), ``survived``, ``timeout`` (a hang counts as killed, reported apart),
or ``unapplied`` (its ``old`` text is gone, or the patched file does not compile: fix the mutant).

    python benchmarks/mutants.py --list
    python benchmarks/mutants.py --only lse_merge_weight_sign
    python benchmarks/mutants.py                      # all; prints a Markdown table and the score
    python benchmarks/mutants.py --baseline           # first check that every selection passes unmutated
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Test selections (pytest arguments), lean on purpose: the killing test is usually single-process or 2 ranks.
PIECES = ["tests/test_ring_pieces.py"]
FUSED_BLOCKS = ["tests/test_fused_block_kernels.py"]
HEAD_GROUPS = ["tests/test_head_groups.py"]
MERGE_UNIT = ["tests/test_ring_attention.py", "-k", "merge or stand_in or reference_kernels or cpu_flash"]
RING_P2 = ["tests/test_ring_attention.py", "-k", "causal_gqa and 2-"]
RING_P4 = ["tests/test_ring_attention.py", "-k", "causal_gqa and 4-"]
RING_LSE = ["tests/test_ring_attention.py", "-k", "gradient_through_lse"]
SHARD_SEQ_GRAD = ["tests/test_ring_attention.py", "-k", "shard_seq_gradient"]
RING_STRIPED = ["tests/test_ring_attention.py", "-k", "causal_gqa and striped"]
SKIP_UNIT = ["tests/test_ring_skipping.py", "-m", "not multirank"]
MASK_UNIT = ["tests/test_ring_masks.py", "-m", "not multirank"]
MASK_RING = ["tests/test_ring_masks.py", "-k", "test_ring_matches_dense_attention_with_static_masks"]
RUNTIME_UNIT = ["tests/test_ring_runtime_masks.py", "-m", "not multirank"]
RUNTIME_RING = ["tests/test_ring_runtime_masks.py", "-k", "test_ring_matches_sdpa_with_documents_and_padding"]
PLANNER = ["tests/test_planner.py"]
LCE_OP = ["tests/test_linear_cross_entropy_op.py"]
FUSE = ["tests/test_fuse_lm_head_loss.py"]
DETECT = ["tests/test_detect_masks.py"]
RULES = ["tests/test_shard_rules.py"]
SHARE_GRADS = ["tests/test_share_replicated_grads.py", "-k", "refused_graph"]
MODEL_GQA = ["tests/test_sharded_models.py", "-k", "test_model_matches_single_device and titan_llama_gqa-2"]
PREFETCH_BURST = ["tests/test_prefetch_ring_backward.py", "-k", "two_ranks and burst"]
MODEL_LAYOUTS = ["tests/test_sharded_models.py", "-k", "test_layouts_and_plans and (zigzag-burst or striped-kv_ring)"]
MODEL_PADDED = ["tests/test_sharded_models.py", "-k", "test_length_the_layout_cannot_split_is_padded_when_exact"]
MODEL_CE = ["tests/test_sharded_models.py", "-k", "test_unfused_cross_entropy_is_sharded or per_token_losses"]
MODEL_AUTOCAST = ["tests/test_sharded_models.py", "-k", "autocast"]
MOE_RULES = ["tests/test_moe_dispatch.py"]
MOE_MODELS = ["tests/test_hf_architectures.py", "-k", "mixture_of_experts_dispatch and mixtral"]
LOAD_BALANCE = ["tests/test_hf_architectures.py", "-k", "load_balancing"]
SINKS = ["tests/test_hf_architectures.py", "-k", "attention_sinks"]
MERGED_OUTPUTS = ["tests/test_sharded_models.py", "-k", "merged_rows_outputs"]
MODEL_GATHER = ["tests/test_sharded_models.py", "-k", "per_token_losses or kept_logits"]
MODEL_BIDIRECTIONAL = ["tests/test_sharded_models.py", "-k", "test_bidirectional_model_matches_when_divisible"]
UNPADDED = ["tests/test_unpadded_mask.py"]
E2E = ["tests/test_e2e_models.py"]
IR = ["tests/test_attention_ir.py"]
FLEX = ["tests/test_flex_attention.py"]
KEPT_OP = ["tests/test_kept_rows.py", "-k", "first_rows or clipped"]
KEPT_MODELS = ["tests/test_kept_rows.py", "-k", "matches_single_device"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    why: str  # the bug it stands for
    tests: tuple[tuple[str, ...], ...]  # pytest argument lists, run in order until one fails

    def patched(self, text: str) -> str:
        count = text.count(self.old)
        if count != 1:
            raise ValueError(f"{self.name}: the text to mutate occurs {count} times in {self.path} (must be once)")
        return text.replace(self.old, self.new)


def _m(name, path, old, new, why, *tests):
    return Mutant(name, path, old, new, why, tuple(tuple(t) for t in tests))


MUTANTS = [
    # --- LSE merge / softmax statistics -------------------------------------------------------------------
    _m("lse_merge_weight_sign", "burstc/ops/lse_merge.py",
       "weight_blk = torch.sigmoid(lse_blk - lse_acc_BHS).unsqueeze(-1)\n    out_acc_BHSD.sub_",
       "weight_blk = torch.sigmoid(lse_acc_BHS - lse_blk).unsqueeze(-1)\n    out_acc_BHSD.sub_",
       "wrong sign in the LSE merge weight", MERGE_UNIT, RING_P2),
    _m("lse_merge_lse_update_sign", "burstc/ops/lse_merge.py",
       "lse_acc_BHS.sub_(F.logsigmoid(lse_acc_BHS - lse_blk))",
       "lse_acc_BHS.add_(F.logsigmoid(lse_acc_BHS - lse_blk))",
       "merged LSE updated with the wrong sign", MERGE_UNIT, RING_LSE),
    _m("lse_merge_empty_accumulator", "burstc/ops/lse_merge.py",
       "torch.where(empty_acc, lse_blk, merged)",
       "torch.where(empty_acc, lse_acc_BHS, merged)",
       "an empty accumulator row keeps lse = -inf after its first block (runtime masks)",
       RUNTIME_UNIT, RUNTIME_RING),
    _m("stand_in_ratio", "burstc/ops/lse_merge.py",
       "delta / norm_sq, torch.zeros_like(norm_sq)",
       "delta / norm_sq.sqrt(), torch.zeros_like(norm_sq)",
       "stand-in output divided by the norm of dO instead of its square", MERGE_UNIT, RING_P2),
    _m("delta_lse_grad_sign", "burstc/ops/ring_loops.py",
       "delta_BHS = delta_BHS - grad_lse_BHS.to(ACC_DTYPE)",
       "delta_BHS = delta_BHS + grad_lse_BHS.to(ACC_DTYPE)",
       "the LSE gradient folded into delta with the wrong sign (burst plan)", RING_LSE),
    # --- ring loops / communication -----------------------------------------------------------------------
    _m("missing_last_return_hop", "burstc/ops/ring_loops.py",
       "    if size > 1:  # the last visitor's gradients go home",
       "    if False:  # the last visitor's gradients go home",
       "a missing dK/dV (dQ) return hop: the last visitor's gradients never go home", RING_P2),
    _m("returned_grads_not_added", "burstc/ops/ring_loops.py",
       "        _wait(requests)\n        _add_returned_(returned, own_travelling_grads)\n",
       "        _wait(requests)\n",
       "gradients returned during the loop are received but not added (P >= 3)", RING_P2, RING_P4),
    _m("grad_rows_of_travelling_side", "burstc/ops/ring_loops.py",
       "return block.q_rows if grad == _DQ else block.kv_rows",
       "return block.q_rows",
       "dK/dV accumulated at the query rows of a block (equal only for square diagonal blocks)",
       RING_STRIPED),
    _m("forward_block_ignores_causal", "burstc/ops/ring_loops.py",
       "return block_attention_forward(q_BHSD, k_BHSD, v_BHSD, block.causal, scale)",
       "return block_attention_forward(q_BHSD, k_BHSD, v_BHSD, False, scale)",
       "the forward computes causal blocks as full (the future leaks in)", RING_P2),
    _m("backward_block_treated_causal", "burstc/ops/ring_loops.py",
       "return block_attention_backward(*inputs, block.causal, scale, lse_grad)",
       "return block_attention_backward(*inputs, True, scale, lse_grad)",
       "the backward treats every block as causal (a mask treated as causal)", RING_P2),
    _m("ring_peer_direction", "burstc/ops/ring_comm.py",
       "dist.get_global_rank(self.group, (self.rank + offset) % self.size)",
       "dist.get_global_rank(self.group, (self.rank - offset) % self.size)",
       "ring offsets taken in the wrong direction (the same on 2 ranks, wrong from 3)", RING_P4),
    # --- block geometry / skipping ------------------------------------------------------------------------
    _m("striped_skip_off_by_one", "burstc/block_geometry.py",
       "return (Block(1, s, 0, s - 1, CAUSAL),) if s > 1 else ()",
       "return (Block(0, s, 0, s, CAUSAL),)",
       "off-by-one in striped block skipping: a later rank's key at the same local index is seen",
       PIECES, RING_STRIPED),
    _m("zigzag_half_swapped", "burstc/block_geometry.py",
       "return (Block(0, s, 0, half),) if kv_owner < q_owner else (Block(half, s, 0, s),)",
       "return (Block(0, s, 0, half),) if kv_owner > q_owner else (Block(half, s, 0, s),)",
       "zigzag: the earlier and later ranks' visible halves swapped", PIECES, RING_P2),
    _m("contiguous_skips_earlier", "burstc/block_geometry.py",
       "return (Block(0, s, 0, s),) if kv_owner < q_owner else ()",
       "return (Block(0, s, 0, s),) if kv_owner <= q_owner - 2 else ()",
       "contiguous: the neighbouring earlier shard skipped (off by one rank)", PIECES, RING_P2),
    _m("window_dropped", "burstc/block_geometry.py",
       "window = mask.term(SlidingWindow) or SlidingWindow(None, None)",
       "window = SlidingWindow(None, None)",
       "a dropped window: the geometry computes (and counts, and sends) full causal", MASK_UNIT, SKIP_UNIT),
    _m("window_left_off_by_one", "burstc/block_geometry.py",
       "first = q_positions - window.left if",
       "first = q_positions - window.left + 1 if",
       "a window one key narrower than asked in the geometry", MASK_UNIT, MASK_RING),
    _m("window_block_split", "burstc/block_geometry.py",
       "change[1:] = (lo[1:] != lo[:-1]) | (hi[1:] != hi[:-1])",
       "change[1:] = lo[1:] != lo[:-1]",
       "rows with different key intervals merged into one full block", MASK_UNIT, MASK_RING),
    _m("travelling_rows_wrong_side", "burstc/block_geometry.py",
       "return _pair_rows_seen(layout, terms, receiver, sender, local_len, world_size)[1]",
       "return _pair_rows_seen(layout, terms, receiver, sender, local_len, world_size)[0]",
       "K/V transfers send the query rows that see something instead of the key rows seen",
       SKIP_UNIT, MASK_RING),
    _m("documents_hide_touching_pair", "burstc/block_geometry.py",
       "(q_docs.amax(1) < kv_docs.amin(1))",
       "(q_docs.amax(1) <= kv_docs.amin(1))",
       "a pair sharing one document at its edge is skipped as hidden", RUNTIME_UNIT, RUNTIME_RING),
    _m("padding_mixed_keys_on_flash", "burstc/block_geometry.py",
       "            if kind == 2:\n                split.extend(_static_pieces(",
       "            if kind >= 1:\n                split.extend(_static_pieces(",
       "keys real in only some batch rows run the static kernel, which ignores the padding", RUNTIME_UNIT,
       RUNTIME_RING),
    _m("padding_causal_rows_from_zero", "burstc/block_geometry.py",
       "q0 = min(k0, rows) if block.mask == CAUSAL else 0",
       "q0 = min(k0 + 1, rows) if block.mask == CAUSAL else 0",
       "a causal block's padded-key piece starts a row late: the diagonal entry of its first key is lost",
       RUNTIME_UNIT, RUNTIME_RING),
    # --- the CUDA block kernels (glue to torch's fused kernels; emulated on CPU) ---------------------------
    _m("fused_flash_for_non_square_causal", "kernels/attention_blocks.py",
       "                and (square or not causal)):",
       "                ):",
       "a non-square causal block sent to the flash kernel, whose causal mask is bottom-right there", FUSED_BLOCKS),
    _m("fused_efficient_lse_padding_kept", "kernels/attention_blocks.py",
       "    return out, lse[:, :, :q_BHSD.shape[2]].to(ACC_DTYPE).contiguous()",
       "    return out, lse.to(ACC_DTYPE).contiguous()",
       "the memory-efficient kernel's LSE padded to 32 rows passed on as the block's statistics", FUSED_BLOCKS),
    _m("fused_gqa_grads_of_one_head", "kernels/attention_blocks.py",
       "    return dq, _sum_kv_heads(dk, groups), _sum_kv_heads(dv, groups)",
       "    return dq, dk[:, ::groups], dv[:, ::groups]",
       "GQA: the K/V gradient of one query head per group instead of the group's sum", FUSED_BLOCKS),
    # --- layouts and sequence ops -------------------------------------------------------------------------
    _m("zigzag_tail_chunk", "burstc/layout.py",
       "tail_chunk = 2 * world_size - 1 - rank",
       "tail_chunk = world_size + rank",
       "zigzag tail chunk not mirrored (rank r holds r and P + r: the layout is no longer balanced)",
       PIECES, RING_P2),
    _m("unshard_wrong_inverse", "burstc/layout.py",
       "inverse[perm] = torch.arange(perm.numel(), device=perm.device)",
       "inverse = perm",
       "wrong inverse permutation when unsharding", PIECES),
    _m("gather_seq_wrong_inverse", "burstc/ops/sequence.py",
       "full[positions] = torch.cat(chunks)",
       "full = torch.cat(chunks)[positions]",
       "gather_seq applies the layout's permutation instead of its inverse", MODEL_GATHER),
    _m("grad_reduced_twice", "burstc/ops/sequence.py",
       "return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), \"sum\", group_name))",
       "once = funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), \"sum\", group_name))\n"
       "    return funcol.wait_tensor(funcol.all_reduce(once, \"sum\", group_name))",
       "a parameter gradient all-reduced twice", MODEL_GQA),
    _m("prefetch_posts_grad_out_stand_in", "burstc/ops/ring_loops.py",
       "    return (0, 2) if plan.queries_travel else (0, 1)",
       "    return (0, 1) if plan.queries_travel else (0, 1)",
       "a prefetched burst backward sends dO's stand-in (its queries) ahead instead of the LSE: the visited rank "
       "computes with Q as dO", PREFETCH_BURST),
    _m("replicated_grads_whole_on_every_rank", "burstc/ops/sequence.py",
       "    return grad / world_size",
       "    return grad",
       "reduce_grads=False: a replicated graph's gradients left whole on every rank (the caller's sum counts them P "
       "times)", SHARE_GRADS),
    _m("unshard_grad_wrong_positions", "burstc/ops/sequence.py",
       "positions = _positions(group_name, total, layout, grad.device, chunk_owners)",
       "positions = _positions(group_name, total, \"contiguous\", grad.device, chunk_owners)",
       "the shard's backward scatters the gradient in contiguous order whatever the layout", SHARD_SEQ_GRAD, MODEL_LAYOUTS),
    # --- the loss -------------------------------------------------------------------------------------------
    _m("local_token_count", "passes/shard.py",
       "valid = graph.call_function(operator.ne, (target, ignore_index))",
       "valid = graph.call_function(operator.ne, (target_local, ignore_index))",
       "the fused loss's mean divides by the local instead of the global token count", MODEL_GQA),
    _m("padded_targets_not_ignored", "passes/shard.py",
       "(target, d, group_name, layout, padded_len, float(PADDING_TARGET),",
       "(target, d, group_name, layout, padded_len, 0.0,",
       "targets of padded positions get class 0 instead of ignore_index", MODEL_PADDED),
    _m("ce_local_token_count", "passes/shard.py",
       "count = graph.call_method(\"sum\", (graph.call_function(operator.ne, (target, ignore_index)),))",
       "count = graph.call_method(\"sum\", (graph.call_function(operator.ne, (target_local, ignore_index)),))",
       "the unfused cross-entropy's mean divides by the local token count", MODEL_CE),
    _m("lce_mean_grad_not_normalised", "burstc/ops/linear_cross_entropy.py",
       "token_grad_scale = torch.reciprocal(normalizer).expand(num_tokens)",
       "token_grad_scale = torch.ones_like(normalizer).expand(num_tokens)",
       "the fused loss's gradients are those of the sum, not the mean", LCE_OP),
    _m("lce_label_smoothing_sign", "kernels/linear_cross_entropy.py",
       "smoothing * (log_sumexp_B + (max_B - mean_logit_B))",
       "smoothing * (log_sumexp_B + (mean_logit_B - max_B))",
       "label smoothing term with the wrong sign", LCE_OP),
    _m("lce_smoothing_mean_off_by_one", "kernels/linear_cross_entropy.py",
       "mean_logit_B = work.sum(dim=1) / vocab if smoothing else None",
       "mean_logit_B = work.sum(dim=1) / (vocab - 1) if smoothing else None",
       "label smoothing's mean logit over V - 1 classes", LCE_OP),
    _m("shift_targets_padded_on_the_wrong_side", "passes/fuse_lm_head_loss.py",
       "pad = [0, 0] * (len(lead_shape) - 1 - dim) + [before, after]",
       "pad = [0, 0] * (len(lead_shape) - 1 - dim) + [after, before]",
       "the next-token shift's targets padded at the front: every token scored against its own label", FUSE),
    _m("shift_targets_padded_with_a_real_class", "passes/fuse_lm_head_loss.py",
       'padded = graph.call_function(F.pad, (target, pad), {"value": match.ignore_index})',
       'padded = graph.call_function(F.pad, (target, pad), {"value": 0})',
       "the position the shift cut gets class 0 instead of ignore_index: one extra token in the loss", FUSE),
    _m("additive_bias_dropped_when_folded", "passes/detect_attention.py",
       '        args = (found["bias"], found["mask"][1])\n',
       '        args = (found["mask"][1], 0.0)\n',
       "(scores + alibi) + mask folded to the mask alone: the ALiBi bias lost", DETECT),
    _m("autocast_scores_read_the_uncast_query", "passes/detect_attention.py",
       "    scores.replace_input_with(q, q_cast)\n",
       "",
       "a manual attention under autocast keeps its scores on the fp32 query: the cast q is read by nothing, so "
       "the ring can't replace the attention (refused, replicated)", DETECT, MODEL_AUTOCAST),
    _m("autocast_mask_left_in_fp32", "passes/detect_attention.py",
       "            mask_node, = _cast_in_graph(gm, [mask_node], q_dtype, fake_mode)\n",
       "            pass\n",
       "an additive fp32 mask on bf16 scores (a model run under autocast) not cast: refused as a dtype mismatch", DETECT),
    _m("merged_rows_cat_along_the_rows", "burstc/sharding/rules.py",
       "    if node.target is not torch.stack and out_dim == placement.dim:\n"
       "        raise Refused(CODES.cat_sequence, f\"`{op_name(node)}` along merged batch and sequence rows\", node)\n",
       "",
       "values on merged rows concatenated along those rows taken as still on them (each rank's pieces "
       "interleaved wrongly)", RULES),
    _m("fuse_drops_softcap", "passes/fuse_lm_head_loss.py",
       "label_smoothing=match.label_smoothing, softcap=match.softcap, chunk_size=chunk)",
       "label_smoothing=match.label_smoothing, softcap=None, chunk_size=chunk)",
       "the fused loss drops the logits' soft-cap", FUSE),
    _m("fuse_drops_logit_scale", "passes/fuse_lm_head_loss.py",
       "            if match.logit_scale is not None:\n                kwargs[\"logit_scale\"]",
       "            if False:\n                kwargs[\"logit_scale\"]",
       "the fused loss drops the logits' scale factor", FUSE),
    _m("fuse_drops_logit_divisor", "passes/fuse_lm_head_loss.py",
       "            if match.logit_divisor is not None:\n                kwargs[\"logit_divisor\"]",
       "            if False:\n                kwargs[\"logit_divisor\"]",
       "the fused loss drops the logits' divisor (Granite's logits_scaling)", FUSE),
    _m("lce_divisor_inverted", "kernels/linear_cross_entropy.py",
       "return logits.div_(logit_divisor) if in_place else logits / logit_divisor",
       "return logits.mul_(1.0 / logit_divisor) if in_place else logits * (1.0 / logit_divisor)",
       "a logit divisor multiplied by its reciprocal (the last bit differs from the model's quotient)", LCE_OP),
    # --- kernels ----------------------------------------------------------------------------------------------
    _m("masked_kernel_unscaled", "kernels/masked_attention_blocks.py",
       "scores = (q_chunk @ k_cols.transpose(-1, -2)) * scale",
       "scores = q_chunk @ k_cols.transpose(-1, -2)",
       "the position-masked kernel forgets the softmax scale", MASK_UNIT),
    _m("alibi_sign", "kernels/masked_attention_blocks.py",
       "slopes_H11 * (kv_pos[None, :] - q_pos[:, None])",
       "slopes_H11 * (q_pos[:, None] - kv_pos[None, :])",
       "ALiBi bias with the wrong sign", MASK_UNIT),
    _m("softcap_not_divided", "kernels/masked_attention_blocks.py",
       "tanh = torch.tanh(scores / softcap.cap)",
       "tanh = torch.tanh(scores)",
       "attention soft-cap computed as c * tanh(s) instead of c * tanh(s / c)", MASK_UNIT),
    # --- passes: detection and classification ----------------------------------------------------------------
    _m("sdpa_treated_causal", "passes/detect_attention.py",
       "spec = MaskSpec.causal() if kwargs[\"is_causal\"] else MaskSpec.full()",
       "spec = MaskSpec.causal()",
       "an SDPA call without is_causal treated as causal", DETECT, MODEL_BIDIRECTIONAL),
    _m("manual_scale_divided_as_multiplied", "passes/detect_attention.py",
       "            scale /= node.args[1]",
       "            scale *= node.args[1]",
       "manual attention's scores / sqrt(d) read as scores * sqrt(d)", DETECT, E2E),
    _m("classification_window_off_by_one", "passes/mask_classification.py",
       "left_bound = None if left >= sq - 1 else left",
       "left_bound = None if left >= sq - 2 else left",
       "a window that hides only the farthest key classified as no window", DETECT),
    _m("classification_checks_first_chunk_only", "passes/mask_classification.py",
       "                       for start in range(0, sq, ROW_CHUNK)) else None",
       "                       for start in range(0, ROW_CHUNK, ROW_CHUNK)) else None",
       "a long mask checked against its spec on its first rows only (a hole further down passes)", DETECT),
    _m("flex_score_mod_ignored", "passes/flex_masks.py",
       "    if _is_identity(call.score_mod):\n        return (), None\n",
       "    if True:\n        return (), None\n",
       "a FlexAttention score_mod silently dropped", FLEX),
    _m("flex_documents_dropped", "passes/flex_masks.py",
       "spec = static & Documents(docs.name, ids=True)",
       "spec = static",
       "FlexAttention document ids dropped from the recognized mask", FLEX),
    _m("padded_batch_assumed_unpadded", "passes/assume_unpadded.py",
       "and not isinstance(example, FakeTensor) and not bool(example.all()):",
       "and not isinstance(example, FakeTensor) and False:",
       "a padded first batch is specialized as if unpadded", UNPADDED),
    # --- sharding rules -------------------------------------------------------------------------------------
    _m("transpose_rule", "burstc/sharding/rules.py",
       "return at_dim(analyzer.place(x), b if d == a else a if d == b else d)",
       "return at_dim(analyzer.place(x), d)",
       "transpose keeps the sharded dim's index", RULES),
    _m("unsqueeze_rule", "burstc/sharding/rules.py",
       "return at_dim(placement, placement.dim + 1 if k <= placement.dim else placement.dim)",
       "return at_dim(placement, placement.dim + 1 if k < placement.dim else placement.dim)",
       "unsqueeze before the sharded dim at its own index: off by one", RULES),
    _m("reduction_rule", "burstc/sharding/rules.py",
       "return at_dim(analyzer.place(x), d if keepdim else d - sum(1 for i in dims if i < d))",
       "return at_dim(analyzer.place(x), d)",
       "a reduction over an earlier dim keeps the sharded dim's index", RULES),
    # --- a mixture of experts' dispatch (rank-local sort, grouped matmul, un-permute) -------------------------
    _m("dispatch_arange_global", "burstc/sharding/dispatch_rules.py",
       "analyzer.plan.new_args[src] = ((_local_extent(analyzer, by.order),), dict(src.kwargs))",
       "pass",
       "the inverse permutation's arange keeps the whole sequence's slot count", MOE_RULES, MOE_MODELS),
    _m("dispatch_inverse_swapped", "burstc/sharding/dispatch_rules.py",
       "analyzer.plan.placement[dst] = RowIndex(target=by.order, order=by.target)",
       "analyzer.plan.placement[dst] = RowIndex(target=by.target, order=by.order)",
       "the inverse permutation typed as the permutation itself", MOE_RULES),
    _m("dispatch_histc_any_keys", "burstc/sharding/dispatch_rules.py",
       "    if not _indices_output(R.first_arg(sort)):",
       "    if False:",
       "group counts of sort keys that may fall below the histogram's range", MOE_RULES),
    _m("dispatch_grouped_mm_any_offsets", "burstc/sharding/dispatch_rules.py",
       "    if offsets != GroupSizes(rows_at.by, cumulative=True):",
       "    if not isinstance(offsets, GroupSizes):",
       "a grouped matmul with another sort's offsets", MOE_RULES),
    _m("dispatch_slots_per_token_any_divisor", "burstc/sharding/dispatch_rules.py",
       "or factors(target)[1] % k:",
       "or False:",
       "slot numbers divided by other than the slots per token", MOE_RULES),
    _m("reshape_rows_slots_dropped", "burstc/sharding/rules.py",
       "            return rows(j, new_outer, new_inner)",
       "            return rows(j, new_outer, 1)",
       "a reshape that merges each token's slots into its row forgets them", MOE_RULES, MOE_MODELS),
    _m("attention_sink_dropped", "passes/shard.py",
       "            if match is not None and match.sink is not None:",
       "            if False:",
       "attention sinks dropped: the ring's output taken as the softmax over keys and sink", SINKS),
    _m("sum_over_ranks_not_reduced", "passes/shard.py",
       "    for node in plan.sums_over_ranks:",
       "    for node in []:",
       "a sum over every token left as this rank's part (no all-reduce)", LOAD_BALANCE),
    _m("sum_over_ranks_partial_gradient_not_summed", "passes/shard.py",
       "        reduce = sum_all_reduce if node in plan.sums_with_partial_gradient else loss_all_reduce",
       "        reduce = loss_all_reduce",
       "a sum over every token added into the tokens gets an identity backward: each rank's gradient misses the "
       "other ranks' parts", ["tests/test_sharded_models.py", "-k", "sum_over_the_sequence or mean_over_the_sequence"]),
    _m("mean_over_ranks_local_count", "burstc/sharding/rules.py",
       "        analyzer.plan.means_over_ranks[node] = math.prod(shape) if dims is None else math.prod(shape[i] for i in dims)",
       "        analyzer.plan.means_over_ranks[node] = (math.prod(shape) if dims is None else math.prod(shape[i] for i in dims)) // analyzer.P",
       "a mean over the sequence divided by the local instead of the whole count", RULES),
    _m("sum_over_ranks_counts_pads", "burstc/sharding/rules.py",
       "    if analyzer.padded_len != analyzer.S:",
       "    if False:",
       "a sum over every token counts the rows the layout pads in", RULES, LOAD_BALANCE),
    _m("padding_key_blocks_kept", "burstc/ops/ring_loops.py",
       "found = tuple(b for b in found if intersect_runs(((b.kv_start, b.kv_stop),), valid))",
       "found = tuple(found)",
       "a block whose every key is padding is kept though its rows never travel (raises on some ranks, hangs the rest)",
       ["tests/test_ring_runtime_masks.py", "-k", "all_padding"]),
    _m("histc_pads_fill_in_range", "burstc/sharding/rules.py",
       "fill=lo - 1)  # histc ignores values below",
       "fill=lo)  # histc ignores values below",
       "the layout's pads get the histogram's lowest value instead of one below its range: counted in bin 0",
       LOAD_BALANCE),
    _m("merged_rows_split_wrong", "passes/shard.py",
       "(x, tuple(shape[:d] + [where.outer, length, where.inner] + shape[d + 1:])))",
       "(x, tuple(shape[:d] + [length, where.outer, where.inner] + shape[d + 1:])))",
       "merged (batch, token) rows split token-major before they are sharded (a flat mask) or gathered (an output)",
       MERGED_OUTPUTS, LOAD_BALANCE),
    # --- head groups (burstc/ops/head_groups.py) -------------------------------------------------------------
    _m("head_groups_gqa_interleaved", "burstc/ops/head_groups.py",
       "return [(slice(g * per_kv * ratio, (g + 1) * per_kv * ratio), slice(g * per_kv, (g + 1) * per_kv))",
       "return [(slice(g, heads_q, groups), slice(g * per_kv, (g + 1) * per_kv))",
       "a group's query heads taken as if head h read K/V head h % Hkv (repeat instead of repeat_interleave)",
       HEAD_GROUPS),
    _m("head_groups_split_score_mods", "burstc/ops/head_groups.py",
       "if world_size < 2 or score_mods or heads_kv < 2:",
       "if world_size < 2 or heads_kv < 2:",
       "a mask with per-head score mods (ALiBi slopes) split into head groups, each reading the first slopes",
       HEAD_GROUPS),
    # --- planner --------------------------------------------------------------------------------------------
    _m("planner_choice_inverted", "burstc/planner.py",
       "chosen = \"burst\" if per_call[\"burst\"] < per_call[\"kv_ring\"] else \"kv_ring\"",
       "chosen = \"burst\" if per_call[\"burst\"] > per_call[\"kv_ring\"] else \"kv_ring\"",
       "the planner picks the more expensive backward", PLANNER),
    _m("planner_return_step_off_by_one", "burstc/planner.py",
       "if op != \"forward\" and step - 1 >= 1:",
       "if op != \"forward\" and step - 1 >= 0:",
       "predicted transfers count a gradient return at the first step", PLANNER, SKIP_UNIT),
    # --- checkpoint_keep: part of each attention's output kept ------------------------------------------------
    _m("kept_rows_wrong_end", "burstc/kept_rows.py",
       "(part, 2, rest, local_rows), fake_mode)",
       "(part, 2, 0, kept_rows), fake_mode)",
       "the forward keeps the first rows instead of the last (the backward concatenates them as the last)",
       KEPT_MODELS),
    _m("first_rows_forward_unrestricted", "burstc/ops/ring_attention.py",
       "        data = dataclasses.replace(data, query_rows=query_rows)\n",
       "        pass\n",
       "the recompute's ring forward runs every row (right values, a whole forward's compute and bytes)", KEPT_OP),
    _m("clip_causal_keeps_width", "burstc/block_geometry.py",
       "width = min(rows, block.kv_stop - block.kv_start)",
       "width = block.kv_stop - block.kv_start",
       "a clipped causal block keeps its keys: the recompute sends key rows its first rows never see", KEPT_OP),
]


# ----------------------------------------------------------------------------------------------------------------
# The copy

def _tracked_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                         capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p]


def make_copy(workdir: Path) -> Path:
    """A fresh copy of the repository's files under ``workdir/repo`` with the package-dir links."""
    copy = workdir / "repo"
    if copy.exists():
        shutil.rmtree(copy)
    for rel in _tracked_files(REPO):
        src = REPO / rel
        if src.is_file():
            dst = copy / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    for sub in ("passes", "kernels"):  # pyproject's package-dir: burstc.passes -> passes/, burstc.kernels -> kernels/
        (copy / "burstc" / sub).symlink_to(Path("..") / sub)
    return copy


def _env(copy: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_copy_is_imported(copy: Path) -> None:
    probe = ("import burstc, burstc.passes, burstc.kernels, burstc.ops.ring_loops as r; "
             "print(burstc.__file__); print(burstc.passes.__file__); print(burstc.kernels.__file__); print(r.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=_env(copy), check=True,
                         capture_output=True, text=True).stdout.split()
    outside = [f for f in out if not Path(f).resolve().is_relative_to(copy.resolve())]
    if outside:
        raise SystemExit(f"the copy at {copy} is not what imports: {outside}")


# ----------------------------------------------------------------------------------------------------------------
# Running

@dataclasses.dataclass
class Result:
    mutant: Mutant
    status: str  # killed / survived / timeout / unapplied
    detail: str
    seconds: float


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def _kill_session(proc: subprocess.Popen) -> None:
    """End pytest's process group (started as its own session): the worker ranks included."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        return
    proc.communicate()


def run_tests(copy: Path, args: tuple[str, ...], timeout_s: float) -> tuple[str, str]:
    """(``"passed"`` / ``"failed"`` / ``"timeout"``, detail) of one pytest selection in the copy."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE", *args]
    proc = subprocess.Popen(cmd, cwd=copy, env=_env(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        return "timeout", f"no result within {timeout_s:.0f} s: {' '.join(args)}"
    finally:
        _kill_session(proc)  # worker processes a failed run left behind go too
    if proc.returncode == 0:
        return "passed", ""
    if proc.returncode == 5:
        raise SystemExit(f"no tests selected by {' '.join(args)}: fix the selection")
    found = _FAILED.search(out)
    return "failed", found.group(1) if found else f"pytest exit {proc.returncode}: {out.strip().splitlines()[-1:]}"


def syntax_error(source: str, path: str) -> str:
    """Why ``source`` does not compile ("" when it does): such a mutant would be "killed" by any import."""
    try:
        compile(source, path, "exec")
    except SyntaxError as err:
        return f"does not compile: {err.msg} (line {err.lineno})"
    return ""


def run_mutant(copy: Path, mutant: Mutant, timeout_s: float) -> Result:
    start = time.monotonic()
    target = copy / mutant.path
    original = target.read_bytes()
    try:
        patched = mutant.patched(original.decode())
    except ValueError as err:
        return Result(mutant, "unapplied", str(err), 0.0)
    syntax = syntax_error(patched, mutant.path)
    if syntax:  # a mutant no test needs to notice: every import of the file would fail
        return Result(mutant, "unapplied", syntax, 0.0)
    target.write_text(patched)
    try:
        for args in mutant.tests:
            verdict, detail = run_tests(copy, args, timeout_s)
            if verdict == "failed":
                return Result(mutant, "killed", detail, time.monotonic() - start)
            if verdict == "timeout":
                return Result(mutant, "timeout", detail, time.monotonic() - start)
        return Result(mutant, "survived", "; ".join(" ".join(a) for a in mutant.tests), time.monotonic() - start)
    finally:
        target.write_bytes(original)


def table(results: list[Result]) -> str:
    lines = ["| mutant | file | bug | result | by / ran | s |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.mutant.name} | {r.mutant.path} | {r.mutant.why} | {r.status} | {r.detail} | "
                     f"{r.seconds:.0f} |")
    return "\n".join(lines)


def score(results: list[Result]) -> str:
    counted = [r for r in results if r.status != "unapplied"]
    dead = [r for r in counted if r.status in ("killed", "timeout")]
    survivors = [r.mutant.name for r in counted if r.status == "survived"]
    unapplied = [r.mutant.name for r in results if r.status == "unapplied"]
    pct = 100.0 * len(dead) / len(counted) if counted else float("nan")
    text = f"mutation score: {len(dead)}/{len(counted)} killed ({pct:.1f}%)"
    text += f"; survivors: {', '.join(survivors) or 'none'}"
    if unapplied:
        text += f"; failed to apply: {', '.join(unapplied)}"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--baseline", action="store_true",
                        help="first run every selection unmutated (they must all pass)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test selection (default 600)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/burstc-mutants"),
                        help="where the copy of the repository goes (default /tmp/burstc-mutants)")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTANTS]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise SystemExit(f"duplicate mutant names: {sorted(duplicates)}")
    if args.list:
        for m in MUTANTS:
            try:
                m.patched((REPO / m.path).read_text())
                applies = "applies"
            except ValueError:
                applies = "DOES NOT APPLY"
            print(f"{m.name:38s} {m.path:38s} {applies:14s} {m.why}")
        return 0
    chosen = MUTANTS
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            raise SystemExit(f"unknown mutants: {sorted(unknown)} (see --list)")
        chosen = [m for m in MUTANTS if m.name in args.only]

    args.workdir.mkdir(parents=True, exist_ok=True)
    copy = make_copy(args.workdir)
    check_copy_is_imported(copy)
    if args.baseline:
        selections = list(dict.fromkeys(t for m in chosen for t in m.tests))
        for sel in selections:
            verdict, detail = run_tests(copy, sel, args.timeout)
            print(f"baseline {' '.join(sel)}: {verdict} {detail}", flush=True)
            if verdict != "passed":
                raise SystemExit("a selection fails without any mutant: mutation results would mean nothing")
    results = []
    for mutant in chosen:
        result = run_mutant(copy, mutant, args.timeout)
        results.append(result)
        print(f"{mutant.name}: {result.status} {result.detail} ({result.seconds:.0f} s)", flush=True)
    print()
    print(table(results))
    print()
    print(score(results))
    return 0 if all(r.status in ("killed", "timeout") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
