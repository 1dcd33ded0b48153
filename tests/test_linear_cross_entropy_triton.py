"""Triton kernels of the fused linear + cross-entropy against the oracle: on a GPU when there is one, otherwise
through the Triton interpreter on CPU.

The interpreter is picked when a @triton.jit function is decorated, and triton's own standard library
(tl.max, tl.sum, ...) is decorated when triton is imported: TRITON_INTERPRET=1 must be set before triton itself is
first imported in the process, and must stay set (triton imports interpreter-dependent modules lazily). So:

- triton not imported yet (e.g. this command line): set TRITON_INTERPRET=1 for the process and run in-process;
- triton already imported without it (another test module compiled something first): the tests here skip and
  ``test_interpreter_subprocess`` reruns this file in a fresh interpreter-mode process.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

def _choose_mode() -> str:
    if importlib.util.find_spec("triton") is None:
        return "missing"
    if torch.cuda.is_available():
        return "cuda"
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # process-wide, see the module docstring
        return "interpreter"
    from triton.language import standard

    return "interpreter" if type(standard.max).__name__ == "InterpretedFunction" else "subprocess"


MODE = _choose_mode()
pytest.importorskip("triton")

from test_linear_cross_entropy_op import (  # noqa: E402
    Tolerance,
    assert_close_nan_aware,
    assert_grads_close,
    assert_grads_match,
    grad_output_for,
    gradient_term_magnitudes,
    loss_and_grads,
    oracle,
)
from test_linear_cross_entropy_op import make_inputs as make_cpu_inputs  # noqa: E402

from burstc.kernels.linear_cross_entropy import scale_logits  # noqa: E402
from burstc.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from burstc.testing.oracle import UNIT_ROUNDOFF, tolerance  # noqa: E402

DEVICE = "cuda" if MODE == "cuda" else "cpu"
if MODE in ("interpreter", "cuda"):
    triton_kernels = importlib.import_module("burstc.kernels.linear_cross_entropy_triton")
    if triton_kernels._DECORATED_FOR_INTERPRETER != (MODE == "interpreter"):
        triton_kernels = importlib.reload(triton_kernels)


@pytest.fixture(autouse=True)
def _only_where_kernels_can_run(request):
    if MODE == "subprocess" and request.node.originalname != "test_interpreter_subprocess":
        pytest.skip("triton was imported before TRITON_INTERPRET=1; covered by test_interpreter_subprocess")


def test_interpreter_subprocess():
    if MODE != "subprocess":
        pytest.skip("the kernels run in this process")
    environment = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider",
         "-k", "not test_interpreter_subprocess"],
        capture_output=True, text=True, env=environment, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


def make_inputs(*args, **kwargs):
    """make_cpu_inputs on DEVICE (fresh leaves)."""
    tensors = make_cpu_inputs(*args, **kwargs)
    moved = []
    for tensor in tensors:
        if tensor is None or DEVICE == "cpu":
            moved.append(tensor)
        else:
            moved.append(tensor.detach().to(DEVICE).requires_grad_(tensor.requires_grad))
    return tuple(moved)


# The kernel accumulates each logit in fp32 in tl.dot's order and rounds it to the input dtype once, like the
# oneDNN GEMM behind F.linear but in another summation order: a logit whose fp32 value sits within the accumulation
# error of a rounding boundary rounds the other way (rare; 1 ulp). A flipped target logit moves that token's loss by
# up to 1 ulp(|z|) (2u |z|), so the low-precision loss atol is 2u * max |z| per token; grads also take a 2u * max|z|
# relative error per softmax term. fp32: a few fp32 ulps of the logits, amplified like the op tests.
# The values and their reasons: burstc.testing.oracle.TOLERANCES ("triton_fused_loss", "triton_fused_loss_grad").
def _grad_tolerance(dtype, max_abs_logit):
    loss, grad = tolerance(dtype, "triton_fused_loss"), tolerance(dtype, "triton_fused_loss_grad")
    flip = 2 * UNIT_ROUNDOFF[dtype] * max_abs_logit if dtype != torch.float32 else 0.0
    return Tolerance(
        loss_rtol=loss.rtol,
        loss_atol=0.0,
        grad_rtol=grad.rtol,
        grad_term_atol=grad.atol + flip,
    )


def _scaling(value) -> dict:
    """A case's logit scaling as the op's keywords: None, a scale s (``logits * s``) or "/d" (``logits / d``)."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"logit_divisor": float(value.removeprefix("/"))}
    return {"logit_scale": value}


def _scaled_logits(hidden, weight, bias, softcap, scaling=None):
    """fp64 logits at the input dtype's rounding: linear, then ``* s`` or ``/ d`` in the input dtype, then softcap."""
    logits = F.linear(hidden.detach(), weight.detach(), None if bias is None else bias.detach())
    logits = scale_logits(logits, _scaling(scaling).get("logit_scale"), _scaling(scaling).get("logit_divisor"))
    logits = logits.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _max_abs_logit(hidden, weight, bias, softcap, scaling=None):
    return float(_scaled_logits(hidden, weight, bias, softcap, scaling).abs().max())


def test_kernels_run_in_the_expected_mode():
    expected = "InterpretedFunction" if MODE == "interpreter" else "JITFunction"
    assert triton_kernels._DECORATED_FOR_INTERPRETER == (MODE == "interpreter")
    assert type(triton_kernels._lce_forward_kernel).__name__ == expected
    assert type(triton_kernels._lce_backward_kernel).__name__ == expected


# (num_tokens, vocab, hidden, has_bias, label_smoothing, softcap, scaling): odd sizes that leave partial token,
# vocab and hidden tiles (interpreter tiles are 16 x 32 x 32); Cohere-like (0.0625) and other logit scales (1 / 8,
# with bias and smoothing; 0.3 with a softcap); Granite-like divisors ("/6" with bias, "/3" with smoothing and a
# softcap)
CASES = [
    (1, 5, 3, False, 0.0, None, None),
    (17, 33, 17, True, 0.0, None, None),
    (37, 127, 40, True, 0.1, None, None),
    (64, 200, 64, False, 0.0, 3.0, None),
    (29, 96, 33, True, 0.3, 20.0, None),
    (23, 77, 20, False, 0.0, None, 0.0625),
    (33, 130, 24, True, 0.1, None, 0.125),
    (19, 64, 36, True, 0.0, 4.0, 0.3),
    (21, 90, 28, True, 0.0, None, "/6"),
    (26, 70, 18, False, 0.1, 5.0, "/3"),
]
CASE_ID = "N{}-V{}-H{}-bias{}-eps{}-cap{}-scale{}".format


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: CASE_ID(*c))
def test_forward_kernel_loss_and_lse(case, dtype):
    num_tokens, vocab, hidden_size, has_bias, label_smoothing, softcap, scaling = case
    hidden, weight, target, bias = make_inputs(num_tokens, vocab, hidden_size, dtype, has_bias=has_bias,
                                               ignore_fraction=0.25, seed=num_tokens)
    loss_N, lse_N = triton_kernels.triton_lce_forward(
        hidden.detach(), weight.detach(), target, None if bias is None else bias.detach(),
        label_smoothing=label_smoothing, softcap=softcap, **_scaling(scaling),
    )
    assert loss_N.dtype == lse_N.dtype == torch.float32 and loss_N.shape == lse_N.shape == (num_tokens,)
    expected_loss = oracle(hidden, weight, target, bias, reduction="none", label_smoothing=label_smoothing,
                           softcap=softcap, **_scaling(scaling))
    expected_lse = torch.logsumexp(_scaled_logits(hidden, weight, bias, softcap, scaling), dim=1)
    loss_tolerance = tolerance(dtype, "triton_fused_loss")
    atol = loss_tolerance.atol * max(1.0, _max_abs_logit(hidden, weight, bias, softcap, scaling))
    assert_close_nan_aware(loss_N, expected_loss, rtol=loss_tolerance.rtol, atol=atol, what="per-token loss")
    assert_close_nan_aware(lse_N, expected_lse, rtol=loss_tolerance.rtol, atol=atol, what="lse")
    assert bool((loss_N[target == -100] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: CASE_ID(*c))
def test_triton_op_loss_and_grads(case, reduction, dtype):
    num_tokens, vocab, hidden_size, has_bias, label_smoothing, softcap, scaling = case
    hidden, weight, target, bias = make_inputs(num_tokens, vocab, hidden_size, dtype, has_bias=has_bias,
                                               ignore_fraction=0.25, seed=num_tokens + 1)
    options = dict(reduction=reduction, label_smoothing=label_smoothing, softcap=softcap, **_scaling(scaling))
    loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, impl="triton", **options)
    expected_loss, expected_grads = loss_and_grads(oracle, hidden, weight, target, bias, **options)
    max_logit = max(1.0, _max_abs_logit(hidden, weight, bias, softcap, scaling))
    loss_tolerance = tolerance(dtype, "triton_fused_loss")
    # per-token atol; a sum of n tokens accumulates up to n of them, a mean averages them
    tokens_in_loss = int((target != -100).sum()) if reduction == "sum" else 1
    loss_atol = loss_tolerance.atol * max_logit * max(tokens_in_loss, 1)
    assert_close_nan_aware(loss, expected_loss, rtol=loss_tolerance.rtol, atol=loss_atol, what="loss")
    magnitudes = gradient_term_magnitudes(hidden, weight, target, bias, grad_output_for(loss), **options)
    assert_grads_close(grads, expected_grads, _grad_tolerance(dtype, max_logit), magnitudes)


def test_triton_all_ignored_mean_is_nan_with_zero_grads():
    hidden, weight, target, bias = make_inputs(9, 40, 8, torch.float32, has_bias=True, ignore_fraction=1.0, seed=0)
    loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, impl="triton")
    expected_loss = F.cross_entropy(F.linear(hidden, weight, bias).float(), target)
    assert torch.isnan(loss) and torch.isnan(expected_loss)
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("poison", ["nan_hidden", "inf_hidden_softcap", "nan_weight", "padding"])
def test_triton_nonfinite_values_propagate_as_in_eager(poison):
    """As the chunked path (tests/test_linear_cross_entropy_nonfinite.py): every row is computed, an ignored
    row's dlogits are 0 x its softmax and its hidden state meets them in dlogits^T @ hidden, so NaN/inf there
    reach eager's places; rows the shard pass appended (PADDING_TARGET) reach none, even NaN."""
    from burstc.ops.linear_cross_entropy import PADDING_TARGET

    hidden, weight, target, bias = make_inputs(21, 45, 18, torch.float32, has_bias=True, ignore_fraction=0.0, seed=9)
    target[:5] = -100
    softcap = 3.0 if poison == "inf_hidden_softcap" else None
    kept = slice(None)
    with torch.no_grad():
        if poison == "nan_weight":
            weight[6, 2] = float("nan")
        else:
            hidden[3 if poison != "padding" else 19, 7] = float("inf" if poison == "inf_hidden_softcap" else "nan")
    if poison == "padding":
        target[-3:], kept = PADDING_TARGET, slice(0, -3)
    loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, impl="triton", softcap=softcap)
    real = hidden.detach()[kept].clone().requires_grad_()
    eager_loss, eager_grads = loss_and_grads(
        lambda h, w, t, b, **kw: F.cross_entropy(F.linear(h, w, b).float() if softcap is None else
                                                 softcap * torch.tanh(F.linear(h, w, b).float() / softcap), t),
        real, weight, target[kept], bias)
    torch_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, impl="torch", chunk_size=4,
                                 softcap=softcap)[1]
    for name, actual, expected, chunked in zip(("hidden", "weight", "bias"), grads, eager_grads, torch_grads):
        actual = actual[kept] if name == "hidden" else actual
        assert torch.equal(actual.isnan(), expected.isnan()), f"grad {name}: NaN pattern differs from eager"
        assert_close_nan_aware(actual, chunked[kept] if name == "hidden" else chunked, rtol=1e-5,
                               atol=1e-5 * float(chunked.nan_to_num(0.0).abs().max()), what=f"grad {name}")
    assert_close_nan_aware(loss, eager_loss, rtol=1e-5, atol=1e-5, what="loss")
    if poison in ("nan_hidden", "nan_weight"):
        assert grads[1].isnan().all() and grads[2].isnan().all()
    if poison == "inf_hidden_softcap":
        assert grads[1].isnan().any(dim=0).tolist() == [h == 7 for h in range(18)]
    if poison == "padding":
        assert torch.isfinite(grads[1]).all() and torch.isfinite(grads[2]).all()


@pytest.mark.parametrize("scaling", [None, 0.3, "/3"])
def test_triton_matches_chunked_torch_path(scaling):
    hidden, weight, target, bias = make_inputs(40, 150, 24, torch.float32, has_bias=True, ignore_fraction=0.2, seed=3)
    options = dict(label_smoothing=0.1, softcap=10.0, **_scaling(scaling))
    triton_loss, triton_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, impl="triton",
                                               **options)
    torch_loss, torch_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, impl="torch",
                                             chunk_size=7, **options)
    assert_close_nan_aware(triton_loss, torch_loss, rtol=1e-6, atol=1e-6, what="loss")
    assert_grads_match(triton_grads, torch_grads, rtol=1e-5, atol_of_max=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_op_under_torch_compile(reduction):
    """The interpreted kernels sit inside opaque custom ops, so fullgraph compilation traces around them."""
    hidden, weight, target, bias = make_inputs(20, 70, 16, torch.float32, has_bias=True, ignore_fraction=0.2, seed=5,
                                               leading=(4, 5))

    def loss_fn(h, w, t, b):
        loss = linear_cross_entropy(h, w, t, b, reduction=reduction, impl="triton")
        return loss if reduction == "mean" else (loss * 0.5).sum()

    eager_loss = loss_fn(hidden, weight, target, bias)
    eager_grads = torch.autograd.grad(eager_loss, (hidden, weight, bias))
    torch._dynamo.reset()
    compiled_loss = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)(hidden, weight, target, bias)
    compiled_grads = torch.autograd.grad(compiled_loss, (hidden, weight, bias))
    assert_close_nan_aware(compiled_loss, eager_loss, rtol=0, atol=0, what="compiled loss")
    assert_grads_match(compiled_grads, eager_grads, rtol=0, atol_of_max=0)


def test_triton_on_cpu_without_interpreter_raises_clear_error():
    script = (
        "import torch\n"
        "from burstc.ops.linear_cross_entropy import linear_cross_entropy\n"
        "try:\n"
        "    linear_cross_entropy(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long),"
        " impl='triton')\n"
        "except RuntimeError as error:\n"
        "    print('ERROR:', error)\n"
    )
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ERROR:" in result.stdout and "TRITON_INTERPRET=1" in result.stdout, result.stdout
