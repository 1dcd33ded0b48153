"""The equivalence oracle's error measure (burstc.testing.oracle)."""
import torch

from burstc.testing.oracle import errors_above, training_step_errors

LOSS = torch.tensor(1.0)


def test_nan_in_one_reference_gradient_leaves_the_others_comparable():
    # a NaN gradient (eager's own, reproduced exactly) must not turn the gradient floor, and so every other
    # gradient's error, into NaN
    ref = {"a": torch.tensor([1.0, float("nan")]), "b": torch.tensor([2.0, 3.0])}
    same = {name: g.clone() for name, g in ref.items()}
    assert training_step_errors(LOSS, LOSS, same, ref, grad_floor=1e-3) == {"loss": 0.0, "grad:a": 0.0,
                                                                             "grad:b": 0.0}
    off = dict(same, b=torch.tensor([2.0, 3.1]))
    assert set(errors_above(training_step_errors(LOSS, LOSS, off, ref, 1e-3), 1e-5, 1e-5)) == {"grad:b"}
    moved_nan = dict(same, a=torch.tensor([float("nan"), 1.0]))  # NaN never passes where eager has none
    assert set(errors_above(training_step_errors(LOSS, LOSS, moved_nan, ref, 1e-3), 1e-5, 1e-5)) == {"grad:a"}


def test_the_fp64_truth_forgives_only_gradients_at_least_as_close_to_it_as_eager():
    """DiffLlama's lambda gradients: eager fp32 itself is 2-6x farther from the fp64 truth than burstc, so their
    fp32 comparison (5e-5 relative) fails while burstc is right; a gradient farther from the truth than eager's
    (x TRUTH_FACTOR) stays an error."""
    from burstc.testing.oracle import errors_vs_truth, forgiven_by_truth, fp64_truth, truth_scale

    model = torch.nn.Linear(3, 2)
    truth = fp64_truth(model, lambda twin: (None, {"w": torch.tensor([1.0, 1e-6], dtype=torch.float64)}))
    assert truth is not None and next(iter(model.parameters())).dtype == torch.float32  # a copy went fp64
    true_grads = truth[1]
    eager = {"w": torch.tensor([1.0, 1e-6 + 2e-9])}
    close = {"w": torch.tensor([1.0, 1e-6 + 5e-10])}   # burstc nearer the truth than eager
    far = {"w": torch.tensor([1.0, 1e-6 + 1e-5])}      # far beyond eager and 8 ulps of the largest: wrong
    for grads, kept in ((close, {}), (far, {"grad:w": 1.0})):
        result = {"grad_errors_vs_truth": errors_vs_truth(grads, true_grads),
                  "eager_grad_errors_vs_truth": errors_vs_truth(eager, true_grads),
                  "truth_grad_scale": truth_scale(true_grads)}
        assert forgiven_by_truth({"grad:w": 1.0}, result) == kept
    assert forgiven_by_truth({"grad:w": 1.0}, {}) == {"grad:w": 1.0}  # no truth: the fp32 verdict stands
    assert errors_vs_truth({"w": torch.tensor([float("nan"), 0.0])}, true_grads)["w"] == float("inf")
