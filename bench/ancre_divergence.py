"""What grows before ANCRe's tiny LM without decoder norms diverges (reproduction (f)).

Trains the 24-layer decoder of ``cli_configs/ancre/repro_lm_deep_nonorm.yaml`` (no norm inside the
decoder layers; lr 3e-3, warm-up 20, cosine to 200 steps, batch 32) in a plain loop, one run per
layout of ``--variants`` and seed 0 and 1 (quick: 4 layers, 10 steps, seed 0), and every 10 steps
prints the training loss, the gradient norm, the largest RMS of any layer's attention input, a
bound on every attention logit and the RMS of the stream entering the final norm, up to the first
non-finite loss or gradient. Writes the rows to ``--out/ancre_divergence.json``.

Its data order is not the sweep's, so it shows how runs diverge, not which of the sweep's runs do.

Example::

    python bench/ancre_divergence.py --variants residual ancre_source hyper --out /tmp/div
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch import seed_everything
from torch import nn

from ada_modules.data import ArithmeticDataModule
from ada_modules.models import CausalLMModule
from ada_modules.nn import ConnectivityWrapper, StreamsWrapper
from ada_modules.optim.lr_schedulers import WarmupCosineLR

WRAPPERS: dict[str, Callable[[], nn.Module]] = {
    "residual": lambda: ConnectivityWrapper(mode="residual"),
    "ancre_source": lambda: ConnectivityWrapper(mode="source"),
    "ancre_input": lambda: ConnectivityWrapper(mode="input"),
    "hyper": lambda: StreamsWrapper(n_streams=4, kind="hyper", dynamic="token"),
    "hyper_static": lambda: StreamsWrapper(n_streams=4, kind="hyper", dynamic="none"),
    "hyper_n1": lambda: StreamsWrapper(n_streams=1, kind="hyper", dynamic="token"),
    "hyper_n1_static": lambda: StreamsWrapper(n_streams=1, kind="hyper", dynamic="none"),
}


def run_divergence(args: argparse.Namespace) -> list[dict]:
    """Train each layout of ``args.variants`` and return the rows the module docstring describes.

    The model and optimizer settings are those of ``cli_configs/ancre/tiny_lm.yaml`` with the
    overrides of ``repro_lm_deep_nonorm.yaml``. Without norms, the attention input is the residual
    stream as the layer sees it; the logit bound is the largest query norm times the largest key
    norm over sqrt(head dim), any layer.
    """
    seen: dict[str, float] = {}  # this step's largest values, filled by the hooks

    def record(name: str, value: float) -> None:
        seen[name] = max(seen.get(name, 0.0), value)

    def attention_input(attn: nn.Module, args_: tuple, kwargs: dict) -> None:
        x = kwargs.get("hidden_states", args_[0] if args_ else None).detach()
        record("attn_in_rms", x.pow(2).mean().sqrt().item())
        # Rotary embeddings rotate queries and keys but keep their norms, so |q| |k| / sqrt(d)
        # bounds every attention logit of the layer.
        head = attn.head_dim
        q = attn.q_proj(x).unflatten(-1, (-1, head)).norm(dim=-1).amax()
        k = attn.k_proj(x).unflatten(-1, (-1, head)).norm(dim=-1).amax()
        record("logit_bound", (q * k * attn.scaling).item())

    records = []
    for layout in args.variants:
        for seed in [0, 1] if not args.quick else [0]:
            seed_everything(seed, verbose=False)
            module = CausalLMModule(
                hidden_size=32,
                num_layers=24 if not args.quick else 4,
                num_heads=4,
                num_kv_heads=4,
                intermediate_size=128,
                max_position_embeddings=64,
                decoder_norms=False,
                model_wrapper=WRAPPERS[layout](),
                optimizer=partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
                lr_scheduler=partial(WarmupCosineLR, warmup_steps=20, total_steps=200),
            )
            data = ArithmeticDataModule(min_digits=1, max_digits=3, num_train=20000, batch_size=32)
            data.setup("fit")
            configured = module.configure_optimizers()
            optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
            hooks = [
                layer.self_attn.register_forward_pre_hook(attention_input, with_kwargs=True)
                for layer in module.model.modules()
                if hasattr(layer, "self_attn")
            ]
            hooks.append(
                module.model.model.norm.register_forward_pre_hook(
                    lambda _, inputs: record("final_rms", inputs[0].pow(2).mean().sqrt().item())
                )
            )
            print(f"\n{layout}, seed {seed}\n")
            print(
                "| step | loss | grad norm | attention input RMS (max) | logit bound | final RMS |"
            )
            print("|---|---|---|---|---|---|")
            for step, batch in enumerate(data.train_dataloader(), start=1):
                seen.clear()
                loss = module._loss(batch)
                optimizer.zero_grad()
                loss.backward()
                grad = torch.nn.utils.clip_grad_norm_(module.parameters(), math.inf).item()
                optimizer.step()
                scheduler.step()
                row = {"layout": layout, "seed": seed, "step": step, "loss": loss.item()}
                row |= {"grad_norm": grad, **seen}
                finite = math.isfinite(row["loss"]) and math.isfinite(grad)
                if step % 10 == 0 or not finite:
                    records.append(row)
                    print(
                        f"| {step} | {row['loss']:.3f} | {grad:.3g} | {row['attn_in_rms']:.3g} "
                        f"| {row['logit_bound']:.3g} | {row['final_rms']:.3g} |"
                    )
                if not finite or step >= (200 if not args.quick else 10):
                    break
            for hook in hooks:
                hook.remove()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, 10 steps, seed 0")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument(
        "--variants",
        nargs="*",
        choices=sorted(WRAPPERS),
        default=["residual", "ancre_source", "hyper"],
        help="layouts to train",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    records = run_divergence(args)
    (args.out / "ancre_divergence.json").write_text(json.dumps({"results": records}, indent=1))
    print(f"\nelapsed {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
