"""``benchmarks/gpu_check.py`` at toy sizes on CPU: the script a lent GPU runs as-is must not first fail there.

Every section runs (kernel checks, timings, the one-device training step), the JSON and Markdown are written, and
a wrong kernel makes it exit 1.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_check_smoke_run_on_cpu(tmp_path):
    gpu_check = _load()
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = summary["checks"]
    assert len(checks) == 6 and all(row["ok"] for row in checks)
    assert {row["check"] for row in checks} == {"attention block", "fused LM-head loss"}
    assert all(0 <= row["worst"] <= row["bound"] for row in checks)
    (attention, loss) = summary["timings"]
    assert attention["results"]["burstc block kernels"]["ms"] > 0 and attention["results"]["torch SDPA (flash)"]["ms"] > 0
    assert loss["results"]["burstc fused loss"]["ms"] > 0
    step = summary["train_step"]
    assert "error" not in step and step["tokens"] == 256 and step["rewrites"] == ["lm_head_loss"]
    assert torch.isfinite(torch.tensor(step["loss"])) and step["step s"] > 0
    assert "| attention block |" in (tmp_path / "gpu_check.md").read_text()
    # the ring calls run on a one-rank group (counted on CUDA only)
    assert summary["ring_host_syncs"] == {mask: {"forward": None, "backward": None}
                                          for mask in ("causal", "causal & documents & padding")}
    assert "| causal & documents & padding | – | – |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_fails_on_a_wrong_kernel(monkeypatch, tmp_path):
    gpu_check = _load()
    real_forward = gpu_check.block_attention_forward

    def off_by_a_little(q, k, v, causal, scale):
        out, lse = real_forward(q, k, v, causal, scale)
        return out * 1.01, lse
    monkeypatch.setattr(gpu_check, "block_attention_forward", off_by_a_little)
    rows = gpu_check.check_attention(gpu_check.Device("cpu"), gpu_check.TINY_ATTENTION_SHAPES, [torch.float32], 0)
    assert rows and not any(row["ok"] for row in rows)
    assert all(0.005 < row["errors"]["out"] < 0.02 for row in rows)

    def raises(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")
    monkeypatch.setattr(gpu_check, "block_attention_forward", raises)
    (row, _) = gpu_check.check_attention(gpu_check.Device("cpu"), gpu_check.TINY_ATTENTION_SHAPES, [torch.float32], 0)
    assert not row["ok"] and "no kernel image" in row["error"]
