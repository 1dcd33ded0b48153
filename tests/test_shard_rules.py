"""The shard analysis's op rules, one process, no process group: capture a small Dynamo graph, run
:class:`burstc.sharding.analysis.Analyzer` for 4 ranks, check the placement of a node, the rewrites the
plan records, or the refusal code.  (The analysis reads only shapes; the multi-rank tests check the
numbers.)"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from burstc.config import BurstConfig
from burstc.passes import PassContext
from burstc.passes.shard import shard
from burstc.refusals import ALL_CODES, Refused
from burstc.report import Report
from burstc.sharding.analysis import Analyzer, find_sequence_length
from burstc.sharding.codes import CODES
from burstc.sharding.placements import REPLICATE, MergedRows, Shard, TuplePlacement
from burstc.sharding.rules import MERGED_RULES, REPLICATED_RULES, SHARDED_RULES
from burstc.testing.graphs import dynamo_graph

B, S, H, V, P = 1, 8, 16, 32, 4  # 4 ranks: s = 2 local tokens


capture_graph = dynamo_graph


def analyzer_for(fn, *inputs):
    gm = capture_graph(fn, *inputs)
    return Analyzer(gm, find_sequence_length(gm), P, BurstConfig())


def analyze(fn, *inputs):
    """The analyzer after a successful run (its ``plan`` filled in)."""
    analyzer = analyzer_for(fn, *inputs)
    analyzer.run()
    return analyzer


def refusal(fn, *inputs) -> Refused:
    analyzer = analyzer_for(fn, *inputs)
    with pytest.raises(Refused) as caught:
        analyzer.run()
    return caught.value


def node_of(analyzer, target, index=-1):
    """The ``index``-th node calling ``target`` (a function, or a method name)."""
    nodes = [n for n in analyzer.gm.graph.nodes if n.op in ("call_function", "call_method") and n.target == target]
    assert nodes, f"no {target} in\n{analyzer.gm.code}"
    return nodes[index]


def place_of(analyzer, target, index=-1):
    return analyzer.place(node_of(analyzer, target, index))


def tokens(batch=B):
    return torch.randint(0, V, (batch, S))


def embed(ids, table):
    return F.embedding(ids, table)


TABLE = torch.randn(V, H)


# -- where activations become sharded --------------------------------------------------------------
def test_embedding_shards_the_ids_along_the_sequence():
    analyzer = analyze(embed, tokens(), TABLE)
    emb = node_of(analyzer, F.embedding)
    assert analyzer.place(emb) == Shard(1)
    ids = emb.args[0]
    assert analyzer.plan.shard_inputs[emb] == {ids: 1}
    assert analyzer.place(ids) == REPLICATE


def test_positions_converted_to_float_are_sharded():
    analyzer = analyze(lambda ids: ids.float() * 2, tokens())
    assert place_of(analyzer, "float") == Shard(1)
    assert place_of(analyzer, operator.mul) == Shard(1)


def test_replicated_only_graph_stays_replicated():
    analyzer = analyze(lambda ids, w: (ids + 1, w * 2), tokens(), TABLE)
    assert place_of(analyzer, operator.add) == REPLICATE
    assert place_of(analyzer, operator.mul) == REPLICATE
    assert not analyzer.plan.shard_inputs


# -- pointwise ---------------------------------------------------------------------------------------
def test_pointwise_with_a_broadcast_replicated_operand_keeps_the_shard():
    bias = torch.randn(H)
    analyzer = analyze(lambda ids, t, b: torch.tanh(embed(ids, t) + b), tokens(), TABLE, bias)
    assert place_of(analyzer, operator.add) == Shard(1)
    assert place_of(analyzer, torch.tanh) == Shard(1)
    assert node_of(analyzer, operator.add) not in analyzer.plan.shard_inputs  # bias broadcasts, not sharded


def test_rope_table_with_full_sequence_is_sharded_to_line_up():
    cos = torch.randn(S, H)
    analyzer = analyze(lambda ids, t, c: embed(ids, t) * c, tokens(), TABLE, cos)
    mul = node_of(analyzer, operator.mul)
    assert analyzer.place(mul) == Shard(1)
    (table_input,) = analyzer.plan.shard_inputs[mul]
    assert analyzer.plan.shard_inputs[mul] == {table_input: 0}  # the [S, H] table's dim 0 lines up with S


class _TanhGelu(torch.autograd.Function):  # BLOOM's GELU: elementwise both ways
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.79788456 * (1 + 3 * 0.044715 * x * x))


class _CumulativeBackward(torch.autograd.Function):  # pointwise forward, a sum over the tokens in the backward
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.cumsum(1)


def test_custom_autograd_function_elementwise_both_ways_keeps_the_shard():
    analyzer = analyze(lambda ids, t: _TanhGelu.apply(embed(ids, t)) * 3, tokens(), TABLE.clone().requires_grad_())
    apply = node_of(analyzer, torch.ops.higher_order.autograd_function_apply)
    assert analyzer.place(apply) == TuplePlacement((Shard(1),))
    assert place_of(analyzer, operator.mul) == Shard(1)


def test_custom_autograd_function_with_a_non_elementwise_backward_is_refused():
    why = refusal(lambda ids, t: _CumulativeBackward.apply(embed(ids, t)) * 3, tokens(),
                  TABLE.clone().requires_grad_())
    assert why.code == CODES.unsupported_op, why


def test_operands_sharded_along_different_dims_are_refused():
    square = torch.randint(0, V, (S, S))  # batch == S: the transpose is a valid broadcast
    why = refusal(lambda ids, t: embed(ids, t) + embed(ids, t).transpose(0, 1), square, TABLE)
    assert why.code == CODES.misaligned_operands and why.reason == "operands sharded along different dims"


@pytest.mark.parametrize("op,target,expected", [
    (lambda x: x.unsqueeze(1), "unsqueeze", Shard(2)),  # a dim inserted at the sequence dim's own index moves it
    (lambda x: x.unsqueeze(0), "unsqueeze", Shard(2)),
    (lambda x: x.unsqueeze(2), "unsqueeze", Shard(1)),  # inserted after it: it stays
    (lambda x: x.sum(0), "sum", Shard(0)),  # an earlier dim reduced away: the sequence dim moves down
    (lambda x: x.sum(0, keepdim=True), "sum", Shard(1)),
    (lambda x: x.sum(-1), "sum", Shard(1)),
])
def test_dims_inserted_or_reduced_before_the_sequence_move_it(op, target, expected):
    analyzer = analyze(lambda ids, t: op(embed(ids, t)), tokens(), TABLE)
    assert place_of(analyzer, target) == expected


# -- position-wise ops -------------------------------------------------------------------------------
def test_linear_and_layer_norm_over_the_hidden_dim_keep_the_shard():
    weight, gamma = torch.randn(H, H), torch.ones(H)
    analyzer = analyze(lambda ids, t, w, g: F.layer_norm(F.linear(embed(ids, t), w), (H,), g),
                       tokens(), TABLE, weight, gamma)
    assert place_of(analyzer, F.linear) == Shard(1)
    assert place_of(analyzer, F.layer_norm) == Shard(1)


def test_dropout_in_training_is_refused():
    why = refusal(lambda ids, t: F.dropout(embed(ids, t), p=0.1, training=True), tokens(), TABLE)
    assert why.code == CODES.dropout_in_training


# -- reshapes and dim moves --------------------------------------------------------------------------
def test_view_keeping_the_sequence_dim_gets_local_shape_constants():
    analyzer = analyze(lambda ids, t: embed(ids, t).view(B, S, 4, H // 4), tokens(), TABLE)
    view = node_of(analyzer, "view")
    assert analyzer.place(view) == Shard(1)
    assert analyzer.plan.new_args[view][0][1] == (B, S // P, 4, H // 4)


def test_view_merging_batch_rows_at_batch_two_and_back():
    def fn(ids, t):
        rows = embed(ids, t).view(-1, H)
        return (rows * 2).view(2, S, H)

    analyzer = analyze(fn, tokens(batch=2), TABLE)
    merge, split_back = node_of(analyzer, "view", 0), node_of(analyzer, "view", 1)
    assert analyzer.place(merge) == MergedRows(0, 2)
    assert analyzer.plan.new_args[merge][0][1] == (2 * S // P, H)
    assert place_of(analyzer, operator.mul) == MergedRows(0, 2)
    assert analyzer.place(split_back) == Shard(1)
    assert analyzer.plan.new_args[split_back][0][1] == (2, S // P, H)


def test_view_splitting_the_sequence_dim_is_refused():
    why = refusal(lambda ids, t: embed(ids, t).view(B, 2, S // 2, H), tokens(), TABLE)
    assert why.code == CODES.reshapes_sequence and "merges or splits the sequence dim" in why.reason


def test_transpose_and_permute_move_the_sequence_dim():
    analyzer = analyze(lambda ids, t: (embed(ids, t).transpose(1, 2), embed(ids, t).permute(1, 0, 2)),
                       tokens(), TABLE)
    assert place_of(analyzer, "transpose") == Shard(2)
    assert place_of(analyzer, "permute") == Shard(0)


# -- indexing, split, cat ------------------------------------------------------------------------------
def test_slicing_other_dims_passes_and_slicing_the_sequence_is_refused():
    analyzer = analyze(lambda ids, t: embed(ids, t)[..., : H // 2], tokens(), TABLE)
    assert place_of(analyzer, operator.getitem) == Shard(1)
    why = refusal(lambda ids, t: embed(ids, t)[:, : S // 2], tokens(), TABLE)
    assert why.code == CODES.slices_sequence and why.reason == "slices or indexes the sequence dim"


def test_split_along_hidden_gives_a_tuple_placement():
    analyzer = analyze(lambda ids, t: embed(ids, t).split(H // 2, dim=-1)[1], tokens(), TABLE)
    assert place_of(analyzer, "split") == TuplePlacement((Shard(1), Shard(1)))
    assert place_of(analyzer, operator.getitem) == Shard(1)


def test_cat_along_hidden_shards_a_replicated_part_and_cat_along_the_sequence_is_refused():
    extra = torch.randn(B, S, H)
    analyzer = analyze(lambda ids, t, e: torch.cat([embed(ids, t), e], dim=-1), tokens(), TABLE, extra)
    cat = node_of(analyzer, torch.cat)
    assert analyzer.place(cat) == Shard(1)
    assert list(analyzer.plan.shard_inputs[cat].values()) == [1]
    why = refusal(lambda ids, t: torch.cat([embed(ids, t), embed(ids, t)], dim=1), tokens(), TABLE)
    assert why.code == CODES.cat_sequence and why.reason == "cat along the sequence dim"


def test_cat_and_stack_of_merged_rows_along_another_dim_keep_the_rows():
    """Phi-MoE's sparsemixer at batch 2: per-token ``[B * S, 1]`` values concatenated to ``[B * S, 2]``."""
    def fn(ids, t, how):
        rows = embed(ids, t).view(-1, H)
        first, second = rows.sum(-1, keepdim=True), rows.amax(-1, keepdim=True)
        if how == "cat":
            return torch.cat([first, second], dim=-1) * 2
        if how == "stack":
            return torch.stack([first, second], dim=0) * 2
        return torch.cat([first, second], dim=0)  # along the merged rows themselves

    assert place_of(analyze(fn, tokens(batch=2), TABLE, "cat"), torch.cat) == MergedRows(0, 2)
    assert place_of(analyze(fn, tokens(batch=2), TABLE, "stack"), torch.stack) == MergedRows(1, 2)
    why = refusal(fn, tokens(batch=2), TABLE, "rows")
    assert why.code == CODES.cat_sequence and "along merged batch and sequence rows" in why.reason
    mixed = refusal(lambda ids, t: torch.cat([embed(ids, t).view(-1, H), torch.randn(2 * S, 1)], dim=-1),
                    tokens(batch=2), TABLE)
    assert mixed.code == CODES.merged_rows and "not all on the same merged" in mixed.reason


# -- softmax, reductions, matmul -------------------------------------------------------------------------
def test_softmax_over_hidden_passes_and_over_the_sequence_is_refused():
    analyzer = analyze(lambda ids, t: embed(ids, t).softmax(dim=-1), tokens(), TABLE)
    assert place_of(analyzer, "softmax") == Shard(1)
    why = refusal(lambda ids, t: embed(ids, t).softmax(dim=1), tokens(), TABLE)
    assert why.code == CODES.mixes_positions and why.reason == "softmax over the sequence dim"


def test_reduction_over_hidden_passes_and_over_the_sequence_is_refused():
    analyzer = analyze(lambda ids, t: embed(ids, t).mean(dim=-1), tokens(), TABLE)
    assert place_of(analyzer, "mean") == Shard(1)
    why = refusal(lambda ids, t: embed(ids, t).amax(dim=1), tokens(), TABLE)
    assert why.code == CODES.reduces_sequence and why.reason == "`.amax` reduces over the sequence dim"
    why = refusal(lambda ids, t: embed(ids, t).amax(), tokens(), TABLE)
    assert why.code == CODES.reduces_sequence and "all dims" in why.reason


def test_a_sum_over_the_sequence_is_summed_over_the_ranks():
    # each rank sums its own tokens; the rewrite all-reduces right after (identity backward), so it is replicated
    for fn in (lambda ids, t: embed(ids, t).sum(dim=1) * 2, lambda ids, t: embed(ids, t).float().sum() * 2,
               lambda ids, t: torch.histc(embed(ids, t).argmax(-1).float(), bins=4, min=0, max=3) * 2):
        analyzer = analyze(fn, tokens(), TABLE)
        (summed,) = analyzer.plan.sums_over_ranks
        assert analyzer.place(summed) == REPLICATE and place_of(analyzer, operator.mul) == REPLICATE
    # counts over the data's own range would be each rank's own range
    why = refusal(lambda ids, t: torch.histc(embed(ids, t), bins=4), tokens(), TABLE)
    assert why.code == CODES.reduces_sequence and "own range" in why.reason


def test_a_mean_over_the_sequence_is_a_sum_over_the_ranks_over_the_whole_count():
    for fn, count in ((lambda ids, t: embed(ids, t).mean(dim=1) * 2, S),
                      (lambda ids, t: embed(ids, t).mean(dim=(0, 1)) * 2, B * S),
                      (lambda ids, t: torch.mean(embed(ids, t).float()) * 2, B * S * H)):
        analyzer = analyze(fn, tokens(), TABLE)
        (summed,) = analyzer.plan.sums_over_ranks
        assert analyzer.plan.means_over_ranks == {summed: count}
        assert analyzer.place(summed) == REPLICATE and place_of(analyzer, operator.mul) == REPLICATE


def test_a_sum_over_the_sequence_masks_the_rows_the_layout_pads():
    # 8 tokens padded to 12 on 4 ranks: the pads' rows get the fill (0 for a sum, below the range for histc) first
    for fn, fill in ((lambda ids, t: embed(ids, t).sum(dim=1), 0.0),
                     (lambda ids, t: torch.histc(embed(ids, t).argmax(-1).float(), bins=4, min=0, max=3), -1)):
        gm = capture_graph(fn, tokens(), TABLE)
        analyzer = Analyzer(gm, S, P, BurstConfig(), padded_len=S + P)
        analyzer.run()
        ((node, (summed, where, masked_fill)),) = analyzer.plan.pads_masked.items()
        assert analyzer.plan.sums_over_ranks == [node] and summed == 0 and masked_fill == fill
        assert where == Shard(1)
    # a sum whose rows are not the token rows (summed over the sequence after a transpose is still rows; a full
    # reduction of a replicated value is not a sum over ranks at all): nothing else is masked
    gm = capture_graph(lambda ids, t: embed(ids, t).sum(dim=-1), tokens(), TABLE)
    analyzer = Analyzer(gm, S, P, BurstConfig(), padded_len=S + P)
    analyzer.run()
    assert not analyzer.plan.pads_masked and not analyzer.plan.sums_over_ranks


def test_matmul_with_a_weight_keeps_the_rows_and_contracting_over_the_sequence_is_refused():
    weight = torch.randn(H, 4)
    analyzer = analyze(lambda ids, t, w: embed(ids, t) @ w, tokens(), TABLE, weight)
    assert place_of(analyzer, operator.matmul) == Shard(1)
    why = refusal(lambda ids, t: embed(ids, t).transpose(1, 2) @ embed(ids, t), tokens(), TABLE)
    assert why.code == CODES.contracts_sequence and "contracts over the sequence dim" in why.reason


# -- attention -----------------------------------------------------------------------------------------
def heads(ids, t):
    return embed(ids, t).view(B, S, 2, H // 2).transpose(1, 2)  # [B, heads, S, D]


def test_causal_attention_on_sharded_heads_is_planned_as_ring_attention():
    analyzer = analyze(lambda ids, t: F.scaled_dot_product_attention(heads(ids, t), heads(ids, t), heads(ids, t),
                                                                     is_causal=True), tokens(), TABLE)
    sdpa = node_of(analyzer, F.scaled_dot_product_attention)
    assert analyzer.place(sdpa) == Shard(2)
    assert analyzer.plan.attention == [sdpa]


def test_attention_with_a_mask_is_refused():
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    why = refusal(lambda ids, t, m: F.scaled_dot_product_attention(heads(ids, t), heads(ids, t), heads(ids, t),
                                                                   attn_mask=m), tokens(), TABLE, mask)
    assert why.code == CODES.attention_mask
    assert why.reason == "attention with an attention mask (masks are not supported by the ring op yet)"


@pytest.mark.parametrize("padded", [False, True])
def test_attention_whose_mask_needs_runtime_data(padded):
    """A match with a Documents term is planned (the rewrite feeds the op the ids), also when the layout pads the
    sequence (the rewrite extends the ids over the pads, which get a document of their own)."""
    from burstc.attention_ir import AttentionMatch, Documents, MaskSpec

    analyzer = analyzer_for(lambda ids, t: F.scaled_dot_product_attention(heads(ids, t), heads(ids, t),
                                                                          heads(ids, t), is_causal=True),
                            tokens(), TABLE)
    sdpa = node_of(analyzer, F.scaled_dot_product_attention)
    q, k, v = sdpa.args[:3]
    analyzer.attention_matches = {sdpa: AttentionMatch(sdpa, q, k, v, MaskSpec.causal() & Documents("l_ids_"))}
    if padded:
        analyzer.padded_len = analyzer.S + analyzer.P
    analyzer.run()
    assert analyzer.plan.attention == [sdpa]


def test_attention_on_a_replicated_operand_is_refused():
    value = torch.randn(B, 2, S, H // 2)
    why = refusal(lambda ids, t, v: F.scaled_dot_product_attention(heads(ids, t), heads(ids, t), v, is_causal=True),
                  tokens(), TABLE, value)
    assert why.code == CODES.attention_operands and "is not sharded" in why.reason


# -- losses ----------------------------------------------------------------------------------------------
def test_cross_entropy_on_merged_rows_at_batch_two():
    head = torch.randn(V, H)

    def fn(ids, t, w):
        logits = F.linear(embed(ids, t), w)
        return F.cross_entropy(logits.view(-1, V), ids.view(-1))

    analyzer = analyze(fn, tokens(batch=2), TABLE, head)
    ce = node_of(analyzer, F.cross_entropy)
    assert analyzer.place(node_of(analyzer, "view", 0)) == MergedRows(0, 2)
    assert analyzer.place(ce) == REPLICATE
    assert analyzer.plan.losses == [ce] and analyzer.plan.merged_rows[ce] == 2


def test_cross_entropy_with_class_weights_is_refused():
    head, weights = torch.randn(V, H), torch.rand(V)

    def fn(ids, t, w, cw):
        return F.cross_entropy(F.linear(embed(ids, t), w).view(-1, V), ids.view(-1), weight=cw)

    why = refusal(fn, tokens(), TABLE, head, weights)
    assert why.code == CODES.loss_arguments and why.reason == "cross_entropy with class weights on sharded logits"


# -- in-place writes, outputs ----------------------------------------------------------------------------
def test_in_place_write_of_sharded_values_into_a_replicated_tensor_is_refused():
    def fn(ids, t, buffer):
        buffer.add_(embed(ids, t))
        return buffer

    why = refusal(fn, tokens(), TABLE, torch.zeros(B, S, H))
    assert why.code == CODES.inplace_write and "writes sharded values into a replicated tensor" in why.reason


def test_a_sharded_output_is_gathered():
    analyzer = analyze(lambda ids, t: embed(ids, t) * 2, tokens(), TABLE)
    ((index, out),) = analyzer.plan.outputs_to_gather
    assert index == 0 and out is node_of(analyzer, operator.mul)


def test_unsupported_op_on_a_sharded_value_is_refused_with_its_name():
    why = refusal(lambda ids, t: torch.cumsum(embed(ids, t), dim=-1), tokens(), TABLE)
    assert why.code == CODES.unsupported_op
    assert why.reason == "op `cumsum` on a sharded value is not supported by the shard pass"


# -- the pass records the codes --------------------------------------------------------------------------
def run_pass(fn, *inputs):
    gm = capture_graph(fn, *inputs)
    config = BurstConfig()
    context = PassContext(report=Report(config, world_size=P), graph_id=0, world_size=P)
    before = gm.code
    assert shard(gm, config=config, context=context).code == before  # refused: the graph is untouched
    (skip,) = context.report.skipped
    return skip


def test_pass_records_the_refusal_code_and_reason():
    skip = run_pass(lambda ids, t: embed(ids, t).softmax(dim=1), tokens(), TABLE)
    assert skip.code == CODES.mixes_positions
    assert skip.reason == "softmax over the sequence dim; the whole graph runs unsharded (replicated on every rank)"


def test_pass_without_attention_or_loss_is_skipped_as_no_sequence_work():
    skip = run_pass(lambda ids, t: embed(ids, t) * 2, tokens(), TABLE)
    assert skip.code == CODES.no_sequence_work


def test_rule_tables_and_codes_are_consistent():
    for table in (REPLICATED_RULES, SHARDED_RULES, MERGED_RULES):
        families = [r.family for r in table]
        assert len(families) == len(set(families)), families
    assert all(ALL_CODES[code] for code in vars(CODES).values())
    assert all(code.startswith("shard.") for code in vars(CODES).values())
