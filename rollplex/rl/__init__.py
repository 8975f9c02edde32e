"""The RL step: `RLStep` (step.py) over its trainers (trainer.py: the actor's `PolicyLoss`, the critic's
`ValueModel` + `ValueLoss`, the reference), built and placed by parts.py (`build_parts`), a runtime
(runtime.py: where it runs) and a schedule (schedule.py: phased or fused). See docs/ARCHITECTURE.md."""

from .actor import Actor, PolicyLoss
from .batch import RolloutBatch
from .config import RLConfig
from .critic import Critic, ValueLoss, ValueModel
from .errors import NonFiniteUpdate, TrainOOM, TrainStepError, TrainStepFailed
from .parts import StepParts, build_parts
from .step import RLStep
from .trainer import Loss, Trainer

__all__ = ["Actor", "Critic", "Loss", "NonFiniteUpdate", "PolicyLoss", "RLConfig", "RLStep", "RolloutBatch",
           "StepParts", "TrainOOM", "TrainStepError", "TrainStepFailed", "Trainer", "ValueLoss", "ValueModel",
           "build_parts"]
