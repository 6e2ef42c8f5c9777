"""Package discovery for the source layout: `splitfuse` is backend/, `splitfuse.kernels` is
kernels/ and the Triton model repository template is model_repository/ (shipped as package data
as `splitfuse.model_repository`, so that an installed, non-editable package renders and serves).
Everything else is in pyproject.toml; this only finds the subpackages, so a new one is never
left out of the wheel."""

from setuptools import find_packages, setup


def under(prefix: str, where: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(where)]


setup(packages=under("splitfuse", "backend") + under("splitfuse.kernels", "kernels") + ["splitfuse.model_repository"])
