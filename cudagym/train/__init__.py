"""cudagym.train: trainer integration (verl agent loop, train/val parquet, stage configs).

Above `env` and `agent`; nothing below imports it. verl is imported only by `verl_loop`,
`launch` and what calls them, so `cudagym train prepare` works without verl installed.
"""

AGENT_NAME = "cudagym_kernel"  # the verl agent loop's registered name, written in every prepared row
