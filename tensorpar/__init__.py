"""tensorpar: tensor parallelism for PyTorch models."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version (tests/cli/test_cli_errors.py checks)
