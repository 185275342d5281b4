"""nbgrader configuration for the flashbook course (used by `flashbook release` and grading)."""
c = get_config()  # noqa: F821  (provided by nbgrader)

c.CourseDirectory.root = "."
c.CourseDirectory.course_id = "flashbook"
# Student notebooks are regenerated from solutions/ ; the stub students see in solution cells.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
# The generated notebooks carry no outputs.
c.ClearOutput.enabled = True
# A kernel that loops forever is interrupted after this many seconds per cell.
c.ExecutePreprocessor.timeout = 300
c.ExecutePreprocessor.interrupt_on_timeout = True
