"""Training: command line, loop, optimizer, checkpoints of the training state."""
