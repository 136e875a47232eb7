"""Kernel files of the templates (CuTe DSL modules; importing one imports cutlass)."""
