"""Checkpoint format (safetensors + JSON) and conversion to and from other formats."""

from megatron_h2.checkpointing.format import (
    Checkpoint,
    CheckpointReader,
    begin_save,
    commit_save,
    find_latest_iteration,
    incomplete_dir,
    iteration_dir,
    load_checkpoint,
    open_checkpoint,
    read_metadata,
    save_checkpoint,
    write_part,
)

__all__ = ["Checkpoint", "CheckpointReader", "begin_save", "commit_save", "find_latest_iteration",
           "incomplete_dir", "iteration_dir", "load_checkpoint", "open_checkpoint",
           "read_metadata", "save_checkpoint", "write_part"]
