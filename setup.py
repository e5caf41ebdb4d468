"""tiercache's packages, discovered: everything else about the build is in pyproject.toml.

Why a setup.py: tiers/, policies/ and configs/ sit at the repository root but install inside the
tiercache namespace (docs/architecture.md), and pyproject's ``packages.find`` cannot remap a folder
into a namespace; a hand-written list forgot packages. So each root is searched here and prefixed.
"""

from __future__ import annotations

from setuptools import find_namespace_packages, find_packages, setup

ROOTS = {"tiercache": "tiercache", "tiercache.tiers": "tiers", "tiercache.policies": "policies"}
"""Package -> folder: every subfolder with an ``__init__.py`` is a subpackage."""
CONFIGS = ("tiercache.configs", "configs")
"""YAML topologies: every subfolder is a package (an ``__init__.py`` or not) shipping its ``*.yaml``."""
NOT_PACKAGES = ["__pycache__", "*.__pycache__"]


def discover() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """The packages, their folders (``package_dir``) and the configs' package data, found on disk."""
    packages: list[str] = []
    for package, folder in ROOTS.items():
        packages += [package] + [f"{package}.{sub}" for sub in find_packages(folder, exclude=NOT_PACKAGES)]
    package, folder = CONFIGS
    configs = [package] + [f"{package}.{sub}" for sub in find_namespace_packages(folder, exclude=NOT_PACKAGES)]
    return packages + configs, {**ROOTS, package: folder}, {name: ["*.yaml"] for name in configs}


packages, package_dir, package_data = discover()
setup(packages=packages, package_dir=package_dir, package_data=package_data)
