"""The instructor's grading pipeline: collect -> autograde -> feedback -> export.

The package stands on its own: it imports nothing of the book (``flashbook.notebooks`` & co.);
the course directory is always given (``--course``, $FLASHBOOK_COURSE, or the CLI's default).

Modules (one job each):
    cellmeta   what nbgrader's cell metadata says (grade id, solution, graded, points)
    markers    the stable ``# flashbook: <grade_id>`` marker every graded cell carries
    record     the result of grading a submission (result.json), shared by every step
    layout     where things live in the course directory (nbgrader layout + results/)
    repair     repair a submitted notebook against the release (metadata, duplicates, deletions)
    collect    LMS downloads / zips / nbgrader layout -> submitted/<student>/<assignment>/
    sandbox    scrubbed environment, resource limits and the sandboxed kernel launcher
    scan       flag tampering: a static scan of the student's own cells (cell, line, what)
    guard      checks out of the student's reach: setup cell, guarded test cells, per-cell tokens
    kernel_guard  the guard's half that runs inside the kernel (loaded there by path, never
               imported by the grader)
    worker     grades one submission (runs in its own process)
    autograde  the batch: shards, workers, time limits, progress bar, resumable results
    merge      combine the results of several shards
    feedback   per-student feedback HTML (the released check cells and their verdicts)
    export     grades CSV and the class summary (histograms)
    gradebook  the grades and messages into nbgrader's gradebook.db (export --nbgrader)
    cli        the ``flashbook collect|autograde|merge|feedback|export`` subcommands
"""
