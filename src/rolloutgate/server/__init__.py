from rolloutgate.core._native import compiled_first

# The compiled validate first when `make native` built them from these sources (core/_native.py).
__path__ = compiled_first(__path__)
