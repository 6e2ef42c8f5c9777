"""C++ kernels for CPUs, compiled on the machine (`build.py`), each beside a torch reference
(`splitfuse.kernels.reference`) that its tests compare against. Without a compiler the
library is absent and the engine runs its torch path."""
