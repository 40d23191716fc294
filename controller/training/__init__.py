"""milepost.training: a Checkpointer for a sequence of training steps."""

from milepost.training._checkpointer import (
    BackgroundSaveError,
    Checkpointer,
    StepExistsError,
    StepNotFoundError,
)
from milepost.training._policies import (
    AnyOf,
    Continuous,
    FixedInterval,
    InitialStep,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    KeepUnion,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    SpecificSteps,
    StepInfo,
)

__all__ = [
    "AnyOf",
    "BackgroundSaveError",
    "Checkpointer",
    "Continuous",
    "FixedInterval",
    "InitialStep",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepUnion",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
    "SpecificSteps",
    "StepExistsError",
    "StepInfo",
    "StepNotFoundError",
]
