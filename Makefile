# flashbook: `make test` and `make book` do all set-up on a fresh machine (Python 3.11).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Test workers (pytest-xdist): 2 for the 2-core machines of CI and developers; `make test
# WORKERS=auto` takes one per core. pyproject.toml keeps tests that share _build/ on one worker.
WORKERS ?= 2
PYTEST  := $(BIN)/python -m pytest -q -n $(WORKERS)

.PHONY: help env chromium test test-fast aot-memo book book-instructor pdf release bench clean

help:
	@echo "make test             create $(VENV) (pinned toolchain), install chromium if it can, and"
	@echo "                      run the whole test suite in parallel (WORKERS=$(WORKERS))"
	@echo "make book             build the book in CPU mode -> _build/html/index.html"
	@echo "make book-instructor  the same, with solutions shown (do not publish)"
	@echo "make pdf              the book as one PDF (printed by chromium) -> _build/pdf/flashbook.pdf"
	@echo "make release          regenerate notebooks/ from solutions/ (nbgrader)"
	@echo "make test-fast        the suite without notebook execution, book build and browser"
	@echo "make aot-memo         recompile every ahead-of-time compile of the tests into tests/aot_memo"

# torch is installed first and on its own: torch==2.13.0 is the CPU wheel; a looser request
# would pull a multi-GB CUDA build. constraints.txt pins every transitive dependency.
# Downloads are large (torch and triton: about 200 and 290 MB), so a dropped connection is resumed
# (--resume-retries) and a failed install is tried again, up to 3 times; wheels that did arrive
# stay in pip's cache, so a retry only fetches what is missing. The first step runs the venv's
# bundled pip, which predates --resume-retries; it fetches only pip itself.
PIP_INSTALL := $(BIN)/python -m pip install -qq --retries 10 --timeout 60 --resume-retries 50
define retry3
for attempt in 1 2 3; do \
  $(1) && break; \
  if [ $$attempt = 3 ]; then echo "make: pip install failed 3 times"; exit 1; fi; \
  echo "make: install failed (attempt $$attempt of 3), retrying in 20 s"; sleep 20; \
done
endef

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	@$(call retry3,$(BIN)/python -m pip install -qq --retries 10 --upgrade pip -c constraints.txt)
	@$(call retry3,$(PIP_INSTALL) torch==2.13.0 -c constraints.txt)
	@$(call retry3,$(PIP_INSTALL) -e ".[dev]" -c constraints.txt)
	touch $(STAMP)

env: $(STAMP)

# tests/test_browser.py drives Debian's chromium (never a downloaded browser build). Installed
# here when it is missing and we may (root, or sudo without a password); otherwise one line says
# how, and the browser tests skip, giving the same command as their reason.
CHROMIUM_HINT := chromium is not installed, so the browser tests will be skipped; to run them: sudo apt-get install -y chromium

chromium:
	@if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "$(CHROMIUM_HINT)"; exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then echo "$(CHROMIUM_HINT)"; exit 0; fi; \
	echo "installing Debian's chromium for the browser tests: apt-get install chromium"; \
	log=$$( { $$SUDO apt-get update -qq && \
	          $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } 2>&1 ) \
	  || { echo "$$log"; echo "make: installing chromium failed"; exit 1; }

test: $(STAMP) chromium
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# tests/aot_memo/ holds what the ahead-of-time compiles gave (tests/aot_compile.py); `make test`
# refreshes the memos of the compiles whose files changed, this rebuilds the directory from
# nothing, dropping the memos of compile scripts that no test runs any more.
aot-memo: $(STAMP)
	rm -rf tests/aot_memo
	$(PYTEST) -k "compile" tests

book: $(STAMP)
	$(BIN)/flashbook book

book-instructor: $(STAMP)
	$(BIN)/flashbook book --instructor

# The printable edition: the book as one HTML page (Sphinx's singlehtml builder), printed by
# Debian's chromium through Playwright.
pdf: $(STAMP) chromium
	$(BIN)/flashbook pdf

release: $(STAMP)
	$(BIN)/flashbook release

clean:
	rm -rf _build
