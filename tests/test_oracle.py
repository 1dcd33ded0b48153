"""The equivalence oracle's error measure (burstc.testing.oracle)."""
import pytest
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


def test_without_a_truth_only_gradients_below_the_rounding_noise_of_the_largest_are_forgiven():
    """Fuzz case 2034-390: router gradients zero in exact arithmetic (1e-8 of the largest gradient, under one fp32
    ulp of it) differ by their own size, and the model's fp64 step is NaN, so no truth can judge them."""
    from burstc.testing.oracle import TRUTH_ULPS, forgiven_as_noise, noise_level_grads

    noise = TRUTH_ULPS * torch.finfo(torch.float32).eps  # of the largest gradient, 1.0 here
    ref = {"big": torch.tensor([1.0, -0.5]), "router": torch.tensor([1e-8, -2e-9]), "small": torch.tensor([1e-4])}
    assert noise_level_grads(ref, ref) == ["router"]  # "small" is 1e-4: real information, never noise
    twice_noise = {**ref, "router": torch.tensor([1e-8 + 2 * noise, 0.0])}
    assert noise_level_grads(twice_noise, ref) == []  # off by more than the noise: a missed or extra term
    nan = {**ref, "router": torch.tensor([float("nan"), 0.0])}
    assert noise_level_grads(nan, ref) == []  # NaN is never noise
    assert noise_level_grads({"big": ref["big"]}, ref) == []  # a missing gradient neither
    assert noise_level_grads(ref, ref, torch.bfloat16) == ["router", "small"]  # bf16's ulp is 2^16 x fp32's

    bad = {"grad:router": 1.3e-5, "grad:small": 1.0, "loss": 1.0}
    listed = {"noise_grads": ["router"]}
    assert forgiven_as_noise(bad, (listed, listed)) == {"grad:small": 1.0, "loss": 1.0}
    assert forgiven_as_noise(bad, (listed, {"noise_grads": []})) == bad  # every run must list it
    assert forgiven_as_noise(bad, ({"noise_grads": None},)) == bad  # a truth existed: its rule decides
    assert list(forgiven_as_noise({"grad:router": float("nan")}, (listed,))) == ["grad:router"]  # NaN never passes


def test_a_nonfinite_fp64_truth_falls_back_to_the_given_lower_precision_only_when_that_is_finite():
    """HF's eager attention adds a finfo(dtype).min mask and softmaxes in fp32: in fp64 a query row that sees no key
    becomes all -inf after the cast, so the fp64 step is NaN where fp32 and bf16 are finite (fuzz case 2030/782).
    A bf16 case then takes the fp32 step as its truth; an fp32 case (no fallback) keeps the NaN truth, and a
    fallback that is not finite either is not taken."""
    from burstc.testing.oracle import fp64_truth

    class MinMaskSoftmaxInFp32(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

        def forward(self):
            masked = self.w + torch.finfo(self.w.dtype).min  # every key hidden, like a padded row under a window
            return (torch.softmax(masked.to(torch.float32), dim=-1).to(self.w.dtype) * self.w).sum()

    def step(twin):
        loss = twin()
        loss.backward()
        return loss.detach(), {"w": twin.w.grad.detach().clone()}

    model = MinMaskSoftmaxInFp32()
    nan_truth = fp64_truth(model, step)
    assert nan_truth[0].isnan() and nan_truth[1]["w"].dtype == torch.float64
    loss, grads = fp64_truth(model, step, fallback=torch.float32)
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and torch.isfinite(grads["w"]).all()
    assert torch.allclose(loss, step(MinMaskSoftmaxInFp32())[0])  # the fp32 step itself
    assert model.w.grad is None and model.w.dtype == torch.float32  # copies only

    class AlwaysNan(MinMaskSoftmaxInFp32):
        def forward(self):
            return super().forward() * float("nan")

    still_nan = fp64_truth(AlwaysNan(), step, fallback=torch.float32)
    assert still_nan[0].dtype == torch.float64 and still_nan[0].isnan()


def test_fewest_layers_keeps_two_only_where_they_differ():
    """The 59-architecture check runs one decoder layer where a second would repeat the first; layers of two
    kinds (sliding and global attention, a dense then an MoE MLP, per-layer config lists) keep both."""
    pytest.importorskip("transformers")
    from burstc.testing import zoo
    from burstc.testing.zoo.hf import _decoder_layers

    for config_name, layers in (("LlamaConfig", 1), ("GPT2Config", 1), ("MixtralConfig", 1),
                                ("Gemma2Config", 2), ("DeepseekV3Config", 2), ("Llama4TextConfig", 2)):
        model = zoo.hf_arch_fewest_layers(config_name)
        assert len(_decoder_layers(model)) == model.config.num_hidden_layers == layers, config_name
    one = zoo.hf_arch_fewest_layers("LlamaConfig")
    two = zoo.hf_arch("LlamaConfig")
    ids = torch.randint(0, 97, (1, 8))
    assert one(ids).logits.shape == two(ids).logits.shape  # a working model, the same sizes otherwise
