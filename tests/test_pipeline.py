"""The staged pass pipeline: the registry, AOT-stage hook points, typed facts and the report's views (one process)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import burstc
import burstc.passes as passes
from burstc.attention_ir import Documents, MaskSpec
from burstc.config import BurstConfig
from burstc.pass_context import GraphFacts, PassContext
from burstc.refusals import ALL_CODES
from burstc.report import Report

V, H = 37, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids, targets):
        return F.cross_entropy(self.head(torch.tanh(self.emb(ids))).view(-1, V), targets.view(-1))


def test_registry_declares_every_pass_once_with_a_stage_and_a_file():
    names = [p.name for p in passes.PASSES]
    assert len(names) == len(set(names)) and tuple(names) == passes.PASS_ORDER
    root = Path(passes.__file__).parent
    for spec in passes.PASSES:
        assert spec.stage in passes.STAGES
        assert (root / f"{spec.name}.py").exists(), spec.name
        assert callable(spec.load())
    # facts consumed were produced by an earlier pass of the registry
    produced = set()
    for spec in passes.PASSES:
        assert set(spec.consumes) <= produced | set(spec.produces) | {"dropped_outputs"}, spec.name
        produced |= set(spec.produces)
    assert set(produced) <= set(GraphFacts.__dataclass_fields__)
    with pytest.raises(ValueError, match="unknown stage"):
        passes.PassSpec("x", "post_grad", False, "nothing")


def test_passes_readme_lists_every_pass_and_fact():
    readme = (Path(passes.__file__).parent / "README.md").read_text()
    for spec in passes.PASSES:
        assert f"`{spec.name}`" in readme, spec.name
    for fact in GraphFacts.__dataclass_fields__:
        assert f"`{fact}`" in readme, fact


def _count_ops_pass(seen: list):
    def count_ops(gm, *, config, context):
        seen.append((context.pass_name, sum(n.op == "call_function" for n in gm.graph.nodes)))
        context.note = f"{seen[-1][1]} ops"
        return gm
    return count_ops


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_aot_stage_passes_run_on_forward_and_backward_graphs(monkeypatch, backend):
    """A pass registered for an AOT stage runs on that graph under both backends and is recorded."""
    seen = []
    extra = (passes.PassSpec("count_forward", "aot_forward", False, "test", function=_count_ops_pass(seen)),
             passes.PassSpec("count_backward", "aot_backward", False, "test", function=_count_ops_pass(seen)))
    monkeypatch.setattr(passes, "PASSES", passes.PASSES + extra)
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, V, (2, 5))
    cmodel = burstc.compile(model, backend=backend)
    loss = cmodel(ids, ids)
    loss.backward()
    assert [name for name, _ in seen] == ["count_forward", "count_backward"]
    assert all(ops > 0 for _, ops in seen)
    rep = burstc.report(cmodel)
    graphs = rep.graphs[0]
    assert {"count_forward", "count_backward", "forward", "backward"} <= set(graphs)
    runs = {p.name: p for p in rep.passes}
    assert runs["count_forward"].note == f"{seen[0][1]} ops"
    assert runs["count_backward"].note == f"{seen[1][1]} ops"
    torch.testing.assert_close(loss, model(ids, ids))


def test_report_starts_with_one_summary_line_per_graph():
    model = TinyLM()
    ids = torch.randint(0, V, (2, 5))
    cmodel = burstc.compile(model, backend="aot_eager")
    cmodel(ids, ids)
    text = str(burstc.report(cmodel))
    assert text.splitlines()[0] == "graph 0: one device (fused LM-head loss x1)"


def test_report_summary_names_sharding_or_the_top_reason():
    from burstc.pass_context import ShardingFact
    from burstc.report import SkipRecord

    rep = Report(BurstConfig(), world_size=4)
    sharded, replicated = rep.new_graph(), rep.new_graph()
    sharded.sharding = ShardingFact(world_size=4, layout="zigzag", plans=("burst", "burst", "kv_ring"),
                                    seq_len=64, padded_len=64)
    rep.skipped.append(SkipRecord("shard", "softmax_1", "", "softmax over the sequence dim", 1, "shard"))
    assert rep.summary(0) == "graph 0: sharded over 4 ranks (zigzag layout; attention plans: burst x2, kv_ring x1)"
    assert rep.summary(1) == "graph 1: replicated on 4 ranks: softmax over the sequence dim"


def test_report_tables_fold_long_cells():
    from burstc.report import SkipRecord

    rep = Report(BurstConfig(), world_size=1)
    rep.new_graph()
    reason = "word " * 60
    rep.skipped.append(SkipRecord("lm_head_loss", "n", "", reason.strip(), 0, "fuse_lm_head_loss",
                                  "lm_head_loss.unsupported_op"))
    table = str(rep).split("skipped:")[1].split("passes:")[0]
    lines = [line for line in table.splitlines() if line.strip()]
    assert len(lines) >= 5  # header, rule and the reason over several lines
    assert max(len(line) for line in lines) < 200
    assert sum(line.count("word") for line in lines) == 60


def test_skip_codes_are_registered_and_validated():
    context = PassContext(report=Report(BurstConfig()), graph_id=0)
    with pytest.raises(ValueError, match="unregistered refusal code"):
        context.skip("attention", "n", "why", code="attention.no_such_code")
    assert "attention.mask_runtime" in ALL_CODES and "lm_head_loss.logit_scale" in ALL_CODES


# -- detect_attention's typed facts, on captured Dynamo graphs (no process group needed) ------------------


def _detect(fn, *inputs, world_size=2):
    """detect_attention on ``fn``'s Dynamo graph -> (graph after the pass, context)."""
    from burstc.testing.graphs import detect_attention_in

    gm, context, _ = detect_attention_in(fn, *inputs, world_size=world_size)
    return gm, context


def test_detect_attention_records_a_causal_match_for_manual_softmax_attention():
    class ManualAttention(nn.Module):  # nanoGPT's fallback: a tril buffer
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.ones(8, 8).tril().view(1, 1, 8, 8))

        def forward(self, q, k, v):
            att = (q @ k.transpose(-2, -1)) * 0.25
            att = att.masked_fill(self.bias[:, :, :8, :8] == 0, float("-inf"))
            return F.softmax(att, dim=-1) @ v

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    _, context = _detect(ManualAttention(), q, k, v)
    (match,) = context.facts.attention.values()
    assert match.mask == MaskSpec.causal() and match.source == "manual" and match.shardable
    assert match.scale == 0.25 and match.heads_q == 2 and match.kv_heads == 2 and match.gqa_groups == 1
    assert [r.kind for r in context.report.rewrites] == ["attention_normal_form"]
    assert match.node.target is F.scaled_dot_product_attention


def test_detect_attention_refuses_a_runtime_mask_with_its_code():
    def attention(q, k, v, allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()
    _, context = _detect(attention, q, k, v, allowed)
    (match,) = context.facts.attention.values()
    assert not match.shardable and match.refusal.code == "attention.mask_runtime"
    assert context.report.rewrites == []


def test_detect_attention_undoes_repeat_kv_into_a_gqa_match():
    def attention(q, k, v):
        b, hkv, s, d = k.shape
        k = k[:, :, None].expand(b, hkv, 2, s, d).reshape(b, hkv * 2, s, d)
        v = v[:, :, None].expand(b, hkv, 2, s, d).reshape(b, hkv * 2, s, d)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    gm, context = _detect(attention, q, k, v)
    (match,) = context.facts.attention.values()
    assert match.mask.is_causal and match.heads_q == 4 and match.kv_heads == 2 and match.gqa_groups == 2
    assert match.notes == ("repeat_kv undone: kv heads travel unrepeated",)
    # the SDPA reads the kv-head inputs themselves now; the expand/reshape copies are gone
    assert match.key.op == "placeholder" and match.value.op == "placeholder"
    assert match.node.kwargs["enable_gqa"] is True
    assert not any(n.op == "call_method" and n.target in ("expand", "reshape") for n in gm.graph.nodes)


def test_readme_names_real_paths_and_exported_api():
    """Paths the README names exist, and every ``burstc.<name>(`` it shows is exported by ``burstc``."""
    import re

    root = Path(burstc.__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    paths = set(re.findall(r"`((?:burstc|passes|kernels|benchmarks|examples|tests)/[\w./-]*)`", readme))
    assert paths, "the README names no paths?"
    missing = sorted(p for p in paths if not (root / p.rstrip("/")).exists())
    assert not missing, f"README names paths that do not exist: {missing}"
    for name in set(re.findall(r"\bburstc\.(\w+)\(", readme)):
        assert hasattr(burstc, name), f"README shows burstc.{name}(...) but burstc does not export it"


def test_a_mask_every_layer_reads_is_classified_once(monkeypatch):
    """HF builds one mask that every layer reads: detection probes it once, not once per layer."""
    import burstc.passes.mask_classification as classification
    from burstc.testing import zoo

    calls = []
    probe = classification._classify_runtime_mask
    monkeypatch.setattr(classification, "_classify_runtime_mask", lambda *a: calls.append(a[1]) or probe(*a))
    model = zoo.hf_llama()  # 2 layers
    ids = zoo.hf_inputs()
    position_ids = zoo.packed_position_ids(*ids.shape)
    _, context = _detect(lambda i, p: model(input_ids=i, position_ids=p, use_cache=False).logits, ids, position_ids)
    matches = list(context.facts.attention.values())
    assert len(matches) == 2 and all(m.mask.term(Documents) is not None for m in matches)
    assert len(calls) == 1
