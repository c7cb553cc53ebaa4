"""`python -m cudagym` runs the `cudagym` command."""

from cudagym.cli import main

main()
