"""`k3tail doctor` (placeholder until its issue lands)."""


def add_arguments(parser):
    pass


def main(args) -> int:
    raise SystemExit("k3tail doctor: not implemented yet")
