"""Key padding: forward bytes per rank against the data's zero-redundancy bound, counted by the simulator (no ranks):
now (K/V rows that are padding in every batch row stay home) and before (the static part's rows), left-padded
batches of two rows, causal, P = 4, S = 8K, 8 heads x 64, fp32.

    python benchmarks/padding_bytes.py
"""
import torch

from burstc.attention_ir import KeyPadding, MaskSpec
from burstc.testing.balance import simulate

SEQ_LEN, WORLD_SIZE = 8192, 4
SHAPE = dict(heads_q=8, heads_kv=8, head_dim=64, dtype=torch.float32)


def main() -> None:
    torch.set_num_threads(1)
    mask = MaskSpec.causal() & KeyPadding("attention_mask")
    print("| left padding of the two rows | layout | fwd MiB/rank now | before | bound | now / bound | before / bound |")
    print("|---|---|---|---|---|---|---|")
    for fractions in ((0.25, 0.35), (0.5, 0.1), (0.05, 0.05)):
        key_valid_BS = torch.ones(len(fractions), SEQ_LEN, dtype=torch.bool)
        for row, fraction in enumerate(fractions):
            key_valid_BS[row, :int(SEQ_LEN * fraction)] = False
        for layout in ("zigzag", "contiguous"):
            now = simulate(mask, layout, WORLD_SIZE, SEQ_LEN, batch=len(fractions), key_valid=key_valid_BS, **SHAPE)
            static = simulate(mask.static_part, layout, WORLD_SIZE, SEQ_LEN, batch=len(fractions), **SHAPE)
            bound = now.bound["forward"]
            before = max(s / b for s, b in zip(static.transfers["forward"].received, bound) if b)
            mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
            print(f"| {fractions} | {layout} | {mib(max(now.transfers['forward'].received))} "
                  f"| {mib(max(static.transfers['forward'].received))} | {mib(max(bound))} "
                  f"| {now.over_bound('forward'):.3f} | {before:.3f} |")


if __name__ == "__main__":
    main()
