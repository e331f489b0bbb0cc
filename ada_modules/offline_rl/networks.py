"""Networks of AIQL: a per-candidate scoring actor and critics on aggregate or per-candidate inputs.

The actor scores each of a variable number of candidates from its own features and a DeepSets
context of the whole pool (a masked mean of embedded candidates), so its scores are
permutation-equivariant and its cost is linear in the pool size. AIQL's critic never sees single
candidates: it reads fixed-width aggregate statistics of the state and of the chosen subset. The
per-candidate critic of plain IQL scores each chosen candidate and sums.

Example:
    >>> import torch
    >>> actor = CandidateScorer(candidate_dim=9, state_dim=24, hidden=16)
    >>> candidates, mask = torch.randn(2, 30, 9), torch.ones(2, 30, dtype=torch.bool)
    >>> actor(candidates, mask, torch.randn(2, 24)).shape
    torch.Size([2, 30])
"""

import torch
from torch import Tensor, nn

__all__ = ["AggregateCritic", "CandidateScorer", "PerCandidateCritic", "ValueNetwork"]


def _mlp(width_in: int, hidden: int, width_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(width_in, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
        nn.Linear(hidden, width_out),
    )  # fmt: skip


class CandidateScorer(nn.Module):
    """Per-candidate scores ``f(x_i, mean_j g(x_j), s)`` for a padded pool.

    Args:
        candidate_dim: Features per candidate.
        state_dim: Width of the aggregate state statistics.
        hidden: Hidden width.
    """

    def __init__(self, candidate_dim: int, state_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Sequential(
            nn.Linear(candidate_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU()
        )
        self.context = nn.Sequential(nn.Linear(hidden + state_dim, hidden), nn.SiLU())
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, candidates: Tensor, mask: Tensor, state: Tensor) -> Tensor:
        """Scores ``[B, N]`` (padded slots get a score too; mask them before use)."""
        embedded = self.embed(candidates)
        weights = mask.to(embedded.dtype)[..., None]
        pooled = (embedded * weights).sum(1) / weights.sum(1).clamp(min=1)
        context = self.context(torch.cat([pooled, state], dim=-1))
        joint = torch.cat([embedded, context[:, None].expand_as(embedded)], dim=-1)
        return self.head(joint).squeeze(-1)


class AggregateCritic(nn.Module):
    """Twin ``Q(φ(S), ψ(a))`` on aggregate state and chosen-subset statistics (AIQL's critic).

    Args:
        state_dim: Width of the state statistics.
        action_dim: Width of the chosen-subset statistics.
        hidden: Hidden width.
    """

    def __init__(self, state_dim: int, action_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.q1 = _mlp(state_dim + action_dim, hidden, 1)
        self.q2 = _mlp(state_dim + action_dim, hidden, 1)

    def forward(self, state: Tensor, action: Tensor) -> tuple[Tensor, Tensor]:
        """Both Q estimates ``[B]``."""
        joint = torch.cat([state, action], dim=-1)
        return self.q1(joint).squeeze(-1), self.q2(joint).squeeze(-1)


class PerCandidateCritic(nn.Module):
    """Twin ``Q(S, a) = Σ_{i ∈ a} q(x_i, φ(S))``: plain IQL's critic for a chosen subset.

    Args:
        candidate_dim: Features per candidate.
        state_dim: Width of the state statistics.
        hidden: Hidden width.
    """

    def __init__(self, candidate_dim: int, state_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.q1 = _mlp(candidate_dim + state_dim, hidden, 1)
        self.q2 = _mlp(candidate_dim + state_dim, hidden, 1)

    def forward(self, state: Tensor, candidates: Tensor, chosen: Tensor) -> tuple[Tensor, Tensor]:
        """Both Q estimates ``[B]`` for the subsets ``chosen`` ``[B, K]``."""
        picks = candidates.gather(1, chosen[..., None].expand(-1, -1, candidates.shape[-1]))
        joint = torch.cat([picks, state[:, None].expand(-1, picks.shape[1], -1)], dim=-1)
        return self.q1(joint).sum((1, 2)), self.q2(joint).sum((1, 2))


class ValueNetwork(nn.Module):
    """``V(φ(S))`` on aggregate state statistics.

    Args:
        state_dim: Width of the state statistics.
        hidden: Hidden width.
    """

    def __init__(self, state_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = _mlp(state_dim, hidden, 1)

    def forward(self, state: Tensor) -> Tensor:
        """``V`` ``[B]``."""
        return self.net(state).squeeze(-1)
