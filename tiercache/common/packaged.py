"""A data file that an installed distribution ships, found without importing its package.

The trained model's GGUF and ShareGPT's conversations come in packages from the
registry; their Python code is never needed (one's needs another program's
plugin system), so the file is located through the distribution's metadata.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


class MissingPackage(RuntimeError):
    """Something tiercache needs is not installed; the message says what and how to install it."""


def packaged_file(distribution: str, resource: str, install_hint: str) -> Path:
    """``resource`` (a path inside the installed ``distribution``); ``MissingPackage`` saying ``install_hint`` when the
    distribution is not installed or lacks the file."""
    try:
        found = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as error:
        raise MissingPackage(f"{distribution} is not installed: {install_hint}") from error
    path = Path(str(found.locate_file(resource)))
    if not path.is_file():
        raise MissingPackage(f"{distribution} is installed but {path} is missing: reinstall it ({install_hint})")
    return path
