"""`marind ckpt` commands (not implemented yet)."""


def register(sub) -> None:
    pass
