"""The evaluation pool on Ray: device actors (one per GPU), compile actors, and `EvalPool`, the
client that the env, the runner and a trainer's rollout workers use where they would use an
`Evaluator`. Needs Ray: ``pip install 'cudagym[ray]'``. See `cudagym.pool.client` for the design.

Nothing below this package imports it: the env and the runner reach it only through
``cudagym run --backend ray`` (`cudagym.agent.runner.make_evaluator`) or an injected client.
"""

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("cudagym.pool needs Ray: pip install 'cudagym[ray]'") from e

from cudagym.pool.client import EvalPool, PoolConfig, PoolError
from cudagym.pool.snapshot import WorkspaceSnapshot

__all__ = ["EvalPool", "PoolConfig", "PoolError", "WorkspaceSnapshot"]
