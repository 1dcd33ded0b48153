"""Hostile inputs and faults (issue 19, parts 3 and 4): a new user's mistakes and odd inputs either run
correctly (against single-device eager, the oracle's tolerances) or fail with a burstc error that says
what to do -- never a silently wrong loss, never a hang; and the same seed gives bitwise-identical results.

The multi-rank cases share the module's 2- and 3-rank worker groups (started once each)."""
import datetime
import io
import logging
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import burstc
from burstc.errors import MeshError, PeerTimeout, check_mesh_alive
from burstc.guards import DROPPED_LOGITS, LogitsDroppedError
from burstc.testing import assert_equivalent, zoo
from burstc.testing.oracle import SHARDED_GRAD_FLOOR, errors_above, parameter_grads, tolerance, \
    training_step_errors

VOCAB = 97
MODEL = zoo.titan_mha  # one layer: the cheapest model with attention and a loss to shard


# ---------------------------------------------------------------------------------------------
# Module-level builders and tasks (pickled to the gloo workers)


def _mesh(world_size):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def _tokens(batch, seq_len, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=g), torch.randint(0, VOCAB, (batch, seq_len), generator=g)


def _inputs_s1():
    return _tokens(2, 1)


def _inputs_s2():
    return _tokens(1, 2)


def _inputs_all_ignored():
    tokens, labels = _tokens(2, 32)
    return tokens, torch.full_like(labels, -100)


def _inputs_some_ignored_rows():
    tokens, labels = _tokens(2, 32)
    labels[0] = -100  # a whole sequence of the batch ignored, the other not
    return tokens, labels


def _titan_nan_weight():
    model = MODEL()
    tokens, _ = _tokens(2, 32)
    with torch.no_grad():
        model.model.tok_embeddings.weight[tokens[1, 20]] = float("nan")  # one token's embedding row
    return model


class ScaledInputLM(torch.nn.Module):
    """Token embeddings scaled by a float per-token input: a NaN there is a NaN in the model's inputs."""

    def __init__(self):
        super().__init__()
        self.lm = MODEL()

    def forward(self, tokens, scale, labels):
        inner = self.lm.model
        h = inner.tok_embeddings(tokens) * scale.unsqueeze(-1)
        for layer in inner.layers.values():
            h = layer(h, inner.freqs_cis)
        logits = inner.output(inner.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _scaled_input_lm():
    torch.manual_seed(0)
    return ScaledInputLM()


def _inputs_nan_scale():
    tokens, labels = _tokens(2, 32)
    scale = torch.ones(2, 32)
    scale[0, 7] = float("nan")
    return tokens, scale, labels


class ScaledOutputLM(ScaledInputLM):
    """The last hidden states scaled by a float per-token input: a NaN there is a NaN at that position only (a NaN
    token embedding would reach every position through attention's 0 x NaN)."""

    def forward(self, tokens, scale, labels):
        inner = self.lm.model
        h = inner.tok_embeddings(tokens)
        for layer in inner.layers.values():
            h = layer(h, inner.freqs_cis)
        logits = inner.output(inner.norm(h * scale.unsqueeze(-1)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _scaled_output_lm():
    torch.manual_seed(0)
    return ScaledOutputLM()


def _scaled_output_lm_frozen_body():
    """Only the final norm and the LM head train: the ignored rows' NaN stops there (not through attention)."""
    model = _scaled_output_lm()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(("lm.model.norm", "lm.model.output")))
    return model


def _inputs_nan_at_ignored_positions(seq_len=32):
    """NaN hidden states only where the labels are ignored (as a -inf mask over a left-padded row gives): eager's
    loss is finite, its LM-head gradient NaN (0 x NaN), and the ignored rows' NaN gradients reach every weight."""
    tokens, labels = _tokens(2, seq_len)
    scale = torch.ones(2, seq_len)
    scale[0, 20] = float("nan")
    labels[0, 20:] = -100
    return tokens, scale, labels


def _inputs_nan_at_ignored_positions_padded():
    return _inputs_nan_at_ignored_positions(31)


def _call_scaled(model, inputs):
    return model(*inputs)


def _step(model, call, inputs, run=None):
    """A step of ``run`` (default ``model``): its loss and the gradients of ``model``'s parameters."""
    model.zero_grad(set_to_none=True)
    loss = call(model if run is None else run, inputs)
    loss.backward()
    return loss.detach(), parameter_grads(model)


def _compare(cmodel, model, inputs, dtype=torch.float32, call=zoo.call_with_loss):
    """One training step of ``cmodel`` vs eager ``model`` on the full batch: the errors above the table's."""
    ref_loss, ref_grads = _step(model, call, inputs)
    loss, grads = _step(model, call, inputs, run=cmodel)
    errors = training_step_errors(loss, ref_loss, grads, ref_grads, SHARDED_GRAD_FLOOR)
    return errors_above(errors, tolerance(dtype, "sharded_loss").rtol, tolerance(dtype, "sharded_param_grad").rtol)


def _codes(cmodel):
    return [s.code for s in burstc.report(cmodel).skipped]


def _kinds(cmodel):
    return [r.kind for r in burstc.report(cmodel).rewrites]


def dynamic_task(rank, world_size, dynamic):
    """Two lengths with dynamic=True / None: correct every time; a symbolic length is refused with a code."""
    torch._dynamo.reset()
    model = MODEL()
    cmodel = burstc.compile(model, _mesh(world_size), backend="aot_eager", dynamic=dynamic)
    lengths = (32,) if dynamic else (32, 40)  # dynamic=None makes the length symbolic on the second one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = [_compare(cmodel, model, _tokens(2, seq_len, seed=seq_len)) for seq_len in lengths]
    report = burstc.report(cmodel)
    return {"bad": bad, "codes": _codes(cmodel), "graphs": len(report.graph_records),
            "sharded_graphs": [r.sharding is not None for r in report.graph_records],
            "replicated_warnings": [str(w.message) for w in caught if "runs replicated on 2 ranks" in str(w.message)]}


def mesh_outside_task(rank, world_size):
    """A 2-rank mesh in a world of 3: the rank outside gets a MeshError; the two inside train correctly."""
    from torch.distributed.device_mesh import DeviceMesh

    torch._dynamo.reset()
    mesh = DeviceMesh("cpu", [0, 1])  # built on every rank (it creates the group collectively)
    model = MODEL()
    try:
        cmodel = burstc.compile(model, mesh, backend="aot_eager")
    except MeshError as error:
        return {"error": str(error)}
    return {"bad": _compare(cmodel, model, zoo.titan_inputs()), "kinds": _kinds(cmodel)}


def _subgroup_mesh(world_size, timeout_s):
    """A fresh gloo group over every rank, as a mesh: a test can stall or destroy it without harming the
    worker group's default one."""
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=timeout_s))
    return group, DeviceMesh.from_group(group, "cpu")


def destroyed_group_task(rank, world_size):
    torch._dynamo.reset()
    group, mesh = _subgroup_mesh(world_size, 30)
    model = MODEL()
    cmodel = burstc.compile(model, mesh, backend="aot_eager")
    tokens, labels = zoo.titan_inputs()
    cmodel(tokens, labels).backward()
    dist.destroy_process_group(group)
    try:
        cmodel(tokens, labels)
    except MeshError as error:
        return {"error": str(error)}
    return {"error": None}


def stalled_peer_task(rank, world_size, check_inputs, timeout_s):
    """Rank 1 is alive but never calls the model; rank 0 must fail within the timeout, naming rank 1."""
    torch._dynamo.reset()
    # the group's own timeout: longer than burstc's (which must fire first), short enough that the abandoned
    # transfers expire before the worker group shuts down
    group, mesh = _subgroup_mesh(world_size, timeout_s + 2)
    model = MODEL()
    cmodel = burstc.compile(model, mesh, backend="aot_eager", check_inputs=check_inputs, timeout=timeout_s)
    tokens, labels = zoo.titan_inputs()
    cmodel(tokens, labels).backward()  # one good step on both ranks
    dist.barrier()
    if rank == 1:
        time.sleep(timeout_s + 3)  # stalls: alive, not calling
        return {"stalled": True}
    start = time.monotonic()
    try:
        cmodel(tokens, labels).backward()
    except PeerTimeout as error:
        return {"error": str(error), "waited_s": time.monotonic() - start}
    return {"error": None, "waited_s": time.monotonic() - start}


class _LossOnly(torch.nn.Module):
    """An embedding and an LM head, no attention: the only collective of the forward is the loss all-reduce
    (a functional collective, waited by torch with its group's timeout)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(97, 16), torch.nn.Linear(16, 97)

    def forward(self, tokens, labels):
        return F.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), labels.flatten())


def stalled_reduction_task(rank, world_size, keep_logits, timeout_s):
    """Rank 1 stalls; rank 0 waits in the loss's collectives (the fused loss's all-reduce; with ``keep_logits`` the
    unfused cross-entropy's): bounded by ``timeout=`` too, not by the group's own 60 s."""
    torch._dynamo.reset()
    group, mesh = _subgroup_mesh(world_size, 60)
    torch.manual_seed(0)
    cmodel = burstc.compile(_LossOnly(), mesh, backend="aot_eager", check_inputs=False, timeout=timeout_s,
                            keep_logits=keep_logits)
    tokens = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(1))
    cmodel(tokens, tokens).backward()  # one good step on both ranks
    kinds = [r.kind for r in burstc.report(cmodel).rewrites]
    dist.barrier()
    if rank == 1:
        time.sleep(timeout_s + 4)
        return {"stalled": True}
    start = time.monotonic()
    try:
        cmodel(tokens, tokens).backward()
    except Exception as error:  # noqa: BLE001 - gloo's timeout error, or burstc's PeerTimeout
        return {"error": f"{type(error).__name__}: {error}", "waited_s": time.monotonic() - start, "kinds": kinds}
    return {"error": None, "waited_s": time.monotonic() - start, "kinds": kinds}


@pytest.mark.parametrize("keep_logits", [False, True], ids=["fused_loss", "unfused_loss"])
def test_stalled_peer_bounds_the_loss_reductions_too(workers, keep_logits):
    timeout_s = 3.0
    results = workers.get(2).run(stalled_reduction_task, keep_logits, timeout_s, timeout=90)
    assert results[1] == {"stalled": True}
    assert "shard" in results[0]["kinds"], results[0]
    assert results[0]["error"] is not None, f"no error after {results[0]['waited_s']:.1f} s"
    assert results[0]["waited_s"] < timeout_s + 3.0, results[0]


def logs_task(rank, world_size, out_dir):
    """BURSTC_LOGS on every rank: each line once, with the rank; BURSTC_LOGS_DIR files per rank."""
    import os

    from burstc import _logging

    torch._dynamo.reset()
    stream = io.StringIO()
    saved = {k: os.environ.get(k) for k in ("BURSTC_LOGS", "BURSTC_LOGS_DIR")}
    os.environ.update(BURSTC_LOGS="rewrites", BURSTC_LOGS_DIR=out_dir)
    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)  # a user's root handler must not print burstc's lines again
    logging.getLogger().addHandler(root_handler)
    try:
        _logging._ensure_handler()
        handler = next(h for h in _logging.log.handlers if isinstance(h.formatter, _logging._RankFormatter))
        previous = handler.setStream(stream)
        model = MODEL()
        cmodel = burstc.compile(model, _mesh(world_size), backend="aot_eager")
        cmodel(*zoo.titan_inputs()).backward()
        handler.setStream(previous)
    finally:
        logging.getLogger().removeHandler(root_handler)
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    rewrites = len(burstc.report(cmodel).rewrites)
    return {"lines": stream.getvalue().splitlines(), "root": root_stream.getvalue(), "rewrites": rewrites}


def recompile_twice_task(rank, world_size):
    """A second burstc.compile of the same model (e.g. a notebook cell run twice): both compiled models agree
    with eager, and the first still works after the second was built."""
    torch._dynamo.reset()
    model = MODEL()
    first = burstc.compile(model, _mesh(world_size), backend="aot_eager")
    bad_first = _compare(first, model, zoo.titan_inputs())
    second = burstc.compile(model, _mesh(world_size), backend="aot_eager", layout="contiguous")
    bad_second = _compare(second, model, zoo.titan_inputs())
    bad_again = _compare(first, model, zoo.titan_inputs())
    return {"bad": [bad_first, bad_second, bad_again], "kinds": [_kinds(first), _kinds(second)]}


def dtype_move_task(rank, world_size):
    """Compiled in fp32, then the model moved to bf16: the next call recompiles for bf16 (Dynamo guards on
    the parameters' dtype) and matches bf16 eager within the bf16 sharded tolerances."""
    torch._dynamo.reset()
    model = MODEL()
    cmodel = burstc.compile(model, _mesh(world_size), backend="aot_eager")
    bad_fp32 = _compare(cmodel, model, zoo.titan_inputs())
    model.to(torch.bfloat16)
    bad_bf16 = _compare(cmodel, model, zoo.titan_inputs(), dtype=torch.bfloat16)
    report = burstc.report(cmodel)
    return {"bad": [bad_fp32, bad_bf16], "sharded": [r.sharding is not None for r in report.graph_records],
            "dtype": str(next(model.parameters()).dtype)}


def eval_modes_task(rank, world_size):
    """train -> eval / no_grad / inference_mode -> train on one compiled model: every loss is eager's."""
    torch._dynamo.reset()
    model = MODEL()
    cmodel = burstc.compile(model, _mesh(world_size), backend="aot_eager")
    inputs = zoo.titan_inputs()
    results = {"train": _compare(cmodel, model, inputs)}
    model.eval()
    with torch.no_grad():
        ref = model(*inputs)
        results["eval_no_grad"] = float((cmodel(*inputs) - ref).abs())
    with torch.inference_mode():
        ref = model(*inputs)
        results["eval_inference_mode"] = float((cmodel(*inputs) - ref).abs())
    model.train()
    results["train_again"] = _compare(cmodel, model, inputs)
    return results


def determinism_task(rank, world_size, layout):
    """A fresh compile and two training steps: the losses and gradients, to compare bit for bit."""
    torch._dynamo.reset()
    model = MODEL()
    cmodel = burstc.compile(model, _mesh(world_size), backend="aot_eager", layout=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        loss = cmodel(*_tokens(2, 32, seed=step))
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
    return {"losses": losses, "grads": parameter_grads(model)}


# ---------------------------------------------------------------------------------------------
# The table of issue 19: every row


@pytest.mark.parametrize("dynamic", [pytest.param(True, marks=pytest.mark.slow), None])  # True: ~20 s tracing
def test_dynamic_shapes_are_refused_with_a_code_and_stay_correct(workers, dynamic):
    results = workers.get(2).run(dynamic_task, dynamic)
    for result in results:
        assert result["bad"] == [{}] * (1 if dynamic else 2)
        assert "shard.dynamic_length" in result["codes"]
        # said when it happens, not only in the report: the attention runs over the whole sequence on every rank
        (warned,) = result["replicated_warnings"]
        assert "attention call(s) over the whole sequence" in warned and "symbolic" in warned, warned
    if dynamic is None:  # the first length is static (sharded), the second makes it symbolic (replicated)
        assert results[0]["sharded_graphs"] == [True, False]
    else:
        assert results[0]["sharded_graphs"] == [False]


def test_rank_outside_the_mesh_is_a_mesh_error(workers):
    results = workers.get(3).run(mesh_outside_task)
    assert results[0]["bad"] == {} and results[1]["bad"] == {}
    assert "shard" in results[0]["kinds"]
    message = results[2]["error"]
    assert "rank (2 of a world of 3) is not in the 2-rank DeviceMesh over ranks [0, 1]" in message
    assert "build the mesh over all 3 ranks" in message


def test_destroyed_process_group_is_a_mesh_error(workers):
    for result in workers.get(2).run(destroyed_group_task):
        assert result["error"] and "no longer exists" in result["error"]
        assert "DeviceMesh over ranks [0, 1]" in result["error"] and "call burstc.compile again" in result["error"]


def test_destroyed_default_group_is_a_mesh_error(tmp_path):
    from torch.distributed.device_mesh import DeviceMesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    mesh = DeviceMesh("cpu", [0])
    check_mesh_alive(mesh)  # alive: no error
    dist.destroy_process_group()
    with pytest.raises(MeshError, match=r"DeviceMesh over ranks \[0\] is not initialized.*burstc.compile again"):
        check_mesh_alive(mesh)


@pytest.mark.parametrize("check_inputs", [True, False])
def test_stalled_peer_fails_the_others_within_the_timeout(workers, check_inputs):
    timeout_s = 3.0
    results = workers.get(2).run(stalled_peer_task, check_inputs, timeout_s, timeout=60)
    assert results[1] == {"stalled": True}
    error, waited = results[0]["error"], results[0]["waited_s"]
    assert error is not None, f"no error after {waited:.1f} s"
    assert waited < timeout_s + 2.0, waited
    assert "rank 1" in error and "timeout=3 s" in error
    # with check_inputs the input check is the first wait; without it, the ring attention's first receive
    assert ("check_inputs" in error) == check_inputs
    assert ("ring attention" in error and "receive from rank 1" in error) == (not check_inputs)


def test_recompile_limit_is_a_warning_and_a_report_line():
    model = MODEL()
    cmodel = burstc.compile(model, backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq_len in (8, 10, 12, 14):
            inputs = _tokens(1, seq_len)
            torch.testing.assert_close(cmodel(*inputs), model(*inputs), rtol=1e-5, atol=0)
    ours = [w for w in caught if "recompile_limit" in str(w.message) and "burstc" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]  # once, though two calls fell off the limit
    assert "run eagerly, unsharded" in str(ours[0].message)
    (skip,) = [s for s in burstc.report(cmodel).skipped if s.code == "pipeline.recompile_limit"]
    assert "'forward'" in skip.node and "recompile_limit (2)" in skip.reason
    assert "recompile_limit" in str(burstc.report(cmodel))


def test_reading_dropped_logits_explains_keep_logits():
    pytest.importorskip("transformers")
    model = zoo.hf_llama()
    ids = zoo.hf_inputs()
    out = burstc.compile(model, backend="aot_eager")(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits is DROPPED_LOGITS
    for use in (lambda x: x.shape, lambda x: x[:, -1], lambda x: F.softmax(x, -1), lambda x: x.float() * 2,
                lambda x: len(x)):
        with pytest.raises(LogitsDroppedError, match="keep_logits=True"):
            use(out.logits)
    assert "keep_logits=True" in repr(out.logits) and not hasattr(out.logits, "shape")
    torch._dynamo.reset()
    kept = burstc.compile(model, backend="aot_eager", keep_logits=True)(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(kept.logits, model(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["--ranks", "-3"], "argument --ranks: must be at least 1, got -3"),
    (["--ranks", "two"], "argument --ranks: expected a positive integer, got 'two'"),
    (["--seq-len", "0"], "argument --seq-len: must be at least 1, got 0"),
    (["--heads", "3"], "--dim 64 must be a multiple of --heads 3"),
    (["--kv-heads", "3"], "--heads 4 must be a multiple of --kv-heads 3"),
    (["--dim", "12", "--heads", "4", "--kv-heads", "1"], "--dim / --heads = 3 must be even"),
])
def test_demo_cli_rejects_bad_arguments(capsys, argv, message):
    from burstc.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_logs_carry_the_rank_once_per_line_and_dump_files_per_rank(workers, tmp_path):
    results = workers.get(2).run(logs_task, str(tmp_path))
    for rank, result in enumerate(results):
        rewrites = [line for line in result["lines"] if "rewrote" in line]
        assert len(rewrites) == result["rewrites"] > 0  # each rewrite logged once
        assert all(line.startswith(f"[burstc rank {rank}] ") for line in rewrites), rewrites
        assert "rewrote" not in result["root"]
    files = {rank: sorted(p.name for p in (tmp_path / f"rank{rank}").iterdir()) for rank in (0, 1)}
    assert files[0] == files[1] and "graph0_captured.py" in files[0] and "graph0_rewritten.py" in files[0]
    assert not list(tmp_path.glob("*.py"))  # nothing written outside the rank folders


def test_a_failed_or_expired_wait_names_the_peer():
    from burstc.errors import PeerFailure, wait_for_peer

    class Work:
        def __init__(self, outcome):
            self.outcome, self.timeouts = outcome, []

        def wait(self, *timeout):
            self.timeouts.append(timeout)
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome

    ok = Work(True)
    wait_for_peer(ok, 2.5, "rank 0 waited to receive from rank 1", "hint")
    assert ok.timeouts == [(datetime.timedelta(seconds=2.5),)]
    wait_for_peer(ok, None, "unused", "hint")  # None: the process group's own timeout, no argument
    assert ok.timeouts[-1] == ()
    with pytest.raises(PeerTimeout, match=r"receive from rank 1 and failed \(burstc timeout=2.5 s\)\. Is it alive"):
        wait_for_peer(Work(False), 2.5, "rank 0 waited to receive from rank 1", "Is it alive?")
    with pytest.raises(PeerTimeout, match="Timed out waiting 2500ms"):
        wait_for_peer(Work(RuntimeError("Timed out waiting 2500ms for recv")), 2.5, "waited", "hint")
    with pytest.raises(PeerFailure, match="process group's timeout.*Connection reset") as failure:
        wait_for_peer(Work(RuntimeError("Connection reset by peer")), None, "waited", "hint")
    assert not isinstance(failure.value, PeerTimeout)


def test_timeout_option_is_validated():
    assert burstc.BurstConfig(timeout=datetime.timedelta(seconds=90)).timeout == 90.0
    for bad in (0, -1, True, "3s", float("inf")):
        with pytest.raises(ValueError, match="timeout"):
            burstc.compile(torch.nn.Linear(2, 2), timeout=bad)


# ---------------------------------------------------------------------------------------------
# Odd inputs: correct against eager on one device, or a clear error


@pytest.mark.parametrize("world_size,inputs_fn", [(2, _inputs_s1), pytest.param(3, _inputs_s1, marks=pytest.mark.slow),
                                                  (3, _inputs_s2)], ids=["S=1,P=2", "S=1,P=3", "S=2,P=3"])
def test_sequences_shorter_than_the_mesh(workers, world_size, inputs_fn):
    results = assert_equivalent(MODEL, inputs_fn, zoo.call_with_loss, world_size=world_size,
                                group=workers.get(world_size), backend="aot_eager")
    assert results[0]["loss"] == results[0]["loss"]  # a number, not NaN


def test_all_labels_ignored_is_nan_as_in_eager(workers):
    # mean cross-entropy over zero tokens is 0/0: NaN in eager, and the same NaN pattern here
    results = assert_equivalent(MODEL, _inputs_all_ignored, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    assert results[0]["ref_loss"] != results[0]["ref_loss"] and results[0]["loss"] != results[0]["loss"]


def test_one_sequence_all_ignored(workers):
    assert_equivalent(MODEL, _inputs_some_ignored_rows, zoo.call_with_loss, world_size=2,
                      group=workers.get(2), backend="aot_eager")


def test_nan_in_a_weight_propagates_as_in_eager(workers):
    results = assert_equivalent(_titan_nan_weight, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    assert results[0]["ref_loss"] != results[0]["ref_loss"]  # the reference is NaN: the check compared patterns


def test_nan_in_an_input_propagates_as_in_eager(workers):
    results = assert_equivalent(_scaled_input_lm, _inputs_nan_scale, _call_scaled, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    assert results[0]["ref_loss"] != results[0]["ref_loss"]


@pytest.mark.parametrize("model_fn,inputs_fn", [
    (_scaled_output_lm_frozen_body, _inputs_nan_at_ignored_positions),
    (_scaled_output_lm_frozen_body, _inputs_nan_at_ignored_positions_padded),
    pytest.param(_scaled_output_lm, _inputs_nan_at_ignored_positions, marks=pytest.mark.xfail(strict=True, reason=(
        "kernel-defined, not a gap: eager's attention backward multiplies masked-out zeros by the NaN rows' dO "
        "(dV = P^T dO) within its kernel's blocks, so its token-embedding gradient is NaN at every token of that "
        "sequence; the ring's blocks differ and skip fully masked ones, leaving some keys finite. How far "
        "0 x NaN reaches is the kernel's blocking: eager's own math and flash backends disagree too "
        "(test_a_nan_gradient_row_spreads_as_far_as_a_kernel_may checks the property all of them share)")))],
    ids=["S=32", "S=31-padded", "through-attention"])
def test_nan_only_at_ignored_positions_propagates_as_in_eager(workers, model_fn, inputs_fn):
    """The LM head's sharded partial gradients are all-reduced: NaN where eager's (from the rank holding the
    NaN rows), and a row the shard pass pads adds nothing."""
    results = assert_equivalent(model_fn, inputs_fn, _call_scaled, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    assert results[0]["ref_loss"] == results[0]["ref_loss"] and results[0]["loss"] == results[0]["loss"]
    # what was compared: eager's NaN gradients (the LM head's whole), beside its finite loss
    _, grads = _step(model_fn(), _call_scaled, inputs_fn())
    assert grads["lm.model.output.weight"].isnan().all()


def nan_row_task(rank, world_size, seq_len, nan_row):
    """One causal ring attention whose grad_out is NaN at query ``nan_row``: this rank's positions and its (dk, dv),
    and the same with that row's grad_out zeroed (the finite reference)."""
    from burstc import layout as layouts
    from burstc.attention_ir import MaskSpec
    from burstc.ops import ring_attention as ra

    generator = torch.Generator().manual_seed(7)
    q, k, v, grad_out = (torch.randn(1, 2, seq_len, 16, generator=generator) for _ in range(4))
    found = {}
    for name, fill in (("nan", float("nan")), ("zeroed", 0.0)):
        grad = grad_out.clone()
        grad[:, :, nan_row] = fill
        shard = lambda t: layouts.shard(t, 2, world_size, rank, "zigzag")  # noqa: E731
        leaves = [shard(t).requires_grad_() for t in (q, k, v)]
        ra.ring_attention(*leaves, mask=MaskSpec.causal(), layout="zigzag").backward(shard(grad))
        found[name] = [t.grad.detach() for t in leaves[1:]]
    return layouts.local_positions(seq_len, world_size, rank, "zigzag"), found


class DividedOutputLM(ScaledInputLM):
    """The last hidden states divided by a per-token input: the row the layout pads in (its input 0) is non-finite,
    a row eager never has."""

    def forward(self, tokens, scale, labels):
        inner = self.lm.model
        h = inner.tok_embeddings(tokens)
        for layer in inner.layers.values():
            h = layer(h, inner.freqs_cis)
        logits = inner.output(inner.norm(h / scale.unsqueeze(-1)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _divided_output_lm_frozen_body():
    torch.manual_seed(0)
    model = DividedOutputLM()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(("lm.model.norm", "lm.model.output")))
    return model


def _inputs_ones_scale_31():
    tokens, labels = _tokens(2, 31)
    return tokens, torch.ones(2, 31), labels


@pytest.mark.xfail(strict=True, reason=(
    "known limit: a row the layout pads in whose position-wise values are not finite (here h / 0: its per-token "
    "input is the pad's 0) reaches parameter gradients as 0 x NaN in every position-wise op's weight gradient (the "
    "final norm's here), though the loss skips it; eager has no such row. Pad the batch to the layout's multiple "
    "(the report's padded_to) to have no layout pads"))
def test_a_non_finite_row_the_layout_pads_in(workers):
    """31 tokens on 2 zigzag ranks: the pad row's hidden states are inf/NaN, eager (no such row) is finite."""
    assert_equivalent(_divided_output_lm_frozen_body, _inputs_ones_scale_31, _call_scaled, world_size=2,
                      group=workers.get(2), backend="aot_eager")


def test_a_nan_gradient_row_spreads_as_far_as_a_kernel_may(workers):
    """How far ``0 x NaN`` spreads is the kernel's: eager's own CPU backends disagree (math: every key; flash: the
    keys of the blocks it runs).  Every one of them, and the ring, gives NaN at each key the NaN row sees (the true
    gradient is NaN there) and, at every other key, NaN or exactly the value without that row."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq_len, nan_row = 1024, 5
    generator = torch.Generator().manual_seed(7)
    q, k, v, grad_out = (torch.randn(1, 2, seq_len, 16, generator=generator) for _ in range(4))

    def eager(backend, fill):
        grad = grad_out.clone()
        grad[:, :, nan_row] = fill
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad)
        return [t.grad for t in leaves[1:]]

    def spread_is_allowed(nan_grads, reference_grads):
        spread = 0
        for got, want in zip(nan_grads, reference_grads):
            nan_keys = got.isnan().any(-1).any(1)[0]                     # [S]: keys whose gradient has a NaN
            assert nan_keys[:nan_row + 1].all()                           # the keys the NaN row sees
            finite = ~got.isnan()
            assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)
            spread = max(spread, int(nan_keys.sum()))
        return spread

    spreads = {backend: spread_is_allowed(eager(backend, float("nan")), eager(backend, 0.0))
               for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION)}
    assert spreads[SDPBackend.MATH] == seq_len > spreads[SDPBackend.FLASH_ATTENTION] > nan_row + 1, spreads
    ring = {name: [torch.empty(1, 2, seq_len, 16) for _ in range(2)] for name in ("nan", "zeroed")}
    for positions, found in workers.get(2).run(nan_row_task, seq_len, nan_row):
        for name, grads in found.items():
            for full, local in zip(ring[name], grads):
                full[:, :, positions] = local
    assert nan_row + 1 <= spread_is_allowed(ring["nan"], ring["zeroed"]) <= seq_len


def test_second_compile_of_the_same_model(workers):
    for result in workers.get(2).run(recompile_twice_task):
        assert result["bad"] == [{}, {}, {}]
        assert all("shard" in kinds for kinds in result["kinds"])


def test_compile_after_moving_to_bfloat16(workers):
    assert_equivalent(MODEL, zoo.titan_inputs, zoo.call_with_loss, world_size=2, group=workers.get(2),
                      dtype=torch.bfloat16, backend="aot_eager")


def test_move_to_bfloat16_after_compile(workers):
    for result in workers.get(2).run(dtype_move_task):
        assert result["bad"] == [{}, {}] and result["dtype"] == "torch.bfloat16"
        assert result["sharded"] == [True, True]


def test_eval_no_grad_and_inference_mode(workers):
    for result in workers.get(2).run(eval_modes_task):
        assert result["train"] == {} and result["train_again"] == {}
        assert result["eval_no_grad"] <= 1e-5 and result["eval_inference_mode"] <= 1e-5


# ---------------------------------------------------------------------------------------------
# Determinism


@pytest.mark.parametrize("layout", ["zigzag", pytest.param("striped", marks=pytest.mark.slow)])
def test_same_seed_gives_bitwise_identical_losses_and_gradients(workers, layout):
    first = workers.get(2).run(determinism_task, layout)
    second = workers.get(2).run(determinism_task, layout)
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
        assert a["grads"].keys() == b["grads"].keys()
        different = [name for name in a["grads"] if not torch.equal(a["grads"][name], b["grads"][name])]
        assert not different, different
    # and every rank holds the same loss and gradients, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(first[0]["losses"], first[1]["losses"]))
    assert all(torch.equal(first[0]["grads"][n], first[1]["grads"][n]) for n in first[0]["grads"])
