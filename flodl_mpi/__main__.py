"""``python -m flodl_mpi`` is the ``flodl-mpi`` command."""

from flodl_mpi.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
