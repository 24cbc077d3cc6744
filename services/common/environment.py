"""The environment variables behind option defaults and cache folders, read in one place.

PARKADE_HOME            where Parkade keeps its state and caches (default ~/.cache/parkade);
                        the front end's `parkade.home` reads the same variable
PARKADE_ENFORCE_EAGER   1: run models eagerly unless told otherwise (the test suite sets it:
                        compiling takes seconds per engine)
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["enforce_eager_default", "parkade_home", "use_inductor_cache_dir"]


def parkade_home() -> Path:
    return Path(os.environ.get("PARKADE_HOME") or "~/.cache/parkade").expanduser()


def enforce_eager_default() -> bool:
    """`enforce_eager`'s default: $PARKADE_ENFORCE_EAGER (1, true or yes), else False."""
    return os.environ.get("PARKADE_ENFORCE_EAGER", "").lower() in ("1", "true", "yes")


def use_inductor_cache_dir(folder: Path) -> None:
    """Point inductor's caches at `folder`, unless TORCHINDUCTOR_CACHE_DIR was chosen.

    NOTE: importing torch._dynamo already set the variable to inductor's default (/tmp/...), so
    that value counts as unset; inductor reads the variable again at each use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
