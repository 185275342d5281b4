# flashbook: `make test` and `make book` do all set-up on a fresh machine (Python 3.11).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: help env test test-fast book book-instructor release bench clean

help:
	@echo "make test             create $(VENV) (pinned toolchain) and run the whole test suite"
	@echo "make book             build the book in CPU mode -> _build/html/index.html"
	@echo "make book-instructor  the same, with solutions shown (do not publish)"
	@echo "make release          regenerate notebooks/ from solutions/ (nbgrader)"
	@echo "make test-fast        the suite without notebook execution, book build and browser"

# torch is installed first and on its own: torch==2.13.0 is the CPU wheel; a looser request
# would pull a multi-GB CUDA build. constraints.txt pins every transitive dependency.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip
	$(BIN)/python -m pip install -qq torch==2.13.0 -c constraints.txt
	$(BIN)/python -m pip install -qq -e ".[dev]" -c constraints.txt
	touch $(STAMP)

env: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

book: $(STAMP)
	$(BIN)/flashbook book

book-instructor: $(STAMP)
	$(BIN)/flashbook book --instructor

release: $(STAMP)
	$(BIN)/flashbook release

clean:
	rm -rf _build
