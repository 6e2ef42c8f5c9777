"""llama.cpp as a benchmark peer: its tools built by build.sh, and how the harnesses run them."""
