"""``python -m jaxaot``: the jaxaot command line (see :mod:`jaxaot._cli`)."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
