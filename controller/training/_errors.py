"""The errors a Checkpointer raises (each subclasses the builtin a caller would catch)."""

from __future__ import annotations

from typing import Any


class StepExistsError(FileExistsError):
    """A committed checkpoint of this step exists already, or a save of it is in flight."""


class StepNotFoundError(FileNotFoundError):
    """No committed checkpoint of this step (or none at all)."""


class StepBusyError(RuntimeError):
    """The step is being saved or loaded right now, so it cannot be deleted."""


class BackgroundSaveError(RuntimeError):
    """A save that ran in the background failed; ``step`` says which, ``__cause__`` why."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(
            f"the background save of step {step} failed: {type(cause).__name__}: {cause}. "
            "Nothing of that step was committed; earlier steps are intact. Save again to retry."
        )
        self.step = step
        self.__cause__ = cause


class MirrorError(BackgroundSaveError):
    """The mirror of a step from the local tier to the root failed or timed out; the step is
    kept in the local tier, and the next Checkpointer on these folders mirrors it again."""

    def __init__(self, step: int, local: Any, root: Any, cause: BaseException) -> None:
        RuntimeError.__init__(
            self,
            f"mirroring step {step} from {local} to {root} failed: {type(cause).__name__}: "
            f"{cause}. The step is kept in {local} (retention will not delete it); open a "
            "Checkpointer on these folders again to retry the mirror.",
        )
        self.step = step
        """The step whose mirror failed."""
        self.local = local
        """The local folder that keeps the step."""
        self.root = root
        """The root the step was being mirrored to."""
        self.__cause__ = cause


class StepNamingError(ValueError):
    """The step folders of ``root`` do not say one thing: two folders hold one step, or a
    writing Checkpointer must choose among several namings (``names``: examples of each)."""

    def __init__(self, root: Any, names: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.root = root
        self.names = names

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.root, self.names, str(self))


class NotATrainingRootError(ValueError):
    """``path`` is one checkpoint, not a root of step folders (list_steps, ``milepost ls``)."""

    def __init__(self, path: Any) -> None:
        super().__init__(
            f"{path} is a checkpoint, not a root of steps: read it with milepost.metadata or "
            "milepost.load (the command: milepost inspect), or list the root that holds it"
        )
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path,)
