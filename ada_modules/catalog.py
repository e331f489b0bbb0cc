"""The catalogue of the seventeen techniques: one record each, pure data.

The README table, the docs pages and ``tests/test_catalog.py`` are checked against this tuple,
so a technique that changes status (``planned`` -> ``in progress`` -> ``implemented``) changes here
first.

Example::

    >>> from ada_modules.catalog import by_slug
    >>> by_slug("adakvq").kind
    'KV cache + Triton kernels'
"""

from __future__ import annotations

from dataclasses import dataclass

from ada_modules.errors import InputError

__all__ = ["STATUSES", "TECHNIQUES", "Technique", "by_slug"]

STATUSES: tuple[str, ...] = ("planned", "in progress", "implemented")
"""Allowed values of `Technique.status`."""


@dataclass(frozen=True)
class Technique:
    """One technique of the library.

    Args:
        name: Display name, as the paper writes it (``"AcceleGrad#"``).
        slug: Folder name used in ``cli_configs/<slug>/``, ``docs/techniques/<slug>.md`` and
            ``bench/<slug>.py``.
        kind: What kind of component it becomes (``"Optimizer"``, ``"KV cache + Triton kernels"``).
        summary: One line on what it does.
        status: One of :data:`STATUSES`.
        issue: The tracker issue that builds it, or ``None`` while it has none.
    """

    name: str
    slug: str
    kind: str
    summary: str
    status: str = "planned"
    issue: int | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise InputError(f"status={self.status!r}: expected one of {STATUSES}")
        if not self.slug.isidentifier() or self.slug != self.slug.lower():
            raise InputError(f"slug={self.slug!r}: expected a lower-case identifier")

    @property
    def docs_path(self) -> str:
        """Path of the technique's docs page, relative to the repository root."""
        return f"docs/techniques/{self.slug}.md"


_T = Technique

TECHNIQUES: tuple[Technique, ...] = (
    _T("AdaKVQ", "adakvq", "KV cache + Triton kernels",
       "Per-layer KV-cache bit widths chosen from each layer's average attention distance.",
       status="implemented", issue=3),
    _T("AdaCal", "adacal", "Attention function + Triton kernel",
       "Sparse prefill attention whose per-head budget is set from a cheap probe.",
       status="implemented", issue=16),
    _T("AdERA", "adera", "Lightning Strategy (FSDP2)",
       "Lossless FSDP2 all-gather that reuses each weight's cached exponent or previous value.",
       status="implemented", issue=4),
    _T("AcceleGrad#", "accelegrad_sharp", "Optimizer",
       "Accelerated linear coupling of an adaptive anchor with a per-layer geometry step.",
       status="implemented", issue=5),
    _T("AVSD", "avsd", "Self-distillation loss + LightningModule",
       "On-policy self-distillation from several privileged teacher views, gated per token.",
       status="implemented", issue=19),
    _T("ASAP", "asap", "Federated-learning simulation + attack",
       "Model-poisoning attack steered by sliding-mode control; a robustness test for aggregators.",
       status="implemented", issue=20),
    _T("AOT-POT", "aot_pot", "nn.Module (multi-stream residual) + operator model",
       "Input-dependent multi-stream residual mixing for multi-PDE operator transformers.",
       status="implemented", issue=17),
    _T("ANCRe", "ancre", "nn.Module + Callback",
       "Learned residual connectivity over earlier layer states, identity at initialisation.",
       status="implemented", issue=6),
    _T("AMPS", "amps", "Steering hooks + nn.Module",
       "Per-instance strength for modality-preference steering of multimodal models.",
       status="implemented", issue=21),
    _T("AMARIS", "amaris", "Model-merging function",
       "Merge a specialist into its base only along ranked activation subspaces.",
       status="implemented", issue=22),
    _T("AHPA", "ahpa", "Alignment loss + DiT LightningModule",
       "Timestep-routed alignment of DiT features to multi-level VAE encoder features.",
       status="implemented", issue=18),
    _T("AEM", "aem", "On-policy RL LightningModule + advantage function",
       "Response-level entropy modulation of advantages for agentic RL credit assignment.",
       status="implemented", issue=7),
    _T("ADKV", "adkv", "KV cache + Triton kernels",
       "KV quantization with EMA-tracked per-channel statistics and delta-coded metadata.",
       status="implemented", issue=15),
    _T("ABC-Align", "abc_align", "Preference-alignment loss (RLHF/DPO)",
       "Pseudo-labelled preferences with an adaptive bias correction from a small human set.",
       status="implemented", issue=23),
    _T("AIQL / A²IQL", "aiql", "Offline RL LightningModule",
       "Set-scoring implicit Q-learning with a conservative cross-domain adaptation step.",
       status="implemented", issue=24),
    _T("Reliability layer", "reliability", "Inference-time operators + router",
       "Retry, voting and critique as channel-coding operators, with a cost-aware router.",
       status="implemented", issue=25),
    _T("aNCA", "anca", "nn.Module (NCA cell) + LightningModule",
       "Neural cellular automaton with deformable perception for grid reasoning tasks.",
       status="implemented", issue=26),
)  # fmt: skip
"""All seventeen techniques, in the order of the abstracts."""

_BY_SLUG = {t.slug: t for t in TECHNIQUES}


def by_slug(slug: str) -> Technique:
    """Return the technique with this slug.

    Raises:
        KeyError: if no technique has this slug; the message lists the known slugs.
    """
    try:
        return _BY_SLUG[slug]
    except KeyError:
        raise KeyError(f"unknown technique {slug!r}; known: {', '.join(_BY_SLUG)}") from None
