"""The bottom layer: what every other part of zerostack may use and which uses none of them.

``progress`` prints the lines a user sees once per job; ``scratch`` holds large short-lived
buffers outside glibc's heap and the pool that reuses them. Nothing here imports another
zerostack package (the import contract in ``pyproject.toml`` holds it there).
"""
