"""``python -m jaxaot``: the jaxaot command line (see :mod:`jaxaot.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
