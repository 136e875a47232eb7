"""Compiler passes, one per file (see k3compile/pipeline.py for their order)."""
