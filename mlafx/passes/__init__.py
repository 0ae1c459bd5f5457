"""Graph rewrites: find MLA attention, absorb weights, lower to the kernels' ops.

Filled by the compiler issue (one pass per file, one explicit pipeline list).
"""
