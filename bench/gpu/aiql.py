"""AIQL at large candidate pools on one GPU: actor cost, sampled negatives, pooling, end to end.

Pools are real simulator states: ``ConsolidationSimulator(min_candidates=N, max_candidates=N)
.reset(64)`` (every row holds exactly N open orders, 9 features each, built on the CPU and moved
to the device), the logged picks the top 8 of the ``edd`` scores plus Gumbel noise (scale 3).
The actor is the library's :class:`~ada_modules.offline_rl.CandidateScorer` (hidden 64, fp32),
its loss the Plackett–Luce negative log-likelihood of the picks,
:func:`~ada_modules.offline_rl.plackett_luce_log_likelihood`, averaged over the batch.
Sections (``--only``), in order:

- ``checks``: the "gathered" actor below equals ``CandidateScorer.forward`` on every candidate, and
  its likelihood over the picks + sampled negatives equals the library's sampled-mask likelihood
  (maximum absolute errors printed); with at least N - 8 negatives the sampled mask is the full one.
- ``actor``: forward + backward of the actor's loss at N = 5,000, 20,000 and 50,000, batch 64, in
  three ways: ``full`` (the normaliser over all N), ``sampled`` (the library's path, as
  ``CandidateSelectionModule(num_negatives=512)`` runs it: ``subsample_candidates`` keeps the picks
  and 512 random others, the actor still scores all N) and ``gathered`` (the same 520 candidates,
  but only they go through the actor's head; the embedding and the DeepSets context still see all
  N). Median ms (``triton.testing.do_bench``), million candidates per second, peak extra CUDA
  memory of one step and its bytes per candidate (linear in N), and the time relative to ``full``.
- ``gradient``: at N = 50,000, the gradient of the loss with respect to the actor's parameters,
  full softmax vs 512 sampled negatives (8 independent draws): cosine of each draw's gradient with
  the full one, cosine of the draws' mean, norm ratio, and the mean log-likelihood of both; once at
  initialisation and once after 100 Adam steps (lr 1e-3) of full-softmax training on another pool
  (a sharper policy).
- ``pooling``: the aggregate critic's inputs, ``state_summary`` of ``[64, N, 9]`` pools (means,
  stds and masked quantiles: a sort) and ``action_summary`` of the picks: median ms, million
  candidates per second, GB/s of the features read, peak extra memory.
- ``end2end``: ``CandidateSelectionModule(critic="aggregate", hidden=32)`` trained twice for 800
  steps on the same ``ConsolidationLogsDataModule`` logs (2,000 to 5,000 candidates per epoch, 300
  source episodes of 20 epochs, batch 128, reward noise 2), ``num_negatives=None`` (full softmax)
  vs ``512``, same seed (same initialisation and batch order); then the greedy top-8 policy of each
  is rolled out on the DataModule's 200 test episodes (source objective), beside the edd, zone,
  random and greedy_source heuristics on the same episodes. Printed: each run's test return (mean
  reward per epoch), its difference from the full-softmax run relative to that return and as a
  share of the random-to-greedy_source gap (at these pool sizes most of the reward is the expiry
  cost no policy avoids, so the relative difference alone flatters), ms per training step (data
  loading included) and fit seconds. Seed 0, then seed 1 (new logs) if the time guard allows.

The time guard (``--budget-s``, default 420) skips what would not fit. Writes ``$OUT/aiql.json``
with one record per measured row when ``OUT`` is set. ``--device cpu --quick`` runs tiny sizes
(pools of 300 and 1,200, batch 4, 32 negatives, a 5-step end-to-end run) in seconds: a smoke test,
numbers meaningless (perf_counter timings, no memory column). Exits non-zero without CUDA unless
``--device cpu``.
"""

import argparse
import functools
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from _common import (  # bench/gpu/_common.py
    Guard,
    add_only_argument,
    add_run_arguments,
    bench_device,
    median_ms,
    quiet_trainer,
    run_sections,
    sync,
    write_json,
)

from ada_modules.data.consolidation import (
    CANDIDATE_FEATURES,
    STATE_FEATURES,
    ConsolidationSimulator,
    action_summary,
    candidate_features,
    heuristic_scores,
    select_top_k,
    state_summary,
)
from ada_modules.offline_rl import (
    CandidateScorer,
    plackett_luce_log_likelihood,
    subsample_candidates,
)

SLUG = "aiql"
PICK = 8
HEURISTIC_REFERENCES = ("edd", "zone", "random", "greedy_source")


@dataclass(frozen=True)
class Size:
    pools: tuple[int, ...]
    batch: int
    hidden: int
    negatives: int
    draws: int
    warm_steps: int
    data: dict[str, Any]
    steps: int
    e2e_hidden: int
    e2e_negatives: int
    seeds: tuple[int, ...]


FULL = Size(
    pools=(5_000, 20_000, 50_000),
    batch=64,
    hidden=64,
    negatives=512,
    draws=8,
    warm_steps=100,
    data={
        "min_candidates": 2000,
        "max_candidates": 5000,
        "horizon": 20,
        "source_episodes": 300,
        "val_episodes": 50,
        "test_episodes": 200,
        "batch_size": 128,
    },
    steps=800,
    e2e_hidden=32,
    e2e_negatives=512,
    seeds=(0, 1),
)
QUICK = Size(
    pools=(300, 1200),
    batch=4,
    hidden=16,
    negatives=32,
    draws=2,
    warm_steps=3,
    data={
        "min_candidates": 20,
        "max_candidates": 60,
        "horizon": 4,
        "source_episodes": 8,
        "val_episodes": 4,
        "test_episodes": 4,
        "batch_size": 16,
    },
    steps=5,
    e2e_hidden=16,
    e2e_negatives=8,
    seeds=(0,),
)


# ------------------------------------------------------------------ pieces


@dataclass
class Pool:
    candidates: torch.Tensor
    mask: torch.Tensor
    chosen: torch.Tensor
    progress: torch.Tensor
    state: torch.Tensor


def make_pool(num_candidates: int, batch: int, seed: int, device: torch.device) -> Pool:
    """``batch`` simulator backlogs of exactly ``num_candidates`` orders and noisy edd picks."""
    sim = ConsolidationSimulator(
        min_candidates=num_candidates, max_candidates=num_candidates, pick=PICK
    )
    state = sim.reset(batch, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(state.mask.shape, generator=generator).clamp(1e-12, 1 - 1e-7)
    noisy = heuristic_scores(state, "edd") + 3.0 * -torch.log(-torch.log(uniform))
    chosen = select_top_k(noisy, state.mask, PICK).to(device)
    candidates = candidate_features(state).to(device)
    mask = state.mask.to(device)
    progress = torch.full((batch,), 0.5, device=device)
    summary = state_summary(candidates, mask, progress)
    return Pool(candidates, mask, chosen, progress, summary)


def gather_index(keep: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[B, K + M]`` of a sampled mask's candidates, the picks first (every row keeps
    the same number M of negatives), and the picks' positions ``[B, K]`` among them."""
    others = keep.scatter(1, chosen, False)
    negatives = others.nonzero()[:, 1].view(keep.shape[0], -1)
    index = torch.cat([chosen, negatives], dim=1)
    local = torch.arange(chosen.shape[1], device=chosen.device).expand_as(chosen)
    return index, local


def gathered_scores(actor: CandidateScorer, pool: Pool, index: torch.Tensor) -> torch.Tensor:
    """``CandidateScorer.forward`` with the per-candidate head run only on ``index``."""
    embedded = actor.embed(pool.candidates)
    weights = pool.mask.to(embedded.dtype)[..., None]
    pooled = (embedded * weights).sum(1) / weights.sum(1).clamp(min=1)
    context = actor.context(torch.cat([pooled, pool.state], dim=-1))
    picked = embedded.gather(1, index[..., None].expand(-1, -1, embedded.shape[-1]))
    joint = torch.cat([picked, context[:, None].expand_as(picked)], dim=-1)
    return actor.head(joint).squeeze(-1)


def loss_fn(actor: CandidateScorer, pool: Pool, mode: str, negatives: int) -> torch.Tensor:
    """The actor's loss ``-mean log PL(picks)`` in one of the modes of the module docstring."""
    if mode == "full":
        scores = actor(pool.candidates, pool.mask, pool.state)
        return -plackett_luce_log_likelihood(scores, pool.mask, pool.chosen).mean()
    keep = subsample_candidates(pool.mask, pool.chosen, negatives)
    if mode == "sampled":
        scores = actor(pool.candidates, pool.mask, pool.state)
        return -plackett_luce_log_likelihood(scores, keep, pool.chosen).mean()
    index, local = gather_index(keep, pool.chosen)
    scores = gathered_scores(actor, pool, index)
    everything = torch.ones_like(scores, dtype=torch.bool)
    return -plackett_luce_log_likelihood(scores, everything, local).mean()


def peak_mib(fn: Any, device: torch.device) -> float | None:
    """Peak CUDA memory of one call of ``fn`` above what was allocated before (MiB)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def flat_grad(actor: CandidateScorer, loss: torch.Tensor) -> torch.Tensor:
    grads = torch.autograd.grad(loss, list(actor.parameters()))
    return torch.cat([g.flatten() for g in grads])


# ------------------------------------------------------------------ sections


class Bench:
    def __init__(self, size: Size, device: torch.device, guard: Guard) -> None:
        self.size, self.device, self.guard = size, device, guard
        self.results: list[dict[str, Any]] = []
        self._pools: dict[tuple[int, int], Pool] = {}

    def pool(self, num_candidates: int, seed: int = 0) -> Pool:
        key = (num_candidates, seed)
        if key not in self._pools:
            self._pools.clear()  # one large pool at a time
            self._pools[key] = make_pool(num_candidates, self.size.batch, seed, self.device)
        return self._pools[key]

    def actor(self, seed: int = 0) -> CandidateScorer:
        torch.manual_seed(seed)
        return CandidateScorer(CANDIDATE_FEATURES, STATE_FEATURES, self.size.hidden).to(self.device)

    def checks(self) -> None:
        print("## Checks\n")
        size = self.size
        pool = make_pool(size.pools[0], size.batch, seed=7, device=self.device)
        actor = self.actor()
        with torch.no_grad():
            full = actor(pool.candidates, pool.mask, pool.state)
            every = torch.arange(pool.mask.shape[1], device=self.device).expand_as(pool.mask)
            forward_error = float((gathered_scores(actor, pool, every) - full).abs().max())
            keep = subsample_candidates(pool.mask, pool.chosen, size.negatives)
            index, local = gather_index(keep, pool.chosen)
            library = plackett_luce_log_likelihood(full, keep, pool.chosen)
            scores = gathered_scores(actor, pool, index)
            everything = torch.ones_like(scores, dtype=torch.bool)
            gathered = plackett_luce_log_likelihood(scores, everything, local)
            likelihood_error = float((gathered - library).abs().max())
            all_kept = subsample_candidates(pool.mask, pool.chosen, pool.mask.shape[1])
            full_mask_equal = bool(torch.equal(all_kept, pool.mask))
            full_ll = plackett_luce_log_likelihood(full, pool.mask, pool.chosen)
            sampled_higher = bool((library >= full_ll - 1e-5).all())
        print(f"- gathered actor vs CandidateScorer.forward: max |error| {forward_error:.2e}")
        print(f"- gathered vs sampled-mask likelihood: max |error| {likelihood_error:.2e}")
        print(f"- N - 8 negatives keep the full mask: {full_mask_equal}")
        print(f"- sampled log-likelihood >= full (fewer competitors): {sampled_higher}\n")
        self.results.append(
            {"section": "checks", "candidates": size.pools[0], "forward_error": forward_error,
             "likelihood_error": likelihood_error, "full_mask_equal": full_mask_equal,
             "sampled_higher": sampled_higher}
        )  # fmt: skip
        if forward_error > 1e-4 or likelihood_error > 1e-3 or not full_mask_equal:
            raise AssertionError("a check failed; the timings below would compare wrong things")

    def actor_cost(self) -> None:
        size = self.size
        print(
            f"## Actor forward + backward (batch {size.batch}, hidden {size.hidden}, pick {PICK}, "
            f"{size.negatives} sampled negatives)\n"
        )
        print(
            "| N | mode | candidates in the likelihood | ms | M candidates/s | peak MiB "
            "| bytes/candidate | time vs full |"
        )
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for num_candidates in size.pools:
            if not self.guard.ok(f"actor N={num_candidates}", 15):
                continue
            pool = self.pool(num_candidates)
            actor = self.actor()
            full_ms = None
            for mode in ("full", "sampled", "gathered"):

                def step(
                    mode: str = mode, actor: CandidateScorer = actor, pool: Pool = pool
                ) -> None:
                    actor.zero_grad(set_to_none=True)
                    loss_fn(actor, pool, mode, size.negatives).backward()

                ms = median_ms(step, self.device)
                peak = peak_mib(step, self.device)
                full_ms = ms if mode == "full" else full_ms
                cells = size.batch * num_candidates
                per_candidate = None if peak is None else peak * 2**20 / cells
                kept = num_candidates if mode == "full" else PICK + size.negatives
                print(
                    f"| {num_candidates} | {mode} | {kept} | {ms:.2f} | {cells / ms / 1e3:.1f} | "
                    f"{fmt(peak, 0)} | {fmt(per_candidate, 0)} | {ms / full_ms:.2f} |",
                    flush=True,
                )
                self.results.append(
                    {"section": "actor", "candidates": num_candidates, "batch": size.batch,
                     "hidden": size.hidden, "mode": mode, "negatives": size.negatives,
                     "ms": ms, "peak_mib": peak, "bytes_per_candidate": per_candidate,
                     "time_vs_full": ms / full_ms}
                )  # fmt: skip
        print()

    def gradient(self) -> None:
        size = self.size
        num_candidates = size.pools[-1]
        print(
            f"## Gradient of the actor's loss, full softmax vs {size.negatives} sampled negatives "
            f"(N = {num_candidates}, batch {size.batch}, {size.draws} draws)\n"
        )
        print(
            "| actor | cos(draw, full) | cos(mean of draws, full) | norm ratio | "
            "log-lik. full | log-lik. sampled |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        pool = self.pool(num_candidates)
        actor = self.actor()
        for label in ("initial", f"after {size.warm_steps} full-softmax steps"):
            if label != "initial":
                if not self.guard.ok("gradient after training", 30):
                    break
                train_pool = make_pool(num_candidates, size.batch, seed=1, device=self.device)
                optimizer = torch.optim.Adam(actor.parameters(), lr=1e-3)
                for _ in range(size.warm_steps):
                    optimizer.zero_grad(set_to_none=True)
                    loss_fn(actor, train_pool, "full", size.negatives).backward()
                    optimizer.step()
                del train_pool
            full_loss = loss_fn(actor, pool, "full", size.negatives)
            full = flat_grad(actor, full_loss)
            draws, losses = [], []
            for _ in range(size.draws):
                loss = loss_fn(actor, pool, "sampled", size.negatives)
                draws.append(flat_grad(actor, loss))
                losses.append(float(loss.detach()))
            cosines = [float(torch.nn.functional.cosine_similarity(g, full, dim=0)) for g in draws]
            mean = torch.stack(draws).mean(0)
            mean_cos = float(torch.nn.functional.cosine_similarity(mean, full, dim=0))
            ratios = [float(g.norm() / full.norm()) for g in draws]
            full_ll, sampled_ll = -float(full_loss.detach()), -sum(losses) / len(losses)
            cos_text = f"{sum(cosines) / len(cosines):.4f} (min {min(cosines):.4f})"
            print(
                f"| {label} | {cos_text} | {mean_cos:.4f} | {sum(ratios) / len(ratios):.3f} | "
                f"{full_ll:.2f} | {sampled_ll:.2f} |",
                flush=True,
            )
            self.results.append(
                {"section": "gradient", "actor": label, "candidates": num_candidates,
                 "negatives": size.negatives, "cosines": cosines, "mean_cosine": mean_cos,
                 "norm_ratios": ratios, "log_likelihood_full": full_ll,
                 "log_likelihood_sampled": sampled_ll}
            )  # fmt: skip
        print(
            "\nThe sampled likelihood is higher (fewer competitors) and, without a correction, "
            "a biased estimate; the cosines say how far its gradient points elsewhere.\n"
        )

    def pooling(self) -> None:
        size = self.size
        print(f"## Aggregate critic's inputs (batch {size.batch}, {CANDIDATE_FEATURES} features)\n")
        print(
            "| N | state_summary ms | M candidates/s | GB/s read | peak MiB | action_summary ms |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for num_candidates in size.pools:
            if not self.guard.ok(f"pooling N={num_candidates}", 8):
                continue
            pool = self.pool(num_candidates)

            def summary(pool: Pool = pool) -> None:
                state_summary(pool.candidates, pool.mask, pool.progress)

            def action(pool: Pool = pool) -> None:
                action_summary(pool.candidates, pool.chosen)

            ms = median_ms(summary, self.device)
            action_ms = median_ms(action, self.device)
            peak = peak_mib(summary, self.device)
            cells = size.batch * num_candidates
            read = pool.candidates.numel() * pool.candidates.element_size() + pool.mask.numel()
            print(
                f"| {num_candidates} | {ms:.3f} | {cells / ms / 1e3:.1f} | {read / ms / 1e6:.1f} "
                f"| {fmt(peak, 0)} | {action_ms:.3f} |",
                flush=True,
            )
            self.results.append(
                {"section": "pooling", "candidates": num_candidates, "batch": size.batch,
                 "state_summary_ms": ms, "action_summary_ms": action_ms, "peak_mib": peak,
                 "gb_per_s": read / ms / 1e6}
            )  # fmt: skip
        print()

    def end_to_end(self) -> None:
        from lightning.pytorch import seed_everything

        from ada_modules.data import ConsolidationLogsDataModule
        from ada_modules.models import CandidateSelectionModule
        from ada_modules.models.candidate_selection import rollout

        size = self.size
        data = size.data
        print(
            f"## End to end: AIQL, full softmax vs {size.e2e_negatives} sampled negatives "
            f"({data['min_candidates']}-{data['max_candidates']} candidates, "
            f"{data['source_episodes']} source episodes, {size.steps} steps, "
            f"{data['test_episodes']} test episodes)\n"
        )
        per_pair = 0.0
        rows = []
        for seed in size.seeds:
            if rows and not self.guard.ok(f"end2end seed {seed}", per_pair * 1.2 + 10):
                continue
            begin = time.perf_counter()
            dm = ConsolidationLogsDataModule(**data, pick=PICK, target_episodes=0, seed=seed)
            dm.setup("fit")
            tests = [dm.datasets["test"][i] for i in range(len(dm.datasets["test"]))]

            def test_return(score: Any, tests: list = tests, dm: Any = dm) -> float:
                values = [rollout(dm.simulator, score, t["envs"], t["seed"]) for t in tests]
                return sum(v["source"] for v in values) / len(values)

            references = {}
            for name in HEURISTIC_REFERENCES:
                returns = []
                for t in tests:
                    generator = torch.Generator().manual_seed(t["seed"])
                    score = functools.partial(heuristic_scores, heuristic=name, generator=generator)
                    returns.append(rollout(dm.simulator, score, t["envs"], t["seed"])["source"])
                references[name] = sum(returns) / len(returns)
            for negatives in (None, size.e2e_negatives):
                seed_everything(seed, verbose=False)
                module = CandidateSelectionModule(
                    critic="aggregate", hidden=size.e2e_hidden, num_negatives=negatives
                )
                trainer = quiet_trainer(self.device, max_steps=size.steps)
                start = time.perf_counter()
                trainer.fit(module, datamodule=dm)
                fit_s = time.perf_counter() - start
                module.eval()
                rows.append(
                    {"section": "end2end", "seed": seed, "negatives": negatives,
                     "test_return": test_return(module.policy_scores), "fit_s": fit_s,
                     "ms_per_step": 1e3 * fit_s / max(trainer.global_step, 1),
                     "steps": trainer.global_step, "references": references}
                )  # fmt: skip
                print(
                    f"seed {seed}, negatives {negatives}: test return "
                    f"{rows[-1]['test_return']:.2f} after {fit_s:.0f} s of fit",
                    flush=True,
                )
            per_pair = max(per_pair, time.perf_counter() - begin)
        print(
            "\n| seed | negatives | test return | vs full, relative | vs full, share of the "
            "random→greedy gap | ms/step | fit s |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            full = next(r for r in rows if r["seed"] == row["seed"] and r["negatives"] is None)
            refs = row["references"]
            gap = refs["greedy_source"] - refs["random"]
            diff = row["test_return"] - full["test_return"]
            row["relative_to_full"] = diff / abs(full["test_return"])
            row["share_of_gap"] = diff / gap if gap else math.nan
            print(
                f"| {row['seed']} | {row['negatives'] or 'all'} | {row['test_return']:.2f} | "
                f"{100 * row['relative_to_full']:+.2f} % | {100 * row['share_of_gap']:+.1f} % | "
                f"{row['ms_per_step']:.1f} | {row['fit_s']:.1f} |"
            )
            self.results.append(row)
        for seed in sorted({r["seed"] for r in rows}):
            refs = next(r["references"] for r in rows if r["seed"] == seed)
            text = ", ".join(f"{name} {value:.2f}" for name, value in refs.items())
            print(f"\nseed {seed}, heuristics on the same test episodes: {text}")
        sampled = [r for r in rows if r["negatives"] is not None]
        if sampled:
            worst = max(abs(r["relative_to_full"]) for r in sampled)
            print(
                f"\nlargest |relative difference| of the sampled run: {100 * worst:.2f} % "
                f"({'within' if worst <= 0.01 else 'outside'} 1 %)"
            )
        print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    add_only_argument(parser)
    args = parser.parse_args(argv)
    found = bench_device(args.device)
    if found is None:
        return 1
    device, name = found
    size = QUICK if args.quick else FULL
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no per-Trainer banners
    print(f"# AIQL GPU benchmark ({'quick' if args.quick else 'full'}) on {name}\n")
    guard = Guard(args.budget_s)
    bench = Bench(size, device, guard)
    sections = [
        ("checks", bench.checks, 5),
        ("actor", bench.actor_cost, 20),
        ("gradient", bench.gradient, 15),
        ("pooling", bench.pooling, 10),
        ("end2end", bench.end_to_end, 5 if args.quick else 120),
    ]
    errors = run_sections(sections, guard, args.only)
    elapsed = guard.elapsed()
    print(f"\nelapsed: {elapsed:.1f} s")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    write_json(
        SLUG,
        {"device": name, "torch": torch.__version__, "triton": triton_version,
         "quick": args.quick, "elapsed_s": elapsed, "skipped": guard.skipped, "errors": errors,
         "results": bench.results},
    )  # fmt: skip
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
