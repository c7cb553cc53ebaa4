"""cudagym.agent: policies, the system prompt, context management, the episode runner and reports."""

from cudagym.agent.context import ContextBudget
from cudagym.agent.episode import EpisodeResult, run_episode
from cudagym.agent.policy import AssistantTurn, CallablePolicy, Policy, PolicyError, TurnContext
from cudagym.agent.prompt import system_prompt
from cudagym.agent.scripted import ScriptedPolicy

__all__ = [
    "AssistantTurn", "CallablePolicy", "ContextBudget", "EpisodeResult", "Policy", "PolicyError", "ScriptedPolicy",
    "TurnContext", "run_episode", "system_prompt",
]
