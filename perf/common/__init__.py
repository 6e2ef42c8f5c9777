"""Shared by every group: the machine and commit for result files, the roofline, the workload, the systems."""
