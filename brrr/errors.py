class BrrrError(ValueError):
    """A problem with what the user gave brrr (a file, a config, a request field). It is a ValueError, so API callers
    can catch it as one; the CLI prints it and exits 2."""
