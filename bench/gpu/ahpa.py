"""GPU benchmark of AHPA: the alignment head's training overhead, then vanilla / REPA / AHPA.

What it measures (AHPA, issue 18), in one run on one GPU, bf16 autocast:

1. ``overhead``. One training step (VAE encode of the clean images, whose forward hooks catch the
   levels; DiT forward and backward; AdamW step; EMA update) of a DiT-S-like denoiser (12 blocks,
   width 384, patch 2) at 32 px (8x8 latents) and 64 px (16x16 latents, the shipped VAE is
   convolutional) with batch 256: median ms per step of vanilla, REPA on the mid block and AHPA
   (three levels, learned router), and the head's overhead in % of vanilla (target: at most
   10 %). Then the exported denoiser's forward with the head attached and after
   ``aligner.remove()``: equal outputs (checked) and equal time (no inference cost).
2. ``train``: the three arms trained for ``--train-seconds`` (60) each on 32 px shapes (8192
   images, batch 256, AdamW 3e-4, same data order), then ``fd`` and ``class_acc`` of 1024 Euler
   samples (20 steps, EMA weights) and ``flow_loss`` on 1024 test images; the arms get the same
   time, and the table gives the steps each managed.

Run it (one H200, about 5 minutes, guarded to ``--budget-s`` = 420 s)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/ahpa.py
    .venv/bin/python bench/gpu/ahpa.py --device cpu --quick      # smoke test, seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from _common import (
    Guard,
    add_only_argument,
    add_run_arguments,
    bench_device,
    median_ms,
    run_sections,
    sync,
    write_json,
)

from ada_modules.data.shapes import generate_shapes
from ada_modules.models.dit import DiTModule
from ada_modules.models.frechet import frechet_distance

SLUG = "ahpa"
LEVELS = ["encoder.down_blocks.0", "encoder.down_blocks.1", "encoder.mid_block"]
ARMS: dict[str, dict[str, Any] | None] = {
    "vanilla": None,
    "repa_mid": {"levels": [LEVELS[-1]], "block_index": 3, "router": "none", "normalize": "none"},
    "ahpa": {"levels": LEVELS, "block_index": 3, "router": "learned", "entropy_weight": 0.05},
}
FULL = {"layers": 12, "heads": 6, "head_dim": 64, "batch": 256, "sides": (32, 64), "images": 8192,
        "samples": 1024, "sample_steps": 20}  # fmt: skip
QUICK = {"layers": 2, "heads": 2, "head_dim": 16, "batch": 8, "sides": (32,), "images": 64,
         "samples": 16, "sample_steps": 2}  # fmt: skip


def _module(arm: str, sizes: dict, side: int, device: torch.device) -> DiTModule:
    alignment = ARMS[arm]
    if alignment is not None and alignment["block_index"] >= sizes["layers"]:
        alignment = {**alignment, "block_index": sizes["layers"] // 2}
    module = DiTModule(
        num_layers=sizes["layers"], num_attention_heads=sizes["heads"],
        attention_head_dim=sizes["head_dim"], alignment=alignment, image_size=side,
        num_samples=sizes["samples"], sample_steps=sizes["sample_steps"],
    )  # fmt: skip
    return module.to(device).train()


def _step(module: DiTModule, optimizer: torch.optim.Optimizer, batch: Any, device: Any) -> float:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = _loss(module, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    module.on_train_batch_end(None, batch, 0)
    return float(loss.detach())


def _loss(module: DiTModule, batch: Any) -> torch.Tensor:
    # training_step without Lightning's logging (no Trainer here)
    images, labels = batch
    z = module.encode(images)
    t = torch.rand(z.shape[0], device=z.device)
    flow = module._flow_loss(module.dit, z, labels, t, torch.randn_like(z))
    if module.aligner is None:
        return flow
    align, _ = module.aligner.loss(t, latent=z)
    return flow + module.hparams.alignment_weight * align


def run_overhead(sizes: dict, device: torch.device, results: list[dict]) -> None:
    print("\n## Training-step overhead of the head\n")
    print("| side | arm | ms / step | overhead vs vanilla |")
    print("|---|---|---|---|")
    for side in sizes["sides"]:
        images, labels = generate_shapes(sizes["batch"], seed=0, size=side)
        batch = (images.to(device), labels.to(device))
        base = None
        for arm in ARMS:
            module = _module(arm, sizes, side, device)
            optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])
            ms = median_ms(lambda m=module, o=optimizer, b=batch: _step(m, o, b, device), device)
            base = ms if base is None else base
            overhead = 100 * (ms / base - 1)
            print(f"| {side} | {arm} | {ms:.2f} | {overhead:+.1f} % |")
            results.append({"section": "overhead", "side": side, "arm": arm, "ms": ms,
                            "overhead_pct": overhead})  # fmt: skip
            if arm == "ahpa":
                results.append(_inference_check(module, side, device))


@torch.no_grad()
def _inference_check(module: DiTModule, side: int, device: torch.device) -> dict:
    dit = module.dit.eval()
    z = torch.randn(64, *module.latent_shape, device=device)
    t, y = torch.full((64,), 500.0, device=device), torch.arange(64, device=device) % 10
    attached = dit(z, timestep=t, class_labels=y).sample
    ms_attached = median_ms(lambda: dit(z, timestep=t, class_labels=y), device)
    module.aligner.remove()
    ms_removed = median_ms(lambda: dit(z, timestep=t, class_labels=y), device)
    equal = torch.equal(attached, dit(z, timestep=t, class_labels=y).sample)
    print(f"\nexported DiT at {side} px: forward {ms_attached:.2f} ms with the head attached, "
          f"{ms_removed:.2f} ms after remove(); outputs equal: {equal}")  # fmt: skip
    return {"section": "overhead", "check": "inference_unchanged", "side": side, "ok": equal,
            "ms_attached": ms_attached, "ms_removed": ms_removed}  # fmt: skip


def run_train(sizes: dict, args: argparse.Namespace, device: torch.device, guard: Guard,
              results: list[dict]) -> None:  # fmt: skip
    images, labels = generate_shapes(sizes["images"], seed=1)
    test_images, test_labels = (x.to(device) for x in generate_shapes(sizes["samples"], seed=2))
    images, labels = images.to(device), labels.to(device)
    seconds = args.train_seconds if not args.quick else 2.0
    print(f"\n## Equal time ({seconds:.0f} s each), 32 px\n")
    print("| arm | steps | final train loss | flow_loss | fd | class_acc |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        if not guard.ok(f"train {arm}", seconds + 30):
            continue
        torch.manual_seed(args.seed)
        module = _module(arm, sizes, 32, device)
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=3e-4)
        order = torch.Generator().manual_seed(args.seed)
        steps, loss, begin = 0, float("nan"), time.perf_counter()
        while time.perf_counter() - begin < seconds:
            index = torch.randint(0, images.shape[0], (sizes["batch"],), generator=order).to(device)
            loss = _step(module, optimizer, (images[index], labels[index]), device)
            steps += 1
        sync(device)
        module.eval()
        with torch.no_grad():
            z = module.encode(test_images)
            t = torch.rand(z.shape[0], generator=order).to(device)
            noise = torch.randn(z.shape, generator=order).to(device)
            flow = float(module._flow_loss(module.ema, z, test_labels, t, noise))
            wanted = torch.arange(sizes["samples"], device=device) % 10
            samples = torch.cat(
                [module.generate(c, seed=i) for i, c in enumerate(wanted.split(256))]
            )
            judge = module.judge
            fd = frechet_distance(judge.features(samples), judge.features(test_images))
            accuracy = float((judge(samples).argmax(-1) == wanted).float().mean())
        print(f"| {arm} | {steps} | {loss:.4f} | {flow:.4f} | {fd:.4g} | {accuracy:.3f} |")
        results.append({"section": "train", "arm": arm, "steps": steps, "train_loss": loss,
                        "flow_loss": flow, "fd": fd, "class_acc": accuracy})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    add_only_argument(parser)
    parser.add_argument("--train-seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    guard = Guard(budget_s=args.budget_s)
    resolved = bench_device(args.device)
    if resolved is None:
        return 1
    device, device_name = resolved
    sizes = QUICK if args.quick else FULL
    torch.manual_seed(args.seed)
    print(f"# AHPA GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(f"device: {device_name}; torch {torch.__version__}; bf16 autocast on CUDA")
    results: list[dict[str, Any]] = []
    sections = [
        ("overhead", lambda: run_overhead(sizes, device, results), 20),
        ("train", lambda: run_train(sizes, args, device, guard, results), 60),
    ]
    errors = run_sections(sections, guard, args.only)
    failed = [r for r in results if r.get("ok") is False]
    print(f"\nelapsed: {guard.elapsed():.1f} s")
    write_json(SLUG, {"device": device_name, "torch": torch.__version__, "quick": args.quick,
                      "elapsed_s": guard.elapsed(), "skipped": guard.skipped, "errors": errors,
                      "results": results})  # fmt: skip
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
