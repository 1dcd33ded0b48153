"""The checkout's top-level folders must not shadow installed packages when the repository root is on sys.path."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run_in_checkout_root(code: str) -> str:
    # python -c puts the current directory first on sys.path, as python -m pytest does
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_top_level_kernels_name_resolves_to_the_installed_distribution():
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        # nothing to shadow: the folder imports as an empty module, and burstc's kernels still import
        out = _run_in_checkout_root("import kernels, burstc.kernels.linear_cross_entropy as k; print(k.__name__)")
        assert out == "burstc.kernels.linear_cross_entropy"
        return
    out = _run_in_checkout_root(
        "import kernels, burstc.kernels.linear_cross_entropy as k; print(kernels.__file__); print(k.__file__)"
    )
    hf_file, ours_file = out.splitlines()
    assert not Path(hf_file).resolve().is_relative_to(REPO_ROOT), hf_file
    assert Path(ours_file).resolve().parent.name == "kernels"


def test_transformers_imports_from_the_checkout_root():
    pytest.importorskip("transformers")
    out = _run_in_checkout_root(
        "import transformers.integrations.hub_kernels\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "print(type(LlamaForCausalLM(LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=8,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))).__name__)"
    )
    assert out.splitlines()[-1] == "LlamaForCausalLM"


def test_every_burstc_package_is_listed_for_setuptools():
    # a package missing from [tool.setuptools] packages imports in the editable install but not from a wheel
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(REPO_ROOT).parts) for init in (REPO_ROOT / "burstc").rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)
