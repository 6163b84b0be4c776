"""What sending each layer's KV as soon as that layer is computed would save, as a model.

Issue 22 asks whether per-layer overlap (P's `save_kv_layer` hook writing a layer's blocks to D
while the next layers compute) is worth its protocol change, for an 8B model on a GPU at 25,
100 and 400 Gb/s. This prints prefill time, KV bytes, the handoff after the prefill without
overlap and with it, from the model's shape and two stated assumptions (the GPU's effective
FLOP/s and the link running at line rate). It measures nothing: `kvferry bench handoff` and the
vLLM benchmarks do that.

    python3 scripts/overlap_model.py                   # Llama-3-8B, 3,000 tokens, H100 at 400 TFLOP/s
    python3 scripts/overlap_model.py --tokens 8000 --tflops 300 --gbps 25,100,400

The schedule: layer i (1..L) is computed at i x c (c = prefill / L); its KV (X / L of the
transfer time X) goes on the one link as soon as the layer is done and the link is free. The last
layer's bytes then land at max over k of (k c + (L - k + 1) X / L), so the handoff left after
the prefill is max(X / L, X - (L - 1) c): one layer's bytes when the link keeps up with the
compute, the excess transfer time when it does not. Without overlap it is all of X.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    params: float = 8.0e9
    dtype_bytes: int = 2

    def kv_bytes(self, tokens: int) -> float:
        """K and V of every layer for `tokens` tokens."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes * tokens

    def prefill_flops(self, tokens: int) -> float:
        """Weights (2 FLOPs per parameter per token) plus causal attention (QK^T and AV over
        half the T x T scores: 2 x layers x T^2 x hidden)."""
        return 2.0 * self.params * tokens + 2.0 * self.layers * tokens * tokens * self.hidden


def tail_after_prefill(prefill_s: float, transfer_s: float, layers: int) -> float:
    """Seconds from the prefill's end until D holds the last layer, layers sent as computed."""
    per_layer_compute = prefill_s / layers
    return max(transfer_s / layers, transfer_s - (layers - 1) * per_layer_compute)


def scheduled_tail(prefill_s: float, transfer_s: float, layers: int) -> float:
    """The same as `tail_after_prefill`, by playing the schedule layer by layer (the check that
    the closed form is right: python/tests/test_overlap_model.py)."""
    c, x = prefill_s / layers, transfer_s / layers
    link_free = 0.0
    for i in range(1, layers + 1):
        link_free = max(i * c, link_free) + x
    return link_free - prefill_s


def rows(model: Model, tokens: int, tflops: float, gbps: list[float]) -> list[dict[str, float]]:
    prefill_s = model.prefill_flops(tokens) / (tflops * 1e12)
    kv = model.kv_bytes(tokens)
    out = []
    for g in gbps:
        transfer_s = kv / (g * 1e9 / 8)
        tail = tail_after_prefill(prefill_s, transfer_s, model.layers)
        out.append({"gbps": g, "prefill_ms": prefill_s * 1e3, "kv_mb": kv / 1e6,
                    "without_ms": transfer_s * 1e3, "with_ms": tail * 1e3,
                    "hidden": 1 - tail / transfer_s})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--tflops", type=float, default=400.0,
                    help="the GPU's effective FLOP/s in prefill (an H100's bf16 peak is 989; "
                         "400 is ~40%% of it)")
    ap.add_argument("--gbps", default="25,100,400", help="link rates, Gb/s, at line rate")
    ap.add_argument("--layers", type=int, default=Model.layers)
    ap.add_argument("--kv-heads", type=int, default=Model.kv_heads)
    ap.add_argument("--head-dim", type=int, default=Model.head_dim)
    ap.add_argument("--hidden", type=int, default=Model.hidden)
    ap.add_argument("--params", type=float, default=Model.params)
    args = ap.parse_args()
    if args.tokens < 1 or args.tflops <= 0 or args.layers < 1:
        ap.error("--tokens, --tflops and --layers must be positive")
    try:
        gbps = [float(g) for g in args.gbps.split(",")]
    except ValueError:
        ap.error(f"--gbps: not a list of numbers: {args.gbps!r}")
    if any(g <= 0 for g in gbps):
        ap.error("--gbps: every rate must be positive")
    model = Model(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  hidden=args.hidden, params=args.params)
    table = rows(model, args.tokens, args.tflops, gbps)
    print(f"{args.tokens} tokens, {model.layers} layers, KV {table[0]['kv_mb']:.0f} MB, prefill "
          f"{table[0]['prefill_ms']:.0f} ms at {args.tflops:.0f} TFLOP/s")
    print("| link | handoff after prefill, layer by layer off | on | hidden |")
    print("|---|---|---|---|")
    for r in table:
        print(f"| {r['gbps']:.0f} Gb/s | {r['without_ms']:.1f} ms | {r['with_ms']:.2f} ms | "
              f"{r['hidden']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
