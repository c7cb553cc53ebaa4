"""cudagym.env: the Gymnasium ReAct environment, its tools and action parsing.

Importing this package registers ``cudagym/Kernel-v0`` with Gymnasium::

    import gymnasium, cudagym.env
    env = gymnasium.make("cudagym/Kernel-v0", tasks="bundled", target="cpu")
"""

import gymnasium

from cudagym.env.kernel_env import EnvConfig, KernelEnv, ShapingConfig, UnicodeText
from cudagym.env.parsing import ParsedAction, parse_action, parse_text
from cudagym.env.tokens import CharEstimate, TokenCounter, TokenizerCounter
from cudagym.env.tools import TOOLS, ToolCall, ToolContext, Toolbox, ToolResult

ENV_ID = "cudagym/Kernel-v0"

if ENV_ID not in gymnasium.registry:
    # nondeterministic: timings (and so rewards) vary between runs of the same actions
    gymnasium.register(id=ENV_ID, entry_point="cudagym.env.kernel_env:KernelEnv", nondeterministic=True,
                       disable_env_checker=False, order_enforce=True)

__all__ = [
    "ENV_ID", "CharEstimate", "EnvConfig", "KernelEnv", "ParsedAction", "ShapingConfig", "TOOLS", "TokenCounter",
    "TokenizerCounter", "ToolCall", "ToolContext", "ToolResult", "Toolbox", "UnicodeText", "parse_action", "parse_text",
]
