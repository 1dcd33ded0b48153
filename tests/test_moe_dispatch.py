"""A mixture of experts' token dispatch under the shard analysis (one process, no ranks): the sort / gather /
grouped matmul / un-permute region is accepted only where every token's output stays its own, and the
rewrite's constants become this rank's.  The multi-rank equality with eager (HF MoE models, grouped and batched
experts, padded batches) is in ``tests/test_sharded_models.py``."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from burstc.config import BurstConfig
from burstc.refusals import Refused
from burstc.sharding.analysis import Analyzer, find_sequence_length
from burstc.sharding.codes import CODES
from burstc.sharding.placements import GroupSizes, MergedRows, Permuted, RowIndex, Shard
from burstc.testing.graphs import dynamo_graph

S, H, V, P, E, K = 8, 16, 32, 4, 4, 2  # 4 ranks: s = 2 local tokens, 4 local token slots
s = S // P


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(table=torch.randn(V, H, generator=g), router=torch.randn(E, H, generator=g),
                up=torch.randn(E, H, 2 * H, generator=g), down=torch.randn(E, 2 * H, H, generator=g))


def route(x_TH, router_EH, k=K):
    probs_TE = F.softmax(F.linear(x_TH, router_EH), dim=-1)
    top_w_TK, top_i_TK = torch.topk(probs_TE, k, dim=-1)
    return top_w_TK / top_w_TK.sum(dim=-1, keepdim=True), top_i_TK


def grouped_experts(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH, *, sort_key=None, histc=None, offsets_of=None,
                    descending=False):
    """HF's ``grouped_mm_experts_forward``, with hooks to plant what the analysis must refuse."""
    k = top_i_TK.shape[-1]
    expert_ids = top_i_TK.reshape(-1)
    ids_sorted, perm = torch.sort(expert_ids if sort_key is None else sort_key(expert_ids), descending=descending)
    x_sorted = x_TH[perm // k]
    w_sorted = top_w_TK.reshape(-1)[perm]
    counts = torch.histc(ids_sorted.float(), **(histc or dict(bins=E, min=0, max=E - 1)))
    if offsets_of is not None:
        counts = torch.histc(torch.sort(offsets_of(expert_ids))[0].float(), bins=E, min=0, max=E - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    bf16 = torch.bfloat16  # what F.grouped_mm takes on CPU
    hidden = F.silu(F.grouped_mm(x_sorted.to(bf16), up_EHF.to(bf16), offs=offsets))
    out = F.grouped_mm(hidden, down_EFH.to(bf16), offs=offsets).float() * w_sorted.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    return out[inverse].view(x_TH.shape[0], k, -1).sum(dim=1)


def batched_experts(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH):
    """HF's ``batched_mm_experts_forward``: every slot its own expert's weights, one bmm."""
    k = top_i_TK.shape[-1]
    x_slots = x_TH.repeat_interleave(k, dim=0)
    ids = top_i_TK.reshape(-1)
    hidden = F.silu(torch.bmm(x_slots.unsqueeze(1), up_EHF[ids]).squeeze(1))
    out = torch.bmm(hidden.unsqueeze(1), down_EFH[ids]).squeeze(1) * top_w_TK.reshape(-1).unsqueeze(-1)
    return out.view(x_TH.shape[0], k, -1).sum(dim=1)


def moe_model(experts, **planted):
    def forward(ids_BS, table, router, up, down):
        x_BSH = F.embedding(ids_BS, table)
        x_TH = x_BSH.view(-1, H)
        top_w, top_i = route(x_TH, router)
        return (x_TH + experts(x_TH, top_w, top_i, up, down, **planted)).view(x_BSH.shape) * 2
    return forward


def analyzer_for(fn, batch=1):
    w = weights()
    ids = torch.randint(0, V, (batch, S))
    gm = dynamo_graph(fn, ids, w["table"], w["router"], w["up"], w["down"], run=False)
    return Analyzer(gm, find_sequence_length(gm), P, BurstConfig())


def nodes(analyzer, target):
    found = [n for n in analyzer.gm.graph.nodes if n.op in ("call_function", "call_method") and n.target == target]
    assert found, f"no {target} in\n{analyzer.gm.code}"
    return found


@pytest.mark.parametrize("batch", [1, 2])
def test_grouped_dispatch_is_placed_per_rank_and_its_constants_made_local(batch):
    analyzer = analyzer_for(moe_model(grouped_experts), batch)
    analyzer.run()
    tokens = Shard(0) if batch == 1 else MergedRows(0, batch)
    slots = MergedRows(0, batch, K)
    (sort,) = nodes(analyzer, torch.sort)
    sorted_slots = Permuted(slots, sort.name)
    assert [analyzer.place(n) for n in nodes(analyzer, operator.getitem) if n.args[0] is sort] == [
        sorted_slots, RowIndex(target=slots, order=sorted_slots)]
    (floordiv,) = nodes(analyzer, operator.floordiv)
    assert analyzer.place(floordiv) == RowIndex(target=tokens, order=sorted_slots)
    (histc,) = nodes(analyzer, torch.histc)
    assert analyzer.place(histc) == GroupSizes(sort.name, cumulative=False)
    (cumsum,) = nodes(analyzer, torch.cumsum)
    assert analyzer.place(cumsum) == GroupSizes(sort.name, cumulative=True)
    assert [analyzer.place(n) for n in nodes(analyzer, torch._grouped_mm)] == [sorted_slots] * 2
    (inverse,) = nodes(analyzer, torch.empty_like)
    assert analyzer.place(inverse) == RowIndex(target=sorted_slots, order=slots)
    (arange,) = nodes(analyzer, torch.arange)
    assert analyzer.plan.new_args[arange][0] == (batch * s * K,)  # this rank's slot count, not S * K
    (view_back,) = [n for n in nodes(analyzer, "view") if len(n.args) == 4]
    assert analyzer.place(view_back) == tokens and analyzer.plan.new_args[view_back][0][1] == (batch * s, K, H)
    (out,) = [n for n in nodes(analyzer, operator.mul) if n.args[1] == 2]
    assert analyzer.place(out) == Shard(1)


def test_batched_dispatch_is_position_wise():
    analyzer = analyzer_for(moe_model(batched_experts), batch=2)
    analyzer.run()
    (repeat,) = nodes(analyzer, "repeat_interleave")
    assert analyzer.place(repeat) == MergedRows(0, 2, K)
    assert [analyzer.place(n) for n in nodes(analyzer, torch.bmm)] == [MergedRows(0, 2, K)] * 2
    (out,) = [n for n in nodes(analyzer, operator.mul) if n.args[1] == 2]
    assert analyzer.place(out) == Shard(1)


def capacity_limited(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH):
    """Switch-style capacity: a slot's rank within its expert counts the slots before it (other tokens')."""
    onehot = F.one_hot(top_i_TK.reshape(-1), E)
    position = (onehot.cumsum(0) * onehot).sum(-1)
    keep = (position <= 3).to(x_TH.dtype).view(-1, K)
    return batched_experts(x_TH, top_w_TK * keep, top_i_TK, up_EHF, down_EFH)


def expert_choice(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH):
    """Each expert picks its top tokens: a top-k along the tokens."""
    scores_TE = F.linear(x_TH, up_EHF[:, :, 0])
    picked = torch.topk(scores_TE, 2, dim=0).indices
    return x_TH * picked.sum()


def neighbour_row(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH):
    """Row numbers in arithmetic: a neighbour's row."""
    _, perm = torch.sort(top_i_TK.reshape(-1))
    return x_TH[(perm + 1) % perm.numel() // K].view(-1, K, H).sum(dim=1)


def wrong_divisor(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH):
    """Slot numbers divided by other than the slots per token: in bounds, but not each slot's own token."""
    _, perm = torch.sort(top_i_TK.reshape(-1))
    return x_TH[perm // (K + 1)].view(-1, K, H).sum(dim=1)


def global_inverse(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH):
    """The inverse written into a tensor of the whole sequence's extent, not this rank's."""
    _, perm = torch.sort(top_i_TK.reshape(-1))
    inverse = torch.empty(perm.shape[0], dtype=torch.long)
    inverse[perm] = torch.arange(perm.shape[0])
    slots_SH = x_TH.repeat_interleave(K, dim=0)[perm]
    return slots_SH[inverse].view(-1, K, H).sum(dim=1)


def wrong_target(x_TH, top_w_TK, top_i_TK, up_EHF, down_EFH):
    """Token numbers used on slot rows."""
    _, perm = torch.sort(top_i_TK.reshape(-1))
    slots_SH = x_TH.repeat_interleave(K, dim=0)
    return slots_SH[perm // K].view(-1, K, H).sum(dim=1)


@pytest.mark.parametrize("experts, code, words", [
    (capacity_limited, CODES.merged_rows, "cumsum"),
    (expert_choice, CODES.mixes_positions, "topk"),
    (lambda *a: grouped_experts(*a, histc=dict(bins=E, min=0, max=0)), CODES.unsupported_op, "range"),
    (lambda *a: grouped_experts(*a, descending=True), CODES.unsupported_op, "ascending"),
    (lambda *a: grouped_experts(*a, sort_key=lambda ids: ids * 2 - 3), CODES.unsupported_op, "top-k indices"),
    # the same keys sorted twice: equal counts, but the analysis asks for the rows' own sort (conservative)
    (lambda *a: grouped_experts(*a, offsets_of=lambda ids: ids), CODES.unsupported_op, "running sums"),
    (neighbour_row, CODES.unsupported_op, "RowIndex"),
    (wrong_divisor, CODES.unsupported_op, "slots per token"),
    (global_inverse, CODES.unsupported_op, "not shaped like this rank's rows"),
    (wrong_target, CODES.slices_sequence, "numbers rows"),
], ids=["capacity", "expert_choice", "histc_data_range", "descending", "keys_not_indices", "other_sort_offsets",
        "row_numbers_in_arithmetic", "slots_per_token", "whole_sequence_inverse", "numbers_of_another_value"])
def test_dispatch_that_is_not_per_token_is_refused(experts, code, words):
    analyzer = analyzer_for(moe_model(experts))
    with pytest.raises(Refused) as caught:
        analyzer.run()
    assert caught.value.code == code and words in caught.value.reason, caught.value


def test_row_numbers_as_an_output_are_refused():
    def returns_perm(ids_BS, table, router, up, down):
        x_TH = F.embedding(ids_BS, table).view(-1, H)
        return x_TH * 2, torch.sort(route(x_TH, router)[1].reshape(-1))[1]

    analyzer = analyzer_for(returns_perm)
    analyzer.run()
    assert analyzer.output_problem is not None and analyzer.output_problem.code == CODES.unsupported_op
