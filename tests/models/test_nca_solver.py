"""The NCA puzzle solvers (aNCA's task modules): scoring, the loss mask, training, bad input."""

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from ada_modules.data import MazeDataModule, SudokuDataModule
from ada_modules.data.sudoku import generate_sudoku, sudoku_tensors
from ada_modules.errors import InputError
from ada_modules.models import MazeNCAModule, SudokuNCAModule

TINY = dict(state_channels=8, hidden_channels=16)


def _trainer(steps: int) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


def test_sudoku_answer_keeps_the_givens_and_is_scored_by_the_constraints():
    rng = np.random.default_rng(0)
    puzzle, solution = generate_sudoku(2, 8, rng)
    inputs, target = sudoku_tensors([puzzle], [solution])
    module = SudokuNCAModule(box=2, steps=2, **TINY)
    # logits that say "digit 1" everywhere: only the blanks take it, the givens stay
    logits = torch.zeros(1, 4, 4, 4)
    logits[:, 0] = 1.0
    answer = module.predict(inputs, logits)
    given = torch.from_numpy(puzzle) > 0
    assert torch.equal(answer[0][given], target[0][given])
    assert torch.all(answer[0][~given] == 0)
    assert not module.solved(answer, inputs, target).item()
    # the reference solution is solved; so is any other valid completion (none here: unique)
    assert module.solved(target, inputs, target).item()
    assert torch.equal(module.loss_mask(inputs)[0].bool(), ~given)


def test_a_maze_counts_only_when_the_whole_path_is_right():
    module = MazeNCAModule(steps=2, **TINY)
    target = torch.zeros(2, 5, 5, dtype=torch.long)
    target[:, 1, 1:4] = 1
    prediction = target.clone()
    prediction[1, 3, 3] = 1  # one extra cell
    inputs = torch.zeros(2, 3, 5, 5)
    assert module.solved(prediction, inputs, target).tolist() == [True, False]
    assert module.loss_mask(inputs) is None


def test_training_lowers_the_loss_on_a_fixed_seed_and_test_logs_the_metrics():
    seed_everything(0)
    data = MazeDataModule(size=7, train_mazes=32, val_mazes=8, test_mazes=16, batch_size=8, seed=0)
    module = MazeNCAModule(steps=6, min_steps=4, eval_steps=6, **TINY)
    data.setup("fit")
    inputs, target = data.datasets["train"].tensors
    with torch.no_grad():
        before = torch.nn.functional.cross_entropy(module(inputs, 6), target[:32])
    trainer = _trainer(30)
    trainer.fit(module, datamodule=data)
    with torch.no_grad():
        after = torch.nn.functional.cross_entropy(module(inputs, 6), target[:32])
    assert after < 0.7 * before
    (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    assert set(metrics) == {"test/exact", "test/cell_acc"}
    assert 0.5 < metrics["test/cell_acc"] <= 1.0


def test_training_draws_the_number_of_steps_from_its_range(monkeypatch):
    module = MazeNCAModule(steps=9, min_steps=4, deformable=False, **TINY)
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)
    seen = []
    forward = module.nca.forward
    monkeypatch.setattr(
        module.nca, "forward", lambda inputs, steps: seen.append(steps) or forward(inputs, steps)
    )
    batch = (torch.zeros(1, 3, 5, 5), torch.zeros(1, 5, 5, dtype=torch.long))
    torch.manual_seed(0)
    for _ in range(40):
        module.training_step(batch, 0)
    assert min(seen) == 4 and max(seen) == 9


def test_eval_steps_set_the_evaluation_rollout():
    module = SudokuNCAModule(box=2, steps=3, eval_steps=7, **TINY)
    seen = []
    forward = module.nca.forward
    module.nca.forward = lambda inputs, steps: seen.append(steps) or forward(inputs, steps)
    module.predict_step((torch.zeros(1, 5, 4, 4),), 0)
    assert seen == [7]


def test_sudoku_module_fits_the_sudoku_data():
    data = SudokuDataModule(
        box=2, givens=(6, 10), train_puzzles=32, val_puzzles=4, test_puzzles=8, seed=0
    )
    module = SudokuNCAModule(box=2, steps=4, **TINY)
    trainer = _trainer(3)
    trainer.fit(module, datamodule=data)
    (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    assert set(metrics) == {"test/exact", "test/cell_acc"}
    assert 0.0 <= metrics["test/exact"] <= 1.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MazeNCAModule(steps=0), "steps must be an integer >= 1, got 0"),
        (lambda: MazeNCAModule(steps=5, min_steps=6), "min_steps must be <= steps=5, got 6"),
        (lambda: MazeNCAModule(eval_steps=1.5), "eval_steps must be an integer >= 1, got 1.5"),
        (lambda: SudokuNCAModule(box=4), "box must be 2 or 3, got 4"),
    ],
)
def test_bad_arguments(make, message):
    with pytest.raises(InputError, match=message):
        make()


def test_inputs_of_the_wrong_task_are_refused():
    module = SudokuNCAModule(box=3, steps=2, **TINY)
    with pytest.raises(InputError, match=r"inputs must have shape \(batch, 10, height, width\)"):
        module(torch.zeros(1, 3, 9, 9))


def test_a_checkpoint_of_the_other_perception_is_refused_by_name():
    anca = MazeNCAModule(steps=2, **TINY)
    plain = MazeNCAModule(steps=2, deformable=False, **TINY)
    checkpoint = {"hyper_parameters": dict(anca.hparams), "state_dict": anca.state_dict()}
    with pytest.raises(InputError, match="trained with deformable=True, this model has deformable"):
        plain.on_load_checkpoint(checkpoint)
    anca.on_load_checkpoint(checkpoint)  # the same perception loads
