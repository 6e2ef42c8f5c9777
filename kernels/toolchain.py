"""The C++ compiler this machine offers, for every part of splitfuse built on the machine (the CPU
kernels, the launcher's argument shim). No torch import: the launcher uses it too."""

from __future__ import annotations

import os
import shutil


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else g++ or c++ on PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None
