"""The balance simulator: per-rank work and bytes of one ring attention call, without ranks.

For a mask, a layout and P (up to 64 and beyond), :func:`simulate` counts what every rank of the ring
op computes (:func:`burstc.planner.predicted_work`, from :func:`burstc.block_geometry.blocks`) and
sends and receives per step (:func:`burstc.planner.predicted_transfers`, from
:func:`burstc.block_geometry.travelling_rows`): the functions the op itself calls, so the simulation
cannot drift from what runs (tests compare it with the counters of real 2- and 4-rank runs).  Beside
them, the zero-redundancy bound (:func:`burstc.planner.zero_redundancy_bound`) and the mask-blind
ring's bytes.  Runtime terms (documents, padding) are data: the static part is simulated (what travels
in the pairs the data leave some entry of, and a bound on the work), or with the data given the pairs
they hide send nothing, as in the op.

    python -m burstc.testing.balance --mask causal --layout zigzag --P 64 --S 65536
    python -m burstc.testing.balance --mask window:4096 --layout contiguous striped --P 8 16 --S 65536
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from burstc.attention_ir import MaskSpec, SlidingWindow
from burstc.layout import LAYOUTS, required_multiple
from burstc.block_geometry import pairs_hidden_by_data
from burstc.planner import masked_plan, predicted_transfers, predicted_work


def parse_mask(text: str) -> MaskSpec:
    """``window:W`` is HF's ``sliding_window=W`` (causal, W keys including the query's own); anything
    else is a :meth:`MaskSpec.encode` string (``full``, ``causal``, ``causal&window(7,-)``, ...)."""
    if text.startswith("window:"):
        return MaskSpec.causal() & SlidingWindow(int(text.removeprefix("window:")) - 1)
    return MaskSpec.decode(text)


@dataclasses.dataclass(frozen=True)
class Balance:
    """One simulated call.  ``work``: score entries per rank (B * Hq * visible pairs, as the op's
    counters count them) in the forward and the ``kv_ring`` backward; ``work_by_op`` the same per op
    (``"forward"``, ``"kv_ring"``, ``"burst"``: the burst backward computes at the keys' owner).  ``transfers``: :class:`burstc.planner.Transfers` per op (``"forward"``,
    ``"kv_ring"``, ``"burst"``); ``bound``: the zero-redundancy bytes each rank must receive, per op;
    ``dense``: bytes per rank of the mask-blind ring, per op."""

    mask: MaskSpec
    layout: str
    world_size: int
    seq_len: int
    plan: str
    work: tuple[int, ...]
    work_by_op: dict
    transfers: dict
    bound: dict
    dense: dict

    @property
    def work_max_over_mean(self) -> float:
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0

    def bytes_per_rank(self, op: str = "forward") -> int:
        """The most any rank receives (or sends: the larger) in one call of ``op``."""
        return max(max(self.transfers[op].received), max(self.transfers[op].sent))

    def over_bound(self, op: str = "forward") -> float:
        from burstc.planner import over_bound

        return over_bound(self.transfers[op].received, self.bound[op])


def simulate(mask: MaskSpec | str, layout: str, world_size: int, seq_len: int, *, batch: int = 1, heads_q: int = 32,
             heads_kv: int = 8, head_dim: int = 128, dtype: torch.dtype | int = torch.bfloat16,
             plan: str = "auto", doc_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None
             ) -> Balance:
    """Per-rank work and bytes of one call on ``world_size`` ranks (defaults: a Llama-3-8B-like
    attention layer in bf16).  With the runtime terms' data (``doc_ids`` / ``key_valid``, ``[B, S]``),
    the pairs the data hide move nothing, as in the op (the work stays the static part's, an upper
    bound)."""
    mask = parse_mask(mask) if isinstance(mask, str) else mask
    static = mask.static_part
    masked = masked_plan(layout, static, seq_len, world_size, batch, heads_q, heads_kv, head_dim, dtype, plan)
    if doc_ids is not None or key_valid is not None:
        hidden = pairs_hidden_by_data(layout, mask, seq_len // world_size, world_size, doc_ids, key_valid)
        transfers = predicted_transfers(layout, static, seq_len, world_size, batch, heads_q, heads_kv, head_dim,
                                        dtype, hidden)
        masked = dataclasses.replace(masked, transfers=transfers)
    work_by_op = {op: tuple(batch * heads_q * w for w in predicted_work(layout, static, seq_len, world_size,
                                                                        op == "burst").per_rank)
                  for op in ("forward", "kv_ring", "burst")}
    dense = {"forward": masked.dense["forward"]}
    for name in ("kv_ring", "burst"):
        dense[name] = masked_plan(layout, static, seq_len, world_size, batch, heads_q, heads_kv, head_dim, dtype,
                                  name).dense["backward"]
    return Balance(mask, layout, world_size, seq_len, masked.plan, work_by_op["forward"], work_by_op,
                   masked.transfers, masked.bound_per_rank,
                   dense)


def table_row(balance: Balance) -> str:
    plan = balance.plan
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    return (f"| {balance.mask.encode()} | {balance.layout} | {balance.world_size} | {balance.seq_len} "
            f"| {mib(balance.bytes_per_rank('forward'))} | {mib(max(balance.bound['forward']))} "
            f"| {balance.over_bound('forward'):.3f} | {plan} {mib(balance.bytes_per_rank(plan))} "
            f"| {mib(max(balance.bound[plan]))} | {balance.over_bound(plan):.3f} "
            f"| {balance.bytes_per_rank('forward') / balance.dense['forward']:.4f} "
            f"| {sum(balance.transfers['forward'].sent) / (balance.dense['forward'] * balance.world_size):.4f} "
            f"| {balance.work_max_over_mean:.3f} |")


HEADER = ("| mask | layout | P | S | fwd MiB/rank | fwd bound | fwd ratio | bwd plan MiB/rank | bwd bound | bwd ratio "
          "| fwd / dense ring, busiest rank | all ranks | work max/mean |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mask", nargs="+", default=["causal"], help="MaskSpec encodings or window:W")
    parser.add_argument("--layout", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--P", nargs="+", type=int, default=[64])
    parser.add_argument("--S", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", default="32/8", help="query/kv heads, e.g. 32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # many tiny tensor ops: threads only contend
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))
    print(HEADER)
    for mask in args.mask:
        for world_size in args.P:
            for layout in args.layout:
                if args.S % required_multiple(world_size, layout):
                    continue
                print(table_row(simulate(mask, layout, world_size, args.S, batch=args.batch, heads_q=heads_q,
                                    heads_kv=heads_kv, head_dim=args.head_dim)), flush=True)


if __name__ == "__main__":
    main()
