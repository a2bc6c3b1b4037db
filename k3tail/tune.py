"""`k3tail tune` (placeholder until its issue lands)."""


def add_arguments(parser):
    pass


def main(args) -> int:
    raise SystemExit("k3tail tune: not implemented yet")
