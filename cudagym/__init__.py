"""cudagym: an agentic environment for tool-using RL on GPU kernel optimization."""

__version__ = "0.1.0"
