"""milepost.training: a Checkpointer for a sequence of training steps in one root directory.

>>> from milepost.training import AnyOf, Checkpointer, FixedInterval, KeepLatest, Preemption
>>> with Checkpointer("/ckpt", save_policy=AnyOf(FixedInterval(interval=100), Preemption()),
...                   keep=KeepLatest(n=3)) as ckpt:
...     ckpt.save(step, state, metrics={"loss": loss})
"""

from milepost.training._checkpointer import Checkpointer
from milepost.training._errors import (
    BackgroundSaveError,
    MirrorError,
    NotATrainingRootError,
    StepBusyError,
    StepExistsError,
    StepNamingError,
    StepNotFoundError,
)
from milepost.training._listing import list_steps
from milepost.training._options import CheckpointerOptions
from milepost.training._policies import (
    AnyOf,
    Continuous,
    FixedInterval,
    InitialStep,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    KeepRecent,
    KeepUnion,
    Preemption,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    SpecificSteps,
    StepInfo,
)
from milepost.training.peers import PeerTier, Recovery
from milepost.workers.peers import PeerRun, UnsafeFolderError, clear_peer_runs, list_peer_runs

__all__ = [
    "AnyOf",
    "BackgroundSaveError",
    "Checkpointer",
    "CheckpointerOptions",
    "Continuous",
    "FixedInterval",
    "InitialStep",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepRecent",
    "KeepUnion",
    "MirrorError",
    "NotATrainingRootError",
    "PeerRun",
    "PeerTier",
    "Preemption",
    "Recovery",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
    "SpecificSteps",
    "StepBusyError",
    "StepExistsError",
    "StepInfo",
    "StepNamingError",
    "StepNotFoundError",
    "UnsafeFolderError",
    "clear_peer_runs",
    "list_peer_runs",
    "list_steps",
]
