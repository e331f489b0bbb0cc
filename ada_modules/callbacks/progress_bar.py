"""A tqdm progress bar that counts towards the run's real budget and leaves out ``v_num``."""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

__all__ = ["BudgetProgressBar"]

# No rate column: with a budget in tokens or a step count that jumps, "it/s" would mislead.
_BUDGET_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"


class BudgetProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting towards the budget that ends the run, without ``v_num``.

    Lightning's bars count batches of the current epoch and title them by epoch, which says
    little when the run is bounded otherwise (``Epoch 0/-2`` in the Rich bar when
    ``max_epochs=-1``). This bar shows, in order of precedence:

    1. the LightningModule's own budget, when it has a ``progress_budget()`` method returning
       ``(done, total, label)`` rather than ``None``: one bar for the whole fit, described as
       ``"{label} {done}/{total}"`` (e.g. ``sampled tokens 3,200/16,000`` for
       :class:`~ada_modules.models.OnPolicyModule`). When the label changes (a warm-up phase
       ends), the finished phase's bar stays on screen, shown complete, and a new one starts;
    2. the step budget of a step-bounded fit (``max_steps`` set, ``max_epochs`` ``None`` or
       ``-1``): one bar over all epochs, described as ``step 120/2,000``, with the time left
       computed over the whole budget;
    3. otherwise Lightning's per-epoch bar (``Epoch 3``).

    The metrics after the bar are those logged with ``prog_bar=True``; the logger's version
    number (``v_num``) is left out.

    Args:
        refresh_rate: Update the bar every this many training batches (``0``: no bar).
        process_position: Lines to offset the bars by (as in ``TQDMProgressBar``).
        leave: Leave each epoch's bar on screen (per-epoch mode only).

    Example::

        from lightning.pytorch import Trainer
        from ada_modules.callbacks import BudgetProgressBar

        trainer = Trainer(max_steps=2000, callbacks=[BudgetProgressBar()])
        # step 120/2,000:   6%|▌         | [00:03<00:50, train/loss=1.230]

    Examples:
        >>> BudgetProgressBar(refresh_rate=10).refresh_rate
        10
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._label: str | None = None  # label of the budget shown; None: per-epoch bar
        self._batches = 0

    # ------------------------------------------------------------------ what to show

    def budget(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> tuple[float, float, str] | None:
        """``(done, total, label)`` of the budget the bar counts towards, ``None``: per epoch."""
        own = getattr(pl_module, "progress_budget", None)
        if callable(own):
            found = own()
            if found is not None:
                done, total, label = found
                if total and total > 0:
                    return done, total, str(label)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            if trainer.max_epochs is None or trainer.max_epochs == -1:
                return trainer.global_step, trainer.max_steps, "step"
        return None

    @staticmethod
    def describe(done: float, total: float, label: str) -> str:
        """The bar's description, e.g. ``"step 120/2,000"``."""

        def number(x: float) -> str:
            return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"

        return f"{label} {number(done)}/{number(total)}"

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """The progress-bar metrics, without the logger's version number ``v_num``."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items

    # ------------------------------------------------------------------ training bar

    def _budget_tqdm(self, done: float, total: float, label: str) -> Tqdm:
        """A training bar for a budget (``init_train_tqdm`` with the budget's format)."""
        return Tqdm(
            desc=self.describe(done, total, label),
            total=total,
            initial=done,  # the time left counts from where this bar starts (resumed fits)
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=_BUDGET_BAR_FORMAT,
        )

    def _show_budget(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """Bring the training bar up to date with the budget; ``False`` when there is none."""
        if self._train_progress_bar is None:
            return False
        budget = self.budget(trainer, pl_module)
        if budget is None:
            if self._label is not None:  # the budget ended mid-fit: a per-epoch bar from here
                self._label = None
                self.train_progress_bar.close()
                bar = self.train_progress_bar = self.init_train_tqdm()
                bar.total = convert_inf(self.total_train_batches)
                bar.set_description(f"Epoch {trainer.current_epoch}", refresh=False)
            return False
        done, total, label = budget
        if label != self._label:  # a new phase: the finished one stays on screen, complete
            old = self.train_progress_bar
            if self._label is not None and not old.disable and old.total:
                old.n = old.total
                old.set_description_str(self.describe(old.total, old.total, self._label))
            old.close()
            self.train_progress_bar = self._budget_tqdm(done, total, label)
            self._label = label
        bar = self.train_progress_bar
        if not bar.disable:
            bar.total = total
            bar.n = min(done, total)  # tqdm drops the total of a bar past its end
            bar.set_description_str(self.describe(done, total, label), refresh=False)
        return True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batches = 0
        self._label = None
        budget = self.budget(trainer, pl_module)
        if budget is None:
            super().on_train_start(trainer, pl_module)
            return
        self.train_progress_bar = self._budget_tqdm(*budget)
        self._label = budget[2]

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._label is not None or self.budget(trainer, pl_module) is not None:
            if self._show_budget(trainer, pl_module) and self.is_enabled:
                self.train_progress_bar.refresh()
            return
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._batches += 1
        if not self._show_budget(trainer, pl_module):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        if self.is_enabled and (self._batches % self.refresh_rate == 0 or bar.n >= bar.total):
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._label is None:
            super().on_train_epoch_end(trainer, pl_module)
        elif not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
