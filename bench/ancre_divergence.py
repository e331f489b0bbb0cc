"""What grows before ANCRe's tiny LM without decoder norms diverges (reproduction (f)).

Trains the 24-layer decoder of ``cli_configs/ancre/repro_lm_deep_nonorm.yaml`` (no norm inside the
decoder layers; lr 3e-3, warm-up 20, cosine to 200 steps, batch 32) in a plain loop, one run per
layout of ``--variants`` and seed of ``--seeds`` (quick: 4 layers, 10 steps, seed 0), and every
``--every`` steps prints the training loss, the gradient norm, the largest RMS of any layer's
attention input, a bound on every attention logit, the largest RMS of any layer's MLP output (and
which layer) and the RMS of the stream entering the final norm, up to the first non-finite loss or
gradient, then the validation loss. A last table gives each run's outcome and its largest finite
logit bound over all steps (the height of its highest jump). Writes the rows to
``--out/ancre_divergence.json``.

``--attn`` picks the attention (``sdpa``, PyTorch's fused attention, as in the sweeps, or
``eager``). ``--on-nonfinite eager`` tests whether a run dies of arithmetic: a step whose
gradient is not finite is computed again with the eager attention (which keeps the attention
probabilities instead of recomputing them in the backward pass), and the run goes on; the step is
listed in the run's last row. The run is otherwise the same, step for step.

Its data order is not the sweep's, so it shows how runs diverge, not which of the sweep's runs do.

Example::

    python bench/ancre_divergence.py --variants residual ancre_source hyper --out /tmp/div
    python bench/ancre_divergence.py --variants residual --on-nonfinite eager --out /tmp/div
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
    norm over sqrt(head dim), any layer. Layers are counted from 0 in the order they run.
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

    def mlp_output(index: int, _: nn.Module, __: tuple, output: torch.Tensor) -> None:
        value = output.detach().pow(2).mean().sqrt().item()
        largest = seen.get("mlp_out_rms", -1.0)
        if value > largest or (not math.isfinite(value) and math.isfinite(largest)):
            seen["mlp_out_rms"], seen["mlp_out_layer"] = value, index

    def gradient(module: CausalLMModule, batch: dict) -> tuple[float, float]:
        seen.clear()
        loss = module._loss(batch)
        module.zero_grad()
        loss.backward()
        return loss.item(), torch.nn.utils.clip_grad_norm_(module.parameters(), math.inf).item()

    records = []
    for layout in args.variants:
        for seed in args.seeds if not args.quick else [0]:
            seed_everything(seed, verbose=False)
            module = CausalLMModule(
                hidden_size=32,
                num_layers=24 if not args.quick else 4,
                num_heads=4,
                num_kv_heads=4,
                intermediate_size=128,
                max_position_embeddings=64,
                decoder_norms=False,
                attn_implementation=args.attn,
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
            mlps = [layer.mlp for layer in module.model.model.layers]
            hooks += [
                mlp.register_forward_hook(partial(mlp_output, i)) for i, mlp in enumerate(mlps)
            ]
            hooks.append(
                module.model.model.norm.register_forward_pre_hook(
                    lambda _, inputs: record("final_rms", inputs[0].pow(2).mean().sqrt().item())
                )
            )
            print(f"\n{layout}, seed {seed}\n")
            print(
                "| step | loss | grad norm | attention input RMS (max) | logit bound "
                "| MLP output RMS (max), layer | final RMS |"
            )
            print("|---|---|---|---|---|---|---|")
            eager_steps, peak = [], (0.0, 0)  # largest finite logit bound, and its step
            for step, batch in enumerate(data.train_dataloader(), start=1):
                loss, grad = gradient(module, batch)
                row = {"layout": layout, "seed": seed, "step": step, "loss": loss}
                row |= {"grad_norm": grad, **seen}
                finite = math.isfinite(loss) and math.isfinite(grad)
                if math.isfinite(seen["logit_bound"]) and seen["logit_bound"] > peak[0]:
                    peak = (seen["logit_bound"], step)
                if not finite and args.on_nonfinite == "eager" and args.attn != "eager":
                    module.model.set_attn_implementation("eager")
                    loss, grad = gradient(module, batch)
                    module.model.set_attn_implementation(args.attn)
                    finite = math.isfinite(loss) and math.isfinite(grad)
                    eager_steps.append(step)
                    row["eager_grad_norm"] = grad
                if finite:
                    optimizer.step()
                scheduler.step()
                if step % args.every == 0 or not finite or "eager_grad_norm" in row:
                    records.append(row)
                    grad_cell = f"{row['grad_norm']:.3g}"
                    if "eager_grad_norm" in row:
                        grad_cell += f", eager: {row['eager_grad_norm']:.3g}"
                    print(
                        f"| {step} | {row['loss']:.3f} | {grad_cell} "
                        f"| {row['attn_in_rms']:.3g} | {row['logit_bound']:.3g} "
                        f"| {row['mlp_out_rms']:.3g}, {row['mlp_out_layer']} "
                        f"| {row['final_rms']:.3g} |"
                    )
                if not finite or step >= (200 if not args.quick else 10):
                    break
            for hook in hooks:
                hook.remove()
            with torch.no_grad():
                val = [module._loss(batch).item() for batch in data.val_dataloader()]
            end = {"layout": layout, "seed": seed, "last_step": step, "finite": finite}
            end |= {"val_loss": sum(val) / len(val), "eager_steps": eager_steps}
            end |= {"peak_logit_bound": peak[0], "peak_step": peak[1]}
            records.append(end)
            print(
                f"\n{layout}, seed {seed}: {'trained' if finite else 'stopped at step'} {step}, "
                f"validation loss {end['val_loss']:.3f}, steps computed again with the eager "
                f"attention: {eager_steps or 'none'}"
            )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, 10 steps, seed 0")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    parser.add_argument("--every", type=int, default=10, help="print every this many steps")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa", help="attention")
    parser.add_argument(
        "--on-nonfinite",
        choices=["stop", "eager"],
        default="stop",
        help="stop the run, or compute the step again with the eager attention",
    )
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
    print("\n| layout | seed | outcome | largest logit bound (step) | validation loss |")
    print("|---|---|---|---|---|")
    for end in (row for row in records if "last_step" in row):
        outcome = "trained" if end["finite"] else f"stopped at step {end['last_step']}"
        if end["eager_steps"]:
            outcome += f", eager attention at {end['eager_steps']}"
        print(
            f"| {end['layout']} | {end['seed']} | {outcome} "
            f"| {end['peak_logit_bound']:.3g} ({end['peak_step']}) | {end['val_loss']:.3f} |"
        )
    (args.out / "ancre_divergence.json").write_text(json.dumps({"results": records}, indent=1))
    print(f"\nelapsed {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
