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
