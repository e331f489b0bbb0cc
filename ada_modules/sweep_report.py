"""Reports of ``ada sweep``: mean ± std per variant, a markdown table and one chart per metric.

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
    from matplotlib.figure import Figure

    from ada_modules.sweep import Metric, RunRecord

__all__ = [
    "Summary",
    "file_name",
    "format_runs_table",
    "format_table",
    "metric_figure",
    "plot_metrics",
    "summarize",
    "y_range",
]


@dataclass(frozen=True)
class Summary:
    """A metric of one variant over its successful seeds.

    Attributes:
        mean: Mean of the finite values, or ``None`` when there are none.
        std: Sample standard deviation (``None`` with fewer than two values).
        n: Number of finite values.
        not_finite: Number of runs whose value is NaN or infinite (e.g. a diverged training run):
            left out of ``mean`` and ``std``, and said by :meth:`text`.
    """

    mean: float | None
    std: float | None
    n: int
    not_finite: int = 0

    def text(self) -> str:
        """``mean ± std``, the mean alone for one value, ``–`` for none; then how many runs had a
        value that is not finite, if any (``1.34 ± 0.01 (4 not finite)``)."""
        if self.mean is None:
            text = "–"
        elif self.std is None:
            text = _number(self.mean)
        else:
            text = f"{_number(self.mean)} ± {_number(self.std)}"
        return f"{text} ({self.not_finite} not finite)" if self.not_finite else text


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
    """Mean and std of each metric per variant, over the successful runs' finite values.

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
            # A run's metrics file writes NaN and infinity as null: a logged name with no
            # number is a value that was not finite.
            logged = [r.metrics[metric.name] for r in ok if metric.name in r.metrics]
            finite = [float(v) for v in logged if v is not None and math.isfinite(v)]
            mean = statistics.fmean(finite) if finite else None
            std = statistics.stdev(finite) if len(finite) > 1 else None
            table[variant][metric.name] = Summary(mean, std, len(finite), len(logged) - len(finite))
    return table


def format_table(
    records: Sequence[RunRecord], metrics: Sequence[Metric], order: Sequence[str] = ()
) -> str:
    """A markdown table: one row per variant, ``mean ± std`` per metric, the best mean in bold.

    The ``runs ok`` column counts successful runs of all runs of the variant; a header arrow
    says whether higher (↑) or lower (↓) is better. Equal best means are all bold. A cell whose
    runs include NaN or infinite values (a diverged run completes as ``ok``) says how many, and
    is bold only if every variant has such runs: its mean is over the runs that survived.

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


def format_runs_table(records: Sequence[RunRecord], metrics: Sequence[Metric]) -> str:
    """A markdown table of every run: variant, seed, status and each metric's value (``–`` where
    none was logged, ``not finite`` for NaN/inf), so that no seed hides in a mean.

    Example::

        >>> from ada_modules.sweep import Metric, RunRecord
        >>> rec = lambda v, s, x: RunRecord(v, s, "ok", {"acc": x}, {}, [], [], None, "", "")
        >>> print(format_runs_table([rec("a", 0, 1.0), rec("a", 1, None)], [Metric("acc")]))
        | variant | seed | status | acc |
        |---|---|---|---|
        | a | 0 | ok | 1 |
        | a | 1 | ok | not finite |
    """
    header = ["variant", "seed", "status", *(m.name for m in metrics)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in records:
        cells = [record.variant, str(record.seed), record.status]
        for metric in metrics:
            if metric.name not in record.metrics:
                cells.append("–")
                continue
            value = record.metrics[metric.name]
            finite = value is not None and math.isfinite(value)
            cells.append(_number(float(value)) if finite else "not finite")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_metrics(
    records: Sequence[RunRecord],
    metrics: Sequence[Metric],
    out: str | Path,
    order: Sequence[str] = (),
) -> list[Path]:
    """Write ``out/<metric>.png`` per metric: a point per variant (mean) with a std error bar.

    The best variant is highlighted and every point is labelled with its mean. The y axis fits the
    data (means ± std) with a small margin (see :func:`y_range`) rather than starting at 0, so that
    0.93 and 0.95 are told apart; points, unlike bars, do not suggest a length measured from 0.
    A metric without any value gets no chart, and a ``<metric>.png`` left in ``out`` by an earlier
    sweep is removed, so the files there are exactly those returned. Uses matplotlib's Agg canvas
    directly, so it needs no display and leaves pyplot's state alone.

    Returns:
        The files written.

    Example::

        paths = plot_metrics(records, [Metric("test/exact_match")], "sweeps/quickstart")
    """
    out = Path(out)
    summaries = summarize(records, metrics, order)
    written = []
    for metric in metrics:
        path = out / f"{file_name(metric.name)}.png"
        figure = metric_figure(summaries, metric)
        if figure is None:
            path.unlink(missing_ok=True)  # a chart of an earlier sweep would look like this one's
            continue
        figure.savefig(path, dpi=120)
        written.append(path)
    return written


def metric_figure(summaries: dict[str, dict[str, Summary]], metric: Metric) -> Figure | None:
    """The chart :func:`plot_metrics` writes for one metric, or ``None`` if it has no value.

    Args:
        summaries: The output of :func:`summarize`.
        metric: The metric to chart.

    Example::

        >>> from ada_modules.sweep import Metric, RunRecord
        >>> rec = lambda v, x: RunRecord(v, 0, "ok", {"acc": x}, {}, [], [], None, "", "")
        >>> table = summarize([rec("a", 0.93), rec("b", 0.95)], [Metric("acc")])
        >>> low, high = metric_figure(table, Metric("acc")).axes[0].get_ylim()
        >>> print(f"{low:.3f} to {high:.3f}")  # not 0 to 1
        0.928 to 0.952
    """
    from matplotlib.figure import Figure

    rows = [(v, s[metric.name]) for v, s in summaries.items() if s[metric.name].mean is not None]
    if not rows:
        return None
    best = _best(summaries, metric)
    names = [v for v, _ in rows]
    means = [s.mean for _, s in rows]
    errors = [s.std or 0.0 for _, s in rows]
    colors = ["tab:orange" if s.mean == best else "tab:blue" for _, s in rows]
    figure = Figure(figsize=(max(4.0, 1.0 + 0.9 * len(rows)), 3.6), layout="constrained")
    axes = figure.add_subplot()
    positions = range(len(rows))
    axes.errorbar(positions, means, yerr=errors, fmt="none", ecolor="0.3", capsize=4, zorder=1)
    axes.scatter(positions, means, c=colors, s=40, zorder=2)
    for x, (_, summary) in zip(positions, rows, strict=True):
        diverged = f" ({summary.not_finite} not finite)" if summary.not_finite else ""
        axes.annotate(
            _number(summary.mean) + diverged,
            (x, summary.mean),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    axes.set_xlim(-0.5, len(rows) - 0.5)
    axes.set_ylim(*y_range(means, errors))
    axes.grid(axis="y", alpha=0.3)
    long = max(len(n) for n in names) > 10
    axes.set_xticks(positions, names, rotation=30 if long else 0, ha="right" if long else "center")
    axes.set_ylabel(metric.name)
    better = "higher" if metric.mode == "max" else "lower"
    axes.set_title(f"{metric.name}\n{better} is better; mean ± std over seeds", fontsize=10)
    return figure


def y_range(
    means: Sequence[float], errors: Sequence[float], margin: float = 0.1
) -> tuple[float, float]:
    """The y limits of a chart: the lowest ``mean - error`` to the highest ``mean + error``,
    widened by ``margin`` times that span on each side.

    The axis is not stretched down to 0 (it would flatten 0.93 vs 0.95), except that it does not
    dip below 0 for data that is all non-negative. Equal values without spread get a range of
    ±5 % of their size (±0.5 around 0).

    Example::

        >>> y_range([0.93, 0.95], [0.0, 0.0])
        (0.928, 0.952)
        >>> y_range([0.01, 0.02], [0.01, 0.01])  # not below 0 for non-negative data
        (0.0, 0.033)
        >>> y_range([2.0], [0.0])
        (1.9, 2.1)
    """
    low = min(m - e for m, e in zip(means, errors, strict=True))
    high = max(m + e for m, e in zip(means, errors, strict=True))
    pad = margin * (high - low)
    if pad <= 0:
        pad = 0.05 * max(abs(low), abs(high)) or 0.5
    bottom = low - pad
    if low >= 0 > bottom:
        bottom = 0.0
    return round(bottom, 12), round(high + pad, 12)


def _best(summaries: dict[str, dict[str, Summary]], metric: Metric) -> float | None:
    """The best mean; a variant with non-finite runs counts only if every variant has some."""
    cells = [row[metric.name] for row in summaries.values() if row[metric.name].mean is not None]
    means = [c.mean for c in cells if not c.not_finite] or [c.mean for c in cells]
    if not means:
        return None
    return max(means) if metric.mode == "max" else min(means)


def _number(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
