"""accelab's version, in a module of its own: the store and the fingerprints read it without
importing the package's front door (`accelab/__init__.py` imports the Python API)."""

__version__ = "0.1.0"
