"""The command's exit statuses, and the error it explains itself."""

from __future__ import annotations

OK, DAMAGED, USAGE, NOT_FOUND, FAILED, INTERRUPTED = 0, 1, 2, 3, 4, 130

EXIT_CODES = (
    "\b\n"
    "Exit status:\n"
    f"  {OK}    success (verify: the checkpoint is sound; diff: the two are equal)\n"
    f"  {DAMAGED}    the checkpoint is damaged (verify found problems, or a read found "
    "corruption); diff: they differ\n"
    f"  {USAGE}    bad usage or input (an unknown option, a bad value, a path milepost does not "
    "read)\n"
    f"  {NOT_FOUND}    nothing there (no checkpoint at the path, no training root)\n"
    f"  {FAILED}    any other error (storage, permissions, a host that failed)\n"
    f"  {INTERRUPTED}  interrupted (Ctrl-C)\n"
)


class CliError(Exception):
    """An error the command explains itself: ``message`` names the problem and the fix."""

    def __init__(self, message: str, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code
