"""`marind doctor` commands (not implemented yet)."""


def register(sub) -> None:
    pass
