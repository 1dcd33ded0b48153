"""``burstc explain``: a model compiled as rank 0 of an 8 x 8 mesh at S = 1M on the meta device and a fake process
group, in seconds, without allocating the model or running a ring step; its bytes and rings are the planner's and the
cost model's for that shape."""
import functools
import importlib
import importlib.metadata
import math

import pytest
import torch

import burstc
from burstc.attention_ir import Causal, MaskSpec
from burstc.cli import peak_rss_bytes
from burstc.cost_model import DEVICES, choose_ring, ulysses_bytes
from burstc.ops import head_groups
from burstc.ops.ring_stats import record_stats
from burstc.ops.ulysses import hybrid_applies
from burstc.planner import cheaper_backward, masked_plan, predicted_double_ring_transfers, predicted_transfers
from burstc.testing.zoo import hf

pytest.importorskip("transformers")
explain_module = importlib.import_module("burstc.explain")
S_1M = 2**20
CAUSAL = MaskSpec((Causal(),))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _expected(nodes, per_node, B, Hq, Hkv, D, dtype, machine, seq_len=S_1M, layout="zigzag"):
    """(ring, backward plan, the busiest rank's bytes per link class) for a causal attention on a nodes x per_node
    mesh, straight from the planner and the cost model (what the shard pass should have asked them)."""
    args = (layout, CAUSAL, seq_len)
    transfers = {"double": predicted_double_ring_transfers(*args, nodes, per_node, B, Hq, Hkv, D, dtype),
                 "flat": predicted_transfers(*args, nodes * per_node, B, Hq, Hkv, D, dtype, per_node=per_node)}
    plan_of = {"double": cheaper_backward(transfers["double"]),
               "flat": masked_plan(*args, nodes * per_node, B, Hq, Hkv, D, dtype).plan}
    if hybrid_applies(layout, Hq, Hkv, per_node) is None:
        transfers["ulysses"] = predicted_transfers(*args, nodes, B, Hq // per_node, Hkv // per_node, D, dtype)
        plan_of["ulysses"] = cheaper_backward(transfers["ulysses"])
    ring, _ = choose_ring(*args, nodes, per_node, B, Hq, Hkv, D, dtype, plan_of.get, machine,
                          candidates=tuple(r for r in ("double", "ulysses", "flat") if r in plan_of))
    ops = {"forward": "forward", "backward": plan_of[ring]}
    found = transfers[ring]
    if ring == "ulysses":
        a2a = dict(zip(ops, ulysses_bytes(seq_len // (nodes * per_node), per_node, B, Hq, Hkv, D, dtype)))
        by_link = {kind: {"inter": max(found[op].sent), "intra": a2a[kind]} for kind, op in ops.items()}
    else:
        by_link = {kind: {link: max(links.get(link, 0) for links in found[op].sent_by_link) for link in ("inter", "intra")}
                   for kind, op in ops.items()}
    return ring, plan_of[ring], by_link


def _run(factory, **kwargs):
    rss_before = _rss_bytes()
    with record_stats() as stats:
        result = burstc.explain(factory, **kwargs)
    return result, peak_rss_bytes() - rss_before, stats


def _check_against_formulas(result, B, Hq, Hkv, D, dtype):
    ring, plan, by_link = _expected(*result.mesh_shape, B, Hq, Hkv, D, dtype, result.device.machine)
    name = {"double": "double 8x8", "ulysses": "ulysses_ring 8x8", "flat": "flat"}[ring]
    for attention in result.attentions:
        assert (attention.ring, attention.plan) == (name, plan)
        assert sum(n for links in attention.bytes_by_link.values() for n in links.values()) > 0
        assert {k: {link: n for link, n in v.items() if n} for k, v in attention.bytes_by_link.items()} == \
            {k: {link: n for link, n in v.items() if n} for k, v in by_link.items()}
    text = str(result)
    assert name in text and f"{len(result.attentions)})" in text  # the grouped row: "(xN)"
    return ring


def test_tiny_llama_8x8_at_1M(tmp_path):
    result, rss_growth, stats = _run("burstc.testing.zoo.hf:hf_llama", mesh="8x8", seq_len="1M", out=tmp_path)
    assert result.mesh_shape == (8, 8) and result.seq_len == S_1M and result.world_size == 64
    assert result.seconds_taken < 90  # seconds, not minutes (a loaded 2-core CI box)
    assert stats.calls == []  # no ring step ran: every op met fake tensors
    assert rss_growth < 512 * 2**20, rss_growth
    assert len(result.attentions) == 2
    _check_against_formulas(result, 1, 4, 2, 8, torch.float32)
    # 16K tokens a rank x 2 K/V heads x 8 dims x fp32, K and V: a step's message is 2 MiB, two groups of 1 MiB
    assert {a.head_groups for a in result.attentions} == {2}
    # the graphs as Python: every stage of the graph, the ring op in the rewritten one
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.endswith("_captured.py") for f in files) and any(f.endswith("_backward.py") for f in files)
    rewritten = next(tmp_path.glob("graph0_*_rewritten.py")).read_text()
    assert "def forward" in rewritten and rewritten.count("burstc.ring_attention_forward") == 2
    # the step time is its parts; the memory section is a hook until burstc.memory exists
    parts = dict(result.step_seconds)
    total = parts.pop("total")
    assert total == pytest.approx(sum(parts.values())) and total > 0
    assert "memory per rank" in str(result)


def test_7b_width_8x8_at_1M_allocates_nothing():
    # the 7B's width and heads, 2 of its 32 layers (the full model: the slow test below)
    factory = functools.partial(hf.llama_7b, layers=2)
    result, rss_growth, stats = _run(factory, mesh="8x8", seq_len=S_1M, device="A800")
    assert stats.calls == []
    assert result.parameter_bytes > 2**30 and rss_growth < result.parameter_bytes / 4, rss_growth
    assert result.parameters == sum(p.numel() for p in torch.nn.Module.parameters(_meta(factory)))
    _check_against_formulas(result, 1, 32, 32, 128, torch.bfloat16)
    # 16K tokens a rank: a step's K/V is 256 MiB, split into the most head groups
    assert {a.head_groups for a in result.attentions} == {head_groups.MAX_HEAD_GROUPS}
    assert f"({head_groups.MAX_HEAD_GROUPS} head groups)" in str(result)
    ring_seconds = sum(a.seconds for a in result.attentions)
    assert result.step_seconds["ring attention x2 (cost model)"] == pytest.approx(ring_seconds)


def _meta(factory):
    with torch.device("meta"):
        return factory()


@pytest.mark.slow
def test_full_7b_gqa_8x8_at_1M():
    result, rss_growth, stats = _run("burstc.testing.zoo.hf:llama_7b_gqa", mesh="8x8", seq_len="1M", device="H100")
    assert stats.calls == [] and rss_growth < 2**30 and result.parameter_bytes > 10 * 2**30
    assert len(result.attentions) == 32
    _check_against_formulas(result, 1, 32, 8, 128, torch.bfloat16)


def test_cli_flat_mesh(capsys):
    assert any(ep.name == "burstc" and ep.value == "burstc.cli:main"
               for ep in importlib.metadata.entry_points(group="console_scripts"))
    from burstc.cli import main

    assert main(["explain", "burstc.testing.zoo.hf:hf_llama", "--mesh", "1x4", "--seq-len", "64K",
                 "--device", "a100"]) == 0
    text = capsys.readouterr().out
    # a 1-D mesh: one flat ring, one class of link, the planner's bytes
    plan = masked_plan("zigzag", CAUSAL, 65536, 4, 1, 4, 2, 8, torch.float32)
    row = next(line for line in text.splitlines() if "self_attn" in line)
    assert " flat " in row and f" {plan.plan} " in row
    from burstc.report import _fmt_bytes

    assert f"forward ring {_fmt_bytes(plan.sent['forward'])}, backward ring {_fmt_bytes(plan.sent['backward'])}" in row
    assert "device A100" in text and "4 ranks" in text


def test_parsing_and_errors():
    parse_mesh, parse_length = explain_module.parse_mesh, explain_module.parse_length
    assert parse_mesh("8x8") == (8, 8) and parse_mesh("1x64") == (64,) and parse_mesh("64") == (64,)
    assert parse_mesh("4x1") == (4,)
    assert parse_length("1M") == S_1M and parse_length("64k") == 65536 and parse_length("4096") == 4096
    for bad in ("8x", "0x8", "2x2x2"):
        with pytest.raises(ValueError, match="mesh"):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="sequence length"):
        parse_length("1.5M")
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        explain_module.load_factory("burstc.testing.zoo.hf")
    with pytest.raises(ValueError, match="known: H100, A100, A800"):
        burstc.explain("burstc.testing.zoo.hf:hf_llama", mesh="2x2", seq_len=64, device="V100")
    assert set(DEVICES) == {"H100", "A100", "A800"}
    assert all(math.isfinite(d.peak_flops) and dict(d.machine.bandwidth)["intra"] > dict(d.machine.bandwidth)["inter"]
               for d in DEVICES.values())


def test_a_refused_graph_and_a_tokens_targets_model():
    # Qwen3-Next's short convolution over the sequence makes the shard pass refuse: the report says why, and
    # nothing is costed as sharded
    result = burstc.explain(functools.partial(hf.hf_arch, "Qwen3NextConfig"), mesh="2x2", seq_len=256, device="A100")
    assert result.attentions == [] and "replicated on 4 ranks" in str(result)
    assert [s.code for s in result.report.skipped if s.kind == "shard"] == ["shard.unsupported_op"]
    assert result.step_seconds["gradient all-reduce over 4 ranks (inter links)"] == 0
    # a torchtitan-style model called as model(tokens, targets)
    from burstc.testing.zoo import titan

    def titan_model():
        return titan.WithLoss(titan.TitanLlama(titan.TitanLlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                                    vocab_size=128, max_seq_len=65536)))

    result = burstc.explain(titan_model, mesh="2x4", seq_len="64K")
    assert len(result.attentions) == 2 and result.step_seconds["gradient all-reduce over 8 ranks (inter links)"] > 0
    ring, plan, by_link = _expected(2, 4, 1, 4, 2, 16, torch.float32, result.device.machine, seq_len=65536)
    name = {"double": "double 2x4", "ulysses": "ulysses_ring 2x4", "flat": "flat"}[ring]
    assert all(a.ring == name and a.plan == plan for a in result.attentions)


def test_the_reason_says_when_a_near_tie_went_to_the_ring_predicted_slower():
    # choose_ring takes the first candidate within NEAR_TIE of the fastest (the double ring before the flat one):
    # the reason, which lists the rings fastest first, must say why the listed-first one was not taken
    details = {"predicted_seconds": {"double": 1.2324, "ulysses": 1.236, "flat": 1.2322}, "plan": "kv_ring",
               "planner_choice": "kv_ring", "heads": "32q/8kv"}
    why = explain_module._reason(details, "double")
    assert why.startswith("cost model, forward + backward: flat 1232 ms < double 1232 ms < ulysses 1236 ms"), why
    assert "double within 1% of the fastest, a tie" in why
    assert "a tie" not in explain_module._reason(details, "flat")
    assert "a tie" not in explain_module._reason({**details, "predicted_seconds": {"double": 1.0, "flat": 1.0}},
                                                 "double")
