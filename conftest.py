"""Collection of the docstring examples of src/verispec (``--doctest-modules``, pyproject's
pytest options): modules that import an optional dependency at module level are left out,
so collecting never needs (or loads) it. Test fixtures live in tests/conftest.py."""

collect_ignore = [
    "src/verispec/server/ray_serve.py",  # imports ray (the [ray] extra) at module level
]
