"""The optional packages a command needs, checked together before it starts, so that one
message names every one that is missing (not one per attempt). Torch-free; nothing is imported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence


def require(what: str, packages: Sequence[str], extra: str) -> None:
    """A ValueError naming every package of `packages` (import name = pip name) that is not
    installed, with the pip line for them and for the moetrain extra that holds them."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if not missing:
        return
    names = " and ".join(f"`{name}`" for name in missing)
    plural = "s" if len(missing) > 1 else ""
    raise ValueError(
        f"{what} needs the optional package{plural} {names}, not installed: "
        f"pip install {' '.join(missing)} (or pip install 'moetrain[{extra}]')"
    )
