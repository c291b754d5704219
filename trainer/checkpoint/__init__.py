"""Checkpointing: DCP save/resume with atomic publish and retention (manager), the states it
saves (state), per-file checksums (manifest), the per-host local tier (local), and initial
weights from DCP or HF (initial)."""

from trainer.checkpoint.initial import (
    HF_CONFIG_MISMATCH,
    INITIAL_LOAD_FORMATS,
    SAFETENSORS_DTYPE_NAMES,
    SafetensorsSlices,
    check_hf_config,
    hf_config_differences,
    load_initial,
    local_box,
    read_box_of,
    safetensors_files,
    safetensors_header,
)
from trainer.checkpoint.local import LocalTier, plan_restore, slice_layout
from trainer.checkpoint.manager import CheckpointManager, CheckpointSaveError, check_entries, complete_steps
from trainer.checkpoint.manifest import (
    BLOCK_BYTES,
    MANIFEST,
    CorruptCheckpointError,
    crc32_blocks,
    hash_threads,
    verify_checkpoint,
    write_manifest,
)
from trainer.checkpoint.state import (
    ASYNC_MODES,
    CHECKPOINT_KEYS,
    ModelState,
    OptimizerState,
    TrainState,
    all_finite,
    run_states,
    short_error,
)

__all__ = [
    "ASYNC_MODES",
    "BLOCK_BYTES",
    "CHECKPOINT_KEYS",
    "HF_CONFIG_MISMATCH",
    "INITIAL_LOAD_FORMATS",
    "MANIFEST",
    "SAFETENSORS_DTYPE_NAMES",
    "CheckpointManager",
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "LocalTier",
    "ModelState",
    "OptimizerState",
    "SafetensorsSlices",
    "TrainState",
    "all_finite",
    "check_entries",
    "check_hf_config",
    "complete_steps",
    "crc32_blocks",
    "hash_threads",
    "hf_config_differences",
    "load_initial",
    "local_box",
    "plan_restore",
    "read_box_of",
    "run_states",
    "safetensors_files",
    "safetensors_header",
    "short_error",
    "slice_layout",
    "verify_checkpoint",
    "write_manifest",
]
