"""Classes named by module path (``package.module:Class``): how a topology reaches tiers and policies outside tiercache.

The tier and policy registries (``tiercache.tiers.TIER_TYPES``,
``tiercache.policies.POLICIES``) map a short name to such a path; a topology
may also give the path itself (``type: mypkg.tiers:S3Tier``, ``policy:
mypkg.policies:Mine``). ``load_class`` imports it and checks that it is a
subclass of what the caller needs, so a wrong path fails when the topology is
loaded, with what went wrong, never later inside the engine.
"""

from __future__ import annotations

import importlib
import re

SEPARATOR = ":"
"""Between the module and the class in a module path."""
MODULE_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
"""``package.module:Class``: dotted identifiers, one colon, an identifier."""


class PluginError(LookupError):
    """A module path that does not name a usable class: the reason, in words."""


def is_module_path(name: str) -> bool:
    """Whether ``name`` has the shape of a module path (``package.module:Class``) rather than a registered name."""
    return SEPARATOR in name


def class_name(path: str) -> str:
    """The class part of a module path (``S3Tier`` of ``mypkg.tiers:S3Tier``)."""
    return path.rpartition(SEPARATOR)[2]


def load_class(path: str, base: type) -> type:
    """The class ``path`` names, which must be a subclass of ``base``; ``PluginError`` saying why not.

    Importing the module runs its code: any exception it raises is reported as
    the reason (a plug-in with a bug is a configuration error, not a crash).
    """
    if not MODULE_PATH.match(path):
        raise PluginError(f"{path!r} is not a module path of the form package.module:Class")
    module_name, _, name = path.partition(SEPARATOR)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # whatever a plug-in's import raises is the reason to report
        raise PluginError(f"module {module_name!r} could not be imported ({type(error).__name__}: {error})") from None
    found = getattr(module, name, None)
    if found is None:
        raise PluginError(f"module {module_name!r} has no attribute {name!r}")
    if not isinstance(found, type) or not issubclass(found, base):
        raise PluginError(f"{path} is not a subclass of {base.__module__}.{base.__qualname__}")
    if getattr(found, "__abstractmethods__", None):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise PluginError(f"{path} does not implement {missing} (abstract in {base.__qualname__})")
    return found


def find_class(name: str, registry: dict[str, str], base: type) -> type:
    """The class registered under ``name`` in ``registry`` (``KeyError`` if unknown), or the subclass of
    ``base`` a module path names (``PluginError`` if it does not)."""
    if is_module_path(name):
        return load_class(name, base)
    module_name, _, attribute = registry[name].partition(SEPARATOR)
    return getattr(importlib.import_module(module_name), attribute)
