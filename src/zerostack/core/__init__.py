"""The bottom layer: what every other part of zerostack may use and which uses none of them.

``progress`` prints the lines a user sees once per job; ``scratch`` holds large short-lived
buffers outside glibc's heap and the pool that reuses them; ``exit`` ends a rank at once and
still removes the files it wrote for itself alone. Nothing here imports another
zerostack package (the import contract in ``pyproject.toml`` holds it there).
"""
