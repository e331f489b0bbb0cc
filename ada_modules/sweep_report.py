"""Reports of ``ada sweep``: mean ± std per variant, a markdown table and bar charts.

These functions are pure (records in, text or image files out), so a sweep's results can be
re-tabulated from ``results.json`` without running anything.

Example:
    Re-draw the report of a finished sweep::

        import json
        from ada_modules.sweep import Metric, RunRecord
        from ada_modules.sweep_report import format_table

        data = json.load(open("sweeps/quickstart/results.json"))
        records = [RunRecord(**r) for r in data["runs"]]
        print(format_table(records, [Metric(**m) for m in data["metrics"]]))
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ada_modules.sweep import Metric, RunRecord

__all__ = ["Summary", "file_name", "format_table", "plot_metrics", "summarize"]


@dataclass(frozen=True)
class Summary:
    """A metric of one variant over its successful seeds.

    Attributes:
        mean: Mean of the finite values, or ``None`` when there are none.
        std: Sample standard deviation (``None`` with fewer than two values).
        n: Number of finite values.
    """

    mean: float | None
    std: float | None
    n: int

    def text(self) -> str:
        """``mean ± std``, the mean alone for one value, ``–`` for none."""
        if self.mean is None:
            return "–"
        if self.std is None:
            return _number(self.mean)
        return f"{_number(self.mean)} ± {_number(self.std)}"


def file_name(name: str) -> str:
    """A file-name-safe version of a metric or variant name (``test/acc`` -> ``test_acc``).

    Example::

        >>> file_name("test/exact_match")
        'test_exact_match'
    """
    return re.sub(r"[^\w.,=+-]+", "_", name).strip(".") or "_"


def summarize(
    records: Sequence[RunRecord], metrics: Sequence[Metric], order: Sequence[str] = ()
) -> dict[str, dict[str, Summary]]:
    """Mean and std of each metric per variant, over the successful runs.

    Args:
        records: Run records (failed ones are ignored).
        metrics: Metrics to summarize.
        order: Variant names to list first, in this order; others follow as they appear.

    Returns:
        ``{variant: {metric name: Summary}}`` in variant order.

    Example::

        >>> from ada_modules.sweep import Metric, RunRecord
        >>> rec = lambda v, x: RunRecord(v, 0, "ok", {"acc": x}, {}, [], [], None, "", "")
        >>> summarize([rec("a", 1.0), rec("a", 3.0)], [Metric("acc")])["a"]["acc"].mean
        2.0
    """
    variants = list(dict.fromkeys([*order, *(r.variant for r in records)]))
    table = {}
    for variant in variants:
        ok = [r for r in records if r.variant == variant and r.status == "ok"]
        table[variant] = {}
        for metric in metrics:
            values = [r.metrics.get(metric.name) for r in ok]
            finite = [float(v) for v in values if v is not None and math.isfinite(v)]
            mean = statistics.fmean(finite) if finite else None
            std = statistics.stdev(finite) if len(finite) > 1 else None
            table[variant][metric.name] = Summary(mean, std, len(finite))
    return table


def format_table(
    records: Sequence[RunRecord], metrics: Sequence[Metric], order: Sequence[str] = ()
) -> str:
    """A markdown table: one row per variant, ``mean ± std`` per metric, the best mean in bold.

    The ``runs ok`` column counts successful runs of all runs of the variant; a header arrow
    says whether higher (↑) or lower (↓) is better. Equal best means are all bold.

    Example::

        >>> from ada_modules.sweep import Metric, RunRecord
        >>> rec = lambda v, x: RunRecord(v, 0, "ok", {"acc": x}, {}, [], [], None, "", "")
        >>> print(format_table([rec("a", 1.0), rec("b", 2.0)], [Metric("acc")]))
        | variant | runs ok | acc ↑ |
        |---|---|---|
        | a | 1/1 | 1 |
        | b | 1/1 | **2** |
    """
    summaries = summarize(records, metrics, order)
    header = [
        "variant",
        "runs ok",
        *(f"{m.name} {'↑' if m.mode == 'max' else '↓'}" for m in metrics),
    ]
    best = {m.name: _best(summaries, m) for m in metrics}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant, row in summaries.items():
        runs = [r for r in records if r.variant == variant]
        ok = sum(r.status == "ok" for r in runs)
        cells = [variant, f"{ok}/{len(runs)}"]
        for metric in metrics:
            summary = row[metric.name]
            text = summary.text()
            cells.append(
                f"**{text}**"
                if summary.mean is not None and summary.mean == best[metric.name]
                else text
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_metrics(
    records: Sequence[RunRecord],
    metrics: Sequence[Metric],
    out: str | Path,
    order: Sequence[str] = (),
) -> list[Path]:
    """Write ``out/<metric>.png`` per metric: a bar per variant (mean, std error bar).

    The best variant's bar is highlighted. Metrics without any value are skipped. Uses
    matplotlib's Agg canvas directly, so it needs no display and leaves pyplot's state alone.

    Returns:
        The files written.

    Example::

        paths = plot_metrics(records, [Metric("test/exact_match")], "sweeps/quickstart")
    """
    from matplotlib.figure import Figure

    out = Path(out)
    summaries = summarize(records, metrics, order)
    written = []
    for metric in metrics:
        rows = [
            (v, s[metric.name]) for v, s in summaries.items() if s[metric.name].mean is not None
        ]
        if not rows:
            continue
        best = _best(summaries, metric)
        names = [v for v, _ in rows]
        means = [s.mean for _, s in rows]
        errors = [s.std or 0.0 for _, s in rows]
        colors = ["tab:orange" if s.mean == best else "tab:blue" for _, s in rows]
        figure = Figure(figsize=(max(4.0, 1.0 + 0.9 * len(rows)), 3.6), layout="constrained")
        axes = figure.add_subplot()
        axes.bar(range(len(rows)), means, yerr=errors, capsize=4, color=colors)
        long = max(len(n) for n in names) > 10
        axes.set_xticks(
            range(len(rows)), names, rotation=30 if long else 0, ha="right" if long else "center"
        )
        axes.set_ylabel(metric.name)
        better = "higher" if metric.mode == "max" else "lower"
        axes.set_title(f"{metric.name} ({better} is better; mean ± std over seeds)", fontsize=10)
        path = out / f"{file_name(metric.name)}.png"
        figure.savefig(path, dpi=120)
        written.append(path)
    return written


def _best(summaries: dict[str, dict[str, Summary]], metric: Metric) -> float | None:
    means = [row[metric.name].mean for row in summaries.values()]
    means = [m for m in means if m is not None]
    if not means:
        return None
    return max(means) if metric.mode == "max" else min(means)


def _number(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
