"""The ``.. exit-code-table::`` directive: the exit statuses of ``flodl_mpi/errors.py`` as a table.

Each ``EXIT_*`` constant of :mod:`flodl_mpi.errors` is a row: its value, its name and the ``#:`` comment
above it (read with Sphinx's own source analyzer), so a new status or a changed meaning appears in the
docs without editing a page.
"""

from __future__ import annotations

from docutils import nodes
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective


def exit_codes() -> list[tuple[int, str, str]]:
    """(value, name, meaning) of every ``EXIT_*`` of flodl_mpi.errors, by value."""
    import flodl_mpi.errors as errors

    notes = ModuleAnalyzer.for_module("flodl_mpi.errors").find_attr_docs()
    rows = []
    for name in dir(errors):
        if name.startswith("EXIT_"):
            doc = " ".join(line.strip() for line in notes.get(("", name), [])).strip()
            rows.append((getattr(errors, name), name, doc))
    return sorted(rows)


class ExitCodeTable(SphinxDirective):
    """A table of flodl_mpi.errors' exit statuses."""

    def run(self):
        table = nodes.table()
        group = nodes.tgroup(cols=3)
        table += group
        for width in (8, 20, 72):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        body = nodes.tbody()
        group += body

        def row(cells, into):
            r = nodes.row()
            for cell in cells:
                entry = nodes.entry()
                entry += cell
                r += entry
            into += r

        row([nodes.paragraph(text=t) for t in ("status", "constant", "meaning")], head)
        for value, name, doc in exit_codes():
            if not doc:
                raise self.error(f"flodl_mpi.errors.{name} has no '#:' comment saying what it means")
            row([nodes.paragraph(text=str(value)), nodes.paragraph("", "", nodes.literal(text=name)),
                 nodes.paragraph(text=doc)], body)
        return [table]


def setup(app):
    app.add_directive("exit-code-table", ExitCodeTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
