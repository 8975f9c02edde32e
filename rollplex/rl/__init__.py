"""The RL step: `RLStep` (step.py) over its trainers (trainer.py: the actor's `PolicyLoss`, the critic's
`ValueModel` + `ValueLoss`, the reference), a runtime (runtime.py: where it runs) and a schedule
(schedule.py: phased or fused). See docs/ARCHITECTURE.md."""

from .actor import Actor, PolicyLoss
from .batch import RolloutBatch
from .config import RLConfig
from .critic import Critic, ValueLoss, ValueModel
from .errors import NonFiniteUpdate, TrainOOM, TrainStepError, TrainStepFailed
from .step import RLStep
from .trainer import Loss, Trainer

__all__ = ["Actor", "Critic", "Loss", "NonFiniteUpdate", "PolicyLoss", "RLConfig", "RLStep", "RolloutBatch",
           "TrainOOM", "TrainStepError", "TrainStepFailed", "Trainer", "ValueLoss", "ValueModel"]
