"""brrr: serve, shrink, train and measure large language models."""
__version__ = "0.1.0"
