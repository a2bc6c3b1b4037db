"""`k3tail bench` (placeholder until its issue lands)."""


def add_arguments(parser):
    pass


def main(args) -> int:
    raise SystemExit("k3tail bench: not implemented yet")
