"""The tools: the command-line interface, demo, doctor, bench and tune (DESIGN §11)."""
