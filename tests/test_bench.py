"""``burstc bench`` (burstc/bench/end_to_end.py): the console script end to end at tiny sizes, the cap search's
logic on a fake memory curve, and the FLOP count by hand."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from burstc.bench import end_to_end
from burstc.testing.oracle import tolerance


REPO = Path(__file__).resolve().parents[1]
_WHEEL_SOURCES = ("pyproject.toml", "README.md", "burstc", "passes", "kernels")


def _build_wheel(out: Path) -> tuple[Path | None, str]:
    """(the wheel built from a copy of this checkout, "") or (None, why it could not be built here)."""
    import importlib.metadata
    import shutil

    source = out / "source"  # a copy, so that the build leaves no build/ folder in the checkout
    source.mkdir(parents=True)
    for name in _WHEEL_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    try:  # this environment's build backend when it is new enough (pyproject.toml asks for >= 77), else pip's
        isolated = int(importlib.metadata.version("setuptools").split(".")[0]) < 77
    except importlib.metadata.PackageNotFoundError:
        isolated = True
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out / "dist"), str(source)]
    done = subprocess.run(command + ([] if isolated else ["--no-build-isolation"]), capture_output=True, text=True,
                          timeout=300)
    if done.returncode and isolated and ("No matching distribution" in done.stderr
                                         or "Could not find a version" in done.stderr):
        return None, f"no setuptools>=77 to build a wheel with (offline?): {done.stderr.strip()[-300:]}"
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (out / "dist").glob("burstc-*.whl")
    return wheel, ""


@pytest.fixture(scope="module")
def installed_burstc(tmp_path_factory) -> Path | None:
    """A folder holding burstc as a fresh ``pip install burstc`` lays it out (the pure-Python wheel built from
    this checkout, unpacked), or None where no wheel can be built (then the CLI runs from the checkout)."""
    import zipfile

    out = tmp_path_factory.mktemp("wheel")
    wheel, why = _build_wheel(out)
    if wheel is None:
        import warnings

        warnings.warn(f"burstc bench runs from the checkout, not from a wheel: {why}")
        return None
    with zipfile.ZipFile(wheel) as unpacked:
        unpacked.extractall(out / "site")
    return out / "site"


# burstc's console script (burstc.cli:main) over several command lines in one process
_CLI = """
import sys
sys.modules["ring_attention_pytorch"] = None  # as if the optional peer were not installed
import burstc
from burstc.cli import main
print("burstc from", burstc.__file__)
for argv in {argvs!r}:
    print("=== burstc", *argv, flush=True)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    print("=== exit", code, flush=True)
"""


@pytest.mark.multirank
def test_burstc_bench_end_to_end(installed_burstc, tmp_path):
    """From the installed wheel, in a folder that is not the checkout: ``burstc bench --help``, ``burstc explain``
    and ``burstc bench`` on 2 ranks at 2 short lengths (burstc + a sharded peer + eager; the lucidrains peer made
    unimportable): every row has positive numbers, burstc's step-0 loss equals eager's, the missing peer is a
    skipped row, the tables land in ./burstc-bench and the plots where asked."""
    import os

    bench = ["bench", "--ranks", "2", "--seq-lens", "64", "128", "--rows", "burstc", "allgather_kv",
             "lucidrains_zigzag", "eager", "--dim", "32", "--ffn", "64", "--vocab", "97", "--steps", "1",
             "--burstc-backend", "aot_eager", "--memory-cap-mib", "0", "--no-progress", "--plots-dir", str(tmp_path)]
    explain = ["explain", "burstc.testing.zoo.hf:hf_llama", "--mesh", "1x2", "--seq-len", "4K"]
    env = dict(os.environ)
    if installed_burstc is not None:
        env["PYTHONPATH"] = str(installed_burstc)  # ahead of the editable install; spawned ranks inherit it
    done = subprocess.run([sys.executable, "-c", _CLI.format(argvs=[["bench", "--help"], explain, bench])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    origin = installed_burstc if installed_burstc is not None else REPO
    assert f"burstc from {origin / 'burstc' / '__init__.py'}" in done.stdout, done.stdout[:300]
    help_text, explain_text, bench_text = done.stdout.split("=== burstc ")[1:]
    for text in (help_text, explain_text, bench_text):
        assert text.rstrip().endswith("=== exit 0"), (text[-1000:], done.stderr[-3000:])
    assert "--seq-lens" in help_text and "2 ranks" in explain_text and "kv_ring" in explain_text

    report = json.loads((tmp_path / "burstc-bench" / "end_to_end.json").read_text())
    results = report["results"]
    assert "ring-attention-pytorch is not installed" in results.pop("lucidrains_zigzag")["skipped"]
    assert "row lucidrains_zigzag skipped: ring-attention-pytorch is not installed" in done.stderr
    assert set(results) == {"burstc", "allgather_kv", "eager"}
    for name, row in results.items():
        assert set(row["by_seq_len"]) == {"64", "128"}, name
        for cell in row["by_seq_len"].values():
            for key in ("tokens_per_s_per_rank", "step_s", "cpu_s", "tokens_per_cpu_s_per_rank", "peak_mib_per_rank",
                        "mfu", "loss0", "grad_norm0"):
                assert cell[key] > 0 and cell[key] == cell[key], (name, key, cell[key])
            assert cell["ranks"] == (1 if name == "eager" else 2)
            if name != "eager":
                assert cell["attention_mib_sent_per_rank"] > 0, name
    rtol = tolerance(torch.float32, "sharded_loss").rtol
    for s in ("64", "128"):
        ours, eager = results["burstc"]["by_seq_len"][s], results["eager"]["by_seq_len"][s]
        assert abs(ours["loss0"] - eager["loss0"]) <= rtol * abs(eager["loss0"]), (s, ours["loss0"], eager["loss0"])
        assert ours["grad_norm0"] == pytest.approx(eager["grad_norm0"], rel=1e-4)
        peer = results["allgather_kv"]["by_seq_len"][s]
        assert abs(peer["loss0"] - eager["loss0"]) <= rtol * abs(eager["loss0"])
        assert ours["best_peer"] in ("allgather_kv", "eager")
        best_cpu = max(results[n]["by_seq_len"][s]["tokens_per_cpu_s_per_rank"] for n in ("allgather_kv", "eager"))
        assert ours["cpu_tokens_vs_best_peer"] == pytest.approx(ours["tokens_per_cpu_s_per_rank"] / best_cpu)
    table = (tmp_path / "burstc-bench" / "end_to_end.md").read_text()
    assert table.count("| burstc (defaults) | 2 |") == 2 and "Targets at S = 128" in table
    assert "| lucidrains zig-zag | - | - | n/a: ring-attention-pytorch is not installed" in table
    assert (tmp_path / "bench-throughput.png").exists() or "matplotlib is not installed" in done.stderr


def _fake_fits(peak_of):
    def fits(case, cap_mib, timeout_s, peak_flops):
        peak = peak_of(case.seq_len)
        return peak <= cap_mib, {"peak_mib_per_rank": peak}
    return fits


def test_cap_search_doubles_then_bisects(monkeypatch):
    """A row whose peak is S / 64 MiB under a 300 MiB cap (true limit 19200): the sweep fits up to 4096, the search
    doubles to 8192, 16384 (fit) and 32768 (over), then bisects 24576 (over), 20480 (over), 18432 (fits)."""
    monkeypatch.setattr(end_to_end, "_fits", _fake_fits(lambda s: s / 64))
    base = end_to_end.Case("eager", 0, 1, end_to_end.ModelShape())
    sweep = {s: {"peak_mib_per_rank": s / 64} for s in (1024, 2048, 4096)}
    progress = end_to_end._Progress(0, enabled=False)
    found = end_to_end.longest_under_cap(base, sweep, 300, max_seq_len=65536, bisect=3, timeout_s=1, peak_flops=1,
                                         progress=progress)
    tried = [(a["seq_len"], a["fits"]) for a in found["attempts"]]
    assert tried == [(8192, True), (16384, True), (32768, False), (24576, False), (20480, False), (18432, True)]
    assert found["seq_len"] == 18432 and found["peak_mib_per_rank"] == 18432 / 64


def test_cap_search_goes_down_and_stops_at_the_limit(monkeypatch):
    """Peak S / 8 MiB under 100 MiB (limit 800) on 2 ranks (grid 256): the sweep's 2048 and 4096 are over, so the
    search halves to 1024 (over) and 512 (fits), then bisects to 768 (fits)."""
    monkeypatch.setattr(end_to_end, "_fits", _fake_fits(lambda s: s / 8))
    base = end_to_end.Case("torch_ring", 0, 2, end_to_end.ModelShape())
    sweep = {s: {"peak_mib_per_rank": s / 8} for s in (2048, 4096)}
    progress = end_to_end._Progress(0, enabled=False)
    found = end_to_end.longest_under_cap(base, sweep, 100, max_seq_len=65536, bisect=1, timeout_s=1, peak_flops=1,
                                         progress=progress)
    assert [(a["seq_len"], a["fits"]) for a in found["attempts"]] == [(1024, False), (512, True), (768, True)]
    assert found["seq_len"] == 768


def test_step_flops_by_hand():
    shape = end_to_end.ModelShape(dim=8, layers=1, heads=2, kv_heads=1, ffn=16, vocab=10)
    seq = 4
    # per token: q 2*8*8, k and v 2*2*8*4, o 2*8*8, mlp 3*2*8*16, head 2*8*10; attention 4*2*4 * 16/2
    forward = seq * (128 + 128 + 128 + 768 + 160) + 4 * 2 * 4 * seq * seq / 2
    assert end_to_end.step_flops(shape, seq) == 3 * forward


def test_emulated_network_prints_the_command(capsys):
    assert end_to_end.main(["--emulated-network", "--ranks", "4", "--seq-lens", "2048"]) == 0
    out = capsys.readouterr().out
    assert f"EC={end_to_end.EMULATED_CLUSTER}" in out
    assert "$EC --ranks 4 --rate 50 -- burstc bench --ranks 4 --seq-lens 2048" in out


def test_checkpoint_targets_from_the_rows_that_ran():
    """Issue 18's summary: selective against none (step and activation memory), longest lengths, torch's budget."""
    def cell(step_s, activation, peak, tokens):
        return {"step_s": step_s, "activation_mib_per_rank": activation, "peak_mib_per_rank": peak,
                "tokens_per_s_per_rank": tokens}

    results = {
        "burstc": {"by_seq_len": {1024: cell(1.0, 100.0, 150.0, 1000.0), 2048: cell(2.0, 200.0, 260.0, 1000.0)},
                   "longest_under_cap": {"seq_len": 2048}},
        "burstc_selective": {"by_seq_len": {1024: cell(1.05, 50.0, 100.0, 950.0), 2048: cell(2.1, 110.0, 170.0, 975.0)},
                             "longest_under_cap": {"seq_len": 8192}},
        "burstc_torch_budget@0.5": {"by_seq_len": {1024: cell(1.5, 60.0, 110.0, 650.0)}},
        "burstc_torch_budget@0.1": {"by_seq_len": {1024: cell(1.9, 40.0, 90.0, 520.0)}},
        "burstc_sac_matmuls": {"by_seq_len": {1024: cell(1.1, 70.0, 120.0, 900.0)}},
        "torch_ring": {"by_seq_len": {1024: cell(1.2, 150.0, 200.0, 800.0)}},
    }
    goal = end_to_end.checkpoint_targets(results)
    assert goal["seq_len"] == 1024  # the longest length every burstc row ran
    selective = goal["burstc_selective"]
    assert selective["step_vs_none"] == pytest.approx(1.05) and selective["activation_vs_none"] == pytest.approx(0.5)
    assert selective["step_met"] and selective["activation_met"]
    assert selective["longest"] == 8192 and selective["longest_vs_none"] == pytest.approx(4.0)
    versus = goal["selective_vs_torch"]
    assert set(versus["each"]) == {"burstc_torch_budget@0.5", "burstc_torch_budget@0.1", "burstc_sac_matmuls"}
    half = versus["each"]["burstc_torch_budget@0.5"]
    assert half["tokens_ratio"] == pytest.approx(950 / 650) and half["peak_ratio"] == pytest.approx(100 / 110)
    # selective's peak is 100: only the 0.1 budget (90) fits within it; 950 / 520 >= 1.1
    assert versus["equal_memory_answer"] == "burstc_torch_budget@0.1"
    assert versus["equal_memory_tokens_ratio"] == pytest.approx(950 / 520) and versus["equal_memory_met"]
    # a torch answer within selective's memory and as fast fails the target
    faster = dict(results, burstc_sac_matmuls={"by_seq_len": {1024: cell(1.0, 30.0, 95.0, 1000.0)}})
    versus = end_to_end.checkpoint_targets(faster)["selective_vs_torch"]
    assert versus["equal_memory_answer"] == "burstc_sac_matmuls" and not versus["equal_memory_met"]
    assert "torch_ring" not in goal
    assert end_to_end.checkpoint_targets({"torch_ring": results["torch_ring"]}) == {}
    text = end_to_end.markdown({"config": {"shape": dataclasses.asdict(end_to_end.ModelShape()), "ranks": 2,
                                           "steps": 2, "command": "burstc bench", "memory_cap_mib": 0},
                                "machine": {"cpus": 2, "load_start": 0.0, "load_end": 0.0, "torch": "x",
                                            "peak_gflops": 1.0, "peak_method": "m"},
                                "results": {}, "targets": {}, "checkpoint_targets": goal})
    assert "burstc + torch activation_memory_budget 0.1): 1.83x its tokens/s (target >= 1.10x: met)" in text


def test_budget_rows_run_once_per_budget():
    keys = end_to_end.expand_rows(["burstc", "burstc_torch_budget", "compile_budget"], [0.5, 0.25])
    assert keys == ["burstc", "burstc_torch_budget@0.5", "burstc_torch_budget@0.25", "compile_budget@0.5",
                    "compile_budget@0.25"]
    args = end_to_end._parser().parse_args(["--ranks", "4", "--budgets", "0.5", "0.25"])
    case = end_to_end.case_of("burstc_torch_budget@0.25", 2048, args, end_to_end.ModelShape(), 1)
    assert (case.row, case.budget, case.ranks, case.key) == ("burstc_torch_budget", 0.25, 4, "burstc_torch_budget@0.25")
    assert end_to_end.case_of("compile_budget@0.5", 2048, args, end_to_end.ModelShape(), 1).ranks == 1
    assert end_to_end.label("compile_budget@0.25") == "torch.compile + memory budget, 1 process 0.25"


def test_pareto_frontier_keeps_the_points_nothing_beats():
    points = [(1.0, 300, "none"), (1.02, 200, "selective"), (1.1, 210, "half"), (1.2, 190, "layers"),
              (1.3, 400, "budget")]
    assert [p[2] for p in end_to_end.pareto_frontier(points)] == ["none", "selective", "layers"]
    assert end_to_end.pareto_frontier([]) == []


def test_checkpoint_pareto_plot(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    cell = lambda step, peak: {"step_s": step, "peak_mib_per_rank": peak}  # noqa: E731
    report = {"config": {"ranks": 2}, "results": {
        "burstc": {"by_seq_len": {1024: cell(1.0, 300), 2048: cell(2.0, 500)}},
        "burstc_selective": {"by_seq_len": {1024: cell(1.02, 200), 2048: cell(2.1, 320)}},
        "torch_ring": {"by_seq_len": {1024: cell(0.5, 100)}}}}  # a peer: not a checkpoint row
    fig = end_to_end.checkpoint_pareto(report, plt)
    ax = fig.axes[0]
    assert len(ax.collections) == 4 and len(ax.lines) == 2  # 2 rows x 2 lengths, one frontier per length
    plt.close(fig)
    assert end_to_end.checkpoint_pareto({"config": {"ranks": 2}, "results": {"burstc": report["results"]["burstc"]}},
                                        plt) is None


def test_mesh_option_is_validated_and_shown_in_the_emulated_command(capsys):
    assert end_to_end.main(["--emulated-network", "--ranks", "4", "--mesh", "2x2", "--seq-lens", "2048"]) == 0
    out = capsys.readouterr().out
    assert "$EC --nodes 2 --gpus-per-node 2 --intra 101 --inter 11.3 -- burstc bench --ranks 4 --mesh 2x2" in out
    for bad in (["--ranks", "4", "--mesh", "2x3"], ["--ranks", "4", "--mesh", "two"], ["--ranks", "4", "--mesh", "0x4"]):
        with pytest.raises(SystemExit):
            end_to_end.main(bad + ["--seq-lens", "64"])
    assert "--mesh 2x3 has 6 ranks, --ranks is 4" in capsys.readouterr().err


def _mesh_case_task(rank, world_size, case):
    return end_to_end.run_case(rank, world_size, case)


@pytest.mark.multirank
def test_burstc_row_on_a_two_level_mesh_matches_eager(workers):
    """``--mesh 2x2``: burstc's row compiles on a named 2 x 2 mesh, runs a double ring (bytes on both link
    classes) and its step-0 loss and gradient norm equal one-process eager's."""
    pytest.importorskip("transformers")
    shape = end_to_end.ModelShape(dim=32, layers=1, heads=4, kv_heads=2, ffn=64, vocab=97)
    case = end_to_end.Case("burstc", 64, 4, shape, steps=1, burstc_backend="aot_eager", mesh=(2, 2))
    per_rank = workers.get(4).run(_mesh_case_task, case)
    eager = end_to_end.run_case(0, 1, end_to_end.Case("eager", 64, 1, shape, steps=1))
    row = end_to_end.combine(case, [p for p, _ in per_rank], [list(s) for s in zip(*(s for _, s in per_rank))], 1e9)
    assert set(row["attention_mib_sent_by_link"]) == {"inter", "intra"}
    assert all(mib > 0 for mib in row["attention_mib_sent_by_link"].values())
    rtol = tolerance(torch.float32, "sharded_loss").rtol
    assert abs(row["loss0"] - eager[0]["loss0"]) <= rtol * abs(eager[0]["loss0"])
    assert row["grad_norm0"] == pytest.approx(eager[0]["grad_norm0"], rel=1e-4)
