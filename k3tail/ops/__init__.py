"""The ops layer: one file per op, holding its launcher and its validation (DESIGN §11)."""
