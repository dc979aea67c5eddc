"""Names loading and saving share: the attribute recording where a model came from, the file that
marks an MHLA checkpoint, what a hub id looks like, and the error for an unreachable hub."""

from __future__ import annotations

import re

SOURCE_ATTR = "mhla_source"  # set on loaded models: {"base_model", "revision", "subfolder"}, saved with them
MHLA_CONFIG = "mhla_config.json"
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def hub_unreachable(repo_id: str, error: Exception) -> OSError:
    return OSError(
        f"could not reach the Hugging Face Hub for {repo_id!r} ({type(error).__name__}: {error}); "
        "pass a local directory instead (a model saved with save_pretrained, or a pipeline folder with transformer/)"
    )
