"""burstc.compile options, burstc.report, BURSTC_LOGS."""
import pytest
import torch
import torch.nn.functional as F

import burstc
from burstc.config import BurstConfig


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=37, dim=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def test_unknown_option_is_value_error_naming_it():
    with pytest.raises(ValueError, match="unknown burstc.compile option.*'chunk'"):
        burstc.compile(TinyLM(), chunk=4)


@pytest.mark.parametrize("option,value,match", [
    ("backend", "tvm", "backend"),
    ("layout", "spiral", "layout"),
    ("attention_plan", "fast", "attention_plan"),
    ("keep_logits", "yes", "keep_logits"),
    ("check_inputs", None, "check_inputs"),
    ("sync_module_states", 1, "sync_module_states"),
    ("lm_head_chunk_size", 0, "lm_head_chunk_size"),
    ("lm_head_chunk_size", 2.5, "lm_head_chunk_size"),
    ("disable_passes", ["no_such_pass"], "disable_passes"),
    ("dynamic", "maybe", "dynamic"),
])
def test_bad_option_value_is_value_error_naming_it(option, value, match):
    with pytest.raises(ValueError, match=match):
        burstc.compile(TinyLM(), **{option: value})


def test_mesh_must_be_a_device_mesh():
    with pytest.raises(TypeError, match="DeviceMesh"):
        burstc.compile(TinyLM(), mesh="cpu")


def test_report_before_first_call_is_a_clear_error():
    cmodel = burstc.compile(TinyLM(), backend="aot_eager")
    with pytest.raises(RuntimeError, match="call the compiled model at least once"):
        burstc.report(cmodel)


def test_report_of_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="burstc.compile"):
        burstc.report(torch.nn.Linear(2, 2))


def test_report_has_rewrite_graphs_and_table():
    model = TinyLM()
    cmodel = burstc.compile(model, backend="aot_eager")
    ids = torch.randint(0, 37, (2, 5))
    cmodel(ids, ids).backward()
    rep = burstc.report(cmodel)
    assert [r.kind for r in rep.rewrites] == ["lm_head_loss"]
    assert rep.rewrites[0].module_path == "head"
    assert rep.rewrites[0].chunk_size > 0
    assert set(rep.rewrites[0].predicted_peak_bytes) == {"eager", "fused"}
    # the stages, and the graph after each pass that ran (on one device: only the fusion)
    assert set(rep.graphs) == {"captured", "fuse_lm_head_loss", "rewritten", "forward", "backward"}
    assert set(rep.graphs[0]) == set(rep.graphs)
    targets = lambda gm: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("cross_entropy" in t for t in targets(rep.graphs["captured"]))
    assert not any("cross_entropy" in t and "linear_cross_entropy" not in t for t in targets(rep.graphs["rewritten"]))
    assert any("linear_cross_entropy" in t for t in targets(rep.graphs["rewritten"]))
    assert any("burstc" in t for t in targets(rep.graphs["forward"]))
    text = str(rep)
    assert "lm_head_loss" in text and "fuse_lm_head_loss" in text and "backward" in text


def test_disable_pass_by_name():
    model = TinyLM()
    cmodel = burstc.compile(model, backend="aot_eager", disable_passes=["fuse_lm_head_loss"])
    ids = torch.randint(0, 37, (2, 5))
    loss = cmodel(ids, ids)
    rep = burstc.report(cmodel)
    assert rep.rewrites == []
    assert rep.pass_run("fuse_lm_head_loss").note == "disabled by option"
    torch.testing.assert_close(loss, model(ids, ids))


def test_pass_that_finds_nothing_says_so():
    cmodel = burstc.compile(torch.nn.Linear(4, 4), backend="aot_eager")
    cmodel(torch.randn(3, 4))
    rep = burstc.report(cmodel)
    assert rep.rewrites == [] and rep.skipped == []
    assert rep.pass_run("fuse_lm_head_loss").note == "found no candidates"


def test_mesh_of_size_one_is_one_device(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = TinyLM()
        cmodel = burstc.compile(model, mesh, backend="aot_eager")
        ids = torch.randint(0, 37, (2, 5))
        torch.testing.assert_close(cmodel(ids, ids), model(ids, ids))
        assert burstc.report(cmodel).world_size == 1
    finally:
        if created:
            dist.destroy_process_group()


def test_config_cache_key_changes_with_options():
    assert BurstConfig().cache_key() != BurstConfig(keep_logits=True).cache_key()


def test_burstc_logs_env_logs_rewrites_and_graphs(monkeypatch, capfd):
    monkeypatch.setenv("BURSTC_LOGS", "rewrites,graphs")
    cmodel = burstc.compile(TinyLM(), backend="aot_eager")
    ids = torch.randint(0, 37, (2, 5))
    cmodel(ids, ids)
    err = capfd.readouterr().err
    assert "rewrote lm_head_loss" in err
    assert "stage captured" in err and "stage rewritten" in err and "stage forward" in err


def test_burstc_logs_dir_writes_graph_files(monkeypatch, tmp_path):
    monkeypatch.setenv("BURSTC_LOGS_DIR", str(tmp_path))
    cmodel = burstc.compile(TinyLM(), backend="aot_eager")
    ids = torch.randint(0, 37, (2, 5))
    cmodel(ids, ids).backward()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["graph0_backward.py", "graph0_captured.py", "graph0_forward.py", "graph0_fuse_lm_head_loss.py",
                     "graph0_rewritten.py"]


def test_a_pass_that_fails_to_match_skips_with_the_error(monkeypatch):
    # an unexpected error while matching is a refusal with the error in the report, not a crash
    import burstc.passes.fuse_lm_head_loss as fuse

    def broken(node):
        raise RuntimeError("boom")

    monkeypatch.setattr(fuse, "_match_one", broken)
    model = TinyLM()
    cmodel = burstc.compile(model, backend="aot_eager")
    ids = torch.randint(0, 37, (2, 5))
    torch.testing.assert_close(cmodel(ids, ids), model(ids, ids))
    rep = burstc.report(cmodel)
    assert rep.rewrites == []
    assert len(rep.skipped) == 1 and rep.skipped[0].code == fuse.CODES.match_failed
    assert "boom" in rep.skipped[0].reason


def test_shard_analysis_error_is_a_refusal(monkeypatch):
    import burstc.passes.shard as shard_pass
    from burstc.config import BurstConfig
    from burstc.passes import PassContext
    from burstc.report import Report

    from burstc.testing.graphs import dynamo_graph

    ids = torch.randint(0, 37, (1, 8))
    graphs = [dynamo_graph(TinyLM(), ids, ids, fullgraph=False)]

    def broken(self, node):
        raise KeyError("no rule")

    monkeypatch.setattr(shard_pass._Analyzer, "visit", broken)
    config = BurstConfig()
    context = PassContext(report=Report(config, world_size=2), graph_id=0, world_size=2)
    before = graphs[0].code
    out = shard_pass.shard(graphs[0], config=config, context=context)
    assert out.code == before  # untouched: runs unsharded
    (skip,) = context.report.skipped
    assert skip.code == "shard.analysis_failed" and "KeyError" in skip.reason
