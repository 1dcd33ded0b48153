"""The model fuzzer: random small decoder-only models (generated ones and tiny HF architectures), random inputs
and random ``burstc.compile`` options, each checked against single-device eager on P gloo ranks.

A case either rewrites and matches eager (loss and every parameter gradient, the oracle's one tolerance table)
or is refused with a code and still matches.  Beside eager, metamorphic checks:

- an *alternative* option set (another layout and backward plan) on the same ranks agrees with the first;
- on P = 1 a mesh of one rank is one device: ``burstc.compile(model, mesh_of_one)`` equals
  ``burstc.compile(model, None)`` bitwise (burstc's one promise of bitwise equality; against eager the
  fused loss reorders the vocab reduction, so P = 1 vs eager is held to the one-device ``loss``/``param_grad``
  tolerances).

Gradients are compared with the oracle's ``SHARDED_GRAD_FLOOR`` on every P (one device included): a gradient that
is zero in exact arithmetic (a key bias; q/k with one visible key) is rounding noise on both sides.  A gradient
still off after that is measured against the same step in fp64 (the truth; for a bf16 case whose fp64 step is not
finite, the fp32 step): it is right when it is within
``TRUTH_FACTOR`` x eager's own distance to the truth, or within ``TRUTH_ULPS`` ulps of the largest true gradient,
in the case's precision (``burstc.testing.oracle.truth_allows``).  Cases run in fp32, with bf16 weights, or under bf16
autocast (``Case.precision``; the bf16 rows of the tolerance table).  A mismatch
is *marginal* when every error is finite and under 10x its tolerance, else *gross*; each also reports its worst
gradient entry in units of the largest gradient (a few 1e-8 is fp32 rounding).  ``rejected`` counts burstc's
documented error for a length the layout can't split when padding would not be exact.

Strategies: :func:`cases` (hypothesis; ``tests/test_fuzz_sample.py`` runs a fixed-seed sample).  The same
generator runs from a seeded ``random.Random`` for the long run::

    python -m burstc.testing.fuzz --cases 300 --seed 1 [--ranks 2 4] [--out fuzz-out]

prints the counts (tried, rewritten, refused by code, rejected, torch.compile's own failures, mismatches, crashes,
hangs) and writes, for every
failing case, a reduced standalone reproducer ``<out>/case-<seed>-<n>.py`` (each distinct failure reduced once).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from burstc.testing.fuzz_models import (
    LOSSES,
    HFSpec,
    InputSpec,
    ModelSpec,
    build_inputs,
    build_model,
    compute_loss,
)
from burstc.config import RING_KINDS
from burstc.layout import LAYOUT_OPTIONS
from burstc.testing.zoo.hf import HF_ARCHITECTURES
from burstc.testing.oracle import (
    SHARDED_GRAD_FLOOR,
    errors_above,
    errors_vs_truth,
    forgiven_as_noise,
    forgiven_by_truth,
    finite_step,
    fp64_truth,
    noise_level_grads,
    parameter_grads,
    summed_over_ranks,
    tolerance,
    training_step_errors,
    truth_scale,
)

HF_VOCAB = 97
MAX_SEQ = 64  # the tiny HF configs have 64 positions

# config overrides that give an architecture a mask beyond causal (a window of w tokens, ALiBi)
_HF_MASK_VARIANTS = {
    "MistralConfig": lambda w: (("sliding_window", w),),
    "Starcoder2Config": lambda w: (("sliding_window", w),),
    "Gemma2Config": lambda w: (("sliding_window", w),),
    "Qwen2Config": lambda w: (("sliding_window", w), ("use_sliding_window", True), ("max_window_layers", 0)),
    "Gemma3TextConfig": lambda w: (("sliding_window", w), ("layer_types", ("sliding_attention", "full_attention"))),
    "FalconConfig": lambda w: (("alibi", True), ("new_decoder_architecture", False), ("num_kv_heads", 4)),
    # not a mask: a mixture of experts' load-balancing loss added to the LM loss (sums over every token)
    **{name: lambda w: (("output_router_logits", True), ("router_aux_loss_coef", 0.02)) for name in (
        "MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig", "OlmoeConfig", "GraniteMoeConfig", "FlexOlmoConfig")},
}
_NO_SDPA = {"Gemma2Config"}
LAYOUTS = ("zigzag", "contiguous", "striped")  # what the options draw from (``--layouts``)
PLANS = ("auto", "kv_ring", "burst")


@dataclass(frozen=True)
class Case:
    model: ModelSpec | HFSpec
    inputs: InputSpec
    world_size: int = 2
    options: tuple = (("backend", "aot_eager"),)
    alternative: tuple | None = None   # a second option set that must agree with the first (P > 1)
    seed: int = 0
    # "fp32"; "bf16" (the model's weights in bf16, eager and burstc alike); "autocast" (fp32 weights, every step
    # under torch.autocast("cpu", bfloat16)): the bf16 rows of the tolerance table, the fp64 truth beside them
    precision: str = "fp32"
    # a two-level mesh (nodes, ranks per node) named ("inter", "intra") over the world_size ranks; None: 1-D
    mesh: tuple[int, int] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def vocab(self) -> int:
        return HF_VOCAB if isinstance(self.model, HFSpec) else self.model.vocab

    def describe(self) -> str:
        m = self.model
        if isinstance(m, HFSpec):
            model = f"hf:{m.config_name.removesuffix('Config')}/{m.impl}" + (f" {dict(m.overrides)}" if m.overrides
                                                                              else "")
        else:
            model = (f"gen:{m.attention}/{m.positions}/H{m.heads}kv{m.kv_heads}"
                     + "".join(f" {f}" for f in ("documents", "document_ids_input", "key_padding", "alibi",
                                                 "qk_norm") if getattr(m, f))
                     + (f" window={m.window}" if m.window else "") + (f" cap={m.score_softcap}" if m.score_softcap
                                                                      else "")
                     + (f" {m.mlp}" + (f"(k={m.moe_top_k})" if m.mlp.startswith("moe") else "")
                        if m.mlp != "swiglu" else "")
                     + f" {m.logits_op}/{m.loss}"
                     + (f" seq:{m.sequence_term}" if m.sequence_term != "none" else ""))
        model += f" {self.precision}" if self.precision != "fp32" else ""
        i = self.inputs
        inputs = (f"B{i.batch}xS{i.seq}" + (f" docs{list(i.documents)}" if i.documents else "")
                  + (f" pad-{i.padding}{list(i.pad_lengths)}" if i.padding != "none" else "")
                  + (f" ignore-{i.ignore}" if i.ignore != "none" else ""))
        where = f"P={self.world_size}" + (f" ({self.mesh[0]}x{self.mesh[1]} mesh)" if self.mesh else "")
        return f"{where} {model} | {inputs} | {dict(self.options)}"


# ---- the generator: one function, driven by hypothesis (tests) or by random.Random (the long run) -----------


class RandomDraw:
    """Choices from a seeded ``random.Random``."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def choice(self, options):
        return self.rng.choice(list(options))

    def integer(self, low, high):
        return self.rng.randint(low, high)

    def boolean(self, p=0.5):
        return self.rng.random() < p


class HypothesisDraw:
    """The same choices through hypothesis's ``draw`` (so that hypothesis can replay and shrink them: every
    choice shrinks towards its first option, ``low``, or False)."""

    def __init__(self, draw):
        self.draw = draw

    def choice(self, options):
        from hypothesis import strategies as st
        return self.draw(st.sampled_from(list(options)))

    def integer(self, low, high):
        from hypothesis import strategies as st
        return self.draw(st.integers(low, high))

    def boolean(self, p=0.5):
        from hypothesis import strategies as st
        return self.draw(st.integers(0, 99)) >= round(100 * (1 - p))


def generate_flex_spec(d) -> ModelSpec:
    """A generated model whose attention is FlexAttention: causal, windowed or per-document (ids an input, or
    computed in the forward from position_ids, a replicated value of the token inputs) mask_mods, a soft-cap or ALiBi score_mod, GQA through enable_gqa or repeats."""
    heads = d.choice([4, 2])
    kv_heads = d.choice([h for h in (heads, 1, 2) if heads % h == 0])
    score = d.choice([None, None, "softcap", "alibi"])
    documents = d.boolean(0.4)  # ids as an input or computed from position_ids in the forward
    return ModelSpec(
        dim=d.choice([32, 16]), layers=d.choice([1, 2]), heads=heads, kv_heads=kv_heads, head_dim=d.choice([8, 4]),
        attention="flex", gqa=d.choice(["enable_gqa", "repeat_kv"]) if kv_heads < heads else "repeat_kv",
        qk_norm=d.boolean(0.25), score_softcap=20.0 if score == "softcap" else None, alibi=score == "alibi",
        window=d.integer(1, 20) if d.boolean(0.3) else None, documents=documents,
        document_ids_input=documents and d.boolean(0.7),
        positions=d.choice(["rope", "none", "learned"]), norm=d.choice(["rms", "layer"]),
        mlp=d.choice(["swiglu", "none"]), tied=d.boolean(0.3), logits_op=d.choice(["none", "upcast", "softcap"]),
        loss=d.choice(LOSSES),
    )


def generate_model_spec(d) -> ModelSpec:
    heads = d.choice([4, 2, 1])
    kv_heads = d.choice([h for h in (heads, 1, 2) if heads % h == 0])
    head_dim = d.choice([8, 4, 6])
    attention = d.choice(["sdpa_causal", "sdpa_bool", "sdpa_float", "manual"])
    masked = attention != "sdpa_causal"
    window = d.integer(1, 20) if masked and d.boolean(0.3) else None
    gqa = "repeat_kv"
    if kv_heads < heads:
        gqa = d.choice(["repeat_kv", "repeat_interleave"] + (["enable_gqa"] if attention != "manual" else []))
    return ModelSpec(
        dim=d.choice([32, 16, 24]), layers=d.choice([1, 2]), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        attention=attention, mask_source=d.choice(["arange", "buffer", "triu"]),
        mask_fill=d.choice(["-inf", "finfo.min"]), masked_fill=d.boolean(), softmax_fp32=d.boolean(0.3), gqa=gqa,
        qkv_bias=d.boolean(0.3), qk_norm=d.boolean(0.25),
        score_softcap=d.choice([50.0, 20.0, 5.0]) if attention == "manual" and d.boolean(0.25) else None,
        alibi=attention in ("sdpa_float", "manual") and d.boolean(0.2), window=window,
        documents=masked and d.boolean(0.25), key_padding=masked and d.boolean(0.2),
        positions=d.choice(["rope", "none", "learned", "rope_partial", "rope_complex"]),
        norm=d.choice(["rms", "layer", "none"]),
        mlp=d.choice(["swiglu", "none", "gelu", "relu2", "moe_batched", "moe_sorted", "moe_argsort"]),
        moe_top_k=d.choice([1, 2, 3]), tied=d.boolean(0.3), head_bias=d.boolean(0.2),
        logits_op=d.choice(["none", "upcast", "scale", "div", "softcap", "scale_odd"]), loss=d.choice(LOSSES),
        sequence_term=d.choice(["sum_tokens", "mean_tokens", "aux_mean", "both", "max_tokens"]) if d.boolean(0.1)
        else "none",
    )


def generate_hf_spec(d) -> HFSpec:
    import transformers

    names = [n for n in HF_ARCHITECTURES if hasattr(transformers, n)]
    name = d.choice(names)
    impl = "eager" if name in _NO_SDPA else d.choice(["sdpa", "eager"])
    overrides = ()
    if name in _HF_MASK_VARIANTS and d.boolean(0.5):
        overrides = _HF_MASK_VARIANTS[name](d.integer(2, 24))
    return HFSpec(config_name=name, impl=impl, overrides=overrides, checkpointing=d.boolean(0.1))


def generate_input_spec(d, world_size: int, model) -> InputSpec:
    lengths = [16, 32, 1, 7, 17, 33, 24, 48, 64, 5, 31] + ([world_size - 1] if world_size > 2 else [])
    seq = d.choice(lengths)
    batch = d.choice([1, 2, 3])
    wants_documents = isinstance(model, HFSpec) or model.documents
    wants_padding = isinstance(model, HFSpec) or model.key_padding
    documents = ()
    if seq >= 4 and d.boolean(0.6 if wants_documents else 0.1):
        budget, lengths = seq, []
        for _ in range(d.integer(1, 3)):  # the documents fit the row (the last one fills what is left)
            if budget < 1:
                break
            lengths.append(d.integer(1, max(1, min(budget, seq // 2))))
            budget -= lengths[-1]
        documents = tuple(lengths)
    padding, pad_lengths = "none", ()
    if seq >= 2 and d.boolean(0.5 if wants_padding else 0.1):
        padding = d.choice(["right", "left"])
        pad_lengths = tuple(d.integer(0, seq - 1) for _ in range(batch))
    ignore = d.choice(["none"] * 6 + ["some"] * 3 + ["all"])
    return InputSpec(batch=batch, seq=seq, documents=documents, padding=padding, pad_lengths=pad_lengths,
                     ignore=ignore, seed=d.integer(0, 2**16))


def _draw_layouts(layouts) -> None:
    """What :func:`generate_options` draws layouts from, from now on (the CLI's ``--layouts``)."""
    global LAYOUTS
    LAYOUTS = tuple(layouts)


KEEP_FRACTIONS = (0.25, 0.5, 0.75)


OVERLAP_BOUNDS = (0, 1 << 30)  # overlap_memory_bytes drawn beside the default (None): nothing moves / all may


def generate_options(d, world_size: int, allow_inductor: bool = False, checkpoint_fraction: float = 0.0,
                     local_grads_fraction: float = 0.0) -> tuple[tuple, tuple | None]:
    """``checkpoint_fraction``: share of cases with burstc's checkpointing (``"layers"``, ``"selective"``, half of
    the selective ones keeping part of each attention's output); ``local_grads_fraction``: of cases on a mesh with
    ``reduce_grads=False`` (gradients summed over the ranks by the oracle; weight gradients moved into the ring
    backwards' last hops, half of them under a drawn ``overlap_memory_bytes``); 0 draws nothing for either (earlier
    seeds stay)."""
    backend = "inductor" if allow_inductor and d.boolean(0.05) else "aot_eager"
    options = [("backend", backend), ("layout", d.choice(LAYOUTS)), ("attention_plan", d.choice(PLANS))]
    if d.boolean(0.3):
        options.append(("lm_head_chunk_size", d.integer(1, 40)))
    if d.boolean(0.2):
        options.append(("check_inputs", False))
    if checkpoint_fraction and d.boolean(checkpoint_fraction):
        options.append(("checkpoint", d.choice(["layers", "selective"])))
        if options[-1][1] == "selective" and d.boolean(0.5):
            options.append(("checkpoint_keep", d.choice(KEEP_FRACTIONS)))
    if local_grads_fraction and world_size > 1 and d.boolean(local_grads_fraction):
        options.append(("reduce_grads", False))
        if d.boolean(0.5):
            options.append(("overlap_memory_bytes", d.choice(OVERLAP_BOUNDS)))
    alternative = None
    if world_size > 1 and d.boolean(0.4):
        layout = d.choice([x for x in LAYOUTS if x != dict(options)["layout"]])
        plan = d.choice([x for x in PLANS if x != dict(options)["attention_plan"]])
        alternative = tuple(o for o in options if o[0] not in ("layout", "attention_plan"))
        alternative += (("layout", layout), ("attention_plan", plan))
    return tuple(options), alternative


def generate_case(d, world_sizes=(1, 2, 3, 4), hf_fraction: float = 0.3, allow_inductor: bool = False,
                  flex_fraction: float = 0.0, checkpoint_fraction: float = 0.0, local_grads_fraction: float = 0.0,
                  two_level_fraction: float = 0.0) -> Case:
    """``flex_fraction``: share of FlexAttention models; ``checkpoint_fraction``: of cases with burstc's
    checkpointing; ``local_grads_fraction``: of cases with ``reduce_grads=False``; ``two_level_fraction``: of cases
    whose world size factors into nodes x ranks per node (both >= 2) on a named two-level mesh, each option set
    with a drawn ``ring`` (flat, double, ulysses or auto); 0 draws nothing for any (earlier seeds stay the same)."""
    world_size = d.choice(list(world_sizes))
    if flex_fraction and d.boolean(flex_fraction):
        model = generate_flex_spec(d)
    else:
        model = generate_hf_spec(d) if d.boolean(hf_fraction) else generate_model_spec(d)
    inputs = generate_input_spec(d, world_size, model)
    options, alternative = generate_options(d, world_size, allow_inductor, checkpoint_fraction, local_grads_fraction)
    precision = "fp32" if d.boolean(0.8) else d.choice(["bf16", "autocast"])
    if _routes_tokens(model):
        # a router's top-k is discontinuous: in bf16 a last-bit difference in its input (another attention kernel,
        # eager's own math vs flash backends included) can flip a token's expert and move that expert's gradients
        # by tens of percent (seen: Mixtral, 1 of 48 tokens, 18%); equality with eager is only defined in fp32
        precision = "fp32"
    mesh = None
    shapes = two_level_shapes(world_size)
    if two_level_fraction and shapes and d.boolean(two_level_fraction):
        mesh = d.choice(shapes)
        options += (("ring", d.choice(RING_KINDS)),)
        if alternative is not None:  # metamorphic across ring kinds too
            alternative += (("ring", d.choice(RING_KINDS)),)
    return Case(model=model, inputs=inputs, world_size=world_size, options=options, alternative=alternative,
                precision=precision, mesh=mesh)


def two_level_shapes(world_size: int) -> list[tuple[int, int]]:
    """``(nodes, ranks per node)``, both >= 2, whose product is ``world_size``."""
    return [(n, world_size // n) for n in range(2, world_size // 2 + 1) if world_size % n == 0]


def _routes_tokens(model) -> bool:
    """A mixture of experts: HF's MoE architectures, or a generated MoE block."""
    if isinstance(model, HFSpec):
        return any(k in model.config_name for k in ("Moe", "Mixtral", "FlexOlmo", "Llama4", "MiniMax"))
    return model.mlp.startswith("moe")


def cases(world_sizes=(1, 2, 3, 4), hf_fraction: float = 0.3, allow_inductor: bool = False,
          flex_fraction: float = 0.0):
    """A hypothesis strategy of :class:`Case`."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        return generate_case(HypothesisDraw(draw), world_sizes, hf_fraction, allow_inductor, flex_fraction)

    return strategy()


# ---- running a case on P ranks ------------------------------------------------------------------------------


def _training_step(model, inputs, run=None, autocast: bool = False):
    """Loss and parameter gradients of ``model`` after one forward/backward through ``run`` (default the model;
    a compiled wrapper of it); ``autocast``: the forward under ``torch.autocast("cpu", bfloat16)``."""
    import contextlib

    from burstc.testing.zoo.flex import cpu_flex_backward

    model.zero_grad(set_to_none=True)
    # FlexAttention on CPU: torch's dense math backward (it has no CPU kernel and refuses requires_grad), for
    # eager and for a compiled run that keeps a flex_attention eager (a mesh of one)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext(), \
            cpu_flex_backward():
        loss = compute_loss(model if run is None else run, inputs)
    loss.backward()
    return loss.detach().clone(), parameter_grads(model)


def _bitwise_equal(loss, grads, other_loss, other_grads) -> bool:
    same = lambda a, b: a.shape == b.shape and torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0)) \
        and torch.equal(torch.isnan(a), torch.isnan(b))  # noqa: E731
    return same(loss, other_loss) and grads.keys() == other_grads.keys() and all(
        same(grads[k], other_grads[k]) for k in grads)


def _global_grad_error(grads, ref_grads) -> float:
    """max |a - e| over every gradient entry / max |e| over every gradient: how far the worst entry is off in
    units of the largest gradient (fp32 rounding makes this a few 1e-8; a wrong gradient makes it large)."""
    scale = max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=0.0) or 1.0
    diffs = [float((grads[k].double() - g.double()).abs().nan_to_num(0.0).max()) for k, g in ref_grads.items()
             if k in grads and grads[k].shape == g.shape and g.numel()]
    return max(diffs, default=0.0) / scale


def fuzz_task(rank: int, world_size: int, case: Case) -> dict:
    """On every rank: eager on the full batch, then ``burstc.compile`` with each option set; the errors."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = build_model(case.model, case.seed)
    inputs = build_inputs(case.inputs, case.vocab)
    # the same step on an fp64 copy (fp32 weights, no autocast): the truth of every precision; a bf16 case whose
    # fp64 step is not finite (model code written for fp32 and lower) takes the fp32 step as its truth
    truth = fp64_truth(model, lambda twin: _training_step(twin, inputs),
                       fallback=torch.float32 if case.precision != "fp32" else None)
    if case.precision == "bf16":
        model = model.to(torch.bfloat16)
    autocast = case.precision == "autocast"
    ref_loss, ref_grads = _training_step(model, inputs, autocast=autocast)
    # a gradient that is zero in exact arithmetic (q/k with one visible key) is rounding noise on both sides,
    # on one device too (aot_eager decomposes SDPA): the oracle's floor for every P
    floor = SHARDED_GRAD_FLOOR
    mesh = (init_device_mesh("cpu", case.mesh, mesh_dim_names=("inter", "intra")) if case.mesh
            else init_device_mesh("cpu", (world_size,)))
    runs = []
    for options in (case.options, case.alternative):
        if options is None:
            continue
        torch._dynamo.reset()
        run: dict = {"options": dict(options)}
        try:
            cmodel = burstc.compile(model, mesh, **dict(options))
            loss, grads = _training_step(model, inputs, cmodel, autocast=autocast)
            if not dict(options).get("reduce_grads", True):
                # left local: the caller's reduction over the sequence ranks (a sum) must give eager's gradients
                grads = summed_over_ranks(grads)
                if grads is None:
                    raise RuntimeError("reduce_grads=False: the ranks hold gradients of different parameters")
            report = burstc.report(cmodel)
        except Exception as exc:  # noqa: BLE001 - a crash is a finding: report it, never hide it
            run["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
            run["traceback"] = traceback.format_exc()[-4000:]
            run["torch_error"] = plain_compile_error(model, inputs, dict(options).get("backend", "inductor"),
                                                     autocast)
            runs.append(run)
            continue
        run.update(errors=training_step_errors(loss, ref_loss, grads, ref_grads, floor), loss=float(loss),
                   global_grad_error=_global_grad_error(grads, ref_grads),
                   rewrites=[r.kind for r in report.rewrites],
                   masks=[r.details.get("mask") for r in report.rewrites if r.kind == "attention"],
                   rings=[r.details.get("ring") for r in report.rewrites if r.kind == "attention"],
                   skip_codes=[s.code for s in report.skipped],
                   skips=[f"{s.code}: {s.reason}"[:300] for s in report.skipped],
                   grad_errors_vs_truth=errors_vs_truth(grads, truth[1]) if truth is not None else None,
                   # no finite truth: the gradients at rounding-noise level are judged by that instead
                   noise_grads=(noise_level_grads(grads, ref_grads, case.dtype)
                                if truth is None or not finite_step(*truth) else None),
                   summary=str(report).splitlines()[0] if str(report) else "")
        if runs and "errors" in runs[0]:  # metamorphic: the two option sets agree with each other
            first_loss, first_grads = runs[0].pop("_step")
            run["errors_vs_first"] = training_step_errors(loss, first_loss, grads, first_grads, floor)
        run["_step"] = (loss, grads)
        runs.append(run)
    if world_size == 1 and runs and "errors" in runs[0]:
        # a mesh of one rank is one device: the same passes, so the same bits as mesh=None
        torch._dynamo.reset()
        try:
            none_loss, none_grads = _training_step(model, inputs, burstc.compile(model, None, **dict(case.options)),
                                                   autocast=autocast)
            runs[0]["bitwise_vs_no_mesh"] = _bitwise_equal(*runs[0]["_step"], none_loss, none_grads)
        except Exception as exc:  # noqa: BLE001
            runs[0]["error"] = f"mesh=None: {type(exc).__name__}: {str(exc)[:1500]}"
        runs[0]["bitwise_vs_eager"] = _bitwise_equal(*runs[0]["_step"], ref_loss, ref_grads)
    for run in runs:
        run.pop("_step", None)
    truth_fields = {}
    if truth is not None:
        truth_fields = {"eager_grad_errors_vs_truth": errors_vs_truth(ref_grads, truth[1]),
                        "truth_grad_scale": truth_scale(truth[1])}
    return {"rank": rank, "ref_loss": float(ref_loss), "ref_nonfinite": not finite_step(ref_loss, ref_grads),
            "runs": runs, **truth_fields}


def plain_compile_error(model, inputs, backend: str, autocast: bool = False) -> str | None:
    """torch.compile's own failure on this model and input — one process, no mesh, no burstc — as
    ``"Type: message"``, or None when that step runs: a burstc crash where this fails too is torch's."""
    torch._dynamo.reset()
    try:
        _training_step(model, inputs, torch.compile(model, backend=backend), autocast=autocast)
    except Exception as exc:  # noqa: BLE001 - the finding is whether plain torch.compile fails
        return f"{type(exc).__name__}: {str(exc)[:500]}"
    finally:
        torch._dynamo.reset()
    return None


@dataclass
class Outcome:
    kind: str            # "rewritten", "refused", "one_device", "rejected" (burstc's error for a length the
                         # layout can't split exactly), "torch_crash" (plain torch.compile fails alike on one
                         # process), "mismatch", "crash", "hang"
    codes: list          # the refusal codes of the first run (rank 0)
    detail: str = ""     # why it failed
    results: list | None = None

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "crash", "hang")


def classify(case: Case, results: list[dict]) -> Outcome:
    """Rank results -> one :class:`Outcome` (the failures first: a crash, then any error above tolerance)."""
    quantity = ("sharded_loss", "sharded_param_grad") if case.world_size > 1 else ("loss", "param_grad")
    loss_rtol, grad_rtol = (tolerance(case.dtype, q).rtol for q in quantity)
    first = results[0]["runs"][0] if results[0]["runs"] else {}
    codes = first.get("skip_codes", [])
    torch_crashes = []
    for result in results:
        for run in result["runs"]:
            if "error" in run and _is_length_rejection(run["error"]):
                return Outcome("rejected", codes, f"rank {result['rank']}: {run['error'].splitlines()[-1]}", results)
            if "error" in run and run.get("torch_error"):
                torch_crashes.append(f"rank {result['rank']} {run['options']}: {run['error']}\nplain torch.compile "
                                     f"on one process: {run['torch_error']}")
            elif "error" in run:
                return Outcome("crash", codes, f"rank {result['rank']} {run['options']}: {run['error']}\n"
                                               f"{run.get('traceback', '')}", results)
    failures, worst_ratio = [], 0.0
    for result in results:
        for run in result["runs"]:
            if "error" in run:  # torch's own failure (above): nothing to compare
                continue
            for label, errors in (("vs eager", run["errors"]), ("vs the first option set",
                                                                 run.get("errors_vs_first", {}))):
                # the fp64 truth may show a gradient right: this run's, and (vs the first set) the first run's
                bad = forgiven_by_truth(errors_above(errors, loss_rtol, grad_rtol), result, case.dtype,
                                        runs=(run, result["runs"][0]))
                bad = forgiven_as_noise(bad, (run, result["runs"][0]))
                if bad:
                    worst_ratio = max([worst_ratio] + [e / (loss_rtol if k == "loss" else grad_rtol)
                                                       if e == e else math.inf for k, e in bad.items()])
                    worst = sorted(bad.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else -math.inf)[:4]
                    failures.append(f"rank {result['rank']} {run['options']} {label}: {worst} (loss {run['loss']}"
                                    f" vs eager {result['ref_loss']}; worst gradient entry off by "
                                    f"{run.get('global_grad_error', math.nan):.2g} of the largest gradient; "
                                    f"{run['summary']})")
            if run.get("bitwise_vs_no_mesh") is False:
                worst_ratio = math.inf
                failures.append(f"rank {result['rank']}: a mesh of one rank differs bitwise from mesh=None")
    if failures:
        # marginal: every error finite and under 10x its tolerance (rounding noise the table may not cover)
        severity = "marginal" if worst_ratio < 10 else "gross"
        return Outcome("mismatch", codes, f"{severity} mismatch\n" + "\n".join(failures[:6]), results)
    if torch_crashes:
        return Outcome("torch_crash", codes, "\n".join(torch_crashes[:4]), results)
    if case.world_size == 1:
        return Outcome("one_device", codes, results=results)
    return Outcome("rewritten" if "shard" in first.get("rewrites", []) else "refused", codes, results=results)


def _is_length_rejection(error: str) -> bool:
    """burstc's documented error for a length the layout can't split when padding would not be exact."""
    return "is not a multiple of" in error and "pad the batch to a multiple of" in error


def run_case(pool, case: Case, timeout: float = 300.0) -> Outcome:
    """Run ``case`` on ``pool.get(case.world_size)`` (a :class:`burstc.testing.WorkerPool`)."""
    from burstc.testing.workers import WorkerError, WorkerGroupDead

    try:
        results = pool.get(case.world_size).run(fuzz_task, case, timeout=timeout)
    except TimeoutError as exc:
        return Outcome("hang", [], str(exc))
    except (WorkerError, WorkerGroupDead) as exc:
        return Outcome("crash", [], str(exc)[:4000])
    return classify(case, results)


def refusal_code(outcome: Outcome) -> str:
    """The code a refused case is counted under: its first ``shard.*`` code, else its first code."""
    return next((c for c in outcome.codes if c.startswith("shard.")), outcome.codes[0] if outcome.codes else "?")


# ---- reduction and reproducers -------------------------------------------------------------------------------


def _simpler(case: Case):
    """Candidate cases one step simpler than ``case`` (the reducer keeps those that still fail)."""
    m, i = case.model, case.inputs
    if case.alternative is not None:
        yield dataclasses.replace(case, alternative=None)
        yield dataclasses.replace(case, options=case.alternative, alternative=None)
    if case.mesh is not None:  # the flat ring over the same ranks
        yield dataclasses.replace(case, mesh=None, alternative=None,
                                  options=tuple(o for o in case.options if o[0] != "ring"))
    if case.world_size > 2:
        yield dataclasses.replace(case, world_size=2, mesh=None, alternative=None,
                                  options=tuple(o for o in case.options if o[0] != "ring"))
    if case.precision != "fp32":
        yield dataclasses.replace(case, precision="fp32")
    plain = [("backend", "aot_eager")] + [o for o in case.options if o[0] in ("layout", "attention_plan", "ring")]
    if tuple(plain) != case.options:
        yield dataclasses.replace(case, options=tuple(plain))
    for field, simple in (("ignore", "none"), ("batch", 1), ("documents", ()), ("padding", "none")):
        if getattr(i, field) != simple:
            changes = {field: simple}
            if field == "padding":
                changes["pad_lengths"] = ()
            if field == "batch" and i.pad_lengths:
                changes["pad_lengths"] = (max(i.pad_lengths),)
            yield dataclasses.replace(case, inputs=dataclasses.replace(i, **changes))
    for seq in (16, 8):
        if i.seq > seq and not i.documents and not i.pad_lengths:
            yield dataclasses.replace(case, inputs=dataclasses.replace(i, seq=seq))
    if isinstance(m, HFSpec):
        if m.checkpointing:
            yield dataclasses.replace(case, model=dataclasses.replace(m, checkpointing=False))
        return
    for field, simple in (("layers", 1), ("mlp", "none"), ("norm", "none"), ("positions", "none"),
                          ("qk_norm", False), ("qkv_bias", False), ("tied", False), ("head_bias", False),
                          ("logits_op", "none"), ("loss", "ce_mean"), ("kv_heads", m.heads), ("alibi", False),
                          ("score_softcap", None), ("window", None), ("softmax_fp32", False),
                          ("mask_source", "arange"), ("sequence_term", "none")):
        if getattr(m, field) != simple:
            yield dataclasses.replace(case, model=dataclasses.replace(m, **{field: simple}))


def failure_signature(outcome: Outcome) -> str:
    """What makes two failures the same one: the kind and the error's last line without its numbers."""
    import re

    lines = [line for line in outcome.detail.splitlines() if line.strip()]
    text = lines[-1] if outcome.kind == "crash" and lines else (lines[0] if lines else "")
    if outcome.kind == "mismatch":
        text = lines[0] + " " + " ".join(re.findall(r"'(grad:[^']+|loss)'", lines[1] if len(lines) > 1 else "")[:2])
    return outcome.kind + ": " + re.sub(r"[0-9.e+-]+", "#", text)[:200]


def reduce_case(pool, case: Case, outcome: Outcome, max_tries: int = 16, timeout: float = 300.0):
    """Greedy reduction: apply simplifications that keep the failure kind; at most ``max_tries`` reruns."""
    tries = 0
    improved = True
    while improved and tries < max_tries:
        improved = False
        for candidate in _simpler(case):
            if tries >= max_tries:
                break
            tries += 1
            got = run_case(pool, candidate, timeout)
            if got.kind == outcome.kind:
                case, outcome, improved = candidate, got, True
                break
    return case, outcome


REPRODUCER = '''"""burstc fuzz reproducer ({kind}): {description}

{detail}

Run: python {filename}   (spawns {world_size} gloo ranks; exits 1 while the failure reproduces)
"""
import sys

from burstc.testing.fuzz import Case, reproduce
from burstc.testing.fuzz_models import HFSpec, InputSpec, ModelSpec  # noqa: F401 (the case's repr uses them)

CASE = {case!r}

if __name__ == "__main__":
    sys.exit(reproduce(CASE))
'''


def write_reproducer(folder: str, name: str, case: Case, outcome: Outcome) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.py")
    detail = "\n".join(line[:200] for line in outcome.detail.splitlines()[:30]).replace('"""', "'''")
    with open(path, "w") as f:
        f.write(REPRODUCER.format(kind=outcome.kind, description=case.describe(), detail=detail,
                                  filename=os.path.basename(path), world_size=case.world_size, case=case))
    return path


def reproduce(case: Case, timeout: float = 300.0) -> int:
    """Run one case (a reproducer's entry point): print the outcome; 1 if it failed."""
    from burstc.testing.workers import WorkerPool

    with WorkerPool(run_timeout_s=timeout) as pool:
        outcome = run_case(pool, case, timeout)
    print(case.describe())
    print(f"outcome: {outcome.kind} {outcome.codes}\n{outcome.detail}")
    return 1 if outcome.failed else 0


# ---- the long run --------------------------------------------------------------------------------------------


def package_sources() -> dict[str, str]:
    """Where ``burstc``, ``burstc.kernels`` and ``burstc.passes`` were imported from: the checkout holding their
    ``pyproject.toml``, or (an installed wheel) the ``burstc`` folder.  An editable install maps the last two to
    its own clone, which ``PYTHONPATH`` does not override: a run from another clone can mix two versions."""
    import importlib

    sources = {}
    for name in ("burstc", "burstc.kernels", "burstc.passes"):
        path = Path(importlib.import_module(name).__file__).resolve().parent
        checkout = next((p for p in (path, *path.parents) if (p / "pyproject.toml").exists()), None)
        sources[name] = str(checkout or (path if name == "burstc" else path.parent))
    return sources


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="burstc model fuzzer: random models, inputs and options vs eager")
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--start", type=int, default=0,
                        help="resume a seed's sequence: draw cases 0..start-1 without running them (a long run "
                             "split in parts gives the same cases as one run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4], help="world sizes to draw from")
    parser.add_argument("--hf-fraction", type=float, default=0.3, help="share of cases drawn from HF architectures")
    parser.add_argument("--inductor", action="store_true", help="draw backend='inductor' in 5%% of cases")
    parser.add_argument("--flex-fraction", type=float, default=0.1, help="share of FlexAttention models")
    parser.add_argument("--checkpoint-fraction", type=float, default=0.1,
                        help="share of cases with burstc's checkpointing (layers, selective, selective keeping part)")
    parser.add_argument("--local-grads-fraction", type=float, default=0.1,
                        help="share of cases on a mesh with reduce_grads=False (the gradients summed over the ranks "
                             "by the oracle; the ring backwards' last hops overlapped with weight gradients)")
    parser.add_argument("--two-level-fraction", type=float, default=0.0,
                        help="share of cases whose world size factors (4: 2 x 2) run on a two-level mesh named "
                             "('inter', 'intra') with a drawn ring kind (flat, double, ulysses, auto)")
    parser.add_argument("--out", default="fuzz-out", help="folder for reproducers and the JSON summary")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--reduce-tries", type=int, default=10, help="reruns spent reducing each failure")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUT_OPTIONS,
                        help="layouts the options draw from (default: the static ones, as the CI sample; add "
                             "'auto' and 'documents' for the per-call documents layout)")
    args = parser.parse_args(argv)
    _draw_layouts(args.layouts)
    sources = package_sources()
    if len(set(sources.values())) > 1:
        parser.error(f"burstc's packages come from different checkouts: {sources}; install the one to fuzz "
                     f"(pip install -e <checkout>)")
    print(f"burstc from {sources['burstc']}", flush=True)
    if any(p < 1 for p in args.ranks) or args.cases < 1 or not 0 <= args.start < args.cases:
        parser.error("--ranks must be >= 1, --cases >= 1 and 0 <= --start < --cases")
    from burstc.testing.workers import WorkerPool

    rng = random.Random(args.seed)
    counts: collections.Counter = collections.Counter()
    refused: collections.Counter = collections.Counter()
    all_codes: collections.Counter = collections.Counter()
    failures, log, signatures = [], [], set()
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    # One line per case as it finishes: an interrupted run keeps what it ran (resume it with --start).
    case_log = open(os.path.join(args.out, f"cases-{args.seed}.jsonl"), "a")
    with WorkerPool(run_timeout_s=args.timeout) as pool, case_log:
        for n in range(args.cases):
            case = generate_case(RandomDraw(rng), tuple(args.ranks), args.hf_fraction, args.inductor,
                                 args.flex_fraction, args.checkpoint_fraction, args.local_grads_fraction,
                                 args.two_level_fraction)
            if n < args.start:
                continue
            case_start = time.time()
            outcome = run_case(pool, case, args.timeout)
            counts["tried"] += 1
            counts[outcome.kind] += 1
            if outcome.kind == "mismatch":
                counts[outcome.detail.split(" ", 1)[0] + "_mismatch"] += 1
            if outcome.kind == "one_device" and outcome.results[0]["runs"][0].get("bitwise_vs_eager", False):
                counts["one_device_bitwise_eager"] += 1
            if outcome.results and any(r["ref_nonfinite"] for r in outcome.results):
                counts["nonfinite_reference"] += 1  # NaN/inf in eager: compared all the same (patterns must match)
            all_codes.update(set(outcome.codes))
            if outcome.kind == "refused":
                refused[refusal_code(outcome)] += 1
            line = f"[{n}] {outcome.kind:10s} {time.time() - case_start:5.1f}s {case.describe()}"
            if outcome.kind == "refused":
                line += f" -> {refusal_code(outcome)}"
            print(line, flush=True)
            entry = {"n": n, "kind": outcome.kind, "case": repr(case), "codes": outcome.codes}
            if outcome.kind == "torch_crash":
                entry["detail"] = outcome.detail[:2000]
            if outcome.failed:
                print("    " + " / ".join(outcome.detail.splitlines()[:2])[:400], flush=True)
                signature = failure_signature(outcome)
                seen = signature in signatures  # reduce each distinct failure once
                signatures.add(signature)
                reduced, reduced_outcome = (case, outcome) if seen else reduce_case(
                    pool, case, outcome, args.reduce_tries, args.timeout)
                path = write_reproducer(args.out, f"case-{args.seed}-{n}", reduced, reduced_outcome)
                print(f"    reproducer: {path} ({reduced.describe()})", flush=True)
                failures.append({"n": n, "kind": outcome.kind, "reproducer": path, "detail": outcome.detail[:2000]})
                entry["reproducer"] = path
            log.append(entry)
            case_log.write(json.dumps({**entry, "seconds": round(time.time() - case_start, 1)}) + "\n")
            case_log.flush()
    elapsed = time.time() - start
    print(f"\ntried {counts['tried']}: rewritten {counts['rewritten']}, refused {counts['refused']}, "
          f"one device {counts['one_device']}, rejected (length error) {counts['rejected']}, torch.compile's own "
          f"failures {counts['torch_crash']}, mismatches {counts['mismatch']}, crashes {counts['crash']}, "
          f"hangs {counts['hang']}; mismatches marginal (< 10x tolerance) {counts['marginal_mismatch']}, gross "
          f"{counts['gross_mismatch']}; one-device cases bitwise equal to eager {counts['one_device_bitwise_eager']}; {counts['nonfinite_reference']} with NaN/inf in eager ({elapsed:.0f} s)")
    print("refused by code: " + ", ".join(f"{c} {k}" for c, k in refused.most_common()))
    print("every skip code seen (cases): " + ", ".join(f"{c} {k}" for c, k in all_codes.most_common()))
    for failure in failures:
        print(f"{failure['kind']}: {failure['reproducer']}")
    with open(os.path.join(args.out, f"summary-{args.seed}-from-{args.start}.json"), "w") as f:
        json.dump({"counts": counts, "refused": refused, "codes": all_codes, "failures": failures, "cases": log,
                   "seconds": elapsed}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
