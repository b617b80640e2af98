"""Runs that outlive the kernel: a detached launch, its run directory, attaching to it
(its modules: docs/architecture.md)."""
