"""The shared vocabulary of every floor: what an evaluation step returns (`verdict`) and the rule
that decides which ops and kernels a candidate's own code may run (`audit`). Nothing here imports
the rest of cudagym."""
