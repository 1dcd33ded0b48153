"""What a ring call reads on the host: on a GPU each read of a device tensor (``tolist``, ``bool``, ``int``, ...)
waits for all queued work, so the ring must not read its device tensors where it decides.

- A static mask: after the first call (its block geometry is cached), a call reads nothing on the host, forward
  or backward, either plan (no zero-lse-gradient check, no stand-in-output check per block).
- Runtime masks (documents, key padding): every decision reads a host copy of the mask data
  (:mod:`burstc.ops.host_reads`), one read-back per mask tensor per step, with "device" tensors played on the
  CPU by declaring the CPU not the host; the results are bit-identical to reading the data in place.
- The masked kernel chooses its chunks from host positions when given them, never reading its device positions.
"""
from __future__ import annotations

import contextlib
import gc
import traceback

import pytest
import torch

from burstc import layout as layouts
from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.kernels.masked_attention_blocks import masked_block_backward, masked_block_forward
from burstc.ops import host_reads
from burstc.ops import ring_attention as ra

CAUSAL = MaskSpec.causal()
DOCS, PAD = Documents("doc_ids"), KeyPadding("attention_mask")
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")
WORKER_RUN_TIMEOUT_S = 300


@contextlib.contextmanager
def counting_host_reads():
    """Counts every host read of a tensor (the Python-level ways to get a number out of one), except the masked
    kernel's chunk choice, which reads the host positions it is given on a device
    (test_masked_kernel_chooses_chunks_from_host_positions)."""
    counts = {name: 0 for name in HOST_READS}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name):
        def read(self, *args):
            frames = traceback.extract_stack(limit=4)
            if not any(f.name == "_chunks" and f.filename.endswith("masked_attention_blocks.py") for f in frames):
                counts[name] += 1
            return originals[name](self, *args)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def cpu_plays_a_device():
    """Every tensor counts as off the host: the mask data are read back through :func:`host_reads.host_copy`."""
    saved = host_reads.host_device, host_reads._pinned
    host_reads.host_device = lambda device: False
    host_reads._pinned = lambda t: t  # (pinning needs an accelerator)
    host_reads._copies.clear()
    try:
        yield
    finally:
        host_reads.host_device, host_reads._pinned = saved
        host_reads._copies.clear()


def test_host_copy_reads_back_once_per_tensor_and_version():
    with cpu_plays_a_device():
        before = host_reads.read_backs
        ids_BS = torch.arange(12).view(2, 6)
        first = host_reads.host_copy(ids_BS)
        assert first is not ids_BS and torch.equal(first, ids_BS)
        assert host_reads.host_copy(ids_BS) is first and host_reads.read_backs == before + 1  # remembered
        ids_BS[0, 0] = 7  # written in place: a new version, a new copy
        second = host_reads.host_copy(ids_BS)
        assert second is not first and int(second[0, 0]) == 7 and host_reads.read_backs == before + 2
        other = ids_BS.clone()
        assert host_reads.host_copy(other) is not second and host_reads.read_backs == before + 3
        del other
        gc.collect()
        reused = torch.zeros(2, 6, dtype=torch.int64)  # may get the freed tensor's id: never its copy
        assert torch.equal(host_reads.host_copy(reused), reused)
        with torch.inference_mode():  # no version counter: copied each call
            frozen = torch.ones(3)
            copies = host_reads.host_copy(frozen), host_reads.host_copy(frozen)
        assert copies[0] is not copies[1]
    assert host_reads.host_copy(ids_BS) is ids_BS  # on the host: the tensor itself, nothing read back
    assert host_reads.host_copy(None) is None


class DeviceOnly(torch.Tensor):
    """A CPU tensor that plays a device tensor: a host read of it, or of anything computed from it, raises."""

    def _refuse(self, *args):
        raise AssertionError("a host read of a device tensor (a GPU synchronization)")

    tolist = item = __bool__ = __int__ = __float__ = __index__ = _refuse


@pytest.mark.parametrize("mask", [CAUSAL & DOCS & PAD, MaskSpec((SlidingWindow(5, 2), PAD))],
                         ids=["causal&docs&pad", "two_sided_window&pad"])
def test_masked_kernel_chooses_chunks_from_host_positions(monkeypatch, mask):
    monkeypatch.setattr("burstc.kernels.masked_attention_blocks._masked_row_chunk", lambda *a: 3)  # several chunks
    torch.manual_seed(0)
    batch, heads, rows, keys, dim = 2, 2, 11, 13, 4
    q, grad_out = torch.randn(batch, heads, rows, dim), torch.randn(batch, heads, rows, dim)
    k, v = torch.randn(batch, heads, keys, dim), torch.randn(batch, heads, keys, dim)
    q_pos, kv_pos = torch.arange(20, 20 + rows), torch.arange(10, 10 + keys)
    doc_ids_BS = (torch.arange(40) // 17).expand(batch, 40).contiguous()
    key_valid_BS = torch.ones(batch, 40, dtype=torch.bool)
    key_valid_BS[1, 18:] = False
    data = {"doc_ids_BS": doc_ids_BS, "key_valid_BS": key_valid_BS}
    out, lse = masked_block_forward(q, k, v, q_pos, kv_pos, mask, 0.5, **data)
    grads = masked_block_backward(grad_out, q, k, v, lse, None, out, q_pos, kv_pos, mask, 0.5, **data)
    with pytest.raises(AssertionError, match="host read"):  # the chunks read positions on the host
        masked_block_forward(q, k, v, q_pos.as_subclass(DeviceOnly), kv_pos.as_subclass(DeviceOnly), mask, 0.5,
                             **data)
    on_device = q_pos.as_subclass(DeviceOnly), kv_pos.as_subclass(DeviceOnly)
    out_d, lse_d = masked_block_forward(q, k, v, *on_device, mask, 0.5, **data, chunk_positions=(q_pos, kv_pos))
    grads_d = masked_block_backward(grad_out, q, k, v, lse, None, out, *on_device, mask, 0.5, **data,
                                    chunk_positions=(q_pos, kv_pos))
    for got, want in zip((out_d, lse_d, *grads_d), (out, lse, *grads)):
        assert torch.equal(got.as_subclass(torch.Tensor), want)


def _static_calls_read_nothing(rank, world_size):
    torch.manual_seed(rank)
    found = {}
    for name, mask in (("causal", CAUSAL), ("window", CAUSAL & SlidingWindow(6))):
        for plan in ra.PLANS:
            q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
            for call in range(2):  # the first call fills the block geometry's caches
                with cpu_plays_a_device(), counting_host_reads() as forward_reads:
                    out = ra.ring_attention(q, k, v, mask=mask, layout="zigzag", plan=plan)
                with cpu_plays_a_device(), counting_host_reads() as backward_reads:
                    out.sum().backward()
            found[(name, plan)] = (sum(forward_reads.values()), sum(backward_reads.values()))
    return found


def test_static_mask_calls_read_nothing_on_the_host(workers):
    for found in workers.get(2).run(_static_calls_read_nothing):
        assert found and all(reads == (0, 0) for reads in found.values()), found


def _runtime_masks_read_back_once(rank, world_size, layout, plan, hidden_rows):
    seq_len, batch = 48, 3
    generator = torch.Generator().manual_seed(7)
    doc_ids_BS = ((torch.rand(batch, seq_len, generator=generator) < 0.15).long().cumsum(1))
    key_valid_BS = torch.ones(batch, seq_len, dtype=torch.bool)
    key_valid_BS[0, 30:] = False  # right padding and left padding: batch groups may form
    key_valid_BS[2, :20] = False
    shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
    q, k, v = (shard(torch.randn(batch, 4, seq_len, 8, generator=generator)) for _ in range(3))

    def two_layers(doc_ids_BS, key_valid_BS):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        x = leaves[0]
        for _ in range(2):  # one mask data object per step, read by every layer and both directions
            x = ra.ring_attention(x, leaves[1], leaves[2], mask=CAUSAL & DOCS & PAD, layout=layout, plan=plan,
                                  doc_ids=doc_ids_BS, key_valid=key_valid_BS, hidden_rows=hidden_rows)
        x.square().sum().backward()
        return [x.detach()] + [t.grad for t in leaves]

    in_place = two_layers(doc_ids_BS, key_valid_BS)
    with cpu_plays_a_device():
        before = host_reads.read_backs
        # a host read of the mask tensors themselves raises (the op's own reads run with torch functions off, so
        # what is computed from them is not caught here: the copy count and the exact results are)
        copied = two_layers(doc_ids_BS.as_subclass(DeviceOnly), key_valid_BS.as_subclass(DeviceOnly))
        read_backs = host_reads.read_backs - before
    return read_backs, all(torch.equal(a, b) for a, b in zip(in_place, copied))


@pytest.mark.parametrize("layout, plan, hidden_rows", [("zigzag", "burst", "zero"), ("striped", "kv_ring", "zero"),
                                                       ("zigzag", "kv_ring", "uniform")])
def test_runtime_masks_decide_on_one_host_copy_per_step(workers, layout, plan, hidden_rows):
    # "uniform": eager's hidden rows (row 2's left padding sees no key), their indices decided on the host too
    for read_backs, identical in workers.get(2).run(_runtime_masks_read_back_once, layout, plan, hidden_rows):
        assert identical and read_backs == 2, (read_backs, identical)  # doc ids and key validity, once each


def test_copies_to_a_device_are_pinned_and_made_once(monkeypatch):
    """A host tensor copied to a GPU the usual way waits for the stream: the ring's copies (batch-group row indices,
    ALiBi's slopes, a chunk layout's positions) go through host_reads.to_device, once each."""
    from burstc.attention_ir import Alibi
    from burstc.kernels import masked_attention_blocks as masked
    from burstc.layout import ChunkLayout, local_positions
    from burstc.ops.batch_groups import rows_of

    pinned = []
    monkeypatch.setattr(host_reads, "host_device", lambda device: False)
    monkeypatch.setattr(host_reads, "_pinned", lambda t: pinned.append(t) or t)
    monkeypatch.setattr(masked, "_masked_row_chunk", lambda *a: 2)  # several chunks: the slopes copied once
    masked._slopes.cache_clear()
    assert torch.equal(rows_of([0, 2], "cpu"), torch.tensor([0, 2])) and len(pinned) == 1
    assert rows_of([1, 2], "cpu") == slice(1, 3) and len(pinned) == 1  # consecutive rows: a slice, no copy
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    masked_block_forward(q, k, v, torch.arange(5, 11), torch.arange(5), CAUSAL & Alibi((0.5, 0.25)), 0.5)
    assert len(pinned) == 2 and pinned[-1].tolist() == [0.5, 0.25]
    layout = ChunkLayout(2, (0, 1, 1, 0))
    first = local_positions(8, 2, 1, layout, "cpu")
    assert local_positions(8, 2, 1, layout, "cpu") is first and first.tolist() == [2, 3, 4, 5] and len(pinned) == 3
    masked._slopes.cache_clear()


def test_a_write_the_version_counter_misses_is_seen_next_step():
    with cpu_plays_a_device():
        ids_BS = torch.arange(12).view(2, 6)
        first = host_reads.host_copy(ids_BS)
        ids_BS.data[0, 0] = 7  # through .data: the version counter does not move
        assert host_reads.host_copy(ids_BS) is first  # within a step the copy stands
        host_reads.new_step()  # each sharded graph's forward starts with this
        assert int(host_reads.host_copy(ids_BS)[0, 0]) == 7


def _sharded_calls_start_steps(rank, world_size):
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    from burstc.testing import zoo

    compiled = burstc.compile(zoo.nanogpt_sdpa(), init_device_mesh("cpu", (world_size,)), backend="aot_eager")
    inputs = zoo.nanogpt_inputs()
    steps = []
    original = host_reads.new_step
    host_reads.new_step = lambda: (steps.append(1), original())
    try:
        for _ in range(2):
            zoo.nanogpt_loss(compiled, inputs).backward()
    finally:
        host_reads.new_step = original
    return len(steps), len(burstc.report(compiled).rewrites_of("shard"))


def test_each_sharded_forward_starts_a_step_of_host_copies(workers):
    for steps, shards in workers.get(2).run(_sharded_calls_start_steps):
        assert shards == 1 and steps == 2, (steps, shards)
