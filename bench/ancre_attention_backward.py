"""How far the fused attention's backward pass is from float64 as the attention logits grow.

The arithmetic behind the divergences of ANCRe's reproduction (f): at a jump of the residual
stream the attention logits of the last decoder layers reach 1e6-1e10. For causal attention of
the tiny LM's shape (batch 32, 4 heads, 40 tokens, head dim 8), with queries and keys scaled so
that the logits reach each ``--scales`` value, this prints the largest error of the value gradient
``dV``, relative to its largest float64 entry, for PyTorch's ``scaled_dot_product_attention`` in
float32 (with a boolean mask, as Hugging Face models call it, and with ``is_causal``) and for the
eager attention in float32 (softmax, then the product, so the probabilities are kept for the
backward pass). ``inf`` means a non-finite entry. ``--device cuda`` runs the same on a GPU, where
the fused attention picks other kernels. Writes the rows to ``--out/ancre_attention_backward.json``.

Example::

    python bench/ancre_attention_backward.py --out /tmp/attn
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

BATCH, HEADS, TOKENS, HEAD_DIM = 32, 4, 40, 8


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention written out: the softmax output is saved for the backward pass."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return logits.masked_fill(future, float("-inf")).softmax(-1) @ v


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fused attention with a boolean causal mask, broadcast over heads."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    mask = mask.expand(q.shape[0], 1, -1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fused attention with ``is_causal=True``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa, mask": masked_sdpa,
    "sdpa, is_causal": causal_sdpa,
    "eager": eager_attention,
}


def value_gradient(attention: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``dV`` of ``attention(q, k, v)`` for the output gradient ``tensors[3]``."""
    q, k, v, grad_out = (t.clone().requires_grad_(i < 3) for i, t in enumerate(tensors))
    attention(q, k, v).backward(grad_out)
    return v.grad


def relative_error(grad: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute error over the largest reference entry; ``inf`` if any entry is not finite."""
    if not torch.isfinite(grad).all():
        return math.inf
    return ((grad.double() - reference).abs().max() / reference.abs().max()).item()


def run(scales: list[float], seed: int, device: str = "cpu") -> list[dict]:
    """One row per logit scale: the largest logit and each attention's relative ``dV`` error."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for scale in scales:
        shape = (BATCH, HEADS, TOKENS, HEAD_DIM)
        q, k, v, grad_out = (torch.randn(shape, generator=generator).to(device) for _ in range(4))
        # logits are q.k / sqrt(d): scaling q and k by sqrt(scale) scales them by `scale`
        q, k = q * math.sqrt(scale), k * math.sqrt(scale)
        largest = (q.double() @ k.double().transpose(-1, -2)).abs().max() / math.sqrt(HEAD_DIM)
        reference = value_gradient(
            eager_attention, q.double(), k.double(), v.double(), grad_out.double()
        )
        row = {"scale": scale, "largest_logit": largest.item()}
        for name, attention in ATTENTIONS.items():
            row[name] = relative_error(value_gradient(attention, q, k, v, grad_out), reference)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three scales")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scales", nargs="*", type=float, default=[10.0**e for e in range(0, 11)])
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = run([1.0, 1e6, 1e10] if args.quick else args.scales, args.seed, args.device)
    print("| largest logit | " + " | ".join(f"dV error, {name}" for name in ATTENTIONS) + " |")
    print("|---|" + "---|" * len(ATTENTIONS))
    for row in rows:
        cells = " | ".join(f"{row[name]:.2g}" for name in ATTENTIONS)
        print(f"| {row['largest_logit']:.2g} | {cells} |")
    payload = {"torch": torch.__version__, "device": args.device, "seed": args.seed}
    payload["results"] = rows
    (args.out / "ancre_attention_backward.json").write_text(json.dumps(payload, indent=1))
    elapsed = time.perf_counter() - start
    print(f"\nelapsed {elapsed:.1f} s (torch {torch.__version__}, {args.device})")


if __name__ == "__main__":
    main()
