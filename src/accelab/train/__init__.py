"""Training with accelerate: `accelab train` (see commands.py) and its worker (worker.py)."""
