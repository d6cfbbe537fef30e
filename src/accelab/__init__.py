"""accelab: make Hugging Face / PyTorch models measurably faster, and prove it."""

__version__ = "0.1.0"
