"""The package's public names (README "Use it from your own code"): each resolves to its module's object."""


def test_every_public_name_resolves_to_its_module_object():
    # the names the README lists are the package's own, loaded lazily from the sub-package
    # that defines them; a name moved without its entry in _WHERE fails here
    import importlib

    import flodl_mpi

    for name in flodl_mpi.__all__:
        if name == "__version__":
            continue
        where = flodl_mpi._WHERE[name]
        assert getattr(flodl_mpi, name) is getattr(importlib.import_module(where), name), name
    assert set(flodl_mpi._WHERE) == set(flodl_mpi.__all__) - {"__version__"}
