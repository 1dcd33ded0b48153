"""The model fuzzer (burstc.testing.fuzz): a fixed-seed sample of generated cases on 1-4 gloo ranks (each rewritten
and exact, or refused with a code and exact; alternative layouts and plans agree; a mesh of one equals mesh=None
bitwise), and the fuzzer's own machinery: the generator's models run, cases survive repr, the classifier and the
reducer catch planted failures, reproducers load."""
from __future__ import annotations

import collections
import json
import dataclasses
import random
import runpy

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from burstc.config import RING_KINDS
from burstc.testing import fuzz
from burstc.testing.fuzz import Case, Outcome, RandomDraw, classify, generate_case, reduce_case, run_case
from burstc.testing.fuzz_models import HFSpec, InputSpec, ModelSpec, build_inputs, build_model, compute_loss

pytest.importorskip("transformers")

WORKER_RUN_TIMEOUT_S = 300
SAMPLE_SEED = 59  # covers rewritten, refused (FalconH1) and one-device cases, and two generated MoE blocks
SAMPLE_CASES = 8


def sample_cases() -> list[Case]:
    """The fixed sample: world sizes 1, 2, 3, 4 in turn, everything else drawn from ``SAMPLE_SEED``."""
    rng = random.Random(SAMPLE_SEED)
    return [generate_case(RandomDraw(rng), world_sizes=((1, 2, 3, 4)[n % 4],)) for n in range(SAMPLE_CASES)]


def test_fuzz_sample(workers, tmp_path):
    outcomes, failures = [], []
    for n, case in enumerate(sample_cases()):
        outcome = run_case(workers, case, timeout=WORKER_RUN_TIMEOUT_S)
        outcomes.append(outcome)
        if outcome.failed:
            path = fuzz.write_reproducer(str(tmp_path), f"sample-{n}", case, outcome)
            failures.append(f"[{n}] {outcome.kind}: {case.describe()}\n{outcome.detail[:1500]}\nreproducer: {path}")
    assert not failures, "\n\n".join(failures)
    kinds = collections.Counter(o.kind for o in outcomes)
    # the sample covers every outcome that is not a failure, and every world size
    assert kinds["rewritten"] >= 2 and kinds["refused"] >= 1 and kinds["one_device"] >= 1, kinds
    assert {c.world_size for c in sample_cases()} == {1, 2, 3, 4}
    assert all(code for o in outcomes if o.kind == "refused" for code in o.codes)


def _draw_cases(n, seed, **kwargs):
    rng = random.Random(seed)
    return [generate_case(RandomDraw(rng), **kwargs) for _ in range(n)]


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=fuzz.cases(hf_fraction=0.0))
def test_generated_models_train_in_eager(case):
    torch.manual_seed(0)
    model = build_model(case.model, case.seed)
    inputs = build_inputs(case.inputs, case.vocab)
    loss = compute_loss(model, inputs)
    assert loss.shape == ()
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())
    assert inputs["input_ids"].shape == inputs["labels"].shape == (case.inputs.batch, case.inputs.seq)
    if case.inputs.ignore == "all":
        assert (inputs["labels"] == -100).all()


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=fuzz.cases(hf_fraction=0.0, flex_fraction=1.0))
def test_generated_flex_models_train_in_eager(case):
    """FlexAttention models (causal / window / document mask_mods, soft-cap / ALiBi score_mods) run a training
    step in eager (torch's dense CPU backward, as the fuzzer's oracle runs them)."""
    from burstc.testing.zoo.flex import cpu_flex_backward

    assert case.model.attention == "flex" and not case.model.key_padding
    model = build_model(case.model, case.seed)
    inputs = build_inputs(case.inputs, case.vocab)
    with cpu_flex_backward():
        loss = compute_loss(model, inputs)
        loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and (case.inputs.ignore == "all" or all(bool(torch.isfinite(g).all()) for g in grads))


def test_flex_fraction_zero_keeps_earlier_seeds():
    """Drawing no FlexAttention consumes no randomness: a seed's cases are the ones it gave before."""
    with_flag = _draw_cases(20, seed=11, flex_fraction=0.0)
    assert with_flag == _draw_cases(20, seed=11) and all(c.model.attention != "flex" for c in with_flag
                                                         if isinstance(c.model, ModelSpec))
    assert sum(isinstance(c.model, ModelSpec) and c.model.attention == "flex"
               for c in _draw_cases(40, seed=11, flex_fraction=0.5)) >= 10


def test_checkpoint_fraction_zero_keeps_earlier_seeds():
    """Drawing no checkpointing consumes no randomness; drawn, it covers every mode and kept fraction."""
    assert _draw_cases(20, seed=11, checkpoint_fraction=0.0) == _draw_cases(20, seed=11)
    drawn = [dict(c.options) for c in _draw_cases(200, seed=11, checkpoint_fraction=0.5)]
    assert {o.get("checkpoint") for o in drawn} == {None, "layers", "selective"}
    assert {o["checkpoint_keep"] for o in drawn if "checkpoint_keep" in o} == set(fuzz.KEEP_FRACTIONS)
    assert all(o.get("checkpoint") == "selective" for o in drawn if "checkpoint_keep" in o)


def test_local_grads_fraction_zero_keeps_earlier_seeds():
    """Drawing no reduce_grads=False consumes no randomness; drawn, it comes on meshes only, with every bound."""
    assert _draw_cases(20, seed=11, local_grads_fraction=0.0) == _draw_cases(20, seed=11)
    drawn = _draw_cases(200, seed=11, local_grads_fraction=0.5)
    local = [dict(c.options) for c in drawn if ("reduce_grads", False) in c.options]
    assert len(local) >= 40 and all(c.world_size > 1 for c in drawn if ("reduce_grads", False) in c.options)
    assert {o.get("overlap_memory_bytes") for o in local} == {None, *fuzz.OVERLAP_BOUNDS}


def test_generator_respects_feature_rules():
    for case in _draw_cases(300, seed=3, hf_fraction=0.0):
        m = case.model
        assert m.heads % m.kv_heads == 0
        if m.attention == "sdpa_causal":  # is_causal carries no other mask
            assert not (m.window or m.documents or m.key_padding or m.alibi)
        if m.score_softcap is not None:
            assert m.attention == "manual"
        if m.gqa == "enable_gqa":
            assert m.attention.startswith("sdpa") and m.kv_heads < m.heads
        assert case.alternative is None or case.world_size > 1
        assert sum(case.inputs.documents) <= case.inputs.seq
        assert all(n < case.inputs.seq for n in case.inputs.pad_lengths)


def test_cases_survive_repr():
    for case in _draw_cases(50, seed=4, hf_fraction=0.5):
        assert eval(repr(case), {"Case": Case, "ModelSpec": ModelSpec, "HFSpec": HFSpec,
                                 "InputSpec": InputSpec}) == case


def _rank_result(errors, rewrites=("shard",), codes=(), extra=None):
    run = {"options": {}, "errors": errors, "loss": 1.0, "rewrites": list(rewrites), "skip_codes": list(codes),
           "summary": "graph 0", **(extra or {})}
    return {"rank": 0, "ref_loss": 1.0, "ref_nonfinite": False, "runs": [run]}


def test_classify_flags_every_failure():
    case = Case(model=ModelSpec(), inputs=InputSpec(), world_size=2)
    exact = {"loss": 0.0, "grad:w": 5e-6}
    assert classify(case, [_rank_result(exact)]).kind == "rewritten"
    assert classify(case, [_rank_result(exact, rewrites=(), codes=("shard.unsupported_op",))]).codes == [
        "shard.unsupported_op"]
    assert classify(case, [_rank_result({"loss": 0.0, "grad:w": 2e-5})]).kind == "mismatch"
    # no finite fp64 truth: a gradient at rounding-noise level (listed by the rank) is judged by that
    assert classify(case, [_rank_result({"loss": 0.0, "grad:w": 2e-5}, extra={"noise_grads": ["w"]})]).kind == (
        "rewritten")
    assert classify(case, [_rank_result({"loss": 0.0, "grad:w": 2e-5}, extra={"noise_grads": []})]).kind == (
        "mismatch")
    assert classify(case, [_rank_result({"loss": float("nan")})]).kind == "mismatch"      # NaN never passes
    assert classify(case, [_rank_result({"loss": float("inf")})]).kind == "mismatch"      # a missing gradient
    disagree = _rank_result(exact, extra={"errors_vs_first": {"loss": 3e-5}})
    assert classify(case, [_rank_result(exact), disagree]).kind == "mismatch"             # layouts disagree
    one = Case(model=ModelSpec(), inputs=InputSpec(), world_size=1)
    assert classify(one, [_rank_result(exact, extra={"bitwise_vs_no_mesh": True})]).kind == "one_device"
    assert classify(one, [_rank_result(exact, extra={"bitwise_vs_no_mesh": False})]).kind == "mismatch"
    crashed = _rank_result(exact)
    crashed["runs"][0]["error"] = "ValueError: boom"
    assert classify(case, [crashed]).kind == "crash"
    crashed["runs"][0]["torch_error"] = None  # plain torch.compile ran: burstc's crash
    assert classify(case, [crashed]).kind == "crash"
    # plain torch.compile on one process fails too: torch's own failure, counted apart and not a finding
    crashed["runs"][0]["torch_error"] = "RuntimeError: view size is not compatible"
    outcome = classify(case, [crashed])
    assert outcome.kind == "torch_crash" and not outcome.failed and "view size" in outcome.detail
    # ... unless the other option set, which ran, disagrees with eager
    wrong = _rank_result({"loss": 0.0, "grad:w": 2e-5})
    wrong["runs"].insert(0, dict(crashed["runs"][0]))
    assert classify(case, [wrong]).kind == "mismatch"


def test_plain_compile_error_says_whether_torch_compile_runs_the_step():
    from burstc.testing.fuzz import plain_compile_error

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11)

        def forward(self, input_ids, labels, use_cache=False):
            logits = self.head(self.embed(input_ids))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    ids = torch.randint(0, 11, (1, 6))
    assert plain_compile_error(Tiny(), {"input_ids": ids, "labels": ids}, "aot_eager") is None
    assert plain_compile_error(Tiny(), {"input_ids": ids, "labels": ids}, "no_such_backend").startswith(
        "InvalidBackend")


def test_classify_forgives_only_what_the_fp64_truth_shows_right():
    """A gradient over the fp32 tolerance vs eager is right when it is as close to the fp64 truth as eager is
    (x TRUTH_FACTOR) or within TRUTH_ULPS ulps of the largest true gradient; a wrong one stays a mismatch."""
    from burstc.testing.oracle import TRUTH_FACTOR, TRUTH_ULPS

    case = Case(model=ModelSpec(), inputs=InputSpec(), world_size=2)
    ulp = torch.finfo(torch.float32).eps

    def result(burstc_error, eager_error):
        r = _rank_result({"loss": 0.0, "grad:key_bias": 3e-4})  # 30x the tolerance vs eager
        r["runs"][0]["grad_errors_vs_truth"] = {"key_bias": burstc_error}
        r["eager_grad_errors_vs_truth"] = {"key_bias": eager_error}
        r["truth_grad_scale"] = 1.0
        return r

    assert classify(case, [result(2e-7, 1e-7)]).kind == "rewritten"                      # noise, like eager's
    assert classify(case, [result(TRUTH_ULPS * ulp * 0.9, 0.0)]).kind == "rewritten"      # a few ulps of the max
    assert classify(case, [result(1e-3, 1e-7)]).kind == "mismatch"                        # really wrong
    assert classify(case, [result(TRUTH_FACTOR * 1e-5 * 1.1, 1e-5)]).kind == "mismatch"   # worse than eager x4
    no_truth = _rank_result({"loss": 0.0, "grad:key_bias": 3e-4})                         # no fp64 run: fp32 rules
    assert classify(case, [no_truth]).kind == "mismatch"
    # in bf16 (weights or autocast) the ulps are bf16's: 1e-4 of the largest gradient is below one
    bf16_case = dataclasses.replace(case, precision="autocast")
    bf16_result = result(1e-4, 1e-6)
    bf16_result["runs"][0]["errors"]["grad:key_bias"] = 0.3  # 10x the bf16 tolerance vs eager
    assert classify(bf16_case, [bf16_result]).kind == "rewritten"
    assert classify(case, [result(1e-4, 1e-6)]).kind == "mismatch"                       # not in fp32


def test_classify_never_forgives_a_nan_pattern_unlike_eagers():
    """A NaN-pattern difference vs eager (error NaN) is a mismatch even when eager's own pattern differs from the
    fp64 truth's (both inf vs the truth): the patterns must agree, e.g. eager's NaN LM-head gradient from NaN
    hidden states at ignored positions."""
    case = Case(model=ModelSpec(), inputs=InputSpec(), world_size=2)
    result = _rank_result({"loss": 0.0, "grad:lm_head.weight": float("nan")})
    result["runs"][0]["grad_errors_vs_truth"] = {"lm_head.weight": float("inf")}
    result["eager_grad_errors_vs_truth"] = {"lm_head.weight": float("inf")}
    result["truth_grad_scale"] = 1.0
    assert classify(case, [result]).kind == "mismatch"
    same = _rank_result({"loss": 0.0, "grad:lm_head.weight": 0.0})  # equal patterns, equal finite entries
    assert classify(case, [same]).kind == "rewritten"


class _PlantedPool:
    """A stand-in worker pool whose cases 'mismatch' exactly when the model has QK-norm (a planted bug)."""

    def __init__(self):
        self.runs = 0

    def get(self, world_size):
        return self

    def run(self, fn, case, timeout=None):
        self.runs += 1
        errors = {"loss": 1.0 if case.model.qk_norm else 0.0}
        return [_rank_result(errors, rewrites=("shard",))]


def test_reducer_keeps_the_failure_and_drops_the_rest():
    case = Case(model=ModelSpec(layers=2, qk_norm=True, qkv_bias=True, logits_op="softcap", loss="ce_sum",
                                positions="rope_complex", mlp="gelu", norm="layer", kv_heads=2),
                inputs=InputSpec(batch=3, seq=33, ignore="some"), world_size=4,
                options=(("backend", "aot_eager"), ("layout", "striped"), ("attention_plan", "burst"),
                         ("lm_head_chunk_size", 7)))
    pool = _PlantedPool()
    outcome = run_case(pool, case)
    assert outcome.kind == "mismatch"
    reduced, reduced_outcome = reduce_case(pool, case, outcome, max_tries=60)
    assert reduced_outcome.kind == "mismatch" and reduced.model.qk_norm
    assert reduced.world_size == 2 and reduced.inputs.batch == 1 and reduced.inputs.ignore == "none"
    assert (reduced.model.layers, reduced.model.mlp, reduced.model.qkv_bias) == (1, "none", False)
    assert dict(reduced.options) == {"backend": "aot_eager", "layout": "striped", "attention_plan": "burst"}


def test_reproducer_loads_its_case(tmp_path):
    case = _draw_cases(1, seed=5, hf_fraction=0.0)[0]
    path = fuzz.write_reproducer(str(tmp_path), "case-x", case, Outcome("mismatch", [], 'rank 0: """quoted"""'))
    assert runpy.run_path(path, run_name="not_main")["CASE"] == case


# Found by the fuzzer, fixed: query rows with every key hidden (left padding: HF's shifted loss reads the last pad
# position, which predicts the first real token).  Eager's finite fill (finfo.min) gives a uniform average over all
# keys, where SDPA gives 0: such attention stays as written, and the ring op that replaces it computes eager's
# uniform rows (hidden_rows="uniform"; burstc/ops/hidden_rows.py).
FULLY_HIDDEN_ROWS = {
    "hf_llama_eager_left_padded_sharded": Case(
        model=HFSpec(config_name="LlamaConfig", impl="eager"),
        inputs=InputSpec(batch=2, seq=16, padding="left", pad_lengths=(5, 0)), world_size=2,
        options=(("backend", "aot_eager"), ("layout", "zigzag"), ("attention_plan", "auto"))),
    "manual_finfo_min_left_padded": Case(
        model=ModelSpec(attention="manual", key_padding=True, mask_fill="finfo.min", positions="none", mlp="none",
                        loss="ce_shift"),
        inputs=InputSpec(batch=1, seq=15, padding="left", pad_lengths=(5,)), world_size=2,
        options=(("backend", "aot_eager"), ("layout", "zigzag"), ("attention_plan", "auto"))),
}


@pytest.mark.parametrize("name", sorted(FULLY_HIDDEN_ROWS))
def test_fully_hidden_rows_match_eager(workers, name):
    outcome = run_case(workers, FULLY_HIDDEN_ROWS[name], timeout=WORKER_RUN_TIMEOUT_S)
    assert not outcome.failed, outcome.detail


# failures the long runs found, fixed: each must now match eager
FOUND = {
    # FlexAttention's create_block_mask vmaps inside each layer: burstc's checkpoint region held the vmap levels'
    # increments but not their decrements (functorch's !dynamicLayerStack.empty() assert)
    "seed282_case36_flex_under_checkpointing": Case(
        model=ModelSpec(vocab=61, dim=32, layers=2, heads=2, kv_heads=2, head_dim=4, attention="flex",
                        mask_source="arange", positions="learned", norm="rms", mlp="none", loss="ce_smooth"),
        inputs=InputSpec(batch=1, seq=8, seed=21850), world_size=2,
        options=(("backend", "aot_eager"), ("layout", "auto"), ("attention_plan", "kv_ring"),
                 ("checkpoint", "selective"))),
    # the recompute's first rows kept a block of padding keys only (ranks raised or hung)
    "seed282_case25_left_padded_keep_half": Case(
        model=HFSpec(config_name="CohereConfig", impl="sdpa"),
        inputs=InputSpec(batch=1, seq=7, padding="left", pad_lengths=(5,), seed=62670), world_size=3,
        options=(("backend", "aot_eager"), ("layout", "striped"), ("attention_plan", "burst"),
                 ("checkpoint", "selective"), ("checkpoint_keep", 0.5))),
    # 2 tokens on 2 ranks: q/k gradients ~2e-5 (relative) from eager's by cancellation; the fp64 truth that shows
    # them right could not run HF's grouped_mm experts (no fp64): the truth's twin now runs the eager experts
    "seed282_case27_moe_fp64_truth": Case(
        model=HFSpec(config_name="OlmoeConfig", impl="sdpa",
                     overrides=(("output_router_logits", True), ("router_aux_loss_coef", 0.02))),
        inputs=InputSpec(batch=1, seq=2, seed=63943), world_size=2,
        options=(("backend", "aot_eager"), ("layout", "documents"), ("attention_plan", "burst"))),
    # the hybrid (Ulysses inside a node) gave each rank's ring all 4 ALiBi slopes for its 2 heads (raised on every
    # rank): each now keeps its heads' slopes
    "seed2037_case26_alibi_on_the_hybrid": Case(
        model=ModelSpec(vocab=61, dim=24, layers=1, heads=4, kv_heads=2, head_dim=6, attention="sdpa_float",
                        mask_source="triu", mask_fill="finfo.min", qk_norm=True, alibi=True, positions="rope",
                        norm="layer", mlp="none", tied=True, head_bias=True, logits_op="softcap",
                        loss="ce_none_mean"),
        inputs=InputSpec(batch=1, seq=32, seed=38246), world_size=4, mesh=(2, 2),
        options=(("backend", "aot_eager"), ("layout", "zigzag"), ("attention_plan", "kv_ring"), ("ring", "ulysses"))),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_cases_the_long_runs_found_match_eager(workers, name):
    outcome = run_case(workers, FOUND[name], timeout=WORKER_RUN_TIMEOUT_S)
    assert outcome.kind == "rewritten" and not outcome.failed, (outcome.kind, outcome.detail)


# the generator's statistics over the whole sequence: sums and means into every token and into the loss are
# sharded (their gradient arriving in parts, or whole), one value into both and a max are refused; all exact
SEQUENCE_TERMS = {"sum_tokens": "rewritten", "mean_tokens": "rewritten", "aux_mean": "rewritten",
                  "both": "refused", "max_tokens": "refused"}


@pytest.mark.parametrize("term", sorted(SEQUENCE_TERMS))
def test_statistics_over_the_sequence_match_eager(workers, term):
    case = Case(model=ModelSpec(vocab=61, dim=16, layers=1, heads=2, kv_heads=2, head_dim=8, attention="sdpa_causal",
                                positions="rope", norm="rms", mlp="swiglu", sequence_term=term),
                inputs=InputSpec(batch=2, seq=17, seed=5), world_size=3,
                options=(("backend", "aot_eager"), ("layout", "zigzag"), ("attention_plan", "burst")))
    outcome = run_case(workers, case, timeout=WORKER_RUN_TIMEOUT_S)
    assert outcome.kind == SEQUENCE_TERMS[term] and not outcome.failed, (outcome.kind, outcome.codes, outcome.detail)


# reduce_grads=False: the oracle sums each rank's gradients; a sharded graph's are its tokens' parts (weight gradients
# moved into the ring backwards' last hops, every bound), a refused graph's 1/P each (share_replicated_grads)
LOCAL_GRADS = {"sharded_all_moved": ("zigzag", 1 << 30, "none", "rewritten"),
               "sharded_default_bound": ("striped", None, "none", "rewritten"),
               "refused": ("zigzag", None, "max_tokens", "refused")}


@pytest.mark.parametrize("name", sorted(LOCAL_GRADS))
def test_local_gradients_sum_to_eagers(workers, name):
    layout, bound, term, expected = LOCAL_GRADS[name]
    options = (("backend", "aot_eager"), ("layout", layout), ("attention_plan", "kv_ring"), ("reduce_grads", False))
    case = Case(model=ModelSpec(vocab=61, dim=16, layers=2, heads=2, kv_heads=2, head_dim=8, attention="sdpa_causal",
                                positions="rope", norm="rms", mlp="swiglu", sequence_term=term),
                inputs=InputSpec(batch=2, seq=17, seed=5), world_size=3,
                options=options + ((("overlap_memory_bytes", bound),) if bound is not None else ()))
    outcome = run_case(workers, case, timeout=WORKER_RUN_TIMEOUT_S)
    assert outcome.kind == expected and not outcome.failed, (outcome.kind, outcome.codes, outcome.detail)


@pytest.mark.parametrize("argv", [["--ranks", "0"], ["--cases", "0"], ["--ranks", "-2", "2"],
                                  ["--cases", "3", "--start", "3"], ["--start", "-1"]])
def test_cli_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fuzz.main(argv)
    assert exit_info.value.code == 2 and "--ranks must be >= 1" in capsys.readouterr().err


def test_mixtures_of_experts_are_compared_in_fp32_only():
    # a router's top-k is discontinuous: in bf16, eager's own math and flash kernels already route a token
    # differently (Mixtral, fuzz seed 271 case 95: 1 of 48 tokens, an expert's gradient 18% apart), so equality with
    # eager is only defined in fp32
    rng = random.Random(3)
    drawn = [generate_case(RandomDraw(rng), world_sizes=(2,)) for _ in range(300)]
    moe = [c for c in drawn if fuzz._routes_tokens(c.model)]
    assert len(moe) >= 20 and all(c.precision == "fp32" for c in moe)
    assert any(c.precision != "fp32" for c in drawn if not fuzz._routes_tokens(c.model))


def test_a_resumed_run_runs_the_same_cases_and_logs_each(tmp_path):
    # a long run split in parts (--start) must run exactly the cases one uninterrupted run would
    rng = random.Random(5)
    expected = [generate_case(RandomDraw(rng), (1,), 0.3, False, 0.1, 0.1) for _ in range(3)]
    assert fuzz.main(["--cases", "3", "--start", "2", "--seed", "5", "--ranks", "1", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "cases-5.jsonl").read_text().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["n"] == 2 and entry["case"] == repr(expected[2]) and entry["kind"] in ("one_device", "refused")
    assert (tmp_path / "summary-5-from-2.json").exists()


def test_the_fuzzer_refuses_to_run_mixed_checkouts(monkeypatch, capsys):
    # an editable install maps burstc.kernels and burstc.passes to its own clone, whatever PYTHONPATH says: a run
    # from another clone once fuzzed one clone's ops with another's kernels
    sources = fuzz.package_sources()
    assert set(sources) == {"burstc", "burstc.kernels", "burstc.passes"} and len(set(sources.values())) == 1, sources
    monkeypatch.setattr(fuzz, "package_sources",
                        lambda: {**sources, "burstc.kernels": "/elsewhere"})
    with pytest.raises(SystemExit) as exited:
        fuzz.main(["--cases", "1", "--out", "unused"])
    assert exited.value.code == 2 and "different checkouts" in capsys.readouterr().err


def test_two_level_meshes_are_drawn_only_when_asked():
    assert fuzz.two_level_shapes(4) == [(2, 2)] and fuzz.two_level_shapes(6) == [(2, 3), (3, 2)]
    assert fuzz.two_level_shapes(3) == [] and fuzz.two_level_shapes(2) == []
    # fraction 0 draws nothing: the earlier seeds' cases are unchanged
    plain = _draw_cases(30, 11, world_sizes=(4,))
    assert all(c.mesh is None and "ring" not in dict(c.options) for c in plain)
    drawn = _draw_cases(30, 11, world_sizes=(2, 3, 4), two_level_fraction=1.0)
    for case in drawn:
        assert (case.mesh == (2, 2)) == (case.world_size == 4), case.describe()
        assert ("ring" in dict(case.options)) == (case.mesh is not None)
        if case.mesh is not None and case.alternative is not None:
            assert dict(case.alternative)["ring"] in RING_KINDS
    assert any(c.mesh for c in drawn) and "(2x2 mesh)" in next(c for c in drawn if c.mesh).describe()
    # the reducer's first step from a two-level case is the flat ring over the same ranks
    case = next(c for c in drawn if c.mesh)
    flat = next(fuzz._simpler(case))
    assert flat.mesh is None and flat.world_size == 4 and "ring" not in dict(flat.options)


def test_a_two_level_case_runs_the_double_ring_and_the_hybrid(workers):
    """One case on a named 2 x 2 mesh through the fuzzer's harness: the double ring, then (the metamorphic second
    option set) the Ulysses hybrid; each matches eager and the other."""
    case = Case(model=ModelSpec(attention="sdpa_causal", heads=4, kv_heads=2, layers=1), inputs=InputSpec(seq=16),
                world_size=4, mesh=(2, 2),
                options=(("backend", "aot_eager"), ("layout", "zigzag"), ("attention_plan", "burst"),
                         ("ring", "double")),
                alternative=(("backend", "aot_eager"), ("layout", "zigzag"), ("attention_plan", "kv_ring"),
                             ("ring", "ulysses")))
    outcome = run_case(workers, case, timeout=WORKER_RUN_TIMEOUT_S)
    assert outcome.kind == "rewritten", outcome.detail
    first, second = outcome.results[0]["runs"]
    assert first["rings"] == ["double 2x2"] and second["rings"] == ["ulysses_ring 2x2"], (first["rings"],
                                                                                       second["rings"])
    # "rewritten" is the oracle's pass (loss and every gradient vs eager, and the two option sets vs each other);
    # the errors it judged are there, and small
    assert max(first["errors"].values()) < 1e-5 and max(second["errors_vs_first"].values()) < 1e-5
