"""The runtime layer: run modes, the interpreter clock, host-side comms, loopback worlds,
symmetric workspaces, kernel launch, input checks and rank processes (DESIGN §11)."""
