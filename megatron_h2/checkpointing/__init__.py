"""Checkpoint format (safetensors + JSON + checksums), save-directory housekeeping, and
conversion to and from other formats."""

from megatron_h2.checkpointing.format import (
    Checkpoint,
    CheckpointReader,
    begin_save,
    commit_save,
    corruption_message,
    find_intact_before,
    find_latest_iteration,
    incomplete_dir,
    iteration_dir,
    load_checkpoint,
    open_checkpoint,
    read_checkpoint_files,
    read_metadata,
    save_checkpoint,
    saved_iterations,
    write_part,
)

__all__ = ["Checkpoint", "CheckpointReader", "begin_save", "commit_save", "corruption_message",
           "find_intact_before", "find_latest_iteration", "incomplete_dir", "iteration_dir",
           "load_checkpoint", "open_checkpoint", "read_checkpoint_files", "read_metadata",
           "save_checkpoint", "saved_iterations", "write_part"]
