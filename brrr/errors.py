class BrrrError(Exception):
    """A problem with what the user gave brrr (a file, a config, a request field); the CLI prints it and exits 2."""
