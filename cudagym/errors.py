"""The library's exception hierarchy.

Inside the library failures are these named exceptions; at the environment boundary they become
error observations. An agent never sees a traceback of the harness itself, only of its own code.
"""


class CudagymError(Exception):
    """Base of every error cudagym raises on purpose."""


class TaskError(CudagymError):
    """A task is malformed: bad syntax, a missing `Model`/`get_inputs`, a model that fails to build."""


class WorkspaceError(CudagymError):
    """A workspace operation was refused: path outside the workspace, read-only file, oversized write."""


class ToolchainError(CudagymError):
    """The compiler could not be run at all (missing binary, bad configuration); not a compile error."""


class SandboxError(CudagymError):
    """The sandbox itself failed (could not start a worker, broken protocol); not the candidate's fault."""


class ConfigError(CudagymError):
    """Invalid configuration or command-line input."""
