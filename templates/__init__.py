"""CuTe DSL kernel templates (rendered per bucket, TP size and arch)."""
