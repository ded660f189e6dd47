"""The version of ddpkit (read by pyproject.toml too)."""

__version__ = "0.1.0"
