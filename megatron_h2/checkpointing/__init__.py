"""Checkpoint format (safetensors + JSON + checksums), save-directory housekeeping, saving
and restoring the whole training state under any layout (:mod:`.checkpoint_io`), and
conversion to and from other formats (:mod:`.hf`).

Public API: :func:`save_checkpoint` / :func:`load_checkpoint` (full tensors by global name, no
process group needed), :func:`open_checkpoint`, :func:`find_latest_iteration`, and the Hugging
Face conversions :func:`convert_hf_to_megatron` / :func:`convert_megatron_to_hf`.
"""

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
from megatron_h2.checkpointing.hf import convert_hf_to_megatron, convert_megatron_to_hf

__all__ = ["convert_hf_to_megatron", "convert_megatron_to_hf",
           "Checkpoint", "CheckpointReader", "begin_save", "commit_save", "corruption_message",
           "find_intact_before", "find_latest_iteration", "incomplete_dir", "iteration_dir",
           "load_checkpoint", "open_checkpoint", "read_checkpoint_files", "read_metadata",
           "save_checkpoint", "saved_iterations", "write_part"]
