"""Training with tensor and sequence parallelism: config, model, dropout, loop, checkpoints, export, CLI."""
