"""`python -m cudagym.sandbox.worker RESULT_FD [SHM_FD]` (or `--channel DIR`): one sandboxed
worker (`cudagym.sandbox.worker.entry`)."""

from cudagym.sandbox.worker.entry import main

main()
