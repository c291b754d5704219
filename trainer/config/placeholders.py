"""Values a recipe ships for its user to replace: a pod recipe's checkpoint bucket.

A pod recipe (`[job] target` of a multi-host slice) cannot name a local checkpoint folder: every
host has its own disk, and the shared-storage check refuses it (trainer/runtime/storage.py
`check_shared_folder`). Nor can it name a real bucket. So it names `gs://YOUR_BUCKET/<recipe>/
checkpoints`, which no bucket can be (bucket names are lowercase), and a run that would write
there is refused, by the launcher (trainer/launch.py) and by the trainer (trainer/train.py), with
one line naming the key and the override that fixes it (docs/launch.md):

    --checkpoint.folder=gs://my-bucket/llama3_8b_v6e/checkpoints

The recipe check and the planners never write a checkpoint: they take the recipe as it is
(tools/recipe_check.py checks the folder's form with a stand-in bucket and says so).
"""

from __future__ import annotations

from models.errors import ConfigError

PLACEHOLDER_BUCKET = "YOUR_BUCKET"
"""The bucket name pod recipes ship in `checkpoint.folder` (uppercase: never a real bucket)."""
PLACEHOLDER_PREFIX = f"gs://{PLACEHOLDER_BUCKET}/"


def is_placeholder(path: str) -> bool:
    """Whether `path` is a recipe's placeholder (`gs://YOUR_BUCKET/...`) rather than the user's own."""
    return isinstance(path, str) and (path.startswith(PLACEHOLDER_PREFIX) or path == PLACEHOLDER_PREFIX.rstrip("/"))


def check_checkpoint_folder(ck) -> None:
    """`checkpoint.folder` (`ck`: the CheckpointConfig) before a run that writes checkpoints: a
    ConfigError naming the key while it is still the recipe's placeholder."""
    if not ck.enable or not is_placeholder(ck.folder):
        return
    prefix = ck.folder[len(PLACEHOLDER_PREFIX) :] or "PREFIX"
    raise ConfigError(
        f"checkpoint.folder: {ck.folder} is the recipe's placeholder, not a bucket of yours; allowed: your "
        f"own gs:// folder, e.g. --checkpoint.folder=gs://my-bucket/{prefix} (a bucket every host can write; "
        "docs/launch.md), a shared file system path mounted on every host, or --checkpoint.enable=false"
    )
