"""``python -m verispec.cli``: the ``verispec`` command."""

from . import main

if __name__ == "__main__":
    main()
