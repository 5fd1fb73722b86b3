"""tensorpar: tensor parallelism for PyTorch models."""
