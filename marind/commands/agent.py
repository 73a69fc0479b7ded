"""`marind agent` commands (not implemented yet)."""


def register(sub) -> None:
    pass
