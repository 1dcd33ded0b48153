"""``burstc bench`` (benchmarks/end_to_end.py): the console script end to end at tiny sizes, the cap search's
logic on a fake memory curve, and the FLOP count by hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from burstc.testing.oracle import tolerance

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import end_to_end  # noqa: E402  (benchmarks/end_to_end.py)


@pytest.mark.multirank
def test_burstc_bench_end_to_end(tmp_path):
    """2 ranks, 2 short lengths, burstc + a sharded peer + eager + a cap search of a few attempts: every row has
    positive numbers, burstc's step-0 loss equals eager's, the tables and plots are written."""
    script = Path(sys.executable).parent / "burstc"
    command = [str(script) if script.exists() else sys.executable, *([] if script.exists() else ["-m", "burstc.cli"]),
               "bench", "--ranks", "2", "--seq-lens", "64", "128", "--rows", "burstc", "allgather_kv", "eager",
               "--dim", "32", "--ffn", "64", "--vocab", "97", "--steps", "1", "--burstc-backend", "aot_eager",
               "--memory-cap-mib", "0", "--no-progress", "--out-dir", str(tmp_path), "--plots-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "end_to_end.json").read_text())
    results = report["results"]
    assert set(results) == {"burstc", "allgather_kv", "eager"}
    for name, row in results.items():
        assert set(row["by_seq_len"]) == {"64", "128"}, name
        for cell in row["by_seq_len"].values():
            for key in ("tokens_per_s_per_rank", "step_s", "peak_mib_per_rank", "mfu", "loss0", "grad_norm0"):
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
    table = (tmp_path / "end_to_end.md").read_text()
    assert table.count("| burstc (defaults) | 2 |") == 2 and "Targets at S = 128" in table
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
